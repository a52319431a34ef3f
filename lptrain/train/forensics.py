"""What the loop does when a step goes wrong: find where, record it, then stop, skip or roll back.

An *anomaly* is a step whose loss or gradient is not finite, or whose loss diverged or spiked
(:class:`lptrain.train.loss_watch.LossWatch`). The engine takes no update for it and
returns it (``TrainEngine.returns_anomalies``); :func:`investigate` then re-runs the step
(:meth:`~lptrain.train.engine.TrainEngine.rerun_without_update`, which puts back every state
the re-run touches) with hooks armed on every module -- only then, so normal steps pay
nothing -- to name the first module whose forward output, or else whose output grad, went
non-finite, on which rank and in which micro-batch (so which samples), together with that
step's quantization statistics. A finite anomaly (a divergence, a spike) has no non-finite
tensor: its culprit is the operand whose statistics moved most (:func:`moved_most`) against
the last normal step's batch re-run with the same weights -- one variable changed, the data;
that re-run's loss says whether the weights are to blame too. The loop writes the record to
``anomalies.jsonl`` and the summary and applies ``train.on_anomaly`` (:mod:`lptrain.train.loop`).

``debug.nan_sample`` (:class:`NaNInjector`) puts a NaN into one named module's output or
output grad in the step that reads one sample: a data-borne fault, which a rollback that
skips the data window gets past, and which a replay of that step reproduces.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Optional

import torch
from torch import nn

from lptrain.errors import InputError

if TYPE_CHECKING:
    from lptrain.config.schema import LPTrainConfig
    from lptrain.train.engine import TrainEngine

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
                samples: Sequence[Sequence[int]], dispatch: list[Any],
                reference: Optional[tuple[int, Sequence[dict[str, torch.Tensor]]]] = None) -> dict[str, Any]:
    """Re-run an anomalous step with the forensic hooks and the statistics armed; returns
    ``{"culprit": ..., "ranks": [...], "numerics": ...}`` (the same on every rank; the
    culprit is the lowest rank's first non-finite tensor, a forward output before an output
    grad). When the re-run is finite everywhere (a divergence, a spike) and ``reference`` --
    ``(step, micro-batches)`` of the last normal step -- is given, that batch is re-run too and
    the culprit is the operand whose statistics moved most (:func:`moved_most`); else None.
    ``dispatch`` is the job's list of per-micro-batch callbacks; the finder joins it for the
    re-run. Collective."""
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
    if culprit is None and reference is not None and numerics:
        ref_step, ref_batches = reference
        with collecting(engine, True) as stats:
            losses = engine.rerun_without_update(ref_batches)
        culprit = moved_most(numerics, stats.result() or {})
        if culprit is not None:
            culprit.update(reference_step=ref_step, reference_loss=float(losses[:, 0].mean()))
    return {"culprit": culprit, "ranks": [f["rank"] for f in found], "numerics": numerics}


# How far a statistic moved, in binades (factors of 2): the magnitudes by their log2 ratio,
# the median block-scale exponent as it is, the SNR at 6.02 dB a bit. The extreme exponents
# follow single blocks (noise); the fractions (underflow, saturation, zero blocks) have no
# such unit and move with the magnitudes.
_LOG2_STATS = ("amax", "scale")
_EXP_STATS = ("scale_exp_median",)
_DB_PER_BIT = 20 * math.log10(2)


def _binades(stat: str, now: float, then: float) -> float:
    if stat in _LOG2_STATS:
        return abs(math.log2(now / then)) if now > 0 and then > 0 else 0.0
    if stat == "snr_db":
        return abs(now - then) / _DB_PER_BIT
    return abs(now - then)


def moved_most(now: dict[str, dict[str, Any]], then: dict[str, dict[str, Any]]) -> Optional[dict[str, Any]]:
    """The operand and statistic of ``now`` that moved most against ``then`` (both
    ``{operand: {statistic: value}}``, an operand named ``<module>.<role>``): ``{"module",
    "tensor", "operand", "statistic", "value", "reference", "binades"}``; None when nothing
    moved. A non-finite count where there was none moves most of all."""
    best: Optional[tuple[float, str, str, float, float]] = None
    for op, stats in now.items():
        ref = then.get(op, {})
        for stat, v in stats.items():
            r = ref.get(stat)
            if r is None or v is None:
                continue
            if stat == "nonfinite":
                moved = math.inf if v > 0 and r == 0 else 0.0
            elif stat in _LOG2_STATS or stat in _EXP_STATS or stat == "snr_db":
                moved = _binades(stat, float(v), float(r))
            else:
                continue
            if moved > 0 and (best is None or moved > best[0]):
                best = (moved, op, stat, float(v), float(r))
    if best is None:
        return None
    moved, op, stat, v, r = best
    module, _, role = op.rpartition(".")
    return {"module": module, "tensor": role, "operand": op, "statistic": stat, "value": v,
            "reference": r, "binades": moved if math.isfinite(moved) else None}


def describe(culprit: Optional[dict[str, Any]]) -> str:
    """``first non-finite: output grad of 'x' (rank 0, micro-batch 1, samples 12-15)``, or
    for a finite anomaly the operand whose statistics moved most."""
    if culprit is None:
        return "the re-run of the step was finite on every rank"
    if "statistic" in culprit:
        moved = f"{culprit['binades']:.1f} binades" if culprit["binades"] is not None else "newly non-finite"
        return (f"statistics moved most: {culprit['tensor']} of '{culprit['module']}' "
                f"({culprit['statistic']} {culprit['reference']:.4g} -> {culprit['value']:.4g}, {moved}, "
                f"against step {culprit['reference_step']}'s batch re-run with the same weights, "
                f"whose loss is {culprit['reference_loss']:.4g})")
    s = culprit["samples"]
    span = f"samples {s[0]}-{s[-1]}" if len(s) > 1 else f"sample {s[0]}" if s else "no samples"
    return (f"first non-finite: {culprit['tensor']} of '{culprit['module']}' (rank "
            f"{culprit['rank']}, micro-batch {culprit['micro_batch']}, {span})")


def batch_span(consumed_before: int, global_batch_size: int) -> list[int]:
    """The step's global batch as ``[first, end)`` sample positions."""
    return [consumed_before, consumed_before + global_batch_size]

