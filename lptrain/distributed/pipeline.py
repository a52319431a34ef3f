"""Pipeline parallelism on ``torch.distributed.pipelining``: this rank's stages, the schedule,
and the data-parallel engine's per-step order inside it.

The schedule is torch's (``Schedule1F1B``, ``ScheduleInterleaved1F1B``, and the zero-bubble
``ScheduleInterleavedZeroBubble``, ``ScheduleZBVZeroBubble``, ``ScheduleDualPipeV``: its stages,
its order, its P2P; :mod:`lptrain.distributed.pipeline_orders`); lptrain supplies the modules
it runs (:class:`lptrain.model.pipeline.PipelineChunk`, one per model chunk this rank holds, in
the loop or V placement of :class:`lptrain.catalog.pipeline.PipelineLayout`), static shapes (no
forward is run to infer them), the loss function, and :class:`EngineStage`, a
``PipelineStage`` whose backward runs inside the data-parallel engine's phases -- and whose
split backward (the zero-bubble schedules' I and W steps) defers the GEMMs' weight gradients
rather than torch's graph split.

**Why the result is the unpipelined run's, bit for bit** (at the same data- and
tensor-parallel sizes):

* each micro-batch runs the unpipelined model's operations on the same operands (the chunks
  are cuts of one graph), and every stage backward starts from the gradients the unpipelined
  backward would pass across that cut;
* gradients accumulate into ``main_grad`` per micro-batch, in micro-batch order, by the same
  hooks; the grad reduction of a stage is dispatched only by the last micro-batch's backward
  of that stage (``no_sync`` for the others: Megatron's and torchtitan's rule), per bucket
  as without pipelining; the loss is ``loss / m`` per micro-batch as without pipelining
  (the schedule's own ``scale_grads`` is off). Under a split backward the GEMM weights'
  gradients are added in the W steps, which torch's zero-bubble orders run in micro-batch
  order per chunk (checked: a W out of order is refused), and a weight is reported ready
  only once its last W job has run (:mod:`lptrain.precision.deferred_wgrad`);
* delayed scaling advances per micro-batch and per layer exactly as without pipelining
  (:mod:`lptrain.model.pipeline`), and stochastic rounding draws from per-quantizer
  generators that each layer advances in micro-batch order, seeded by the rank's position
  inside its stage (``TrainEngine``), i.e. the unpipelined rank's seed;
* the gradient norm is the unpipelined sum over the same per-parameter terms
  (:mod:`lptrain.optim.chained`).

Under interleaving a rank holds several chunks of one model (one set of buffers, one
optimizer): the grad reduction of a bucket waits for the last backward of every chunk whose
params it holds (the hooks count them).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Optional

import torch
import torch.distributed as dist

from lptrain.config.schema import LPTrainConfig
from lptrain.distributed.ddp import DataParallel
from lptrain.distributed.groups import ParallelGroups
from lptrain.distributed.pipeline_orders import forward_only, schedule_class, send_after_each_half
from lptrain.model.gpt import AUX_KEYS, GPTModel
from lptrain.model.pipeline import PipelineChunk, chunk_io, pipeline_layout
from lptrain.precision.deferred_wgrad import deferring


def _pipelining() -> Any:
    import torch.distributed.pipelining as pipelining

    return pipelining


class EngineStage:
    """Factory of ``PipelineStage`` subclasses whose backward runs in the engine's phases:
    outside ``ddp.no_sync()`` only for the stage's last micro-batch (when the schedule says
    ``last_backward``), inside ``ddp.backward_phase()`` (recompute forwards must not free
    sharded params), after ``runner.before_backward()`` (the step's pending gathers).

    **Split backwards** (the zero-bubble schedules' I and W steps): torch would split a
    backward by walking the autograd graph of the stage's parameters; lptrain's GEMMs form
    their weight gradients inside their own backward (fused into ``main_grad``), so the I step
    here is the whole autograd backward run inside :func:`lptrain.precision.deferred_wgrad.
    deferring` -- the GEMMs compute the input gradients and queue their weight gradients, with
    that micro-batch's quantized operands -- and the W step runs the queue. The I step of the
    chunk's last micro-batch reports the gradients autograd formed (norms, embedding, head) as
    ready, the W step of the last micro-batch the GEMM weights' (each only once its last job
    has run); a W out of micro-batch order is refused (the sums would change order)."""

    _cls: Optional[type] = None

    @classmethod
    def make(cls, runner: PipelineRunner, *args: Any, micro_batches: int, **kwargs: Any) -> Any:
        stage = cls.stage_class()(*args, **kwargs)
        stage.lptrain_runner = runner
        stage.lptrain_micro_batches = micro_batches
        stage.lptrain_wgrads = {}
        stage.lptrain_last_w = -1
        return stage

    @classmethod
    def stage_class(cls) -> type:
        """The ``PipelineStage`` subclass (made once: torch's pipelining is imported lazily)."""
        if cls._cls is None:
            base = _pipelining().PipelineStage

            class _Stage(base):  # type: ignore[misc, valid-type]
                def forward_one_chunk(self, fwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
                    # the engine's per-micro-batch callback (a NaN injection, forensic hooks)
                    run = self.lptrain_runner
                    if run.before_micro_batch is not None:
                        run.before_micro_batch(fwd_chunk_id)
                    with run.micro_batch(fwd_chunk_id):
                        return super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)

                def backward_maybe_with_nosync(self, backward_type: Any, bwd_kwargs: dict,
                                               last_backward: bool = False) -> Any:
                    run = self.lptrain_runner
                    run.before_backward()
                    ddp = run.ddp
                    ctx = contextlib.nullcontext() if last_backward else ddp.no_sync()
                    with ctx, ddp.backward_phase():
                        return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)

                def backward_one_chunk(self, bwd_chunk_id: int, loss: Any = None, full_backward: bool = True,
                                       last_backward: bool = False) -> Any:
                    if full_backward:
                        return super().backward_one_chunk(bwd_chunk_id, loss=loss, full_backward=True,
                                                          last_backward=last_backward)
                    last = bwd_chunk_id == self.lptrain_micro_batches - 1
                    with deferring() as wgrads:  # the I step (see EngineStage)
                        super().backward_one_chunk(bwd_chunk_id, loss=loss, full_backward=True,
                                                   last_backward=last)
                    self.lptrain_wgrads[bwd_chunk_id] = wgrads
                    return None

                def backward_weight_one_chunk(self, bwd_chunk_id: int, last_backward: bool = False) -> None:
                    if not self.has_backward:
                        return
                    if bwd_chunk_id <= self.lptrain_last_w:
                        raise RuntimeError(f"stage {self.stage_index}: the W step of micro-batch {bwd_chunk_id} "
                                           f"after that of {self.lptrain_last_w} (W steps must run in "
                                           "micro-batch order: each main_grad sums them in that order)")
                    self.lptrain_last_w = bwd_chunk_id
                    wgrads = self.lptrain_wgrads.pop(bwd_chunk_id)
                    ddp = self.lptrain_runner.ddp
                    last = bwd_chunk_id == self.lptrain_micro_batches - 1
                    with contextlib.nullcontext() if last else ddp.no_sync(), ddp.backward_phase():
                        wgrads.run()

                def clear_runtime_states(self) -> None:
                    super().clear_runtime_states()
                    self.lptrain_wgrads.clear()
                    self.lptrain_last_w = -1

            cls._cls = _Stage
        return cls._cls


class PipelineRunner:
    """This rank's part of the pipeline: its chunks, the training schedule and the
    evaluation schedules (see the module doc). ``forward_backward`` and ``evaluate`` are what
    :class:`lptrain.train.engine.TrainEngine` calls in place of its own micro-batch loop."""

    def __init__(self, cfg: LPTrainConfig, model: GPTModel, ddp: DataParallel, groups: ParallelGroups,
                 device: torch.device, micro_batches: int) -> None:
        self.cfg = cfg
        self.model = model
        self.ddp = ddp
        self.groups = groups
        self.device = device
        self.layout = pipeline_layout(cfg.model)
        self.pp_rank = groups.pp.rank
        amax_group = groups.amax_reduction.pg  # the stage's ranks (a real group even of one rank)
        seq = cfg.model.seq_length // max(1, cfg.model.context_parallel_size)  # (this rank's tokens)
        self.chunks = [PipelineChunk(model, self.layout, c, amax_group, seq)
                       for c in self.layout.rank_chunks(self.pp_rank)]
        self.first = self.chunks[0].first
        self.last = self.chunks[-1].last
        self.micro_batches = micro_batches
        self._schedules: dict[tuple[int, bool], Any] = {}
        self._sums = torch.zeros(2, dtype=torch.float64, device=device)
        self._eval_total = torch.zeros((), dtype=torch.float64, device=device)
        self._n = 1
        self._backward_started = False
        self._training = False  # a training step's schedule is running (not an evaluation's)
        # called with the micro-batch's index before each chunk's forward of it (the engine's
        # ``before_micro_batch``, as its own micro-batch loop calls it without pipelining)
        self.before_micro_batch: Optional[Callable[[int], None]] = None

    @property
    def stage_rank(self) -> int:
        """This rank's pipeline stage (its pipeline rank)."""
        return self.pp_rank

    def last_stage_rank(self, rank: int) -> int:
        """The global rank computing the loss in ``rank``'s pipeline (the last chunk's)."""
        return self.groups.dims.group_of(rank, "pp")[self.layout.loss_rank]

    # ---- stages and schedules ----------------------------------------------------------------

    def _stages(self, n: int) -> list[Any]:
        cfg = self.cfg.model
        model = self.model
        tp = max(1, cfg.tensor_model_parallel_size)
        vocab_rows = model.padded_vocab_size // tp
        stages = []
        for chunk in self.chunks:
            inputs, outputs = chunk_io(cfg, self.layout, chunk.chunk, self.cfg.train.micro_batch_size,
                                       model.compute_dtype, vocab_rows, model.sequence_first)
            stages.append(EngineStage.make(self, chunk, chunk.chunk, self.layout.chunks, self.device,
                                           input_args=inputs, output_args=outputs, group=self.groups.pp.pg,
                                           micro_batches=n))
        return stages

    def schedule(self, n: int, train: bool) -> Any:
        """The schedule for ``n`` micro-batches (training: with the backward; kept, with its
        stages' receive buffers, for the next steps): torch's class for
        ``model.pipeline_schedule`` (:mod:`lptrain.distributed.pipeline_orders`). Evaluation
        runs it forward-only (:meth:`_eval_schedule`; built per evaluation: its buffers are
        freed after it). With fewer
        micro-batches than stages (which torch's Schedule1F1B refuses), 1F1B's warm-up holds
        them all, so Megatron's 1F1B runs every forward, then every backward, on each stage:
        GPipe's order, which torch's ScheduleGPipe runs (PP-FEW-MICRO-BATCHES warns)."""
        key = (n, train)
        if key in self._schedules:
            return self._schedules[key]
        stages = self._stages(n)
        loss_fn = self._loss if train else self._eval_loss
        kind = self.cfg.model.pipeline_schedule if train else self._eval_schedule()
        cls = schedule_class(kind, self.layout.pp, n)
        if not train and self.layout.v_shape:
            cls = forward_only(cls)
        single = issubclass(cls, _pipelining().schedules.PipelineScheduleSingle)
        sched = cls(stages[0] if single else stages, n, loss_fn=loss_fn, scale_grads=False)
        if getattr(sched, "pipeline_order_with_comms", None):
            # a paired forward and backward sends the forward's output as soon as it exists
            sched.pipeline_order_with_comms = send_after_each_half(sched.pipeline_order_with_comms)
        if train:
            self._schedules[key] = sched
        return sched

    def _eval_schedule(self) -> str:
        """Evaluation's forward-only order: the training schedule's without its backward; a V
        placement's through ZBV's forwards (DualPipeV refuses fewer than ``2 PP`` micro-batches,
        and forward only the two run the same forwards; :func:`forward_only`)."""
        kind = self.cfg.model.pipeline_schedule
        if self.layout.v_shape:
            return "zbv_zero_bubble"
        if kind == "interleaved_zero_bubble":
            return "interleaved_1f1b" if self.layout.vpp > 1 else "1f1b"
        return kind

    # ---- a training step ------------------------------------------------------------------

    def _inputs(self, micro_batches: Sequence[dict[str, torch.Tensor]]) -> tuple[tuple[Any, ...], Any]:
        """The schedule's whole-batch arguments: the tokens on the first stage, the labels
        on the last (the schedule cuts them back into the same micro-batches, in order)."""
        args = (torch.cat([b["tokens"] for b in micro_batches]),) if self.first else ()
        target = torch.cat([b["labels"] for b in micro_batches]) if self.last else None
        return args, target

    def forward_backward(self, micro_batches: Sequence[dict[str, torch.Tensor]]) -> torch.Tensor:
        """One step's forwards and backwards through the schedule; returns the local
        (lm_loss, total_loss) means over the micro-batches on the last stage (zeros on the
        others), fp64 on the device, as the unpipelined micro-batch loop does."""
        n = len(micro_batches)
        self._n = n
        self._sums = torch.zeros(2, dtype=torch.float64, device=self.device)
        self._backward_started = False
        args, target = self._inputs(micro_batches)
        self._training = True
        try:
            self.schedule(n, train=True).step(*args, target=target, return_outputs=False)
        finally:
            self._training = False
        if not self._backward_started:  # (a rank whose schedule ran no backward: none)
            self.before_backward()
        return self._sums

    def micro_batch(self, index: int) -> Any:
        """The model's context around the forward of micro-batch ``index`` of a training step
        (TE: Megatron's ``is_first_microbatch``, ``True`` for each chunk's first micro-batch of
        the step -- the schedule runs a chunk's forwards in micro-batch order -- so each weight
        is cast once per step, after the optimizer step and the param gather; ``False`` after).
        Evaluation forwards get nothing (``None``: cast every time, as without pipelining)."""
        if not self._training:
            return contextlib.nullcontext()
        return self.model.micro_batch(first=index == 0)

    def before_backward(self) -> None:
        """Before this step's first backward on this rank: every pending param gather
        finished (its forwards have all run by then: each chunk's first forward comes
        before the rank's first backward in both schedules), as after the first forward
        without pipelining."""
        if not self._backward_started:
            self._backward_started = True
            self.ddp.after_first_forward()

    def _split_output(self, output: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        if isinstance(output, (tuple, list)):
            logits, *aux = output
            return logits, dict(zip(AUX_KEYS, aux, strict=True))
        return output, {k: output.new_zeros((), dtype=torch.float32) for k in AUX_KEYS}

    def _loss(self, output: Any, labels: torch.Tensor) -> torch.Tensor:
        """The last stage's loss of one micro-batch: the unpipelined model's loss, divided
        by the micro-batch count (the backward of ``loss / m``, as without pipelining)."""
        logits, totals = self._split_output(output)
        loss, aux = self.model.loss(logits, labels, totals)
        n = self._n
        self._sums[0] += aux["lm_loss"].detach().double() / n
        self._sums[1] += loss.detach().double() / n
        return loss / n

    # ---- evaluation -------------------------------------------------------------------------

    def _eval_loss(self, output: Any, labels: torch.Tensor) -> torch.Tensor:
        logits, totals = self._split_output(output)
        _, aux = self.model.loss(logits, labels, totals)
        self._eval_total += aux["lm_loss"].double()
        return aux["lm_loss"]

    def evaluate(self, batches: Iterator[dict[str, torch.Tensor]], n: int) -> torch.Tensor:
        """The sum of the LM losses of ``n`` batches on the last stage (0 elsewhere), fp64,
        through the schedule forward-only (no backward, no grad: the caller's ``no_grad``)."""
        micro = [next(batches) for _ in range(n)]
        self._eval_total = torch.zeros((), dtype=torch.float64, device=self.device)
        if n == 0:
            return self._eval_total
        args, target = self._inputs([{k: v.to(self.device) for k, v in b.items()} for b in micro])
        self.schedule(n, train=False).eval(*args, target=target, return_outputs=False)
        return self._eval_total

    # ---- collectives across stages -------------------------------------------------------------

    def broadcast_from_last(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` of the last stage of this rank's pipeline, on every stage of it."""
        pp = self.groups.pp
        if pp.active:
            dist.broadcast(t, src=self.last_stage_rank(self.groups.rank), group=pp.pg)
        return t

    def name_nonfinite(self, codes: list[int], decode: Callable[[list[int]], Optional[tuple[int, str]]],
                       ) -> Optional[tuple[int, int, str]]:
        """``(rank, stage, parameter)`` of the first rank (by rank) whose non-finite code is
        set, every rank agreeing: the code is decoded on the rank that set it (only its own
        buffers know their parameters) and its name sent to the others. None: all finite."""
        bad = next((r for r, c in enumerate(codes) if c > 0), None)
        if bad is None:
            return None
        world = self.groups.all_ranks
        name: list[Any] = [None]
        if self.groups.rank == bad:
            found = decode([c if r == bad else 0 for r, c in enumerate(codes)])
            name[0] = found[1] if found is not None else "<unknown>"
        dist.broadcast_object_list(name, src=bad, group=world.pg)
        return bad, self.groups.dims.coords(bad)["pp"], str(name[0])


def whole_model_parameters(model: torch.nn.Module, groups: ParallelGroups, device: torch.device) -> int:
    """The whole model's parameter count from this rank's part: tensor-parallel shards counted
    whole, the pipeline stages' counts added over the pipeline group (a tied embedding's copy
    on the last stage once). Collective over the pipeline group."""
    from lptrain.model.tensor_parallel import whole_parameter_count

    copies = [p for p in model.parameters() if getattr(p, "pipeline_copy", False)]
    n = whole_parameter_count(model) - whole_parameter_count(torch.nn.ParameterList(copies))
    if groups.pp.active:
        t = torch.tensor([n], dtype=torch.int64, device=device)
        dist.all_reduce(t, group=groups.pp.pg)
        n = int(t)
    return n
