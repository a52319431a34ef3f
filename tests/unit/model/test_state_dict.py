"""Checkpoint layouts: single grouped <-> discrete <-> sequential convert exactly."""

from __future__ import annotations

import io
import itertools

import pytest
import torch
from model_helpers import hp_model, moe_overrides, tiny_cfg, tokens

from lptrain.model import (
    canonical_state_dict,
    from_canonical,
    load_canonical_state_dict,
    to_canonical,
)

LAYOUTS = {
    "single": {"grouped_gemm": True, "single_grouped_weight": True},
    "discrete": {"grouped_gemm": True, "single_grouped_weight": False},
    "sequential": {"grouped_gemm": False, "single_grouped_weight": False},
}


def _model(layout: str, seed: int):
    return hp_model(tiny_cfg(train__seed=seed, **moe_overrides(moe_layer_freq=2, **LAYOUTS[layout])))


def test_canonical_keys() -> None:
    sd = canonical_state_dict(_model("single", 1))
    assert "layers.0.mlp.experts.linear_fc1.weight.3" in sd
    assert sd["layers.0.mlp.experts.linear_fc1.weight.3"].shape == (256, 64)
    assert sd["layers.0.mlp.experts.linear_fc2.weight.0"].shape == (64, 128)
    assert not any(k.endswith("experts.linear_fc1.weight") for k in sd)
    assert "layers.1.mlp.linear_fc1.weight" in sd  # dense layer unchanged


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_round_trip_same_layout(layout: str) -> None:
    model = _model(layout, 1)
    sd = model.state_dict()
    back = from_canonical(to_canonical(sd), model)
    assert back.keys() == sd.keys()
    for k in sd:
        assert torch.equal(back[k], sd[k]), k


@pytest.mark.parametrize("src,dst", list(itertools.permutations(LAYOUTS, 2)))
def test_load_across_layouts(src: str, dst: str) -> None:
    """Save (canonical, through torch.save) from ``src``, load into a differently seeded
    ``dst``: identical canonical weights and bitwise identical losses."""
    a, b = _model(src, 1), _model(dst, 2)
    buf = io.BytesIO()
    torch.save(canonical_state_dict(a), buf)
    buf.seek(0)
    load_canonical_state_dict(b, torch.load(buf))
    ca, cb = canonical_state_dict(a), canonical_state_dict(b)
    assert ca.keys() == cb.keys() and all(torch.equal(ca[k], cb[k]) for k in ca)
    t = tokens()
    assert torch.equal(a(t, t)[0], b(t, t)[0])


def test_missing_expert_key_is_named() -> None:
    model = _model("single", 1)
    sd = canonical_state_dict(model)
    del sd["layers.0.mlp.experts.linear_fc2.weight.2"]
    with pytest.raises(KeyError, match=r"linear_fc2\.weight\.2"):
        from_canonical(sd, model)


def test_expert_bias_survives() -> None:
    cfg = tiny_cfg(**moe_overrides(score_function="sigmoid", enable_expert_bias=True, **LAYOUTS["single"]))
    a = hp_model(cfg)
    a.layers[0].mlp.router.expert_bias.fill_(0.25)
    b = hp_model(tiny_cfg(**moe_overrides(score_function="sigmoid", enable_expert_bias=True)))
    load_canonical_state_dict(b, canonical_state_dict(a))
    assert torch.equal(b.layers[0].mlp.router.expert_bias, torch.full((4,), 0.25))
