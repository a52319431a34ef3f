"""Pipeline-parallel arithmetic (torch-free): which layers each stage holds, which stages a
rank runs, and how many micro-batches a schedule keeps in flight.

The rules (``validate-config``), the model build, the engine and the memory planner all read
this one module, so they cannot disagree about a split.

**Stages and chunks.** Megatron-LM's layout: the ``num_layers`` transformer layers are cut into
``PP x VPP`` equal *model chunks* (virtual stages) in layer order; chunk ``c`` runs on
pipeline rank ``c % PP`` (``VPP`` = ``virtual_pipeline_model_parallel_size``, 1 without
interleaving). So pipeline rank ``r`` holds chunks ``r, r + PP, r + 2 PP, ...`` -- the loop
layout both Megatron's interleaved schedule and ``torch.distributed.pipelining``'s
``ScheduleInterleaved1F1B`` run. The token embedding lives on chunk 0 (pipeline rank 0), the
final norm, the output head and the loss on the last chunk (pipeline rank ``PP - 1``).

**In-flight micro-batches** (the activation memory of a stage): under 1F1B pipeline rank ``r``
runs ``min(m, PP - r)`` forwards before its first backward, so the first stage holds the most
(``min(m, PP)``); interleaving multiplies a stage's activations by Megatron's penalty
``1 + (PP - 1) / (PP x VPP)`` (Megatron-LM's theoretical memory usage report).
"""

from __future__ import annotations

from dataclasses import dataclass

SCHEDULES: tuple[str, ...] = ("1f1b", "interleaved_1f1b")


@dataclass(frozen=True)
class PipelineLayout:
    """The split of ``num_layers`` layers over ``pp`` pipeline ranks with ``vpp`` model chunks
    each. Sizes that do not divide are the rules' business (PP-LAYERS-DIVIDE): the methods
    assume ``num_layers % (pp * vpp) == 0``."""

    num_layers: int
    pp: int = 1
    vpp: int = 1

    @property
    def chunks(self) -> int:
        """Model chunks (virtual stages) in the whole pipeline."""
        return self.pp * self.vpp

    @property
    def layers_per_chunk(self) -> int:
        return self.num_layers // self.chunks

    def divides(self) -> bool:
        return self.chunks >= 1 and self.num_layers % self.chunks == 0 and self.num_layers >= self.chunks

    def chunk_layers(self, chunk: int) -> range:
        """The global (0-based) indices of the layers of model chunk ``chunk``."""
        if not 0 <= chunk < self.chunks:
            raise ValueError(f"chunk {chunk} not in [0, {self.chunks})")
        n = self.layers_per_chunk
        return range(chunk * n, (chunk + 1) * n)

    def rank_chunks(self, pp_rank: int) -> list[int]:
        """The model chunks pipeline rank ``pp_rank`` runs, in forward order."""
        if not 0 <= pp_rank < self.pp:
            raise ValueError(f"pipeline rank {pp_rank} not in [0, {self.pp})")
        return [pp_rank + v * self.pp for v in range(self.vpp)]

    def rank_layers(self, pp_rank: int) -> list[int]:
        """Every layer pipeline rank ``pp_rank`` holds (all its chunks), in layer order."""
        return [i for c in self.rank_chunks(pp_rank) for i in self.chunk_layers(c)]

    def holds_embedding(self, pp_rank: int) -> bool:
        return pp_rank == 0

    def holds_head(self, pp_rank: int) -> bool:
        return pp_rank == self.pp - 1

    def stage_of_layer(self, layer: int) -> int:
        """The pipeline rank holding global layer ``layer``."""
        return (layer // self.layers_per_chunk) % self.pp

    def in_flight(self, pp_rank: int, micro_batches: int) -> float:
        """Micro-batches whose activations pipeline rank ``pp_rank`` holds at its peak, as
        Megatron counts them: ``min(m, PP - r)`` under 1F1B (``m`` on every stage when
        ``m < PP``: all forwards run before the first backward); with interleaving the first
        stage's ``PP`` scaled by ``1 + (PP - 1) / (PP x VPP)`` (its chunks are ``1 / VPP`` of
        its layers each; the penalty counts the extra warm-up forwards)."""
        if self.pp == 1:
            return 1.0
        if self.vpp > 1:  # (interleaving needs m % PP == 0: m >= PP)
            return (self.pp - pp_rank) * (1 + (self.pp - 1) / (self.pp * self.vpp))
        return float(micro_batches if micro_batches < self.pp else self.pp - pp_rank)


def bubble_fraction(pp: int, micro_batches: int, vpp: int = 1) -> float:
    """The idle fraction of a pipeline step, analytically: ``(p - 1) / (m + p - 1)`` for 1F1B
    (Narayanan et al. 2021), ``(p - 1) / (v m + p - 1)`` with ``v`` interleaved chunks (each
    chunk's forward and backward is ``1 / v`` of a stage's)."""
    return (pp - 1) / (vpp * micro_batches + pp - 1)
