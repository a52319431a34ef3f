"""The launcher's hung-rank watchdog: a rank that makes no progress for the timeout is named in
one line and the job stops (exit 3).

Every rank publishes its progress counters (:mod:`lptrain.distributed.progress`) in a file the
launcher creates; a thread of the launcher reads them every half second and remembers when
each rank's counters last moved. Once a rank that has started training has not moved for
``dist.distributed_timeout_minutes`` (less a second, so that the watchdog speaks before a
waiting peer's process-group timeout fires), the watchdog picks the hung rank among the stale
ones -- a stopped process first (SIGSTOP, a debugger), then one outside any collective (a
host-side hang: its peers wait for it inside one), then the one furthest behind -- records
one line, marks the file (the ranks then say nothing of their own), and kills every rank of
this node (SIGKILL: a hung rank cannot act on SIGTERM). The launcher turns the line into its
error, exit 3.

A rank on another node is not visible here: its node's launcher names it, and this node's
ranks then lose their peer (``rank N lost peer M``), or this watchdog reports a local rank
waiting inside a collective as the one without progress, saying so.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import signal
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from lptrain.distributed.orphans import LAUNCHER_PID_ENV
from lptrain.distributed.progress import (
    HEADER,
    PROGRESS_ENV,
    STATE_FIRED,
    Slot,
    file_size,
    read_slots,
)

POLL_S = 0.5
HANG_FIX = ("see what the rank was doing (its last log lines; py-spy dump --pid PID on a live "
            "one), raise dist.distributed_timeout_minutes if a step or save legitimately takes "
            "longer, and resume from the last checkpoint")
MARGIN_S = 1.0  # ahead of the process-group timeout, which counts from a later moment


def _process_state(pid: int) -> Optional[str]:
    """``R``, ``S``, ``T`` (stopped), ``Z``... from ``/proc``; None when it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat[stat.rindex(")") + 2:].split()[0]


@dataclass
class _Seen:
    counters: tuple[int, int] = (-1, -1)
    since: float = field(default_factory=time.monotonic)


def choose_hung(slots: dict[int, Slot], stale_s: dict[int, float],
                states: dict[int, Optional[str]]) -> list[int]:
    """The local ranks to name among the stale ones (``stale_s``): stopped processes first,
    then ranks outside any collective, then the ones with the fewest ticks."""
    stale = sorted(stale_s)
    stopped = [r for r in stale if states.get(r) in ("T", "t")]
    if stopped:
        return stopped
    outside = [r for r in stale if not slots[r].in_collective]
    pool = outside or stale
    fewest = min(slots[r].ticks for r in pool)
    return [r for r in pool if slots[r].ticks == fewest]


def describe_hang(local: list[int], slots: dict[int, Slot], stale_s: dict[int, float],
                  states: dict[int, Optional[str]]) -> str:
    """One line: which rank(s) made no progress, for how long, and where they were."""
    parts = []
    for r in local:
        s = slots[r]
        where = ("stopped by a signal (SIGSTOP or a debugger)" if states.get(r) in ("T", "t")
                 else "waiting inside a collective (a rank elsewhere is hung or too slow)"
                 if s.in_collective else "outside any collective (a host-side hang)")
        parts.append(f"rank {s.rank} (pid {s.pid}, step {s.step}, {where})")
    timeout_min = slots[local[0]].timeout_ms / 60000
    worst = max(stale_s[r] for r in local)
    who = parts[0] if len(parts) == 1 else "ranks " + ", ".join(p.removeprefix("rank ") for p in parts)
    return (f"{who} of {slots[local[0]].world} made no progress for {worst:.0f} s "
            f"(dist.distributed_timeout_minutes={timeout_min:g}); the job was stopped")


class Watchdog:
    """The watching thread and its file, for ``nproc`` local ranks (see the module doc)."""

    def __init__(self, nproc: int) -> None:
        self.nproc = nproc
        self.message: Optional[str] = None
        self._folder = Path(tempfile.mkdtemp(prefix="lptrain-progress-"))
        self.path = self._folder / "progress"
        self.path.write_bytes(b"\0" * file_size(nproc))
        self._file = open(self.path, "r+b")  # noqa: SIM115 - closed in close()
        self.buf = mmap.mmap(self._file.fileno(), 0)
        self._stop = threading.Event()
        self._seen = {r: _Seen() for r in range(nproc)}
        self._thread = threading.Thread(target=self._run, name="lptrain-watchdog", daemon=True)

    @property
    def fired(self) -> bool:
        return self.message is not None

    def check(self, now: Optional[float] = None) -> Optional[str]:
        """One look at the counters; the line when a rank is hung (and the job stopped)."""
        now = time.monotonic() if now is None else now
        slots = dict(enumerate(read_slots(self.buf, self.nproc)))
        stale_s: dict[int, float] = {}
        for r, s in slots.items():
            seen = self._seen[r]
            if (s.ticks, s.step) != seen.counters:
                seen.counters, seen.since = (s.ticks, s.step), now
                continue
            if s.pid <= 0 or s.step < 1 or s.timeout_ms <= 0:
                continue  # not training yet: start-up has its own timeouts
            limit = s.timeout_ms / 1000
            limit -= min(MARGIN_S, limit / 4)
            if now - seen.since >= limit and _process_state(s.pid) not in (None, "Z"):
                stale_s[r] = now - seen.since
        if not stale_s:
            return None
        states = {r: _process_state(slots[r].pid) for r in stale_s}
        hung = choose_hung(slots, stale_s, states)
        self.message = describe_hang(hung, slots, stale_s, states)
        HEADER.pack_into(self.buf, 0, STATE_FIRED, 0, 0, 0)
        self._kill_all(slots)
        return self.message

    def _kill_all(self, slots: dict[int, Slot]) -> None:
        for s in slots.values():
            if s.pid > 0:
                with contextlib.suppress(OSError):
                    os.kill(s.pid, signal.SIGKILL)

    def _run(self) -> None:
        while not self._stop.wait(POLL_S):
            if self.check() is not None:
                return

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        with contextlib.suppress(Exception):
            self.buf.close()
            self._file.close()
        with contextlib.suppress(OSError):
            self.path.unlink()
            self._folder.rmdir()


@contextlib.contextmanager
def watching(nproc: int) -> Iterator[Watchdog]:
    """Run the watchdog around a launch of ``nproc`` local ranks: they inherit the file's
    path (``$LPTRAIN_PROGRESS_FILE``) and this launcher's pid (``$LPTRAIN_LAUNCHER_PID``, see
    :mod:`lptrain.distributed.orphans`) from this process's environment."""
    dog = Watchdog(nproc)
    exported = {PROGRESS_ENV: str(dog.path), LAUNCHER_PID_ENV: str(os.getpid())}
    previous = {k: os.environ.get(k) for k in exported}
    os.environ.update(exported)
    dog._thread.start()
    try:
        yield dog
    finally:
        dog.close()
        for k, v in previous.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
