"""derive(): derived values, explicit values kept, idempotence."""

from __future__ import annotations

import pytest

from lptrain.config import World, compose, derive
from lptrain.config.derive import default_bucket_size


def test_defaults_filled() -> None:
    cfg = derive(compose(None, ["model.hidden_size=96"]), World())
    assert cfg.ddp.grad_reduce_in_fp32 is True  # bf16 params
    assert cfg.ddp.bucket_size is None  # no overlap: one bucket
    assert cfg.optimizer.use_layer_wise_optimizer is False
    assert cfg.model.ffn_hidden_size == 4 * 96
    assert cfg.model.num_query_groups == cfg.model.num_attention_heads
    assert cfg.model.moe.ffn_hidden_size is None  # dense: no expert width (MOE-FFN-NEEDS-EXPERTS)
    assert cfg.precision.backend == "emulated"  # auto without CUDA
    moe = derive(compose(None, ["model.hidden_size=96", "model.moe.num_experts=4"]), World())
    assert moe.model.moe.ffn_hidden_size == 4 * 96  # experts default to the dense width


def test_fp32_params_reduce_in_param_dtype_unless_set() -> None:
    assert derive(compose(None, ["precision.params_dtype=fp32"]), World()).ddp.grad_reduce_in_fp32 is False
    cfg = compose(None, ["ddp.grad_reduce_in_fp32=false"])
    assert derive(cfg, World()).ddp.grad_reduce_in_fp32 is False


@pytest.mark.parametrize(("dp", "expected"), [(1, 40_000_000), (8, 40_000_000), (64, 64_000_000)])
def test_bucket_size_with_overlap(dp: int, expected: int) -> None:
    cfg = derive(compose(None, ["ddp.overlap_grad_reduce=true"]), World(dp=dp))
    assert cfg.ddp.bucket_size == expected == default_bucket_size(dp)
    kept = derive(compose(None, ["ddp.overlap_grad_reduce=true", "ddp.bucket_size=123"]), World(dp=dp))
    assert kept.ddp.bucket_size == 123


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (["optimizer.name=muon", "ddp.use_distributed_optimizer=true"], True),
        (["optimizer.name=muon"], False),
        (["ddp.use_distributed_optimizer=true"], False),
    ],
)
def test_muon_layerwise_derived(overrides: list[str], expected: bool) -> None:
    assert derive(compose(None, overrides), World()).optimizer.use_layer_wise_optimizer is expected


def test_explicit_values_kept_and_idempotent() -> None:
    cfg = compose(None, ["model.ffn_hidden_size=160", "model.num_query_groups=2",
                         "model.moe.num_experts=4", "model.moe.ffn_hidden_size=32",
                         "precision.backend=te"])
    world = World(dp=4, target="sm100", te_version="2.14", cuda=True)
    once = derive(cfg, world)
    assert (once.model.ffn_hidden_size, once.model.num_query_groups,
            once.model.moe.ffn_hidden_size, once.precision.backend) == (160, 2, 32, "te")
    assert derive(once, world) == once
    assert cfg.ddp.grad_reduce_in_fp32 is None  # the input is not modified


def test_auto_backend_on_a_cluster_is_te_only_for_a_quantized_recipe() -> None:
    world = World.detect(target="sm100")
    assert world.cuda and world.te_version
    fp8 = ["precision.fp8_format=e4m3", "precision.fp8_recipe=mxfp8"]
    assert derive(compose(None, fp8), world).precision.backend == "te"
    # bf16 GEMMs need no TE: plain PyTorch (the emulated backend without a recipe).
    assert derive(compose(None), world).precision.backend == "emulated"
