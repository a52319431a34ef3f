"""``bucket_group._first_nonfinite``: the index sharded grads' NaN check keeps before release.

On the CPU a finite bucket sum skips the search (a sum is finite only if every element is);
a non-finite sum runs it, which also covers finite grads whose fp32 sum overflowed (-1).
"""

from __future__ import annotations

import pytest
import torch

from lptrain.distributed.bucket_group import _first_nonfinite


def _index(view: torch.Tensor) -> int:
    out = _first_nonfinite(view, view.sum(dtype=torch.float32))
    assert out.dtype == torch.int64 and out.dim() == 0
    return int(out)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_the_first_bad_element_is_found(bad: float) -> None:
    v = torch.randn(1000)
    v[700], v[321] = bad, bad
    assert _index(v) == 321


def test_finite_grads_give_minus_one_with_or_without_an_overflowing_sum() -> None:
    assert _index(torch.randn(1000)) == -1
    big = torch.full((16,), 3e38)
    assert not torch.isfinite(big.sum()) and _index(big) == -1  # the search ran: still -1


def test_a_finite_sum_skips_the_search(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    real = torch.isfinite

    def spy(t: torch.Tensor) -> torch.Tensor:
        calls.append(t.numel())
        return real(t)

    monkeypatch.setattr(torch, "isfinite", spy)
    assert _index(torch.randn(1000)) == -1
    assert calls == [1]  # only the sum was asked, not the 1000 elements
