"""A virtual CUDA device on a CPU-only machine: runs real training steps and enforces CUDA's
device rules, so code that would crash on a GPU fails here, with the op that broke the rule.

Why not ``FakeTensorMode``: it has no values (losses, ``.item()``, data-dependent shapes of an
MoE dispatch are meaningless) and on a CPU-only build any backward through fake ``cuda``
tensors aborts the process (AccumulateGrad needs a CUDA device guard). Here every tensor is a
real CPU tensor; what is virtual is its *placement*:

* a :class:`~torch.overrides.TorchFunctionMode` maps ``cuda`` placements onto the CPU --
  ``device=`` arguments of factories, ``Tensor.to``/``.cuda()``/``.cpu()``, ``nn.Module.to``,
  ``with torch.device("cuda")`` -- and labels the storage of what it creates as *device*
  memory; it reports ``.device``/``.is_cuda`` of labelled tensors as ``cuda:0``, so code follows
  its CUDA paths (bf16 activations, native bf16 GEMMs, NCCL process groups);
* a :class:`~torch.utils._python_dispatch.TorchDispatchMode` sees every aten op (forward,
  backward and optimizer alike), propagates the label to outputs and enforces the rules:

  1. no op mixes device and host tensors, except a 0-dim host tensor used as an input (what
     CUDA kernels accept as a scalar);
  2. no in-place op writes device results into a host tensor;
  3. a random op on device tensors draws from a device generator;
  4. every collective's tensors are on the device the process group requires (NCCL: CUDA);

  and counts **host syncs** (``.item()``/``float()``/``.tolist()``, device-to-host copies,
  ``nonzero`` and other ops whose output size depends on device values,
  ``torch.cuda.synchronize``) so a test can show that a step's syncs do not grow with the
  number of parameters;
* the ``torch.cuda`` queries the code asks (``is_available``, ``current_device``,
  ``get_device_capability``, RNG state, memory statistics, ...) answer as one GPU of the
  requested capability; memory statistics count the bytes of labelled storages.

Labels live on storage objects (torch keeps a storage's Python object, and its attributes, as
long as the storage lives), so views and ``param.data = x`` follow their storage without
extra bookkeeping, and a storage created any other way (``torch.from_numpy``, a data loader,
before the device was entered) is host memory. Quantized wrapper subclasses (lptrain's and
Transformer Engine's, which have no storage of their own) are created on the CPU with the
label on the wrapper.

A violation raises :class:`DeviceRuleError` (an ``AssertionError``) at the op; the message
names the rule, the op, and each tensor's placement, shape and dtype. Used by the tests, by
``lptrain pretrain --dry-run`` on a GPU target, and by nothing at run time.
"""

from __future__ import annotations

import contextlib
import threading
import traceback
import weakref
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten
DEVICE, HOST, TO_HOST = "device", "host", "to-host"  # where the current Python-level call places
_LABEL = "_lptrain_virtual_cuda"
CUDA = torch.device("cuda", 0)
_HOST = torch.device("cpu")


class DeviceRuleError(AssertionError):
    """Code broke one of CUDA's device rules (see the module doc); a GPU would fail here."""


# ---- labels ---------------------------------------------------------------------------------


_DENSE = (torch.Tensor, torch.nn.Parameter)


def _storage(t: torch.Tensor) -> Optional[Any]:
    """The storage object of a dense tensor; None for wrapper subclasses (whose storage
    object is a placeholder: lptrain's and TE's quantized tensors keep their bytes in inner
    tensors)."""
    st = t.untyped_storage()
    if type(t) in _DENSE:
        return st
    try:
        st.data_ptr()
    except RuntimeError:
        return None
    return st


def is_device(t: Any) -> bool:
    """Whether ``t`` lives on the virtual device (its storage, or a wrapper, is labelled)."""
    if not isinstance(t, torch.Tensor):
        return isinstance(t, DeviceGenerator)
    st = _storage(t)
    if st is None:
        return bool(t.__dict__.get(_LABEL, False))
    return bool(getattr(st, _LABEL, False))


def _label(t: torch.Tensor, stats: Optional[DeviceStats] = None) -> torch.Tensor:
    st = _storage(t)
    if st is None:
        t.__dict__[_LABEL] = True
        return t
    if not getattr(st, _LABEL, False):
        setattr(st, _LABEL, True)
        if stats is not None:
            stats.allocated(st.nbytes())
            weakref.finalize(st, stats.freed, st.nbytes())
    return t


def _placement(t: Any) -> str:
    if not isinstance(t, torch.Tensor):
        return repr(t)
    where = "cuda" if is_device(t) else t.device.type
    return f"{where} {tuple(t.shape)} {str(t.dtype).replace('torch.', '')}"


def _is_cuda_device(d: Any) -> bool:
    if d is None:
        return False
    if isinstance(d, torch.device):
        return d.type == "cuda"
    if isinstance(d, str):
        return d.split(":")[0] == "cuda"
    return isinstance(d, int)  # a bare index means a CUDA device in torch's factories


# ---- statistics -----------------------------------------------------------------------------


@dataclass
class DeviceStats:
    """What the virtual device saw: host syncs by kind (with where they came from),
    collectives by name, and device memory (bytes of labelled storages)."""

    syncs: Counter = field(default_factory=Counter)
    sync_sites: list[str] = field(default_factory=list)
    collectives: Counter = field(default_factory=Counter)
    bytes_now: int = 0
    bytes_peak: int = 0
    # re-entrant: a storage finalizer (``freed``) may run inside any allocation, this
    # class's own included
    _lock: threading.RLock = field(default_factory=threading.RLock, repr=False)

    def sync(self, kind: str) -> None:
        site = f"{kind} at {_caller()}"
        with self._lock:
            self.syncs[kind] += 1
            self.sync_sites.append(site)

    def allocated(self, n: int) -> None:
        with self._lock:
            self.bytes_now += n
            self.bytes_peak = max(self.bytes_peak, self.bytes_now)

    def freed(self, n: int) -> None:
        with self._lock:
            self.bytes_now -= n

    @property
    def host_syncs(self) -> int:
        return sum(self.syncs.values())

    def reset_peak(self) -> None:
        self.bytes_peak = self.bytes_now


def _caller() -> str:
    """The innermost lptrain frame of the current stack (where a sync was asked for)."""
    for frame in reversed(traceback.extract_stack()[:-2]):
        if "/lptrain/" in frame.filename and "/testing/virtual_cuda" not in frame.filename:
            return f"{frame.filename.rsplit('/lptrain/', 1)[1]}:{frame.lineno} ({frame.name})"
    return "<outside lptrain>"


# ---- ops ------------------------------------------------------------------------------------

# Ops that move data between host and device on purpose (checked by their own rules).
_TRANSFERS = {aten._to_copy.default, aten.copy_.default, aten._copy_from.default,
              aten._copy_from_and_resize.default}
# Ops whose output size depends on device values: CUDA must sync to allocate the output.
_SYNC_OPS = {
    aten.nonzero.default, aten.nonzero_static.default, aten.masked_select.default,
    aten._unique2.default, aten.unique_dim.default, aten.unique_consecutive.default,
    aten.is_nonzero.default, aten.equal.default, aten._local_scalar_dense.default,
}
_SYNC_NAMES = {aten._local_scalar_dense.default: "item", aten.is_nonzero.default: "bool"}
# CUDA's "CPU scalar" exception does not hold inside tensor-list arguments (cat, stack,
# foreach): every tensor of a list must be on the device.


def _written(func: Any, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    out = []
    for i, a in enumerate(func._schema.arguments):
        info = a.alias_info
        if info is None or not info.is_write:
            continue
        v = args[i] if i < len(args) else kwargs.get(a.name)
        if isinstance(v, torch.Tensor):
            out.append(v)
        elif isinstance(v, (list, tuple)):
            out.extend(x for x in v if isinstance(x, torch.Tensor))
    return out


def _tensor_args(args: tuple, kwargs: dict) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(top-level tensors, tensors inside list arguments)."""
    top, listed = [], []
    for v in (*args, *kwargs.values()):
        if isinstance(v, torch.Tensor):
            top.append(v)
        elif isinstance(v, (list, tuple)):
            listed.extend(x for x in v if isinstance(x, torch.Tensor))
    return top, listed


class _DispatchRules(TorchDispatchMode):
    def __init__(self, device: VirtualCuda) -> None:
        super().__init__()
        self.vd = device

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        top, listed = _tensor_args(args, kwargs)
        tensors = [t for t in (*top, *listed) if t.device.type != "meta"]
        on_device = [t for t in tensors if is_device(t)]
        if func in _TRANSFERS:
            return self._transfer(func, args, kwargs, on_device)
        if on_device:
            self._check(func, top, listed, on_device, args, kwargs)
            if func in _SYNC_OPS:
                self.vd.stats.sync(_SYNC_NAMES.get(func, func.overloadpacket.__name__))
            if kwargs.get("generator", 0) is None or (
                "generator" not in kwargs and any(a.name == "generator" for a in func._schema.arguments)
            ):
                kwargs["generator"] = self.vd.generator  # CUDA's default generator
        out = func(*args, **kwargs)
        if on_device or (not top and not listed and self.vd.ambient() == DEVICE):
            _label_all(out, self.vd.stats)
        return out

    def _check(self, func: Any, top: list, listed: list, on_device: list, args: tuple, kwargs: dict) -> None:
        written = {id(t) for t in _written(func, args, kwargs)}
        for t in top:
            if is_device(t) or t.device.type == "meta":
                continue
            if id(t) in written:
                self.vd.violation("an in-place op writes device results into a host tensor", func, args)
            if t.dim() > 0:
                self.vd.violation("an op mixes device and host tensors", func, args)
        for t in listed:
            if not is_device(t) and t.device.type != "meta":
                self.vd.violation("an op mixes device and host tensors (tensor list)", func, args)
        gen = kwargs.get("generator")
        if isinstance(gen, torch.Generator) and not is_device(gen):
            self.vd.violation("a random op on device tensors draws from a host generator", func, args)

    def _transfer(self, func: Any, args: tuple, kwargs: dict, on_device: list) -> Any:
        if func is aten._to_copy.default:
            src = args[0]
            out = func(*args, **kwargs)
            if is_device(src):
                if self.vd.ambient() == TO_HOST:
                    if not kwargs.get("non_blocking", False):
                        self.vd.stats.sync("device-to-host copy")
                else:  # autograd's and composites' dtype casts keep their placement
                    _label(out, self.vd.stats)
            return out
        dst, src = args[0], args[1]
        if is_device(src) and not is_device(dst) and not dst.is_meta:
            non_blocking = bool(args[2]) if len(args) > 2 else bool(kwargs.get("non_blocking", False))
            if not non_blocking:
                self.vd.stats.sync("device-to-host copy")
        return func(*args, **kwargs)


# ---- placement ------------------------------------------------------------------------------

_FACTORY_DEVICE_KW = "device"


def _to_args(t: torch.Tensor, args: tuple, kwargs: dict) -> tuple[Any, Any, bool, bool]:
    """(device, dtype, non_blocking, copy) of a ``Tensor.to`` call."""
    copy = bool(kwargs.get("copy", False))
    device, dtype, non_blocking, _fmt = torch._C._nn._parse_to(*args, **{k: v for k, v in kwargs.items() if k != "copy"})
    if args and isinstance(args[0], torch.Tensor):
        device = CUDA if is_device(args[0]) else args[0].device
    return device, dtype, non_blocking, copy


def _tensors(obj: Any) -> Iterator[torch.Tensor]:
    """The tensors in call arguments (nested lists, tuples and dict values), in order; a
    light stand-in for pytree flattening on this hot path."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for x in obj:
            yield from _tensors(x)
    elif isinstance(obj, dict):
        for x in obj.values():
            yield from _tensors(x)


def _label_all(out: Any, stats: DeviceStats) -> Any:
    for t in _tensors(out):
        _label(t, stats)
    return out


def _any_device(args: tuple, kwargs: dict) -> bool:
    return any(is_device(t) for t in _tensors((args, kwargs)))


class _Placement(TorchFunctionMode):
    """Maps ``cuda`` placements of Python-level calls onto the CPU (see the module doc) and
    tells the dispatch rules where the ops a call decomposes into belong: tensors that
    composite ops and autograd create from an input's options (``device=cpu``, as every
    tensor is really on the CPU) belong where the call's tensors are."""

    def __init__(self, device: VirtualCuda) -> None:
        super().__init__()
        self.vd = device

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        kwargs = dict(kwargs or {})
        handler = self.vd.special.get(func)
        if handler is not None:
            return handler(func, args, kwargs)
        if getattr(func, "__name__", "") == "__get__":  # a property read: places nothing
            return func(*args, **kwargs)
        dev = kwargs.get(_FACTORY_DEVICE_KW)
        if _is_cuda_device(dev):
            kwargs[_FACTORY_DEVICE_KW] = _HOST
            with self.vd.placed(DEVICE):
                out = func(*args, **kwargs)
            return _label_all(out, self.vd.stats)
        where = DEVICE if dev is None and _any_device(args, kwargs) else HOST
        with self.vd.placed(where):
            return func(*args, **kwargs)


# ---- the device -----------------------------------------------------------------------------


@dataclass
class _Props:
    name: str
    major: int
    minor: int
    total_memory: int
    multi_processor_count: int = 132
    is_integrated: bool = False
    is_multi_gpu_board: bool = False


class VirtualCuda:
    """Context manager: while active, this process has one virtual CUDA GPU (see module doc).

    ``capability``: the compute capability ``torch.cuda.get_device_capability()`` reports
    (``(9, 0)`` an H100, ``(10, 0)`` a B200); ``name``: the device name (what the MFU table
    matches); ``stats``: the counters. Not re-entrant; one per process at a time.
    """

    _active: Optional[VirtualCuda] = None

    def __init__(self, capability: tuple[int, int] = (9, 0), name: str = "NVIDIA H100 80GB HBM3",
                 total_memory: int = 80 * 2**30, cuda_version: str = "12.9") -> None:
        self.capability = capability
        self.props = _Props(name, capability[0], capability[1], total_memory)
        self.cuda_version = cuda_version
        self.stats = DeviceStats()
        self.violations: list[str] = []
        self.nccl_groups: set[Any] = set()
        self._undo: list[Callable[[], None]] = []
        self._modes: list[Any] = []
        self._checks_paused = 0
        self._ambient = threading.local()
        self.generator = DeviceGenerator()  # the device's default generator (CUDA RNG state)
        self.special = self._special_functions()

    # -- rules ---------------------------------------------------------------------------------

    def violation(self, rule: str, func: Any, args: Any) -> None:
        if self._checks_paused:
            return
        operands = ", ".join(_placement(t) for t in _tensors(args)) or "no tensors"
        msg = f"virtual CUDA: {rule}: {func} on [{operands}] at {_caller()}"
        self.violations.append(msg)
        raise DeviceRuleError(msg)

    def ambient(self) -> Optional[str]:
        """Where the innermost Python-level call of this thread places new tensors."""
        stack = getattr(self._ambient, "stack", None)
        return stack[-1] if stack else None

    @contextlib.contextmanager
    def placed(self, where: str) -> Iterator[None]:
        stack = self._ambient.__dict__.setdefault("stack", [])
        stack.append(where)
        try:
            yield
        finally:
            stack.pop()

    @contextlib.contextmanager
    def mode_active(self) -> Iterator[None]:
        """Inside a placement handler: the placement mode on again, for a function whose own
        torch-function check is skipped (``torch.autograd``'s, so it does not recurse)."""
        import torch.autograd as autograd_pkg

        saved = autograd_pkg.has_torch_function
        autograd_pkg.has_torch_function = lambda *a, **k: False
        torch.overrides._push_mode(self._modes[0])
        try:
            yield
        finally:
            torch.overrides._pop_mode()
            autograd_pkg.has_torch_function = saved

    @contextlib.contextmanager
    def checks_paused(self) -> Iterator[None]:
        """Suspend the rules (object collectives move their own pickles, as on NCCL)."""
        self._checks_paused += 1
        try:
            yield
        finally:
            self._checks_paused -= 1

    # -- context -------------------------------------------------------------------------------

    def __enter__(self) -> VirtualCuda:
        if VirtualCuda._active is not None:
            raise RuntimeError("a virtual CUDA device is already active in this process")
        if torch.cuda.is_available() and not isinstance(torch.cuda.is_available, _Patched):
            raise RuntimeError("a real CUDA device is present: use it instead of the virtual one")
        VirtualCuda._active = self
        self._patch_cuda()
        self._patch_wrapper_subclass()
        self._patch_distributed()
        self._modes = [_Placement(self), _DispatchRules(self)]
        for m in self._modes:
            m.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        for m in reversed(self._modes):
            m.__exit__(None, None, None)
        self._modes = []
        for undo in reversed(self._undo):
            undo()
        self._undo = []
        VirtualCuda._active = None

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

    # -- torch.cuda ------------------------------------------------------------------------------

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
        }
        for name, fn in fns.items():
            self._set(c, name, _Patched(fn))
        self._set(c, "default_generators", (gen,))
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
            cuda = _is_cuda_device(dev) or (vd.ambient() == DEVICE and (dev is None or torch.device(dev).type == "cpu"))
            if cuda:
                kwargs["device"] = _HOST
            out = original(cls, *args, **kwargs)
            if cuda:
                out.__dict__[_LABEL] = True
            return out

        self._set(torch.Tensor, "_make_wrapper_subclass", staticmethod(make_wrapper))

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
        for name in _TENSOR_COLLECTIVES:
            fn = getattr(dist, name, None)
            if fn is not None:
                self._set(dist, name, self._checked_collective(name, fn))
        for name in _OBJECT_COLLECTIVES:
            fn = getattr(dist, name, None)
            if fn is not None:
                self._set(dist, name, self._object_collective(fn))

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
                host = [t for t in _tensors((args, kwargs)) if not is_device(t)]
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

    # -- Python-level tensor functions ---------------------------------------------------------

    def _special_functions(self) -> dict[Any, Callable[[Any, tuple, dict], Any]]:
        st = self.stats
        T = torch.Tensor

        def device_get(func: Any, args: tuple, kwargs: dict) -> Any:
            return CUDA if is_device(args[0]) else func(*args, **kwargs)

        def is_cuda_get(func: Any, args: tuple, kwargs: dict) -> Any:
            return True if is_device(args[0]) else func(*args, **kwargs)

        def is_cpu_get(func: Any, args: tuple, kwargs: dict) -> Any:
            return False if is_device(args[0]) else func(*args, **kwargs)

        def get_device(func: Any, args: tuple, kwargs: dict) -> Any:
            return 0 if is_device(args[0]) else func(*args, **kwargs)

        def to(func: Any, args: tuple, kwargs: dict) -> Any:
            t = args[0]
            device, dtype, non_blocking, copy = _to_args(t, args[1:], kwargs)
            if device is None:
                return func(*args, **kwargs)
            want_device = _is_cuda_device(device)
            fwd: dict[str, Any] = {"dtype": dtype, "non_blocking": non_blocking}
            if want_device == is_device(t) and not copy and (dtype is None or dtype == t.dtype):
                return t
            if device is not None and getattr(device, "type", str(device)) == "meta":
                return func(*args, **kwargs)
            with self.placed(DEVICE if want_device else TO_HOST):
                out = t.to(device=_HOST, copy=True, **{k: v for k, v in fwd.items() if v is not None})
            if want_device:
                if is_device(t):
                    return out  # device -> device (dtype change or copy): labelled by dispatch
                return _label(out, st)
            return out  # a device-to-host copy: counted by the dispatch rules

        def cuda(func: Any, args: tuple, kwargs: dict) -> Any:
            t = args[0]
            if is_device(t):
                return t
            with self.placed(DEVICE):
                return _label(t.to(device=_HOST, copy=True), st)

        def cpu(func: Any, args: tuple, kwargs: dict) -> Any:
            t = args[0]
            if not is_device(t):
                return func(*args, **kwargs)
            with self.placed(TO_HOST):
                return t.to(device=_HOST, copy=True)  # counted by the dispatch rules

        def scalar(kind: str) -> Callable[[Any, tuple, dict], Any]:
            def read(func: Any, args: tuple, kwargs: dict) -> Any:
                if is_device(args[0]):
                    st.sync(kind)
                    with self.checks_paused():
                        return func(*args, **kwargs)
                return func(*args, **kwargs)

            return read

        def autograd(fn: Callable[..., Any], tensor_method: bool) -> Callable[[Any, tuple, dict], Any]:
            """Backward passes run user code (hooks, custom backwards): run them with the
            placement mode active (a handler otherwise runs its function with it popped)."""

            def run(func: Any, args: tuple, kwargs: dict) -> Any:
                if tensor_method:  # Tensor.backward(self, gradient, retain_graph, create_graph, inputs)
                    names = ("gradient", "retain_graph", "create_graph", "inputs")
                    kw = dict(zip(names, args[1:], strict=False))
                    kw.update(kwargs)
                    grads = kw.pop("gradient", None)
                    call_args: tuple = (args[0],)
                    kwargs = {"grad_tensors": grads, **kw}
                else:
                    call_args = args
                with self.placed(DEVICE if _any_device(args, kwargs) else HOST), self.mode_active():
                    return fn(*call_args, **kwargs)

            return run

        def numpy(func: Any, args: tuple, kwargs: dict) -> Any:
            if is_device(args[0]):
                self.violation("a device tensor converted to numpy (call .cpu() first)", func, args)
            return func(*args, **kwargs)

        out: dict[Any, Callable[[Any, tuple, dict], Any]] = {
            T.device.__get__: device_get,
            T.is_cuda.__get__: is_cuda_get,
            T.is_cpu.__get__: is_cpu_get,
            T.get_device: get_device,
            T.to: to,
            T.cuda: cuda,
            T.cpu: cpu,
            T.tolist: scalar("tolist"),
            T.numpy: numpy,
            T.backward: autograd(torch.autograd.backward, tensor_method=True),
            torch.autograd.backward: autograd(torch.autograd.backward, tensor_method=False),
            torch.autograd.grad: autograd(torch.autograd.grad, tensor_method=False),
        }
        # item/float/int/bool reach aten._local_scalar_dense (counted in dispatch)
        return out


class DeviceGenerator(torch.Generator):
    """The virtual GPU's generator: a CPU generator that counts as a device one (random ops
    on device tensors without an explicit generator draw from it, as from CUDA's default)."""

    __slots__ = ()


class _Patched:
    """A patched ``torch.cuda`` function (tells :class:`VirtualCuda` a real GPU from itself)."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)


class _Stream:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def synchronize(self) -> None:
        active = VirtualCuda._active
        if active is not None:
            active.stats.sync("stream.synchronize")

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
        active = VirtualCuda._active
        if active is not None:
            active.stats.sync("event.synchronize")

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


_TENSOR_COLLECTIVES = (
    "all_reduce", "all_reduce_coalesced", "reduce", "broadcast", "all_gather",
    "all_gather_into_tensor", "all_gather_single", "all_gather_coalesced",
    "reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single", "all_to_all",
    "all_to_all_single", "gather", "scatter", "send", "recv", "isend", "irecv",
)
_OBJECT_COLLECTIVES = (
    "all_gather_object", "broadcast_object_list", "gather_object", "scatter_object_list",
    "send_object_list", "recv_object_list", "barrier", "monitored_barrier",
)


def active() -> Optional[VirtualCuda]:
    """The virtual device of this process, if one is active."""
    return VirtualCuda._active


__all__ = ["CUDA", "DeviceGenerator", "DeviceRuleError", "DeviceStats", "VirtualCuda", "active",
           "is_device"]
