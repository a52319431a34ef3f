"""Shared test setup: deterministic CPU defaults and the `gpu` marker's skip rule."""

from __future__ import annotations

import pytest
import torch


def _gpu_available() -> bool:
    if not torch.cuda.is_available():
        return False
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception:
        return False
    return True


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _gpu_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA and Transformer Engine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _cpu_defaults() -> None:
    # Subnormal fp32 scales (2^-127) must survive: never flush denormals.
    torch.set_flush_denormal(False)
    torch.set_num_threads(2)
