"""Forward+backward time of lptrain's GPT against a plain-PyTorch GPT of the same architecture.

Not a test: prints a rich table. The reference (``ReferenceGPT`` below) is written with
``nn.Linear``/``nn.Embedding`` only, fp32 parameters, and the same math (RMSNorm, per-group
fused QKV, RoPE, causal SDPA, SwiGLU, untied head). Both get the same weights and batch;
its loss must equal lptrain's fp32 loss before anything is timed. lptrain runs with fp32
params, bf16 params (the factory computes in fp32; target <= 1.10x the reference) and each
quantized recipe (emulated backend, bf16 params). Steps of all variants are interleaved
per repeat so machine-load drift hits them alike; the median over repeats is reported.

    .venv/bin/python bench/model_step.py [--repeats 30] [--warmup 5] [--threads 1]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from rich.console import Console
from rich.table import Table
from torch import nn

from lptrain.config.schema import LPTrainConfig, ModelConfig
from lptrain.model import build_model, flops_per_token
from lptrain.precision.factory import build_factory

RECIPES: dict[str, dict[str, Any]] = {
    "fp8 delayed": {"fp8_format": "hybrid", "fp8_recipe": "delayed"},
    "fp8 tensorwise": {"fp8_format": "e4m3", "fp8_recipe": "tensorwise"},
    "fp8 blockwise": {"fp8_format": "e4m3", "fp8_recipe": "blockwise"},
    "mxfp8": {"fp8_format": "e4m3", "fp8_recipe": "mxfp8"},
    "nvfp4": {"fp4_format": "e2m1"},
}


class _RMSNorm(nn.Module):
    def __init__(self, h: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(h))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class _Attention(nn.Module):
    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        self.h, self.g = c.num_attention_heads, c.num_query_groups or c.num_attention_heads
        self.d = c.hidden_size // self.h
        self.linear_qkv = nn.Linear(c.hidden_size, self.g * (self.h // self.g + 2) * self.d, bias=False)
        self.linear_proj = nn.Linear(self.h * self.d, c.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        qpg = self.h // self.g
        qkv = self.linear_qkv(x).view(b, s, self.g, qpg + 2, self.d)
        q = qkv[:, :, :, :qpg].reshape(b, s, self.h, self.d).transpose(1, 2)
        k, v = qkv[:, :, :, qpg].transpose(1, 2), qkv[:, :, :, qpg + 1].transpose(1, 2)

        def rope(t: torch.Tensor) -> torch.Tensor:
            t1, t2 = t.chunk(2, -1)
            return t * cos + torch.cat([-t2, t1], -1) * sin

        q, k = rope(q), rope(k)
        if qpg > 1:
            k, v = k.repeat_interleave(qpg, 1), v.repeat_interleave(qpg, 1)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.linear_proj(o.transpose(1, 2).reshape(b, s, self.h * self.d))


class _MLP(nn.Module):
    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        ffn = c.ffn_hidden_size or 4 * c.hidden_size
        self.linear_fc1 = nn.Linear(c.hidden_size, 2 * ffn, bias=False)
        self.linear_fc2 = nn.Linear(ffn, c.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.linear_fc1(x).chunk(2, -1)
        return self.linear_fc2(F.silu(gate) * up)


class _Layer(nn.Module):
    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        self.input_norm = _RMSNorm(c.hidden_size, c.norm_epsilon)
        self.self_attention = _Attention(c)
        self.pre_mlp_norm = _RMSNorm(c.hidden_size, c.norm_epsilon)
        self.mlp = _MLP(c)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attention(self.input_norm(x), cos, sin)
        return x + self.mlp(self.pre_mlp_norm(x))


class ReferenceGPT(nn.Module):
    """Plain fp32 PyTorch GPT; parameter names match lptrain's dense GPT state dict."""

    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        self.embedding = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(_Layer(c) for _ in range(c.num_layers))
        self.final_norm = _RMSNorm(c.hidden_size, c.norm_epsilon)
        self.output_layer = nn.Linear(c.hidden_size, c.vocab_size, bias=False)
        d = c.hidden_size // c.num_attention_heads
        inv = 1.0 / (c.rotary_base ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
        f = torch.outer(torch.arange(c.seq_length, dtype=torch.float64), inv)
        emb = torch.cat([f, f], -1)
        self.register_buffer("cos", emb.cos().float(), persistent=False)
        self.register_buffer("sin", emb.sin().float(), persistent=False)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        s = tokens.shape[1]
        x = self.embedding(tokens)
        for layer in self.layers:
            x = layer(x, self.cos[:s], self.sin[:s])
        logits = self.output_layer(self.final_norm(x))
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


def load_config() -> LPTrainConfig:
    """``recipes/tiny_cpu.yaml`` through ``lptrain.config``; the same shape hard-coded if
    composition is unavailable."""
    try:
        from lptrain.config.compose import compose

        return compose("tiny_cpu.yaml")
    except Exception:
        cfg = LPTrainConfig()
        m = cfg.model
        m.num_layers, m.hidden_size, m.ffn_hidden_size = 2, 64, 256
        m.num_attention_heads, m.num_query_groups, m.seq_length, m.vocab_size = 4, 4, 128, 259
        cfg.train.micro_batch_size = 4
        return cfg


def lptrain_step(cfg: LPTrainConfig, params_dtype: str, recipe: dict[str, Any]) -> tuple[nn.Module, Any]:
    cfg.precision.params_dtype = params_dtype
    cfg.precision.backend = "emulated"
    cfg.precision.fp8_format = recipe.get("fp8_format")
    cfg.precision.fp8_recipe = recipe.get("fp8_recipe", "delayed")
    cfg.precision.fp4_format = recipe.get("fp4_format")
    factory = build_factory(cfg.precision, num_layers=cfg.model.num_layers)
    return build_model(cfg, factory), factory


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    base = load_config()
    mc = base.model
    b, s = base.train.micro_batch_size, mc.seq_length
    g = torch.Generator().manual_seed(0)
    batch = torch.randint(0, mc.vocab_size, (b, s + 1), generator=g)
    tokens, labels = batch[:, :-1], batch[:, 1:]

    variants: dict[str, tuple[nn.Module, Callable[[], torch.Tensor]]] = {}
    ref = ReferenceGPT(mc)
    variants["reference fp32 (nn.Linear)"] = (ref, lambda: ref(tokens, labels))

    def add(name: str, dtype: str, recipe: dict[str, Any]) -> nn.Module:
        import copy

        model, factory = lptrain_step(copy.deepcopy(base), dtype, recipe)

        def run() -> torch.Tensor:
            with factory.autocast():
                return model(tokens, labels)[0]

        variants[name] = (model, run)
        return model

    fp32_model = add("lptrain fp32 params", "fp32", {})
    add("lptrain bf16 params", "bf16", {})
    for name, recipe in RECIPES.items():
        add(f"lptrain {name}", "bf16", recipe)
    ref.load_state_dict(fp32_model.state_dict())
    with torch.no_grad():
        l_ref, l_lp = ref(tokens, labels), fp32_model(tokens, labels)[0]
    # Same weights, same fp32 math up to summation order: losses agree to 1e-5.
    assert abs(l_ref.item() - l_lp.item()) < 1e-5, (l_ref.item(), l_lp.item())

    def step(model: nn.Module, run: Callable[[], torch.Tensor]) -> float:
        model.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        run().backward()
        return time.perf_counter() - t0

    times: dict[str, list[float]] = {k: [] for k in variants}
    for r in range(args.warmup + args.repeats):
        for name, (model, run) in variants.items():
            dt = step(model, run)
            if r >= args.warmup:
                times[name].append(dt)

    flops = flops_per_token(mc).total * b * s
    ref_ms = statistics.median(times["reference fp32 (nn.Linear)"]) * 1e3
    table = Table(title=f"GPT fwd+bwd, {mc.num_layers}L h{mc.hidden_size} ffn{mc.ffn_hidden_size} "
                  f"seq{s} mbs{b}, {args.threads} thread(s), median of {args.repeats}")
    for col in ("variant", "median ms", "IQR ms", "vs reference", "tokens/s", "GFLOP/s"):
        table.add_column(col, justify="left" if col == "variant" else "right")
    for name, ts in times.items():
        med = statistics.median(ts) * 1e3
        q = statistics.quantiles(ts, n=4)
        table.add_row(
            name, f"{med:.2f}", f"{(q[2] - q[0]) * 1e3:.2f}", f"{med / ref_ms:.2f}x",
            f"{b * s / med * 1e3:,.0f}", f"{flops / med / 1e6:.2f}",
        )
    Console(width=110).print(table)
    print(f"reference vs lptrain fp32 loss: {l_ref.item():.6f} vs {l_lp.item():.6f}")


if __name__ == "__main__":
    main()
