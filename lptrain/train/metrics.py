"""Metrics people can watch: ``metrics.jsonl`` (appended and flushed per step), console lines,
throughput, memory, MFU.

Why flush per line: a SIGKILL (OOM killer, a scheduler without grace time) must lose at most
the current step's line, and ``tail -f metrics.jsonl`` must show the run as it goes. A line is
written whole with one ``write`` call, so a kill leaves at most one torn last line, which the
resume path drops (:func:`lptrain.train.run_dir.trim_metrics`).

MFU is reported only where the device's peak is known for the compute dtype (a small table of
datacenter GPUs); on CPU and unknown devices it is ``null`` rather than a made-up number.
"""

from __future__ import annotations

import contextlib
import json
import math
import resource
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, TextIO

import torch

from lptrain.errors import RunFailedError

if TYPE_CHECKING:
    from lptrain.train.engine import StepResult

# Dense peak TFLOP/s per device name fragment and compute class (bf16, fp8, fp4).
_PEAK_TFLOPS: dict[str, dict[str, float]] = {
    "H100": {"bf16": 989.0, "fp8": 1979.0},
    "H200": {"bf16": 989.0, "fp8": 1979.0},
    "B200": {"bf16": 2250.0, "fp8": 4500.0, "fp4": 9000.0},
    "GB200": {"bf16": 2500.0, "fp8": 5000.0, "fp4": 10000.0},
    "A100": {"bf16": 312.0},
}


def compute_class(cfg: Any) -> str:
    """Which peak applies: fp4 and fp8 GEMM recipes, else bf16 (fp32 params still run bf16-class
    peaks only on tensor cores; MFU is then an upper-bound convention)."""
    p = cfg.precision
    if p.fp4_format is not None:
        return "fp4"
    if p.fp8_format is not None:
        return "fp8"
    return "bf16"


def peak_flops(device: torch.device, klass: str) -> float | None:
    """Peak FLOP/s of ``device`` for ``klass``, or None (CPU, unknown GPU)."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name(device)
    for frag in sorted(_PEAK_TFLOPS, key=len, reverse=True):
        if frag in name:
            table = _PEAK_TFLOPS[frag]
            value = table.get(klass)
            return value * 1e12 if value is not None else None
    return None


def memory_gib(device: torch.device) -> float:
    """Peak memory so far: CUDA max allocated on GPUs, process peak RSS on CPU."""
    if device.type == "cuda" and torch.cuda.is_available():
        return torch.cuda.max_memory_allocated(device) / 2**30
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return rss / (2**30 if sys.platform == "darwin" else 2**20)


def finite_or_none(x: float) -> float | None:
    """JSON has no NaN/Inf: a non-finite value is written as null."""
    return x if math.isfinite(x) else None


class MetricsWriter:
    """Appends one JSON object per line to ``metrics.jsonl`` and flushes it at once."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.records: list[dict[str, Any]] = []
        if path.exists():  # resumed: keep the earlier part of the run (already trimmed)
            for line in path.read_text().splitlines():
                try:
                    self.records.append(json.loads(line))
                except ValueError:
                    continue
        self._f: TextIO = path.open("a")

    def write(self, rec: dict[str, Any]) -> None:
        """Append one line; a filesystem error (a full disk) is :class:`RunFailedError`
        naming the file (exit 3), the lines before it stay as written."""
        self.records.append(rec)
        try:
            self._f.write(json.dumps(rec) + "\n")
            self._f.flush()
        except OSError as e:
            raise RunFailedError(f"cannot append step {rec.get('step')} to {self.path}: "
                                 f"{e.strerror or e}", fix=_FS_FIX) from None

    def close(self) -> None:
        with contextlib.suppress(OSError):  # a failed write already said so
            self._f.close()


_FS_FIX = "free space on that filesystem or make the run folder writable, then resume"


@dataclass(frozen=True)
class StepMeter:
    """Turns one step's result and time into its ``metrics.jsonl`` line; the keys and their
    order are what readers of the file (and the tests) expect."""

    tokens_per_step: int
    flops_per_token: float
    peak_flops: Optional[float]  # of the device, for the compute class; None: no MFU
    world_size: int
    device: torch.device

    def record(self, step: int, res: StepResult, step_time_s: float,
               consumed_samples: int) -> dict[str, Any]:
        tps = self.tokens_per_step / step_time_s
        peak = self.peak_flops
        rec: dict[str, Any] = {
            "step": step,
            "loss": finite_or_none(res.loss),
            "lr": next(iter(res.lrs.values())),
            "lrs": res.lrs,
            "grad_norm": finite_or_none(res.grad_norm),
            "tokens_per_s": tps,
            "step_time_s": step_time_s,
            "mem_gib": memory_gib(self.device),
            "mfu": self.flops_per_token * tps / (peak * self.world_size) if peak else None,
            "consumed_samples": consumed_samples,
            **res.extra,
        }
        if res.skipped:
            rec["skipped"] = True
        return rec


def format_log_line(rec: dict[str, Any], total_steps: int, tokens_per_s: float, step_time_s: float) -> str:
    """One console line: step, loss, lr per group, grad norm, tokens/s, step time, memory."""
    loss = rec.get("loss")
    parts = [f"step {rec['step']}/{total_steps}", f"loss {loss:.4f}" if loss is not None else "loss n/a"]
    lrs = rec.get("lrs") or {"lr": rec.get("lr")}
    parts.append("lr " + " ".join(f"{k}={v:.3e}" for k, v in lrs.items()))
    gn = rec.get("grad_norm")
    parts.append(f"grad norm {gn:.3f}" if gn is not None else "grad norm n/a")
    parts.append(f"{tokens_per_s:,.0f} tokens/s")
    parts.append(f"{step_time_s * 1000:.0f} ms/step")
    parts.append(f"mem {rec.get('mem_gib', 0.0):.2f} GiB")
    if rec.get("mfu") is not None:
        parts.append(f"MFU {100 * rec['mfu']:.1f}%")
    if "val_loss" in rec:
        parts.append(f"val loss {rec['val_loss']:.4f}")
    if rec.get("skipped"):
        parts.append("SKIPPED (non-finite)")
    return " | ".join(parts)
