# One idempotent install step shared by `make run` and `make test`.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.lptrain-installed

.PHONY: install run test lint bench gpu-check clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	# CPU torch from local disk on a fresh machine; an existing torch (e.g. a GPU build) is kept.
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install torch==2.13.0
	$(BIN)/pip install -e ".[dev]"
	touch $(STAMP)

install: $(STAMP)

run: install
	$(BIN)/lptrain pretrain --recipe tiny_cpu.yaml --overwrite

test: install
	$(BIN)/python -m pytest -q

lint: install
	$(BIN)/ruff check lptrain tests bench

bench: install
	$(BIN)/python bench/quantize.py
	$(BIN)/python bench/model_step.py
	$(BIN)/python bench/data.py
	$(BIN)/python bench/hf_export.py
	$(BIN)/python bench/muon_vs_adamw.py

# On a machine with a CUDA GPU and a CUDA torch (>= 2.11) already installed: no venv (its CPU
# torch would shadow the GPU build), lptrain from this checkout. With OUT set (an environment
# variable or OUT=dir) the results are written to $(OUT)/gpu_check.json. See scripts/gpu_check.py.
gpu-check:
	PYTHONPATH=$(CURDIR) $(PY) scripts/gpu_check.py $(if $(OUT),--out $(OUT))

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
