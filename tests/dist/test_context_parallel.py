"""Context parallelism through the real engine: each sequence split over the CP ranks, in every
comm type, against the runs without it; the fixes that make it right, each shown to matter;
every optimizer path over DP x CP (the distributed optimizer with FP8/FP4 param gather, ZeRO-2/3,
layer-wise Muon, MoE experts over the CP ranks); checkpoints across CP sizes; the Hugging Face
export.

Worlds: this process runs CP 1 (one rank), one spawned 2-rank world CP 2 (every comm type, the
regressions, the DP 2 and TP 2 baselines), one 4-rank world a2a+p2p at CP 4 (2 x 2), DP 4,
CP 2 x DP 2 and CP 2 x TP 2 (every case of a size in one world). Each step is the same global
batch of 4 sequences of 64 tokens at every size (128 for MXFP8: one 32-token block per chunk).

**Why not bitwise.** A CP rank computes the CP 1 model on its chunks, but three sums are cut
where CP 1 makes them whole: the attention's softmax over key blocks (the ring merges blocks by
online softmax; Ulysses and all-gather run the whole row in one kernel, but on a gathered
sequence whose fp32 reductions are blocked differently), each weight gradient (each rank's
tokens' part, rounded to the grad buffer's dtype and then summed over DP x CP), and the loss
(each rank's tokens' cross-entropy sum over the sequences' token count, summed over CP).
Measured over 6 steps: within 4e-6 relative (bf16, every comm type), 3e-5 (FP8 delayed at
CP 2 x DP 2), 5e-5 (MXFP8 + Muon at CP 2 x TP 2). ``LOSS_RTOL = 1e-3`` (the issue's bound),
ten times below the ~1e-2 by which one step moves the loss here -- the scale at which a missing
reduction, a wrong position or a lost chunk shows (the regressions below fail by far more).
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from lptrain.testing.dist import run_distributed

sys.path.insert(0, str(Path(__file__).parent))
from _hf_reexport import assert_reexport_at_one_rank_is_identical  # noqa: E402
from _cp_cases import (  # noqa: E402
    CKPT_STEPS,
    COMM_TYPES,
    MOE,
    MOE_STEPS,
    PP_STEPS,
    SMALL,
    STEPS,
    metrics,
    pretrain_run,
    run,
    world2,
    world4,
)

pytestmark = pytest.mark.dist

LOSS_RTOL = 1e-3


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("cptrain")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as every spawned rank: tiny GEMMs, and the ranks share the cores
    try:
        cp1 = run("tiny_cpu.yaml", [])
        moe1 = run("moe_mxfp8_cpu.yaml", MOE, steps=MOE_STEPS)
        two = run_distributed(world2, 2, args=(str(root),), timeout_s=600)
        shutil.copytree(root / "cp2_half", root / "cp1_from_cp2")
        shutil.copytree(root / "cp2_half", root / "cp4_from_cp2")
        four = run_distributed(world4, 4, args=(str(root),), timeout_s=600)
        pretrain_run(root / "cp1_from_cp2")
    finally:
        torch.set_num_threads(threads)
    return {"root": root, "cp1": cp1, "moe1": moe1, "two": two, "four": four}


def test_cp2_pp2_is_bitwise_cp2(runs: dict[str, Any]) -> None:
    """Pipelining a CP 2 run (PP 2: each stage's hidden states are its CP rank's chunks, the
    static shapes seq / CP) is a schedule: its losses are CP 2's, bitwise."""
    for r in runs["four"]:
        assert r["cp2pp2"]["losses"] == runs["two"][0]["cp2"]["p2p"]["losses"][:PP_STEPS]


def _assert_close(got: list[float], want: list[float]) -> None:
    assert len(got) == len(want)
    for step, (g, w) in enumerate(zip(got, want, strict=True), 1):
        assert g == pytest.approx(w, rel=LOSS_RTOL), (step, got, want)


def _same_on_every_rank(reports: list[dict[str, Any]]) -> None:
    """Every rank reports the same losses and holds the same fp32 masters (CP shards nothing)."""
    from lptrain.testing.parity import first_difference

    for r in reports[1:]:
        assert r["losses"] == reports[0]["losses"]
        assert first_difference(r["masters"], reports[0]["masters"]) is None


@pytest.mark.parametrize("comm", COMM_TYPES)
def test_cp2_matches_cp1(runs: dict[str, Any], comm: str) -> None:
    """tiny_cpu.yaml at context_parallel_size=2 on 2 ranks (cp_comm_type p2p, a2a, allgather)
    against CP 1 on 1 rank over 6 steps, within LOSS_RTOL."""
    reports = [r["cp2"][comm] for r in runs["two"]]
    _same_on_every_rank(reports)
    _assert_close(reports[0]["losses"], runs["cp1"]["losses"])
    assert reports[0]["losses"][-1] < reports[0]["losses"][0]


def test_hierarchical_cp4_matches_dp4(runs: dict[str, Any]) -> None:
    """a2a+p2p at CP 4 (hierarchical_context_parallel_sizes [2, 2]: a2a inside pairs of CP
    ranks, the ring across them) against CP 1 on 4 ranks (DP 4), and against CP 1 on 1 rank."""
    reports = [r["hierarchical"] for r in runs["four"]]
    _same_on_every_rank(reports)
    _assert_close(reports[0]["losses"], runs["four"][0]["dp4"]["losses"])
    _assert_close(reports[0]["losses"], runs["cp1"]["losses"])


def test_fp8_delayed_cp2_dp2_matches_dp2(runs: dict[str, Any]) -> None:
    """Delayed scaling at CP 2 x DP 2: amaxes reduced over the whole stage (CP included)."""
    reports = [r["cp2dp2"] for r in runs["four"]]
    assert all(r["losses"] == reports[0]["losses"] for r in reports)
    _assert_close(reports[0]["losses"], runs["two"][0]["dp2"]["losses"])


def test_mxfp8_muon_cp2_tp2_matches_tp2(runs: dict[str, Any]) -> None:
    """MXFP8 + layer-wise Muon at CP 2 x TP 2 (+ SP) against TP 2: blocks inside the chunks,
    Muon's matrices owned over DP x CP, the TP shards of each CP rank alike."""
    reports = [r["cp2tp2"] for r in runs["four"]]
    assert all(r["losses"] == reports[0]["losses"] for r in reports)
    _assert_close(reports[0]["losses"], runs["two"][0]["tp2"]["losses"])


def test_positions_per_chunk(runs: dict[str, Any]) -> None:
    """Each CP rank's logits of a fixed batch are CP 1's at its chunks' positions (a model with
    peaked attention, 0.5 init std, so positions matter from the start: at the default init
    attention is nearly uniform and a wrong position moves the first losses by ~1e-5 only).
    The regression: RoPE at 0 .. s/CP - 1 on every rank (the fix -- each chunk's true
    positions -- monkeypatched away) gives rank 1 (chunks 1 and 2) and rank 0's second chunk
    other logits, by far more than the fp32 tolerance (2e-5 of the largest logit)."""
    from _cp_cases import PEAKY, probe_logits

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        whole, _ = probe_logits([])
    finally:
        torch.set_num_threads(threads)
    scale = float(whole.abs().max())
    for r in runs["two"]:
        (got, cols), (broken, _) = r["logits"], r["no_positions"]
        assert float((got - whole[:, cols]).abs().max()) <= 2e-5 * scale
        assert float((broken - whole[:, cols]).abs().max()) > 1e-2 * scale
    assert PEAKY


def test_without_the_dp_cp_gradient_reduction_cp_ranks_drift_apart(runs: dict[str, Any]) -> None:
    """The regression: gradients reduced over DP only (the DP x CP reduction monkeypatched
    away): each CP rank steps with its own tokens' part of the gradient, so the two ranks'
    masters differ after one step; with the reduction they are bitwise equal
    (test_cp2_matches_cp1). (The loss moves less: Adam's first updates are nearly sign(g),
    and a part of the gradient mostly has the whole's signs.)"""
    from lptrain.testing.parity import first_difference

    a, b = (r["no_grad_reduction"] for r in runs["two"])
    assert first_difference(a["masters"], b["masters"]) is not None
    assert a["losses"][1:] != runs["cp1"]["losses"][1:2]


def test_delayed_scaling_amaxes_are_reduced_over_cp(runs: dict[str, Any]) -> None:
    """Delayed scaling at CP 2: every rank's scales and amax histories are the same after two
    steps (the amaxes are reduced over the stage, CP included: Megatron's amax-reduction
    group). The regression: reduced over TP x DP only (the CP part monkeypatched away), each CP
    rank scales by the amaxes of its own chunks -- a silent divergence, like the TP case."""
    from lptrain.testing.parity import first_difference

    fixed = [r["amax"] for r in runs["two"]]
    assert fixed[0] and first_difference(fixed[0], fixed[1]) is None
    broken = [r["no_amax"] for r in runs["two"]]
    assert first_difference(broken[0], broken[1]) is not None


@pytest.mark.parametrize("fmt", ["fp8", "fp4"])
def test_quantized_param_gather_over_cp_ranks_is_bitwise(runs: dict[str, Any], fmt: str) -> None:
    """The distributed optimizer shards over DP x CP, so at CP 2 the param all-gather runs
    over the CP ranks: FP8 (tensorwise bytes, gathered after the shards' amax reduction) and
    FP4 (NVFP4) primary weights train bitwise like quantizing bf16 params in the forward."""
    from lptrain.testing.parity import first_difference

    for r in runs["two"]:
        on, off = r["param_gather"][f"{fmt}_on"], r["param_gather"][f"{fmt}_off"]
        assert first_difference(on, off) is None, fmt


@pytest.mark.parametrize("strategy", ["optim_grads", "optim_grads_params"])
def test_zero2_and_zero3_over_dp_cp_are_bitwise_zero1(runs: dict[str, Any], strategy: str) -> None:
    """ZeRO-2 and ZeRO-3 (overlapped, prefetching) shard over DP x CP and train bitwise like
    ZeRO-1 there: the same reduction of the CP ranks' gradient parts, another placement."""
    from lptrain.testing.parity import first_difference

    for r in runs["two"]:
        assert first_difference(r["zero"][strategy], r["zero"]["optim"]) is None, strategy


def test_moe_with_experts_over_the_cp_ranks_matches_cp1(runs: dict[str, Any]) -> None:
    """moe_mxfp8_cpu.yaml at CP 2 x EP 2 (the expert-parallel group is the CP group: each rank
    routes its chunks' tokens to both ranks' experts; router statistics summed over CP; dense
    grads over DP x CP, expert grads over expert DP) against CP 1, EP 1."""
    reports = [r["moe"] for r in runs["two"]]
    assert reports[0]["losses"] == reports[1]["losses"]
    _assert_close(reports[0]["losses"], runs["moe1"]["losses"])


@pytest.mark.parametrize(("resumed", "note"), [("cp1_from_cp2", "saved at CP 2, resumed at CP 1"),
                                               ("cp4_from_cp2", "saved at CP 2, resumed at CP 4")])
def test_resume_at_another_cp_size_matches_the_straight_run(runs: dict[str, Any], resumed: str, note: str) -> None:
    """CP shards no weight: a CP 2 checkpoint holds the single-rank model and resumes at any CP
    size, reading the same samples (its chunks of them) from where it stopped."""
    assert runs["two"][0]["half"]["status"] == "exit_interval"
    got, want = metrics(runs["root"] / resumed), metrics(runs["root"] / "cp2_straight")
    assert [m["step"] for m in got] == list(range(1, CKPT_STEPS + 1)), note
    assert [m["consumed_samples"] for m in got] == [m["consumed_samples"] for m in want], note
    for g, w in zip(got[CKPT_STEPS // 2:], want[CKPT_STEPS // 2:], strict=True):
        assert g["loss"] == pytest.approx(w["loss"], rel=LOSS_RTOL), (note, g["step"])


def test_hf_export_of_a_cp_run_equals_the_cp1_export(runs: dict[str, Any], tmp_path: Path) -> None:
    """The CP 2 run's checkpoint, loaded by a CP 1 engine and saved again, exports to the same
    Hugging Face folder byte for byte."""
    assert_reexport_at_one_rank_is_identical(runs["root"] / "cp2_straight" / "ckpt", "tiny_cpu.yaml", SMALL, CKPT_STEPS,
                                             tmp_path)


def test_cp_runs_really_split(runs: dict[str, Any]) -> None:
    """The CP runs are context parallel (another summation order), not replicas of the CP 1
    run: their grad norms differ from CP 1's in the last bits somewhere."""
    assert runs["two"][0]["cp2"]["p2p"]["grad_norms"] != runs["cp1"]["grad_norms"]
    assert len(runs["cp1"]["losses"]) == STEPS
