"""Model initialisation is identical on every rank (the data-parallel engine relies on it).

Each rank builds ``build_model`` from a composed tiny config with the same ``train.seed``
after seeding/consuming its global RNG differently (init must depend only on the seed and
the parameter names, not on process state). The ranks exchange sha256 digests of their
canonical state dicts (``all_gather_object``) and must agree bitwise:

* dense tiny model (bf16 params, ``tiny_cpu.yaml``);
* MoE with ``single_grouped_weight`` on rank 0 and discrete expert weights on rank 1,
  compared in canonical (per-expert) form;
* the same MoE with MXFP8 quantized primary weights (``fp8_param_gather``): the quantized
  members' raw buffers must agree too.

Negative control: another ``train.seed`` on one rank gives other digests.
"""

from __future__ import annotations

import hashlib
from typing import Any

import pytest
import torch
import torch.distributed as dist

from lptrain.testing.dist import run_distributed

pytestmark = pytest.mark.dist

MOE = [
    "model.moe.num_experts=4",
    "model.moe.router_topk=2",
    "model.moe.ffn_hidden_size=64",
    "model.moe.grouped_gemm=true",
]
MXFP8_PARAMS = [
    "precision.fp8_format=e4m3",
    "precision.fp8_recipe=mxfp8",
    "precision.fp8_param_gather=true",
    "precision.backend=emulated",
]


def _digest(t: torch.Tensor) -> str:
    """sha256 over dtype, shape and raw bytes; quantized tensors: every raw buffer and the
    kept high-precision init value."""
    h = hashlib.sha256(f"{t.dtype}|{tuple(t.shape)}|{type(t).__name__}".encode())
    views = getattr(t, "storage_views", None)
    buffers = dict(sorted(views().items())) if callable(views) else {"data": t}
    init_value = getattr(t, "high_precision_init_value", None)
    hp = init_value() if callable(init_value) else None
    if hp is not None:  # the value fp32 master weights are seeded from must agree too
        buffers["high_precision_init_value"] = hp
    for name, buf in buffers.items():
        b = buf.detach().contiguous()
        h.update(f"{name}|{b.dtype}|{tuple(b.shape)}".encode())
        h.update(b.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _canonical_digests(overrides: list[str], rank: int) -> dict[str, str]:
    from lptrain.config import compose
    from lptrain.model import build_model, canonical_state_dict

    torch.manual_seed(1000 + rank)  # rank-dependent process RNG state ...
    torch.randn(17 + rank)  # ... and a rank-dependent number of draws from it
    cfg = compose("tiny_cpu.yaml", overrides)
    model = build_model(cfg)
    return {k: _digest(v) for k, v in canonical_state_dict(model).items()}


def _gather(obj: Any, world_size: int) -> list[Any]:
    out: list[Any] = [None] * world_size
    dist.all_gather_object(out, obj)
    return out


def _init_rank(rank: int, world_size: int) -> dict[str, Any]:
    layout = "true" if rank % 2 == 0 else "false"  # single grouped on even ranks, discrete on odd
    cases = {
        "dense": ["train.seed=1234"],
        "moe": ["train.seed=1234", *MOE, f"model.moe.single_grouped_weight={layout}"],
        "moe_mxfp8": ["train.seed=1234", *MOE, f"model.moe.single_grouped_weight={layout}", *MXFP8_PARAMS],
        "dense_other_seed": [f"train.seed={1234 + rank}"],
    }
    return {name: _gather(_canonical_digests(ov, rank), world_size) for name, ov in cases.items()}


@pytest.fixture(scope="module")
def gathered() -> list[dict[str, Any]]:
    return run_distributed(_init_rank, 2)


@pytest.mark.parametrize("case", ["dense", "moe", "moe_mxfp8"])
def test_init_is_bitwise_identical_across_ranks(gathered: list[dict[str, Any]], case: str) -> None:
    per_rank = gathered[0][case]  # what rank 0 received from every rank
    assert gathered[1][case] == per_rank  # both ranks saw the same exchange
    d0, d1 = per_rank
    assert d0.keys() == d1.keys()
    differing = sorted(k for k in d0 if d0[k] != d1[k])
    assert not differing, f"{case}: parameters differ across ranks: {differing[:5]}"
    if case != "dense":
        assert "layers.0.mlp.experts.linear_fc1.weight.3" in d0  # canonical per-expert keys


def test_other_seed_changes_the_digests(gathered: list[dict[str, Any]]) -> None:
    d0, d1 = gathered[0]["dense_other_seed"]
    assert d0.keys() == d1.keys()
    assert all(d0[k] != d1[k] for k in d0 if "weight" in k and "norm" not in k)
