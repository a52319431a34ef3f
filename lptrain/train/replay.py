"""``lptrain replay RUN_DIR --step N``: run step N again and say whether it came out bitwise
the same -- the question Megatron's rerun state machine answers.

The run's ``resolved_config.yaml`` builds the engine; the newest valid checkpoint before step
N is loaded with its data position, the steps between it and N are run again (the data
skips of recorded rollbacks followed, an anomalous step skipped as the run skipped it), then
step N with its statistics and, when it is anomalous, the forensic re-run. The result is
compared with what the run recorded for step N: its ``metrics.jsonl`` line (loss, grad norm,
statistics), or its ``anomalies.jsonl`` record (loss, kind, first non-finite tensor), and
when a checkpoint of step N exists, every fp32 master weight after the step (``torch.equal``).

Bitwise the same points at the data or the numerics (a replay reproduces it); different
points at the hardware or at non-determinism. Nothing is written into the run folder.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch

from lptrain.checkpoint import find_checkpoints, load_checkpoint, read_train_state
from lptrain.errors import InputError
from lptrain.train.anomalies import read_anomalies
from lptrain.train.forensics import NaNInjector, investigate, micro_batch_samples
from lptrain.train.jsonl import step_records
from lptrain.train.loss_watch import LossWatch


@dataclass
class ReplayResult:
    step: int
    checkpoint: Path
    fast_forwarded: int
    same: bool
    anomalous: bool = False  # the run recorded an anomaly at this step
    compared: list[str] = field(default_factory=list)  # what was compared (all equal if same)
    differences: list[str] = field(default_factory=list)

    def lines(self) -> list[str]:
        head = (f"step {self.step} replayed from {self.checkpoint} ({self.fast_forwarded} "
                f"step(s) run again before it)")
        if self.same:
            why = ("the anomaly comes back from the same inputs: the data or the numerics "
                   "caused it, not the hardware" if self.anomalous else
                   "the step is reproducible from its checkpoint")
            return [head, f"bitwise the same: {', '.join(self.compared)} -- {why}"]
        return [head, "different: " + "; ".join(self.differences) + " -- the same inputs gave "
                "another result: suspect the hardware or non-determinism"]


def _run_config(run_dir: Path) -> Any:
    from lptrain.config import World, derive
    from lptrain.config.compose import load
    from lptrain.train.run_dir import rebase_on_output_dir

    path = run_dir / "resolved_config.yaml"
    if not path.is_file():
        raise InputError(f"{path} not found: not a run folder written by lptrain pretrain",
                         file=str(path), fix="pass the run folder (it holds resolved_config.yaml)")
    cfg = derive(load(path).cfg, World.detect())
    cfg.logging.progress = False
    # checkpoints the run kept inside its folder are this folder's (a copied or moved run
    # folder, another working directory), never the original's
    cfg = rebase_on_output_dir(cfg, run_dir)
    save = Path(cfg.checkpoint.save) if cfg.checkpoint.save else None
    if save is None or not save.exists():  # a relative path from elsewhere: the run's own folder
        cfg.checkpoint.save = str(run_dir / "checkpoints")
    return cfg


def _recorded(run_dir: Path, step: int) -> tuple[Optional[dict[str, Any]], Optional[dict[str, Any]]]:
    """Step ``step``'s metrics line and its anomaly record, if any (a rolled-back anomaly is
    not the step of the run's surviving history: that step was taken again)."""
    line = None
    for rec in step_records(run_dir / "metrics.jsonl"):  # damage: one line naming it, exit 2
        if rec["step"] == step:
            line = rec
    anomaly = next((r for r in reversed(read_anomalies(run_dir))
                    if r["step"] == step and r.get("action") != "rollback"), None)
    return line, anomaly


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return a == b


@dataclass
class ReplayPlan:
    """What a replay of ``step`` reads, checked before any rank builds an engine."""

    cfg: Any
    step: int
    line: Optional[dict[str, Any]]
    anomaly: Optional[dict[str, Any]]
    valid: list[Path]  # the run's valid checkpoints, newest first
    before: list[Path]  # those before ``step``, newest first
    world_size: int  # the ranks that wrote the checkpoint replayed from


def plan_replay(run_dir: str | Path, step: int, world_size: int) -> ReplayPlan:
    """The checkpoint to replay ``step`` from and what the run recorded for it; an
    :class:`InputError` (one line) when the step, a checkpoint before it, or a replay on
    ``world_size`` ranks cannot be had -- said by the launcher of a multi-rank replay once,
    before any rank starts."""
    run_dir = Path(run_dir)
    cfg = _run_config(run_dir)
    line, anomaly = _recorded(run_dir, step)
    if line is None and anomaly is None:
        raise InputError(f"{run_dir} recorded no step {step} (metrics.jsonl and anomalies.jsonl)",
                         fix="pass a step the run took: see metrics.jsonl")
    found = find_checkpoints(cfg.checkpoint.save)
    before = [f for f in found.valid if _iteration(f) < step]
    if not before:
        raise _no_checkpoint_before(cfg, step, found.valid)
    wrote = int(read_train_state(before[0]).get("world_size", world_size))
    if wrote != world_size:
        m = cfg.model
        raise InputError(
            f"{before[0]} was written by {wrote} rank(s) (TP {m.tensor_model_parallel_size} x PP "
            f"{m.pipeline_model_parallel_size} x DP {wrote // max(1, m.tensor_model_parallel_size * m.pipeline_model_parallel_size)}), "
            f"this replay runs {world_size}: a step is bitwise the same only at the run's size",
            fix=f"lptrain replay {run_dir} --step {step} --nproc-per-node {wrote}")
    return ReplayPlan(cfg, step, line, anomaly, found.valid, before, wrote)


def _iteration(folder: Path) -> int:
    return int(folder.name.rsplit("_", 1)[-1])


def _no_checkpoint_before(cfg: Any, step: int, valid: list[Path]) -> InputError:
    """Why no checkpoint precedes ``step``: none was written yet, or the ones written were
    pruned (``checkpoint.keep_latest``; this used to blame ``save_interval``)."""
    ck = cfg.checkpoint
    where = f"no valid checkpoint before step {step} in {ck.save}"
    if valid and ck.save_interval and ck.save_interval < step:
        kept = sorted(_iteration(f) for f in valid)
        return InputError(
            f"{where}: checkpoint.keep_latest={ck.keep_latest} kept the newest "
            f"{len(kept)} (step(s) {', '.join(map(str, kept))}); the older ones were pruned",
            key="checkpoint.keep_latest",
            fix=f"replay a step after {kept[0]} (--step {kept[0] + 1} or later), or raise "
                "checkpoint.keep_latest for the run to replay")
    first = f" (the first is at step {min(map(_iteration, valid))})" if valid else ""
    return InputError(f"{where}{first}", key="checkpoint.save_interval",
                      fix="replay a step after the first checkpoint, or save earlier "
                          "(checkpoint.save_interval) in the run to replay")


def replay_step(run_dir: str | Path, step: int) -> ReplayResult:
    """Replay ``step`` of the run in ``run_dir`` (see the module doc)."""
    from lptrain.data.loader import load_data_state
    from lptrain.distributed.launch_env import world_from_env
    from lptrain.train.engine import TrainEngine
    from lptrain.train.loop import _open_data, _resume
    from lptrain.train.metrics import finite_or_none

    run_dir = Path(run_dir)
    plan = plan_replay(run_dir, step, world_from_env()[1])
    cfg, line, anomaly, before = plan.cfg, plan.line, plan.anomaly, plan.before
    engine = TrainEngine(cfg)
    engine.returns_anomalies = True
    train_it, valid_it = _open_data(cfg, engine)

    class _Quiet:
        def line(self, text: str) -> None:
            pass

    state = _resume(engine, before[:1], _Quiet(), True)  # type: ignore[arg-type]
    load_data_state(state["data"], train_it, valid_it)
    start = int(state["iteration"])
    jumps = {int(r["to_step"]): int(r["skipped_samples"][1])
             for r in read_anomalies(run_dir) if r.get("action") == "rollback"}
    t = cfg.train
    num_micro = t.global_batch_size // (t.micro_batch_size * engine.dp_size)
    dispatch: list[Any] = []
    injector = NaNInjector(cfg, engine.model) if cfg.debug.nan_sample is not None else None
    if injector is not None:
        dispatch.append(injector)
    engine.before_micro_batch = lambda i: [c.on_micro_batch(i) for c in dispatch]  # type: ignore[func-returns-value]
    spikes = LossWatch.from_config(cfg)
    reference = None  # the last normal step's batch (the statistics' reference of a finite anomaly)
    res = None
    for s in range(start + 1, step + 1):
        if s - 1 in jumps:
            train_it.load_state_dict({"consumed_samples": jumps[s - 1]})
        before_samples = train_it.consumed_samples
        micro = [next(train_it) for _ in range(num_micro)]
        samples = micro_batch_samples(train_it.sampler, before_samples, num_micro)
        if injector is not None:
            injector.arm(samples)
        want_stats = s == step and line is not None and "numerics" in line
        res = engine.train_step(micro, s, numerics=want_stats,
                                spike=spikes.check if spikes.enabled else None)
        if res.anomaly is None and spikes.observe(s, res.loss):
            reference = (s, micro)
    assert res is not None
    out = ReplayResult(step, before[0], step - 1 - start, True, anomalous=anomaly is not None)

    def check(what: str, got: Any, want: Any) -> None:
        out.compared.append(what)
        if not _same(got, want):
            out.same = False
            out.differences.append(f"{what} {got!r} (replay) vs {want!r} (run)")

    if line is not None:
        check("loss", finite_or_none(res.loss), line.get("loss"))
        check("grad norm", finite_or_none(res.grad_norm), line.get("grad_norm"))
        if "numerics" in line:
            check(f"{len(line['numerics'])} operands' statistics", res.numerics, line["numerics"])
    if anomaly is not None:
        check("anomaly", res.anomaly, anomaly.get("kind"))
        check("loss", finite_or_none(res.loss), anomaly.get("loss"))
        if res.anomaly is not None:
            found_now = investigate(engine, micro, samples, dispatch, reference)
            if "statistic" not in (anomaly.get("culprit") or {}):
                check("first non-finite tensor", found_now["culprit"], anomaly.get("culprit"))
            elif reference is not None:  # (its reference is a normal step replayed before it)
                check("operand that moved most", found_now["culprit"], anomaly.get("culprit"))
    at_step = [f for f in plan.valid if _iteration(f) == step]
    if at_step and res.anomaly is None:
        _compare_weights(engine, at_step[0], check)
    return out


def _compare_weights(engine: Any, folder: Path, check: Any) -> None:
    """Every fp32 master after the replayed step against the run's checkpoint of that step:
    each rank compares the ones it holds (a pipeline stage holds its layers only), and the
    differences of all ranks are the verdict's (a weight no rank holds is one)."""
    saved, _ = load_checkpoint(folder, engine.rank, engine.world_size)
    with engine.params_synced():
        now = engine.checkpoint_state()["global"]["model"]
    want = saved["global"]["model"]
    held = [n for n in want if n in now]
    differ = [n for n in held if not torch.equal(now[n], want[n])]
    everyone = _gathered((held, differ))
    all_held = {n for h, _ in everyone for n in h}
    differ = sorted({n for _, d in everyone for n in d} | (set(want) - all_held))
    check(f"{len(want)} fp32 master weights (checkpoint {folder.name})", differ, [])


def _gathered(mine: Any) -> list[Any]:
    """``mine`` of every rank (``[mine]`` in one process)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return [mine]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, mine)
    return out
