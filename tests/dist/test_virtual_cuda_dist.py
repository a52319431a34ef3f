"""Two ranks on virtual CUDA devices with NCCL's device rule for every collective.

Covers both data-parallel engines (distributed optimizer with overlapped reduce-scatter and
param gather; replicated grads with all-reduce), layer-wise Muon, expert parallelism
(all-to-all), blockwise FP8 primary weights gathered as bytes, an evaluation after every step
and the loop's checkpoint save. Before the engine became device-correct, the first collective
after the first backward (``train/engine.py`` ``_gather_losses``, a CPU tensor) failed here,
as NCCL would have refused it.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from _virtual_cuda_cases import run_cases

from lptrain.testing.dist import run_distributed

pytestmark = pytest.mark.dist

CASES = {
    "distopt_overlap": ("tiny_cpu.yaml", ["ddp.use_distributed_optimizer=true",
                                          "ddp.overlap_grad_reduce=true",
                                          "ddp.overlap_param_gather=true", "ddp.bucket_size=20000"]),
    "replicated": ("tiny_cpu.yaml", ["ddp.use_distributed_optimizer=false",
                                     "ddp.overlap_grad_reduce=true", "ddp.bucket_size=20000"]),
    "layerwise_muon": ("mxfp8_muon_cpu.yaml", []),
    "expert_parallel": ("moe_mxfp8_cpu.yaml", ["model.moe.expert_model_parallel_size=2"]),
    "blockwise_bytes": ("fp8_blockwise_cpu.yaml", []),
    # pipeline parallelism: the schedule's P2P, the stages' norm terms, the MoE metrics
    "pipeline": ("tiny_cpu.yaml", ["model.pipeline_model_parallel_size=2", "ddp.use_distributed_optimizer=true"]),
    "pipeline_moe": ("moe_mxfp8_cpu.yaml", ["model.pipeline_model_parallel_size=2"]),
}


def test_engines_muon_ep_eval_and_save_on_two_virtual_gpus(tmp_path: Path) -> None:
    results = run_distributed(run_cases, 2, args=(CASES, str(tmp_path / "cache"), str(tmp_path)),
                              init_process_group=False, timeout_s=240)
    for r in results:
        assert r["violations"] == []
        assert r["loop"] == "completed"
        for name in CASES:
            losses, norms = r[name]
            assert all(math.isfinite(x) for x in (*losses, *norms)), (name, losses, norms)
    assert results[0]["expert_parallel"] == results[1]["expert_parallel"]  # losses are global
    assert {"all_reduce", "all_to_all_single"} <= set(results[0]["collectives"])
    assert (tmp_path / "ckpt" / "iter_0000002" / "COMPLETE.json").is_file()
