"""How many transformer layers each pipeline model chunk holds: Megatron-LM's keys, its
validation rules and its layout grammar (torch-free).

Four ways to ask for a split, as in Megatron-LM (at most one of the families at a time):

* **even** (no key): ``num_layers`` cut into ``PP x VPP`` equal chunks;
* **first / last stage** (``decoder_first_pipeline_num_layers``,
  ``decoder_last_pipeline_num_layers``): the first (last) pipeline rank holds that many layers,
  the ranks between split the rest evenly; under interleaving each rank's layers are cut into
  ``VPP`` equal chunks;
* **embedding / loss counted as layers** (``account_for_embedding_in_pipeline_split``,
  ``account_for_loss_in_pipeline_split``): ``num_layers + 1`` (or ``+ 2``) layers cut evenly, the
  first (last) chunk holding one transformer layer fewer -- the token embedding (the final norm,
  output layer and loss) takes its place;
* **a layout string** (``pipeline_model_parallel_layout``): every chunk spelled out, in
  Megatron's grammar -- ``E`` the embedding, ``t`` a transformer layer, ``L`` the loss (final
  norm, head and loss), ``|`` between chunks, ``(...)*n`` and ``x*n`` repeat, commas are
  cosmetic: ``"Et|(tt|)*2,tL"`` is 6 layers over 4 chunks. The chunks are listed in model order
  (chunk ``i`` is virtual stage ``i // PP`` of pipeline rank ``i % PP`` under the loop layout),
  so ``VPP`` is the chunk count over ``PP``. Megatron's ``m`` (multi-token prediction) is not
  built.

Every way yields the same thing: the layers per chunk, in model order (:func:`chunk_sizes`),
which :class:`lptrain.catalog.pipeline.PipelineLayout` places on ranks. A split that Megatron
refuses raises :class:`SplitError` carrying the rule that names it
(:mod:`lptrain.config.rulesets.pp`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

FIRST = "model.decoder_first_pipeline_num_layers"
LAST = "model.decoder_last_pipeline_num_layers"
EMBEDDING = "model.account_for_embedding_in_pipeline_split"
LOSS = "model.account_for_loss_in_pipeline_split"
LAYOUT = "model.pipeline_model_parallel_layout"
LAYERS = "model.num_layers"
PP = "model.pipeline_model_parallel_size"
VPP = "model.virtual_pipeline_model_parallel_size"

LAYOUT_CHARS = {"E": "embedding", "t": "transformer layer", "L": "loss"}


@dataclass(frozen=True)
class SplitKeys:
    """The keys a split is asked with (``vpp`` 1 without interleaving; ``v_shape``: a V
    schedule places the chunks, see :class:`lptrain.catalog.pipeline.PipelineLayout`)."""

    num_layers: int
    pp: int = 1
    vpp: int = 1
    first: Optional[int] = None
    last: Optional[int] = None
    embedding: bool = False
    loss: bool = False
    layout: Optional[str] = None
    v_shape: bool = False

    @property
    def uneven_stages(self) -> bool:
        return self.first is not None or self.last is not None

    @property
    def accounts(self) -> bool:
        return self.embedding or self.loss


MAX_LAYOUT_REPEAT = 100_000  # more layers or chunks than any model has


class SplitError(ValueError):
    """A split Megatron-LM refuses: ``rule`` (its id in the catalog), the keys at fault, the
    message and the fix (the rule's text is built from these)."""

    def __init__(self, rule: str, keys: tuple[str, ...], message: str, fix: str) -> None:
        super().__init__(message)
        self.rule = rule
        self.keys = keys
        self.message = message
        self.fix = fix


def parse_layout(text: str) -> list[str]:
    """Megatron's layout string as one string per chunk (``"Et|(tt|)*2,tL"`` ->
    ``["Et", "tt", "tt", "tL"]``): commas dropped, ``(...)*n`` then ``x*n`` unrolled, split at
    ``|``. Raises :class:`SplitError` on a character outside ``E``, ``t``, ``L``."""
    s = text.replace(",", "").replace(" ", "")
    if any(int(n) > MAX_LAYOUT_REPEAT for n in re.findall(r"\*(\d+)", s)):  # "E*99999999999" unrolled
        raise SplitError("PP-LAYOUT-GRAMMAR", (LAYOUT,), f"pipeline_model_parallel_layout={text!r}: a repeat "
                         f"count over {MAX_LAYOUT_REPEAT}", "spell the layout with a repeat count a model can have")
    s = re.sub(r"\(([^)]+)\)\*(\d+)", lambda m: m.group(1) * int(m.group(2)), s)
    s = re.sub(r"(.)\*(\d+)", lambda m: m.group(1) * int(m.group(2)), s)
    chunks = s.split("|")
    bad = sorted({ch for c in chunks for ch in c if ch not in LAYOUT_CHARS})
    if bad:
        what = "'m' (multi-token prediction) is not built" if bad == ["m"] else \
            f"unknown character(s) {', '.join(repr(b) for b in bad)}"
        raise SplitError("PP-LAYOUT-GRAMMAR", (LAYOUT,), f"pipeline_model_parallel_layout={text!r}: {what}",
                         "spell each chunk with E (embedding), t (transformer layer) and L (loss), "
                         "chunks separated by |, (...)*n and x*n to repeat")
    return chunks


def layout_vpp(text: str, pp: int) -> Optional[int]:
    """The virtual size a layout string implies at ``pp`` stages (its chunk count over ``pp``),
    None when the string does not parse or does not divide (the rules report those)."""
    try:
        n = len(parse_layout(text))
    except SplitError:
        return None
    return n // pp if pp >= 1 and n % pp == 0 else None


def _even(k: SplitKeys) -> tuple[int, ...]:
    chunks = k.pp * k.vpp
    if k.num_layers < chunks or k.num_layers % chunks:
        what = (f"pipeline_model_parallel_size x virtual_pipeline_model_parallel_size = {k.pp} x {k.vpp} = "
                f"{chunks} model chunks" if k.vpp > 1 else f"pipeline_model_parallel_size={k.pp} stages")
        raise SplitError("PP-LAYERS-DIVIDE", (LAYERS, PP, VPP),
                         f"num_layers={k.num_layers} must divide into {what}: every stage (and every "
                         "virtual chunk) holds the same number of layers unless an uneven split is asked for",
                         f"set model.num_layers to a multiple of {chunks}, or set {FIRST} / {LAST}, "
                         f"{EMBEDDING} / {LOSS}, or {LAYOUT}")
    return (k.num_layers // chunks,) * chunks


def _first_last(k: SplitKeys, rank_of_chunk: list[int]) -> tuple[int, ...]:
    """Megatron's uneven first / last stage (``TransformerConfig.__post_init__``'s checks)."""
    if k.accounts:
        raise SplitError("PP-UNEVEN-EXCLUSIVE", (FIRST, LAST, EMBEDDING, LOSS),
                         "decoder_first/last_pipeline_num_layers cannot be set together with "
                         "account_for_embedding/loss_in_pipeline_split",
                         "use one of the two ways to unbalance the stages")
    if k.v_shape:
        raise SplitError("PP-UNEVEN-V-SHAPE", (FIRST, LAST, "model.pipeline_schedule"),
                         "decoder_first/last_pipeline_num_layers name the first and last pipeline ranks, "
                         "but a V schedule puts the first and the last chunk on pipeline rank 0",
                         f"spell the chunks with {LAYOUT} (in model order), or count the embedding "
                         f"and loss as layers ({EMBEDDING} / {LOSS})")
    layers, stages = k.num_layers, k.pp
    per_rank: dict[int, int] = {}
    for key, value, rank in ((FIRST, k.first, 0), (LAST, k.last, k.pp - 1)):
        if value is None:
            continue
        if value <= 0:
            raise SplitError("PP-UNEVEN-POSITIVE", (key,), f"{key.split('.')[1]}={value} must be larger than 0",
                             f"set {key} >= 1, or null for an even split")
        if value % k.vpp:
            raise SplitError("PP-UNEVEN-VIRTUAL", (key, VPP),
                             f"{key.split('.')[1]}={value} must divide into the "
                             f"virtual_pipeline_model_parallel_size={k.vpp} chunks of its pipeline rank",
                             f"set {key} to a multiple of {k.vpp}")
        per_rank[rank] = value
        layers -= value
        stages -= 1
    if bool(layers > 0) != bool(stages > 0) or layers < 0:
        raise SplitError("PP-UNEVEN-MIDDLE", (FIRST, LAST, LAYERS),
                         f"{max(layers, 0)} layer(s) left for {stages} middle pipeline stage(s) "
                         f"(num_layers={k.num_layers} minus the first / last stage's)",
                         "leave layers for the middle stages exactly when there are middle stages")
    if stages:
        if layers % stages:
            raise SplitError("PP-UNEVEN-MIDDLE", (FIRST, LAST, LAYERS),
                             f"the {layers} middle layers must divide into the {stages} middle pipeline stages",
                             f"change {FIRST} / {LAST} so that the rest divides by {stages}")
        middle = layers // stages
        if middle % k.vpp:
            raise SplitError("PP-UNEVEN-VIRTUAL", (FIRST, LAST, VPP),
                             f"each middle pipeline stage's {middle} layers must divide into its "
                             f"virtual_pipeline_model_parallel_size={k.vpp} chunks",
                             f"choose {FIRST} / {LAST} so that each middle stage holds a multiple of {k.vpp}")
        for r in range(k.pp):
            per_rank.setdefault(r, middle)
    return tuple(per_rank[r] // k.vpp for r in rank_of_chunk)


def _accounted(k: SplitKeys) -> tuple[int, ...]:
    """Megatron's embedding / loss counted as layers: ``num_layers + 1 (+ 1)`` cut evenly."""
    total = k.num_layers + int(k.embedding) + int(k.loss)
    if total % k.pp:
        raise SplitError("PP-ACCOUNT-DIVIDES", (LAYERS, EMBEDDING, LOSS, PP),
                         f"num_layers={k.num_layers} plus the embedding / loss counted as layers is "
                         f"{total}, which must divide into pipeline_model_parallel_size={k.pp} stages",
                         f"set model.num_layers so that num_layers + {total - k.num_layers} is a multiple of {k.pp}")
    per_rank = total // k.pp
    if per_rank % k.vpp:
        raise SplitError("PP-ACCOUNT-DIVIDES", (LAYERS, EMBEDDING, LOSS, VPP),
                         f"each pipeline stage's {per_rank} layers (embedding / loss counted) must divide "
                         f"into virtual_pipeline_model_parallel_size={k.vpp} chunks",
                         f"set model.num_layers so that (num_layers + {total - k.num_layers}) / {k.pp} "
                         f"is a multiple of {k.vpp}")
    n = per_rank // k.vpp
    sizes = [n] * (k.pp * k.vpp)
    sizes[0] -= int(k.embedding)
    sizes[-1] -= int(k.loss)
    return tuple(sizes)


def _from_layout(k: SplitKeys) -> tuple[int, ...]:
    """Megatron's ``PipelineParallelLayerLayout`` checks on a layout string."""
    assert k.layout is not None
    others = [key for key, on in ((FIRST, k.first is not None), (LAST, k.last is not None),
                                  (EMBEDDING, k.embedding), (LOSS, k.loss)) if on]
    if others:
        raise SplitError("PP-LAYOUT-EXCLUSIVE", (LAYOUT, *others),
                         f"pipeline_model_parallel_layout cannot be set with {', '.join(others)}",
                         "spell the split in the layout string alone, or drop the layout")
    chunks = parse_layout(k.layout)
    if len(chunks) % k.pp:
        raise SplitError("PP-LAYOUT-STAGES", (LAYOUT, PP),
                         f"pipeline_model_parallel_layout has {len(chunks)} chunk(s), not a multiple of "
                         f"pipeline_model_parallel_size={k.pp}",
                         f"spell a multiple of {k.pp} chunks separated by |")
    if len(chunks) // k.pp != k.vpp:
        raise SplitError("PP-LAYOUT-STAGES", (LAYOUT, VPP),
                         f"pipeline_model_parallel_layout has {len(chunks)} chunks = {len(chunks) // k.pp} per "
                         f"pipeline rank, but virtual_pipeline_model_parallel_size={k.vpp}",
                         "leave model.virtual_pipeline_model_parallel_size=null (derived from the layout) or "
                         "make the two agree")
    flat = "".join(chunks)
    problems = []
    if flat.count("E") != 1 or not chunks[0].startswith("E"):
        problems.append("the embedding E exactly once, first in the first chunk")
    if flat.count("L") != 1 or not chunks[-1].endswith("L"):
        problems.append("the loss L exactly once, last in the last chunk")
    if flat.count("t") != k.num_layers:
        problems.append(f"num_layers={k.num_layers} transformer layers t (it has {flat.count('t')})")
    empty = [i for i, c in enumerate(chunks) if not c]
    if empty:
        problems.append(f"something in every chunk (chunk(s) {', '.join(map(str, empty))} are empty)")
    if problems:
        raise SplitError("PP-LAYOUT-CONTENTS", (LAYOUT, LAYERS),
                         f"pipeline_model_parallel_layout={k.layout!r} must hold " + "; ".join(problems),
                         "spell the layout as E, then the num_layers t's cut by |, then L, e.g. "
                         "'Et|tt|tt|tL'")
    return tuple(c.count("t") for c in chunks)


def chunk_sizes(k: SplitKeys, rank_of_chunk: Optional[list[int]] = None) -> tuple[int, ...]:
    """The transformer layers of every model chunk, in model order; ``rank_of_chunk[c]`` is
    the pipeline rank running chunk ``c`` (the loop layout's ``c % PP`` by default). Raises
    :class:`SplitError` naming the rule a split breaks."""
    ranks = rank_of_chunk if rank_of_chunk is not None else [c % k.pp for c in range(k.pp * k.vpp)]
    if k.layout is not None:
        return _from_layout(k)
    if k.uneven_stages:
        return _first_last(k, ranks)
    if k.accounts:
        sizes = _accounted(k)
        if min(sizes) < 0 or (len(sizes) == 1 and sizes[0] < 0):
            raise SplitError("PP-ACCOUNT-DIVIDES", (LAYERS, EMBEDDING, LOSS),
                             "not enough layers for the first / last chunk once the embedding / loss "
                             "is counted as one", "raise model.num_layers")
        return sizes
    return _even(k)
