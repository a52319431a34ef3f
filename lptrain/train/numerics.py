"""A step's quantization statistics, collected by the engine (``logging.numerics_interval``).

:func:`collecting` arms the collection for one step: on the emulated backend the quantized
ops record every operand they quantize (:mod:`lptrain.precision.operand_stats`, exact: the
bytes the GEMMs read); on Transformer Engine the probe of :mod:`lptrain.precision.te_numerics`
reads TE's own quantized tensors. Outside an armed step nothing is recorded and nothing is
paid but one attribute check per GEMM. At the end of the step the statistics leave the
device in one copy, are merged over the ranks (counts and sums add, maxima max: the
statistics of the global batch) and reduced to the figures of
:func:`lptrain.precision.operand_stats.finish`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Optional

from lptrain.precision import operand_stats as _stats

if TYPE_CHECKING:
    from lptrain.train.engine import TrainEngine

Figures = dict[str, dict[str, Optional[float]]]


class Collection:
    """One armed step's statistics (``result()`` None when the step was not armed)."""

    def __init__(self, recorder: Optional[_stats.OperandRecorder]) -> None:
        self.recorder = recorder

    def result(self) -> Optional[Figures]:
        """The figures per operand, merged over every rank (collective when armed)."""
        if self.recorder is None:
            return None
        return finish_all(gather(self.recorder.read()))


@contextlib.contextmanager
def collecting(engine: TrainEngine, armed: bool) -> Iterator[Collection]:
    """Collect the statistics of the GEMMs run inside (with their backwards) when ``armed``."""
    if not armed:
        yield Collection(None)
        return
    recorder = _stats.OperandRecorder()
    if engine.cfg.precision.backend == "te":
        from lptrain.precision.te_numerics import probing

        ctx: Any = probing(engine.model, recorder)
    else:
        ctx = _stats.recording(recorder)
    with ctx:
        yield Collection(recorder)


def gather(local: dict[str, list[float]]) -> dict[str, list[float]]:
    """Every rank's operand vectors merged by name (sums add, maxima max); ranks holding
    other experts contribute their own names. One object all-gather when there are ranks."""
    import torch.distributed as dist

    parts = [local]
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        parts = [{} for _ in range(dist.get_world_size())]
        dist.all_gather_object(parts, local)
    merged: dict[str, list[float]] = {}
    for part in parts:
        for name, vec in part.items():
            held = merged.get(name)
            if held is None:
                merged[name] = list(vec)
                continue
            for i in range(_stats.N_SUMMED):
                held[i] += vec[i]
            for i in range(_stats.N_SUMMED, _stats.WIDTH):
                held[i] = max(held[i], vec[i])
    return merged


def finish_all(vectors: dict[str, list[float]]) -> Figures:
    """Each operand's reported figures, without the ones that do not apply (``None``)."""
    out: Figures = {}
    for name, vec in vectors.items():
        out[name] = {k: v for k, v in _stats.finish(vec).items() if v is not None}
    return out


def flat_for_wandb(figures: Figures) -> dict[str, float]:
    """``numerics/<operand>/<statistic>`` keys (W&B charts one scalar per key)."""
    return {f"numerics/{op}/{k}": v for op, stats in figures.items() for k, v in stats.items()
            if v is not None}
