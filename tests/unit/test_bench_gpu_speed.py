"""bench/gpu_speed.py's CPU-side logic: which recipes it runs on which GPU, the overrides of
each configuration, the ratios against bf16 (same compile setting) and the target verdicts.
(The plan itself runs dry on the virtual GPU in tests/e2e/test_gpu_check_script.py.)"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import gpu_speed as S

from lptrain.config import World, check, load


def test_plan_follows_the_kernel_table() -> None:
    assert S.recipes_for(90, "12.9") == ["bf16", "tensorwise", "blockwise"]
    assert S.recipes_for(90, "12.8") == ["bf16", "tensorwise"]  # blockwise needs cuBLASLt 12.9
    assert S.recipes_for(100, "12.8") == ["bf16", "tensorwise", "mxfp8", "nvfp4"]
    assert S.recipes_for(80, "12.9") == ["bf16"]


def test_every_configuration_validates_and_has_the_issue_shapes() -> None:
    ov = S.overrides_for("8b", "blockwise", True, layers=2, dry=False)
    cfg = load("tiny_cpu.yaml", ov).cfg
    m = cfg.model
    assert (m.hidden_size, m.ffn_hidden_size, m.num_layers) == (4096, 14336, 2)
    assert cfg.train.micro_batch_size * m.seq_length == 8192
    assert cfg.train.compile and cfg.precision.quantized_gemm == "scaled_mm"
    m24 = load("tiny_cpu.yaml", S.overrides_for("24x3072", "bf16", False, 2, False)).cfg.model
    assert (m24.num_layers, m24.hidden_size) == (24, 3072)
    world = World.detect(dp=1, target="sm90")
    for workload in S.WORKLOADS:
        for recipe in S.recipes_for(90, "12.9"):
            cfg = load("tiny_cpu.yaml", S.overrides_for(workload, recipe, True, 2, False)).cfg
            assert [v.rule for v in check(cfg, world) if v.severity == "error"] == [], (workload, recipe)


def test_ratios_and_targets() -> None:
    M = S.Measurement
    runs = [M("24x3072", "bf16", False, 100.0, 0.40), M("24x3072", "tensorwise", False, 135.0, 0.54),
            M("24x3072", "blockwise", False, 120.0, 0.48), M("24x3072", "bf16", True, 110.0, 0.46),
            M("24x3072", "tensorwise", True, 121.0, 0.51), M("8b", "blockwise", True, 0.0, None, "OOM")]
    r = S.ratios(runs)
    assert r[("24x3072", "tensorwise", False)] == 1.35
    assert r[("24x3072", "tensorwise", True)] == 1.1  # against the compiled bf16 run
    assert ("8b", "blockwise", True) not in r  # failed runs have no ratio
    verdicts = {name.split(" >=")[0]: met for name, met, _ in S.targets(runs, 90)}
    assert verdicts == {"FP8 tensorwise": True, "FP8 blockwise": False, "bf16 MFU": True}
    assert all(met is None for name, met, _ in S.targets(runs, 100) if name.startswith("FP8"))
    lines = S.report(runs, 90, "NVIDIA H100 80GB HBM3")
    assert any("FAILED: OOM" in ln for ln in lines)
    assert "TARGET PASS FP8 tensorwise >= 1.30x bf16 tokens/s (H100/H200): 24x3072 1.35x, 24x3072 compiled 1.10x" in lines
