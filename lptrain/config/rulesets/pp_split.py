"""Pipeline-parallel rules on the split of the layers into model chunks: Megatron-LM's checks on
``decoder_first/last_pipeline_num_layers``, ``account_for_embedding/loss_in_pipeline_split`` and
``pipeline_model_parallel_layout`` (its ``TransformerConfig`` and ``PipelineParallelLayerLayout``
refuse the same), and the even split's divisibility.

The split itself is computed once, by :func:`lptrain.catalog.pipeline_split.chunk_sizes`, which
raises a :class:`~lptrain.catalog.pipeline_split.SplitError` carrying the id of the rule here
that names the fault: the rule reports that error's message and keys, so the checker, the model
build and the memory planner cannot disagree on what a split is.
"""

from __future__ import annotations

from typing import Any

from lptrain.catalog.pipeline import PipelineLayout, split_keys
from lptrain.catalog.pipeline_split import SplitError
from lptrain.config.rules import Rule
from lptrain.config.schema import LPTrainConfig
from lptrain.config.world import World

S = "Pipeline parallelism"
SPLIT_KEYS = ("model.decoder_first_pipeline_num_layers", "model.decoder_last_pipeline_num_layers",
              "model.account_for_embedding_in_pipeline_split", "model.account_for_loss_in_pipeline_split",
              "model.pipeline_model_parallel_layout")


def split_error(c: LPTrainConfig) -> SplitError | None:
    """Why the layers cannot be split as asked (None: they can, or there is one chunk)."""
    keys = split_keys(c.model)
    if keys.pp * keys.vpp <= 1 or keys.num_layers < 1 or keys.vpp < 1:
        return None
    try:
        PipelineLayout.of(keys)
    except SplitError as e:
        return e
    return None


def _fault(rule: str) -> Any:
    def when(c: LPTrainConfig, w: World) -> Any:
        e = split_error(c)
        if e is None or e.rule != rule:
            return False
        return {"detail": e.message, "hint": e.fix, "keys": e.keys}

    return when


def _split_keys_set(c: LPTrainConfig) -> list[str]:
    m = c.model
    values = (m.decoder_first_pipeline_num_layers, m.decoder_last_pipeline_num_layers,
              m.account_for_embedding_in_pipeline_split or None, m.account_for_loss_in_pipeline_split or None,
              m.pipeline_model_parallel_layout)
    return [k for k, v in zip(SPLIT_KEYS, values, strict=True) if v is not None]


def _split_without_pp(c: LPTrainConfig, w: World) -> Any:
    keys = _split_keys_set(c)
    if not keys or max(1, c.model.pipeline_model_parallel_size) > 1:
        return False
    return {"set": ", ".join(keys), "keys": tuple(keys)}


def _split_rule(rule: str, keys: tuple[str, ...], condition: str, why: str, fix: str) -> Rule:
    return Rule(id=rule, severity="error", keys=keys, when=_fault(rule), message="{detail}",
                fix=fix + ": {hint}", condition=condition, why=why, section=S)


RULES = [
    _split_rule(
        "PP-LAYERS-DIVIDE", ("model.num_layers", "model.pipeline_model_parallel_size",
                             "model.virtual_pipeline_model_parallel_size"),
        "no uneven split asked for -> num_layers % (pipeline_model_parallel_size x "
        "virtual_pipeline_model_parallel_size) == 0",
        "Megatron-LM's validate_args refuses the same ('number of layers should be divisible by the "
        "pipeline parallel size', and per virtual stage)",
        "make the layers divide, or ask for an uneven split"),
    Rule(
        id="PP-SPLIT-NEEDS-PP", severity="error", keys=SPLIT_KEYS, when=_split_without_pp,
        message="{set} shape(s) the split of the layers over pipeline stages, but "
                "pipeline_model_parallel_size=1: it would have no effect",
        fix="set model.pipeline_model_parallel_size > 1, or drop {set}",
        condition="an uneven-split key set -> pipeline_model_parallel_size > 1",
        why="a setting that is accepted must be honoured", section=S,
    ),
    _split_rule(
        "PP-UNEVEN-EXCLUSIVE", SPLIT_KEYS[:4],
        "decoder_first/last_pipeline_num_layers set -> neither account_for_*_in_pipeline_split",
        "Megatron-LM's TransformerConfig refuses the same: the two ways to unbalance the stages "
        "do not combine", "keep one of the two"),
    _split_rule(
        "PP-UNEVEN-POSITIVE", SPLIT_KEYS[:2],
        "decoder_first/last_pipeline_num_layers set -> > 0",
        "Megatron-LM's TransformerConfig refuses the same: the first and last stages hold layers "
        "(count the embedding or loss as a layer, or spell a layout, for a stage without)",
        "set the key >= 1, or null"),
    _split_rule(
        "PP-UNEVEN-VIRTUAL", (*SPLIT_KEYS[:2], "model.virtual_pipeline_model_parallel_size"),
        "interleaved -> the first, last and each middle stage's layers % "
        "virtual_pipeline_model_parallel_size == 0",
        "Megatron-LM's TransformerConfig refuses the same: every chunk of a rank holds the same "
        "number of layers", "choose the counts so that each rank's layers divide into its chunks"),
    _split_rule(
        "PP-UNEVEN-MIDDLE", (*SPLIT_KEYS[:2], "model.num_layers"),
        "decoder_first/last_pipeline_num_layers set -> the layers left divide evenly into the "
        "middle stages (none left exactly when there is no middle stage)",
        "Megatron-LM's TransformerConfig refuses the same ('number of layers at middle stage ... "
        "must be divisible by the middle pipeline model parallel size')",
        "change the first / last counts or model.num_layers"),
    _split_rule(
        "PP-UNEVEN-V-SHAPE", (*SPLIT_KEYS[:2], "model.pipeline_schedule"),
        "pipeline_schedule in (zbv_zero_bubble, dualpipev) -> decoder_first/last_pipeline_num_layers null",
        "the keys name the first and last pipeline ranks' layers; a V schedule puts the first and "
        "the last chunk on rank 0, so 'the last stage' would be read two ways",
        "spell the chunks with model.pipeline_model_parallel_layout, or count the embedding / loss "
        "as layers"),
    _split_rule(
        "PP-ACCOUNT-DIVIDES", ("model.num_layers", *SPLIT_KEYS[2:4], "model.pipeline_model_parallel_size",
                               "model.virtual_pipeline_model_parallel_size"),
        "account_for_*_in_pipeline_split -> (num_layers + 1 per flag) divides into "
        "pipeline_model_parallel_size x virtual_pipeline_model_parallel_size chunks",
        "Megatron-LM's validate_args and TransformerConfig refuse the same", "change model.num_layers"),
    _split_rule(
        "PP-LAYOUT-EXCLUSIVE", SPLIT_KEYS,
        "pipeline_model_parallel_layout set -> no other split key",
        "Megatron-LM's TransformerConfig refuses the same ('pipeline_model_parallel_layout cannot be "
        "set with other pipeline layout arguments')", "keep the layout alone"),
    _split_rule(
        "PP-LAYOUT-GRAMMAR", ("model.pipeline_model_parallel_layout",),
        "pipeline_model_parallel_layout uses E, t, L, |, (...)*n, x*n and commas only",
        "Megatron-LM's grammar; its m (multi-token prediction layers) is not built",
        "fix the layout string"),
    _split_rule(
        "PP-LAYOUT-STAGES", ("model.pipeline_model_parallel_layout", "model.pipeline_model_parallel_size",
                             "model.virtual_pipeline_model_parallel_size"),
        "the layout's chunk count == pipeline_model_parallel_size x virtual_pipeline_model_parallel_size",
        "Megatron-LM refuses the same (the virtual size is the layout's chunks over the pipeline "
        "size; an explicit one must agree)", "spell as many chunks as the pipeline holds"),
    _split_rule(
        "PP-LAYOUT-CONTENTS", ("model.pipeline_model_parallel_layout", "model.num_layers"),
        "the layout holds E once (first), L once (last), num_layers t's, and something in every chunk",
        "Megatron-LM's PipelineParallelLayerLayout.validate_layer_layout refuses the same; an empty "
        "chunk would be a stage that only forwards what it receives", "fix the layout string"),
]
