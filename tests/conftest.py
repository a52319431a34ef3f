"""Shared test setup: deterministic CPU defaults and the `gpu` / `te` markers' skip rules."""

from __future__ import annotations

import pytest
import torch


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
    torch.set_num_threads(2)
