"""The memory planner under context parallelism: a CP rank's activations are its tokens'
(the CP 1 figure / CP), the weights, grads and optimizer states are CP 1's shards over DP x CP,
the attention's communication buffers are added per comm type; the 128k-token recipe fits."""

from __future__ import annotations

import pytest

from lptrain.config import World, compose, derive, load
from lptrain.memory.context_parallel import cp_buffer_bytes
from lptrain.memory.plan import estimate_memory

BASE = ["data.builtin_max_mb=1", "logging.progress=false", "train.micro_batch_size=2",
        "train.global_batch_size=4", "model.seq_length=64"]


def _plan(extra: list[str], dp: int = 1) -> dict[str, int]:
    cfg = derive(compose("tiny_cpu.yaml", [*BASE, *extra]), World(dp=dp))
    return estimate_memory(cfg, dp).worst.bytes


@pytest.mark.parametrize("comm", ["p2p", "a2a", "allgather"])
def test_activations_divide_by_cp_and_the_attention_buffers_are_added(comm: str) -> None:
    """CP 2 at DP 1 against DP 2 (the same 2 ranks sharding the optimizer the same way): the
    same weights, grads and states per rank; activations per rank half of one DP rank's
    (half the tokens of the same micro-batch); plus one layer's CP buffers."""
    dp2 = _plan([], dp=2)
    cp2 = _plan(["model.context_parallel_size=2", f"model.cp_comm_type={comm}"])
    for k in ("weights", "grads", "masters", "optimizer_states"):
        assert cp2[k] == dp2[k], k
    assert cp2["activations"] == pytest.approx(dp2["activations"] / 2, rel=1e-6)
    cfg = derive(compose("tiny_cpu.yaml", [*BASE, "model.context_parallel_size=2",
                                           f"model.cp_comm_type={comm}"]), World(dp=1))
    assert cp2["cp_buffers"] == cp_buffer_bytes(cfg, 4) > 0
    assert "cp_buffers" not in dp2


def test_the_128k_recipe_fits_80gb_only_with_context_parallelism() -> None:
    """fp8_tensorwise_8b_128k_cp16_tp8.yaml at DP 4 (512 GPUs) on sm90: under 80 GiB per rank;
    the same recipe at CP 1 (TP 8 alone, DP 32: 256 GPUs) does not fit."""
    gib = 1024**3
    cfg = load("fp8_tensorwise_8b_128k_cp16_tp8.yaml").cfg
    cp16 = estimate_memory(derive(cfg, World(dp=4, target="sm90")), 4, "sm90")
    assert cp16.worst.total < 80 * gib and cp16.cp == 16
    assert any("context parallel 16" in n for n in cp16.notes)
    cfg.model.context_parallel_size = 1
    cp1 = estimate_memory(derive(cfg, World(dp=32, target="sm90")), 32, "sm90")
    assert cp1.worst.total > 80 * gib
    assert cp1.worst.bytes["activations"] > 12 * cp16.worst.bytes["activations"]
