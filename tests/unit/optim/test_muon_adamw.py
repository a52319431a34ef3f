"""MuonWithAdamW as a torch optimizer: torch references, LR schedulers, update RMS, state by
parameter name (incl. torch.distributed.checkpoint's optimizer state dict)."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch.distributed.checkpoint.state_dict import (
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)

from lptrain.config import compose
from lptrain.config.schema import OptimizerConfig
from lptrain.model import build_model
from lptrain.optim.muon import Muon, MuonWithAdamW
from lptrain.optim.param_groups import split_params_for_muon


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _cfg(**muon: object) -> OptimizerConfig:
    cfg = OptimizerConfig(name="muon", lr=0.01, weight_decay=0.1)
    for k, v in muon.items():
        setattr(cfg.muon, k, v)
    return cfg


def _params() -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Two Muon matrices; an embedding-like matrix, a head-like one and two 1-D gains."""
    g = _gen(0)
    muon = [torch.randn(24, 40, generator=g), torch.randn(40, 24, generator=g)]
    adamw = [torch.randn(50, 24, generator=g), torch.randn(24, 50, generator=g),
             torch.randn(24, generator=g), torch.randn(40, generator=g)]
    return muon, adamw


def _grads(tensors: list[torch.Tensor], seed: int) -> list[torch.Tensor]:
    g = _gen(seed)
    return [torch.randn(t.shape, generator=g) for t in tensors]


def test_groups_and_torch_adamw_bitwise() -> None:
    cfg = _cfg()
    muon, adamw = _params()
    ref_adamw = [t.clone() for t in adamw]
    ref_muon = [t.clone() for t in muon]
    opt = MuonWithAdamW(muon, adamw, cfg)
    assert [(g["name"], g["optimizer"], len(g["params"])) for g in opt.param_groups] == [
        ("muon", "muon", 2), ("adamw_decay", "adamw", 2), ("adamw_no_decay", "adamw", 2)]
    torch_adamw = torch.optim.AdamW(
        [{"params": ref_adamw[:2], "weight_decay": cfg.weight_decay},
         {"params": ref_adamw[2:], "weight_decay": 0.0}],
        lr=cfg.lr, betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_eps)
    m = cfg.muon
    muon_ref = Muon(ref_muon, lr=cfg.lr, weight_decay=cfg.weight_decay, momentum=m.momentum,
                    nesterov=m.nesterov, ns_steps=m.ns_steps, coefficients=m.coefficients,
                    scale_mode=m.scale_mode, extra_scale_factor=m.extra_scale_factor)
    for step in range(3):
        for ts in (muon + adamw, ref_muon + ref_adamw):
            for t, gr in zip(ts, _grads(ts, 10 + step), strict=True):
                t.grad = gr
        opt.step()
        torch_adamw.step()
        muon_ref.step()
    # Same kernels, same order of operations: bitwise.
    assert all(torch.equal(a, b) for a, b in zip(adamw, ref_adamw, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(muon, ref_muon, strict=True))
    for a, b in zip(adamw, ref_adamw, strict=True):
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(opt.state[a][key], torch_adamw.state[b][key])


@pytest.mark.parametrize(
    ("scale_mode", "extra", "adjust_lr_fn"),
    [("shape_scaling", 1.0, None), ("spectral", 0.2, "match_rms_adamw")],
)
@pytest.mark.parametrize("shape", [(64, 32), (32, 64)])
@pytest.mark.parametrize("torch_ns_fp32", [True, False])
def test_matches_torch_optim_muon(
    monkeypatch: pytest.MonkeyPatch, scale_mode: str, extra: float, adjust_lr_fn: str | None,
    shape: tuple[int, int], torch_ns_fp32: bool,
) -> None:
    """Where the conventions coincide: Keller's ``simple`` coefficients x5, eps 1e-7, EMA
    momentum 0.95 with Nesterov, decoupled decay with the base lr; lptrain's
    ``shape_scaling`` is torch's ``original`` and ``spectral`` x 0.2 its ``match_rms_adamw``."""
    p0 = torch.randn(*shape, generator=_gen(1))
    grads = _grads([p0] * 3, 2)
    ours, theirs = p0.clone(), p0.clone()
    opt = Muon([ours], lr=0.02, weight_decay=0.1, momentum=0.95, nesterov=True, ns_steps=5,
               coefficients="simple", scale_mode=scale_mode, extra_scale_factor=extra)
    ref = torch.optim.Muon([theirs], lr=0.02, weight_decay=0.1, momentum=0.95, nesterov=True,
                           adjust_lr_fn=adjust_lr_fn)
    for gr in grads:
        ours.grad, theirs.grad = gr.clone(), gr.clone()
        opt.step()
        with monkeypatch.context() as mp:
            if torch_ns_fp32:
                # torch's Newton-Schulz casts its input to bf16; run its own code in fp32.
                mp.setattr(torch.Tensor, "bfloat16", lambda self, *a, **k: self.float())
            ref.step()
    d_ours, d_ref = ours - p0, theirs - p0
    rel = ((d_ours - d_ref).norm() / d_ref.norm()).item()
    # fp32 vs fp32: only GEMM/division order differs (torch addmm vs our matmul, scale on
    # the update vs on the lr): measured 2.5e-6 relative over 3 steps; tolerance 1e-5.
    # Against torch's bf16 Newton-Schulz (8-bit mantissa over 5 steps): measured ~1e-2;
    # tolerance 3e-2 -- a wrong scale or momentum convention is off by >= 10%.
    assert rel < (1e-5 if torch_ns_fp32 else 3e-2), rel


def test_lambda_lr_scheduler_drives_every_group() -> None:
    muon, adamw = _params()
    opt = MuonWithAdamW(muon, adamw, _cfg())
    factors = [lambda s: [0.0, 1.0, 0.5][s], lambda s: [0.0, 0.5, 1.0][s],
               lambda s: [0.0, 0.25, 0.25][s]]
    sched = torch.optim.lr_scheduler.LambdaLR(opt, factors)
    assert opt.lr_by_group() == {"muon": 0.0, "adamw_decay": 0.0, "adamw_no_decay": 0.0}
    before = [t.clone() for t in muon + adamw]
    for t, gr in zip(muon + adamw, _grads(muon + adamw, 3), strict=True):
        t.grad = gr
    opt.step()  # lr 0 everywhere: decay (1 - 0*wd) and step are exact no-ops
    assert all(torch.equal(a, b) for a, b in zip(before, muon + adamw, strict=True))
    assert all(len(opt.state[t]) > 0 for t in muon + adamw)  # but the state advanced
    sched.step()
    assert opt.lr_by_group() == pytest.approx(
        {"muon": 0.01, "adamw_decay": 0.005, "adamw_no_decay": 0.0025})
    assert sched.get_last_lr() == pytest.approx([0.01, 0.005, 0.0025])
    opt.step()
    assert all(not torch.equal(a, b) for a, b in zip(before, muon + adamw, strict=True))
    # The scheduler's own state rides in the optimizer's groups (initial_lr) and survives a
    # state-dict round trip; the group dicts stay the same objects.
    groups = list(opt.param_groups)
    opt.load_state_dict(copy.deepcopy(opt.state_dict()))
    assert all(a is b for a, b in zip(groups, opt.param_groups, strict=True))
    assert [g["initial_lr"] for g in opt.param_groups] == [0.01, 0.01, 0.01]
    sched.step()
    assert opt.lr_by_group() == pytest.approx(
        {"muon": 0.005, "adamw_decay": 0.01, "adamw_no_decay": 0.0025})


@pytest.mark.parametrize("extra", [1.0, 0.2])
def test_last_update_rms(extra: float) -> None:
    cfg = _cfg(extra_scale_factor=extra)
    cfg.weight_decay = 0.0  # so the param change is exactly lr * update
    muon, adamw = _params()
    opt = MuonWithAdamW(muon, adamw, cfg)
    assert opt.last_update_rms is None
    before = [t.clone() for t in muon]
    for t, gr in zip(muon + adamw, _grads(muon + adamw, 4), strict=True):
        t.grad = gr
    opt.step()
    rms = opt.last_update_rms
    # spectral: every singular value of NS(U) in quintic's band [0.977, 1.032] -> RMS extra x
    # that band (the momentum-averaged gaussian grads are full rank and well inside the band's
    # premise).
    assert rms is not None and 0.977 * extra <= rms <= 1.032 * extra, rms
    # It is the RMS of what was applied: (W_before - W_after) / lr over all Muon entries;
    # fp32 rounding of W - lr*u, then /lr, leaves ~1e-6 relative.
    deltas = torch.cat([((b - a) / cfg.lr).flatten() for a, b in zip(muon, before, strict=True)])
    assert deltas.square().mean().sqrt().item() == pytest.approx(rms, rel=1e-4)
    for t in muon:
        t.grad = None
    opt.step()  # no Muon grads this step
    assert opt.last_update_rms is None


def _tiny_model(seed: int = 0) -> torch.nn.Module:
    cfg = compose("tiny_cpu.yaml")
    cfg.precision.params_dtype = "fp32"
    torch.manual_seed(seed)
    return build_model(cfg)


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    tok = torch.randint(0, 259, (2, 65), generator=_gen(7))
    return tok[:, :-1], tok[:, 1:]


def _train_step(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    tokens, labels = _batch()
    loss, _ = model(tokens, labels=labels)
    loss.backward()
    opt.step()
    opt.zero_grad()


def _twin(model: torch.nn.Module) -> torch.nn.Module:
    """A separately built model with the same weights (deepcopy drops the params' tags)."""
    twin = _tiny_model(seed=1)
    twin.load_state_dict(model.state_dict())
    return twin


def test_state_round_trip_by_names_in_any_order() -> None:
    cfg = _cfg()
    model = _tiny_model()
    opt = MuonWithAdamW(*split_params_for_muon(model.named_parameters()), cfg)
    _train_step(model, opt)
    _train_step(model, opt)
    assert all("param_names" in g for g in opt.param_groups)
    for sd in (opt.state_dict(), opt.named_state_dict()):
        twin = _twin(model)
        # Registered in reverse: positions differ from the saved ones, names do not.
        twin_opt = MuonWithAdamW(
            *split_params_for_muon(list(twin.named_parameters())[::-1]), cfg)
        assert twin_opt.param_groups[0]["param_names"] != opt.param_groups[0]["param_names"]
        twin_opt.load_state_dict(copy.deepcopy(sd))
        ref = _twin(model)
        ref_opt = MuonWithAdamW(*split_params_for_muon(ref.named_parameters()), cfg)
        ref_opt.load_state_dict(copy.deepcopy(opt.state_dict()))
        _train_step(twin, twin_opt)
        _train_step(ref, ref_opt)
        assert all(torch.equal(a, b) for a, b in
                   zip(twin.parameters(), ref.parameters(), strict=True))
    named = opt.named_state_dict()
    assert set(named["state"]) == {n for n, _ in model.named_parameters()}


def test_state_by_names_errors() -> None:
    cfg = _cfg()
    model = _tiny_model()
    opt = MuonWithAdamW(*split_params_for_muon(model.named_parameters()), cfg)
    _train_step(model, opt)
    sd = opt.named_state_dict()
    renamed = copy.deepcopy(sd)
    old = "layers.0.mlp.linear_fc1.weight"
    renamed["state"]["mystery.weight"] = renamed["state"].pop(old)
    g = renamed["param_groups"][0]
    g["params"] = ["mystery.weight" if n == old else n for n in g["params"]]
    with pytest.raises(ValueError, match=rf"param group 'muon'.*missing.*{old}.*mystery\.weight"):
        opt.load_state_dict(renamed)
    unnamed = MuonWithAdamW(*split_params_for_muon(model), cfg)
    with pytest.raises(ValueError, match="keyed by parameter name"):
        unnamed.load_state_dict(sd)
    with pytest.raises(ValueError, match="no parameter names"):
        opt.load_state_dict(unnamed.state_dict())


def test_torch_dcp_optimizer_state_dict_round_trip() -> None:
    """get_optimizer_state_dict keys state by the model's FQNs; set_optimizer_state_dict puts
    it into an optimizer whose params were registered in another order."""
    cfg = _cfg()
    model = _tiny_model()
    opt = MuonWithAdamW(*split_params_for_muon(model.named_parameters()), cfg)
    _train_step(model, opt)
    osd = get_optimizer_state_dict(model, opt)
    names = {n for n, _ in model.named_parameters()}
    assert set(osd["state"]) == names
    assert set(osd["state"]["layers.0.self_attention.linear_qkv.weight"]) == {"momentum_buffer"}
    assert set(osd["state"]["embedding.weight"]) == {"step", "exp_avg", "exp_avg_sq"}
    assert [g["name"] for g in osd["param_groups"]] == ["muon", "adamw_decay", "adamw_no_decay"]
    twin = _twin(model)
    twin_opt = MuonWithAdamW(*split_params_for_muon(list(twin.named_parameters())[::-1]), cfg)
    # torch's loader aliases the given tensors: pass a copy so the two runs stay independent.
    set_optimizer_state_dict(twin, twin_opt, copy.deepcopy(osd))
    _train_step(model, opt)
    _train_step(twin, twin_opt)
    assert all(torch.equal(a, b) for a, b in
               zip(model.parameters(), twin.parameters(), strict=True))


def test_fp32_momentum_survives_loading_onto_bf16_params() -> None:
    p = torch.randn(16, 32, generator=_gen(5)).bfloat16()
    opt = Muon([("w", p)], lr=0.01)
    p.grad = (1e-3 * torch.randn(16, 32, generator=_gen(6))).bfloat16()
    opt.step()
    saved = copy.deepcopy(opt.state_dict())
    q = p.detach().clone()
    opt2 = Muon([("w", q)], lr=0.01)
    opt2.load_state_dict(saved)
    buf = opt2.state[q]["momentum_buffer"]
    # torch would cast it to the param's bf16; it stays fp32 and exact.
    assert buf.dtype == torch.float32
    assert torch.equal(buf, saved["state"][0]["momentum_buffer"])
    assert not torch.equal(buf, buf.bfloat16().float())  # bf16 would have lost bits
    assert math.isfinite(buf.abs().sum().item())


def test_the_docs_example_trains_a_plain_torch_model() -> None:
    """docs/muon.md's MuonWithAdamW example, run as written: the loss of its fixed batch
    falls (30 steps memorise 8 sequences: 4.62 -> 3.24 here; a broken optimizer stays near
    ln(100) = 4.6), and the update RMS is the spectral scale's ~1 (0.2: RMS of an
    orthogonalised 32x64 / 64x32 update times the scale, measured 1.002)."""
    import re

    from lptrain.config.compose import repo_root

    page = (repo_root() / "docs" / "muon.md").read_text()
    section = page.split("## MuonWithAdamW in your own training loop", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S)
    assert code is not None, "docs/muon.md: the example's code block is missing"
    ns: dict[str, object] = {}
    exec(compile(code.group(1), "docs/muon.md", "exec"), ns)
    opt, losses = ns["opt"], ns["losses"]
    assert isinstance(opt, MuonWithAdamW)
    assert set(opt.lr_by_group()) == {"muon", "adamw_decay", "adamw_no_decay"}
    assert [len(g["params"]) for g in opt.param_groups] == [1, 2, 2]  # fc1 | emb, head | biases
    assert losses[-1] < 0.8 * losses[0], losses
    assert opt.last_update_rms == pytest.approx(1.0, abs=0.2)
