"""Run a test function on N local ``torch.distributed`` ranks (gloo, CPU, spawned processes).

Multi-process behaviour (amax MAX-reductions, data-parallel sharding, gradient all-reduce)
must be tested with real processes and real collectives: a single-process fake cannot show
a rank that reduces over the wrong group or a sampler that hands two ranks the same sample.
:func:`run_distributed` is the one way the test suites do that:

* each rank is a fresh process with one torch thread (the CI machine has 2 cores shared by
  several workers), forked from a ``forkserver`` that has imported torch and lptrain once
  (:data:`_PRELOAD`) and done nothing else (no OpenMP pool, no process group, no test state: what ``spawn`` gives,
  without paying the ~3 s torch import per rank; ``spawn`` where there is no forkserver);
* rendezvous is ``env://`` on 127.0.0.1 with a free TCP port; ``MASTER_ADDR``,
  ``MASTER_PORT``, ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK`` and ``LOCAL_WORLD_SIZE`` are set
  in every rank, so code under test can also initialise the group itself
  (``init_process_group=False``). A port taken by someone else between the probe and rank 0's
  bind (``EADDRINUSE``) makes the whole run start again on a new port;
* ``fn(rank, world_size, *args, **kwargs)`` must be picklable (a module-level function); its
  return value comes back to the parent (pickled by value, so tensors are fine);
* an exception in any rank is re-raised in the parent as :class:`RankFailedError` naming the
  rank, with the rank's traceback text in the message. The *first* failure (by time) is the
  primary one: ranks that then fail in a collective because a peer died are listed after
  it as consequences. Ranks still running a short grace period after a failure are killed;
* the whole run has a deadline (default 120 s); on expiry the ranks still running dump
  their Python stacks to stderr (``faulthandler`` on SIGUSR1), are killed, and
  :class:`DistributedTimeoutError` names them. The process group's own timeout equals the
  deadline, so blocked collectives raise instead of hanging forever;
* the process group is destroyed at the end of each rank (after a barrier, so rank 0, which
  hosts the rendezvous store, never leaves while a peer still needs it).
"""

from __future__ import annotations

import contextlib
import datetime
import multiprocessing as mp
import os
import pickle
import queue
import signal
import socket
import sys
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "DistributedTestError",
    "DistributedTimeoutError",
    "RankFailedError",
    "RankFailure",
    "find_free_port",
    "run_distributed",
]

DEFAULT_TIMEOUT_S = 120.0
_HOST = "127.0.0.1"
# How c10d's TCPStore (and Python's socket module) report a port that is already bound.
_ADDR_IN_USE = ("eaddrinuse", "address already in use", "errno 98")
_DUMP_SIGNAL = getattr(signal, "SIGUSR1", None)


def find_free_port(host: str = _HOST) -> int:
    """A TCP port on ``host`` that was free a moment ago (bind to port 0, read it, release).

    Someone else may take it before rank 0 binds it; :func:`run_distributed` retries then.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


@dataclass(frozen=True)
class RankFailure:
    """What one rank reported (or what the parent observed) when it did not succeed."""

    rank: int
    exc_type: str
    message: str
    traceback: str
    wall_time: float  # time.time() when the failure was caught (orders the failures)


class DistributedTestError(RuntimeError):
    """Base error of :func:`run_distributed`; ``failures`` lists every rank that failed,
    the primary (earliest) failure first; ``rank`` is the primary failing rank."""

    def __init__(self, summary: str, failures: Sequence[RankFailure]) -> None:
        super().__init__(summary)
        self.failures = list(failures)
        self.rank: Optional[int] = self.failures[0].rank if self.failures else None


class RankFailedError(DistributedTestError):
    """A rank raised (or its process died) while running the test function."""


class DistributedTimeoutError(DistributedTestError):
    """The run did not finish before its deadline; the unfinished ranks were killed."""

    def __init__(self, summary: str, failures: Sequence[RankFailure], unfinished: Sequence[int]) -> None:
        super().__init__(summary, failures)
        self.unfinished = list(unfinished)


@dataclass(frozen=True)
class _RankSpec:
    """Everything a rank needs; pickled into the spawned process."""

    rank: int
    world_size: int
    fn: Callable[..., Any]
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    host: str
    port: int
    backend: str
    timeout_s: float
    init_process_group: bool
    threads: int


def _rank_main(spec: _RankSpec, results: Any) -> None:
    """Body of a spawned rank: env, threads, process group, ``fn``, report, tear down."""
    import faulthandler

    if _DUMP_SIGNAL is not None:
        faulthandler.register(_DUMP_SIGNAL, all_threads=True)
    os.environ.update(
        MASTER_ADDR=spec.host,
        MASTER_PORT=str(spec.port),
        RANK=str(spec.rank),
        WORLD_SIZE=str(spec.world_size),
        LOCAL_RANK=str(spec.rank),
        LOCAL_WORLD_SIZE=str(spec.world_size),
        OMP_NUM_THREADS=str(spec.threads),
    )
    import torch
    import torch.distributed as dist

    torch.set_num_threads(spec.threads)
    with contextlib.suppress(RuntimeError):  # already set by an import that ran parallel work
        torch.set_num_interop_threads(1)
    ok = False
    try:
        if spec.init_process_group:
            dist.init_process_group(
                spec.backend,
                init_method="env://",
                rank=spec.rank,
                world_size=spec.world_size,
                timeout=datetime.timedelta(seconds=spec.timeout_s),
            )
        value = spec.fn(spec.rank, spec.world_size, *spec.args, **spec.kwargs)
        payload = pickle.dumps(value)  # by value: no shared-memory handles to a dying process
        if dist.is_initialized():
            dist.barrier()  # nobody (rank 0 hosts the store) leaves while a peer needs it
        results.put(("ok", spec.rank, payload))
        ok = True
    except BaseException as exc:  # everything (also SystemExit) is reported to the parent
        failure = RankFailure(
            rank=spec.rank,
            exc_type=type(exc).__qualname__,
            message=str(exc),
            traceback=traceback.format_exc(),
            wall_time=time.time(),
        )
        results.put(("err", spec.rank, failure))
    if ok:
        if dist.is_initialized():
            dist.destroy_process_group()
        return
    # After a failure the group is not destroyed (that can block on dead peers): flush the
    # report and leave at once, so the peers' sockets close and their collectives fail now
    # rather than at the process-group timeout.
    results.close()
    results.join_thread()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):  # best effort on the way out
            stream.flush()
    os._exit(1)


def _is_addr_in_use(failure: RankFailure) -> bool:
    text = f"{failure.message}\n{failure.traceback}".lower()
    return any(marker in text for marker in _ADDR_IN_USE)


def _stop(procs: Sequence[Any], dump_stacks: bool) -> None:
    """Dump stacks (optional), terminate, then kill whatever is still alive."""
    alive = [p for p in procs if p.is_alive()]
    if dump_stacks and _DUMP_SIGNAL is not None and alive:
        for p in alive:
            with contextlib.suppress(ProcessLookupError, TypeError):  # exited meanwhile
                os.kill(p.pid, _DUMP_SIGNAL)
        time.sleep(0.5)
    for p in alive:
        p.terminate()
    deadline = time.monotonic() + 3.0
    for p in alive:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in alive:
        if p.is_alive():
            p.kill()
            p.join(5.0)


# Imported once by the forkserver, before any rank is forked from it: torch and what nearly
# every rank imports anyway. ``torch._dynamo`` (with sympy, about 1.5 s on the CI machine) is
# imported by the first ``torch.optim.Optimizer`` a rank builds (torch wraps its methods in
# ``_disable_dynamo``); ``torch.distributed.tensor`` by the first parameter made under a device
# context. Import-only: none of these starts a thread or touches a process group.
_PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "torch.distributed.tensor",
            "torch.distributed.pipelining", "omegaconf", "lptrain.train.engine", "lptrain.testing.dist",
            "lptrain.testing.parity", "lptrain.config.compose", "lptrain.model.build", "lptrain.data"]


def _rank_context() -> Any:
    """The multiprocessing context ranks start in (see the module doc): a forkserver that
    preloads :data:`_PRELOAD` (it is started once per parent process and reused)."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


@dataclass
class _Outcome:
    results: dict[int, Any]
    failures: list[RankFailure]
    unfinished: list[int]
    timed_out: bool


def _run_once(
    ctx: Any, specs: list[_RankSpec], deadline: float, failure_grace_s: float
) -> _Outcome:
    """Start every rank, collect their reports until done, deadline or failure + grace."""
    world_size = len(specs)
    results_q = ctx.Queue()
    procs = [
        ctx.Process(target=_rank_main, args=(s, results_q), name=f"lptrain-dist-rank{s.rank}", daemon=True)
        for s in specs
    ]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    failures: dict[int, RankFailure] = {}
    first_failure_at: Optional[float] = None
    timed_out = False

    def take(item: tuple[str, int, Any]) -> None:
        nonlocal first_failure_at
        kind, rank, payload = item
        if kind == "ok":
            results[rank] = pickle.loads(payload)
        else:
            failures[rank] = payload
            if first_failure_at is None:
                first_failure_at = time.monotonic()

    try:
        while len(results) + len(failures) < world_size:
            now = time.monotonic()
            if now >= deadline:
                timed_out = True
                break
            if first_failure_at is not None:
                # An address clash is retried at once; other failures give peers a grace period
                # to report their own (consequential) errors before they are killed.
                if any(_is_addr_in_use(f) for f in failures.values()):
                    break
                if now >= first_failure_at + failure_grace_s:
                    break
            try:
                take(results_q.get(timeout=min(0.05, max(0.0, deadline - now))))
                continue
            except queue.Empty:
                pass
            for rank, p in enumerate(procs):
                if rank in results or rank in failures or p.exitcode is None:
                    continue
                # Exited: anything it sent is already in the pipe (its feeder thread was joined).
                try:
                    while True:
                        take(results_q.get(timeout=0.2))
                except queue.Empty:
                    pass
                if rank not in results and rank not in failures:
                    failures[rank] = RankFailure(
                        rank=rank,
                        exc_type="ProcessDied",
                        message=f"process exited with code {p.exitcode} without reporting a result",
                        traceback="",
                        wall_time=time.time(),
                    )
                    if first_failure_at is None:
                        first_failure_at = time.monotonic()
    finally:
        unfinished = [r for r in range(world_size) if r not in results and r not in failures]
        _stop(procs, dump_stacks=timed_out)
        results_q.close()
        results_q.join_thread()
    return _Outcome(results, sorted(failures.values(), key=lambda f: f.wall_time), unfinished, timed_out)


def _failure_report(failures: Sequence[RankFailure], world_size: int) -> str:
    primary, *others = failures
    lines = [
        f"rank {primary.rank} of {world_size} failed: {primary.exc_type}: {primary.message}",
        f"--- traceback of rank {primary.rank} ---",
        primary.traceback.rstrip(),
    ]
    for f in others:
        lines += [
            f"--- rank {f.rank} also failed (later; possibly a consequence): {f.exc_type}: {f.message}",
            f.traceback.rstrip(),
        ]
    return "\n".join(line for line in lines if line)


def run_distributed(
    fn: Callable[..., Any],
    world_size: int = 2,
    args: Sequence[Any] = (),
    kwargs: Optional[Mapping[str, Any]] = None,
    *,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    backend: str = "gloo",
    init_process_group: bool = True,
    threads: int = 1,
    port_retries: int = 3,
    failure_grace_s: float = 10.0,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` spawned gloo ranks.

    Returns the ranks' return values in rank order. Raises :class:`RankFailedError` if a rank
    raised or died (the message names the rank and carries its traceback),
    :class:`DistributedTimeoutError` if the run outlived ``timeout_s`` (the whole run,
    retries included), and ``TypeError`` up front if ``fn`` or the arguments cannot be
    pickled (``fn`` must be a module-level function of an importable module).
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    kw = dict(kwargs or {})
    try:
        pickle.dumps((fn, tuple(args), kw))
    except Exception as err:  # any pickling failure means the same thing
        raise TypeError(
            f"run_distributed: fn and its arguments must be picklable (a module-level function): {err}"
        ) from err
    ctx = _rank_context()
    deadline = time.monotonic() + timeout_s
    attempts = 0
    while True:
        attempts += 1
        port = find_free_port(_HOST)
        specs = [
            _RankSpec(r, world_size, fn, tuple(args), kw, _HOST, port, backend, timeout_s, init_process_group, threads)
            for r in range(world_size)
        ]
        out = _run_once(ctx, specs, deadline, failure_grace_s)
        if out.failures and attempts <= port_retries and any(_is_addr_in_use(f) for f in out.failures):
            continue  # port stolen between the probe and rank 0's bind: start over
        if out.timed_out:
            done = sorted(out.results)
            msg = (
                f"distributed run timed out after {timeout_s:g} s: rank(s) {out.unfinished} of "
                f"{world_size} did not finish (finished: {done}); their stacks were dumped to stderr"
            )
            if out.failures:
                msg += "\n" + _failure_report(out.failures, world_size)
            raise DistributedTimeoutError(msg, out.failures, out.unfinished)
        if out.failures:
            msg = _failure_report(out.failures, world_size)
            if out.unfinished:
                msg += f"\n--- rank(s) {out.unfinished} were still running and were killed"
            raise RankFailedError(msg, out.failures)
        return [out.results[r] for r in range(world_size)]


def launched_rank_pids(launcher: int) -> dict[int, int]:
    """``{rank: pid}`` of the rank processes a launcher (``lptrain pretrain --nproc-per-node``,
    ``torchrun``) started: its children, by their ``RANK`` variable (Linux ``/proc``). For the
    tests that kill, stop or signal one rank of a real launch."""
    out = {}
    for task in Path(f"/proc/{launcher}/task").glob("*"):
        try:
            children = (task / "children").read_text().split()
        except OSError:
            continue
        for pid in children:
            try:
                env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            except OSError:
                continue
            for item in env:
                if item.startswith(b"RANK="):
                    out[int(item[5:])] = int(pid)
    return out
