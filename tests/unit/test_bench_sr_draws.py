"""bench/sr_draws.py: the NVFP4 SR draws recorded from a quantization and replayed alone.

The split line of bench/quantize.py reads the replay's time as the quantizer's draw time;
that holds only if the replay makes exactly the quantizer's draws. These check it on an
operand that takes several chunks per orientation, with no timing asserted."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import sr_draws

from lptrain.precision import recipes as R
from lptrain.precision.tensors import nvfp4

SHAPE = (1024, 512)  # two 2^18-element chunks per orientation: four draws


def _grad_quantizer() -> object:
    return R.NVFP4Scaling().make_quantizer("grad", True, True)


def test_record_sees_one_byte_per_element_per_orientation() -> None:
    q = _grad_quantizer()
    x = torch.randn(*SHAPE)
    sizes = sr_draws.record_draws(lambda: q.quantize(x))
    assert len(sizes) == 4
    assert sum(sizes) == 2 * x.numel()


def test_replay_makes_the_quantizers_draws(monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(0)
    q = _grad_quantizer()
    x = torch.randn(*SHAPE)
    before = q.generator.get_state()
    seen: list[torch.Tensor] = []
    inner = nvfp4.draw_rbits

    def capture(n: int, *a: object, **k: object) -> torch.Tensor:
        out = inner(n, *a, **k)
        seen.append(out.clone())
        return out

    monkeypatch.setattr(nvfp4, "draw_rbits", capture)  # the bytes the quantizer consumed
    sizes = sr_draws.record_draws(lambda: q.quantize(x))
    monkeypatch.undo()
    after = q.generator.get_state()
    g = torch.Generator()
    g.set_state(before)
    for n, got in zip(sizes, seen, strict=True):
        assert torch.equal(sr_draws.replay_draws([n], g), got)
    assert torch.equal(g.get_state(), after)
    # the check can fail: one draw short leaves the generator elsewhere
    g.set_state(before)
    sr_draws.replay_draws(sizes[:-1], g)
    assert not torch.equal(g.get_state(), after)


def test_record_restores_the_seam_on_error() -> None:
    inner = nvfp4.draw_rbits

    def boom() -> None:
        raise RuntimeError("quantize failed")

    with pytest.raises(RuntimeError):
        sr_draws.record_draws(boom)
    assert nvfp4.draw_rbits is inner


def test_split_line_names_every_part() -> None:
    import quantize

    line = quantize.nvfp4_sr_split(torch.randn(*SHAPE), n_rounds=1)
    for part in ("quantize", "SR draws alone", "4 draws", "dequantize rowwise", "columnwise"):
        assert part in line
