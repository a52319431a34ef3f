"""Context-parallel rules: what Megatron-LM (and Transformer Engine's context-parallel
attention, which Megatron's CP runs on) refuses for CP, and what lptrain's CP needs.

The world is judged as ``TP x CP x DP x PP`` ranks (``--dp N``), or a launch's rank count is
split into ``TP`` consecutive tensor-parallel ranks, ``CP`` context-parallel ranks ``TP``
apart, then data- and pipeline-parallel ranks (:mod:`lptrain.catalog.parallel_dims`). Each
sequence is cut into ``2 x CP`` equal chunks, two per CP rank (causal load balancing).

Megatron allows CP with tensor and sequence parallelism, pipeline parallelism (interleaved
too), MoE (expert parallelism folds CP into expert data parallelism) and activation recompute
(selective and full); so does lptrain -- none of them is refused here. What is refused: a
world or sequence the CP layout cannot tile, the all-to-all's head split, the hierarchical
sizes Megatron checks, and a chunk that would cut a quantization block.
"""

from __future__ import annotations

import math
from typing import Any

from lptrain.config.rules import Rule, quant_spec, recipe_key, runs
from lptrain.config.schema import LPTrainConfig
from lptrain.config.world import World

S = "Context parallelism"


def cp_size(c: LPTrainConfig) -> int:
    return max(1, c.model.context_parallel_size)


def _tp(c: LPTrainConfig) -> int:
    return max(1, c.model.tensor_model_parallel_size)


def _groups(c: LPTrainConfig) -> int:
    m = c.model
    return m.num_query_groups if m.num_query_groups is not None else m.num_attention_heads


def a2a_size(c: LPTrainConfig) -> int:
    """The all-to-all's group size: CP for ``a2a``, the first hierarchical level for
    ``a2a+p2p`` (1 when the attention runs no all-to-all)."""
    m = c.model
    if cp_size(c) <= 1:
        return 1
    if m.cp_comm_type == "a2a":
        return cp_size(c)
    sizes = m.hierarchical_context_parallel_sizes
    if m.cp_comm_type == "a2a+p2p" and sizes:
        return max(1, int(sizes[0]))
    return 1


def chunk_length(c: LPTrainConfig) -> int:
    """Tokens per chunk: ``seq_length / (2 x CP)``."""
    return c.model.seq_length // (2 * cp_size(c))


def _world_not_divisible(c: LPTrainConfig, w: World) -> Any:
    if cp_size(c) <= 1 or w.ranks is None:
        return False
    mp = _tp(c) * cp_size(c) * max(1, c.model.pipeline_model_parallel_size)
    return {"mp": mp} if w.ranks % mp else False


def _seq_bad(c: LPTrainConfig, w: World) -> Any:
    if cp_size(c) <= 1 or c.model.seq_length % (2 * cp_size(c)) == 0:
        return False
    return {"two_cp": 2 * cp_size(c)}


def _sp_seq_bad(c: LPTrainConfig, w: World) -> Any:
    cp, tp = cp_size(c), _tp(c)
    if cp <= 1 or tp <= 1 or not c.model.sequence_parallel or c.model.seq_length % (2 * cp):
        return False
    local = c.model.seq_length // cp
    return {"local": local} if local % tp else False


def _a2a_heads_bad(c: LPTrainConfig, w: World) -> Any:
    n = a2a_size(c)
    m = c.model
    if n <= 1 or m.num_attention_heads % _tp(c) or _groups(c) % _tp(c):
        return False  # (TP-HEADS / TP-KV-HEADS report those)
    heads, groups = m.num_attention_heads // _tp(c), _groups(c) // _tp(c)
    bad = [f"{what}={x}" for what, x in (("attention heads", heads), ("query groups", groups)) if x % n]
    if not bad:
        return False
    per_tp = " per tensor-parallel rank" if _tp(c) > 1 else ""
    return {"n": n, "what": " and ".join(bad), "per_tp": per_tp}


def _hierarchical_missing(c: LPTrainConfig, w: World) -> bool:
    return cp_size(c) > 1 and c.model.cp_comm_type == "a2a+p2p" and not c.model.hierarchical_context_parallel_sizes


def _hierarchical_bad(c: LPTrainConfig, w: World) -> Any:
    sizes = c.model.hierarchical_context_parallel_sizes
    if not sizes:
        return False
    sizes = [int(x) for x in sizes]
    if len(sizes) == 2 and min(sizes) >= 1 and math.prod(sizes) == cp_size(c):
        return False
    return {"sizes": sizes, "prod": math.prod(sizes)}


def _blocks_bad(c: LPTrainConfig, w: World) -> Any:
    spec = quant_spec(c)
    if cp_size(c) <= 1 or spec is None or not runs(c, spec) or spec.block <= 1 or _seq_bad(c, w):
        return False
    n = chunk_length(c)
    if n % spec.block == 0:
        return False
    return {"keys": ("model.seq_length", "model.context_parallel_size", recipe_key(c)),
            "chunk": n, "block": spec.block, "recipe": spec.name,
            "multiple": spec.block * 2 * cp_size(c)}


RULES = [
    Rule(
        id="LAUNCH-CP-DIVIDES-WORLD", severity="error",
        keys=("model.context_parallel_size", "model.tensor_model_parallel_size",
              "model.pipeline_model_parallel_size"),
        when=_world_not_divisible,
        message="world_size ({world.ranks}) is not divisible by tensor_model_parallel_size x "
                "context_parallel_size x pipeline_model_parallel_size = "
                "{cfg.model.tensor_model_parallel_size} x {cfg.model.context_parallel_size} x "
                "{cfg.model.pipeline_model_parallel_size} = {mp}: every rank is in one "
                "context-parallel group, and the data-parallel size is world / {mp}",
        fix="launch a multiple of {mp} ranks (--nproc-per-node), or lower model.context_parallel_size",
        condition="world % (tensor_model_parallel_size x context_parallel_size x "
                  "pipeline_model_parallel_size) == 0 (a launch's rank count; --dp N judges a world "
                  "of TP x CP x PP x N ranks)",
        why="Megatron-LM's initialize_model_parallel refuses the same",
        section=S, supersedes=("LAUNCH-TP-DIVIDES-WORLD", "LAUNCH-PP-DIVIDES-WORLD"),
    ),
    Rule(
        id="CP-SEQ-DIVIDES", severity="error",
        keys=("model.seq_length", "model.context_parallel_size"), when=_seq_bad,
        message="seq_length={cfg.model.seq_length} must be divisible by 2 x context_parallel_size "
                "= {two_cp}: each sequence is split into 2 x CP chunks and every CP rank holds two "
                "of them (chunks i and 2 x CP - 1 - i, for causal load balancing)",
        fix="set model.seq_length to a multiple of 2 x model.context_parallel_size",
        condition="seq_length % (2 x context_parallel_size) == 0",
        why="Megatron-LM's get_batch_on_this_cp_rank splits each sequence into 2 x CP equal chunks "
            "(Transformer Engine: 'Sequence length per GPU needs to be divisible by 2!')",
        section=S,
    ),
    Rule(
        id="CP-SP-SEQ-DIVIDES", severity="error",
        keys=("model.seq_length", "model.context_parallel_size", "model.tensor_model_parallel_size",
              "model.sequence_parallel"),
        when=_sp_seq_bad,
        message="a context-parallel rank's {local} tokens (seq_length / context_parallel_size) must "
                "be divisible by tensor_model_parallel_size={cfg.model.tensor_model_parallel_size} "
                "under sequence parallelism: each TP rank holds 1/TP of them",
        fix="set model.seq_length to a multiple of 2 x context_parallel_size x "
            "tensor_model_parallel_size",
        condition="sequence_parallel -> (seq_length / context_parallel_size) % tensor_model_parallel_size == 0",
        why="the sequence scatter and gather split a CP rank's tokens into equal parts",
        section=S, supersedes=("SP-SEQ-DIVIDES",),
    ),
    Rule(
        id="CP-A2A-HEADS", severity="error",
        keys=("model.num_attention_heads", "model.num_query_groups", "model.cp_comm_type",
              "model.context_parallel_size", "model.hierarchical_context_parallel_sizes"),
        when=_a2a_heads_bad,
        message="the number of attention heads needs to be divisible by the all-to-all's CP size "
                "{n} (cp_comm_type={cfg.model.cp_comm_type}): {what}{per_tp} do not split over it "
                "(the all-to-all hands each rank whole heads and whole query groups)",
        fix="use cp_comm_type=p2p or allgather, or choose a CP size (or a2a level) dividing both "
            "the heads and the query groups per tensor-parallel rank",
        condition="cp_comm_type in (a2a, a2a+p2p) -> (num_attention_heads / TP) % a2a size == 0 and "
                  "(num_query_groups / TP) % a2a size == 0",
        why="Transformer Engine's all-to-all context parallelism asserts the same ('The number of "
            "attention heads needs be divisible by CP size!'), for the query heads and the kv heads",
        section=S,
    ),
    Rule(
        id="CP-HIERARCHICAL-NEEDS-SIZES", severity="error",
        keys=("model.hierarchical_context_parallel_sizes", "model.cp_comm_type"),
        when=_hierarchical_missing,
        message="--hierarchical-context-parallel-sizes must be set when a2a+p2p is used in cp comm "
                "(model.cp_comm_type=a2a+p2p, model.hierarchical_context_parallel_sizes=null)",
        fix="set model.hierarchical_context_parallel_sizes=[A2A,P2P] with A2A x P2P = "
            "{cfg.model.context_parallel_size} (A2A: the CP ranks inside a node)",
        condition="cp_comm_type == a2a+p2p -> hierarchical_context_parallel_sizes set",
        why="Megatron-LM's validate_args asserts the same: the all-to-all and the ring need their "
            "two group sizes",
        section=S,
    ),
    Rule(
        id="CP-HIERARCHICAL-PRODUCT", severity="error",
        keys=("model.hierarchical_context_parallel_sizes", "model.context_parallel_size"),
        when=_hierarchical_bad,
        message="hierarchical_context_parallel_sizes={sizes} must be two sizes [a2a, p2p] whose "
                "product is context_parallel_size={cfg.model.context_parallel_size} (it is {prod})",
        fix="set model.hierarchical_context_parallel_sizes=[A2A,P2P] with A2A x P2P = "
            "{cfg.model.context_parallel_size}",
        condition="len(hierarchical_context_parallel_sizes) == 2 and their product == "
                  "context_parallel_size",
        why="Megatron-LM's validate_args asserts context_parallel_size == "
            "prod(hierarchical_context_parallel_sizes); lptrain builds the two levels of a2a+p2p",
        section=S,
    ),
    Rule(
        id="CP-BLOCK-BOUNDARY", severity="error",
        keys=("model.seq_length", "model.context_parallel_size", "precision.fp8_recipe",
              "precision.fp4_recipe"),
        when=_blocks_bad,
        message="the {recipe} recipe quantizes in blocks of {block} along the token dimension of a "
                "weight gradient's operands, and a context-parallel chunk of {chunk} tokens "
                "(seq_length / (2 x context_parallel_size)) would cut blocks: their scales (and so "
                "the quantized bytes) would differ from the single-rank run's",
        fix="set model.seq_length to a multiple of {multiple}, or lower model.context_parallel_size",
        condition="(seq_length / (2 x context_parallel_size)) % block == 0 for block recipes "
                  "(blockwise 128, mxfp8 32, nvfp4 16)",
        why="every block then lies inside one chunk, so each CP rank's blocks are blocks of the "
            "single-rank tensor: a silent divergence otherwise",
        section=S,
    ),
]
