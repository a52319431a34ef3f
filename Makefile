# One idempotent install step shared by `make run` and `make test`.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.lptrain-installed

.PHONY: install te-python run test lint bench gpu-check wheelhouse clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	# CPU torch from local disk on a fresh machine; an existing torch (e.g. a GPU build) is kept.
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install torch==2.13.0
	$(BIN)/pip install -e ".[dev]"
	touch $(STAMP)

# Transformer Engine's own Python layer (its pure-Python wheel, ~1 MB a release, plus einops,
# its one pure-Python dependency the venv lacks) for the TE backend's tests and the dry run on a
# CPU (lptrain/testing/te_python: only TE's kernels are emulated). Each release goes into its own
# git-ignored folder with `pip install --no-deps --target`, never into the venv's site-packages,
# so a real TE on a GPU machine is never shadowed; a folder already there is kept.
TE_PYTHON_VERSIONS := 2.8.0 2.12.0 2.14.1 2.18.0 2.19.0 2.20.2
TE_PYTHON_DIR := .te-python

te-python: $(STAMP)
	@for v in $(TE_PYTHON_VERSIONS); do \
	  test -d $(TE_PYTHON_DIR)/$$v/transformer_engine-$$v.dist-info && continue; \
	  echo "TE $$v's Python -> $(TE_PYTHON_DIR)/$$v"; \
	  rm -rf $(TE_PYTHON_DIR)/$$v.partial && \
	  $(BIN)/pip install -q --no-deps --target $(TE_PYTHON_DIR)/$$v.partial transformer-engine==$$v einops==0.8.2 && \
	  rm -rf $(TE_PYTHON_DIR)/$$v && mv $(TE_PYTHON_DIR)/$$v.partial $(TE_PYTHON_DIR)/$$v || exit 1; \
	done

install: $(STAMP) te-python

run: install
	$(BIN)/lptrain pretrain --recipe tiny_cpu.yaml --overwrite

# Two pytest-xdist workers by default (CI has 2 cores); TEST_WORKERS=0 runs in one process.
# loadscope keeps a module on one worker, so its module-scoped fixtures (multi-rank batteries
# of 10-180 s) are built once, not once per worker that took one of its tests; in collection
# order (--no-loadscope-reorder), so tests/dist's long batteries start first and the many short
# unit tests fill the end (ordered by test count, the batteries came last: a 3-minute tail).
TEST_WORKERS ?= 2

# Bytecode is written (PYTHONDONTWRITEBYTECODE cleared): the suite starts a few hundred
# processes (ranks, CLI subprocesses) that would each compile lptrain from source again, and each
# worker would re-run pytest's assertion rewriting of every test module.
test: install
	PYTHONDONTWRITEBYTECODE= $(BIN)/python -m compileall -q -j 2 lptrain tests
	PYTHONDONTWRITEBYTECODE= $(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadscope --no-loadscope-reorder

lint: install
	$(BIN)/ruff check lptrain tests bench

# Every bench under bench/ (about 55 minutes on 2 shared cores, half of it optim_state's 11 runs: each measurement repeats until
# its medians are tight or its time cap is reached; see README "Benchmarks"). A FAIL or
# REGRESSED does not stop the others.
BENCHES := quantize model_step train_step host_overhead ddp tp pp cp optim moe data hf_export muon_vs_adamw optim_state checkpoint memory numerics threads

bench: install
	@for b in $(BENCHES); do echo "== bench/$$b.py"; $(BIN)/python bench/$$b.py || echo "bench/$$b.py exited $$?"; done

# On a machine with a CUDA GPU and a CUDA torch (>= 2.11) already installed: no venv (its CPU
# torch would shadow the GPU build), lptrain from this checkout. With OUT set (an environment
# variable or OUT=dir) the results are written to $(OUT)/gpu_check.json. See scripts/gpu_check.py.
# Offline node: WHEELHOUSE=dir (from `make wheelhouse`) first installs the other dependencies
# from it alone into GPU_DEPS (never into site-packages: the node's torch stays the one used),
# then runs with PYTHONPATH=checkout:GPU_DEPS. A PYTHONPATH the node sets (a module system's
# torch) is kept, after those two.
WHEELHOUSE ?=
GPU_DEPS ?= .gpu-deps

gpu-check:
ifneq ($(WHEELHOUSE),)
	$(PY) scripts/wheelhouse.py install --wheelhouse $(WHEELHOUSE) --target $(GPU_DEPS)
endif
	PYTHONPATH=$(CURDIR)$(if $(WHEELHOUSE),:$(abspath $(GPU_DEPS)))$${PYTHONPATH:+:$$PYTHONPATH} \
	  $(PY) scripts/gpu_check.py $(if $(OUT),--out $(OUT))

# Where the network is, for a GPU node without it: every wheel lptrain and `make gpu-check` need
# except torch (and the nvidia-*/triton wheels a CUDA torch brings), into wheelhouse/, for the
# node's Python and platform (default: this machine's), e.g.
#   make wheelhouse PYTHON_VERSION=3.12 PLATFORM=manylinux_2_28_x86_64
# (PLATFORM: the node's glibc, `ldd --version`; older manylinux wheels are accepted too).
PYTHON_VERSION ?=
PLATFORM ?=

wheelhouse:
	$(PY) scripts/wheelhouse.py download --dest wheelhouse \
	  $(if $(PYTHON_VERSION),--python-version $(PYTHON_VERSION)) $(if $(PLATFORM),--platform $(PLATFORM))

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache $(GPU_DEPS) $(TE_PYTHON_DIR)
