"""The ``optimizer`` section of the schema: the optimizer, its schedule, Muon, and Megatron-LM's
precision-aware optimizer keys (:mod:`lptrain.catalog.optimizer_state`).

Its own module so the schema stays small; :mod:`lptrain.config.schema` re-exports everything.
"""

# opt_factory() is a dataclasses.field(default_factory=...) wrapper, not a shared default.
# ruff: noqa: RUF009

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from lptrain.catalog import muon_scaling, ns_coefficients
from lptrain.catalog import optimizer_state as pao
from lptrain.config.fields import choice, opt, opt_factory

MUON_COEFFICIENTS = tuple(ns_coefficients.COEFFICIENT_SETS)
MUON_SCALE_MODES = muon_scaling.SCALE_MODES
SCALAR_OPTIMIZERS = ("adamw", "lion")
OPTIMIZERS = ("adamw", "muon")
LR_SCHEDULES = ("cosine", "linear", "constant", "wsd")
LAYER_WISE_LAYOUTS = ("compact", "padded")
MUON_TP_MODES = ("duplicated", "distributed")


@dataclass
class MuonConfig:
    """Muon hyperparameters (for 2-D hidden matrices)."""

    lr: Optional[float] = opt(
        None,
        "Peak lr of the Muon group (null = optimizer.lr); the AdamW groups (embeddings, head, "
        "norms) keep optimizer.lr. Its min lr is optimizer.min_lr scaled by the same ratio.",
    )
    momentum: float = opt(0.95, "Momentum coefficient, in [0, 1).")
    nesterov: bool = opt(True, "Use Nesterov momentum.")
    ns_steps: int = opt(
        5,
        "Newton-Schulz iterations: simple >= 1, quintic a multiple of 5, polar_express >= 8, "
        "aol a multiple of 4.",
    )
    coefficients: str = choice("quintic", MUON_COEFFICIENTS, "Newton-Schulz coefficients: {choices}.")
    scale_mode: str = choice(
        "spectral", MUON_SCALE_MODES, "Update scaling: {choices}.",
        {"shape_scaling": "RMS 1/sqrt(fan_in): Keller-style lr ~0.02",
         "spectral": "update RMS 1: takes AdamW's lr",
         "unit_rms_norm": "as shape_scaling when fan_out >= fan_in"},
    )
    extra_scale_factor: float = opt(1.0, "Extra multiplier on the orthogonalized update.")
    split_qkv: bool = opt(True, "Orthogonalize Q, K and V separately.")
    tp_mode: str = choice(
        "duplicated", MUON_TP_MODES,
        "Newton-Schulz of a tensor-parallel matrix (tensor_model_parallel_size > 1): {choices}; "
        "both give the same update.",
        {"duplicated": "all-gather the shards, every TP rank orthogonalizes, keeps its slice",
         "distributed": "one TP rank per matrix orthogonalizes, then scatters the slices"},
    )
    scalar_optimizer: str = choice(
        "adamw", SCALAR_OPTIMIZERS,
        "Optimizer for the params Muon does not take (embeddings, output head, norms): {choices}.",
        {"lion": "at optimizer.lr, with optimizer.lion_beta1/lion_beta2"},
    )


@dataclass
class OptimizerConfig:
    """Optimizer and learning-rate schedule."""

    name: str = choice("adamw", OPTIMIZERS, "Optimizer: {choices}.")
    lr: float = opt(3e-4, "Peak learning rate.")
    min_lr: float = opt(3e-5, "Final learning rate of the decay.")
    weight_decay: float = opt(0.1, "Decoupled weight decay.")
    adam_beta1: float = opt(0.9, "AdamW beta1.")
    adam_beta2: float = opt(0.95, "AdamW beta2.")
    adam_eps: float = opt(1e-8, "AdamW epsilon.")
    lion_beta1: float = opt(
        0.95, "Lion beta1: weight of the momentum in the signed update (scalar_optimizer=lion)."
    )
    lion_beta2: float = opt(0.98, "Lion beta2: decay of Lion's momentum (scalar_optimizer=lion).")
    clip_grad: float = opt(1.0, "Global gradient-norm clip (0 = off).")
    lr_schedule: str = choice("cosine", LR_SCHEDULES, "LR decay: {choices}.")
    warmup_iters: int = opt(10, "Linear warmup iterations.")
    decay_iters: Optional[int] = opt(None, "Decay length; null = train.train_iters.")
    override_opt_param_scheduler: bool = opt(False, "On resume: this config's lr schedule from the "
                                             "step reached, where it differs from the checkpoint's.")
    use_checkpoint_opt_param_scheduler: bool = opt(False, "On resume: the checkpoint's lr schedule, "
                                                   "whatever this config's says.")
    layer_wise_param_layout: str = choice("compact", LAYER_WISE_LAYOUTS,
                                          "Layer-wise optimizer layout: {choices}.")
    use_layer_wise_optimizer: Optional[bool] = opt(
        None, "Derived: Muon + distributed optimizer use the layer-wise distributed optimizer."
    )
    muon: MuonConfig = opt_factory(MuonConfig, "Muon settings.")
    # Megatron-LM's precision-aware optimizer (lptrain.catalog.optimizer_state; docs/optimizer-state.md)
    use_precision_aware_optimizer: bool = opt(
        False, "Megatron's precision-aware optimizer: Transformer Engine's FusedAdam math with the "
        "main grads, master weights and moments below in lower precision (needs a distributed "
        "optimizer)."
    )
    main_grads_dtype: str = choice(
        "fp32", pao.MAIN_GRADS_DTYPES, "Grads the optimizer reads (the grad buffer): {choices}.",
        {"bf16": "accumulated, reduced and read in bf16"},
    )
    main_params_dtype: str = choice(
        "fp32", pao.MAIN_PARAMS_DTYPES, "Master weights: {choices}.",
        {"fp16": "with one fp32 scale per optimizer tensor; TE holds them"},
    )
    exp_avg_dtype: str = choice(
        "fp32", pao.STATE_DTYPES,
        "Stored dtype of Adam's first moment and Muon's momentum (the math stays fp32): {choices}.",
        {"fp16": "per-tensor scale", "fp8": "E4M3, per-tensor scale"},
    )
    exp_avg_sq_dtype: str = choice(
        "fp32", pao.STATE_DTYPES, "Stored dtype of Adam's second moment: {choices}.",
        {"fp16": "per-tensor scale", "fp8": "E4M3, per-tensor scale"},
    )
    store_param_remainders: Optional[bool] = opt(
        None, "fp32 masters of bf16 params kept as the bf16 param plus an int16 remainder (2 bytes "
        "instead of 4, the same 32 bits); null = derived: true where TE holds fp32 masters of bf16 "
        "params."
    )
