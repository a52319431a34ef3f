"""Keys that would have no effect: a setting that is accepted is honoured, so a value that
changes nothing in its context is refused, naming what makes it inert and how to fix it.

Each rule here is a *gate*: some keys (``keys``) do nothing while a condition (``idle``) holds
-- MoE settings on a dense model, delayed-scaling settings without delayed scaling, Muon
settings under AdamW. When the condition holds and any of those keys differs from its neutral
value (the schema default, unless the gate names other values that mean "off"), the rule
reports exactly the keys that are set. The same gates give :func:`inert_keys`, the list of
keys a config leaves inert, which ``docs/rules.md`` shows for every shipped recipe.

``tests/unit/config/test_key_effects.py`` checks the other direction for every schema key and
every recipe: a changed value is either refused by one of these rules or changes something
observable (model, buffer layout, optimizer, resolved settings, first steps).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import cache
from typing import Any

from lptrain.catalog import optimizer_state as pao
from lptrain.catalog import recipes as catalog_recipes
from lptrain.config.rules import Rule, get_key, is_moe, layer_wise, quant_recipe, quant_spec, runs
from lptrain.config.rulesets.optim_state import remainders_possible
from lptrain.config.schema import LPTrainConfig, one_of, show_value
from lptrain.config.world import World

S = "Keys that would have no effect"
# Shown under the section's heading on docs/rules.md (lptrain.config.render).
SECTION_NOTE = (
    "Each of these errors becomes a warning naming both layers when the key still had an "
    "effect in the layer that set it and a later layer turned it off (a command-line override "
    "over the recipe, a recipe's own values over its fragments): `lptrain validate-config "
    "--recipe moe_mxfp8.yaml precision.fp8_format=null precision.fp8_param_gather=false "
    "ddp.reuse_grad_buf_for_mxfp8_param_ag=false` is the bf16 baseline of that recipe, and its "
    "`precision.fp8_recipe=mxfp8` a warning. A key set in the same layer as the switch that "
    "disables it, or after it, stays an error (`lptrain.config.layers`)."
)

Idle = Callable[[LPTrainConfig, World], bool]


@cache
def schema_default(key: str) -> Any:
    return get_key(LPTrainConfig(), key)


@dataclass(frozen=True)
class Gate:
    """``keys`` have no effect while ``idle(cfg, world)``; ``because`` says why (formatted
    with ``cfg``), ``fix`` how to get rid of the setting or give it an effect."""

    rule_id: str
    keys: tuple[str, ...]
    context: tuple[str, ...]  # the keys that make them inert
    idle: Idle
    condition: str  # for the catalog: "<context> -> <keys> at their defaults"
    because: str
    fix: str
    # Values besides the schema default that also leave a key without effect here.
    also_neutral: dict[str, tuple[Any, ...]] = field(default_factory=dict)
    # A neutral value computed from the config (replaces the schema default), for derived keys.
    neutral_of: dict[str, Callable[[LPTrainConfig], Any]] = field(default_factory=dict)

    def neutral(self, cfg: LPTrainConfig, key: str) -> tuple[Any, ...]:
        base = self.neutral_of[key](cfg) if key in self.neutral_of else schema_default(key)
        return (base, *self.also_neutral.get(key, ()))

    def set_keys(self, cfg: LPTrainConfig) -> list[str]:
        """The gated keys whose values differ from every neutral value."""
        return [k for k in self.keys if get_key(cfg, k) not in self.neutral(cfg, k)]

    def when(self, cfg: LPTrainConfig, world: World) -> dict[str, Any]:
        if not self.idle(cfg, world):
            return {}
        return self.report(cfg, self.set_keys(cfg))

    def report(self, cfg: LPTrainConfig, bad: Sequence[str]) -> dict[str, Any]:
        """The rule's fields for the set keys ``bad`` ({} when there are none)."""
        if not bad:
            return {}
        shown = ", ".join(f"{k}={show_value(get_key(cfg, k))}" for k in bad)
        defaults = ", ".join(f"{k}={show_value(self.neutral(cfg, k)[0])}" for k in bad)
        return {"keys": tuple(bad), "settings": shown, "defaults": defaults,
                "recipe": quant_recipe(cfg) or "none"}

    def rule(self) -> Rule:
        return Rule(
            id=self.rule_id, severity="error", keys=(*self.keys, *self.context), when=self.when,
            message="{settings} would have no effect: " + self.because,
            fix="remove the setting (back to {defaults}), or " + self.fix, condition=self.condition,
            why="a setting that is accepted must be honoured: refused instead of silently ignored",
            section=S,
        )


def _dense(c: LPTrainConfig, w: World) -> bool:
    return not is_moe(c)


def _all_layers_moe(c: LPTrainConfig) -> bool:
    m = c.model
    freq = max(1, m.moe.moe_layer_freq)
    return is_moe(c) and all(i % freq == 0 for i in range(m.num_layers))


def _dense_ffn_unused(c: LPTrainConfig, w: World) -> bool:
    # Every layer is an MoE layer and the experts have their own width: no MLP reads
    # model.ffn_hidden_size (experts default to it only when moe.ffn_hidden_size is null).
    m = c.model
    return _all_layers_moe(c) and m.moe.ffn_hidden_size not in (None, m.ffn_hidden_size)


# The recipes that read the delayed-scaling keys, and those that read amax_epsilon.
DELAYED = [s.name for s in catalog_recipes.RECIPES if s.amax_history]
CURRENT_AMAX = [s.name for s in catalog_recipes.RECIPES if s.current_amax]


def _not_delayed(c: LPTrainConfig, w: World) -> bool:
    spec = quant_spec(c)
    return not (runs(c, spec) and spec is not None and spec.amax_history)


def _no_current_amax(c: LPTrainConfig, w: World) -> bool:
    spec = quant_spec(c)
    return spec is None or not spec.current_amax


def scalar_optimizer(c: LPTrainConfig) -> str:
    """What optimizes the non-Muon params (``lptrain.optim.lion.scalar_optimizer_name``)."""
    return c.optimizer.muon.scalar_optimizer if c.optimizer.name == "muon" else "adamw"


def _builtin_unused(c: LPTrainConfig, w: World) -> bool:
    return bool(c.data.paths) or not str(c.data.source).startswith("builtin:")


MOE_ROUTING_KEYS = (
    "model.moe.router_topk", "model.moe.moe_layer_freq", "model.moe.grouped_gemm",
    "model.moe.single_grouped_weight", "model.moe.load_balancing_type",
    "model.moe.aux_loss_coeff", "model.moe.z_loss_coeff", "model.moe.score_function",
    "model.moe.enable_expert_bias", "model.moe.bias_update_rate",
)
MUON_KEYS = (
    "optimizer.muon.lr", "optimizer.muon.momentum", "optimizer.muon.nesterov",
    "optimizer.muon.ns_steps", "optimizer.muon.coefficients", "optimizer.muon.scale_mode",
    "optimizer.muon.extra_scale_factor", "optimizer.muon.split_qkv",
    "optimizer.muon.scalar_optimizer", "optimizer.muon.tp_mode",
)
DELAYED_KEYS = (
    "precision.fp8_margin", "precision.fp8_amax_history_len", "precision.fp8_amax_compute_algo",
)
NVFP4_KEYS = (
    "precision.nvfp4_rht", "precision.nvfp4_stochastic_rounding", "precision.nvfp4_2d_weights",
)
BF16_LAYER_COUNTS = ("precision.num_layers_at_start_in_bf16", "precision.num_layers_at_end_in_bf16")

GATES: tuple[Gate, ...] = (
    Gate(
        rule_id="MOE-EP-NEEDS-EXPERTS", keys=("model.moe.expert_model_parallel_size",),
        context=("model.moe.num_experts",), idle=_dense,
        condition="num_experts == 0 -> expert_model_parallel_size == 1",
        because="the model has no experts (model.moe.num_experts=0), so expert parallelism would "
                "silently stay 1 (Megatron-LM refuses expert parallelism without experts)",
        fix="set model.moe.num_experts to a multiple of model.moe.expert_model_parallel_size",
    ),
    Gate(
        rule_id="MOE-FFN-NEEDS-EXPERTS", keys=("model.moe.ffn_hidden_size",),
        context=("model.moe.num_experts",), idle=_dense,
        condition="num_experts == 0 -> moe.ffn_hidden_size null",
        because="the model has no experts (model.moe.num_experts=0); every MLP is dense and "
                "model.ffn_hidden_size sets its width (Megatron-LM refuses moe_ffn_hidden_size "
                "without experts)",
        fix="set model.moe.num_experts > 0, or size the dense MLP with model.ffn_hidden_size",
    ),
    Gate(
        rule_id="INERT-MOE-DENSE", keys=MOE_ROUTING_KEYS, context=("model.moe.num_experts",),
        idle=_dense, condition="num_experts == 0 -> router and expert settings at their defaults",
        because="the model has no experts (model.moe.num_experts=0), so there is no router and no "
                "expert layer",
        fix="set model.moe.num_experts > 0 to build MoE layers",
    ),
    Gate(
        rule_id="INERT-MOE-LB-TYPE", keys=("model.moe.load_balancing_type",),
        context=("model.moe.aux_loss_coeff",),
        idle=lambda c, w: is_moe(c) and c.model.moe.aux_loss_coeff == 0,
        condition="MoE with aux_loss_coeff == 0 -> load_balancing_type aux_loss or none",
        because="model.moe.aux_loss_coeff=0 turns the load-balancing loss off",
        fix="set model.moe.aux_loss_coeff > 0",
        also_neutral={"model.moe.load_balancing_type": ("none",)},
    ),
    Gate(
        rule_id="INERT-MOE-AUX-COEFF", keys=("model.moe.aux_loss_coeff",),
        context=("model.moe.load_balancing_type",),
        idle=lambda c, w: is_moe(c) and c.model.moe.load_balancing_type == "none",
        condition="MoE with load_balancing_type=none -> aux_loss_coeff == 0",
        because="model.moe.load_balancing_type=none computes no load-balancing loss to weight",
        fix="set model.moe.load_balancing_type=aux_loss (or seq_aux_loss)",
    ),
    Gate(
        rule_id="INERT-MOE-BIAS-RATE", keys=("model.moe.bias_update_rate",),
        context=("model.moe.enable_expert_bias",),
        idle=lambda c, w: is_moe(c) and not c.model.moe.enable_expert_bias,
        condition="MoE without enable_expert_bias -> bias_update_rate at its default",
        because="there is no expert bias to update (model.moe.enable_expert_bias=false)",
        fix="set model.moe.enable_expert_bias=true (with score_function sigmoid or sqrtsoftplus)",
    ),
    Gate(
        rule_id="INERT-DENSE-FFN", keys=("model.ffn_hidden_size",),
        context=("model.moe.num_experts", "model.moe.moe_layer_freq", "model.moe.ffn_hidden_size"),
        idle=_dense_ffn_unused,
        condition="every layer MoE (moe_layer_freq=1) with its own moe.ffn_hidden_size -> "
                  "ffn_hidden_size at its default (4 * hidden_size)",
        because="every layer is an MoE layer "
                "(model.moe.moe_layer_freq={cfg.model.moe.moe_layer_freq}) and the experts' width "
                "is model.moe.ffn_hidden_size={cfg.model.moe.ffn_hidden_size}, so no MLP reads "
                "model.ffn_hidden_size",
        fix="set model.moe.moe_layer_freq > 1 to keep dense layers, or size the experts with "
            "model.moe.ffn_hidden_size only",
        neutral_of={"model.ffn_hidden_size": lambda c: 4 * c.model.hidden_size},
    ),
    Gate(
        rule_id="INERT-FP8-RECIPE", keys=("precision.fp8_recipe",),
        context=("precision.fp8_format",), idle=lambda c, w: c.precision.fp8_format is None,
        condition="fp8_format null -> fp8_recipe at its default",
        because="precision.fp8_format is null, so no GEMM runs in FP8",
        fix="set precision.fp8_format=e4m3 (or hybrid)",
    ),
    Gate(
        rule_id="INERT-DELAYED-SCALING", keys=DELAYED_KEYS,
        context=("precision.fp8_format", "precision.fp8_recipe"), idle=_not_delayed,
        condition=f"not (fp8_format set and fp8_recipe={'/'.join(DELAYED)}) -> margin and amax "
                  "history settings at their defaults",
        because=f"only delayed scaling (an fp8_format with fp8_recipe={'/'.join(DELAYED)}) keeps "
                "an amax history and a margin; the quantized recipe here is {recipe}",
        fix=f"use precision.fp8_recipe={one_of(DELAYED)} with an fp8_format",
    ),
    Gate(
        rule_id="INERT-AMAX-EPSILON", keys=("precision.amax_epsilon",),
        context=("precision.fp8_format", "precision.fp8_recipe", "precision.fp4_format"),
        idle=_no_current_amax,
        condition=f"quantized recipe not {'/'.join(CURRENT_AMAX)} -> amax_epsilon == 0",
        because=f"only {one_of(CURRENT_AMAX, last='and')} FP8 divide by a current amax; the "
                "quantized recipe here is {recipe}",
        fix=f"use precision.fp8_recipe={one_of(CURRENT_AMAX)}",
    ),
    Gate(
        rule_id="INERT-QUANTIZED-GEMM", keys=("precision.quantized_gemm",),
        context=("precision.fp8_format", "precision.fp4_format"),
        idle=lambda c, w: quant_recipe(c) is None,
        condition="no quantized recipe -> quantized_gemm auto or dequantized",
        because="no GEMM is quantized (fp8_format and fp4_format are null)",
        fix="set precision.fp8_format (or fp4_format) to quantize the GEMMs",
        also_neutral={"precision.quantized_gemm": ("dequantized",)},
    ),
    Gate(
        rule_id="INERT-NVFP4-KEYS", keys=NVFP4_KEYS, context=("precision.fp4_format",),
        idle=lambda c, w: c.precision.fp4_format is None,
        condition="fp4_format null -> nvfp4_* switches at their defaults",
        because="precision.fp4_format is null, so nothing is quantized to NVFP4",
        fix="set precision.fp4_format=e2m1",
    ),
    Gate(
        rule_id="INERT-BF16-LAYERS", keys=("precision.first_last_layers_bf16", *BF16_LAYER_COUNTS),
        context=("precision.fp8_format", "precision.fp4_format"),
        idle=lambda c, w: quant_recipe(c) is None,
        condition="no quantized recipe -> first_last_layers_bf16 and the bf16 layer counts at "
                  "their defaults",
        because="no GEMM is quantized (fp8_format and fp4_format are null), so every layer already "
                "runs in bf16",
        fix="set precision.fp8_format or precision.fp4_format",
    ),
    Gate(
        rule_id="INERT-BF16-LAYER-COUNTS", keys=BF16_LAYER_COUNTS,
        context=("precision.first_last_layers_bf16",),
        idle=lambda c, w: quant_recipe(c) is not None and not c.precision.first_last_layers_bf16,
        condition="first_last_layers_bf16=false -> the bf16 layer counts at their defaults",
        because="precision.first_last_layers_bf16=false keeps every layer quantized",
        fix="set precision.first_last_layers_bf16=true",
    ),
    Gate(
        rule_id="INERT-LAYERWISE-LAYOUT", keys=("optimizer.layer_wise_param_layout",),
        context=("optimizer.name", "ddp.use_distributed_optimizer"),
        idle=lambda c, w: not layer_wise(c),
        condition="no layer-wise optimizer -> layer_wise_param_layout at its default",
        because="the layer-wise distributed optimizer is not in use (it is Muon with "
                "ddp.use_distributed_optimizer=true)",
        fix="set optimizer.name=muon and ddp.use_distributed_optimizer=true",
    ),
    Gate(
        rule_id="INERT-MUON-KEYS", keys=MUON_KEYS, context=("optimizer.name",),
        idle=lambda c, w: c.optimizer.name != "muon",
        condition="optimizer.name != muon -> optimizer.muon.* at their defaults",
        because="optimizer.name={cfg.optimizer.name} does not use Muon",
        fix="set optimizer.name=muon",
    ),
    Gate(
        rule_id="INERT-MUON-TP-MODE", keys=("optimizer.muon.tp_mode",),
        context=("model.tensor_model_parallel_size",),
        idle=lambda c, w: c.optimizer.name == "muon" and c.model.tensor_model_parallel_size <= 1,
        condition="muon and tensor_model_parallel_size=1 -> muon.tp_mode at its default",
        because="without tensor parallelism every Muon matrix is whole on its rank: there is "
                "nothing to gather or scatter",
        fix="set model.tensor_model_parallel_size > 1",
    ),
    Gate(
        rule_id="INERT-ADAMW-KEYS",
        keys=("optimizer.adam_beta1", "optimizer.adam_beta2", "optimizer.adam_eps"),
        context=("optimizer.name", "optimizer.muon.scalar_optimizer"),
        idle=lambda c, w: scalar_optimizer(c) != "adamw",
        condition="Muon with scalar_optimizer=lion -> adam_* at their defaults",
        because="no param is optimized by AdamW (Muon takes the matrices, Lion the rest: "
                "optimizer.muon.scalar_optimizer=lion)",
        fix="set optimizer.muon.scalar_optimizer=adamw",
    ),
    Gate(
        rule_id="INERT-LION-KEYS", keys=("optimizer.lion_beta1", "optimizer.lion_beta2"),
        context=("optimizer.name", "optimizer.muon.scalar_optimizer"),
        idle=lambda c, w: scalar_optimizer(c) != "lion",
        condition="not (optimizer.name=muon and muon.scalar_optimizer=lion) -> lion_* at their "
                  "defaults",
        because="no param is optimized by Lion (it is Muon's optimizer for non-matrix params: "
                "optimizer.name=muon with optimizer.muon.scalar_optimizer=lion)",
        fix="set optimizer.name=muon and optimizer.muon.scalar_optimizer=lion",
    ),
    Gate(
        rule_id="PAO-DTYPES-NEED-PAO", keys=pao.DTYPE_KEYS,
        context=("optimizer.use_precision_aware_optimizer",),
        idle=lambda c, w: not c.optimizer.use_precision_aware_optimizer,
        condition="not use_precision_aware_optimizer -> main_grads_dtype, main_params_dtype, "
                  "exp_avg_dtype and exp_avg_sq_dtype fp32",
        because="the precision-aware optimizer is off (optimizer.use_precision_aware_optimizer="
                "false), so every optimizer tensor stays fp32 (Megatron-LM: '... can only be fp32 "
                "when not using precision-aware optimizer')",
        fix="set optimizer.use_precision_aware_optimizer=true (with a distributed optimizer)",
    ),
    Gate(
        rule_id="INERT-PAO-REMAINDERS", keys=("optimizer.store_param_remainders",),
        context=("optimizer.use_precision_aware_optimizer", "optimizer.main_params_dtype",
                 "precision.params_dtype", "precision.fp8_recipe"),
        idle=lambda c, w: not remainders_possible(c),
        condition="not (use_precision_aware_optimizer, main_params_dtype=fp32, params_dtype=bf16 "
                  "and TE holding the masters) -> store_param_remainders false",
        because="TE keeps remainders only of fp32 masters it holds of bf16 params "
                "(use_precision_aware_optimizer=true, main_params_dtype=fp32, params_dtype=bf16, "
                "and no quantized recipe among "
                f"{', '.join(pao.LPTRAIN_HELD_RECIPES)}); here use_precision_aware_optimizer="
                "{cfg.optimizer.use_precision_aware_optimizer}, main_params_dtype="
                "{cfg.optimizer.main_params_dtype}, params_dtype={cfg.precision.params_dtype}, "
                "recipe {recipe}",
        fix="use the precision-aware optimizer with fp32 main params on bf16 params and bf16 or "
            "delayed-scaling GEMMs",
        neutral_of={"optimizer.store_param_remainders": lambda c: False},
        also_neutral={"optimizer.store_param_remainders": (None,)},
    ),
    Gate(
        rule_id="INERT-PAO-FP32-PARAMS",
        keys=("optimizer.main_grads_dtype", "optimizer.main_params_dtype"),
        context=("precision.params_dtype", "optimizer.use_precision_aware_optimizer"),
        idle=lambda c, w: c.optimizer.use_precision_aware_optimizer and c.precision.params_dtype == "fp32",
        condition="use_precision_aware_optimizer and params_dtype=fp32 -> main_grads_dtype and "
                  "main_params_dtype fp32",
        because="precision.params_dtype=fp32: the grads of fp32 params are fp32 and fp32 params "
                "are their own masters (FusedAdam updates them in place)",
        fix="set precision.params_dtype=bf16",
    ),
    Gate(
        rule_id="INERT-CONSTANT-LR", keys=("optimizer.min_lr", "optimizer.decay_iters"),
        context=("optimizer.lr_schedule",), idle=lambda c, w: c.optimizer.lr_schedule == "constant",
        condition="lr_schedule=constant -> min_lr and decay_iters at their defaults",
        because="optimizer.lr_schedule=constant never decays the lr",
        fix="set optimizer.lr_schedule to cosine, linear or wsd",
    ),
    Gate(
        rule_id="INERT-BUILTIN-DATA", keys=("data.builtin_max_mb", "data.cache_dir"),
        context=("data.source", "data.paths"), idle=_builtin_unused,
        condition="no built-in corpus in use -> builtin_max_mb and cache_dir at their defaults",
        because="they size and place a built-in corpus, and none is read "
                "(data.source={cfg.data.source}, data.paths={cfg.data.paths})",
        fix="use data.source=builtin:python-stdlib without data.paths",
    ),
    Gate(
        rule_id="INERT-DATA-SOURCE", keys=("data.source",), context=("data.paths",),
        idle=lambda c, w: bool(c.data.paths),
        condition="data.paths set -> data.source at its default",
        because="data.paths wins over data.source", fix="put every dataset into data.paths",
    ),
    Gate(
        rule_id="INERT-DATA-WEIGHTS", keys=("data.weights",), context=("data.paths",),
        idle=lambda c, w: len(c.data.paths) < 2,
        condition="fewer than 2 data.paths -> data.weights empty",
        because="there is no blend to weight (one dataset)",
        fix="list two or more datasets in data.paths",
    ),
    Gate(
        rule_id="INERT-CKPT-NO-SAVE",
        keys=("checkpoint.keep_latest", "checkpoint.save_on_interrupt"),
        context=("checkpoint.save",), idle=lambda c, w: not c.checkpoint.save,
        condition="checkpoint.save null -> keep_latest and save_on_interrupt at their defaults",
        because="checkpoint.save is null, so no checkpoint is written",
        fix="set checkpoint.save=<folder>",
    ),
    Gate(
        rule_id="INERT-CKPT-NO-RESUME",
        keys=("checkpoint.load_optimizer", "optimizer.override_opt_param_scheduler",
              "optimizer.use_checkpoint_opt_param_scheduler"),
        context=("checkpoint.save", "checkpoint.load"),
        idle=lambda c, w: not c.checkpoint.save and not c.checkpoint.load,
        condition="checkpoint.save and checkpoint.load null -> load_optimizer, "
                  "override_opt_param_scheduler and use_checkpoint_opt_param_scheduler at their defaults",
        because="neither checkpoint.save nor checkpoint.load is set, so no checkpoint is resumed",
        fix="set checkpoint.load=<folder> (or checkpoint.save) to resume from a checkpoint",
    ),
    Gate(
        rule_id="INERT-WANDB-KEYS", keys=("logging.wandb_project", "logging.wandb_mode"),
        context=("logging.wandb",), idle=lambda c, w: not c.logging.wandb,
        condition="logging.wandb=false -> wandb_project and wandb_mode at their defaults",
        because="logging.wandb=false starts no W&B run", fix="set logging.wandb=true",
    ),
    Gate(
        rule_id="INERT-SPIKE-WINDOW", keys=("train.spike_window", "train.spiky_loss_factor",
                                            "train.uniform_loss_factor"),
        context=("train.spike_zscore", "train.check_for_spiky_loss"),
        idle=lambda c, w: c.train.spike_zscore is None and not c.train.check_for_spiky_loss,
        condition="spike_zscore null and check_for_spiky_loss false -> spike_window, "
                  "spiky_loss_factor and uniform_loss_factor at their defaults",
        because="train.spike_zscore=null and train.check_for_spiky_loss=false judge no loss",
        fix="set train.check_for_spiky_loss=true (or train.spike_zscore, e.g. 6) to judge losses",
    ),
    Gate(
        rule_id="INERT-MAX-ROLLBACKS", keys=("train.max_rollbacks",),
        context=("train.on_anomaly",), idle=lambda c, w: c.train.on_anomaly != "rollback",
        condition="on_anomaly != rollback -> max_rollbacks at its default",
        because="train.on_anomaly={cfg.train.on_anomaly} never rolls back",
        fix="set train.on_anomaly=rollback",
    ),
    Gate(
        rule_id="INERT-DEBUG-NAN", keys=("debug.nan_module", "debug.nan_tensor"),
        context=("debug.nan_sample",), idle=lambda c, w: c.debug.nan_sample is None,
        condition="nan_sample null -> nan_module and nan_tensor at their defaults",
        because="debug.nan_sample=null injects no NaN",
        fix="set debug.nan_sample=<a global sample position>",
    ),
    Gate(
        rule_id="INERT-CP-KEYS", keys=("model.cp_comm_type", "model.hierarchical_context_parallel_sizes"),
        context=("model.context_parallel_size",),
        idle=lambda c, w: max(1, c.model.context_parallel_size) <= 1,
        condition="context_parallel_size == 1 -> cp_comm_type p2p, hierarchical_context_parallel_sizes null",
        because="model.context_parallel_size=1 splits no sequence: attention exchanges nothing",
        fix="set model.context_parallel_size > 1",
    ),
    Gate(
        rule_id="INERT-CP-HIERARCHICAL", keys=("model.hierarchical_context_parallel_sizes",),
        context=("model.cp_comm_type",),
        idle=lambda c, w: max(1, c.model.context_parallel_size) > 1 and c.model.cp_comm_type != "a2a+p2p",
        condition="cp_comm_type != a2a+p2p -> hierarchical_context_parallel_sizes null",
        because="only cp_comm_type=a2a+p2p has two levels (Megatron-LM reads the sizes for it)",
        fix="set model.cp_comm_type=a2a+p2p",
    ),
    Gate(
        rule_id="INERT-RECOMPUTE-FULL", keys=("model.recompute_method", "model.recompute_num_layers"),
        context=("model.recompute_granularity",),
        idle=lambda c, w: c.model.recompute_granularity != "full",
        condition="recompute_granularity != full -> recompute_method and recompute_num_layers at "
                  "their defaults",
        because="only full recompute checkpoints whole layers "
                "(model.recompute_granularity={cfg.model.recompute_granularity})",
        fix="set model.recompute_granularity=full, or drop the full-recompute settings",
    ),
    Gate(
        rule_id="INERT-RECOMPUTE-SELECTIVE", keys=("model.recompute_modules",),
        context=("model.recompute_granularity",),
        idle=lambda c, w: c.model.recompute_granularity != "selective",
        condition="recompute_granularity != selective -> recompute_modules at its default",
        because="only selective recompute reads the module list "
                "(model.recompute_granularity={cfg.model.recompute_granularity})",
        fix="set model.recompute_granularity=selective, or drop model.recompute_modules",
    ),
)


RULES = [g.rule() for g in GATES]
INERT_RULE_IDS = frozenset(g.rule_id for g in GATES)
GATES_BY_ID = {g.rule_id: g for g in GATES}


@dataclass(frozen=True)
class InertKey:
    """A key that has no effect in a config, and the rule that refuses changing it."""

    key: str
    rule: str
    because: str


def inert_keys(cfg: LPTrainConfig, world: World, keys: Sequence[str] | None = None) -> list[InertKey]:
    """Every key (of ``keys``, default all gated ones) that ``cfg`` leaves without effect:
    changing it from its neutral value would be refused. ``cfg`` is derived first."""
    from lptrain.config.derive import derive

    cfg = derive(cfg, world)
    out: dict[str, InertKey] = {}
    for gate in GATES:
        if not gate.idle(cfg, world):
            continue
        because = gate.because.format(cfg=cfg, world=world, recipe=quant_recipe(cfg) or "none")
        for k in gate.keys:
            if (keys is None or k in keys) and k not in out:
                out[k] = InertKey(k, gate.rule_id, because)
    return list(out.values())
