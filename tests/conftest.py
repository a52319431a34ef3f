"""Shared test setup: deterministic CPU defaults, the `gpu` / `te` markers' skip rules, and one
session-wide data cache."""

from __future__ import annotations

import os
import shutil
import tempfile

# The suite never writes into the user's cache (``$LPTRAIN_CACHE_DIR``, ``$XDG_CACHE_HOME`` or
# ``~/.cache/lptrain``): every built-in corpus a test prepares goes into one temporary cache for
# the whole session. The process that loads this file first (pytest, or xdist's controller)
# creates it; xdist workers and the CLI runs tests start inherit it through the environment.
# Built-in datasets are content-addressed and prepared under a lock, so sharing is safe.
_SESSION_CACHE = "LPTRAIN_TEST_SESSION_CACHE"
_CACHE_OWNER = "LPTRAIN_TEST_SESSION_CACHE_OWNER"
if not os.environ.get(_SESSION_CACHE):
    os.environ[_SESSION_CACHE] = tempfile.mkdtemp(prefix="lptrain-test-cache-")
    os.environ[_CACHE_OWNER] = str(os.getpid())
os.environ["LPTRAIN_CACHE_DIR"] = os.environ[_SESSION_CACHE]

# Under pytest-xdist (``make test`` runs two workers on the 2-core CI machine) each worker gets
# an equal share of the cores, and so do the CLI runs it starts as subprocesses: two workers
# each spinning two OpenMP threads on two cores made single-process tests 2-5x slower.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
# Always pinned: a run otherwise picks its threads from the CPUs free at its start
# (lptrain.distributed.threads), which would make a test's speed and notes depend on the load.
_THREADS = 2 if _WORKERS <= 1 else max(1, (os.cpu_count() or 2) // _WORKERS)
os.environ.setdefault("OMP_NUM_THREADS", str(_THREADS))

import pytest  # noqa: E402
import torch  # noqa: E402


def _te_importable() -> bool:
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception:
        return False
    return True


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """``gpu``: needs a CUDA device; ``te``: needs Transformer Engine (on a CUDA device)."""
    cuda = torch.cuda.is_available()
    te = cuda and _te_importable()
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    skip_te = pytest.mark.skip(reason="needs CUDA and Transformer Engine")
    for item in items:
        if item.get_closest_marker("te") is not None and not te:
            item.add_marker(skip_te)
        elif item.get_closest_marker("gpu") is not None and not cuda:
            item.add_marker(skip_gpu)


@pytest.fixture(autouse=True)
def _cpu_defaults() -> None:
    # Subnormal fp32 scales (2^-127) must survive: never flush denormals.
    torch.set_flush_denormal(False)
    torch.set_num_threads(_THREADS)


def pytest_unconfigure(config: pytest.Config) -> None:
    """The process that created the session cache removes it at the end."""
    if os.environ.get(_CACHE_OWNER) == str(os.getpid()):
        shutil.rmtree(os.environ[_SESSION_CACHE], ignore_errors=True)
