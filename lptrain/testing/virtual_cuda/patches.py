"""What the virtual GPU patches while it is active: ``torch.cuda``'s queries, wrapper-subclass
creation and ``torch.distributed``'s collectives (a mixin of :class:`~.device.VirtualCuda`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist

from .labels import CPU, DEVICE, LABEL, is_cuda_device, is_device, tensors_in


@dataclass
class Props:
    name: str
    major: int
    minor: int
    total_memory: int
    multi_processor_count: int = 132
    is_integrated: bool = False
    is_multi_gpu_board: bool = False


class Patches:
    """Patching helpers; ``_set`` records how to undo each patch."""

    stats: Any
    generator: Any
    capability: tuple[int, int]
    props: Props
    cuda_version: str
    nccl_groups: set[Any]
    _undo: list[Callable[[], None]]

    def _set(self, owner: Any, name: str, value: Any) -> None:
        missing = object()
        old = owner.__dict__.get(name, missing) if isinstance(owner, type) else getattr(owner, name, missing)

        def undo() -> None:
            if old is missing:
                delattr(owner, name)
            else:
                setattr(owner, name, old)

        setattr(owner, name, value)
        self._undo.append(undo)

    def _patch_cuda(self) -> None:
        c = torch.cuda
        st = self.stats
        gen = self.generator
        props = self.props
        fns: dict[str, Callable[..., Any]] = {
            "is_available": lambda: True,
            "is_initialized": lambda: True,
            "_lazy_init": lambda: None,
            "init": lambda: None,
            "device_count": lambda: 1,
            "current_device": lambda: 0,
            "set_device": lambda d: None,
            "get_device_capability": lambda d=None: self.capability,
            "get_device_name": lambda d=None: props.name,
            "get_device_properties": lambda d=None: props,
            "is_bf16_supported": lambda *a, **k: True,
            "synchronize": lambda d=None: st.sync("torch.cuda.synchronize"),
            "empty_cache": lambda: None,
            "memory_allocated": lambda d=None: st.bytes_now,
            "max_memory_allocated": lambda d=None: st.bytes_peak,
            "memory_reserved": lambda d=None: st.bytes_now,
            "max_memory_reserved": lambda d=None: st.bytes_peak,
            "reset_peak_memory_stats": lambda d=None: st.reset_peak(),
            "reset_max_memory_allocated": lambda d=None: st.reset_peak(),
            "mem_get_info": lambda d=None: (props.total_memory - st.bytes_now, props.total_memory),
            "manual_seed": lambda s: gen.manual_seed(int(s)),
            "manual_seed_all": lambda s: gen.manual_seed(int(s)),
            "seed": lambda: gen.seed(),
            "seed_all": lambda: gen.seed(),
            "initial_seed": lambda: gen.initial_seed(),
            "get_rng_state": lambda d="cuda": gen.get_state(),
            "set_rng_state": lambda s, d="cuda": gen.set_state(s),
            "get_rng_state_all": lambda: [gen.get_state()],
            "set_rng_state_all": lambda states: gen.set_state(states[0]),
            "current_stream": lambda d=None: _Stream(),
            "default_stream": lambda d=None: _Stream(),
            "is_current_stream_capturing": lambda: False,  # no CUDA graph is ever captured
        }
        for name, fn in fns.items():
            self._set(c, name, Patched(fn))
        self._set(c, "default_generators", (gen,))
        for name in ("range_push", "range_pop", "mark"):  # NVTX markers (profiling): no-ops
            self._set(c.nvtx, name, lambda *a, **k: 0)
        self._set(c.nvtx, "range", lambda *a, **k: contextlib.nullcontext())
        self._set(c, "Event", _Event)
        self._set(c, "Stream", _Stream)
        self._set(c, "stream", lambda s=None: contextlib.nullcontext())
        self._set(c, "device", _DeviceCtx)
        self._set(torch.version, "cuda", self.cuda_version)
        self._set(torch.Tensor, "pin_memory", lambda t, *a, **k: t)
        self._set(torch.Tensor, "is_pinned", lambda t, *a, **k: False)

    def _patch_wrapper_subclass(self) -> None:
        """Wrapper subclasses asked for ``cuda`` are created on the CPU, labelled: a real
        CUDA wrapper would make autograd look for a CUDA device guard (absent here). One made
        inside a call on device tensors (where ``.device`` reads the real CPU, as Python
        torch functions run with the placement mode off) is labelled too."""
        original = torch.Tensor._make_wrapper_subclass
        vd = self

        def make_wrapper(cls: Any, *args: Any, **kwargs: Any) -> Any:
            dev = kwargs.get("device")
            cuda = is_cuda_device(dev) or (vd.ambient() == DEVICE and (dev is None or torch.device(dev).type == "cpu"))
            if cuda:
                kwargs["device"] = CPU
            out = original(cls, *args, **kwargs)
            if cuda:
                out.__dict__[LABEL] = True
            return out

        self._set(torch.Tensor, "_make_wrapper_subclass", staticmethod(make_wrapper))

    def _patch_checkpoint_metadata(self) -> None:
        """Activation checkpointing compares each recomputed tensor's shape, dtype and device
        with the forward's: a device tensor's ``.device`` reads the real CPU where the forward
        records it (its saved-tensor hook runs with the placement mode off) and ``cuda`` in
        the recompute (under it), so the check compares the label instead."""
        import torch.utils.checkpoint as ckpt

        checks = ckpt._allowed_determinism_checks_to_fns
        key = ckpt._DEFAULT_DETERMINISM_MODE
        original = checks[key]

        def metadata(x: torch.Tensor) -> dict[str, Any]:
            return {"shape": x.shape, "dtype": x.dtype, "device": "cuda" if is_device(x) else "cpu"}

        checks[key] = metadata
        self._undo.append(lambda: checks.__setitem__(key, original))

    # -- torch.distributed ---------------------------------------------------------------------

    def _patch_distributed(self) -> None:
        """A process group asked for as NCCL is a gloo group whose collectives demand
        device tensors; object collectives (which move their own pickles) are exempt."""
        vd = self
        real_init = dist.init_process_group

        def init_process_group(backend: Any = None, *args: Any, **kwargs: Any) -> Any:
            if backend is not None and "nccl" in str(backend):
                out = real_init("gloo", *args, **kwargs)
                vd.nccl_groups.add(dist.group.WORLD)
                return out
            return real_init(backend, *args, **kwargs)

        self._set(dist, "init_process_group", init_process_group)
        self._set(dist, "is_nccl_available", lambda: True)
        real_new_group = dist.new_group

        def new_group(*args: Any, **kwargs: Any) -> Any:
            backend = kwargs.get("backend")
            if backend is not None and "nccl" in str(backend):
                kwargs["backend"] = "gloo"
            pg = real_new_group(*args, **kwargs)
            if (backend is None and dist.group.WORLD in vd.nccl_groups) or (backend and "nccl" in str(backend)):
                vd.nccl_groups.add(pg)
            return pg

        self._set(dist, "new_group", new_group)
        for name in TENSOR_COLLECTIVES:
            fn = getattr(dist, name, None)
            if fn is not None:
                checked = self._checked_collective(name, fn)
                self._set(dist, name, checked)
                if name in ("isend", "irecv"):  # P2POp accepts only c10d's own isend/irecv
                    self._set(dist.distributed_c10d, name, checked)
        for name in OBJECT_COLLECTIVES:
            fn = getattr(dist, name, None)
            if fn is not None:
                self._set(dist, name, self._object_collective(fn))
        # NCCL batches the collectives issued inside ``_coalescing_manager`` (TE gathers data
        # and scales in one batch); gloo cannot. Issued one by one they give the same
        # results, so on the virtual GPU the manager runs them eagerly.
        self._set(dist, "_coalescing_manager", _eager_coalescing)
        self._set(dist.distributed_c10d, "_coalescing_manager", _eager_coalescing)

    def _requires_device(self, group: Any) -> bool:
        if not self.nccl_groups:
            return False
        if group is None or group is dist.group.WORLD:
            return dist.group.WORLD in self.nccl_groups
        return group in self.nccl_groups

    def _checked_collective(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        vd = self

        def collective(*args: Any, **kwargs: Any) -> Any:
            vd.stats.collectives[name] += 1
            group = kwargs.get("group")
            if group is None:
                group = next((a for a in args if isinstance(a, dist.ProcessGroup)), None)
            if not vd._checks_paused and vd._requires_device(group):
                host = [t for t in tensors_in((args, kwargs)) if not is_device(t)]
                if host:
                    vd.violation(f"a collective on an NCCL process group gets host tensors ({name})",
                                 f"torch.distributed.{name}", (args, kwargs))
            return fn(*args, **kwargs)

        collective.__wrapped__ = fn  # type: ignore[attr-defined]
        return collective

    def _object_collective(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        vd = self

        def collective(*args: Any, **kwargs: Any) -> Any:
            with vd.checks_paused():
                return fn(*args, **kwargs)

        collective.__wrapped__ = fn  # type: ignore[attr-defined]
        return collective



class _DoneWork:
    def wait(self) -> bool:
        return True


@contextlib.contextmanager
def _eager_coalescing(group: Any = None, device: Any = None, async_ops: bool = False) -> Any:
    """``torch.distributed._coalescing_manager`` on gloo: each collective ran when issued."""
    yield _DoneWork() if async_ops else None


def _count_sync(kind: str) -> None:
    from .device import active

    vd = active()
    if vd is not None:
        vd.stats.sync(kind)


class Patched:
    """A patched ``torch.cuda`` function (tells :class:`VirtualCuda` a real GPU from itself)."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)


class _Stream:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def synchronize(self) -> None:
        _count_sync("stream.synchronize")

    def wait_stream(self, other: Any) -> None:
        pass

    def __enter__(self) -> _Stream:
        return self

    def __exit__(self, *exc: object) -> None:
        pass


class _Event:
    def __init__(self, enable_timing: bool = False, **kwargs: Any) -> None:
        import time

        self._time = time.perf_counter
        self._t: Optional[float] = None

    def record(self, stream: Any = None) -> None:
        self._t = self._time()

    def synchronize(self) -> None:
        _count_sync("event.synchronize")

    def elapsed_time(self, end: _Event) -> float:
        return 1000.0 * ((end._t or 0.0) - (self._t or 0.0))

    def query(self) -> bool:
        return True


class _DeviceCtx:
    """``torch.cuda.device(i)``: a no-op context on the one virtual GPU."""

    def __init__(self, device: Any) -> None:
        self.idx = 0

    def __enter__(self) -> _DeviceCtx:
        return self

    def __exit__(self, *exc: object) -> None:
        pass


TENSOR_COLLECTIVES = (
    "all_reduce", "all_reduce_coalesced", "reduce", "broadcast", "all_gather",
    "all_gather_into_tensor", "all_gather_single", "all_gather_coalesced",
    "reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single", "all_to_all",
    "all_to_all_single", "gather", "scatter", "send", "recv", "isend", "irecv",
)
OBJECT_COLLECTIVES = (
    "all_gather_object", "broadcast_object_list", "gather_object", "scatter_object_list",
    "send_object_list", "recv_object_list", "barrier", "monitored_barrier",
)

