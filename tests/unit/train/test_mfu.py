"""MFU against the bf16 peak and against each GEMM's own precision, counted by hand on the
tiny model; and the one GPU table the MFU, the memory planner and the virtual GPU read.

Hand count (configs/model/tiny.yaml: 2 layers, h 64, 4 heads of 16, 4 groups, SwiGLU 256,
vocab 259, seq 128), training FLOPs per token = 6 x GEMM weights + attention:
per layer QKV 64*(4+2*4)*16 = 12288, projection 4*16*64 = 4096, MLP 3*64*256 = 49152, so
the linears are 6 * 2 * 65536 = 786432; the head 6 * 64 * 259 = 99456; attention's two score
GEMMs 12 * 2 * 128 * 64 / 2 = 98304 (causal). Peaks: the catalog's B200 (bf16 2250, FP8
4500, FP4 9000 TFLOP/s dense).
"""

from __future__ import annotations

import math

import pytest
import torch

from lptrain.catalog.gpus import GPUS, gpu_for_device, gpu_for_target
from lptrain.config import compose
from lptrain.train import metrics
from lptrain.train.engine import StepResult

LINEARS, HEAD, ATTENTION = 786432.0, 99456.0, 98304.0
LAYER = LINEARS / 2
B200 = gpu_for_target("sm100")


def _meter(overrides: list[str], monkeypatch: pytest.MonkeyPatch) -> metrics.StepMeter:
    monkeypatch.setattr(metrics, "device_gpu", lambda device: B200)
    cfg = compose("tiny_cpu.yaml", overrides)
    return metrics.StepMeter.for_run(cfg, torch.device("cpu"), world_size=1)


CASES = {
    # recipe overrides -> {precision: FLOPs per token}
    "bf16": ([], {"bf16": LINEARS + HEAD + ATTENTION}),
    "fp8": (["precision.fp8_format=e4m3", "precision.fp8_recipe=tensorwise"],
            {"fp8": LINEARS, "bf16": HEAD + ATTENTION}),
    "nvfp4": (["precision.fp4_format=e2m1"], {"fp4": LINEARS, "bf16": HEAD + ATTENTION}),
    "nvfp4, last layer bf16": (["precision.fp4_format=e2m1", "precision.first_last_layers_bf16=true",
                                "precision.num_layers_at_start_in_bf16=0",
                                "precision.num_layers_at_end_in_bf16=1"],
                               {"fp4": LAYER, "bf16": LAYER + HEAD + ATTENTION}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_precision_aware_mfu_is_the_hand_count(case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    overrides, flops = CASES[case]
    meter = _meter(overrides, monkeypatch)
    res = StepResult(loss=1.0, grad_norm=1.0, lrs={"g": 1e-3})
    rec = meter.record(1, res, step_time_s=0.5, consumed_samples=8)
    tps = 8 * 128 / 0.5  # tokens per step / step time
    peaks = {"bf16": 2250e12, "fp8": 4500e12, "fp4": 9000e12}
    want = sum(f / peaks[p] for p, f in flops.items()) * tps
    assert math.isclose(rec["mfu_precision"], want, rel_tol=1e-12), (rec["mfu_precision"], want)
    # the bf16-peak figure counts every FLOP against the bf16 peak, whatever the recipe
    assert math.isclose(rec["mfu"], (LINEARS + HEAD + ATTENTION) * tps / 2250e12, rel_tol=1e-12)


def test_no_mfu_without_a_known_peak(monkeypatch: pytest.MonkeyPatch) -> None:
    """CPU, or a GPU whose FP4 peak is unknown running FP4 GEMMs: null, not a made-up number."""
    cpu = metrics.StepMeter.for_run(compose("tiny_cpu.yaml"), torch.device("cpu"), 1)
    rec = cpu.record(1, StepResult(1.0, 1.0, {"g": 1e-3}), 0.5, 8)
    assert rec["mfu"] is None and rec["mfu_precision"] is None
    h100 = gpu_for_target("sm90")
    monkeypatch.setattr(metrics, "device_gpu", lambda device: h100)
    cfg = compose("tiny_cpu.yaml", ["precision.fp4_format=e2m1"])
    rec = metrics.StepMeter.for_run(cfg, torch.device("cpu"), 1).record(
        1, StepResult(1.0, 1.0, {"g": 1e-3}), 0.5, 8)
    assert rec["mfu"] is not None and rec["mfu_precision"] is None


def test_one_gpu_table_for_mfu_memory_and_the_virtual_gpu() -> None:
    from lptrain.cli.estimate_memory import GPU_MEMORY_GIB, default_gpu_memory_gib
    from lptrain.testing.fake_gpu import GPUS as VIRTUAL

    for target in ("sm89", "sm90", "sm100", "sm120"):
        g = gpu_for_target(target)
        assert g is not None
        assert default_gpu_memory_gib(target) == g.memory_gib == GPU_MEMORY_GIB[target]
        assert VIRTUAL[target] == (g.capability, g.device_name)
        assert gpu_for_device(g.device_name) is g  # the virtual GPU's name finds its peaks
    assert gpu_for_device("NVIDIA GB200").match == "GB200"  # not B200: the longest match
    assert gpu_for_device("Some Other GPU") is None
    assert all(set(g.peak_tflops) <= {"bf16", "fp8", "fp4"} for g in GPUS)
