"""A rank whose peer died: one line naming the peer and how it ended, exit 3.

Why: when a rank is killed (SIGKILL, the OOM killer, a segfault) its sockets close and the
survivors' next collective fails with a backend error (gloo: "Connection closed by peer",
NCCL: "remote process exited"). That is not a bug in lptrain, but it used to surface as a
gloo traceback and "internal error ... this is a bug in lptrain". :func:`lost_peer_error`
recognises such a failure in a multi-rank run and turns it into
``rank N lost peer M (exit X, signal S)``, a :class:`~lptrain.errors.RunFailedError`.

Which peer: the ranks on this node are the launcher's children (``torchrun``, the elastic
agent of ``--nproc-per-node``), so the survivor lists its siblings in ``/proc``: the live ones
say their ``RANK`` in their environment; the missing one is the lost peer. How it ended: both
of lptrain's launchers (``--nproc-per-node`` and :mod:`lptrain.launch.torchrun`) run the agent
under :func:`publish_peer_exits`, which writes each failed rank's exit code to a file named by
``$LPTRAIN_PEER_EXITS`` as soon as the agent sees it (before it stops the others); failing
that, a dead peer not yet reaped is a zombie whose wait status ``/proc/PID/stat`` still holds.
A peer on another node is named as far as it can be ("exit unknown"); the launcher's own line
then gives its exit status.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from lptrain.errors import RunFailedError

# What the collective backends say when the other end of a connection went away.
# (Not "connection refused": that is a rendezvous that never formed, not a peer that died.)
_PEER_GONE = (
    "connection closed by peer", "connection reset by peer", "broken pipe",
    "remote process exited", "communicator was aborted", "ncclremoteerror",
    "transport endpoint is not connected",
)


PEER_EXITS_ENV = "LPTRAIN_PEER_EXITS"
RANK_SPOKE_ENV = "LPTRAIN_RANK_SPOKE"  # set in the launcher when a rank printed an error line
_PUBLISH_WAIT_S = 2.0  # how long a survivor waits for the launcher's record


@contextlib.contextmanager
def publish_peer_exits() -> Iterator[None]:
    """In the launcher's process, around the elastic agent's run: every rank failure the
    agent's process context sees is written (``{local rank: exit code}``) to
    ``$LPTRAIN_PEER_EXITS``, which the ranks inherit, before it stops the surviving ranks (the
    hook is the context's failure capture, which runs just before that teardown). Without
    that hook in this torch version it does nothing (the survivors fall back to ``/proc``).
    When the launch fails after a rank printed its error line (:func:`claim_the_word`),
    ``$LPTRAIN_RANK_SPOKE`` is set in this process for :func:`rank_spoke`."""
    try:
        from torch.distributed.elastic.multiprocessing.api import SubprocessContext
    except ImportError:
        yield
        return
    original = getattr(SubprocessContext, "_capture_process_failures", None)
    if original is None:
        yield
        return
    folder = Path(tempfile.mkdtemp(prefix="lptrain-exits-"))
    path = folder / "exits.json"
    previous = os.environ.get(PEER_EXITS_ENV)
    os.environ[PEER_EXITS_ENV] = str(path)

    def capture(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(self, *args, **kwargs)
        failures = getattr(self, "_failures", None) or {}
        if failures and not path.exists():  # the first failures: before the teardown's
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps({str(r): int(f.exitcode) for r, f in failures.items()}))
            os.replace(tmp, path)
        return result

    SubprocessContext._capture_process_failures = capture  # type: ignore[method-assign]
    try:
        yield
    except BaseException:
        if (folder / _SPOKEN).exists():  # a rank printed the job's error line: none from here
            os.environ[RANK_SPOKE_ENV] = "1"
        raise
    finally:
        SubprocessContext._capture_process_failures = original  # type: ignore[method-assign]
        if previous is None:
            os.environ.pop(PEER_EXITS_ENV, None)
        else:
            os.environ[PEER_EXITS_ENV] = previous
        shutil.rmtree(folder, ignore_errors=True)


_SPOKEN = "spoken"  # beside the exits file: created by the first rank that printed an error


def claim_the_word() -> bool:
    """Whether this rank is the first of its launch to print an error line (then it must);
    False when another rank already did. Under a launcher without lptrain's exits file (a
    plain ``torchrun``, another node's), every rank may speak: True. One failure -- a killed
    rank at TP 2 x PP 2 -- used to print a line from each survivor and one from the launcher."""
    name = os.environ.get(PEER_EXITS_ENV)
    if not name:
        return True
    try:
        os.close(os.open(Path(name).with_name(_SPOKEN), os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
    except FileExistsError:
        return False
    except OSError:  # the launcher's folder is gone (it is tearing down): say it anyway
        return True
    return True


def _published_exit(local_rank: int) -> Optional[int]:
    """The exit code of this node's ``local_rank`` as the launcher recorded it (waiting
    briefly), else None."""
    name = os.environ.get(PEER_EXITS_ENV)
    if not name:
        return None
    deadline = time.monotonic() + _PUBLISH_WAIT_S
    while True:
        with contextlib.suppress(OSError, ValueError):
            code = json.loads(Path(name).read_text()).get(str(local_rank))
            if code is not None:
                return int(code)
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.05)


def rank_spoke() -> bool:
    """In the launcher, after the launch failed: whether a rank printed the job's error line."""
    return os.environ.pop(RANK_SPOKE_ENV, None) == "1"


def peer_failed_first() -> bool:
    """Whether the launcher has recorded a failure of another local rank: a SIGTERM now is the
    launcher stopping this rank because of it, not a preemption (nothing to say about it)."""
    name = os.environ.get(PEER_EXITS_ENV)
    if not name:
        return False
    try:
        exits = json.loads(Path(name).read_text())
    except (OSError, ValueError):
        return False
    me = os.environ.get("LOCAL_RANK", "0")
    return any(rank != me and code != 0 for rank, code in exits.items())


def _exit_code_text(exitcode: int) -> str:
    """A launcher's exit code (negative: killed by that signal) as ``exit X, signal S``."""
    if exitcode < 0:
        return _how_it_ended(-exitcode)  # a wait status whose low bits are the signal
    return f"exit {exitcode}, signal none"


@dataclass(frozen=True)
class _Sibling:
    pid: int
    rank: Optional[int]  # None: a zombie (its environment is gone)
    wait_status: Optional[int]  # zombies only


def _is_peer_failure(exc: BaseException) -> bool:
    return _chain_mentions(exc, _PEER_GONE)


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
        try:
            name = signal.Signals(sig).name
        except ValueError:
            name = str(sig)
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
        published = _published_exit(missing[0] - first)
        if published is not None:
            status = _exit_code_text(published)
        return f"rank {rank} lost peer {missing[0]} ({status})"
    if missing:
        return f"rank {rank} lost peers {', '.join(map(str, missing))} ({status})"
    return f"rank {rank} lost a peer on another node (exit unknown, signal unknown)"


# What the collective backends say when a collective waited past the process-group timeout.
_TIMED_OUT = ("timed out waiting", "collective operation timeout", "operation timed out")


def _chain_mentions(exc: BaseException, markers: tuple[str, ...]) -> bool:
    seen: set[int] = set()
    e: Optional[BaseException] = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if any(m in f"{type(e).__name__} {e}".lower() for m in markers):
            return True
        e = e.__cause__ or e.__context__
    return False


def collective_timeout_error(exc: BaseException) -> Optional[RunFailedError]:
    """The one-line error for a collective that waited past ``dist.distributed_timeout_minutes``
    in a multi-rank run, else None. (When this node's launcher has already named the hung rank,
    its line is the job's; the caller then says nothing.)"""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1 or not _chain_mentions(exc, _TIMED_OUT):
        return None
    rank = int(os.environ.get("RANK", "0"))
    return RunFailedError(
        f"rank {rank}: a collective waited longer than dist.distributed_timeout_minutes for its "
        "peers: a rank is hung or much slower (on another node, that node's launcher names it)",
        fix="find the hung rank in the other nodes' logs; raise dist.distributed_timeout_minutes "
            "if a step or save legitimately takes that long; resume from the last checkpoint",
    )


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
