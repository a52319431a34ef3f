"""Optimizer tests run single-threaded: their GEMMs are tiny, and on the shared 2-core machine
OpenMP threads spin against other workers' processes."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def _single_thread() -> None:
    torch.set_num_threads(1)
