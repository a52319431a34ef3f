"""How many intra-op CPU threads a rank uses: the cores it can actually have.

PyTorch starts one OpenMP thread per physical core of the machine. On a shared machine -- a
laptop, a login node, a CI runner -- other processes hold some of those cores, and an OpenMP
region then waits at its barrier for a thread the kernel has not scheduled: 20 tiny CPU steps
took 18.4 s with the default threads and 0.9 s with one thread on a busy 2-core machine. So a
rank picks its thread count (:func:`choose_threads`) from:

* ``run.cpu_threads`` when set, else ``$OMP_NUM_THREADS`` when set (torchrun sets 1 for several
  ranks a node): the user's number is kept;
* else the CPUs this process may run on (``sched_getaffinity``: a SLURM or taskset binding),
  capped by a cgroup CPU quota (a container's ``cpu.max``), shared among the ranks of the node
  (torchrun's ``LOCAL_WORLD_SIZE``), and at most PyTorch's own default (one per physical core);
* and a single rank on the node also leaves out the cores that other processes keep busy,
  measured over :data:`SAMPLE_S` from ``/proc/stat`` on its CPUs. (Several ranks are started
  together and load each other at that moment: they take their share instead.)

:func:`apply_threads` sets it with ``torch.set_num_threads`` and says why, once, at the start
of a run. ``bench/threads.py`` measures the effect under a load it starts itself.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

SAMPLE_S = 0.1  # how long the other processes' load is measured


@dataclass(frozen=True)
class ThreadChoice:
    """The thread count and why (one line for the run log)."""

    threads: int
    why: str


def choose_threads(setting: Optional[int], env: Mapping[str, str], cpus: int, busy: Optional[float],
                   default: int, quota: Optional[float] = None) -> ThreadChoice:
    """The thread count from the user's setting, else from ``cpus`` (this process's affinity),
    the cgroup ``quota`` (CPUs' worth, None: unlimited), the node's ranks
    (``env["LOCAL_WORLD_SIZE"]``), ``busy`` (CPUs' worth other processes keep busy; None: not
    measured) and PyTorch's ``default``. Pure: the callers read the system."""
    if setting is not None:
        return ThreadChoice(setting, f"run.cpu_threads={setting}")
    if env.get("OMP_NUM_THREADS", "").strip():
        return ThreadChoice(default, f"OMP_NUM_THREADS={env['OMP_NUM_THREADS'].strip()}")
    try:
        ranks = max(1, int(env.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        ranks = 1
    usable = min(float(cpus), quota) if quota is not None else float(cpus)
    share = max(1, math.floor(usable / ranks))
    parts = [f"{cpus} CPU(s) in this process's affinity"]
    if quota is not None and quota < cpus:
        parts.append(f"a cgroup quota of {quota:g}")
    if ranks > 1:
        parts.append(f"{ranks} ranks on this node (LOCAL_WORLD_SIZE)")
    free = share
    if ranks == 1 and busy is not None:
        free = max(1, min(share, round(usable - busy)))
        parts.append(f"{busy:.1f} kept busy by other processes")
    return ThreadChoice(max(1, min(free, default)), ", ".join(parts))


def affinity_cpus() -> list[int]:
    """The CPUs this process may run on."""
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # pragma: no cover - non-Linux
        return list(range(os.cpu_count() or 1))


def cgroup_quota(root: Path = Path("/sys/fs/cgroup")) -> Optional[float]:
    """CPUs' worth of a cgroup v2 ``cpu.max`` quota (``"200000 100000"`` is 2), or None."""
    try:
        quota, period = (root / "cpu.max").read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        return None


def _cpu_times(cpus: list[int]) -> Optional[tuple[float, float]]:
    """(idle, total) jiffies summed over ``cpus`` from ``/proc/stat``, or None."""
    wanted = {f"cpu{c}" for c in cpus}
    idle = total = 0.0
    try:
        with open("/proc/stat") as f:
            for line in f:
                name, *fields = line.split()
                if name in wanted:
                    values = [float(x) for x in fields[:8]]
                    idle += values[3] + values[4]  # idle + iowait
                    total += sum(values)
    except (OSError, ValueError, IndexError):
        return None
    return (idle, total) if total else None


def busy_cpus(cpus: list[int], sample_s: float = SAMPLE_S) -> Optional[float]:
    """CPUs' worth of ``cpus`` that other processes kept busy over ``sample_s`` (this process
    sleeps meanwhile), or None where ``/proc/stat`` is not there."""
    first = _cpu_times(cpus)
    if first is None:
        return None
    time.sleep(sample_s)
    second = _cpu_times(cpus)
    if second is None or second[1] <= first[1]:
        return None
    idle, total = second[0] - first[0], second[1] - first[1]
    return len(cpus) * (1.0 - idle / total)


_TORCH_DEFAULT: list[int] = []  # PyTorch's own count, as the process started with it


def torch_default_threads() -> int:
    """PyTorch's intra-op thread count before lptrain first changed it in this process."""
    import torch

    if not _TORCH_DEFAULT:
        _TORCH_DEFAULT.append(torch.get_num_threads())
    return _TORCH_DEFAULT[0]


def apply_threads(setting: Optional[int], env: Optional[Mapping[str, str]] = None) -> Optional[str]:
    """Choose (:func:`choose_threads`) and set this process's intra-op thread count; a line
    saying so when the count is not PyTorch's default (else None)."""
    import torch

    env = os.environ if env is None else env
    if setting is None and env.get("OMP_NUM_THREADS", "").strip():
        return None  # the user's (or torchrun's) count, which PyTorch already follows
    default = torch_default_threads()
    cpus = affinity_cpus()
    measure = setting is None and env.get("LOCAL_WORLD_SIZE", "1").strip() in ("", "1")
    choice = choose_threads(setting, env, len(cpus), busy_cpus(cpus) if measure else None,
                            default, cgroup_quota())
    torch.set_num_threads(choice.threads)
    if choice.threads == default or setting is not None:
        return None
    return (f"note: {choice.threads} intra-op CPU thread(s), not PyTorch's {default}: {choice.why} "
            "(run.cpu_threads or OMP_NUM_THREADS sets it)")
