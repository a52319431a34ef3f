"""Buffer layout properties, without processes: coverage, alignment, padding, buckets."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from lptrain.config import World, derive
from lptrain.config.compose import load
from lptrain.distributed.layout import (
    BUCKET_END_ALIGN,
    PARAM_START_ALIGN,
    BufferKey,
    ParamSpec,
    param_specs,
    plan_layout,
)

DENSE = BufferKey(torch.bfloat16, torch.float32, quantized=False, is_expert=False, is_muon=False)
EXPERT = BufferKey(torch.bfloat16, torch.float32, quantized=False, is_expert=True, is_muon=False)


def _check(layout, specs) -> None:
    """Every param exactly once, inside its bucket, no overlaps, rules of the layout."""
    names = [s.name for s in specs]
    seen = [p.name for b in layout.buffers for p in b.params]
    assert sorted(seen) == sorted(names)
    for buf in layout.buffers:
        spans = sorted((p.start, p.end) for p in buf.params)
        for (_, e0), (s1, _) in itertools.pairwise(spans):
            assert e0 <= s1, "params overlap"
        for p in buf.params:
            bucket = buf.buckets[p.bucket]
            assert bucket.start <= p.start < p.end <= bucket.end
            assert p.end - p.start == math.prod(p.shape)
            if buf.sharded:
                assert p.start % PARAM_START_ALIGN == 0
        for b in buf.buckets:
            assert b.numel_unpadded == sum(math.prod(p.shape) for p in buf.params if p.bucket == b.index)
            if buf.sharded:
                assert b.numel % math.lcm(layout.dp, BUCKET_END_ALIGN) == 0
            else:
                assert b.padding == 0
        for b in buf.buckets:  # the shards of a bucket tile it exactly, each param counted once
            n = layout.dp if buf.sharded else 1
            ranges = [buf.shard_range(b, r, n) for r in range(n)]
            assert ranges[0][0] == b.start and ranges[-1][1] == b.end
            assert all(x[1] == y[0] for x, y in itertools.pairwise(ranges))
            for p in buf.params:
                if p.bucket == b.index:
                    assert sum(buf.overlap(b, p, r, n) for r in range(n)) == p.end - p.start
        for a, b in itertools.pairwise(buf.buckets):
            assert a.end == b.start


def _random_specs(seed: int, n: int = 40) -> list[ParamSpec]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        shape = (int(torch.randint(1, 300, (1,), generator=g)), int(torch.randint(1, 70, (1,), generator=g)))
        key = EXPERT if i % 5 == 0 else DENSE
        out.append(ParamSpec(f"p{i}", shape, key, shared_embedding=(i == 0)))
    return out


@pytest.mark.parametrize("dp", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("sharded", [False, True])
@pytest.mark.parametrize("bucket_size", [None, 5000, 20000])
def test_layout_rules_hold(dp: int, sharded: bool, bucket_size) -> None:
    specs = _random_specs(dp * 7 + (bucket_size or 0))
    layout = plan_layout(specs, dp=dp, bucket_size=bucket_size, sharded=sharded)
    _check(layout, specs)
    assert {b.key for b in layout.buffers} == {DENSE, EXPERT}
    if bucket_size is None:
        assert all(len(b.buckets) == 1 or any(p.name == "p0" for p in b.params) for b in layout.buffers)


def test_reverse_registration_order_and_bucket_size() -> None:
    specs = [ParamSpec(f"p{i}", (100,), DENSE) for i in range(10)]
    layout = plan_layout(specs, dp=1, bucket_size=250, sharded=False)
    (buf,) = layout.buffers
    assert [p.name for p in buf.params] == [f"p{i}" for i in reversed(range(10))]
    assert [b.params for b in buf.buckets] == [
        ("p9", "p8", "p7"), ("p6", "p5", "p4"), ("p3", "p2", "p1"), ("p0",)
    ]


def test_tied_embedding_gets_its_own_bucket() -> None:
    specs = [ParamSpec("emb", (64, 32), DENSE, shared_embedding=True)] + [
        ParamSpec(f"w{i}", (32, 32), DENSE) for i in range(3)
    ]
    layout = plan_layout(specs, dp=2, bucket_size=None, sharded=True)
    (buf,) = layout.buffers
    emb_bucket = buf.buckets[layout.slot("emb").bucket]
    assert emb_bucket.params == ("emb",)
    # without the distributed optimizer there is no reason to isolate it
    flat = plan_layout(specs, dp=2, bucket_size=None, sharded=False)
    assert len(flat.buffers[0].buckets) == 1


def test_muon_buffers_are_never_sharded() -> None:
    muon = BufferKey(torch.bfloat16, torch.float32, quantized=False, is_expert=False, is_muon=True)
    specs = [ParamSpec("a", (33, 7), muon), ParamSpec("b", (5,), DENSE)]
    layout = plan_layout(specs, dp=4, bucket_size=None, sharded=True)
    by_key = {b.key: b for b in layout.buffers}
    assert not by_key[muon].sharded and by_key[muon].numel == 33 * 7
    assert by_key[DENSE].sharded and by_key[DENSE].numel % math.lcm(4, 128) == 0


def _model_specs(recipe: str, overrides: list[str]) -> list[ParamSpec]:
    from lptrain.model import build_model

    cfg = derive(load(recipe, overrides).cfg, World(dp=1))
    with torch.device("meta"):
        model = build_model(cfg, device="meta")
    return param_specs(list(model.named_parameters()), grad_reduce_in_fp32=True)


@pytest.mark.parametrize("dp", [2, 8, 64])
def test_padding_under_one_percent_tiny_and_1b(dp: int) -> None:
    """The issue's bound: buffer padding under 1% of the elements, for tiny_cpu and a 1B GPT."""
    tiny = _model_specs("tiny_cpu.yaml", [])
    one_b = _model_specs("tiny_cpu.yaml", [
        "model.num_layers=16", "model.hidden_size=2048", "model.num_attention_heads=16",
        "model.ffn_hidden_size=5632", "model.vocab_size=50304",
    ])
    assert 0.9e9 < sum(s.numel for s in one_b) < 1.5e9
    for specs, bucket in ((tiny, None), (one_b, 40_000_000)):
        layout = plan_layout(specs, dp=dp, bucket_size=bucket, sharded=True)
        _check(layout, specs)
        assert layout.padding_percent() < 1.0, layout.report()
