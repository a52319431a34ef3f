"""Each rank's progress, published for the launcher's hung-rank watchdog.

Why: a rank that hangs -- stopped (SIGSTOP, a debugger), or stuck on the host between two
collectives (a deadlock, a stalled filesystem) -- used to hang the whole job in silence until
the process-group timeout, hard-coded at 10 minutes, and then some (a host-side hang outside
any collective has no timeout at all). The launcher cannot see inside a rank, so every rank
publishes a few counters in a small shared file that the launcher reads
(:mod:`lptrain.launch.watchdog`):

* ``ticks``: bumped when the rank enters and when it leaves a collective (every
  ``torch.distributed`` collective, wrapped when the rank joins its world);
* ``step``: the training step the rank is in (the loop sets it);
* ``in_collective``: whether it is inside a blocking collective now;
* ``timeout_ms``: ``dist.distributed_timeout_minutes``, so the launcher needs no config.

A rank whose counters stop moving for the timeout has made no progress; one that is not
inside a collective while its peers wait in one is the hung one. Publishing is a few stores
into shared memory per collective (no system call). Without a launcher that provides the
file (``$LPTRAIN_PROGRESS_FILE``) nothing is published.
"""

from __future__ import annotations

import contextlib
import functools
import mmap
import os
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Optional

PROGRESS_ENV = "LPTRAIN_PROGRESS_FILE"
SLOT = struct.Struct("<qqqqqqq")  # pid, timeout_ms, ticks, step, in_collective, rank, world
HEADER = struct.Struct("<qqqq")  # state (0 watching, 1 fired), reserved
STATE_FIRED = 1

# The collectives a rank may block in (those this torch has are wrapped).
COLLECTIVES = (
    "all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_single", "all_gather_object",
    "reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single", "broadcast",
    "broadcast_object_list", "barrier", "monitored_barrier", "all_to_all", "all_to_all_single",
    "gather", "gather_object", "scatter", "scatter_object_list", "reduce", "send", "recv",
)


def file_size(slots: int) -> int:
    return HEADER.size + slots * SLOT.size


@dataclass
class Slot:
    """One rank's published counters (what the launcher reads)."""

    pid: int
    timeout_ms: int
    ticks: int
    step: int
    in_collective: bool
    rank: int
    world: int


def read_slots(buf: Any, slots: int) -> list[Slot]:
    out = []
    for i in range(slots):
        pid, timeout_ms, ticks, step, inside, rank, world = SLOT.unpack_from(
            buf, HEADER.size + i * SLOT.size)
        out.append(Slot(pid, timeout_ms, ticks, step, bool(inside), rank, world))
    return out


class _Beacon:
    """This rank's slot in the shared file."""

    def __init__(self, buf: mmap.mmap, index: int, timeout_s: float) -> None:
        self.buf, self.offset = buf, HEADER.size + index * SLOT.size
        self.ticks = 0
        self.step = 0
        self.depth = 0
        self.rank = int(os.environ.get("RANK", "0"))
        self.world = int(os.environ.get("WORLD_SIZE", "1"))
        self._write(timeout_ms=int(timeout_s * 1000))

    def _write(self, timeout_ms: Optional[int] = None) -> None:
        if timeout_ms is not None:
            self.timeout_ms = timeout_ms
        SLOT.pack_into(self.buf, self.offset, os.getpid(), self.timeout_ms, self.ticks, self.step,
                       int(self.depth > 0), self.rank, self.world)

    def tick(self, entering: bool) -> None:
        self.ticks += 1
        self.depth += 1 if entering else -1
        self._write()

    def set_step(self, step: int) -> None:
        self.step = step
        self.ticks += 1
        self._write()

    def fired(self) -> bool:
        """Whether the launcher's watchdog has already named a hung rank and stops the job."""
        return HEADER.unpack_from(self.buf, 0)[0] == STATE_FIRED


_BEACON: Optional[_Beacon] = None


def _wrap(fn: Callable[..., Any], beacon: _Beacon) -> Callable[..., Any]:
    @functools.wraps(fn)
    def collective(*args: Any, **kwargs: Any) -> Any:
        beacon.tick(entering=True)
        try:
            return fn(*args, **kwargs)
        finally:
            beacon.tick(entering=False)

    collective.__lptrain_progress__ = True  # type: ignore[attr-defined]
    return collective


def publish(timeout_s: float) -> bool:
    """Start publishing this rank's progress when a launcher asked for it (idempotent);
    whether it publishes."""
    global _BEACON
    path = os.environ.get(PROGRESS_ENV)
    if _BEACON is not None or not path:
        return _BEACON is not None
    index = int(os.environ.get("LOCAL_RANK", "0"))
    try:
        with open(path, "r+b") as f:
            buf = mmap.mmap(f.fileno(), 0)
    except (OSError, ValueError):
        return False
    if len(buf) < file_size(index + 1):
        buf.close()
        return False
    _BEACON = _Beacon(buf, index, timeout_s)
    import torch.distributed as dist

    for name in COLLECTIVES:
        fn = getattr(dist, name, None)
        if fn is not None and not getattr(fn, "__lptrain_progress__", False):
            setattr(dist, name, _wrap(fn, _BEACON))
    return True


def mark_step(step: int) -> None:
    """The training loop is at ``step`` (counts as progress)."""
    if _BEACON is not None:
        _BEACON.set_step(step)


def watchdog_fired() -> bool:
    """The launcher's watchdog has named a hung rank and is stopping the job (this rank then
    says nothing of its own)."""
    if _BEACON is None:
        return False
    with contextlib.suppress(ValueError):
        return _BEACON.fired()
    return False
