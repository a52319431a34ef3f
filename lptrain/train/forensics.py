"""What the loop does when a step goes wrong: find where, record it, then stop, skip or roll back.

An *anomaly* is a step whose loss or gradient is not finite, or whose loss spikes
(``train.spike_zscore``: :class:`SpikeDetector`). The engine takes no update for it and
returns it (``TrainEngine.returns_anomalies``); :func:`investigate` then re-runs the step
(:meth:`~lptrain.train.engine.TrainEngine.rerun_without_update`, which puts back every state
the re-run touches) with hooks armed on every module -- only then, so normal steps pay
nothing -- to name the first module whose forward output, or else whose output grad, went
non-finite, on which rank and in which micro-batch (so which samples), together with that
step's quantization statistics. The loop writes the record to ``anomalies.jsonl`` and the
summary and applies ``train.on_anomaly`` (:mod:`lptrain.train.loop`).

``debug.nan_sample`` (:class:`NaNInjector`) puts a NaN into one named module's output or
output grad in the step that reads one sample: a data-borne fault, which a rollback that
skips the data window gets past, and which a replay of that step reproduces.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Optional

import torch
from torch import nn

from lptrain.errors import InputError

if TYPE_CHECKING:
    from lptrain.config.schema import LPTrainConfig
    from lptrain.train.engine import TrainEngine

MIN_SPIKE_HISTORY = 10  # steps of history before a z-score means anything


class SpikeDetector:
    """``train.spike_zscore``: a loss more than ``zscore`` standard deviations above the mean
    of the last ``window`` accepted steps (at least :data:`MIN_SPIKE_HISTORY` of them, or the
    whole window when it is shorter) is a spike. Every rank sees the same losses (they are
    all-reduced), so every rank decides alike. The history starts empty in each job."""

    def __init__(self, zscore: Optional[float], window: int) -> None:
        self.zscore = zscore
        self.window = window
        self.history: deque[tuple[int, float]] = deque(maxlen=window)

    @property
    def enabled(self) -> bool:
        return self.zscore is not None

    def check(self, loss: float) -> Optional[str]:
        """Why ``loss`` is a spike, or None."""
        if self.zscore is None or len(self.history) < min(MIN_SPIKE_HISTORY, self.window):
            return None
        values = [v for _, v in self.history]
        mean = sum(values) / len(values)
        std = math.sqrt(sum((v - mean) ** 2 for v in values) / len(values))
        if not math.isfinite(loss) or std == 0.0:
            return None
        z = (loss - mean) / std
        if z <= self.zscore:
            return None
        return (f"loss {loss:.4f} is {z:.1f} standard deviations above the mean of the last "
                f"{len(values)} steps ({mean:.4f} +- {std:.4f}; train.spike_zscore={self.zscore:g})")

    def observe(self, step: int, loss: float) -> None:
        """An accepted step's loss joins the history."""
        if math.isfinite(loss):
            self.history.append((step, loss))

    def forget_after(self, step: int) -> None:
        """A rollback to ``step``: the losses of the steps after it are gone."""
        self.history = deque(((s, v) for s, v in self.history if s <= step), maxlen=self.window)


def micro_batch_samples(sampler: Any, consumed_before: int, num_micro: int) -> list[list[int]]:
    """This rank's global sample positions per micro-batch of the step that starts at
    ``consumed_before`` (the sampler's layout: micro step ``t`` reads ``m`` positions from
    ``consumed + t*m*dp + rank*m``)."""
    step = sampler.micro_batch_size * sampler.dp_size
    return [sampler.positions_at(consumed_before + t * step).tolist() for t in range(num_micro)]


def _first_tensor(out: Any) -> Optional[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, (tuple, list)):
        return next((t for t in (_first_tensor(o) for o in out) if t is not None), None)
    return None


def _poisoned(t: torch.Tensor) -> torch.Tensor:
    out = t.clone()
    out.view(-1)[0] = float("nan")
    return out


class NaNInjector:
    """``debug.nan_sample``: a NaN in ``debug.nan_module``'s first output element (or in its
    output grad's) in the forward of the micro-batch that reads the sample, on the rank that
    reads it. A forward hook registered when the job starts (before any forensic hook, so a
    forensic hook on the same tensor sees the NaN)."""

    def __init__(self, cfg: LPTrainConfig, model: nn.Module) -> None:
        d = cfg.debug
        self.sample = d.nan_sample
        self.tensor = d.nan_tensor
        module = dict(model.named_modules()).get(d.nan_module) if d.nan_module else None
        if module is None:  # on another pipeline stage, or in no stage (refused)
            check_nan_module(cfg)
        self.handle = module.register_forward_hook(self._hook) if module is not None else None
        self.target: Optional[int] = None
        self.active = False

    def arm(self, samples: Sequence[Sequence[int]]) -> None:
        """This step's micro-batches (their sample positions): the one holding the sample."""
        self.target = next((i for i, s in enumerate(samples) if self.sample in s), None)

    def on_micro_batch(self, i: int) -> None:
        self.active = i == self.target

    def _hook(self, module: nn.Module, inputs: Any, output: Any) -> Any:
        if not self.active or not torch.is_grad_enabled():
            return None
        self.active = False  # once per micro-batch (a recompute's forward is not poisoned again)
        t = _first_tensor(output)
        if t is None:
            return None
        if self.tensor == "output_grad":
            if t.requires_grad:
                t.register_hook(_poisoned)
            return None
        bad = _poisoned(t)
        if isinstance(output, torch.Tensor):
            return bad
        return type(output)(bad if o is t else o for o in output)


def check_nan_module(cfg: LPTrainConfig) -> None:
    """``debug.nan_module`` names a module of the whole model (every pipeline stage's layers
    under their global names), else :class:`InputError` naming a few -- before the run
    folder is written. A stage checks no longer against its own layers alone: under pipeline
    parallelism every name was refused on some stage."""
    d = cfg.debug
    if d.nan_sample is None:
        return
    names = whole_module_names(cfg)
    if d.nan_module in names:
        return
    gemms = [n for n in names if n.endswith(("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"))]
    raise InputError(f"debug.nan_module={d.nan_module!r} names no module of this model "
                     f"(e.g. {', '.join(gemms[:3]) or 'layers.0'})", key="debug.nan_module",
                     fix="name a module by its state-dict prefix")


def whole_module_names(cfg: LPTrainConfig) -> list[str]:
    """The state-dict names of every module of the whole model (built on the meta device,
    without pipeline stages; tensor-parallel shards have the same names)."""
    import copy

    from lptrain.memory.plan import meta_model

    whole = copy.deepcopy(cfg)
    whole.model.pipeline_model_parallel_size = 1
    whole.model.virtual_pipeline_model_parallel_size = None
    return [n for n, _ in meta_model(whole).named_modules() if n]


class FirstNonFinite:
    """Hooks on every module (armed for a forensic re-run only): the first forward output
    and the first output grad, in execution order, that hold a NaN or an infinity."""

    def __init__(self, model: nn.Module) -> None:
        self.forward: Optional[tuple[str, int]] = None
        self.backward: Optional[tuple[str, int]] = None
        self.micro = 0
        self.handles = [m.register_forward_hook(self._hook(n)) for n, m in model.named_modules() if n]

    def on_micro_batch(self, i: int) -> None:
        self.micro = i

    def _hook(self, name: str) -> Any:
        def hook(module: nn.Module, inputs: Any, output: Any) -> None:
            t = _first_tensor(output)
            if t is None or not t.is_floating_point():
                return
            micro = self.micro
            if self.forward is None and not bool(torch.isfinite(t).all()):
                self.forward = (name, micro)
            if t.requires_grad:
                t.register_hook(lambda g: self._grad(name, micro, g))
        return hook

    def _grad(self, name: str, micro: int, g: torch.Tensor) -> None:
        if self.backward is None and not bool(torch.isfinite(g).all()):
            self.backward = (name, micro)

    def remove(self) -> None:
        for h in self.handles:
            h.remove()

    def finding(self, rank: int, samples: Sequence[Sequence[int]]) -> Optional[dict[str, Any]]:
        """This rank's culprit: module, tensor, rank, micro-batch and its samples."""
        for where, tensor in ((self.forward, "output"), (self.backward, "output grad")):
            if where is not None:
                name, micro = where
                return {"module": name, "tensor": tensor, "rank": rank, "micro_batch": micro,
                        "samples": list(samples[micro]) if micro < len(samples) else []}
        return None


def _all_findings(mine: Optional[dict[str, Any]]) -> list[Optional[dict[str, Any]]]:
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return [mine]
    out: list[Optional[dict[str, Any]]] = [None] * dist.get_world_size()
    dist.all_gather_object(out, mine)
    return out


def investigate(engine: TrainEngine, micro_batches: Sequence[dict[str, torch.Tensor]],
                samples: Sequence[Sequence[int]], dispatch: list[Any]) -> dict[str, Any]:
    """Re-run an anomalous step with the forensic hooks and the statistics armed; returns
    ``{"culprit": ..., "ranks": [...], "numerics": ...}`` (the same on every rank; the
    culprit is the lowest rank's first non-finite tensor, a forward output before an output
    grad; None when the re-run is finite everywhere, e.g. a spike). ``dispatch`` is the
    job's list of per-micro-batch callbacks; the finder joins it for the re-run. Collective."""
    from lptrain.train.numerics import collecting

    finder = FirstNonFinite(engine.model)
    dispatch.append(finder)
    try:
        with collecting(engine, True) as stats:
            engine.rerun_without_update(micro_batches)
        numerics = stats.result()
    finally:
        dispatch.remove(finder)
        finder.remove()
    findings = _all_findings(finder.finding(engine.rank, samples))
    found = [f for f in findings if f is not None]
    # forwards run from the first pipeline stage to the last, backwards the other way: the
    # first output grad to go bad is the latest stage's (pipeline ranks are outermost)
    stage = engine.groups.dims.coords
    grads = sorted((f for f in found if f["tensor"] != "output"),
                   key=lambda f: (-stage(f["rank"])["pp"], f["rank"]))
    culprit = next((f for f in found if f["tensor"] == "output"), grads[0] if grads else None)
    return {"culprit": culprit, "ranks": [f["rank"] for f in found], "numerics": numerics}


def describe(culprit: Optional[dict[str, Any]]) -> str:
    """``first non-finite: output grad of 'x' (rank 0, micro-batch 1, samples 12-15)``."""
    if culprit is None:
        return "the re-run of the step was finite on every rank"
    s = culprit["samples"]
    span = f"samples {s[0]}-{s[-1]}" if len(s) > 1 else f"sample {s[0]}" if s else "no samples"
    return (f"first non-finite: {culprit['tensor']} of '{culprit['module']}' (rank "
            f"{culprit['rank']}, micro-batch {culprit['micro_batch']}, {span})")


def batch_span(consumed_before: int, global_batch_size: int) -> list[int]:
    """The step's global batch as ``[first, end)`` sample positions."""
    return [consumed_before, consumed_before + global_batch_size]

