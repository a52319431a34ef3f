"""The emulated grouped-tensor kernels (lptrain.testing.te_python.kernels.grouped) under TE's
own Python (newest release): a single grouped MXFP8 expert weight (``GroupedTensor``, TE's
native grouped-tensor path: ``group_quantize`` + ``te_general_grouped_gemm_for_grouped_tensor``)
computes bitwise what TE's discrete-weight ``GroupedLinear`` computes from the same init values
(its per-member quantize + ``te_general_grouped_gemm``, an independent emulation) -- forward,
data gradient and weight gradient. Bitwise because both paths quantize each member alone with
the same MXFP8 cast and form each member's product in fp32 from the same dequantized operands.

The check can fail: with the grouped GEMM reading the wrong member, or the wrong copy of an
MXFP8 operand (column-wise for row-wise: other 32-element blocks, other scales), the outputs
differ.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from lptrain.precision import te_adapter
from lptrain.testing.fake_gpu import virtual_gpu
from lptrain.testing.te_python.kernels import grouped as K

N, OUT, IN = 4, 128, 64
SPLITS = [128, 256, 0, 128]  # an expert without tokens; rows padded to 128 (see test_te_findings)


def _spread(t: torch.Tensor) -> torch.Tensor:
    """Rows of magnitudes 1..64: a 32-row (column-wise) MXFP8 block then has another scale
    than the 32-column (row-wise) blocks, so the two copies of an operand differ (with
    Gaussian values alone nearly every block's amax falls in the same binade)."""
    return t * (2.0 ** (torch.arange(t.shape[0]) % 7)).unsqueeze(1)


def _init() -> Callable[[torch.Tensor], None]:
    g = torch.Generator().manual_seed(11)

    def init(w: torch.Tensor) -> None:
        with torch.no_grad():
            w.copy_(_spread(torch.randn(tuple(w.shape), generator=g)).to(w.dtype))

    return init


def _run(single: bool) -> dict[str, torch.Tensor]:
    """Forward and backward of a GroupedLinear (``single``: one grouped weight) on fixed input."""
    import transformer_engine.common.recipe as ter

    recipe = ter.MXFP8BlockScaling(fp8_format=ter.Format.E4M3)
    with te_adapter.te_model_init(recipe):
        m = te_adapter.te_grouped_linear(N, IN, OUT, single_grouped_weight=single,
                                         params_dtype=torch.bfloat16, init_method=_init())
    g = torch.Generator().manual_seed(5)
    x = _spread(torch.randn(sum(SPLITS), IN, generator=g)).to(torch.bfloat16).to("cuda").requires_grad_()
    dy = _spread(torch.randn(sum(SPLITS), OUT, generator=g)).to(torch.bfloat16).to("cuda")
    with te_adapter.te_autocast(recipe):
        y = m(x, SPLITS)
    y.backward(dy)
    weights = [m.weight] if single else [getattr(m, f"weight{i}") for i in range(N)]
    wgrad = torch.cat([w.grad.float().reshape(-1) for w in weights])
    return {"y": y.detach().float().cpu(), "dx": x.grad.float().cpu(), "dw": wgrad.cpu()}


@pytest.fixture(scope="module")
def discrete() -> dict[str, torch.Tensor]:
    with virtual_gpu("sm100", te=True):
        return _run(single=False)


def _single() -> dict[str, torch.Tensor]:
    calls: list[int] = []
    gemm = K.te_general_grouped_gemm_for_grouped_tensor

    def counted(*a: Any, **k: Any) -> Any:
        calls.append(1)
        return gemm(*a, **k)

    with virtual_gpu("sm100", te=True), pytest.MonkeyPatch.context() as mp:
        import transformer_engine_torch as tex

        mp.setattr(tex, "te_general_grouped_gemm_for_grouped_tensor", counted)
        out = _run(single=True)
    assert len(calls) == 3, calls  # forward, data gradient, weight gradient: the native path ran
    return out


def test_single_grouped_weight_is_bitwise_the_discrete_weights(discrete: dict[str, torch.Tensor]) -> None:
    single = _single()
    assert discrete["y"][128:384].abs().sum() > 0 and discrete["dw"].abs().sum() > 0
    for k in ("y", "dx", "dw"):
        assert torch.equal(single[k], discrete[k]), k


@pytest.mark.parametrize("fault", ["member", "copy"])
def test_a_wrong_grouped_gemm_is_caught(fault: str, discrete: dict[str, torch.Tensor],
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """The comparison above fails with the grouped GEMM reading the neighbouring member, or
    the other (column-wise / row-wise) copy of an MXFP8 operand."""
    read = K.member_values

    def wrong(g: Any, i: int, rowwise: bool, lay: Any = None) -> torch.Tensor:
        if fault == "member":
            j = (i + 1) % int(g.num_tensors)
            if K.member_shapes(g)[j] == K.member_shapes(g)[i]:
                i = j
            return read(g, i, rowwise, lay)
        both = g.quantizer is not None and g.columnwise_data is not None and g.rowwise_data is not None
        return read(g, i, not rowwise if both else rowwise, lay)

    monkeypatch.setattr(K, "member_values", wrong)
    single = _single()
    assert any(not torch.equal(single[k], discrete[k]) for k in ("y", "dx", "dw"))
