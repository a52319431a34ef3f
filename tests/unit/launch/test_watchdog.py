"""The hung-rank watchdog and the rank side of it (issue 43, failure 2 and a smaller item), on
small real processes instead of training ranks:

* a rank stuck on the host outside any collective while its peer waits inside one is the one
  named (a host-side hang between collectives), a stopped one before any other, and the
  watchdog kills every rank it watches;
* nothing is named before a rank has started training, nor a rank that moves or has exited;
* a rank publishes its counters through the wrapped ``torch.distributed`` collectives;
* a rank dies with its launcher: SIGKILL the parent and the child gets SIGTERM.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lptrain.distributed.progress import HEADER, SLOT, STATE_FIRED, Slot, read_slots
from lptrain.launch.watchdog import Watchdog, choose_hung, describe_hang

# A stand-in rank: writes its slot (pid, timeout, ticks, step, in_collective, rank, world) and
# then hangs, inside or outside "a collective".
_RANK = """
import os, sys, mmap, time
from lptrain.distributed.progress import HEADER, SLOT
path, index, step, inside = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
with open(path, "r+b") as f:
    buf = mmap.mmap(f.fileno(), 0)
SLOT.pack_into(buf, HEADER.size + index * SLOT.size, os.getpid(), 2000, 7 + index, step, inside,
               index, 2)
print("ready", flush=True)
time.sleep(120)
"""


def _rank(dog: Watchdog, index: int, step: int, inside: bool) -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, "-c", _RANK, str(dog.path), str(index), str(step),
                          str(int(inside))], stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "ready"
    return p


@pytest.fixture
def dog() -> Watchdog:
    d = Watchdog(2)
    yield d
    d.close()


def _stop(*procs: subprocess.Popen) -> None:
    for p in procs:
        with contextlib.suppress(OSError):
            p.kill()
        p.wait()


def test_host_side_hang_is_named_and_every_rank_killed(dog: Watchdog) -> None:
    waiting, hung = _rank(dog, 0, 3, inside=True), _rank(dog, 1, 3, inside=False)
    try:
        t0 = time.monotonic()
        assert dog.check(t0) is None  # first look: counters just seen
        assert dog.check(t0 + 1.0) is None  # 2 s timeout, less its margin: not yet
        line = dog.check(t0 + 1.6)
        assert line is not None and line.startswith(f"rank 1 (pid {hung.pid}, step 3, outside any "
                                                    "collective (a host-side hang)) of 2 made no "
                                                    "progress for 2 s")
        assert "(dist.distributed_timeout_minutes=0.0333333)" in line
        assert HEADER.unpack_from(dog.buf, 0)[0] == STATE_FIRED  # the ranks stay silent
        assert waiting.wait(10) == -signal.SIGKILL and hung.wait(10) == -signal.SIGKILL
    finally:
        _stop(waiting, hung)


def test_stopped_rank_first_and_nothing_before_training(dog: Watchdog) -> None:
    starting, stopped = _rank(dog, 0, 0, inside=False), _rank(dog, 1, 5, inside=True)
    os.kill(stopped.pid, signal.SIGSTOP)
    deadline = time.monotonic() + 10
    while _state(stopped.pid) != "T" and time.monotonic() < deadline:  # delivered
        time.sleep(0.01)
    try:
        t0 = time.monotonic()
        dog.check(t0)
        line = dog.check(t0 + 10)  # rank 0 has not trained a step: not armed
        assert line is not None and line.startswith(f"rank 1 (pid {stopped.pid}, step 5, stopped by a signal")
        assert " of 2 " in line and "rank 0" not in line
    finally:
        _stop(starting, stopped)


def test_moving_or_exited_ranks_are_not_named(dog: Watchdog) -> None:
    gone, moving = _rank(dog, 0, 4, inside=False), _rank(dog, 1, 4, inside=False)
    _stop(gone)  # finished and reaped: its slot stays, the process does not
    try:
        t0 = time.monotonic()
        dog.check(t0)
        for i in range(1, 6):  # rank 1 moves between every two looks
            SLOT.pack_into(dog.buf, HEADER.size + SLOT.size, moving.pid, 2000, 100 + i, 4, 0, 1, 2)
            assert dog.check(t0 + 2.0 * i) is None
        assert moving.poll() is None
    finally:
        _stop(moving)


def test_choose_hung_prefers_outside_then_fewest_ticks() -> None:
    def slot(ticks: int, inside: bool) -> Slot:
        return Slot(100, 60000, ticks, 3, inside, 0, 4)

    slots = {0: slot(10, True), 1: slot(9, True), 2: slot(9, True), 3: slot(10, False)}
    stale = dict.fromkeys(slots, 61.0)
    assert choose_hung(slots, stale, {}) == [3]  # outside any collective
    del stale[3]
    assert choose_hung(slots, stale, {}) == [1, 2]  # furthest behind
    line = describe_hang([1, 2], {r: Slot(100 + r, 60000, 9, 3, True, r, 4) for r in slots}, stale, {})
    assert line.startswith("ranks 1 (pid 101, step 3, waiting inside a collective")
    assert ", 2 (pid 102," in line and "of 4 made no progress for 61 s" in line


_PUBLISH = """
import mmap, os
import torch, torch.distributed as dist
from lptrain.distributed.progress import mark_step, publish, read_slots
assert publish(90.0)
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
mark_step(3)
dist.all_reduce(torch.ones(1))
dist.barrier()
with open(os.environ["LPTRAIN_PROGRESS_FILE"], "rb") as f:
    buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
print(read_slots(buf, 2)[1])
"""


def test_a_rank_publishes_through_its_collectives(dog: Watchdog) -> None:
    """Local rank 1 of a 2-slot file (a one-process gloo world): its pid, the timeout, step 3,
    and two ticks per collective (in and out) after the step's one."""
    env = {**os.environ, "LPTRAIN_PROGRESS_FILE": str(dog.path), "RANK": "1", "WORLD_SIZE": "2",
           "LOCAL_RANK": "1"}
    r = subprocess.run([sys.executable, "-c", _PUBLISH], env=env, capture_output=True, text=True,
                       timeout=120, check=False)
    assert r.returncode == 0, r.stderr[-2000:]
    got = r.stdout.strip().splitlines()[-1]
    assert got.startswith("Slot(pid=") and got.endswith(
        "timeout_ms=90000, ticks=5, step=3, in_collective=False, rank=1, world=2)"), got
    assert read_slots(dog.buf, 2)[0].pid == 0  # slot 0 untouched


_PARENT = """
import os, subprocess, sys
os.environ["LPTRAIN_LAUNCHER_PID"] = str(os.getpid())
child = subprocess.Popen([sys.executable, "-c", sys.argv[1]], stdout=sys.stdout)
child.wait()
"""
_CHILD = """
import os, signal, sys, time
from lptrain.distributed.orphans import die_with_launcher
signal.signal(signal.SIGTERM, lambda *a: sys.exit(143))
assert die_with_launcher()
print(os.getpid(), flush=True)
time.sleep(120)
"""


def _state(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return None


def _running(pid: int) -> bool:
    return _state(pid) not in (None, "Z")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's")
def test_a_rank_dies_with_its_launcher() -> None:
    """SIGKILL the launcher: its rank gets SIGTERM (it used to run on under PID 1)."""
    parent = subprocess.Popen([sys.executable, "-c", _PARENT, _CHILD], stdout=subprocess.PIPE, text=True)
    child = int(parent.stdout.readline())  # the request is in place
    parent.kill()
    parent.wait()
    deadline = time.monotonic() + 20
    while _running(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    alive = _running(child)
    if alive:
        os.kill(child, signal.SIGKILL)
    assert not alive, "the rank outlived its launcher"


def test_a_rank_whose_launcher_died_first_stops_at_once() -> None:
    """The launcher died before the rank's request took effect: the rank stops itself."""
    code = _CHILD.replace("print(os.getpid(), flush=True)", "print('asked', flush=True)")
    env = {**os.environ, "LPTRAIN_LAUNCHER_PID": "999999999"}  # not this process's parent
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=60, check=False)
    assert r.returncode == 143 and "asked" not in r.stdout, (r.returncode, r.stdout, r.stderr[-1000:])
