"""Delayed scaling: quantize with last step's scale, record amax, update rule (numerics.md 2.1)."""

from __future__ import annotations

import math

import pytest
import torch

from lptrain.precision import E4M3, E5M2, DelayedScaling, DelayedScalingState, quantize
from lptrain.precision.formats import FLT_MAX
from lptrain.precision.scaling import fp32_value

INF = float("inf")


def run(recipe: DelayedScaling, amaxes: list[float], role: str = "input") -> tuple[list[float], DelayedScalingState]:
    """Feed one tensor per step whose amax is given; return the scale after each update."""
    st = recipe.make_state(role)  # type: ignore[arg-type]
    q = recipe.make_quantizer(role, state=st)  # type: ignore[arg-type]
    scales = []
    for a in amaxes:
        q.quantize(torch.tensor([a, -a / 2, 0.0], dtype=torch.float32))
        recipe.update([st])
        scales.append(st.scale.item())
    return scales, st


def test_history_roll_and_max_vs_most_recent() -> None:
    seq = [2.0, 1.0, 0.0, 4.0, 1.0, 1.0, 1.0, 1.0]
    mx, st = run(DelayedScaling(amax_history_len=4, amax_compute_algo="max"), seq)
    # step 3 (amax 0): nothing rolls, scale kept; the 4 seen at step 4 stays in the window for
    # the next three updates (L = 4 with slot 0 as the accumulator), then drops out.
    assert mx == [224.0, 224.0, 224.0, 112.0, 112.0, 112.0, 112.0, 448.0]
    assert st.amax_history.tolist() == [0.0, 1.0, 1.0, 1.0]
    mr, _ = run(DelayedScaling(amax_history_len=4, amax_compute_algo="most_recent"), seq)
    assert mr == [224.0, 448.0, 448.0, 112.0, 448.0, 448.0, 448.0, 448.0]


def test_history_contents_after_each_update() -> None:
    r = DelayedScaling(amax_history_len=4)
    st = r.make_state("input")
    st.amax_history[0] = 2.0
    r.update([st])
    assert st.amax_history.tolist() == [0.0, 0.0, 0.0, 2.0]
    st.amax_history[0] = 1.0
    r.update([st])
    assert st.amax_history.tolist() == [0.0, 0.0, 2.0, 1.0]
    r.update([st])  # zero amax: no roll
    assert st.amax_history.tolist() == [0.0, 0.0, 2.0, 1.0]


def test_first_step_uses_scale_one_and_records_amax() -> None:
    r = DelayedScaling(amax_history_len=3)
    st = r.make_state("input")
    x = torch.tensor([3.0, -500.0, 0.1])
    qt = quantize(x, r, state=st)
    assert qt.storage_views()["scale_inv"].item() == 1.0
    assert torch.equal(qt.dequantize(), torch.tensor([3.0, -448.0, 0.1015625]))  # scale 1, saturated
    assert st.amax_history.tolist() == [500.0, 0.0, 0.0]
    quantize(torch.tensor([7.0]), r, state=st)  # a second quantization in the same step: max
    assert st.amax_history[0].item() == 500.0


def test_margin_and_hybrid_grad_format() -> None:
    scales, _ = run(DelayedScaling(margin=1, amax_history_len=1), [2.0])
    assert scales == [112.0]  # fp32(448 * 2^-1) / 2
    gs, st = run(DelayedScaling(amax_history_len=1), [2.0], role="grad")
    assert st.fp8_format is E5M2 and gs == [28672.0]
    es, st = run(DelayedScaling(amax_history_len=1, fp8_format="e4m3"), [2.0], role="grad")
    assert st.fp8_format is E4M3 and es == [224.0]


def test_inf_amax_freezes_scale_while_in_window() -> None:
    seq = [2.0, INF, 1.0, 1.0, 1.0]
    mx, _ = run(DelayedScaling(amax_history_len=3), seq)
    # inf is recorded and rolled, the scale is kept while inf is in the window (2 updates).
    assert mx == [224.0, 224.0, 224.0, 224.0, 448.0]
    mr, _ = run(DelayedScaling(amax_history_len=3, amax_compute_algo="most_recent"), seq)
    assert mr == [224.0, 224.0, 448.0, 448.0, 448.0]


def test_scale_overflow_capped_at_flt_max() -> None:
    tiny = torch.tensor([1e-45])  # 448 / 1.4e-45 overflows fp32
    scales, _ = run(DelayedScaling(amax_history_len=1), [tiny.item()])
    assert scales == [FLT_MAX]


def test_length_one_history() -> None:
    scales, st = run(DelayedScaling(amax_history_len=1), [2.0, 0.0, 8.0])
    assert scales == [224.0, 224.0, 56.0]
    assert st.amax_history.tolist() == [0.0]


def test_amax_reduction_hook() -> None:
    r = DelayedScaling(amax_history_len=2)
    a, b = r.make_state("input"), r.make_state("weight")
    a.amax_history[0], b.amax_history[0] = 2.0, 4.0
    seen = []

    def allreduce_max(t: torch.Tensor) -> torch.Tensor:
        seen.append(t.clone())
        return torch.maximum(t, torch.tensor([7.0, 1.0]))  # "other rank" amaxes

    r.update([a, b], amax_reduction=allreduce_max)
    assert seen[0].tolist() == [2.0, 4.0]  # packed in slot order
    assert a.scale.item() == 64.0 and b.scale.item() == 112.0
    assert a.amax_history.tolist() == [0.0, 7.0]
    # reduce_amax=False ignores the hook
    r2 = DelayedScaling(amax_history_len=2, reduce_amax=False)
    c = r2.make_state("input")
    c.amax_history[0] = 2.0
    r2.update([c], amax_reduction=allreduce_max)
    assert c.scale.item() == 224.0


def test_non_pow2_scale_scale_inv_is_fp32_reciprocal() -> None:
    r = DelayedScaling(amax_history_len=1)
    st = r.make_state("input")
    st.amax_history[0] = 3.0
    r.update([st])
    s = st.scale
    assert torch.equal(s, torch.tensor([448.0]) / torch.tensor([3.0]))
    qt = quantize(torch.tensor([1.0]), r, state=st)
    assert torch.equal(qt.storage_views()["scale_inv"], torch.reciprocal(s))


def test_quantize_api_requires_state() -> None:
    with pytest.raises(ValueError, match="state"):
        quantize(torch.ones(4), "delayed")


def _reference_update(st: DelayedScalingState, margin: float, algo: str, reduced_amax: torch.Tensor | None) -> None:
    """The update rule written branch by branch, one slot at a time, with host floats
    (numerics.md 2.1): what the batched ``update_slots`` must reproduce bit for bit."""
    hist = st.amax_history
    last = hist[0].clone()
    if reduced_amax is not None and float(reduced_amax) != 0.0:
        last = reduced_amax.reshape(()).float().clone()
    if float(last) == 0.0:
        return
    if hist.numel() == 1:
        window = last
        hist[0] = 0.0
    else:
        window = torch.maximum(hist[1:].amax(), last)
        rolled = torch.roll(hist, -1)
        rolled[0] = 0.0
        rolled[-1] = last
        hist.copy_(rolled)
    a = float(window if algo == "max" else last)
    if not math.isfinite(a) or a <= 0.0:
        return
    scaled_max = fp32_value(st.fp8_format.max * fp32_value(2.0 ** (-margin)))
    s = fp32_value(scaled_max / a)
    st.scale.fill_(FLT_MAX if math.isinf(s) else s)


@pytest.mark.parametrize("length", [1, 2, 4, 16])
@pytest.mark.parametrize("algo", ["max", "most_recent"])
@pytest.mark.parametrize("margin", [0.0, 2.0])
@pytest.mark.parametrize("reduce", [False, True])
def test_batched_update_is_the_per_slot_rule_bit_for_bit(length: int, algo: str, margin: float, reduce: bool) -> None:
    """``DelayedScaling.update`` updates all slots in one batch (``update_slots``), equal to
    the per-slot reference rule bit for bit; every branch of that rule is hit: zero amax (no roll), NaN / inf in the history or as
    the current amax, amaxes so small the scale overflows to FLT_MAX, mixed formats."""
    from lptrain.precision.delayed_scaling import update_slots

    g = torch.Generator().manual_seed(length * 7 + int(margin))
    specials = torch.tensor([0.0, float("nan"), INF, 1e-38, 1e-45, 3.0, 448.0, 6e4])
    batch, single = [], []
    for i in range(24):
        fmt = E4M3 if i % 3 else E5M2
        hist = torch.rand(length, generator=g) * 10.0 ** torch.randint(-6, 6, (1,), generator=g).item()
        picks = torch.randint(0, len(specials) * 4, (length,), generator=g)  # ~1 in 4 special
        for j, p in enumerate(picks.tolist()):
            if p < len(specials):
                hist[j] = specials[p]
        if i % 5 == 0:
            hist[0] = 0.0  # nothing recorded this step
        a, b = DelayedScalingState(length, fmt), DelayedScalingState(length, fmt)
        a.amax_history.copy_(hist)
        b.amax_history.copy_(hist)
        a.scale.fill_(0.5 + i)
        b.scale.fill_(0.5 + i)
        batch.append(a)
        single.append(b)
    reduced = None
    if reduce:
        reduced = torch.stack([s.amax_history[0] for s in batch]) * 2.0
        reduced[::4] = 0.0  # a zero reduced amax falls back to the local one
        reduced[1] = float("nan")
    update_slots(batch, margin, algo, reduced)
    for i, st in enumerate(single):
        _reference_update(st, margin, algo, None if reduced is None else reduced[i])
    for a, b in zip(batch, single, strict=True):
        assert torch.equal(a.amax_history.view(torch.int32), b.amax_history.view(torch.int32))
        assert torch.equal(a.scale.view(torch.int32), b.scale.view(torch.int32))
    assert any(not torch.equal(a.scale, torch.full((1,), 0.5 + i)) for i, a in enumerate(batch))  # scales moved


def test_update_groups_slots_by_history_length() -> None:
    r = DelayedScaling(amax_history_len=4)
    short, long_ = DelayedScalingState(1, E4M3), DelayedScalingState(4, E4M3)
    for st in (short, long_):
        st.amax_history[0] = 2.0
    r.update([short, long_])
    assert short.scale.item() == 224.0 and long_.scale.item() == 224.0
    assert short.amax_history.tolist() == [0.0]
    assert long_.amax_history.tolist() == [0.0, 0.0, 0.0, 2.0]
