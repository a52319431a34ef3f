"""``TrainEngine``: everything one optimizer step needs, behind one small interface.

The loop (``lptrain.train.loop``) owns *when* things happen (steps, logging, eval, save,
exit); the engine owns *how* one step is done: the model on its device, the data-parallel
engine (buffers, bucketed reduction, param gather), the optimizer and its LR schedule per
param group. World size 1 runs the same engine as world size N.

Interface used by the loop and the checkpoint code:

* ``TrainEngine(cfg)`` -- builds model, buffers, optimizer for the current
  ``torch.distributed`` world (or a single process when no group is initialised);
* ``rank``, ``world_size``, ``dp_rank``, ``dp_size``, ``is_main``;
* ``train_step(micro_batches, step) -> StepResult`` -- forward/backward over the micro-batches
  of this rank, grad reduction, non-finite handling (``train.on_nonfinite``), optimizer step,
  param sync; ``step`` is 1-based (as in ``metrics.jsonl``);
* ``evaluate(batches) -> float`` -- mean LM loss over the given batches, averaged over ranks,
  through ``params_synced()`` and without touching delayed-scaling state;
* ``params_synced()`` -- the one forced-sync entry point (eval, checkpoint save, shutdown);
* ``checkpoint_state()`` / ``load_checkpoint_state(state)`` -- a plain nested dict of tensors
  and Python values, identical on every rank for replicated entries and keyed by canonical
  parameter names, so it reshards across DP sizes;
* ``memory_breakdown()`` -- this rank's buffer and optimizer bytes (the memory model of
  :mod:`lptrain.memory`, measured).

The order inside a step that data parallelism needs (when masters are staged, when gathers
must be finished) belongs to :class:`lptrain.distributed.ddp.DataParallel`
(``begin_step`` / ``after_first_forward`` / ``end_step``); the engine names the steps.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional

import torch

from lptrain.config.schema import LPTrainConfig
from lptrain.errors import RunFailedError
from lptrain.precision.model_state import (
    load_rank_state,
    load_scaling_state,
    rank_state,
    scaling_state,
    seed_device_rng,
)
from lptrain.train.engine_state import EngineCheckpointState

if TYPE_CHECKING:
    from lptrain.model.gpt import GPTModel
    from lptrain.optim.chained import StepOutcome


class TrainingDivergedError(RunFailedError):
    """A loss or gradient went NaN/Inf; the message names the step, the rank and the tensor
    (exit status 3, like any run that started and failed). Every rank raises it from the same
    gathered losses, so rank 0 alone prints it."""

    every_rank = True


@dataclass
class StepResult:
    """What one optimizer step reports (all floats are the same on every rank)."""

    loss: float  # mean LM loss over the global batch
    grad_norm: float  # global grad norm before clipping
    lrs: dict[str, float]  # lr per param group name
    skipped: bool = False  # step skipped on a non-finite loss or grad norm
    note: str = ""  # why it was skipped: step, rank and first non-finite tensor (for the log)
    extra: dict[str, float] = field(default_factory=dict)  # e.g. MoE aux losses, Muon update RMS
    # the anomaly that skipped the step ("nonfinite", "divergence", "spike"), when the caller handles it
    anomaly: Optional[str] = None
    # per operand, the quantization statistics of this step (when asked for: numerics=True)
    numerics: Optional[dict[str, dict[str, Optional[float]]]] = None


class TrainEngine(EngineCheckpointState):
    """Model + data-parallel engine + optimizer for one run (see the module doc)."""

    def __init__(self, cfg: LPTrainConfig) -> None:
        from lptrain.catalog.pipeline import layout_for
        from lptrain.distributed.ddp import DataParallel
        from lptrain.distributed.groups import build_groups
        from lptrain.distributed.launch_env import (
            init_process_group_from_env,
            use_one_cuda_work_queue,
        )
        from lptrain.distributed.layout import plan_run_layout, run_param_specs
        from lptrain.model.build import resolve_device
        from lptrain.optim.chained import build_optimizer, state_precision

        self.cfg = cfg
        use_one_cuda_work_queue(cfg.model.tensor_model_parallel_size)
        # (resolved again after joining: joining selects this rank's CUDA device)
        init_process_group_from_env(resolve_device(cfg), 60.0 * cfg.dist.distributed_timeout_minutes)
        moe, pp = cfg.model.moe, max(1, cfg.model.pipeline_model_parallel_size)
        ep = moe.expert_model_parallel_size if moe.num_experts else 1
        m = cfg.model
        self.loss_stage = layout_for(m).loss_rank  # the pipeline rank computing the loss
        self.groups = build_groups(cfg.ddp.num_distributed_optimizer_instances, ep=ep,
                                   tp=m.tensor_model_parallel_size,
                                   sequence_parallel=m.sequence_parallel, pp=pp,
                                   tied_embeddings=m.tie_embeddings, cp=max(1, m.context_parallel_size),
                                   hierarchical_cp=(m.hierarchical_context_parallel_sizes
                                                    if m.cp_comm_type == "a2a+p2p" else None),
                                   loss_stage=self.loss_stage)
        self.rank, self.world_size = self.groups.rank, self.groups.world_size
        self.dp_rank, self.dp_size = self.groups.dp.rank, self.groups.dp.size
        # (cp rank, cp size): which chunks of each sample this rank reads
        self.context_parallel = (self.groups.cp.rank, self.groups.cp.size)
        # the ranks that split each sequence (sequence and context parallelism): per-token
        # statistics (router counts, MoE metrics) are summed over them as well as over dp
        self.stats_group = (self.groups.everyone if cfg.model.sequence_parallel
                            else self.groups.grad_reduction)
        self.is_main = self.rank == 0
        self.device = resolve_device(cfg)
        torch.manual_seed(cfg.train.seed)
        self.model = self._build_model()
        # MoE bookkeeping walks every module: a dense model skips it (no routers, no metrics)
        # (every pipeline stage of a MoE model joins the per-step MoE collectives)
        self.has_moe = bool(self.model.routers()) or (pp > 1 and moe.num_experts > 0)
        named = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]
        expert = self.groups.expert_intra
        self.layout = plan_run_layout(cfg, run_param_specs(cfg, named), self.groups.intra.size,
                                      expert_dp=expert.size if expert is not None else None)
        self.ddp = DataParallel(self.model, self.layout, cfg.ddp, self.groups, device=self.device)
        self.optimizer = build_optimizer(self.ddp.buffers, cfg.optimizer, ep=self.groups.ep, tp=self.groups.tp,
                                         pp=self.groups.pp, state=state_precision(cfg))
        self.ddp.release_sharded_params()  # ZeRO-3: the masters hold the values now
        # Set by a caller that decides what an anomalous step does (the loop's
        # train.on_anomaly): a non-finite or spiking step is then returned skipped, with its
        # kind, instead of following train.on_nonfinite here.
        self.returns_anomalies = False
        # Called with each micro-batch's index before its forward (the debug NaN injection).
        self.before_micro_batch: Optional[Callable[[int], None]] = None
        # Pipeline parallelism: this rank's stages and schedule run the micro-batches
        self._codes: list[int] = []  # every rank's non-finite grad code of the step (pipeline)
        self.pipeline = self._build_pipeline() if pp > 1 else None

    def _build_model(self) -> GPTModel:
        """The run's model with this rank's experts (and, under pipeline parallelism, its
        stage's layers), its quantizers' random streams seeded per rank (stochastic
        rounding: distinct per rank, reproducible from (seed, rank)). The rank that seeds
        them is the rank's place inside its pipeline stage: every stage of a pipeline draws
        as the one rank at that place draws without pipelining (pipeline ranks are outermost,
        so that is the rank itself at PP 1)."""
        from lptrain.model import build_model, default_factory
        from lptrain.model.context_parallel import ContextParallel
        from lptrain.model.pipeline import model_part

        cfg = self.cfg
        factory = default_factory(cfg)
        stream_rank = self.stream_rank()
        if factory.recipe is not None and hasattr(factory.recipe, "seed"):  # SR recipes only
            factory.recipe.seed = cfg.train.seed * 65_537 + stream_rank
        seed_device_rng(cfg.train.seed, stream_rank, self.device)  # TE draws its SR bits there
        return build_model(cfg, factory, expert_model_parallel_rank=self.groups.ep.rank,
                           expert_parallel_group=self.groups.ep, tensor_parallel_group=self.groups.tp,
                           device=self.device, part=model_part(cfg.model, self.groups.pp.rank),
                           context_parallel=ContextParallel.of(self.groups, cfg.model.cp_comm_type))

    def stream_rank(self) -> int:
        """The rank whose random streams this rank draws (see :meth:`_build_model`): its
        place inside its pipeline stage (the stage's ranks are consecutive)."""
        return self.rank % self.groups.everyone.size if self.groups.pp.size > 1 else self.rank

    def _build_pipeline(self) -> Any:
        """This rank's pipeline stages and schedule (:mod:`lptrain.distributed.pipeline`)."""
        from lptrain.distributed.pipeline import PipelineRunner

        t = self.cfg.train
        runner = PipelineRunner(self.cfg, self.model, self.ddp, self.groups, self.device,
                                t.global_batch_size // (t.micro_batch_size * self.dp_size))
        if self.cfg.model.tie_embeddings:
            self.ddp.share_over_pipeline(self.model.embedding, self.groups.embedding, runner)
        return runner

    @property
    def defer_staging(self) -> bool:
        """Whether masters are staged at the start of the next step (a reused grad buffer
        with overlapped gathers: :attr:`lptrain.distributed.ddp.DataParallel.defers_staging`)."""
        return self.ddp.defers_staging

    # ---- steps --------------------------------------------------------------------------------

    def lr_for_step(self, step: int) -> dict[str, float]:
        """LR per param group for 1-based ``step``: each group follows the schedule from its
        own peak (the Muon group ``optimizer.muon.lr`` when set, the others ``optimizer.lr``;
        min lr scaled by the same ratio)."""
        from lptrain.config.rulesets.muon import muon_lr
        from lptrain.optim.schedule import lr_at

        o = self.cfg.optimizer
        out = {}
        for name in self.optimizer.lr_by_group():
            peak = muon_lr(self.cfg) if name == "muon" else o.lr
            out[name] = lr_at(
                step - 1,
                lr=peak,
                min_lr=o.min_lr * (peak / o.lr if o.lr else 1.0),
                warmup_iters=o.warmup_iters,
                decay_iters=o.decay_iters or self.cfg.train.train_iters,
                schedule=o.lr_schedule,
            )
        return out

    def train_step(self, micro_batches: Sequence[dict[str, torch.Tensor]], step: int, *,
                   numerics: bool = False,
                   spike: Optional[Callable[[float], Optional[tuple[str, str]]]] = None) -> StepResult:
        """One optimizer step over this rank's micro-batches (see the module doc).

        ``numerics``: collect the quantization statistics of every GEMM operand of this step
        (:mod:`lptrain.train.numerics`; one device-to-host read at the end of the step).
        ``spike(loss)``: ``(kind, note)`` when the step's mean loss diverged or spiked (then
        the step is not taken, like a non-finite one), else None."""
        from lptrain.model.recompute import take_region_count
        from lptrain.train.numerics import collecting

        take_region_count()  # counted from here: this step's checkpointed regions
        with collecting(self, numerics) as stats:
            self.ddp.begin_step(self.optimizer.stage)
            local = self._forward_backward(micro_batches)
            losses = self._gather_losses(local, self.ddp.finish_grad_sync())
        moe_metrics = self._moe_metrics()
        lrs = self.lr_for_step(step)
        bad, kind = self._nonfinite(losses, step), "nonfinite"
        if bad is None and spike is not None:  # (kind, why) of a divergence or spike, or None
            found = spike(float(losses[:, 0].mean()))
            bad, kind = (f"step {step}: {found[1]}", found[0]) if found else (None, kind)
        self._reduce_router_counts()
        zeros = self.optimizer.count_zeros()  # before the step: reused grad buffers are restaged after it
        if bad is None:
            outcome = self.optimizer.step(lrs)
            if not outcome.skipped:
                res = self._finish_step(outcome, lrs, losses, moe_metrics, zeros)
                res.numerics = stats.result()
                return res
            bad = self._nonfinite_grad(step) or f"step {step}: global gradient norm is {outcome.grad_norm}"
            kind = "nonfinite"
        res = self._skip_step(bad, losses, lrs, kind)
        res.numerics = stats.result()
        return res

    def rerun_without_update(self, micro_batches: Sequence[dict[str, torch.Tensor]]) -> torch.Tensor:
        """Run a step's forwards and backwards again and take no update: the per-rank
        ``[dp, 3]`` losses (see :meth:`_gather_losses`). Everything a step changes besides the
        weights -- delayed-scaling state, random streams, router counts, the MoE metrics --
        is put back afterwards, so the run continues as if it had not happened (the anomaly
        forensics re-run an anomalous step with hooks armed, :mod:`lptrain.train.forensics`).
        Collective: every rank runs it."""
        from lptrain.model.recompute import take_region_count

        scaling = scaling_state(self.model)
        streams = rank_state(self.model, self.model.quantizer_recipe(), self.device)
        counts = [c.clone() for c in self.model.expert_bias_counts()]
        try:
            self.ddp.begin_step(self.optimizer.stage)
            local = self._forward_backward(micro_batches)
            losses = self._gather_losses(local, self.ddp.finish_grad_sync())
            self.ddp.end_step(self.optimizer.stage)
        finally:
            if self.has_moe:
                for m in self.model.modules():
                    if hasattr(m, "reset_metrics"):
                        m.reset_metrics()
            for live, c in zip(self.model.expert_bias_counts(), counts, strict=True):
                live.copy_(c)
            load_scaling_state(self.model, scaling)
            load_rank_state(self.model, streams, self.model.quantizer_recipe())
            take_region_count()
        return losses

    def _nonfinite_grad(self, step: int) -> str | None:
        """After a non-finite grad norm, the parameter to blame when the grad check was left
        to the norm (:attr:`lptrain.distributed.ddp.DataParallel.norm_finds_nonfinite`)."""
        if not self.ddp.norm_finds_nonfinite:
            return None
        return self._grad_note(step, [self.ddp.scan_nonfinite_code()])

    def _grad_note(self, step: int, codes: list[int]) -> str | None:
        """The first rank's non-finite gradient named from the per-rank codes, or None."""
        from lptrain.distributed.ddp import NonFiniteGradError

        if self.pipeline is not None:  # another stage's parameters: named by their rank
            found = self.pipeline.name_nonfinite(codes, self._decode_code)
            if found is None:
                return None
            rank, stage, param = found
            return f"step {step}, rank {rank} (pipeline stage {stage}): gradient of '{param}' is not finite"
        try:
            self.ddp.raise_on_nonfinite(codes)
        except NonFiniteGradError as e:
            return f"step {step}, rank {e.rank}: gradient of '{e.param}' is not finite"
        return None

    def _decode_code(self, codes: list[int]) -> tuple[int, str] | None:
        from lptrain.distributed.ddp import NonFiniteGradError

        try:
            self.ddp.raise_on_nonfinite(codes)
        except NonFiniteGradError as e:
            return e.rank, e.param
        return None

    def _to_device(self, b: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if self.device.type == "cpu":
            return b
        return {k: v.to(self.device, non_blocking=True) for k, v in b.items()}

    def _forward_backward(self, micro_batches: Sequence[dict[str, torch.Tensor]]) -> torch.Tensor:
        """Local (lm_loss, total_loss) means over this rank's micro-batches, fp64, on the
        device (read once per step, after the loss all-reduce). Under pipeline parallelism
        the schedule runs them (the losses are the last stage's)."""
        if self.pipeline is not None:  # (its stages call before_micro_batch per micro-batch)
            self.pipeline.before_micro_batch = self.before_micro_batch
            return self.pipeline.forward_backward([self._to_device(b) for b in micro_batches])
        model, ddp = self.model, self.ddp
        n = len(micro_batches)
        sums = torch.zeros(2, dtype=torch.float64, device=self.device)
        for i, b in enumerate(micro_batches):
            b = self._to_device(b)
            if self.before_micro_batch is not None:
                self.before_micro_batch(i)
            ctx = ddp.no_sync() if i < n - 1 else contextlib.nullcontext()
            with ctx:
                with model.autocast(self.groups.amax_reduction.pg), model.micro_batch(first=i == 0):
                    loss, aux = model(b["tokens"], labels=b["labels"])
                if i == 0:
                    ddp.after_first_forward()
                with ddp.backward_phase():
                    (loss / n).backward()
            sums[0] += aux["lm_loss"].detach().double() / n
            sums[1] += loss.detach().double() / n
        return sums

    def _gather_losses(self, local: torch.Tensor, nonfinite_code: int) -> torch.Tensor:
        """[ranks, 3] per rank (lm_loss, total_loss, non-finite grad code): one small
        all-reduce on the device over every rank (tensor-parallel ranks check their own
        shards' grads, and every rank must take the same decision), then one copy to the
        host (the codes stay below 2^53, exact in fp64); each row then holds its
        data-parallel replica's losses (:func:`lptrain.train.step_losses.replica_losses`), so
        means over the rows are means over replicas."""
        import torch.distributed as dist

        from lptrain.train.step_losses import replica_losses

        g = self.groups.all_ranks
        out = torch.zeros(g.size, 3, dtype=torch.float64, device=self.device)
        out[g.rank, :2] = local
        out[g.rank, 2] = float(nonfinite_code)
        if g.active:
            dist.all_reduce(out, group=g.pg)  # (one row per rank, the others zero: exact)
        out = out.cpu()
        if self.pipeline is not None:
            # the losses are the rows of the stage computing the loss (pipeline ranks are
            # outermost), the non-finite codes every rank's (kept for _nonfinite)
            self._codes = [int(c) for c in out[:, 2].tolist()]
            out = out.view(self.groups.pp.size, -1, 3)[self.loss_stage].clone()
            out[:, 2] = 0.0
        return replica_losses(out, self.groups.tp.size, self.groups.cp.size)

    def _nonfinite(self, losses: torch.Tensor, step: int) -> str | None:
        """Why this step cannot be taken (a rank's non-finite gradient, else a non-finite
        loss), or None. Every rank reads the same gathered ``losses``: all decide alike."""
        codes = self._codes if self.pipeline is not None else [int(c) for c in losses[:, 2].tolist()]
        note = self._grad_note(step, codes)
        if note is not None:
            return note
        if not math.isfinite(float(losses[:, 1].mean())):
            r = int((~torch.isfinite(losses[:, 1])).nonzero()[0])
            where = f"rank {r}"
            if self.pipeline is not None:  # the rows are the loss stage's
                last = self.loss_stage
                where = f"rank {r + last * self.groups.everyone.size} (pipeline stage {last}, the loss's)"
            return f"step {step}, {where}: loss is {float(losses[r, 1])}"
        return None

    def _skip_step(self, bad: str, losses: torch.Tensor, lrs: dict[str, float],
                   kind: str = "nonfinite") -> StepResult:
        """``train.on_nonfinite``: stop with :class:`TrainingDivergedError`, or skip the
        update (the params keep their values, restaged and gathered as after any step).
        With :attr:`returns_anomalies` the step is skipped and its ``kind`` returned: the
        caller decides (stop, skip, roll back)."""
        if self.returns_anomalies:
            self.ddp.end_step(self.optimizer.stage)
            return StepResult(loss=float(losses[:, 0].mean()), grad_norm=float("nan"), lrs=lrs,
                              skipped=True, note=bad, anomaly=kind)
        if self.cfg.train.on_nonfinite != "skip":
            raise TrainingDivergedError(
                f"{bad}; stopping (train.on_nonfinite=stop; 'skip' skips such steps)"
            )
        self.ddp.end_step(self.optimizer.stage)
        return StepResult(
            loss=float(losses[:, 0].mean()), grad_norm=float("nan"), lrs=lrs, skipped=True,
            note=f"{bad}; step skipped (train.on_nonfinite=skip)",
        )

    def _finish_step(self, outcome: StepOutcome, lrs: dict[str, float], losses: torch.Tensor,
                     moe_metrics: dict[str, float], zeros: int | None) -> StepResult:
        """After an update: params synced (or left to the next forward), the expert bias
        stepped, the step's result with its extra metrics."""
        self.ddp.end_step(self.optimizer.stage)
        if self.has_moe:
            self.model.update_expert_bias()
        extra = self._step_extras(moe_metrics, zeros, losses)
        return StepResult(loss=float(losses[:, 0].mean()), grad_norm=outcome.grad_norm, lrs=lrs,
                          extra=extra)

    def _step_extras(self, moe_metrics: dict[str, float], zeros: int | None,
                     losses: torch.Tensor) -> dict[str, float]:
        """MoE metrics, the Muon update RMS and zero-grad count, and the auxiliary loss."""
        from lptrain.model.recompute import take_region_count

        extra = dict(moe_metrics)
        if self.model.recompute.granularity is not None:  # (model.recompute_granularity)
            extra["recompute_regions"] = float(take_region_count())
        rms = self.optimizer.update_rms()
        if rms is not None:
            extra["muon_update_rms"] = rms
        if zeros is not None:
            extra["muon_grad_zeros"] = float(zeros)
        loss, total = float(losses[:, 0].mean()), float(losses[:, 1].mean())
        if total != loss:
            extra["aux_loss"] = total - loss
        return extra

    def _moe_metrics(self) -> dict[str, float]:
        """Tokens per expert (min/mean/max over the global batch) and the load-balancing
        loss of this step's forwards (``lptrain.model.moe.metrics``; ``{}`` when dense).
        Collective over the data-parallel group; resets the layers' accumulators."""
        from lptrain.model.moe.metrics import moe_step_metrics

        if not self.has_moe:
            return {}
        shards = (self.groups.tp.size if self.cfg.model.sequence_parallel else 1) * self.groups.cp.size
        return moe_step_metrics(self.model, self.stats_group, sequence_shards=shards,
                                pipeline=self.groups.pp)

    def _reduce_router_counts(self) -> None:
        """The expert-bias update sees global token counts (summed over the stats group)."""
        from lptrain.model.moe.metrics import reduce_router_counts

        if self.has_moe:
            reduce_router_counts(self.model, self.stats_group)

    def evaluate(self, batches: Iterator[dict[str, torch.Tensor]], n: int) -> float:
        """Mean LM loss over ``n`` batches per rank, averaged over data-parallel replicas (the
        context-parallel ranks' parts summed); leaves training state untouched (no-grad
        forwards do not touch delayed scaling; router counts kept)."""
        import torch.distributed as dist

        model = self.model
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        counts = [c.clone() for c in model.expert_bias_counts()]
        with self.params_synced(), torch.no_grad(), model.evaluation_guard():
            model.eval()
            try:
                if self.pipeline is not None:  # through the schedule, forward only
                    total = self.pipeline.evaluate(batches, n)
                for _ in range(n if self.pipeline is None else 0):
                    b = self._to_device(next(batches))
                    with model.autocast(self.groups.amax_reduction.pg):
                        _, aux = model(b["tokens"], labels=b["labels"])
                    total += aux["lm_loss"].double()
            finally:
                model.train()
                for live, c in zip(model.expert_bias_counts(), counts, strict=True):
                    live.copy_(c)
        g = self.groups.grad_reduction  # (the CP ranks' parts add up to their replica's loss)
        if g.active:
            dist.all_reduce(total, group=g.pg)
        if self.pipeline is not None:  # the last stage's total, on every stage
            self.pipeline.broadcast_from_last(total)
        return float(total) / max(1, n) / self.groups.dp.size

    @contextlib.contextmanager
    def params_synced(self) -> Iterator[None]:
        """The forced-sync entry point (eval, checkpoint save, shutdown): every param holds
        the current masters inside; training after it is bitwise training without it."""
        with self.ddp.params_synced(self.optimizer.stage):
            yield

    def parameter_count(self) -> int:
        """The whole model's parameter count (collective over the pipeline group)."""
        from lptrain.distributed.pipeline import whole_model_parameters

        return whole_model_parameters(self.model, self.groups, self.device)

    def memory_breakdown(self) -> dict[str, int]:
        """Bytes this rank holds, measured on the live buffers and optimizer
        (:func:`lptrain.memory.measure.measured_memory`) and reported under the keys
        ``params``, ``param_buffer``, ``grads``, ``masters``, ``moments``, ``padding`` --
        already inside ``grads``/``param_buffer`` -- and ``total``, which excludes it
        (:meth:`lptrain.memory.breakdown.MemoryBreakdown.engine_report`). Activations are not
        included (they exist only inside a step); call it after a step, optimizer state is
        created lazily. Local: no collective."""
        from lptrain.memory.measure import measured_memory

        return measured_memory(self.model, self.ddp.buffers, self.optimizer.children).engine_report()
