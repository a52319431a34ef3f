"""The checks ``make gpu-check`` runs on a real GPU (and the gpu-marked tests share).

* :func:`quantizer_identity`: every recipe's quantizers give the same bytes and scales on
  CUDA as on the CPU for the same inputs (the emulation is device-independent; stochastic
  rounding draws its bits on a seeded CPU generator);
* :func:`compare_recipe`: a ``*_cpu`` recipe trained for N steps on the CPU and with
  ``run.device=cuda``: the loss curves agree within :data:`LOSS_RTOL`;
* :func:`throughput`: tokens/s and MFU of a medium bf16 GPT against the device's bf16 peak,
  and its peak memory against ``lptrain estimate-memory``'s figure for the same config.

Everything here also runs on the virtual GPU (:mod:`lptrain.testing.virtual_cuda`), which is
how the CPU suite checks that the script works before a GPU is lent.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Optional

import torch

# Relative loss difference allowed between the CPU run (fp32 activations) and the CUDA run
# (bf16 activations, native bf16 GEMMs, cuBLAS summation order) over 20 steps. Measured on
# the virtual GPU, where only the activation dtype differs: at most 7.5e-4 (mxfp8_muon_cpu,
# Newton-Schulz amplifying), 1.6e-4 for the others. 1e-2 leaves 13x for the summation order
# and 20 steps of amplification; a misplaced layer or a wrong quantizer moves the loss by
# O(1) within a step.
LOSS_RTOL = 1e-2
ROLES = ("input", "weight", "grad")


@dataclass
class CheckResult:
    name: str
    ok: bool
    detail: str


def _recipes() -> dict[str, Any]:
    from lptrain.precision.recipes import RECIPES

    out = {}
    for name, cls in RECIPES.items():
        kw: dict[str, Any] = {}
        if name in ("tensorwise", "delayed"):
            kw["fp8_format"] = "hybrid"
        elif name in ("blockwise", "mxfp8"):
            kw["fp8_format"] = "e4m3"
        out[name] = cls(**kw)
    return out


def quantizer_identity(device: str = "cuda", shape: tuple[int, int] = (256, 512)) -> list[CheckResult]:
    """Quantize the same seeded inputs on the CPU and on ``device``: every buffer equal."""
    results = []
    for name, recipe in _recipes().items():
        for role in ROLES:
            g = torch.Generator().manual_seed(hash((name, role)) & 0xFFFF)
            x = (torch.randn(*shape, generator=g) * 3.0).to(torch.bfloat16)
            got = {}
            for dev in ("cpu", device):
                q = _quantizer(recipe, role)
                got[dev] = {k: v.cpu() for k, v in q.quantize(x.to(dev)).storage_views().items()}
            diff = [k for k in got["cpu"] if not torch.equal(got["cpu"][k], got[device][k])]
            results.append(CheckResult(f"quantizer {name}/{role}", not diff,
                                       "bit-identical" if not diff else f"differs in {diff}"))
    return results


def _quantizer(recipe: Any, role: str) -> Any:
    if getattr(recipe, "name", "") == "delayed":
        st = recipe.make_state(role)
        st.scale.fill_(4.0)  # a realistic non-unit scale
        return recipe.make_quantizer(role, True, True, state=st)
    if getattr(recipe, "name", "") == "nvfp4":
        # stochastic rounding on a fixed stream, so both devices draw the same bits
        return recipe.make_quantizer(role, True, True, generator=torch.Generator().manual_seed(7))
    return recipe.make_quantizer(role, True, True)


_SHORT = ["logging.progress=false", "train.global_batch_size=4", "train.micro_batch_size=2",
          "model.seq_length=64", "data.builtin_max_mb=1"]


def compare_recipe(recipe: str, steps: int = 20, overrides: tuple[str, ...] = ()) -> CheckResult:
    """``recipe`` for ``steps`` steps on the CPU and on CUDA; losses within LOSS_RTOL."""
    from lptrain.testing.parity import train_steps

    ov = [*_SHORT, *overrides]
    cpu = train_steps(recipe, [*ov, "run.device=cpu"], steps=steps)["losses"]
    cuda = train_steps(recipe, [*ov, "run.device=cuda"], steps=steps)["losses"]
    rel = max(abs(a - b) / max(abs(a), 1e-12) for a, b in zip(cpu, cuda, strict=True))
    ok = rel <= LOSS_RTOL and all(x == x for x in cuda)
    return CheckResult(f"recipe {recipe} ({steps} steps)", ok,
                       f"max rel loss diff {rel:.2e} (tol {LOSS_RTOL:g}); final {cpu[-1]:.4f} cpu, "
                       f"{cuda[-1]:.4f} cuda")


@dataclass
class Throughput:
    tokens_per_s: float
    mfu: Optional[float]
    peak_bytes: int
    estimated_bytes: int
    device: str

    def lines(self) -> list[str]:
        mfu = f"{100 * self.mfu:.1f}% of the bf16 peak" if self.mfu is not None else "MFU n/a (unknown peak)"
        ratio = self.peak_bytes / max(self.estimated_bytes, 1)
        return [f"throughput on {self.device}: {self.tokens_per_s:,.0f} tokens/s, {mfu}",
                f"peak memory {self.peak_bytes / 2**30:.2f} GiB vs estimate-memory "
                f"{self.estimated_bytes / 2**30:.2f} GiB ({ratio:.2f}x)"]


MEDIUM = ["model.num_layers=8", "model.hidden_size=1024", "model.ffn_hidden_size=4096",
          "model.num_attention_heads=16", "model.num_query_groups=16", "model.seq_length=1024",
          "train.micro_batch_size=4", "train.global_batch_size=8", "data.builtin_max_mb=8",
          "logging.progress=false", "run.device=cuda"]


def throughput(steps: int = 10, overrides: tuple[str, ...] = ()) -> Throughput:
    """A medium bf16 GPT (8x1024, seq 1024) on CUDA: tokens/s, MFU, peak memory vs plan."""
    from lptrain.config import World, derive
    from lptrain.config.compose import load
    from lptrain.data import build_train_valid_loaders
    from lptrain.memory.plan import estimate_memory
    from lptrain.model.flops import flops_per_token
    from lptrain.train.engine import TrainEngine
    from lptrain.train.metrics import compute_class, peak_flops

    cfg = derive(load("tiny_cpu.yaml", [*MEDIUM, *overrides]).cfg, World.detect())
    torch.cuda.reset_peak_memory_stats()
    engine = TrainEngine(cfg)
    t = cfg.train
    it, _ = build_train_valid_loaders(cfg.data, seq_length=cfg.model.seq_length,
                                      micro_batch_size=t.micro_batch_size,
                                      global_batch_size=t.global_batch_size, dp_rank=0, dp_size=1,
                                      vocab_size=cfg.model.vocab_size)
    n = t.global_batch_size // t.micro_batch_size
    engine.train_step([next(it) for _ in range(n)], 1)  # warm-up: lazy state, kernels
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for step in range(2, steps + 2):
        engine.train_step([next(it) for _ in range(n)], step)
    torch.cuda.synchronize()
    tps = steps * t.global_batch_size * cfg.model.seq_length / (time.perf_counter() - t0)
    peak = peak_flops(engine.device, compute_class(cfg))
    mfu = flops_per_token(cfg.model).total * tps / peak if peak else None
    world = World.detect(dp=1)
    estimate = estimate_memory(cfg, 1, target=world.target)
    return Throughput(tps, mfu, torch.cuda.max_memory_allocated(), estimate.worst.total,
                      torch.cuda.get_device_name())
