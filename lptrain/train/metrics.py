"""Metrics people can watch: ``metrics.jsonl`` (appended and flushed per step), console lines,
throughput, memory, MFU.

Why flush per line: a SIGKILL (OOM killer, a scheduler without grace time) must lose at most
the current step's line, and ``tail -f metrics.jsonl`` must show the run as it goes. A line is
written whole with one ``write`` call, so a kill leaves at most one torn last line, which the
resume path drops (:func:`lptrain.train.run_dir.trim_metrics`).

Two MFU figures (``lptrain.catalog.gpus`` holds the peaks): ``mfu``, model FLOPs against the
device's bf16 peak, and ``mfu_precision``, each GEMM's FLOPs against the peak of the precision
it runs in (``sum_p flops_p / peak_p`` seconds per token at peak, over the measured time), so
a run mixing bf16, FP8 and FP4 GEMMs has a meaningful utilisation. Both are ``null`` on CPU
and on devices without a known peak, rather than a made-up number.
"""

from __future__ import annotations

import contextlib
import json
import math
import resource
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, TextIO

import torch

from lptrain.catalog.gpus import GPU, gpu_for_device
from lptrain.errors import RunFailedError

if TYPE_CHECKING:
    from lptrain.train.engine import StepResult

def compute_class(cfg: Any) -> str:
    """The precision of the recipe's GEMMs: fp4 and fp8 recipes, else bf16 (the linears of
    layers kept in bf16, attention, router and head run bf16 whatever the recipe:
    :func:`layer_precision`)."""
    p = cfg.precision
    if p.fp4_format is not None:
        return "fp4"
    if p.fp8_format is not None:
        return "fp8"
    return "bf16"


def layer_precision(cfg: Any) -> Callable[[int], str]:
    """Precision of transformer layer ``i``'s (0-based) linears: the recipe's, except the
    first/last layers ``precision.first_last_layers_bf16`` keeps in bf16."""
    klass, p, n = compute_class(cfg), cfg.precision, cfg.model.num_layers
    start = p.num_layers_at_start_in_bf16 if p.first_last_layers_bf16 else 0
    end = p.num_layers_at_end_in_bf16 if p.first_last_layers_bf16 else 0
    return lambda i: "bf16" if i < start or i >= n - end else klass


def device_gpu(device: torch.device) -> Optional[GPU]:
    """The catalog entry of ``device`` (:mod:`lptrain.catalog.gpus`), or None (CPU, unknown)."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    return gpu_for_device(torch.cuda.get_device_name(device))


def peak_flops(device: torch.device, klass: str) -> float | None:
    """Dense peak FLOP/s of ``device`` for ``klass`` GEMMs, or None (CPU, unknown GPU)."""
    gpu = device_gpu(device)
    return gpu.peak_flops(klass) if gpu is not None else None


def seconds_at_peak(flops: dict[str, float], gpu: Optional[GPU]) -> float | None:
    """Seconds per token if every GEMM ran at the peak of its own precision
    (``sum_p flops_p / peak_p``), or None when a precision in use has no known peak."""
    if gpu is None:
        return None
    total = 0.0
    for precision, f in flops.items():
        if not f:
            continue
        peak = gpu.peak_flops(precision)
        if peak is None:
            return None
        total += f / peak
    return total


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
                    self.records.append(_light(json.loads(line)))
                except ValueError:
                    continue
        self._f: TextIO = path.open("a")

    def write(self, rec: dict[str, Any]) -> None:
        """Append one line; a filesystem error (a full disk) is :class:`RunFailedError`
        naming the file (exit 3), the lines before it stay as written."""
        self.records.append(_light(rec))
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


def _light(rec: Any) -> Any:
    """A line as kept in memory for the summary: without its per-operand statistics (tens of
    kilobytes per interval on a large model; they stay in the file)."""
    if isinstance(rec, dict) and "numerics" in rec:
        return {k: v for k, v in rec.items() if k != "numerics"}
    return rec


@dataclass(frozen=True)
class StepMeter:
    """Turns one step's result and time into its ``metrics.jsonl`` line; the keys and their
    order are what readers of the file (and the tests) expect."""

    tokens_per_step: int
    flops_per_token: float
    peak_flops: Optional[float]  # the device's bf16 peak; None: no MFU
    world_size: int
    device: torch.device
    seconds_at_peak: Optional[float] = None  # per token, each GEMM at its precision's peak

    @classmethod
    def for_run(cls, cfg: Any, device: torch.device, world_size: int) -> StepMeter:
        """The meter of a run of ``cfg`` on ``device``: its FLOPs per token (in total and
        by GEMM precision) against the catalog's peaks for that device."""
        from lptrain.model.flops import flops_by_precision, flops_per_token

        t, m = cfg.train, cfg.model
        gpu = device_gpu(device)
        return cls(t.global_batch_size * m.seq_length, flops_per_token(m).total,
                   gpu.peak_flops("bf16") if gpu is not None else None, world_size, device,
                   seconds_at_peak(flops_by_precision(m, layer_precision(cfg)), gpu))

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
            "mfu_precision": (self.seconds_at_peak * tps / self.world_size
                              if self.seconds_at_peak else None),
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
    if rec.get("mfu_precision") is not None:
        parts.append(f"MFU at GEMM precision {100 * rec['mfu_precision']:.1f}%")
    if "val_loss" in rec:
        parts.append(f"val loss {rec['val_loss']:.4f}")
    if rec.get("skipped"):
        parts.append("SKIPPED (non-finite)")
    return " | ".join(parts)
