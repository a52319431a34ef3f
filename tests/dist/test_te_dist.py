"""Two ranks on the TE backend (TE's own Python, kernels emulated, on virtual GPUs): TE's per-tensor and blockwise FP8
weights gathered as bytes -- each rank casts its master shard with TE's
``cast_master_weights_to_fp8`` after one MAX all-reduce of the amaxes -- and MXFP8 through the
reused grad buffer, each bitwise equal to gathering nothing (bf16 params quantized in the
forward); and TE's stochastic-rounding generator (CUDA's) seeded differently per rank.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from _virtual_cuda_cases import te_param_gather_cases

from lptrain.testing.dist import run_distributed

pytestmark = pytest.mark.dist

E4M3 = ["precision.fp8_format=e4m3", "precision.first_last_layers_bf16=false"]
CASES = {
    "tensorwise_on": ("sm90", [*E4M3, "precision.fp8_recipe=tensorwise", "precision.fp8_param_gather=true"]),
    "tensorwise_off": ("sm90", [*E4M3, "precision.fp8_recipe=tensorwise"]),
    "blockwise_on": ("sm90", [*E4M3, "precision.fp8_recipe=blockwise", "precision.fp8_param_gather=true"]),
    "blockwise_off": ("sm90", [*E4M3, "precision.fp8_recipe=blockwise"]),
    "mxfp8_on": ("sm100", [*E4M3, "precision.fp8_recipe=mxfp8", "precision.fp8_param_gather=true",
                           "ddp.reuse_grad_buf_for_mxfp8_param_ag=true", "ddp.overlap_param_gather=true"]),
    "mxfp8_off": ("sm100", [*E4M3, "precision.fp8_recipe=mxfp8"]),
}


def test_te_fp8_param_gather_on_equals_off_at_dp2_and_per_rank_seeds(tmp_path: Path) -> None:
    r0, r1 = run_distributed(te_param_gather_cases, 2, args=(CASES, str(tmp_path / "cache")),
                             init_process_group=False, timeout_s=300)
    for fmt in ("tensorwise", "blockwise", "mxfp8"):
        assert r0[f"{fmt}_on"] == r0[f"{fmt}_off"], (fmt, r0[f"{fmt}_on"], r0[f"{fmt}_off"])
        assert r0[f"{fmt}_on"] == r1[f"{fmt}_on"]  # losses are global
    assert all(not r0[k] and not r1[k] for k in r0 if k.endswith("/violations"))
    assert r0["mxfp8_on/seed"] != r1["mxfp8_on/seed"]  # TE's SR draws differ per rank
