"""Tensor- and sequence-parallel rules: what Megatron-LM refuses for TP/SP, and the block
boundaries a quantized recipe needs at every tensor-parallel split.

The world is judged as ``tensor_model_parallel_size x dp`` ranks (``--dp N``), or a launch's
rank count is split into ``TP`` consecutive tensor-parallel ranks and ``ranks / TP``
data-parallel ones (:mod:`lptrain.catalog.parallel_dims`). Which GEMM dimension each split
cuts (:func:`tp_split_dims`): the column-parallel QKV and fc1 weights by output rows (QKV by
whole query groups, fc1 as its gate and up halves), the row-parallel proj and fc2 weights and
inputs by input columns; the embedding and output head by vocab rows (never quantized).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

from lptrain.catalog import recipes as catalog_recipes
from lptrain.config.rules import Rule, is_moe, quant_spec, recipe_key, runs
from lptrain.config.schema import LPTrainConfig
from lptrain.config.world import World

S = "Tensor and sequence parallelism"


def tp_size(c: LPTrainConfig) -> int:
    return max(1, c.model.tensor_model_parallel_size)


def _groups(c: LPTrainConfig) -> int:
    m = c.model
    return m.num_query_groups if m.num_query_groups is not None else m.num_attention_heads


def tp_split_dims(c: LPTrainConfig) -> list[tuple[str, str, int, str]]:
    """``(key, what, per-rank size, the whole size that must be a multiple)`` of every
    quantized GEMM dimension a tensor-parallel split cuts (dense layers; MoE experts are whole
    on every TP rank)."""
    m, tp = c.model, tp_size(c)
    if m.num_attention_heads < 1 or m.hidden_size % m.num_attention_heads or _groups(c) < 1:
        return []  # MODEL-HEADS reports it
    head_dim = m.hidden_size // m.num_attention_heads
    qkv_rows = (m.num_attention_heads + 2 * _groups(c)) * head_dim
    out = [("model.hidden_size", "linear_proj input columns (hidden_size / TP)", m.hidden_size // tp,
            "model.hidden_size"),
           ("model.num_query_groups", "linear_qkv output rows ((heads + 2 kv heads) x head_dim / TP)",
            qkv_rows // tp, "(num_attention_heads + 2 x num_query_groups) x head_dim")]
    if m.ffn_hidden_size and has_dense_mlp(c):
        out.append(("model.ffn_hidden_size", "linear_fc1 gate/up rows and linear_fc2 input columns "
                    "(ffn_hidden_size / TP)", m.ffn_hidden_size // tp, "model.ffn_hidden_size"))
    return out


def has_dense_mlp(c: LPTrainConfig) -> bool:
    """Some layer has a dense (tensor-parallel) MLP: a dense model, or MoE every k > 1 layers."""
    freq = max(1, c.model.moe.moe_layer_freq)
    return not is_moe(c) or any(i % freq for i in range(c.model.num_layers))


def _next_multiple(n: int, k: int) -> int:
    """The multiple of ``k`` nearest ``n`` from below (``k`` when there is none)."""
    return max(k, n - n % k)


def _groups_multiple(c: LPTrainConfig) -> int:
    """A kv-head count that splits over the TP ranks and still divides the heads."""
    tp, heads = tp_size(c), c.model.num_attention_heads
    return next((g for g in range(_next_multiple(_groups(c), tp), 0, -tp) if heads % g == 0), heads)


def _world_not_divisible(c: LPTrainConfig, w: World) -> bool:
    return w.ranks is not None and w.ranks % tp_size(c) != 0


def _heads_bad(c: LPTrainConfig, w: World) -> bool:
    return tp_size(c) > 1 and c.model.num_attention_heads % tp_size(c) != 0


def _kv_heads_bad(c: LPTrainConfig, w: World) -> dict[str, Any]:
    tp, g = tp_size(c), _groups(c)
    if tp <= 1 or g < 1 or g % tp == 0 or c.model.num_attention_heads % tp:
        return {}  # (heads TP does not divide: TP-HEADS)
    how = ("fewer kv heads than TP ranks would need each kv head replicated on TP / "
           "num_query_groups ranks, which lptrain does not build" if tp % g == 0
           else "the kv heads neither divide over nor replicate evenly across the TP ranks")
    return {"groups": g, "how": how}


def _ffn_bad(c: LPTrainConfig, w: World) -> bool:
    f = c.model.ffn_hidden_size
    return tp_size(c) > 1 and f is not None and has_dense_mlp(c) and f % tp_size(c) != 0


def _seq_bad(c: LPTrainConfig, w: World) -> bool:
    return c.model.sequence_parallel and tp_size(c) > 1 and c.model.seq_length % tp_size(c) != 0


def _blocks_bad(c: LPTrainConfig, w: World) -> dict[str, Any]:
    spec = quant_spec(c)
    tp = tp_size(c)
    if tp <= 1 or spec is None or not runs(c, spec) or spec.block <= 1:
        return {}
    bad = [d for d in tp_split_dims(c) if d[2] % spec.block]
    if not bad:
        return {}
    detail = "; ".join(f"{what} = {n} is not a multiple of {spec.block}" for _, what, n, _ in bad)
    fixes = ", ".join(dict.fromkeys(f"{whole} a multiple of {spec.block * tp}" for *_, whole in bad))
    return {"keys": (*dict.fromkeys(k for k, *_ in bad), recipe_key(c), "model.tensor_model_parallel_size"),
            "detail": detail, "block": spec.block, "recipe": spec.name, "fixes": fixes}


# The rules on the tensor-parallel size itself: each one's fix is a size all of them accept.
def _tp_checks() -> dict[str, Callable[[LPTrainConfig, World], Any]]:
    return {"LAUNCH-TP-DIVIDES-WORLD": _world_not_divisible, "TP-HEADS": _heads_bad,
            "TP-KV-HEADS": _kv_heads_bad, "TP-FFN": _ffn_bad, "SP-SEQ-DIVIDES": _seq_bad,
            "TP-BLOCK-BOUNDARY": _blocks_bad}


def _at_tp(c: LPTrainConfig, w: World, tp: int) -> tuple[LPTrainConfig, World]:
    """``c`` at tensor-parallel size ``tp`` and its world: a launch's rank count stays (the
    data-parallel size follows), a ``--dp`` world keeps its data-parallel size."""
    c = replace(c, model=replace(c.model, tensor_model_parallel_size=tp))
    return c, w.for_config(c)


def tp_faults(c: LPTrainConfig, w: World, tp: int | None = None) -> list[str]:
    """The tensor-parallel rules this config breaks, at its own size or at ``tp``."""
    if tp is not None:
        c, w = _at_tp(c, w, tp)
    return [rule for rule, bad in _tp_checks().items() if bad(c, w)]


def _fits(c: LPTrainConfig, w: World, tp: int) -> bool:
    """Every tensor-parallel rule holds at ``tp``, and so does the batch split over the
    data-parallel size it leaves (a launch of 3 ranks at TP 1 is dp 3)."""
    if tp_faults(c, w, tp):
        return False
    c, w = _at_tp(c, w, tp)
    per = c.train.micro_batch_size * max(1, w.dp)
    return w.ranks is None or w.ranks % w.model_parallel != 0 or (per > 0 and c.train.global_batch_size % per == 0)


def tp_fix(c: LPTrainConfig, w: World, rule: str, alternative: str) -> dict[str, Any]:
    """The fix of tensor-parallel rule ``rule``: a size every such rule accepts, the same in
    each of their messages (a fix for one must not break another: TP 3 with 4 heads and an
    FFN of 256 said "a divisor of 4" in one row and "an FFN that is a multiple of 3" in the
    next), nearest below the size asked for; plus ``alternative`` (another key to change)
    when this is the only one broken (no size fits: the alternative alone)."""
    heads = max(1, c.model.num_attention_heads)
    tp = tp_size(c)
    alone = bool(alternative) and tp_faults(c, w) == [rule]
    launch = ""
    sizes = [t for t in range(1, heads + 1) if heads % t == 0 and _fits(c, w, t)]
    if not sizes and not w.ranks_from_dp:  # no size fits this launch: another rank count too
        free = replace(w, ranks_from_dp=True)
        sizes = [t for t in range(1, heads + 1) if heads % t == 0 and _fits(c, free, t)]
        launch = " and launch a multiple of {n} ranks ({launcher})"
    if not sizes:
        return {"set_a_tp_size_every_tp_rule_accepts": alternative, "or_this_rules_own_fix_when_alone": ""}
    best = max((t for t in sizes if t < tp), default=min(sizes))
    fix = f"set model.tensor_model_parallel_size={best}"
    if best == 1 and c.model.sequence_parallel:
        fix += " model.sequence_parallel=false"
    if launch:
        fix += launch.format(n=best * max(1, c.model.pipeline_model_parallel_size), launcher=w.launcher)
    elif len(sizes) > 1:
        fix += f" (every tensor-parallel rule holds at {', '.join(map(str, sizes))})"
    return {"set_a_tp_size_every_tp_rule_accepts": fix,
            "or_this_rules_own_fix_when_alone": f", or {alternative}" if alone else ""}


def _with_fix(rule: str, bad: Callable[[LPTrainConfig, World], Any],
              alternative: Callable[[LPTrainConfig, World, Any], str]) -> Callable[[LPTrainConfig, World], Any]:
    """``bad`` with the rule's fix fields added (see :func:`tp_fix`)."""
    def when(c: LPTrainConfig, w: World) -> Any:
        hit = bad(c, w)
        if not hit:
            return hit
        fields = dict(hit) if isinstance(hit, dict) else {}
        fix = tp_fix(c, w, rule, alternative(c, w, fields))
        tp = fix["set_a_tp_size_every_tp_rule_accepts"]
        fits_launch = tp.startswith("set model.tensor_model_parallel_size") and " launch " not in tp
        fix["or_a_tp_size_that_fits"] = f", or {tp}" if fits_launch else ""
        return {**fields, **fix}
    return when


_BLOCKED = ", ".join(f"{s.name} {s.block}" for s in catalog_recipes.RECIPES if s.block > 1)

RULES = [
    Rule(
        id="LAUNCH-TP-DIVIDES-WORLD", severity="error", keys=("model.tensor_model_parallel_size",),
        when=_with_fix("LAUNCH-TP-DIVIDES-WORLD", _world_not_divisible, lambda c, w, f: ""),
        message="tensor_model_parallel_size={cfg.model.tensor_model_parallel_size} must divide the "
                "world of {world.ranks} ranks: each tensor-parallel group is that many consecutive "
                "ranks and the data-parallel size is world / TP",
        fix="launch a multiple of {cfg.model.tensor_model_parallel_size} ranks ({world.launcher}){or_a_tp_size_that_fits}",
        condition="world % tensor_model_parallel_size == 0 (a launch's rank count; --dp N judges "
                  "a world of TP x N ranks)",
        why="Megatron-LM's initialize_model_parallel refuses the same: every rank is in exactly "
            "one tensor-parallel group",
        section=S,
    ),
    Rule(
        id="TP-HEADS", severity="error",
        keys=("model.num_attention_heads", "model.tensor_model_parallel_size"),
        when=_with_fix("TP-HEADS", _heads_bad, lambda c, w, f: ""),
        message="num_attention_heads={cfg.model.num_attention_heads} must be a multiple of "
                "tensor_model_parallel_size={cfg.model.tensor_model_parallel_size}: each TP rank "
                "holds whole attention heads",
        fix="{set_a_tp_size_every_tp_rule_accepts}{or_this_rules_own_fix_when_alone}",
        condition="num_attention_heads % tensor_model_parallel_size == 0",
        why="Megatron-LM's TransformerConfig refuses the same (heads are split over TP ranks)",
        section=S,
    ),
    Rule(
        id="TP-KV-HEADS", severity="error",
        keys=("model.num_query_groups", "model.tensor_model_parallel_size"),
        when=_with_fix("TP-KV-HEADS", _kv_heads_bad, lambda c, w, f: (
            f"set model.num_query_groups={_groups_multiple(c)}")),
        message="num_query_groups={groups} is not a multiple of tensor_model_parallel_size="
                "{cfg.model.tensor_model_parallel_size}: {how}",
        fix="{set_a_tp_size_every_tp_rule_accepts}{or_this_rules_own_fix_when_alone}",
        condition="num_query_groups % tensor_model_parallel_size == 0",
        why="each TP rank holds whole query groups (its query heads with their key and value "
            "head); Megatron-LM also accepts a TP that is a multiple of num_query_groups by "
            "replicating kv heads, which is not built here",
        section=S,
    ),
    Rule(
        id="TP-FFN", severity="error",
        keys=("model.ffn_hidden_size", "model.tensor_model_parallel_size"),
        when=_with_fix("TP-FFN", _ffn_bad, lambda c, w, f: (
            f"set model.ffn_hidden_size={_next_multiple(c.model.ffn_hidden_size or 0, tp_size(c))}")),
        message="ffn_hidden_size={cfg.model.ffn_hidden_size} must be a multiple of "
                "tensor_model_parallel_size={cfg.model.tensor_model_parallel_size}: fc1's gate and "
                "up halves and fc2's input columns are split over the TP ranks",
        fix="{set_a_tp_size_every_tp_rule_accepts}{or_this_rules_own_fix_when_alone}",
        condition="ffn_hidden_size % tensor_model_parallel_size == 0 (models with a dense MLP)",
        why="Megatron-LM's ColumnParallelLinear / RowParallelLinear divide the size exactly",
        section=S,
    ),
    Rule(
        id="SP-NEEDS-TP", severity="error",
        keys=("model.sequence_parallel", "model.tensor_model_parallel_size"),
        when=lambda c, w: c.model.sequence_parallel and tp_size(c) <= 1,
        message="sequence_parallel=true splits the sequence over the tensor-parallel ranks, but "
                "tensor_model_parallel_size=1: it would have no effect",
        fix="set model.tensor_model_parallel_size > 1, or model.sequence_parallel=false",
        condition="sequence_parallel -> tensor_model_parallel_size > 1",
        why="Megatron-LM refuses it too ('Cannot use sequence parallelism without tensor "
            "parallelism'); a setting that is accepted must be honoured",
        section=S,
    ),
    Rule(
        id="SP-SEQ-DIVIDES", severity="error",
        keys=("model.seq_length", "model.tensor_model_parallel_size", "model.sequence_parallel"),
        when=_with_fix("SP-SEQ-DIVIDES", _seq_bad, lambda c, w, f: (
            f"set model.seq_length={_next_multiple(c.model.seq_length, tp_size(c))}")),
        message="seq_length={cfg.model.seq_length} must be a multiple of "
                "tensor_model_parallel_size={cfg.model.tensor_model_parallel_size} under sequence "
                "parallelism: each TP rank holds seq_length / TP positions",
        fix="{set_a_tp_size_every_tp_rule_accepts}{or_this_rules_own_fix_when_alone}",
        condition="sequence_parallel -> seq_length % tensor_model_parallel_size == 0",
        why="the sequence scatter and gather split the sequence into equal parts",
        section=S,
    ),
    Rule(
        id="TP-MOE-NEEDS-SP", severity="error",
        keys=("model.moe.num_experts", "model.tensor_model_parallel_size", "model.sequence_parallel"),
        when=lambda c, w: is_moe(c) and tp_size(c) > 1 and not c.model.sequence_parallel,
        message="an MoE model with tensor_model_parallel_size={cfg.model.tensor_model_parallel_size} "
                "needs sequence parallelism: the experts are whole on every TP rank (expert "
                "TP = 1) and each rank routes its own sequence shard's tokens",
        fix="set model.sequence_parallel=true",
        condition="num_experts > 0 and tensor_model_parallel_size > 1 -> sequence_parallel",
        why="Megatron-LM refuses it too ('When using MoE and tensor parallelism, sequence "
            "parallelism must be used'); without SP every TP rank would route the same tokens "
            "and the expert gradients would be counted TP times",
        section=S,
    ),
    Rule(
        id="MOE-ETP-ONE", severity="error", keys=("model.moe.expert_tensor_parallel_size",),
        when=lambda c, w: c.model.moe.expert_tensor_parallel_size != 1,
        message="expert_tensor_parallel_size={cfg.model.moe.expert_tensor_parallel_size}: experts "
                "split over tensor-parallel ranks are not built",
        fix="set model.moe.expert_tensor_parallel_size=1 (experts whole on every TP rank, tokens "
            "on sequence shards; use model.moe.expert_model_parallel_size to spread experts)",
        condition="expert_tensor_parallel_size == 1",
        why="only expert TP = 1 is built and tested",
        section=S,
    ),
    Rule(
        id="TP-BLOCK-BOUNDARY", severity="error",
        keys=("model.tensor_model_parallel_size", "precision.fp8_recipe", "precision.fp4_recipe"),
        when=_with_fix("TP-BLOCK-BOUNDARY", _blocks_bad, lambda c, w, f: f"make {f['fixes']}"),
        message="the {recipe} recipe quantizes in blocks of {block} along each GEMM dimension, and "
                "a tensor-parallel split must fall on a block boundary or its shards' blocks (and "
                "so their bytes) differ from the whole tensor's: {detail}",
        fix="{set_a_tp_size_every_tp_rule_accepts}{or_this_rules_own_fix_when_alone}",
        condition=f"for every GEMM dimension a TP split cuts: (size / TP) % block == 0 ({_BLOCKED}; "
                  "per-tensor recipes reduce their amax over TP instead)",
        why="a shard boundary inside a quantization block gives that block two scales, so the "
            "quantized bytes of each shard no longer equal the single-rank bytes of its slice: "
            "a silent divergence",
        section=S,
    ),
]
