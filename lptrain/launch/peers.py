"""A rank whose peer died: one line naming the peer and how it ended, exit 3.

Why: when a rank is killed (SIGKILL, the OOM killer, a segfault) its sockets close and the
survivors' next collective fails with a backend error (gloo: "Connection closed by peer",
NCCL: "remote process exited"). That is not a bug in lptrain, but it used to surface as a
gloo traceback and "internal error ... this is a bug in lptrain". :func:`lost_peer_error`
recognises such a failure in a multi-rank run and turns it into
``rank N lost peer M (exit X, signal S)``, a :class:`~lptrain.errors.RunFailedError`.

Which peer: the ranks on this node are the launcher's children (``torchrun``, the elastic
agent of ``--nproc-per-node``), so the survivor lists its siblings in ``/proc``: the live ones
say their ``RANK`` in their environment, a dead one not yet reaped by the launcher is a zombie
whose wait status ``/proc/PID/stat`` still holds. A peer on another node, or one the launcher
already reaped, is named as far as it can be ("exit unknown"); the launcher's own line then
gives its exit status.
"""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from lptrain.errors import RunFailedError

# What the collective backends say when the other end of a connection went away.
_PEER_GONE = (
    "connection closed by peer", "connection reset by peer", "broken pipe",
    "remote process exited", "connection refused", "communicator was aborted",
    "socket closed", "ncclremoteerror", "transport endpoint is not connected",
)


@dataclass(frozen=True)
class _Sibling:
    pid: int
    rank: Optional[int]  # None: a zombie (its environment is gone)
    wait_status: Optional[int]  # zombies only


def _is_peer_failure(exc: BaseException) -> bool:
    seen: set[int] = set()
    e: Optional[BaseException] = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        text = f"{type(e).__name__} {e}".lower()
        if any(marker in text for marker in _PEER_GONE):
            return True
        e = e.__cause__ or e.__context__
    return False


def _children(pid: int) -> list[int]:
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            out += [int(x) for x in (task / "children").read_text().split()]
        except (OSError, ValueError):
            continue
    return out


def _sibling(pid: int) -> Optional[_Sibling]:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2 :].split()  # after "pid (comm) "
    if fields[0] == "Z":
        return _Sibling(pid, None, int(fields[-1]) if len(fields) >= 50 else None)
    try:
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    for item in env:
        if item.startswith(b"RANK="):
            return _Sibling(pid, int(item[5:]), None)
    return None


def _how_it_ended(wait_status: Optional[int]) -> str:
    if wait_status is None:
        return "exit unknown, signal unknown: already reaped by the launcher"
    if os.WIFSIGNALED(wait_status):
        sig = os.WTERMSIG(wait_status)
        name = signal.Signals(sig).name if sig in signal.Signals._value2member_map_ else str(sig)
        return f"exit {128 + sig}, signal {name}"
    return f"exit {os.WEXITSTATUS(wait_status)}, signal none"


def describe_lost_peer(rank: int, world_size: int) -> str:
    """``rank N lost peer M (exit X, signal S)`` as far as this node can tell."""
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    first = rank - int(os.environ.get("LOCAL_RANK", rank % max(1, local_world)))
    expected = set(range(first, first + local_world)) - {rank}
    siblings = [s for s in (_sibling(p) for p in _children(os.getppid()) if p != os.getpid()) if s]
    alive = {s.rank for s in siblings if s.rank is not None}
    zombies = [s for s in siblings if s.rank is None]
    missing = sorted(expected - alive)
    status = _how_it_ended(zombies[0].wait_status if len(zombies) == 1 else None)
    if len(missing) == 1:
        return f"rank {rank} lost peer {missing[0]} ({status})"
    if missing:
        return f"rank {rank} lost peers {', '.join(map(str, missing))} ({status})"
    return f"rank {rank} lost a peer on another node (exit unknown, signal unknown)"


def lost_peer_error(exc: BaseException) -> Optional[RunFailedError]:
    """The one-line error for a collective that failed because a peer died, else None."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1 or not _is_peer_failure(exc):
        return None
    rank = int(os.environ.get("RANK", "0"))
    return RunFailedError(
        describe_lost_peer(rank, world) + "; this rank stopped too",
        fix="see the lost rank's log or the launcher's line for why it ended (killed, out of "
            "memory, its own error); resume from the last checkpoint",
    )
