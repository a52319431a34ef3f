"""Precision rules: formats, recipes, quantized param gather, alignment, hardware, TE."""

from __future__ import annotations

from typing import Any

from lptrain.catalog import recipes as catalog_recipes
from lptrain.catalog.optimizer_state import BF16_MOMENTS_MIN_TE, STATE_KEYS
from lptrain.catalog.recipes import (
    GROUPED_AMAX_EPSILON_MIN_TE,
    SINGLE_GROUPED_WEIGHT_MIN_TE,
    TE_MIN_VERSION,
)
from lptrain.config.rules import (
    Rule,
    fp4_on,
    fp8_on,
    is_mxfp8,
    quant_spec,
    runs,
    sharded_optimizer,
)
from lptrain.config.rulesets.te_backend import (
    backend_missing,
    te_cuda_too_old,
    te_device_cpu,
    te_mxfp8_sm120,
    te_only,
    te_rht_needs_bf16,
    te_sm_too_old,
    te_too_old,
)
from lptrain.config.schema import LPTrainConfig
from lptrain.config.world import World

S = "Precision"


# Transformer Engine refuses, at the first quantized GEMM, a sequence-parallel input whose
# local rows (each rank's sequence slice) are not a multiple of 8 (its FP8 shape check).
SP_LOCAL_ROWS_ALIGN = 8


def _gemm_misaligned(c: LPTrainConfig, w: World) -> dict[str, Any]:
    """Every quantized GEMM dimension that is not a multiple of the recipe's block size,
    judged per tensor-parallel shard (what each rank's GEMM sees: TE checks the shard), and,
    under sequence parallelism, each rank's local rows."""
    spec = quant_spec(c)
    if spec is None:
        return {}
    recipe, align = spec.name, spec.alignment
    m = c.model
    tp = max(1, int(m.tensor_model_parallel_size or 1))
    per = f" / tensor_model_parallel_size {tp}" if tp > 1 else ""
    tp_keys = ("model.tensor_model_parallel_size",) if tp > 1 else ()
    dims: list[tuple[str, tuple[str, ...], str, int, int]] = [
        ("hidden (input of qkv and fc1, output of proj and fc2)", ("model.hidden_size",),
         "model.hidden_size", m.hidden_size, align),
    ]
    heads, groups = m.num_attention_heads, m.num_query_groups or m.num_attention_heads
    if heads > 0 and m.hidden_size % heads == 0:
        head_dim = m.hidden_size // heads
        dims.append((
            "attention qkv output", ("model.num_attention_heads", "model.num_query_groups", *tp_keys),
            f"(num_attention_heads + 2*num_query_groups) * head_dim{per}",
            (heads + 2 * groups) * head_dim // tp, align,
        ))
        dims.append(("attention proj input", ("model.num_attention_heads", *tp_keys),
                     f"num_attention_heads * head_dim{per}", heads * head_dim // tp, align))
    if m.ffn_hidden_size is not None:
        dims.append(("mlp fc1 output / fc2 input", ("model.ffn_hidden_size", *tp_keys),
                     f"model.ffn_hidden_size{per}", m.ffn_hidden_size // tp, align))
    if m.moe.num_experts > 0 and m.moe.ffn_hidden_size is not None:
        dims.append(("expert fc1 output / fc2 input", ("model.moe.ffn_hidden_size",),
                     "model.moe.ffn_hidden_size", m.moe.ffn_hidden_size, align))
    tokens = c.train.micro_batch_size * m.seq_length
    dims.append(("tokens per micro-batch", ("train.micro_batch_size", "model.seq_length"),
                 "micro_batch_size * seq_length", tokens, align))
    if tp > 1 and m.sequence_parallel:
        dims.append(("sequence-parallel local rows", ("model.seq_length", "model.tensor_model_parallel_size"),
                     f"seq_length / tensor_model_parallel_size {tp}", m.seq_length // tp, SP_LOCAL_ROWS_ALIGN))
    bad = [d for d in dims if d[3] % d[4] != 0]
    if not bad:
        return {}
    keys = tuple(dict.fromkeys(k for d in bad for k in d[1]))
    detail = "; ".join(f"{layer}: {expr} = {value}" + (f" (needs a multiple of {a})" if a != align else "")
                       for layer, _, expr, value, a in bad)
    return {"keys": keys, "align": align, "recipe": recipe, "detail": detail}


def _delayed_in_use(c: LPTrainConfig) -> bool:
    spec = quant_spec(c)
    return runs(c, spec) and spec is not None and spec.amax_history


def _cuda_device_missing(c: LPTrainConfig, w: World) -> bool:
    return c.run.device == "cuda" and not w.cuda


# Catalog texts for the rule documentation (``lptrain rules``, docs/rules.md).


def _selects(specs: list[catalog_recipes.RecipeSpec]) -> str:
    """``fp8_recipe=a/b``: the config values selecting ``specs`` (one family)."""
    return f"{specs[0].keys.recipe_key.split('.', 1)[1]}={'/'.join(s.name for s in specs)}"


def _grouped(attr: str) -> dict[Any, list[str]]:
    out: dict[Any, list[str]] = {}
    for spec in catalog_recipes.RECIPES:
        out.setdefault(getattr(spec, attr), []).append(spec.name)
    return out


def _alignments_text() -> str:
    return ", ".join(f"{a} ({', '.join(names)})" for a, names in _grouped("alignment").items())


def _min_sm_text() -> str:
    return ", ".join(f"{'/'.join(names)}{' need' if i == 0 else ''} sm{sm}+"
                     for i, (sm, names) in enumerate(_grouped("min_sm").items()))


def _min_te_text() -> str:
    parts = [f"any recipe {TE_MIN_VERSION}"]
    parts += [f"{s.name} {s.min_te}" for s in catalog_recipes.RECIPES if s.min_te != TE_MIN_VERSION]
    parts += [f"{s.name} on sm{sm}+ {v}" for s in catalog_recipes.RECIPES for sm, v in s.min_te_from_sm]
    parts += [f"amax_epsilon in grouped expert GEMMs {GROUPED_AMAX_EPSILON_MIN_TE}",
              f"single grouped weight {SINGLE_GROUPED_WEIGHT_MIN_TE}",
              f"bf16 Adam moments {BF16_MOMENTS_MIN_TE}"]
    return ", ".join(parts)


def _min_cuda_text() -> str:
    return " or ".join(f"{_selects([s])} with CUDA < {s.min_cuda}"
                       for s in catalog_recipes.RECIPES if s.min_cuda is not None)


_DELAYED = [s for s in catalog_recipes.RECIPES if s.amax_history]
_MXFP8 = next(s for s in catalog_recipes.RECIPES if s.name == "mxfp8")


def _bf16_layers_out_of_range(c: LPTrainConfig, w: World) -> bool:
    p = c.precision
    if not p.first_last_layers_bf16:
        return False
    start, end = p.num_layers_at_start_in_bf16, p.num_layers_at_end_in_bf16
    return start < 0 or end < 0 or start + end > c.model.num_layers


RULES = [
    Rule(
        id="PREC-FP8-FP4-EXCLUSIVE", severity="error",
        keys=("precision.fp8_format", "precision.fp4_format"),
        when=lambda c, w: fp8_on(c) and fp4_on(c),
        message="fp8_format={cfg.precision.fp8_format} and fp4_format={cfg.precision.fp4_format} "
                "are both set; a run uses one quantized GEMM recipe",
        fix="set precision.fp4_format=null to train in FP8, or precision.fp8_format=null for NVFP4",
        condition="fp8_format and fp4_format both set", why="one quantized GEMM recipe per run",
        section=S,
    ),
    Rule(
        id="PREC-FP8PG-NEEDS-FP8", severity="error",
        keys=("precision.fp8_param_gather", "precision.fp8_format"),
        when=lambda c, w: c.precision.fp8_param_gather and not fp8_on(c),
        message="fp8_param_gather=true but fp8_format is null: there is no FP8 weight to keep or "
                "gather",
        fix="set precision.fp8_format=e4m3 (and a precision.fp8_recipe), or "
            "precision.fp8_param_gather=false",
        condition="fp8_param_gather -> fp8_format set", why="nothing to keep in FP8 otherwise",
        section=S,
    ),
    Rule(
        id="PREC-FP4PG-NEEDS-FP4", severity="error",
        keys=("precision.fp4_param_gather", "precision.fp4_format"),
        when=lambda c, w: c.precision.fp4_param_gather and not fp4_on(c),
        message="fp4_param_gather=true but fp4_format is null: there is no FP4 weight to keep or "
                "gather",
        fix="set precision.fp4_format=e2m1, or precision.fp4_param_gather=false",
        condition="fp4_param_gather -> fp4_format set", why="same for FP4", section=S,
    ),
    Rule(
        id="PREC-PG-NEEDS-DISTOPT", severity="error",
        keys=("precision.fp8_param_gather", "precision.fp4_param_gather",
              "ddp.use_distributed_optimizer"),
        when=lambda c, w: (c.precision.fp8_param_gather or c.precision.fp4_param_gather)
             and not sharded_optimizer(c),
        message="quantized primary weights (fp8/fp4_param_gather) need a distributed optimizer "
                "that owns the fp32 master copies and re-quantizes them after each step",
        fix="set ddp.use_distributed_optimizer=true (Muon then uses the layer-wise optimizer), or "
            "turn param gather off",
        condition="fp8_param_gather or fp4_param_gather -> ddp.use_distributed_optimizer (Muon's "
                  "layer-wise optimizer counts)",
        why="FP8 primary weights need an optimizer that owns FP32 master copies and re-quantizes "
            "them",
        section=S,
    ),
    Rule(
        id="PREC-MXFP8-PG-NEEDS-REUSE", severity="error",
        keys=("precision.fp8_recipe", "precision.fp8_param_gather",
              "ddp.reuse_grad_buf_for_mxfp8_param_ag"),
        when=lambda c, w: is_mxfp8(c) and c.precision.fp8_param_gather
             and not c.ddp.reuse_grad_buf_for_mxfp8_param_ag
             and c.ddp.data_parallel_sharding_strategy not in ("optim_grads", "optim_grads_params"),
        message="MXFP8 with fp8_param_gather needs the bf16 param all-gather to ride the grad "
                "buffer: MXFP8 row/column block scales cannot be remapped into a flat buffer",
        fix="set ddp.reuse_grad_buf_for_mxfp8_param_ag=true",
        condition="fp8_recipe=mxfp8 and fp8_param_gather and strategy optim -> "
                  "ddp.reuse_grad_buf_for_mxfp8_param_ag",
        why="MXFP8 row/column block scales cannot be remapped into a flat buffer; the BF16 gather "
            "must ride the grad buffer (with sharded grads, data_parallel_sharding_strategy="
            "optim_grads*, it has a bf16 area of its own instead)",
        section=S,
    ),
    Rule(
        id="PREC-REUSE-NEEDS-MXFP8-PG", severity="error",
        keys=("ddp.reuse_grad_buf_for_mxfp8_param_ag", "precision.fp8_param_gather",
              "precision.fp8_recipe"),
        when=lambda c, w: c.ddp.reuse_grad_buf_for_mxfp8_param_ag
             and not (c.precision.fp8_param_gather and is_mxfp8(c)),
        message="reuse_grad_buf_for_mxfp8_param_ag=true only makes sense for MXFP8 with "
                "fp8_param_gather (fp8_recipe={cfg.precision.fp8_recipe}, "
                "fp8_format={cfg.precision.fp8_format}, "
                "fp8_param_gather={cfg.precision.fp8_param_gather})",
        fix="set ddp.reuse_grad_buf_for_mxfp8_param_ag=false, or use precision.fp8_format=e4m3 "
            "precision.fp8_recipe=mxfp8 precision.fp8_param_gather=true",
        condition="reuse_grad_buf_for_mxfp8_param_ag -> fp8_param_gather and fp8_recipe=mxfp8",
        why="upstream documents but does not enforce the recipe half; lptrain enforces it",
        section=S,
    ),
    Rule(
        id="PREC-MXFP8-E4M3", severity="warning",
        keys=("precision.fp8_recipe", "precision.fp8_format"),
        when=lambda c, w: is_mxfp8(c) and c.precision.fp8_format == "hybrid",
        message="MXFP8 with fp8_format=hybrid uses E5M2 gradients, which have diverged in practice",
        fix="set precision.fp8_format=e4m3", condition="fp8_recipe=mxfp8 and fp8_format=hybrid",
        why="E5M2 gradients with MXFP8 have diverged in practice; e4m3 both ways is recommended",
        section=S,
    ),
    Rule(
        id="PREC-BLOCKWISE-E4M3", severity="warning",
        keys=("precision.fp8_recipe", "precision.fp8_format"),
        when=lambda c, w: fp8_on(c) and c.precision.fp8_recipe == "blockwise"
             and c.precision.fp8_format == "hybrid",
        message="blockwise FP8 with fp8_format=hybrid: per-128 block scales need precision (E4M3) "
                "more than range (E5M2)",
        fix="set precision.fp8_format=e4m3", condition="fp8_recipe=blockwise and fp8_format=hybrid",
        why="per-128 scales need precision more than range", section=S,
    ),
    Rule(
        id="PREC-DELAYED-FIRST-LAST", severity="error",
        keys=("precision.first_last_layers_bf16", "precision.fp8_recipe"),
        when=lambda c, w: c.precision.first_last_layers_bf16 and _delayed_in_use(c),
        message="first_last_layers_bf16 with delayed scaling: entering/leaving FP8 autocast per "
                "layer breaks the delayed-scaling amax reduction",
        fix="set precision.fp8_recipe=tensorwise (or mxfp8/blockwise), or "
            "precision.first_last_layers_bf16=false",
        condition=f"first_last_layers_bf16 and {_selects(_DELAYED)}",
        why="per-layer autocast enter/exit breaks delayed-scaling amax reduction", section=S,
    ),
    Rule(
        id="PREC-BF16-LAYERS-RANGE", severity="error",
        keys=("precision.num_layers_at_start_in_bf16", "precision.num_layers_at_end_in_bf16",
              "model.num_layers"),
        when=_bf16_layers_out_of_range,
        message="num_layers_at_start_in_bf16={cfg.precision.num_layers_at_start_in_bf16} + "
                "num_layers_at_end_in_bf16={cfg.precision.num_layers_at_end_in_bf16} must lie in "
                "[0, num_layers={cfg.model.num_layers}]",
        fix="lower precision.num_layers_at_start_in_bf16 / precision.num_layers_at_end_in_bf16 "
            "(each >= 0, sum <= model.num_layers)",
        condition="first_last_layers_bf16: num_layers_at_start_in_bf16 + num_layers_at_end_in_bf16 "
                  "within [0, num_layers]",
        section=S,
    ),
    Rule(
        id="PREC-GEMM-ALIGN", severity="error",
        keys=("model.hidden_size", "model.ffn_hidden_size", "model.num_attention_heads",
              "model.num_query_groups", "model.moe.ffn_hidden_size", "train.micro_batch_size",
              "model.seq_length", "model.tensor_model_parallel_size", "model.sequence_parallel"),
        when=_gemm_misaligned,
        message="{recipe} quantizes in blocks and needs every GEMM dimension to be a multiple of "
                "{align}; not aligned: {detail}",
        fix="make each listed dimension a multiple of {align} per tensor-parallel shard (e.g. round "
            "model sizes up to {align} x tensor_model_parallel_size; tokens per micro-batch = "
            "train.micro_batch_size * model.seq_length; under sequence parallelism model.seq_length "
            f"a multiple of {SP_LOCAL_ROWS_ALIGN} x tensor_model_parallel_size)",
        condition="every quantized GEMM dimension of each tensor-parallel shard (hidden, ffn / tp, "
                  "qkv and output projections / tp, expert dims) and the tokens per micro-batch are "
                  "multiples of the recipe alignment: " + _alignments_text() + "; under sequence "
                  f"parallelism each rank's local rows (seq_length / tp) a multiple of {SP_LOCAL_ROWS_ALIGN}",
        why="block quantizers need whole blocks, and TE checks each rank's shard (per-tensor FP8 "
            "too: ffn 28736 at TP 8 gives an fc2 shard of 3592 columns, refused at the first step; "
            "seq 8208 at TP 8 under SP gives 1026 local rows); small debug models trip this "
            "silently otherwise",
        section=S,
    ),
    Rule(
        id="PREC-TARGET-SUPPORT", severity="error",
        keys=("precision.backend", "precision.fp8_recipe"), when=te_only(te_sm_too_old),
        message="the Transformer Engine {recipe} recipe needs {need} or newer; the target is "
                "{world.target}",
        fix="check for a newer target (--target {need}), pick a recipe this GPU supports, or set "
            "precision.backend=emulated (runs every recipe anywhere, slowly)",
        condition=f"backend=te: {_min_sm_text()}; the emulated backend runs every recipe anywhere",
        section=S,
    ),
    Rule(
        id="PREC-MXFP8-SM120", severity="error", keys=("precision.backend", "precision.fp8_recipe"),
        when=te_only(te_mxfp8_sm120),
        message="Transformer Engine refuses MXFP8 on {world.target}: MXFP8 GEMMs are not supported "
                "on compute capability 12.0+",
        fix="use precision.fp8_recipe=tensorwise (TE's default recipe there) or blockwise, or "
            "precision.backend=emulated",
        condition=f"backend=te and {_selects([_MXFP8])} on sm{_MXFP8.unsupported_from_sm}+",
        why="TE's check_mxfp8_support: 'MXFP8 (for all gemm layouts) is not supported on 12.0+ "
            "architectures yet'",
        section=S,
    ),
    Rule(
        id="PREC-BLOCKWISE-CUDA", severity="error",
        keys=("precision.backend", "precision.fp8_recipe"), when=te_only(te_cuda_too_old),
        message="{recipe} {family} on Transformer Engine needs a CUDA >= {need} build; torch here "
                "is built with CUDA {world.cuda_version}",
        fix="install a torch/Transformer Engine built for CUDA >= {need}, use "
            "precision.fp8_recipe=tensorwise, or precision.backend=emulated",
        condition=f"backend=te and {_min_cuda_text()}",
        why="TE's block-scaling check: 'FP8 block scaled GEMM requires ... CUDA >= 12.9'",
        section=S,
    ),
    Rule(
        id="PREC-TE-VERSION", severity="error",
        keys=("precision.backend", "precision.fp8_recipe", "precision.amax_epsilon",
              "model.moe.single_grouped_weight", *STATE_KEYS),
        when=te_too_old, message="Transformer Engine {world.te_version} is too old: {detail}",
        fix="upgrade Transformer Engine to >= {need} (pip install -U "
            "'transformer_engine[pytorch]')",
        condition=f"backend=te: minimum Transformer Engine versions: {_min_te_text()}",
        why="first TE releases with Float8CurrentScaling (2.2), Float8BlockScaling (2.3), "
            "NVFP4BlockScaling (2.8), blockwise on Blackwell (2.9), GroupedLinear QParams (2.3) "
            "and a single grouped weight whose GEMMs take the grouped parameter and its "
            "main_grad (2.19; 2.14-2.18 run them on members without gradients); lptrain sets "
            "NVTE_GROUPED_LINEAR_SINGLE_PARAM (2.15+) and use_grouped_tensor (2.19+); FusedAdam "
            "takes bf16 moments from 2.3 (its precision-aware arguments date from 1.13)",
        section=S,
    ),
    Rule(
        id="PREC-NVFP4-RHT-BF16", severity="error",
        keys=("precision.backend", "precision.nvfp4_rht", "precision.params_dtype"),
        when=te_only(te_rht_needs_bf16),
        message="NVFP4 with RHT on Transformer Engine needs bf16 activations, but "
                "params_dtype={cfg.precision.params_dtype} makes them {cfg.precision.params_dtype}",
        fix="set precision.params_dtype=bf16, or precision.nvfp4_rht=false",
        condition="backend=te, fp4_format set, nvfp4_rht and params_dtype != bf16",
        why="TE's Hadamard-transform kernels check 'Input tensor must be BF16 tensor'; GPU "
            "activations follow params_dtype",
        section=S,
    ),
    Rule(
        id="PREC-TE-NEEDS-CUDA-DEVICE", severity="error", keys=("precision.backend", "run.device"),
        when=te_only(te_device_cpu),
        message="precision.backend=te runs Transformer Engine layers on CUDA, but run.device=cpu",
        fix="set run.device=auto (or cuda), or precision.backend=emulated to run on the CPU",
        condition="backend=te and run.device=cpu", why="TE modules are CUDA-only", section=S,
    ),
    Rule(
        id="PREC-BACKEND-AVAILABLE", severity="error", keys=("precision.backend",),
        when=backend_missing, message="precision.backend=te but {missing} here",
        fix="install it with `pip install -e .[te]` on a CUDA machine (keeps your torch), check "
            "for a cluster with --target sm90/sm100, or set precision.backend=emulated",
        condition="backend=te without CUDA or without an importable Transformer Engine", section=S,
    ),
    Rule(
        id="RUN-DEVICE-CUDA", severity="error", keys=("run.device",), when=_cuda_device_missing,
        message="run.device=cuda but there is no CUDA device here",
        fix="set run.device=auto (CUDA when available, else CPU) or run.device=cpu, or check for a "
            "cluster with --target sm90/sm100",
        condition="run.device=cuda without a CUDA device", section=S,
    ),
]

