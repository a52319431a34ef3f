"""The precision-aware optimizer in lptrain's engine, one process: who holds the masters, the
remainders' claim, Transformer Engine's FusedAdam called Megatron's way, the derived keys.

The math of each stored format against an independent reference is
``test_fused_adam_emulation.py``; every parallel layout is ``tests/dist/
test_precision_aware_dist.py``; a resume through the checkpoint files ``tests/e2e/
test_precision_aware_resume.py``; the memory figures ``tests/unit/memory/
test_optimizer_state_memory.py``.
"""

from __future__ import annotations

import importlib.machinery
import sys
import types
from typing import ClassVar

import pytest
import torch

from lptrain.config import World, check, compose, derive
from lptrain.optim.precision_aware import StatePrecision, fused_adam, state_precision
from lptrain.precision.fused_adam import EmulatedFusedAdam

BASE = ["data.builtin_max_mb=1", "logging.progress=false", "model.seq_length=32",
        "train.micro_batch_size=2", "train.global_batch_size=2"]
PAO = ["optimizer.use_precision_aware_optimizer=true", "ddp.use_distributed_optimizer=true"]


def _engine(overrides: list[str]):
    from lptrain.train.engine import TrainEngine

    return TrainEngine(derive(compose("tiny_cpu.yaml", [*BASE, *overrides]), World(dp=1)))


def _batch(cfg) -> list[dict[str, torch.Tensor]]:
    tok = torch.randint(0, cfg.model.vocab_size, (2, cfg.model.seq_length + 1),
                        generator=torch.Generator().manual_seed(5))
    return [{"tokens": tok[:, :-1], "labels": tok[:, 1:]}]


def test_remainders_hold_the_fp32_masters_bits() -> None:
    """TE holding fp32 masters of bf16 params, with and without remainders, one step from the
    same init: the masters are bitwise equal (the remainder and the bf16 param are the same
    32 bits), and the bf16 params differ exactly where the master's low half is a tie
    (0x8000) under an even high half: TE's split rounds those away from zero, the fp32 path to
    even. Over a run the two part at the first such tie (bench/optim_state.py)."""
    runs = {}
    for rem in (True, False):
        e = _engine([*PAO, f"optimizer.store_param_remainders={str(rem).lower()}"])
        child = e.optimizer.children[0]
        assert child.params_are_masters  # bf16 GEMMs: TE holds the masters
        e.train_step(_batch(e.cfg), 1)
        opt = child.optimizers[0]
        runs[rem] = {pc.name: (opt.master_value(pc.master).clone(), pc.master.detach().clone())
                     for pc in child.pieces}
        if rem:
            st = opt.state[child.pieces[0].master]["master_param"]
            assert st.dtype == torch.int16  # 2 bytes per element, not 4
    ties = 0
    for name, (master, param) in runs[True].items():
        master32, param32 = runs[False][name]
        assert torch.equal(master.view(torch.int32), master32.view(torch.int32)), name
        bits = master.contiguous().view(torch.int32)
        tie_even = ((bits & 0xFFFF) == 0x8000) & (((bits >> 16) & 1) == 0)
        differs = param.view(torch.int16) != param32.view(torch.int16)
        assert torch.equal(differs, tie_even.view(param.shape)), name
        ties += int(tie_even.sum())
    assert ties == 0 or ties < 100  # (rare: about one element in 2^17)


def test_who_holds_the_masters() -> None:
    """Megatron's rule: TE holds them for bf16 / delayed-scaling GEMMs or fp16 main params;
    lptrain keeps fp32 masters for MXFP8 (whose primary weights it requantizes)."""
    def sp(*ov: str) -> StatePrecision:
        got = state_precision(derive(compose("tiny_cpu.yaml", [*PAO, *ov]), World(dp=1)))
        assert got is not None
        return got

    assert sp().te_holds_masters and sp().remainders
    mx = sp("precision.fp8_format=e4m3", "precision.fp8_recipe=mxfp8")
    assert not mx.te_holds_masters and not mx.remainders
    half = sp("precision.fp8_format=e4m3", "precision.fp8_recipe=mxfp8", "optimizer.main_params_dtype=fp16")
    assert half.te_holds_masters and not half.remainders
    assert state_precision(derive(compose("tiny_cpu.yaml", []), World(dp=1))) is None


def test_bf16_main_grads_are_a_bf16_grad_buffer_read_directly() -> None:
    cfg = derive(compose("tiny_cpu.yaml", [*PAO, "optimizer.main_grads_dtype=bf16"]), World(dp=1))
    assert cfg.ddp.grad_reduce_in_fp32 is False  # PAO-MAIN-GRADS-DERIVE
    e = _engine([*PAO, "optimizer.main_grads_dtype=bf16"])
    assert {b.key.grad_dtype for b in e.ddp.buffers} == {torch.bfloat16}
    child = e.optimizer.children[0]
    child.prepare_grads()
    grads = child.master_grads()
    assert all(g.dtype == torch.bfloat16 for g in grads)  # no fp32 copy (Megatron's decoupled grad)
    assert grads[0].data_ptr() == child.pieces[0].grad_view().data_ptr()
    child.discard_grads()


def test_bf16_moments_need_te_2_3_on_the_te_backend() -> None:
    old = World(dp=1, target="sm90", te_version="2.2", cuda=True)
    cfg = compose(None, ["precision.backend=te", *PAO, "optimizer.exp_avg_sq_dtype=bf16"])
    (v,) = [v for v in check(cfg, old) if v.rule == "PREC-TE-VERSION"]
    assert "optimizer.exp_avg_sq_dtype" in v.keys and "2.3" in v.message
    new = World(dp=1, target="sm90", te_version="2.3", cuda=True)
    assert not [v for v in check(cfg, new) if v.rule == "PREC-TE-VERSION"]


class _FakeQuantizer:
    def __init__(self) -> None:
        self.scale = torch.ones(1)


class _FakeFloat8:
    """What the guard touches of TE's Float8Tensor: its quantizer's scale and ``copy_``."""

    def __init__(self) -> None:
        self._quantizer = _FakeQuantizer()
        self.copied: torch.Tensor | None = None

    def copy_(self, x: torch.Tensor) -> None:
        self.copied = x * self._quantizer.scale  # TE's cast: x times the quantizer scale


class _FakeFusedAdam(EmulatedFusedAdam):
    """Stands in for TE's class: records the constructor's keywords; ``_apply_scale`` as TE's
    (which sets the quantizer scale to 1 / scale)."""

    kwargs: ClassVar[dict] = {}

    def __init__(self, params, **kwargs) -> None:
        _FakeFusedAdam.kwargs = kwargs
        super().__init__(params, **kwargs)

    def _apply_scale(self, state_name, unscaled_state, scaled_state, scale) -> None:
        scaled_state._quantizer.scale.copy_(1 / scale)
        scaled_state.copy_(unscaled_state)


def test_te_backend_builds_fused_adam_megatrons_way(monkeypatch: pytest.MonkeyPatch) -> None:
    """``fused_adam`` with the TE backend builds TE's FusedAdam (here a stand-in module) with
    Megatron's arguments (``megatron/core/optimizer/__init__.py``), and the adapter's guard
    keeps an all-zero FP8 state finite where TE's ``_apply_scale`` would divide by zero."""
    import lptrain.precision.te_adapter as adapter

    te_opt = types.ModuleType("transformer_engine.pytorch.optimizers")
    te_opt.__spec__ = importlib.machinery.ModuleSpec(te_opt.__name__, None)
    te_opt.FusedAdam = _FakeFusedAdam  # type: ignore[attr-defined]
    te_f8 = types.ModuleType("transformer_engine.pytorch.tensor.float8_tensor")
    te_f8.Float8Tensor = _FakeFloat8  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "transformer_engine.pytorch.optimizers", te_opt)
    monkeypatch.setitem(sys.modules, "transformer_engine.pytorch.tensor.float8_tensor", te_f8)
    adapter._guarded_fused_adam_cls.cache_clear()
    try:
        cfg = derive(compose("tiny_cpu.yaml", [*PAO, "optimizer.exp_avg_dtype=fp8"]), World(dp=1))
        sp = StatePrecision(**{**state_precision(cfg).__dict__, "backend": "te"})  # type: ignore[union-attr]
        p = torch.zeros(4, dtype=torch.bfloat16)
        opt = fused_adam([p], [], cfg.optimizer, sp)
        assert isinstance(opt, _FakeFusedAdam)
        o = cfg.optimizer
        assert _FakeFusedAdam.kwargs == dict(
            lr=o.lr, weight_decay=o.weight_decay, betas=(o.adam_beta1, o.adam_beta2), eps=o.adam_eps,
            adam_w_mode=True, exp_avg_dtype=torch.uint8, exp_avg_sq_dtype=torch.float32,
            master_weights=True, use_decoupled_grad=True, master_weight_dtype=torch.float32,
            store_param_remainders=True)
        state, scale = _FakeFloat8(), torch.ones(1)
        opt._apply_scale("exp_avg", torch.zeros(4), state, scale)
        assert scale.item() == 0 and state._quantizer.scale.item() == 1.0
        assert torch.equal(state.copied, torch.zeros(4))  # TE's own: 0 * inf = NaN
        _FakeFusedAdam._apply_scale(opt, "exp_avg", torch.zeros(4), state, torch.zeros(1))
        assert torch.isnan(state.copied).all()
    finally:
        adapter._guarded_fused_adam_cls.cache_clear()


def test_the_stand_in_te_steps_with_the_emulation() -> None:
    """Regression: lptrain's stand-in TE (the fake GPU step of ``pretrain --dry-run --target
    sm100``) has no ``pytorch.optimizers``; the TE backend then builds the emulated FusedAdam
    (it raised ModuleNotFoundError)."""
    from lptrain.precision.te_adapter import te_fused_adam
    from lptrain.testing import te_standin

    with te_standin.installed():
        opt = te_fused_adam([{"params": [torch.zeros(2)]}], exp_avg_dtype=torch.bfloat16)
    assert type(opt) is EmulatedFusedAdam
