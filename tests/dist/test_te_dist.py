"""Two ranks on the TE backend (TE's own Python, kernels emulated, on virtual GPUs): TE's per-tensor and blockwise FP8
weights gathered as bytes -- each rank casts its master shard with TE's
``cast_master_weights_to_fp8`` after one MAX all-reduce of the amaxes -- and MXFP8 through the
reused grad buffer, each bitwise equal to gathering nothing (bf16 params quantized in the
forward); TE's stochastic-rounding generator (CUDA's) seeded differently per rank; and, at
PP 2, each TE weight cast once per step (the schedule's ``is_first_microbatch``).
"""

from __future__ import annotations

import pytest
from _virtual_cuda_cases import te_cases

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


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    return run_distributed(te_cases, 2, args=(CASES, str(tmp_path_factory.mktemp("cache"))),
                           init_process_group=False, timeout_s=600)


def test_te_fp8_param_gather_on_equals_off_at_dp2_and_per_rank_seeds(results: list[dict]) -> None:
    r0, r1 = results
    for fmt in ("tensorwise", "blockwise", "mxfp8"):
        assert r0[f"{fmt}_on"] == r0[f"{fmt}_off"], (fmt, r0[f"{fmt}_on"], r0[f"{fmt}_off"])
        assert r0[f"{fmt}_on"] == r1[f"{fmt}_on"]  # losses are global
    assert all(not r0[k] and not r1[k] for k in r0 if k.endswith("/violations"))
    assert r0["mxfp8_on/seed"] != r1["mxfp8_on/seed"]  # TE's SR draws differ per rank


def test_each_te_weight_is_cast_once_per_step_under_pipeline_parallelism(results: list[dict]) -> None:
    """Issue 48 finding 5 under PP 2: the schedule passes Megatron's ``is_first_microbatch``
    per micro-batch (True for each stage's first, False after), so each bf16 weight is cast
    once per step (4 micro-batches), not once per micro-batch as with ``None``."""
    for r in results:
        casts, linears = r["pp_casts"]["fixed"]
        assert linears == 4 and casts == linears, r["pp_casts"]  # one layer per stage
        casts, linears = r["pp_casts"]["unfixed"]
        assert casts == 4 * linears, r["pp_casts"]
        assert r["pp_casts"]["bitwise_as_before"], r["pp_casts"]  # losses, grad norms, params
