"""Pipeline-parallel arithmetic (torch-free): which layers each model chunk holds, which chunks
a rank runs, how many micro-batches a schedule keeps in flight, and the bubble of a schedule.

The rules (``validate-config``), the model build, the engine, the memory planner and the
bench all read this one module, so they cannot disagree about a split.

**Chunks.** The ``num_layers`` transformer layers are cut into ``PP x VPP`` *model chunks*
(virtual stages) in layer order -- evenly, or as Megatron-LM's uneven keys ask
(:mod:`lptrain.catalog.pipeline_split`: the first / last stage's layer counts, the embedding and
the loss counted as layers, a layout string). The token embedding lives on chunk 0, the final
norm, the output head and the loss on the last chunk.

**Ranks.** The *loop* layout (Megatron-LM's, and ``torch.distributed.pipelining``'s
``Schedule1F1B``, ``ScheduleInterleaved1F1B``, ``ScheduleInterleavedZeroBubble``): chunk ``c``
runs on pipeline rank ``c % PP``, so rank ``r`` holds chunks ``r, r + PP, ...``. The *V* layout
(``ScheduleZBVZeroBubble``, ``ScheduleDualPipeV``: exactly two chunks per rank): chunk ``c`` runs
on rank ``c`` for ``c < PP`` and on rank ``2 PP - 1 - c`` after, so rank 0 holds the first and
the last chunk -- the embedding and the loss on one rank.

**In-flight micro-batches** (the activation memory of a stage): under 1F1B pipeline rank ``r``
runs ``min(m, PP - r)`` forwards before its first backward, so the first stage holds the most
(``min(m, PP)``); interleaving multiplies a stage's activations by Megatron's penalty
``1 + (PP - 1) / (PP x VPP)`` (Megatron-LM's theoretical memory usage report). The zero-bubble
schedules keep a micro-batch's weight-gradient operands until its W step: their peak is read
off the schedule's own order (:func:`peak_in_flight`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

from lptrain.catalog.pipeline_split import SplitError, SplitKeys, chunk_sizes

SCHEDULES: tuple[str, ...] = ("1f1b", "interleaved_1f1b", "interleaved_zero_bubble", "zbv_zero_bubble",
                              "dualpipev")
# schedules that place two chunks per rank in a V (torch's "v" stage-to-rank style)
V_SCHEDULES: tuple[str, ...] = ("zbv_zero_bubble", "dualpipev")
# schedules that split a backward into its input-gradient (I) and weight-gradient (W) parts
SPLIT_BACKWARD_SCHEDULES: tuple[str, ...] = ("interleaved_zero_bubble", "zbv_zero_bubble", "dualpipev")


@dataclass(frozen=True)
class PipelineLayout:
    """The split of ``num_layers`` layers over ``pp`` pipeline ranks with ``vpp`` model chunks
    each. ``sizes``: the layers of every chunk in model order (empty: the even split, which
    the methods assume divides -- rule PP-LAYERS-DIVIDE); ``v_shape``: the V placement of the
    chunks on ranks (module doc)."""

    num_layers: int
    pp: int = 1
    vpp: int = 1
    sizes: tuple[int, ...] = field(default=())
    v_shape: bool = False

    @staticmethod
    def of(keys: SplitKeys) -> PipelineLayout:
        """The layout Megatron's keys ask for (raises :class:`~lptrain.catalog.pipeline_split.
        SplitError` for a split the rules refuse)."""
        lay = PipelineLayout(keys.num_layers, keys.pp, keys.vpp, v_shape=keys.v_shape)
        if lay.chunks > max(0, keys.num_layers) + 2:  # not even one layer (or the embedding / loss) each
            raise SplitError("PP-LAYERS-DIVIDE", ("model.num_layers", "model.pipeline_model_parallel_size",
                                                  "model.virtual_pipeline_model_parallel_size"),
                             f"{lay.chunks} model chunks (pipeline x virtual size) for {keys.num_layers} layers",
                             "lower model.pipeline_model_parallel_size / model.virtual_pipeline_model_parallel_size")
        sizes = chunk_sizes(keys, [lay.chunk_rank(c) for c in range(lay.chunks)])
        return PipelineLayout(keys.num_layers, keys.pp, keys.vpp, tuple(sizes), keys.v_shape)

    @property
    def chunks(self) -> int:
        """Model chunks (virtual stages) in the whole pipeline."""
        return self.pp * self.vpp

    @property
    def chunk_sizes(self) -> tuple[int, ...]:
        """Transformer layers per chunk, in model order."""
        if self.sizes:
            return self.sizes
        return (self.num_layers // self.chunks,) * self.chunks

    @property
    def uneven(self) -> bool:
        return len(set(self.chunk_sizes)) > 1

    def divides(self) -> bool:
        """The even split exists (or an explicit one was given)."""
        if self.sizes:
            return True
        return self.chunks >= 1 and self.num_layers % self.chunks == 0 and self.num_layers >= self.chunks

    def chunk_layers(self, chunk: int) -> range:
        """The global (0-based) indices of the layers of model chunk ``chunk``."""
        if not 0 <= chunk < self.chunks:
            raise ValueError(f"chunk {chunk} not in [0, {self.chunks})")
        sizes = self.chunk_sizes
        start = sum(sizes[:chunk])
        return range(start, start + sizes[chunk])

    def chunk_rank(self, chunk: int) -> int:
        """The pipeline rank running model chunk ``chunk`` (loop or V placement)."""
        if self.v_shape and chunk >= self.pp:
            return 2 * self.pp - 1 - chunk
        return chunk % self.pp

    def rank_chunks(self, pp_rank: int) -> list[int]:
        """The model chunks pipeline rank ``pp_rank`` runs, in model order."""
        if not 0 <= pp_rank < self.pp:
            raise ValueError(f"pipeline rank {pp_rank} not in [0, {self.pp})")
        return [c for c in range(self.chunks) if self.chunk_rank(c) == pp_rank]

    def rank_layers(self, pp_rank: int) -> list[int]:
        """Every layer pipeline rank ``pp_rank`` holds (all its chunks), in layer order."""
        return [i for c in self.rank_chunks(pp_rank) for i in self.chunk_layers(c)]

    def holds_embedding(self, pp_rank: int) -> bool:
        return self.chunk_rank(0) == pp_rank

    def holds_head(self, pp_rank: int) -> bool:
        return self.chunk_rank(self.chunks - 1) == pp_rank

    @property
    def loss_rank(self) -> int:
        """The pipeline rank computing the loss (the last chunk's): ``PP - 1``, or 0 in a V."""
        return self.chunk_rank(self.chunks - 1)

    def stage_of_layer(self, layer: int) -> int:
        """The pipeline rank holding global layer ``layer``."""
        for c in range(self.chunks):
            if layer in self.chunk_layers(c):
                return self.chunk_rank(c)
        raise ValueError(f"layer {layer} not in [0, {self.num_layers})")

    def describe(self) -> str:
        """One line per pipeline rank: its chunks' layers (what ``validate-config`` shows)."""
        rows = []
        for r in range(self.pp):
            parts = []
            for c in self.rank_chunks(r):
                lay = self.chunk_layers(c)
                what = [f"layers {lay.start}-{lay.stop - 1}" if len(lay) > 1 else f"layer {lay.start}"][:len(lay)]
                if c == 0:
                    what.insert(0, "embedding")
                if c == self.chunks - 1:
                    what.append("loss")
                parts.append(f"chunk {c}: " + " + ".join(what))
            rows.append(f"pipeline rank {r}: " + "; ".join(parts))
        return "\n".join(rows)

    def in_flight(self, pp_rank: int, micro_batches: int) -> float:
        """Micro-batches whose activations pipeline rank ``pp_rank`` holds at its peak, as
        Megatron counts them: ``min(m, PP - r)`` under 1F1B (``m`` on every stage when
        ``m < PP``: all forwards run before the first backward); with interleaving the first
        stage's ``PP`` scaled by ``1 + (PP - 1) / (PP x VPP)`` (its chunks are ``1 / VPP`` of
        its layers each; the penalty counts the extra warm-up forwards). The zero-bubble
        schedules: :func:`peak_in_flight` of their order."""
        if self.pp == 1:
            return 1.0
        if self.vpp > 1:  # (interleaving needs m % PP == 0: m >= PP)
            return (self.pp - pp_rank) * (1 + (self.pp - 1) / (self.pp * self.vpp))
        return float(micro_batches if micro_batches < self.pp else self.pp - pp_rank)


def split_keys(model: Any) -> SplitKeys:
    """The split keys of a model config section (``model.*``: any object with its fields)."""
    vpp = model.virtual_pipeline_model_parallel_size
    return SplitKeys(
        num_layers=model.num_layers, pp=max(1, model.pipeline_model_parallel_size),
        vpp=max(1, vpp) if vpp is not None else 1,
        first=model.decoder_first_pipeline_num_layers, last=model.decoder_last_pipeline_num_layers,
        embedding=bool(model.account_for_embedding_in_pipeline_split),
        loss=bool(model.account_for_loss_in_pipeline_split),
        layout=model.pipeline_model_parallel_layout,
        v_shape=model.pipeline_schedule in V_SCHEDULES)


def layout_for(model: Any) -> PipelineLayout:
    """The run's layout from its ``model`` config section (raises ``SplitError`` for a split
    the rules refuse: the rules run first)."""
    keys = split_keys(model)
    if keys.pp == 1 and keys.vpp == 1:
        return PipelineLayout(keys.num_layers)
    return PipelineLayout.of(keys)


def bubble_fraction(pp: int, micro_batches: int, vpp: int = 1) -> float:
    """The idle fraction of a pipeline step, analytically: ``(p - 1) / (m + p - 1)`` for 1F1B
    (Narayanan et al. 2021), ``(p - 1) / (v m + p - 1)`` with ``v`` interleaved chunks (each
    chunk's forward and backward is ``1 / v`` of a stage's)."""
    return (pp - 1) / (vpp * micro_batches + pp - 1)


# ---- a schedule's order, simulated ------------------------------------------------------------

# One action of a rank's order: (chunk, kind, micro-batch); kind "F" forward, "B" a whole
# backward, "I" its input-gradient part, "W" its weight-gradient part.
Action = tuple[int, str, int]


@dataclass(frozen=True)
class Simulation:
    """When a schedule's order finishes under given action costs (:func:`simulate`)."""

    step: float  # the last action's end
    busy: tuple[float, ...]  # per rank: the sum of its actions' costs

    @property
    def bubble(self) -> float:
        """The idle fraction of the step, averaged over the ranks."""
        return 1.0 - sum(self.busy) / len(self.busy) / self.step if self.step > 0 else 0.0


def simulate(orders: Mapping[int, Sequence[Action]], cost: Mapping[tuple[int, str], float],
             num_chunks: int, link: float = 0.0, cores: Optional[int] = None, send: float = 0.0,
             held: Optional[Mapping[Action, Action]] = None) -> Simulation:
    """Run each rank's ``orders`` in sequence, every action starting when its rank is free
    and its input exists: a forward after the previous chunk's forward of that micro-batch, a
    backward (B or I) after the next chunk's (the last chunk's after its own forward), a W
    after its I. ``cost[(chunk, kind)]`` is one action's seconds ("B" defaults to I + W). A
    P2P transfer (an output another rank consumes) arrives ``link`` later and occupies its
    sender ``send`` seconds after the action (a CPU transport's copy: idle for the bubble,
    busy for the rank). ``cores``: the ranks share that many cores (processor sharing: ``k``
    actions running at once each progress at ``min(1, cores / k)``); None gives every rank its
    own (a GPU each). ``held``: actions whose output leaves for another rank only once a later
    action of theirs has run (a paired forward and backward: :func:`lptrain.distributed.
    pipeline_orders.held_outputs`). The analytic bubble of any schedule at any stage loads."""
    rank_of = {a[0]: r for r, acts in orders.items() for a in acts}
    done: dict[tuple[int, str, int], float] = {}
    pos = {r: 0 for r in orders}
    busy = {r: 0.0 for r in orders}
    running: dict[int, list[float]] = {}  # rank -> [seconds of work left]

    def seconds(chunk: int, kind: str) -> float:
        if kind == "B" and (chunk, "B") not in cost:
            return cost[(chunk, "I")] + cost[(chunk, "W")]
        return cost[(chunk, kind)]

    def sends(r: int, chunk: int, kind: str) -> bool:
        """Whether the action's output goes to another rank."""
        to = chunk + 1 if kind == "F" else chunk - 1 if kind in ("B", "I") else -1
        return 0 <= to < num_chunks and rank_of.get(to, r) != r

    def arrival(r: int) -> Optional[float]:
        """When rank ``r``'s next action has its input (None: not produced yet)."""
        chunk, kind, mb = orders[r][pos[r]]
        if kind == "F":
            dep = (chunk - 1, "F", mb) if chunk > 0 else None
        elif kind == "W":
            dep = (chunk, "I", mb)
        elif chunk == num_chunks - 1:
            dep = (chunk, "F", mb)
        else:
            dep = (chunk + 1, "B", mb) if (chunk + 1, "B", mb) in done else (chunk + 1, "I", mb)
        if dep is None:
            return 0.0
        if dep not in done:
            return None
        if rank_of.get(dep[0]) == r:
            return done[dep]
        release = (held or {}).get(dep, dep)
        if release not in done:
            return None
        return max(done[dep], done[release]) + link + send

    now = 0.0
    while True:
        waits = []
        for r in orders:
            if r in running or pos[r] >= len(orders[r]):
                continue
            at = arrival(r)
            if at is not None and at <= now:
                chunk, kind, _mb = orders[r][pos[r]]
                running[r] = [seconds(chunk, kind), send if sends(r, chunk, kind) else 0.0]
            elif at is not None:
                waits.append(at - now)
        if not running:
            if not waits:
                break
            now += min(waits)
            continue
        computing = [r for r in running if running[r][0] > 0]
        rate = 1.0 if cores is None or not computing else min(1.0, cores / len(computing))
        dt = min([(left[0] / rate if left[0] > 0 else left[1]) for left in running.values()] + waits)
        now += dt
        eps = 1e-12 * max(1.0, now)
        for r in list(running):
            left = running[r]
            if left[0] > 0:  # computing
                left[0] -= dt * rate
                busy[r] += dt * rate
                if left[0] <= eps:
                    left[0] = 0.0
                    done[orders[r][pos[r]]] = now  # (the output exists; its transfer follows)
            else:  # sending
                left[1] -= dt
            if left[0] <= eps and left[1] <= eps:
                pos[r] += 1
                del running[r]
    if any(pos[r] < len(orders[r]) for r in orders):
        raise ValueError("the schedule's order deadlocks (an action waits on one never run)")
    return Simulation(now, tuple(busy[r] for r in sorted(busy)))


def peak_in_flight(order: Sequence[Action], layers: Mapping[int, int]) -> float:
    """The most micro-batches' activations one rank's ``order`` holds at once, in whole-rank
    units: a chunk's micro-batch is held from its forward to its B (or its W: the W keeps the
    operands of the weight gradient), weighted by the chunk's share ``layers[chunk]`` of the
    rank's layers (an even split: each chunk ``1 / VPP``)."""
    total = sum(layers.values())
    live = peak = 0.0
    for chunk, kind, _mb in order:
        share = layers.get(chunk, 0) / total if total else 1.0 / max(1, len(layers))
        if kind == "F":
            live += share
            peak = max(peak, live)
        elif kind in ("B", "W"):
            live -= share
    return peak
