"""Multi-process tests: skipped where torch.distributed or its gloo backend is missing.

The ranks are spawned by ``lptrain.testing.dist.run_distributed`` (one torch thread each);
the parent process does little work, so it keeps the suite-wide CPU defaults.
"""

from __future__ import annotations

import pytest
import torch.distributed as dist


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if dist.is_available() and dist.is_gloo_available():
        return
    skip = pytest.mark.skip(reason="needs torch.distributed with the gloo backend")
    for item in items:
        if "dist" in item.keywords:
            item.add_marker(skip)
