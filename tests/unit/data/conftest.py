"""Fixtures for the data-pipeline tests."""

from __future__ import annotations

import pytest


@pytest.fixture
def text_docs() -> list[str]:
    return [
        "def f(x):\n    return x + 1\n",
        "Grüße aus Köln — ünïcødé ✓ 日本語 🚀\n",
        "plain ascii line\nsecond line\n",
        "tabs\tand\r\nCRLF\r\n",
    ]
