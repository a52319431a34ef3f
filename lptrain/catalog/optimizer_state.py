"""Megatron-LM's precision-aware optimizer: the dtypes it stores, and who holds the masters.

Torch-free facts shared by the configuration (the keys' allowed values, the rules, the memory
planner) and the optimizer code (:mod:`lptrain.optim.precision_aware`). The keys are
Megatron-LM's (``--use-precision-aware-optimizer``, ``--main-grads-dtype``,
``--main-params-dtype``, ``--exp-avg-dtype``, ``--exp-avg-sq-dtype``,
``--store-param-remainders``); Transformer Engine's ``FusedAdam`` does the math, and these are
the facts of its source (``transformer_engine/pytorch/optimizers/fused_adam.py`` and the
``multi_tensor_adam`` kernels):

* a state dtype is a *storage* dtype: the kernel reads every state into fp32, computes in
  fp32, and stores the result back; fp16 and fp8 (E4M3) states carry one fp32 scale per
  optimizer tensor (``absmax / (65504 / 2)`` and ``absmax / 448``, recomputed after every
  step from the new fp32 values); bf16 states are plain round-to-nearest-even casts;
* Megatron hands TE the masters (``master_weights=True``) when the main params are fp16, or
  when no FP8 GEMM recipe other than delayed scaling runs (``use_precision_aware_optimizer_
  no_fp8_or_ds_fp8``); otherwise Megatron keeps fp32 masters itself and TE steps them;
* with TE holding fp32 masters of bf16 params, ``store_param_remainders`` keeps only the low
  16 bits of each master (an int16); the high 16 bits are the bf16 parameter itself, rounded
  half away from zero (TE's split), so the fp32 master is rebuilt exactly;
* the main grads are the grad buffer: bf16 main grads are accumulated and reduced in bf16 (a
  bf16 grad buffer), which the kernel reads directly.
"""

from __future__ import annotations

from typing import Optional

# The allowed values of the keys (Megatron's argparse choices).
STATE_DTYPES = ("fp32", "fp16", "bf16", "fp8")
MAIN_GRADS_DTYPES = ("fp32", "bf16")
MAIN_PARAMS_DTYPES = ("fp32", "fp16")
STATE_KEYS = ("optimizer.exp_avg_dtype", "optimizer.exp_avg_sq_dtype")
DTYPE_KEYS = ("optimizer.main_grads_dtype", "optimizer.main_params_dtype", *STATE_KEYS)

# Bytes per element of each stored dtype, and the fp32 scales a non-fp32 dtype adds per
# optimizer tensor (a shard piece: the per-tensor scale is per tensor TE steps): FusedAdam's
# scale (kept for bf16 states too, unused), and for FP8 the quantizer's scale and the
# tensor's scale_inv (TE's Float8Quantizer also keeps a 4-byte amax the emulation has no use for).
BYTES = {"fp32": 4, "fp16": 2, "bf16": 2, "fp8": 1}
SCALED = ("fp16", "fp8")
SCALE_BYTES = {"bf16": 4, "fp16": 4, "fp8": 12}
# A remainder master: the bf16 parameter holds the high half, the optimizer an int16.
REMAINDER_BYTES = 2
# Largest magnitude TE scales a state to: fp16's max / 2 (headroom for the next step) and
# E4M3's max (the FP8 states are E4M3).
SCALED_RANGE = {"fp16": 65504.0 / 2.0, "fp8": 448.0}

# Transformer Engine releases (TE's git history): FusedAdam takes master_weight_dtype,
# exp_avg_dtype, exp_avg_sq_dtype and use_decoupled_grad from 1.13 (older than lptrain's
# oldest TE, 2.2), store_param_remainders from 2.1, bf16 moments from 2.3.
BF16_MOMENTS_MIN_TE = "2.3"

# Quantized GEMM recipes under which lptrain keeps the fp32 masters itself (TE steps them):
# Megatron's FP8 recipes other than delayed scaling, whose primary weights are requantized
# from masters Megatron owns. NVFP4 joins them: Megatron's test reads only the FP8 recipe,
# and it hands TE no shard of an NVFP4 primary weight to hold a master of.
LPTRAIN_HELD_RECIPES = ("tensorwise", "blockwise", "mxfp8", "nvfp4")


def te_holds_masters(precision_aware: bool, main_params_dtype: str, recipe: Optional[str]) -> bool:
    """Whether TE's FusedAdam holds the masters (``master_weights=True``): Megatron's
    ``use_precision_aware_optimizer_no_fp8_or_ds_fp8``. ``recipe`` is the quantized GEMM
    recipe in use (None for bf16 GEMMs)."""
    if not precision_aware:
        return False
    return main_params_dtype != "fp32" or recipe not in LPTRAIN_HELD_RECIPES


def remainders_apply(precision_aware: bool, main_params_dtype: str, recipe: Optional[str],
                     params_dtype: str) -> bool:
    """Whether ``store_param_remainders`` can take effect: TE holds fp32 masters of bf16
    params (TE ignores it otherwise)."""
    return (te_holds_masters(precision_aware, main_params_dtype, recipe)
            and main_params_dtype == "fp32" and params_dtype == "bf16")


def master_bytes(main_params_dtype: str, remainders: bool) -> int:
    """Bytes per element the optimizer keeps for a master weight."""
    if remainders:
        return REMAINDER_BYTES
    return BYTES[main_params_dtype]
