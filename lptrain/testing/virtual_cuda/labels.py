"""Where tensors live on the virtual GPU: storage labels, what counts, what is reported.

A tensor is on the device when its storage object carries :data:`LABEL` (torch keeps a
storage's Python object, attributes included, as long as the storage lives, so views and
``param.data = x`` follow their storage); a wrapper subclass (no storage of its own) carries
the label itself. Everything else is host memory.
"""

from __future__ import annotations

import threading
import traceback
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

aten = torch.ops.aten
DEVICE, HOST, TO_HOST = "device", "host", "to-host"  # where the current Python-level call places
LABEL = "_lptrain_virtual_cuda"
CUDA = torch.device("cuda", 0)
CPU = torch.device("cpu")


class DeviceRuleError(AssertionError):
    """Code broke one of CUDA's device rules (see the module doc); a GPU would fail here."""


# ---- labels ---------------------------------------------------------------------------------


DENSE = (torch.Tensor, torch.nn.Parameter)
_Tensor, _Parameter = torch.Tensor, torch.nn.Parameter


def storage_of(t: torch.Tensor) -> Optional[Any]:
    """The storage object of a dense tensor; None for wrapper subclasses (whose storage
    object is a placeholder: lptrain's and TE's quantized tensors keep their bytes in inner
    tensors)."""
    tp = type(t)
    if tp is _Tensor or tp is _Parameter:
        return t.untyped_storage()
    try:  # (TE >= 2.20's QuantizedTensor makes an empty storage on its device: "cuda" here)
        st = t.untyped_storage()
        st.data_ptr()
    except RuntimeError:
        return None
    return st


def is_device(t: Any) -> bool:
    """Whether ``t`` lives on the virtual device (its storage, or a wrapper, is labelled).

    Called for every tensor of every op: a dense tensor (the common case) costs one storage
    lookup and one attribute read."""
    tp = type(t)
    if tp is _Tensor or tp is _Parameter:
        return getattr(t.untyped_storage(), LABEL, None) is not None
    if not isinstance(t, torch.Tensor):
        return isinstance(t, DeviceGenerator)
    st = storage_of(t)
    if st is None:
        return bool(t.__dict__.get(LABEL, False))
    return getattr(st, LABEL, None) is not None


class _Allocation:
    """The label of a device storage that counts towards the device's memory: it lives in
    the storage object's ``__dict__``, which torch keeps exactly as long as the storage, so
    its finalizer frees the bytes when the storage goes (a ``weakref.finalize`` per storage,
    for the same effect, costs several times more on this hot path)."""

    __slots__ = ("nbytes", "stats")

    def __init__(self, stats: DeviceStats, nbytes: int) -> None:
        self.stats = stats
        self.nbytes = nbytes
        stats.allocated(nbytes)

    def __del__(self) -> None:
        self.stats.freed(self.nbytes)


def label(t: torch.Tensor, stats: Optional[DeviceStats] = None) -> torch.Tensor:
    tp = type(t)
    st = t.untyped_storage() if tp is _Tensor or tp is _Parameter else storage_of(t)
    if st is None:
        t.__dict__[LABEL] = True
        return t
    if getattr(st, LABEL, None) is None:
        setattr(st, LABEL, True if stats is None else _Allocation(stats, st.nbytes()))
    return t


def describe(t: Any) -> str:
    if not isinstance(t, torch.Tensor):
        return repr(t)
    where = "cuda" if is_device(t) else t.device.type
    return f"{where} {tuple(t.shape)} {str(t.dtype).replace('torch.', '')}"


def is_cuda_device(d: Any) -> bool:
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
        site = f"{kind} at {caller()}"
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


def caller() -> str:
    """The innermost lptrain frame of the current stack (where a sync was asked for)."""
    for frame in reversed(traceback.extract_stack()[:-2]):
        if "/lptrain/" in frame.filename and "/testing/virtual_cuda" not in frame.filename:
            return f"{frame.filename.rsplit('/lptrain/', 1)[1]}:{frame.lineno} ({frame.name})"
    return "<outside lptrain>"



def tensors_in(obj: Any) -> Iterator[torch.Tensor]:
    """The tensors in call arguments (nested lists, tuples and dict values), in order; a
    light stand-in for pytree flattening on this hot path."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for x in obj:
            yield from tensors_in(x)
    elif isinstance(obj, dict):
        for x in obj.values():
            yield from tensors_in(x)


def label_all(out: Any, stats: DeviceStats) -> Any:
    """Label every tensor in ``out`` (nested lists, tuples and dict values) device memory."""
    if isinstance(out, torch.Tensor):
        label(out, stats)
    elif isinstance(out, (list, tuple)):
        for x in out:
            label_all(x, stats)
    elif isinstance(out, dict):
        for x in out.values():
            label_all(x, stats)
    return out


def _has_device(items: Any) -> bool:
    for v in items:
        tp = type(v)
        if tp is _Tensor or tp is _Parameter:
            if getattr(v.untyped_storage(), LABEL, None) is not None:
                return True
        elif isinstance(v, torch.Tensor):
            if is_device(v):
                return True
        elif isinstance(v, (list, tuple)):
            if _has_device(v):
                return True
        elif isinstance(v, dict) and _has_device(v.values()):
            return True
    return False


def any_device(args: tuple, kwargs: dict) -> bool:
    """Whether any tensor of the call arguments is on the device (:func:`tensors_in`'s walk,
    inlined and stopping at the first: asked of every Python-level torch call)."""
    return _has_device(args) or (bool(kwargs) and _has_device(kwargs.values()))



class DeviceGenerator(torch.Generator):
    """The virtual GPU's generator: a CPU generator that counts as a device one (random ops
    on device tensors without an explicit generator draw from it, as from CUDA's default)."""

    __slots__ = ()

