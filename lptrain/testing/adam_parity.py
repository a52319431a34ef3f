"""Transformer Engine's own ``FusedAdam`` against lptrain's :class:`~lptrain.precision.fused_adam.
EmulatedFusedAdam`, both built by :func:`lptrain.optim.precision_aware.fused_adam` (Megatron's
arguments) from the same parameters and gradients, stepped a few times and compared bit for bit:
the params, the fp32 masters and the checkpointed states.

TE's class runs on TE's own Python with its ``multi_tensor_adam*`` kernels emulated
(:mod:`lptrain.testing.te_python.kernels.adam`), so agreement says that TE's state handling
(the unscale / rescale around the kernel, the FP8 ``Float8Tensor`` moments, the fused bf16
moments of 2.14+, the remainder split) and lptrain's emulation of it are the same. Call inside
``virtual_gpu(..., te=True)``; used by the unit tests (newest release) and by the older
releases' subprocess checks.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from lptrain.config.schema import OptimizerConfig
from lptrain.optim.precision_aware import StatePrecision, fused_adam, master_value, piece_states

# name -> (exp_avg, exp_avg_sq, main_params, main_grads, remainders, TE holds the masters), and
# the TE kernel each reaches
CASES: dict[str, tuple[StatePrecision, str]] = {
    "bf16-params-remainders": (StatePrecision("fp32", "fp32", "fp32", "fp32", True, True),
                               "multi_tensor_adam_param_remainder"),
    "bf16-params-fp32-masters": (StatePrecision("fp32", "fp32", "fp32", "fp32", False, True), "multi_tensor_adam"),
    "bf16-params-fp16-masters": (StatePrecision("fp32", "fp32", "fp16", "fp32", False, True), "multi_tensor_adam"),
    "fp8-fp16-moments-remainders": (StatePrecision("fp8", "fp16", "fp32", "fp32", True, True),
                                    "multi_tensor_adam_param_remainder"),
    "bf16-moments-bf16-grads": (StatePrecision("bf16", "bf16", "fp32", "bf16", True, True),
                                "multi_tensor_adam_param_remainder"),
    "fp32-params-fp8-bf16-moments": (StatePrecision("fp8", "bf16", "fp32", "fp32", False, False),
                                     "multi_tensor_adam"),
}
KERNELS = ("multi_tensor_adam", "multi_tensor_adam_param_remainder", "multi_tensor_adam_fp8",
           "multi_tensor_adam_capturable", "multi_tensor_adam_capturable_master")


def _counting(opt: Any, calls: list[str]) -> None:
    """Record which of TE's kernels ``opt.step`` launches (FusedAdam keeps them as attributes)."""
    for name in KERNELS:
        fn = getattr(opt, name, None)
        if fn is None:
            continue

        def wrapped(*args: Any, _fn: Callable[..., Any] = fn, _name: str = name) -> Any:
            calls.append(_name)
            return _fn(*args)

        setattr(opt, name, wrapped)


def _bits(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().contiguous()
    ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}
    return t.view(ints[t.element_size()]) if t.is_floating_point() else t


def run(sp: StatePrecision, cfg: OptimizerConfig, backend: str, steps: int = 3,
        shapes: tuple[tuple[int, ...], ...] = ((48, 40), (40,), (8, 40))) -> tuple[Any, list[torch.Tensor], list[str]]:
    """Build ``backend``'s FusedAdam (``te``: TE's own) over params of ``shapes`` (the first two
    decayed) and step it ``steps`` times with seeded gradients; (optimizer, params, TE kernels
    launched)."""
    sp = StatePrecision(**{**sp.__dict__, "backend": backend})
    gen = torch.Generator().manual_seed(0)
    dtype = torch.bfloat16 if sp.te_holds_masters else torch.float32
    grad_dtype = torch.bfloat16 if sp.main_grads == "bf16" else torch.float32
    params = [(torch.randn(s, generator=gen) * 0.05).to(dtype).cuda() for s in shapes]
    opt = fused_adam(params[:2], params[2:], cfg, sp)
    calls: list[str] = []
    _counting(opt, calls)
    for _ in range(steps):
        for p in params:
            g = (torch.randn(p.shape, generator=gen) * 0.01).to(grad_dtype).cuda()
            if sp.te_holds_masters:
                p.decoupled_grad = g  # type: ignore[attr-defined]
            else:
                p.grad = g
        opt.step()
    return opt, params, calls


def mismatches(cfg: OptimizerConfig, cases: dict[str, tuple[StatePrecision, str]] = CASES,
               steps: int = 3) -> list[str]:
    """Every difference between TE's FusedAdam and the emulation over ``cases`` (empty: bitwise
    the same), and every case whose TE step did not launch its kernel."""
    out: list[str] = []
    for name, (sp, kernel) in cases.items():
        te_opt, te_params, calls = run(sp, cfg, "te", steps)
        em_opt, em_params, _ = run(sp, cfg, "emulated", steps)
        if set(calls) != {kernel}:
            out.append(f"{name}: TE launched {sorted(set(calls))}, expected {kernel}")
        sp_te = StatePrecision(**{**sp.__dict__, "backend": "te"})
        for i, (a, b) in enumerate(zip(te_params, em_params, strict=True)):
            if not torch.equal(_bits(a), _bits(b)):
                out.append(f"{name}: param {i}")
            if not torch.equal(_bits(master_value(te_opt, a)), _bits(master_value(em_opt, b))):
                out.append(f"{name}: master {i}")
            sa, sb = piece_states(te_opt, a, sp_te), piece_states(em_opt, b, sp)
            for key in sorted(set(sa) | set(sb)):
                if key not in sa or key not in sb or not torch.equal(_bits(sa[key]), _bits(sb[key])):
                    out.append(f"{name}: {key} {i}")
    return out
