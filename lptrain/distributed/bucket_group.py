"""A bucket of the param/grad buffer and its explicit synchronisation state machine.

Two independent state variables per bucket, each changed only by a method that asserts the
state it starts from, so a forgotten or repeated step raises at the line that caused it
instead of silently training on stale data (the upstream bugs were a ``param_gather_dispatched``
flag left ``True`` after a forced sync, and zeros gathered before every optimizer had staged):

    grads:  IDLE --start_grad_sync--> REDUCING --finish_grad_sync--> READY --zero--> IDLE
    params: READY --stage--> STAGED --start_param_sync--> GATHERING --finish_param_sync--> READY

``stage`` is legal from READY or STAGED (restaging overwrites the staged values) and resets
the dispatch state: a restaged bucket is always gathered again. It is never legal while a
gather is in flight.
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING, Any, Optional, Protocol, runtime_checkable

import torch
import torch.distributed as dist

from lptrain.precision.collectives import all_gather_flat, reduce_scatter_flat

if TYPE_CHECKING:
    from lptrain.distributed.buffers import ParamAndGradBuffer
    from lptrain.distributed.groups import BufferGroups


def _first_nonfinite(view: torch.Tensor, total: torch.Tensor) -> torch.Tensor:
    """The flat index of ``view``'s first non-finite element as a 0-dim int64 tensor (-1: none),
    given ``total``, its sum (taken anyway for the NaN check).

    Read only when ``total`` is not finite (``DataParallel._local_nonfinite_code``), but it
    must be found before sharded grads are released. On the CPU, where asking is free, a
    finite sum skips the search: a sum is finite only if every element is, and the search is
    four full passes over the bucket (~6 ms per 1M-element bucket in a DP=2 step). Elsewhere
    asking would be a host sync per bucket, so the (asynchronous) search always runs."""
    if view.device.type == "cpu" and bool(torch.isfinite(total)):
        return torch.full((), -1, dtype=torch.int64, device=view.device)
    bad = ~torch.isfinite(view)
    return torch.where(bad.any(), bad.to(torch.uint8).argmax(), -1)


class IllegalTransition(RuntimeError):
    """A bucket was asked to change state from a state that does not allow it."""


class GradState(enum.Enum):
    IDLE = "idle"
    REDUCING = "reducing"
    READY = "ready"


class ParamState(enum.Enum):
    READY = "ready"
    STAGED = "staged"
    GATHERING = "gathering"


@runtime_checkable
class ParamSyncHook(Protocol):
    """A bucket's own param sync, replacing the sharded all-gather (compact layer-wise Muon
    buckets: every param comes whole from its owner). The bucket calls ``start`` on
    ``start_param_sync`` and ``finish`` on ``finish_param_sync`` (before the buffer's params
    are loaded from staging), so the hook runs inside the state machine like a gather."""

    @property
    def in_flight(self) -> bool:
        """Whether a started sync awaits :meth:`finish`."""
        ...

    def start(self, *, async_op: bool) -> None:
        """Launch the sync's collectives (``async_op``: return before they complete)."""
        ...

    def finish(self) -> None:
        """Wait for the collectives and write the gathered values into the params."""
        ...


class Bucket:
    """Bucket ``index`` of ``buffer``: elements ``[start, end)``, its params, its two states."""

    def __init__(self, buffer: ParamAndGradBuffer, index: int, groups: BufferGroups) -> None:
        spec = buffer.spec.buckets[index]
        self.buffer = buffer
        self.index = index
        self.start, self.end = spec.start, spec.end
        self.param_names = spec.params
        self.groups = groups
        self.grad_state = GradState.IDLE
        self.param_state = ParamState.READY
        self._grad_handles: list[Any] = []
        self._gather_handle: Optional[Any] = None
        self._pending: set[str] = set(self.param_names)
        # sum of this rank's grads before the reduction: non-finite iff one of them is
        # (one cheap pass, no host sync; the position is looked up only on failure)
        self.local_sum: Optional[torch.Tensor] = None
        self.next_in_forward: Optional[Bucket] = None
        # Layer-wise (compact Muon) buckets: whole-param uneven gather, set by the optimizer
        # (lptrain.optim.compact_gather.CompactGather).
        self.param_sync_hook: Optional[ParamSyncHook] = None
        # Sharded grads (ZeRO-2): this bucket's own full grad tensor, allocated only from its
        # first backward use to its reduce-scatter (see lptrain.distributed.buffers).
        self.full_grad: Optional[torch.Tensor] = None
        self._full_grad_bytes = 0
        self._grads_allocated = False
        self.first_bad: Optional[torch.Tensor] = None  # first non-finite element, pre-release
        # Sharded params (ZeRO-3): the bucket's full params exist only around their uses
        # (gathered from the shards before a forward or backward needs them, freed after);
        # plain params are views of ``full_param``, whose storage is resized to 0 when freed.
        self.full_param: Optional[torch.Tensor] = None
        self._full_param_bytes = 0
        self._params_allocated = True
        self.prev_in_forward: Optional[Bucket] = None
        self.forward_modules: set[int] = set()  # modules whose forward reads these params
        self._forward_seen: set[int] = set()
        self._grads_done: set[str] = set()
        self.keep_through_forward = False  # a tied embedding: the head reads it again
        if buffer.shards_params:
            self.full_param = torch.zeros(
                self.end - self.start, dtype=buffer.key.param_dtype, device=buffer.device
            )
            self._full_param_bytes = self.full_param.untyped_storage().nbytes()
        if buffer.shards_grads:
            self.full_grad = torch.zeros(
                self.end - self.start, dtype=buffer.key.grad_dtype, device=buffer.device
            )
            self._full_grad_bytes = self.full_grad.untyped_storage().nbytes()
            self._grads_allocated = True

    def __repr__(self) -> str:
        return (
            f"Bucket(buffer={self.buffer.index}, index={self.index}, grads={self.grad_state.value}, "
            f"params={self.param_state.value})"
        )

    # ---- helpers --------------------------------------------------------------------------

    def _expect(self, what: str, state: enum.Enum, *allowed: enum.Enum) -> None:
        if state not in allowed:
            names = " or ".join(a.value for a in allowed)
            raise IllegalTransition(f"{self!r}: {what} needs {names}, state is {state.value}")

    @property
    def grad_view(self) -> torch.Tensor:
        """The bucket's full (pre-reduction) grads. With sharded grads they exist only
        between :meth:`acquire_grads` and the release after the reduction."""
        if self.full_grad is not None:
            if not self._grads_allocated:
                raise IllegalTransition(f"{self!r}: its full grads are released (sharded grads)")
            return self.full_grad
        return self.buffer.grad_data[self.start : self.end]

    # ---- sharded grads: the full bucket's lifetime ----------------------------------------

    def acquire_grads(self) -> None:
        """Allocate this bucket's full grads as zeros (no-op when allocated or unsharded).
        Called at the first backward use of any of its params in a step."""
        if self.full_grad is None or self._grads_allocated:
            return
        self.full_grad.untyped_storage().resize_(self._full_grad_bytes)
        self.full_grad.zero_()
        self._grads_allocated = True

    def release_grads(self) -> None:
        """Free the full grads' storage (the views stay valid objects; any read before the
        next :meth:`acquire_grads` fails loudly)."""
        if self.full_grad is None or not self._grads_allocated:
            return
        self.full_grad.untyped_storage().resize_(0)
        self._grads_allocated = False

    def full_grad_nbytes(self) -> int:
        return self._full_grad_bytes if self._grads_allocated else 0

    # ---- sharded params: the full bucket's lifetime -------------------------------------

    @property
    def params_present(self) -> bool:
        """Whether the bucket's full params are allocated (always, unless params are sharded)."""
        return self.full_param is None or self._params_allocated

    def release_params(self) -> None:
        """ZeRO-3: free the full params (the param views stay valid objects; the next use
        gathers them again from the shards, which hold the current values)."""
        if self.full_param is None or not self._params_allocated:
            return
        if self.param_state is ParamState.GATHERING:
            raise IllegalTransition(f"{self!r}: release_params with a gather in flight")
        self.buffer.release_quantized(self)
        self.full_param.untyped_storage().resize_(0)
        self._params_allocated = False
        self._forward_seen.clear()
        self._grads_done.clear()

    def ensure_params(self, *, async_op: bool) -> None:
        """ZeRO-3: make the full params present -- finish a gather in flight, or gather
        from the shards (staged, or released since) -- returning early when ``async_op``."""
        if self.param_state is ParamState.GATHERING:
            if not async_op:
                self.finish_param_sync()
        elif self.param_state is ParamState.STAGED or not self.params_present:
            self.start_param_sync(async_op=async_op)

    def forward_done(self, module: int) -> None:
        """A module reading these params finished its forward; when all have, the bucket
        is freed until its backward (unless it holds a tied embedding)."""
        self._forward_seen.add(module)
        done = self._forward_seen >= self.forward_modules and not self.keep_through_forward
        if done and self.param_state is not ParamState.GATHERING:
            self.release_params()

    def grad_done(self, name: str) -> None:
        """A param's gradient is complete for this backward; after the last, free the bucket."""
        self._grads_done.add(name)
        if len(self._grads_done) == len(self.param_names) and self.param_state is not ParamState.GATHERING:
            self.release_params()

    @property
    def param_view(self) -> torch.Tensor:
        assert self.buffer.param_data is not None
        return self.buffer.param_data[self.start : self.end]

    def shard_range(self) -> tuple[int, int]:
        """This rank's shard of the bucket, in buffer elements (the whole bucket if unsharded)."""
        spec = self.buffer.spec
        return spec.shard_range(spec.buckets[self.index], self.groups.intra.rank, self.groups.intra.size)

    # ---- grads -----------------------------------------------------------------------------

    def register_grad_ready(self, name: str, check_nan: bool, scale: float, avg_in_collective: bool) -> None:
        """A param's grad is complete for this step; dispatch the reduction when all are."""
        if name not in self._pending:
            raise IllegalTransition(f"{self!r}: grad of {name!r} reported ready twice in one step")
        self._pending.discard(name)
        if not self._pending:
            self.start_grad_sync(check_nan, scale, avg_in_collective, async_op=True)

    def start_grad_sync(self, check_nan: bool, scale: float, avg_in_collective: bool, *, async_op: bool) -> None:
        self._expect("start_grad_sync", self.grad_state, GradState.IDLE)
        self.acquire_grads()  # (sharded grads: a bucket no param used this step is zeros)
        view = self.grad_view
        if check_nan:
            self.local_sum = view.sum(dtype=torch.float32)
            if self.full_grad is not None:  # the full grads are gone by the time it is read
                self.first_bad = _first_nonfinite(view, self.local_sum)
        intra = self.groups.intra
        dp_size = self.groups.dp_size
        if dp_size > 1 and not avg_in_collective and scale != 1.0:
            view.mul_(scale)
        self.grad_state = GradState.REDUCING
        self._grad_handles = []
        if self.full_grad is not None and intra.active:
            # straight into the kept shard: no aliasing with the input, no copy afterwards
            self._grad_handles.append(
                reduce_scatter_flat(self.buffer.shard_of(self), view, group=intra.pg, async_op=async_op)
            )
        elif self.buffer.sharded and intra.active:
            # in place: this rank's shard of the bucket is the output (equal shards in rank
            # order, the in-place form NCCL and gloo support), so nothing is copied after
            lo, hi = self.shard_range()
            out = self.buffer.grad_data[lo:hi]
            self._grad_handles.append(reduce_scatter_flat(out, view, group=intra.pg, async_op=async_op))
        elif intra.active:
            self._grad_handles.append(dist.all_reduce(view, group=intra.pg, async_op=async_op))
        if not async_op:
            self._after_reduce()

    def _after_reduce(self) -> None:
        for h in self._grad_handles:
            if h is not None:
                h.wait()
        self._grad_handles = []
        if self.full_grad is not None:
            if not self.groups.intra.active:  # one shard-holder: the shard is the bucket
                self.buffer.shard_of(self).copy_(self.full_grad)
            self.release_grads()
        inter = self.groups.inter
        if inter.active:  # partial sharding: the reduced shard is replicated over instances
            lo, hi = self.shard_range()
            dist.all_reduce(self.buffer.grad_slice(lo, hi), group=inter.pg)

    def finish_grad_sync(self, check_nan: bool, scale: float, avg_in_collective: bool) -> None:
        if self.grad_state is GradState.IDLE:  # not dispatched by hooks (overlap off, or unused params)
            self.start_grad_sync(check_nan, scale, avg_in_collective, async_op=False)
        else:
            self._expect("finish_grad_sync", self.grad_state, GradState.REDUCING)
            self._after_reduce()
        if avg_in_collective and self.groups.dp_size > 1:
            lo, hi = self.shard_range()  # gloo has no AVG: average right after the SUM
            self.buffer.grad_slice(lo, hi).mul_(scale)
        self.grad_state = GradState.READY

    def zero_grads(self) -> None:
        if self._grad_handles:
            raise IllegalTransition(f"{self!r}: zero_grad with a reduction in flight")
        self.grad_state = GradState.IDLE
        self._pending = set(self.param_names)
        self.local_sum = None
        self.first_bad = None

    # ---- params ----------------------------------------------------------------------------

    def mark_staged(self) -> None:
        """The optimizer wrote this rank's masters into the param slice (see module doc)."""
        self._expect("stage", self.param_state, ParamState.READY, ParamState.STAGED)
        self.param_state = ParamState.STAGED

    def start_param_sync(self, *, async_op: bool) -> None:
        if not (self.param_state is ParamState.READY and not self.params_present):
            # (a released ZeRO-3 bucket may gather again from READY: its shards are current)
            self._expect("start_param_sync", self.param_state, ParamState.STAGED)
        g = self.groups.intra
        self.param_state = ParamState.GATHERING
        if self.full_param is not None:
            if not self._params_allocated:
                self.full_param.untyped_storage().resize_(self._full_param_bytes)
                self._params_allocated = True
            local = self.buffer.param_shard_of(self)
            if g.active:
                self._gather_handle = all_gather_flat(self.full_param, local, group=g.pg, async_op=async_op)
            else:  # through an alias with its own version counter: views of the params may
                # be saved for backward, and refilling them is not a modification
                alias = torch.empty(0, dtype=local.dtype, device=local.device)
                alias.set_(self.full_param.untyped_storage(), 0, self.full_param.shape)
                alias.copy_(local)
        elif self.buffer.sharded and g.active:
            # in place: the staged shard is this rank's slot of the bucket's param view (equal
            # shards in rank order), so neither a copy of the input nor of the output is made
            lo, hi = self.shard_range()
            full = self.param_view
            self._gather_handle = all_gather_flat(
                full, full[lo - self.start : hi - self.start], group=g.pg, async_op=async_op
            )
        elif self.param_sync_hook is not None:
            self.param_sync_hook.start(async_op=async_op)
        if not async_op:
            self.finish_param_sync()

    def finish_param_sync(self) -> None:
        if self.param_state is ParamState.STAGED:
            self.start_param_sync(async_op=False)
            return
        if self.param_state is ParamState.READY:
            raise IllegalTransition(
                f"{self!r}: param sync needs staged or gathering, state is ready: its optimizer "
                "has not staged this bucket (gathering now would load stale or zero values)"
            )
        if self._gather_handle is not None:
            self._gather_handle.wait()
            self._gather_handle = None
        if self.param_sync_hook is not None:
            self.param_sync_hook.finish()
        self.buffer.load_params_from_staging(self)
        self.param_state = ParamState.READY
