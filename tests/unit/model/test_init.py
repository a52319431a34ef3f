"""Initialisation depends only on (train.seed, canonical name): not on global RNG state,
expert layout, expert-parallel size or parameter dtype."""

from __future__ import annotations

import math

import pytest
import torch
from model_helpers import hp_model, moe_overrides, tiny_cfg

from lptrain.model import build_model, canonical_state_dict
from lptrain.model.init import init_values
from lptrain.precision.layers import LayerFactory

LAYOUTS = [
    {"grouped_gemm": True, "single_grouped_weight": True},
    {"grouped_gemm": True, "single_grouped_weight": False},
    {"grouped_gemm": False, "single_grouped_weight": False},
]


def _assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_independent_of_global_rng_state() -> None:
    cfg = tiny_cfg(**moe_overrides())
    torch.manual_seed(0)
    a = canonical_state_dict(hp_model(cfg))
    torch.manual_seed(987)
    torch.randn(1000)
    b = canonical_state_dict(hp_model(cfg))
    _assert_same(a, b)


def test_seed_changes_weights() -> None:
    a = canonical_state_dict(hp_model(tiny_cfg(train__seed=1)))
    b = canonical_state_dict(hp_model(tiny_cfg(train__seed=2)))
    assert not torch.equal(a["layers.0.self_attention.linear_qkv.weight"], b["layers.0.self_attention.linear_qkv.weight"])


@pytest.mark.parametrize("layout", LAYOUTS[1:])
def test_independent_of_expert_layout(layout: dict) -> None:
    ref = canonical_state_dict(hp_model(tiny_cfg(**moe_overrides(**LAYOUTS[0]))))
    _assert_same(ref, canonical_state_dict(hp_model(tiny_cfg(**moe_overrides(**layout)))))


@pytest.mark.parametrize("ep", [2, 4])
def test_independent_of_expert_parallel_size(ep: int) -> None:
    """Each EP rank's experts equal the same global experts of the 1-rank model."""
    full = canonical_state_dict(hp_model(tiny_cfg(**moe_overrides(**LAYOUTS[0]))))
    cfg = tiny_cfg(**moe_overrides(expert_model_parallel_size=ep, **LAYOUTS[ep % 3]))
    union: dict[str, torch.Tensor] = {}
    for rank in range(ep):
        model = build_model(cfg, LayerFactory(), expert_model_parallel_rank=rank)
        sd = canonical_state_dict(model)
        for k, v in sd.items():
            if k in union and ".experts." not in k:
                assert torch.equal(union[k], v), k  # dense weights identical on every rank
            union[k] = v
    _assert_same(full, union)


def test_bf16_is_fp32_init_rounded_once() -> None:
    a = canonical_state_dict(hp_model(tiny_cfg(**moe_overrides())))
    b = canonical_state_dict(hp_model(tiny_cfg(precision__params_dtype="bf16", **moe_overrides())))
    for k in a:
        assert torch.equal(a[k].to(torch.bfloat16), b[k]), k


def test_every_weight_is_seeded_by_its_canonical_name() -> None:
    """Re-deriving each canonical tensor from (seed, key) reproduces it exactly, so the names
    used at init time are exactly the checkpoint's canonical keys."""
    cfg = tiny_cfg(**moe_overrides(moe_layer_freq=2, **LAYOUTS[0]))
    std, out_std = 0.02, 0.02 / math.sqrt(2 * cfg.model.num_layers)
    sd = canonical_state_dict(hp_model(cfg))
    for k, v in sd.items():
        if k.endswith("norm.weight"):
            assert torch.equal(v, torch.ones_like(v)), k
            continue
        s = out_std if ("linear_proj" in k or "linear_fc2" in k) else std
        assert torch.equal(v, init_values(cfg.train.seed, k, v.shape, s)), k
