"""The precision-aware optimizer in lptrain's engine, one process: who holds the masters, the
remainders' claim, Transformer Engine's FusedAdam called Megatron's way, the derived keys.

The math of each stored format against an independent reference is
``test_fused_adam_emulation.py``; every parallel layout is ``tests/dist/
test_precision_aware_dist.py``; a resume through the checkpoint files ``tests/e2e/
test_precision_aware_resume.py``; the memory figures ``tests/unit/memory/
test_optimizer_state_memory.py``.
"""

from __future__ import annotations

import pytest
import torch

from lptrain.config import World, check, compose, derive
from lptrain.optim.precision_aware import StatePrecision, fused_adam, state_precision
from lptrain.testing import adam_parity
from lptrain.testing.fake_gpu import virtual_gpu

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


def _cfg(*overrides: str):
    return derive(compose("tiny_cpu.yaml", [*PAO, *overrides]), World(dp=1))


def test_te_fused_adam_steps_bitwise_as_the_emulation() -> None:
    """TE's own FusedAdam (its Python, the ``multi_tensor_adam*`` kernels emulated) and the
    emulated backend's, built by ``fused_adam`` from the same params and grads, agree bit for
    bit after three steps in every stored format lptrain configures (remainders, fp32 / fp16
    masters, fp8 / fp16 / bf16 moments -- fused into the kernel from TE 2.14 --, bf16 grads,
    fp32 params), each reaching the kernel TE picks for it; the kernels refuse what TE's host
    code refuses."""
    with virtual_gpu("sm90", te=True):
        import transformer_engine_torch as tex

        assert adam_parity.mismatches(_cfg().optimizer) == []
        p = torch.zeros(4, device="cuda")
        with pytest.raises(RuntimeError, match="First and second moment"):
            tex.multi_tensor_adam(2048, torch.zeros(1, dtype=torch.int32), [[p], [p], [p], [p.bfloat16()]],
                                  1e-3, 0.9, 0.95, 1e-8, 1, 1, 1, 0.0)


def test_remainders_hold_the_fp32_masters_bits() -> None:
    """TE's FusedAdam holding fp32 masters of bf16 params, with and without remainders, from
    the same init: the masters are bitwise equal after three steps (the remainder and the bf16
    param are the same 32 bits, 2 bytes of state per element instead of 4). The bf16 params
    differ exactly where the master's low half is a tie (0x8000) under an even high half: the
    remainder split rounds those away from zero, the fp32 path's cast to even (shown on masters
    made of ties, stepped with lr 0 so the kernels only write the params back). Over a run the
    two part at the first such tie (bench/optim_state.py)."""
    from lptrain.optim.precision_aware import master_value
    from lptrain.precision.te_adapter import te_load_master

    cfg = _cfg().optimizer
    runs = {}
    with virtual_gpu("sm90", te=True):
        for rem in (True, False):
            sp = StatePrecision("fp32", "fp32", "fp32", "fp32", rem, True)
            opt, params, _ = adam_parity.run(sp, cfg, "te")
            if rem:
                assert opt.state[params[0]]["master_param"].dtype == torch.int16
            masters = [master_value(opt, p).clone() for p in params]
            high = torch.randint(-2**15, 2**15, (512,), generator=torch.Generator().manual_seed(1), dtype=torch.int32)
            high = high[(high & 0x7F80) != 0x7F80]  # finite masters
            ties = ((high << 16) | 0x8000).view(torch.float32).cuda()
            tie = torch.zeros(ties.shape, dtype=torch.bfloat16, device="cuda")
            opt.param_groups[0]["params"].append(tie)
            te_load_master(opt, tie, ties)
            tie.decoupled_grad = torch.zeros(ties.shape, device="cuda")  # type: ignore[attr-defined]
            for g in opt.param_groups:
                g["lr"] = 0.0
            opt.step()
            runs[rem] = (masters, tie.clone(), master_value(opt, tie).clone())
    for a, b in zip(runs[True][0], runs[False][0], strict=True):
        assert torch.equal(a.view(torch.int32), b.view(torch.int32))
    for rem in (True, False):  # lr 0: every master as it was
        assert torch.equal(runs[rem][2].cpu().view(torch.int32), ties.cpu().view(torch.int32))
    even = high & 1 == 0
    differs = runs[True][1].cpu().view(torch.int16) != runs[False][1].cpu().view(torch.int16)
    assert torch.equal(differs, even) and even.any() and (~even).any()


def test_te_backend_builds_fused_adam_megatrons_way() -> None:
    """``fused_adam`` with the TE backend builds TE's own FusedAdam with Megatron's arguments
    (``megatron/core/optimizer/__init__.py``), and the adapter's guard keeps an all-zero FP8
    state finite where TE's ``_apply_scale`` stores ``0 * (1 / 0) = NaN``."""
    from transformer_engine.pytorch.optimizers import FusedAdam

    with virtual_gpu("sm90", te=True):
        cfg = _cfg("optimizer.exp_avg_dtype=fp8")
        sp = StatePrecision(**{**state_precision(cfg).__dict__, "backend": "te"})  # type: ignore[union-attr]
        p = torch.zeros(4, dtype=torch.bfloat16, device="cuda")
        opt = fused_adam([p], [], cfg.optimizer, sp)
        assert isinstance(opt, FusedAdam)
        o = cfg.optimizer
        group = opt.param_groups[0]
        assert (group["lr"], group["weight_decay"], group["betas"], group["eps"]) == (
            o.lr, o.weight_decay, (o.adam_beta1, o.adam_beta2), o.adam_eps)
        assert opt.param_groups[1]["weight_decay"] == 0.0
        assert opt.adam_w_mode == 1 and opt.master_weights and opt.use_decoupled_grad and opt.store_param_remainders
        assert opt.name_to_dtype_map == {"exp_avg": torch.uint8, "exp_avg_sq": torch.float32,
                                         "master_param": torch.float32}
        opt.initialize_state(p, True)
        state = opt.state[p]["exp_avg"]
        zero, scale = torch.zeros(4, device="cuda"), torch.ones(1, device="cuda")
        opt._apply_scale("exp_avg", zero, state, scale)
        assert scale.item() == 0 and state._quantizer.scale.item() == 1.0
        assert torch.equal(state.dequantize().float(), zero)
        FusedAdam._apply_scale(opt, "exp_avg", zero, state, scale)  # TE's own
        assert torch.isnan(state.dequantize().float()).all()
