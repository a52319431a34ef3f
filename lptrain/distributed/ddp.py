"""``DataParallel``: buffers, backward hooks, bucketed grad reduction and param sync.

Per step the engine calls ``begin_step(stage)`` (zero the grad buffers), runs the
micro-batches (all but the last inside ``no_sync()``, ``after_first_forward()`` right after
the first forward), then ``finish_grad_sync()``; the optimizer reads the reduced grads
(``main_grad`` views) and steps; ``end_step(stage)`` has it write its masters into the
staging slices (marking buckets staged) and gathers them -- or, with
``ddp.overlap_param_gather``, leaves the gather to the forward pre-hooks of the next step.
``stage`` is the optimizer's (every child stages before any bucket is gathered). The order
of these calls is this class's business, not the caller's: see :meth:`begin_step`.
``params_synced()`` is the single forced-sync entry point for eval, checkpoint save and
shutdown.

Grad accumulation: a hook on each parameter's ``AccumulateGrad`` node adds ``p.grad`` into
``p.main_grad`` (skipped when a fused linear already accumulated straight into it and set
``grad_added_to_main_grad``) and drops ``p.grad``. Fused linears hand autograd no weight grad
at all (``p.main_grad_hooked``; :func:`lptrain.precision.linear_ops.fused_wgrad_placeholder`),
so the hook only resets the flag and marks the grad ready. With ``ddp.overlap_grad_reduce``, the last
micro-batch's hooks count ready params per bucket and dispatch each bucket's reduction
asynchronously as soon as it is complete. Without it, lptrain's own fused-wgrad weights in
unsharded buckets get no hook at all (``p.main_grad_unhooked``): there is nothing for it to
do, and ``backward_phase`` does the rest of its work (``_collect_unhooked``) once per backward.
A weight whose gradient a zero-bubble pipeline schedule defers to its W step
(``p.wgrad_pending``: :mod:`lptrain.precision.deferred_wgrad`) is skipped by the hook autograd
fires in the I step; the W step calls it (``p.main_grad_hook``) once the grad is in.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Optional

import torch
from torch import nn

from lptrain.config.schema import DDPConfig
from lptrain.distributed.bucket_group import Bucket, GradState, ParamState
from lptrain.distributed.buffers import ParamAndGradBuffer, buckets_in_forward_order
from lptrain.distributed.groups import ParallelGroups
from lptrain.distributed.layout import BufferLayout


def _tensors(obj: Any) -> list[torch.Tensor]:
    """The tensors in a module's output (a tensor, or tuples/lists/dicts of them)."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (tuple, list)):
        return [t for x in obj for t in _tensors(x)]
    if isinstance(obj, dict):
        return [t for x in obj.values() for t in _tensors(x)]
    return []


class NonFiniteGradError(RuntimeError):
    """A rank's local gradient held NaN/Inf before reduction (``ddp.check_for_nan_in_grad``)."""

    def __init__(self, rank: int, param: str) -> None:
        super().__init__(f"rank {rank}: gradient of '{param}' is not finite")
        self.rank = rank
        self.param = param


class DataParallel:
    """The data-parallel engine around one model (see the module doc)."""

    def __init__(
        self,
        model: nn.Module,
        layout: BufferLayout,
        ddp_cfg: DDPConfig,
        groups: ParallelGroups,
        *,
        device: torch.device,
    ) -> None:
        self.model = model
        self.layout = layout
        self.cfg = ddp_cfg
        self.groups = groups
        named = dict(model.named_parameters())
        self.param_names = {id(p): n for n, p in named.items()}
        self.buffers = [
            ParamAndGradBuffer(
                spec,
                i,
                named,
                groups,
                reuse_grad_buffer=bool(ddp_cfg.reuse_grad_buf_for_mxfp8_param_ag),
                device=device,
            )
            for i, spec in enumerate(layout.buffers)
        ]
        self.bucket_of: dict[str, Bucket] = {}
        for b in self.buffers:
            self.bucket_of.update(b.bucket_of)
        self.forward_order = buckets_in_forward_order(self.buffers)
        for prev, nxt in zip(self.forward_order, self.forward_order[1:], strict=False):
            prev.next_in_forward = nxt
            nxt.prev_in_forward = prev
        self.shards_params = any(b.shards_params for b in self.buffers)
        self._in_backward = False
        # params whose gradient is summed with another pipeline stage's copy before the
        # reduction (a tied embedding: share_over_pipeline); their buckets wait for it
        self._pipeline_shared: dict[str, tuple[nn.Parameter, Any]] = {}
        self.grad_scale = 1.0 / groups.dp.size
        # With a grad buffer reused as the gather area and gathers overlapped with the next
        # forward, masters can only be staged after that step has zeroed the grad buffer.
        self.defers_staging = bool(ddp_cfg.overlap_param_gather) and any(
            b.reuses_grad_buffer for b in self.buffers
        )
        self._is_last_microbatch = True
        self._pre_hooks_enabled = bool(ddp_cfg.overlap_param_gather) or self.shards_params
        self._hooks: list[Any] = []
        # (listed once: walking model.parameters() every step costs a module-tree walk)
        self._params = list(named.values())
        for p in self._params:  # (the grad hook reads them without a default)
            p.grad_added_to_main_grad = getattr(p, "grad_added_to_main_grad", False)
            p.wgrad_pending = 0  # weight-gradient jobs of a zero-bubble W step still to run
        # fused-wgrad weights autograd gives no grad, whose readiness nothing waits for: no
        # hook (one Python call per weight per backward saved); see _collect_unhooked
        self._unhooked: list[nn.Parameter] = self._hook_free_params(model)
        unhooked = {id(p) for p in self._unhooked}
        for name, p in named.items():
            if not p.requires_grad:
                continue
            if id(p) in unhooked:
                p.main_grad_unhooked = True  # see fused_wgrad_placeholder
            else:
                # (main_grad_hook: what a deferred W step calls once the weight's grad is in:
                # lptrain.precision.deferred_wgrad)
                p.main_grad_hook = self._make_grad_hook(name)
                self._hooks.append(p.register_post_accumulate_grad_hook(p.main_grad_hook))
                p.main_grad_hooked = True  # see fused_wgrad_placeholder
        if ddp_cfg.overlap_param_gather and not self.shards_params:
            for m in model.modules():
                if any(True for _ in m.parameters(recurse=False)):
                    self._hooks.append(m.register_forward_pre_hook(self._make_pre_hook(m)))
        if any(b.shards_grads for b in self.buffers):
            for m in model.modules():
                owned = self._sharded_grad_buckets(m)
                if owned:
                    self._hooks.append(m.register_forward_hook(self._make_grad_alloc_hook(owned)))
        if self.shards_params:
            from lptrain.distributed.param_sharding import install_param_sharding_hooks

            self._hooks.extend(install_param_sharding_hooks(self))

    @property
    def hooks_active(self) -> bool:
        """Whether the param-gather hooks act (off inside :meth:`params_synced`)."""
        return self._pre_hooks_enabled

    @property
    def in_backward(self) -> bool:
        return self._in_backward

    # ---- the step's order ---------------------------------------------------------------------

    def begin_step(self, stage: Callable[[], None]) -> None:
        """Zero the grad buffers; when staging is deferred (:attr:`defers_staging`), stage
        the masters now, into the zeroed buffer the overlapped gathers read."""
        self.zero_grad_buffer()
        if self.defers_staging:
            stage()

    def after_first_forward(self) -> None:
        """Finish every pending gather before the first backward writes grads (a reused grad
        buffer is zeroed as its bucket's params load, so no grad may land there first)."""
        self.sync_params(self.pending_param_buckets())

    def end_step(self, stage: Callable[[], None]) -> None:
        """After the optimizer step (or a skipped one): stage the masters and gather them,
        or leave the gather to the next forward (``ddp.overlap_param_gather``, and always
        with sharded params: each bucket is gathered when a forward needs it); nothing when
        staging is deferred to :meth:`begin_step`."""
        if not self.defers_staging:
            stage()
            if not self.cfg.overlap_param_gather and not self.shards_params:
                self.sync_params()

    # ---- grads -------------------------------------------------------------------------------

    def _sharded_grad_buckets(self, module: nn.Module) -> list[Bucket]:
        names = [self.param_names[id(p)] for p in module.parameters(recurse=False)]
        found = (self.bucket_of[n] for n in names if n in self.bucket_of)
        return list(dict.fromkeys(b for b in found if b.buffer.shards_grads))

    def _make_grad_alloc_hook(self, buckets: list[Bucket]) -> Callable[..., None]:
        """Sharded grads: allocate the module's buckets when the first gradient of its
        outputs arrives, i.e. before its own backward runs (a fused wgrad writes straight
        into ``main_grad`` there, before any param hook could fire). With sharded params
        the same moment gathers the bucket's params for the backward (and prefetches the
        bucket the backward needs next, with ``ddp.overlap_param_gather``)."""
        prefetch = bool(self.cfg.overlap_param_gather)

        def alloc(_grads: Any) -> None:
            for b in buckets:
                b.acquire_grads()
                if b.full_param is not None and self._pre_hooks_enabled:
                    b.ensure_params(async_op=False)
            prev = buckets[0].prev_in_forward
            if prefetch and prev is not None and prev.full_param is not None and self._pre_hooks_enabled:
                prev.ensure_params(async_op=True)

        def post_hook(_module: nn.Module, _args: Any, output: Any) -> None:
            if not torch.is_grad_enabled():
                return
            outs = [t for t in _tensors(output) if t.requires_grad]
            if outs:
                torch.autograd.graph.register_multi_grad_hook(outs, alloc, mode="any")

        return post_hook

    def _hook_free_params(self, model: nn.Module) -> list[nn.Parameter]:
        """The params that need no grad hook: lptrain's fused-wgrad weights
        (:func:`lptrain.precision.params.hook_free_wgrad_weights`: their layers add the grad
        into ``main_grad`` and hand autograd none) in buckets that neither dispatch
        reductions from hooks (``ddp.overlap_grad_reduce``) nor shard grads or params (whose
        hooks allocate and free bucket storage). None of TE's: they hand autograd a dummy
        grad, which the hook frees as soon as it lands."""
        from lptrain.precision.params import hook_free_wgrad_weights

        if bool(self.cfg.overlap_grad_reduce):
            return []
        out = []
        for p in hook_free_wgrad_weights(model):
            bucket = self.bucket_of.get(self.param_names.get(id(p), ""))
            if bucket is not None and bucket.full_grad is None and bucket.full_param is None:
                out.append(p)
        return out

    def _collect_unhooked(self) -> None:
        """After a backward, what the grad hook does for the unhooked params: a ``.grad``
        autograd left after all (none is expected: their layers hand it none) goes into
        ``main_grad`` unless the fused wgrad was added, and the fusion flag is reset."""
        for p in self._unhooked:
            grad = p.grad
            if grad is not None:
                if not p.grad_added_to_main_grad:
                    p.main_grad.add_(grad.view_as(p.main_grad))
                p.grad = None
            p.grad_added_to_main_grad = False

    def _make_grad_hook(self, name: str) -> Callable[[torch.Tensor], None]:
        # Runs once per param per backward: everything that does not change during a run is
        # decided here, so the hook itself is the accumulation plus what this layout needs.
        bucket = self.bucket_of[name]
        cfg = self.cfg
        shards_grads = bucket.full_grad is not None
        shards_params = bucket.full_param is not None
        overlap = bool(cfg.overlap_grad_reduce)
        ready_args = (name, bool(cfg.check_for_nan_in_grad), self.grad_scale, bool(cfg.average_in_collective))
        param = bucket.buffer.params[name]
        # a grad has its param's shape: reshaped only where main_grad's differs (2 ops per
        # param per backward saved; the same add either way)
        reshape = tuple(param.main_grad.shape) != tuple(param.shape)

        def hook(p: torch.Tensor) -> None:
            if p.wgrad_pending:  # its W step has yet to add the grad: it calls this then
                return
            if shards_grads:
                bucket.acquire_grads()
            grad = p.grad
            if grad is not None:
                if not p.grad_added_to_main_grad:
                    p.main_grad.add_(grad.view_as(p.main_grad) if reshape else grad)
                p.grad = None
            p.grad_added_to_main_grad = False
            if shards_params:
                bucket.grad_done(name)  # (the last grad frees the bucket)
            if overlap and self._is_last_microbatch and name not in self._pipeline_shared:
                bucket.register_grad_ready(*ready_args)

        return hook

    def share_over_pipeline(self, module: Optional[nn.Module], group: Any, runner: Any) -> None:
        """Tied embeddings under pipeline parallelism (Megatron-LM's embedding group): the
        first stage's table and the last stage's copy of it (the head) sum their local
        gradients over ``group`` before the data-parallel reduction, so both copies take
        the same update and stay equal. Their buckets are reduced in
        :meth:`finish_grad_sync`, after that sum, never early by the hooks. The copy on
        the last stage is marked ``pipeline_copy`` (the grad norm counts the first stage's
        only), and the last stage's head gathers it before reading it."""
        if module is None or not group.active:
            return
        p = module.weight
        name = self.param_names[id(p)]
        self._pipeline_shared[name] = (p, group)
        p.pipeline_copy = not runner.first
        if runner.last and not runner.first:
            bucket = self.bucket_of[name]

            def gather() -> None:
                if not self._pre_hooks_enabled:
                    return
                if bucket.full_param is not None:
                    bucket.ensure_params(async_op=False)
                elif bucket.param_state is not ParamState.READY:
                    bucket.finish_param_sync()

            runner.chunks[-1].before_tied_head = gather

    def _sum_pipeline_shared(self) -> None:
        """The gradient sums of :meth:`share_over_pipeline` (local, before any reduction)."""
        import torch.distributed as dist

        for name, (p, group) in self._pipeline_shared.items():
            self.bucket_of[name].acquire_grads()
            dist.all_reduce(p.main_grad, group=group.pg)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Micro-batches inside accumulate without dispatching reductions."""
        self._is_last_microbatch = False
        try:
            yield
        finally:
            self._is_last_microbatch = True

    def zero_grad_buffer(self) -> None:
        for b in self.buffers:
            b.zero_grads()
        for p in self._params:
            p.grad_added_to_main_grad = False

    def finish_grad_sync(self) -> int:
        """Every bucket reduced (waiting on overlapped ones). Returns this rank's non-finite
        code for :meth:`raise_on_nonfinite` (0: all finite or ``ddp.check_for_nan_in_grad``
        off; else 1 + the position of its first bad element). The caller exchanges the codes
        with its other per-step scalars, so the check costs no collective of its own."""
        self._collect_unhooked()  # (a caller that ran its backward outside backward_phase)
        self._sum_pipeline_shared()
        cfg = self.cfg
        check = bool(cfg.check_for_nan_in_grad) and not self.norm_finds_nonfinite
        avg = bool(cfg.average_in_collective)
        buckets = [k for b in self.buffers for k in b.buckets]
        # Every reduction the hooks did not dispatch is launched before any is waited on, so
        # their latencies overlap (several buffers -- dense and Muon, dense and expert -- or
        # buckets with overlap off): on gloo two in flight took 3.3 ms against 5.1 ms one
        # after the other. The same collectives on the same data, in the same order.
        for bucket in buckets:
            if bucket.grad_state is GradState.IDLE:
                bucket.start_grad_sync(check, self.grad_scale, avg, async_op=True)
        for bucket in buckets:
            bucket.finish_grad_sync(check, self.grad_scale, avg)
        if self.shards_params:
            self.release_sharded_params()  # (buckets whose params got no grad this step)
        return self._local_nonfinite_code() if check else 0

    @property
    def norm_finds_nonfinite(self) -> bool:
        """Whether ``ddp.check_for_nan_in_grad`` is left to the optimizer's grad norm: in a
        world of one process nothing is reduced, so the norm (fp64 over every grad: finite
        fp32 grads cannot overflow it) is non-finite exactly when a grad is, and the
        per-bucket pass over the grads each step would find nothing the norm does not. The
        engine then calls :meth:`scan_nonfinite_code` on that failure path only, to name the
        parameter. With more ranks the check must run before the reduction mixes the ranks'
        grads (the error names the rank)."""
        return bool(self.cfg.check_for_nan_in_grad) and self.groups.world_size == 1

    def scan_nonfinite_code(self) -> int:
        """This rank's non-finite code (as :meth:`finish_grad_sync` returns it) read straight
        from the reduced grads: the first non-finite element of this rank's shard of each
        bucket, in buffer order; 0 when all are finite. A full pass: failure paths only."""
        for b in self.buffers:
            for k in b.buckets:
                lo, hi = k.shard_range()
                bad = (~torch.isfinite(b.grad_slice(lo, hi))).nonzero()
                if len(bad):
                    return 1 + b.index * (1 << 40) + lo + int(bad[0])
        return 0

    @contextlib.contextmanager
    def backward_phase(self) -> Iterator[None]:
        """Around a backward: forwards inside it are recomputes (activation checkpointing),
        which must not free sharded params the backward is about to read."""
        self._in_backward = True
        try:
            yield
        finally:
            self._in_backward = False
        self._collect_unhooked()

    def release_sharded_params(self) -> None:
        """ZeRO-3: free every bucket's full params (finishing gathers in flight first); the
        engine calls it once the optimizer has read the initial values."""
        for bucket in self.forward_order:
            if bucket.full_param is None:
                continue
            if bucket.param_state is ParamState.GATHERING:
                bucket.finish_param_sync()
            bucket.release_params()

    def _local_nonfinite_code(self) -> int:
        buckets = [k for b in self.buffers for k in b.buckets if k.local_sum is not None]
        if not buckets or bool(torch.isfinite(torch.stack([k.local_sum for k in buckets])).all()):
            return 0
        for k in buckets:  # failure path only: find the first bad element
            if not bool(torch.isfinite(k.local_sum)):
                if k.first_bad is not None:  # sharded grads: found before the release
                    at = int(k.first_bad)
                    bad = torch.tensor([[at]] if at >= 0 else [], dtype=torch.long)
                else:
                    bad = (~torch.isfinite(k.grad_view)).nonzero()
                if len(bad):  # (else: finite grads whose fp32 sum overflowed: not an error)
                    return 1 + k.buffer.index * (1 << 40) + k.start + int(bad[0])
        return 0

    def raise_on_nonfinite(self, codes: list[int]) -> None:
        """Raise :class:`NonFiniteGradError` naming the first rank (by rank) whose code is set
        and its parameter; every rank sees the same codes, so every rank raises."""
        for rank, c in enumerate(codes):
            if c > 0:
                buf, offset = divmod(c - 1, 1 << 40)
                raise NonFiniteGradError(rank, self._param_at(buf, offset))

    def _param_at(self, buffer: int, offset: int) -> str:
        for s in self.buffers[buffer].spec.params:
            if s.start <= offset < s.end:
                return s.name
        return f"<padding of buffer {buffer}>"

    # ---- params ------------------------------------------------------------------------------

    def _make_pre_hook(self, module: nn.Module) -> Callable[..., None]:
        names = [self.param_names[id(p)] for p in module.parameters(recurse=False)]
        buckets = list(dict.fromkeys(self.bucket_of[n] for n in names if n in self.bucket_of))

        def pre_hook(_module: nn.Module, _args: Any) -> None:
            if not self._pre_hooks_enabled:
                return
            for bucket in buckets:
                if bucket.param_state is not ParamState.READY:
                    bucket.finish_param_sync()
                    nxt = bucket.next_in_forward
                    if nxt is not None and nxt.param_state is ParamState.STAGED:
                        nxt.start_param_sync(async_op=True)

        return pre_hook

    def sync_params(self, buckets: Optional[Sequence[Bucket]] = None) -> None:
        """Gather every (given) bucket now; each must have been staged (strict on purpose: a
        bucket gathered before its optimizer staged it would load stale or zero values).
        Every staged bucket's gather is launched before any is waited on, so their latencies
        overlap (see :meth:`finish_grad_sync`); each then loads its params in order."""
        todo = list(buckets if buckets is not None else self.gathered_buckets())
        for bucket in todo:
            if bucket.param_state is ParamState.STAGED:
                bucket.start_param_sync(async_op=True)
        for bucket in todo:
            bucket.finish_param_sync()

    def gathered_buckets(self) -> list[Bucket]:
        """Buckets whose params travel by all-gather (sharded buffers, and compact layer-wise
        Muon buckets with a ``param_sync_hook``), in forward order; other replicated
        buffers' params are written directly by the optimizer."""
        return [
            b for b in self.forward_order if b.buffer.sharded or b.param_sync_hook is not None
        ]

    def pending_param_buckets(self) -> list[Bucket]:
        return [b for b in self.forward_order if b.param_state is not ParamState.READY]

    @contextlib.contextmanager
    def params_synced(self, stage: Callable[[], None]) -> Iterator[None]:
        """The forced-sync entry point: finish in-flight gathers, restage masters (``stage``,
        which resets every bucket's dispatch state), gather everything synchronously, keep the
        pre-hooks off inside, restore them on exit."""
        for bucket in self.forward_order:
            if bucket.param_state is ParamState.GATHERING:
                bucket.finish_param_sync()
        stage()
        self.sync_params()
        enabled, self._pre_hooks_enabled = self._pre_hooks_enabled, False
        try:
            yield
        finally:
            self._pre_hooks_enabled = enabled
            if self.shards_params:
                self.release_sharded_params()

