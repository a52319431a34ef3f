"""The GPUs lptrain knows: device memory and dense peak throughput per GEMM precision.

One table, read by everything that needs a hardware figure: the memory planner's default
budget per ``--target`` (``lptrain estimate-memory``), the MFU figures of a run on a GPU
(``lptrain.train.metrics``: against the bf16 peak, and against each GEMM's own precision),
and the virtual GPU of the fake GPU step (its device name and compute capability).

Peaks are dense tensor-core TFLOP/s (no 2:4 sparsity) from the vendors' datasheets; a
precision a part has no tensor-core path for is absent, and an MFU against it is ``null``
rather than a made-up number. ``target`` names the ``--target`` a part stands for: each GPU
target has one reference part (sm89: L40S, sm90: H100 SXM, sm100: B200, sm120: RTX PRO 6000
Blackwell); other parts are only looked up by the device name a run reports.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

PRECISIONS: tuple[str, ...] = ("bf16", "fp8", "fp4")


@dataclass(frozen=True)
class GPU:
    """One part: the name its driver reports, what identifies it in such a name, its
    compute capability, device memory and dense peak TFLOP/s per GEMM precision."""

    device_name: str
    match: str  # fragment of torch.cuda.get_device_name(); the longest matching one wins
    capability: tuple[int, int]
    memory_gib: float
    peak_tflops: dict[str, float] = field(default_factory=dict)
    target: Optional[str] = None  # the --target this part is the reference for

    def peak_flops(self, precision: str) -> Optional[float]:
        """Dense peak FLOP/s of a ``precision`` GEMM (bf16, fp8, fp4), or None."""
        if precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
        tflops = self.peak_tflops.get(precision)
        return tflops * 1e12 if tflops is not None else None


GPUS: tuple[GPU, ...] = (
    GPU("NVIDIA A100-SXM4-80GB", "A100", (8, 0), 80.0, {"bf16": 312.0}),
    GPU("NVIDIA L40S", "L40S", (8, 9), 48.0, {"bf16": 362.0, "fp8": 733.0}, target="sm89"),
    GPU("NVIDIA H100 80GB HBM3", "H100", (9, 0), 80.0, {"bf16": 989.0, "fp8": 1979.0}, target="sm90"),
    GPU("NVIDIA H200", "H200", (9, 0), 141.0, {"bf16": 989.0, "fp8": 1979.0}),
    GPU("NVIDIA B200", "B200", (10, 0), 192.0, {"bf16": 2250.0, "fp8": 4500.0, "fp4": 9000.0},
        target="sm100"),
    GPU("NVIDIA GB200", "GB200", (10, 0), 192.0, {"bf16": 2500.0, "fp8": 5000.0, "fp4": 10000.0}),
    # peaks not listed: no datasheet figure lptrain vouches for (MFU null, memory planned)
    GPU("NVIDIA RTX PRO 6000 Blackwell", "RTX PRO 6000", (12, 0), 96.0, target="sm120"),
)


def gpu_for_target(target: str) -> Optional[GPU]:
    """The reference part of a ``--target`` (sm89, sm90, sm100, sm120); None for cpu."""
    return next((g for g in GPUS if g.target == target), None)


def gpu_for_device(device_name: str) -> Optional[GPU]:
    """The part a device name belongs to (the longest matching fragment: GB200 before
    B200), or None for a GPU lptrain has no figures for."""
    found = [g for g in GPUS if g.match in device_name]
    return max(found, key=lambda g: len(g.match)) if found else None
