"""The TE backend beyond single GEMMs, against the emulated backend (GPU only).

Skips per capability with the reason, as test_te_backend. Checks:

- quantized model init (``quantized_model_init`` / FP8-FP4 primary weights): the primary
  weight's bytes equal the emulated ones exactly, and fp32 masters start from TE's
  ``get_high_precision_init_val()``, equal to the emulated init value bit for bit;
- delayed scaling over several steps: after every step the scales of input, weight and
  gradient equal the emulated ones exactly (same amaxes, same fused update), and the
  amax-history maxima match;
- the tiny GPT on CUDA: every parameter and buffer on the GPU, bf16 activations, first loss
  within 1e-2 relative of the emulated CPU model (fp32 activations there; ~20 bf16
  roundings of <= 2^-9 each feed an averaged loss, while a misplaced or wrong layer moves it
  by O(1)), a few optimizer steps lower the loss, and fused wgrad fills ``main_grad``.
"""

from __future__ import annotations

import dataclasses

import _te_gpu as G
import pytest
import torch

from lptrain.config.schema import LPTrainConfig
from lptrain.model.build import build_model
from lptrain.precision.factory import build_factory
from lptrain.precision.params import fused_wgrad_weights, master_weight_init

pytestmark = [pytest.mark.gpu, pytest.mark.te]

NAMES = sorted(G.CONFIGS)


def _fixed_init(shape: tuple[int, int], seed: int = 3):
    g = torch.Generator().manual_seed(seed)
    values = torch.randn(*shape, generator=g) * 0.05

    def init(t: torch.Tensor) -> None:
        with torch.no_grad():
            t.copy_(values)

    return init


@pytest.mark.parametrize("name", NAMES)
def test_quantized_model_init_matches_te(name: str) -> None:
    pg = {"fp4_param_gather": True} if name == "nvfp4" else {"fp8_param_gather": True}
    G.require_te_for(G.prec("te", name, **pg))
    emu = build_factory(G.prec("emulated", name, **pg), num_layers=1)
    te_f = build_factory(G.prec("te", name, **pg), num_layers=1)
    with emu.model_init():
        ours = emu.linear(256, 128, init_method=_fixed_init((128, 256)))
    with te_f.model_init():
        theirs = te_f.linear(256, 128, init_method=_fixed_init((128, 256)))
    assert G.compare_buffers(name, ours.weight, theirs.weight, role="weight") >= 2
    te_init = theirs.weight.get_high_precision_init_val()
    assert torch.equal(te_init.cpu(), ours.weight.high_precision_init_value().cpu())
    m_ours, m_theirs = master_weight_init(ours.weight), master_weight_init(theirs.weight)
    assert m_theirs.device.type == "cuda" and m_theirs.dtype == torch.float32
    assert torch.equal(m_ours.cpu(), m_theirs.cpu())


def test_delayed_scaling_over_steps_matches_te() -> None:
    cfg = G.prec("te", "delayed")
    G.require_te_for(cfg)
    emu = build_factory(G.prec("emulated", "delayed"), num_layers=1)
    te_f = build_factory(cfg, num_layers=1)
    ours, theirs = emu.linear(128, 64), te_f.linear(128, 64)
    with torch.no_grad():
        theirs.weight.copy_(ours.weight.detach().cuda())
    for step in range(5):
        g = torch.Generator().manual_seed(10 + step)
        x = (torch.randn(64, 128, generator=g) * 2.0 ** (step - 2)).to(torch.bfloat16)
        dy = (torch.randn(64, 64, generator=g) * 2.0 ** (2 - step)).to(torch.bfloat16)
        outs = []
        for f, m, dev in ((emu, ours, "cpu"), (te_f, theirs, "cuda")):
            xi = x.to(dev).requires_grad_(True)
            with f.autocast():
                y = m(xi)
            y.backward(dy.to(dev))
            outs.append(y)
        assert G.rel(outs[0], outs[1]) < G.GEMM_RTOL, step
        st = ours.delayed_scaling_states(emu.recipe)[0]
        fwd, bwd = theirs.fp8_meta["scaling_fwd"], theirs.fp8_meta["scaling_bwd"]
        # TE's slots: forward [input, weight, output], backward [grad_output, grad_input].
        for role, meta, idx in (("input", fwd, 0), ("weight", fwd, 1), ("grad", bwd, 0)):
            assert torch.equal(st[role].scale.reshape(-1).cpu(), meta.scale[idx: idx + 1].cpu()), (step, role)
            assert torch.equal(st[role].amax_history.max().cpu(), meta.amax_history[:, idx].max().cpu())


def _tiny(name: str, **train) -> LPTrainConfig:
    cfg = LPTrainConfig()
    m = cfg.model
    m.num_layers, m.hidden_size, m.num_attention_heads, m.ffn_hidden_size = 2, 64, 4, 128
    m.seq_length, m.vocab_size = 32, 259
    cfg.precision = G.prec("te", name)
    cfg.train = dataclasses.replace(cfg.train, gradient_accumulation_fusion=False, **train)
    return cfg


def _batch(cfg: LPTrainConfig, device: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, cfg.model.vocab_size, (2, cfg.model.seq_length), generator=g).to(device)


@pytest.mark.parametrize("name", NAMES)
def test_tiny_gpt_trains_on_cuda(name: str) -> None:
    cfg = _tiny(name)
    G.require_te_for(cfg)
    model = build_model(cfg)
    assert {t.device.type for t in [*model.parameters(), *model.buffers()]} == {"cuda"}
    assert model.compute_dtype == torch.bfloat16
    cpu_cfg = dataclasses.replace(cfg, precision=dataclasses.replace(cfg.precision, backend="emulated"))
    reference = build_model(cpu_cfg, device="cpu")
    tokens = _batch(cfg, "cuda")
    with reference.autocast():
        ref_loss = reference(tokens.cpu(), tokens.cpu())[0].item()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(6):
        with model.autocast():
            loss, _ = model(tokens, tokens)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    assert abs(losses[0] - ref_loss) / ref_loss < 1e-2, (losses[0], ref_loss)
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < 0.98 * losses[0], losses


def test_fused_wgrad_fills_main_grad_on_te() -> None:
    cfg = _tiny("tensorwise", gradient_accumulation_fusion=True)
    G.require_te_for(cfg)
    fused = build_model(cfg)
    plain = build_model(_tiny("tensorwise"))
    weights = list(fused_wgrad_weights(fused))
    assert len(weights) == 8 and all(w.main_grad.dtype == torch.float32 for w in weights)
    tokens = _batch(cfg, "cuda")
    for model in (fused, plain):
        with model.autocast():
            model(tokens, tokens)[0].backward()
    by_name = dict(plain.named_parameters())
    for name, p in fused.named_parameters():
        if any(p is w for w in weights):
            # fp32 accumulation vs a bf16 wgrad output: one bf16 rounding apart (GEMM_RTOL).
            assert G.rel(p.main_grad, by_name[name].grad) < G.GEMM_RTOL, name
            assert p.grad_added_to_main_grad is True, name
