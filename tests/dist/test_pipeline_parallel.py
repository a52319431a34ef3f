"""Pipeline parallelism through the real engine and ``torch.distributed.pipelining``: bitwise
equal to the unpipelined run at the same data-parallel size.

Worlds (``model.pipeline_model_parallel_size`` 1 or 2): this process runs PP 1 (one rank), one
spawned 2-rank world PP 2 (and the DP 2 and TP 2 baselines), one 4-rank world PP 2 x DP 2 (every
case of a size in one world). Each step is the same global batch of 4 sequences at every size,
:data:`_pp_cases.STEPS` steps.

**What it costs, and what is not run.** The battery is the suite's largest fixture, so every
comparison shares its baseline: one batching (4 micro-batches of one sequence at DP 1, what
DualPipeV's ``2 PP`` needs) serves 1F1B, the three zero-bubble schedules and the uneven split, so
one PP 1 run per recipe (and one at 4 layers for interleaving and the MoE and Muon V splits) is
the baseline of all of them; the TP cases and the ones with fewer micro-batches than stages keep
2-sequence micro-batches. Not run: a separate DualPipeV baseline (it was the same model at
another batching), and the steps after the first :data:`_pp_cases.FAULT_STEPS` of the
regressions' runs with their fix removed (each parts from the fixed run by its second step:
a later difference proves nothing more; they are compared with the same steps of that run).

**Bitwise, and why it can be.** Pipelining is a schedule: every micro-batch runs the
operations of the unpipelined model on the same operands (the stages are cuts of one graph),
gradients accumulate per micro-batch in micro-batch order, the reduction of each stage's
buckets starts only after its last micro-batch, delayed scaling advances once per micro-batch
per layer, stochastic rounding draws from per-quantizer streams seeded by the rank's place
inside its stage, and the gradient norm depends on its terms only (the sharded part is an
exact binned sum, :mod:`lptrain.optim.exact_norm`). So the losses, the grad norms and every
fp32 master after 6 steps are compared with ``==`` / ``torch.equal``.

**Not bitwise: tied embeddings.** Without pipelining the head's and the lookup's gradients of
the one table are added per micro-batch, then accumulated; with pipelining each stage
accumulates its own copy's over the step and the two sums are added once (Megatron-LM's
embedding group). Same terms, another fp32 order, then BF16 weights that round the small
master differences: over 6 steps the losses stay within 4e-6 relative and the grad norms
within 2e-4 (measured), asserted at 1e-4 and 2e-3 -- the loss tolerance a hundred times below
the ~1e-2 one step moves the loss, the scale of a gradient counted twice or missed.

**Resumes across data-parallel sizes** change the order of the fp32 gradient sums (one rank
accumulating two micro-batches against an all-reduce), as without pipelining: their losses are
compared within 1e-3 relative (measured ~1e-6).
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
from _pp_cases import (
    CKPT_STEPS,
    DP_CASES,
    DP_ZB_CASES,
    FEW,
    FOUR_LAYERS,
    INTERLEAVED,
    NUMERICS,
    NVFP4_ALL,
    RECIPES,
    TIED,
    TP_CASES,
    TP_ZB_CASES,
    UNEVEN_1F1B_RECIPES,
    ZERO_BUBBLE,
    four_layers,
    metrics,
    pretrain_run,
    recipe_of,
    run,
    world2,
    world4,
)

pytestmark = pytest.mark.dist

TIED_RTOL = 1e-4
TIED_NORM_RTOL = 2e-3
RESUME_RTOL = 1e-3


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("pptrain")
    half = f"train.exit_interval={CKPT_STEPS // 2}"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as every spawned rank: tiny GEMMs, and the ranks share the cores
    try:
        pp1 = {r: run(r, [], numerics=r == NUMERICS) for r in RECIPES}
        pp1_four = {r: run(r, FOUR_LAYERS) for r in INTERLEAVED}
        tied = run("tiny_cpu.yaml", TIED)
        sr = run("nvfp4_adamw_cpu.yaml", NVFP4_ALL)
        pretrain_run(root / "pp1_straight")
        pretrain_run(root / "pp1_half", half)
        shutil.copytree(root / "pp1_half", root / "from_pp1")
        two = run_distributed(world2, 2, args=(str(root),), timeout_s=600)
        shutil.copytree(root / "pp2_half", root / "from_pp2")
        shutil.copytree(root / "pp2_half", root / "pp1_from_pp2")
        four = run_distributed(world4, 4, args=(str(root),), timeout_s=600)
        shutil.copytree(root / "pp2dp2_half", root / "pp1_from_pp2dp2")
        pretrain_run(root / "pp1_from_pp2")
        pretrain_run(root / "pp1_from_pp2dp2")
    finally:
        torch.set_num_threads(threads)
    return {"root": root, "pp1": pp1, "pp1_four": pp1_four, "tied": tied, "sr": sr, "two": two, "four": four}


def _joined(reports: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    """The stages' masters as one model (a tied embedding's copies must agree)."""
    out: dict[str, torch.Tensor] = {}
    for r in reports:
        for name, t in r["masters"].items():
            assert name not in out or torch.equal(out[name], t), name
            out[name] = t
    return out


def _parts(run: dict[str, Any], want: dict[str, Any]) -> bool:
    """Whether a run with a fix removed (:data:`_pp_cases.FAULT_STEPS` steps) parts from the
    fixed run ``want`` within its steps (the losses compared over the same steps)."""
    n = len(run["losses"])
    assert 0 < n <= len(want["losses"])
    return run["losses"] != want["losses"][:n]


def _assert_bitwise(reports: list[dict[str, Any]], want: dict[str, Any], what: str) -> None:
    for r in reports:  # every rank reports the step's numbers
        assert r["losses"] == want["losses"], (what, r["losses"], want["losses"])
        assert r["grad_norms"] == want["grad_norms"], (what, r["grad_norms"], want["grad_norms"])
    got = _joined(reports)
    assert got.keys() == want["masters"].keys(), what
    bad = [n for n, t in want["masters"].items() if not torch.equal(got[n], t)]
    assert not bad, (what, bad)


@pytest.mark.parametrize("recipe", RECIPES)
def test_pp2_matches_pp1_bitwise(runs: dict[str, Any], recipe: str) -> None:
    """1F1B over 2 stages (embedding and layer 0 | layer 1, head and loss): losses, grad norms
    and every fp32 master after 6 steps equal the one-rank run's, in every CPU recipe."""
    _assert_bitwise([r["pp2"][recipe] for r in runs["two"]], runs["pp1"][recipe], recipe)
    assert runs["pp1"][recipe]["losses"][-1] < runs["pp1"][recipe]["losses"][0]


@pytest.mark.parametrize("recipe", INTERLEAVED)
def test_interleaved_matches_pp1_bitwise(runs: dict[str, Any], recipe: str) -> None:
    """Interleaved 1F1B, 2 virtual chunks per rank (rank 0 runs layers 0 and 2, rank 1 layers
    1 and 3; the layers' forwards and backwards interleave across chunks), at 4 layers."""
    _assert_bitwise([r["interleaved"][recipe] for r in runs["two"]], runs["pp1_four"][recipe], recipe)


@pytest.mark.parametrize("case", sorted(DP_CASES))
def test_pp2_dp2_matches_dp2_bitwise(runs: dict[str, Any], case: str) -> None:
    """PP 2 x DP 2 against DP 2: per-stage buffers, ZeRO-1 (MXFP8 param gather through the
    reused grad buffer), layer-wise Muon, dense + expert optimizers at EP 2, ZeRO-3 with
    overlapped, prefetched gathers -- the data-parallel shards cut the params elsewhere at PP 2
    (smaller buffers), which the grad norm does not see."""
    want = runs["two"][0]["dp2"][case]
    reports = [r["pp2dp2"][case] for r in runs["four"]]  # ranks 0, 1: stage 0; 2, 3: stage 1
    for dp in (0, 1):  # each data-parallel replica of the pipeline holds the whole model
        _assert_bitwise([reports[dp], reports[2 + dp]], want, case)


@pytest.mark.parametrize("recipe", FEW)
def test_fewer_micro_batches_than_stages_match_dp2_bitwise(runs: dict[str, Any], recipe: str) -> None:
    """One micro-batch per step at PP 2 x DP 2 (Schedule1F1B refuses fewer micro-batches than
    stages; 1F1B's warm-up would hold them all, so lptrain runs ScheduleGPipe, the same order):
    bitwise the DP 2 run's in every CPU recipe (``lptrain pretrain --nproc-per-node 4`` with the
    recipes' own batch runs this way)."""
    want = runs["two"][0]["dp2_few"][recipe]
    reports = [r["pp2dp2_few"][recipe] for r in runs["four"]]
    for dp in (0, 1):
        _assert_bitwise([reports[dp], reports[2 + dp]], want, recipe)


@pytest.mark.parametrize("recipe", sorted(TP_CASES))
def test_pp2_tp2_matches_tp2_bitwise(runs: dict[str, Any], recipe: str) -> None:
    """PP 2 x TP 2 with sequence parallelism against TP 2: the stages pass sequence shards, the
    delayed-scaling amaxes reduce over each stage's TP group, the MoE router runs on shards."""
    want = runs["two"][0]["tp2"][recipe]
    reports = [r["pp2tp2"][recipe] for r in runs["four"]]  # ranks 0, 1: stage 0; 2, 3: stage 1
    for tp in (0, 1):  # (each TP rank reports the whole masters: its shards joined)
        _assert_bitwise([reports[tp], reports[2 + tp]], want, recipe)


@pytest.mark.parametrize("schedule", sorted(ZERO_BUBBLE))
@pytest.mark.parametrize("recipe", RECIPES)
def test_zero_bubble_schedules_match_pp1_bitwise(runs: dict[str, Any], recipe: str, schedule: str) -> None:
    """torch's zero-bubble schedules at PP 2, every backward split into an I step (the input
    gradients; the GEMMs queue their weight gradients with the micro-batch's quantized
    operands) and a W step (the queue run, into ``main_grad``, in micro-batch order), and
    DualPipeV (some backwards split so, the others whole, overlapped with another micro-batch's
    forward): losses, grad norms and every fp32 master after 6 steps equal the one-rank run's,
    in every CPU recipe -- delayed scaling, stochastic rounding and the MoE experts included.
    ZBV runs the uneven V split ``E|t|t|L`` (rank 0 holds the embedding and the loss alone),
    DualPipeV the same split asked as Megatron's embedding and loss counted as layers (0 | 1 |
    1 | 0 layers in a V); MoE and Muon, which need a layer on every rank, run the V schedules at
    4 layers split evenly."""
    want = runs["pp1_four" if four_layers(recipe, schedule) else "pp1"][recipe]
    _assert_bitwise([r["zero_bubble"][(recipe, schedule)] for r in runs["two"]], want, f"{recipe} {schedule}")


def test_dualpipev_sends_a_paired_forwards_output_before_its_backward(runs: dict[str, Any]) -> None:
    """The runner's DualPipeV plan splits torch's paired forward-backward actions so that the
    forward's output leaves before the paired backward runs (torch's runtime posted it after the
    pair: the next stage waited a whole backward). Fails with the wiring in
    ``PipelineRunner.schedule`` removed (torch's plan keeps the pairs)."""
    assert all(r["dualpipev_pairs_split"] for r in runs["two"])


def test_numerics_records_follow_the_split(runs: dict[str, Any]) -> None:
    """The quantization statistics of every step (``logging.numerics_interval``) are the
    one-rank run's under every zero-bubble schedule and split: each stage records its own
    layers' operands (the grad operands in the I step) and the ranks' records merge by name."""
    records = runs["pp1"][NUMERICS]["numerics"]
    assert len(records) == 6 and all(records) and any("grad" in str(k) for k in records[0])
    for s in ZERO_BUBBLE:
        for r in runs["two"]:
            assert r["zero_bubble"][(NUMERICS, s)]["numerics"] == records, s


@pytest.mark.parametrize("recipe", UNEVEN_1F1B_RECIPES)
def test_uneven_split_matches_pp1_bitwise_under_1f1b(runs: dict[str, Any], recipe: str) -> None:
    """1F1B on ``pipeline_model_parallel_layout=Ett|L``: both layers on the first stage, the
    final norm, head and loss alone on the second."""
    _assert_bitwise([r["uneven_1f1b"][recipe] for r in runs["two"]], runs["pp1"][recipe], recipe)


@pytest.mark.parametrize("case", sorted(DP_ZB_CASES))
def test_zero_bubble_at_pp2_dp2_matches_dp2_bitwise(runs: dict[str, Any], case: str) -> None:
    """Zero-bubble schedules at PP 2 x DP 2 against DP 2: ZeRO-3 with overlapped reduce-scatter
    and prefetched gathers, overlapped all-reduce, MXFP8 param gather through the reused grad
    buffer on the uneven V split -- a bucket's reduction starts only after the W steps of its
    weights (each weight's pending W jobs hold its grad hook back)."""
    want = runs["two"][0]["dp2"][case if case in DP_CASES else recipe_of(case)]
    reports = [r["pp2dp2_zb"][case] for r in runs["four"]]
    for dp in (0, 1):
        _assert_bitwise([reports[dp], reports[2 + dp]], want, case)


@pytest.mark.parametrize("recipe", sorted(TP_ZB_CASES))
def test_zero_bubble_at_pp2_tp2_matches_tp2_bitwise(runs: dict[str, Any], recipe: str) -> None:
    """ZBV on the uneven V split at PP 2 x TP 2 + SP against TP 2: the I step's sequence-parallel
    collectives in order, the W step local (the layers keep their gathered inputs)."""
    want = runs["two"][0]["tp2"][recipe]
    reports = [r["pp2tp2_zb"][recipe] for r in runs["four"]]
    for tp in (0, 1):
        _assert_bitwise([reports[tp], reports[2 + tp]], want, recipe)


def test_grad_ready_before_the_w_step_breaks_the_equality(runs: dict[str, Any]) -> None:
    """Regression: with overlapped grad reduction, a GEMM weight reported ready by the hook
    autograd fires in the I step (its W job not marked pending) has its bucket reduced before
    the W step adds the last micro-batch's gradient: the run parts from DP 2 (the same run with
    the readiness held to the W step is bitwise: the "overlap" case above)."""
    want = runs["two"][0]["dp2"]["tiny_cpu.yaml"]
    assert [r["pp2dp2_zb"]["overlap"]["losses"] for r in runs["four"]] == [want["losses"]] * 4  # (the fix)
    for r in runs["four"]:
        assert r["ready_at_i"]["losses"][0] == want["losses"][0]  # (the first step's forward)
        assert _parts(r["ready_at_i"], want)


def test_delayed_scaling_advanced_per_step_breaks_the_equality(runs: dict[str, Any]) -> None:
    """Regression: the unpipelined run advances each layer's delayed-scaling history once per
    micro-batch (one autocast region per forward, as Transformer Engine's autocast is entered
    per micro-batch); a stage that advanced it once per schedule step instead (one region
    around the whole schedule: the natural way to wrap ``schedule.step``) quantizes its second
    micro-batch with stale scales: the losses part from the unpipelined ones."""
    want = runs["pp1"]["fp8_delayed_cpu.yaml"]
    for r in runs["two"]:
        assert r["pp2"]["fp8_delayed_cpu.yaml"]["losses"] == want["losses"]  # (the fix)
        assert _parts(r["delayed_per_step"], want)


def test_sr_streams_seeded_by_global_rank_break_the_equality(runs: dict[str, Any]) -> None:
    """Regression: NVFP4's stochastic rounding draws from per-quantizer streams seeded by the
    rank; seeded by the global rank, the second stage draws other bits than the one rank
    holding its layers without pipelining (the fix seeds by the rank's place in its stage).
    Both layers in NVFP4 here, so that stage 1 rounds stochastically."""
    want = runs["sr"]
    for r in runs["two"]:
        _assert_bitwise([x["sr"] for x in runs["two"]], want, "nvfp4, both layers")
        assert _parts(r["sr_global_rank"], want)


def test_train_eval_train_is_bitwise_under_pp(runs: dict[str, Any]) -> None:
    """An evaluation through the schedule (forward only) after every step and a forced param
    sync change nothing: losses, grad norms, reduced grads, raw param bytes, masters."""
    for r in runs["two"]:
        assert r["eval_bitwise"] is None, r["eval_bitwise"]


def test_train_eval_train_is_bitwise_under_zbv(runs: dict[str, Any]) -> None:
    """An evaluation after every step of ZBV on the uneven V split (ZBV's forwards alone:
    torch's V schedules run their I steps' hand-over even forward-only, which fails) changes
    no loss and no grad norm of the 6-step run without it."""
    for r in runs["two"]:
        losses, norms = r["eval_v"]
        run6 = r["zero_bubble"][("fp8_delayed_cpu.yaml", "zbv_zero_bubble")]
        assert losses == run6["losses"][:3] and norms == run6["grad_norms"][:3]


def test_nonfinite_gradient_names_the_stage_rank_and_tensor(runs: dict[str, Any]) -> None:
    """A NaN gradient on the second stage stops every rank with one line naming the step, the
    rank, its pipeline stage and the parameter (named by the rank that holds it)."""
    want = "step 2, rank 1 (pipeline stage 1): gradient of 'final_norm.weight' is not finite"
    for r in runs["two"]:
        assert r["nonfinite"].startswith(want), r["nonfinite"]


def test_injected_nan_on_the_last_stage_is_named(runs: dict[str, Any]) -> None:
    """``debug.nan_module`` of a layer on stage 1: accepted (each stage used to check it
    against its own layers, so stage 0 refused it), injected there, and named: the first
    bad output grad of a backward is the latest stage's (it was the lowest rank's)."""
    want = ("first non-finite: output grad of 'layers.1.mlp.linear_fc2' (rank 1, micro-batch 1, "
            "sample 1); stopping (train.on_anomaly=stop)")
    for r in runs["two"]:
        assert r["nan_module"].endswith(want), r["nan_module"]


def test_replay_of_a_pp_run_on_its_ranks_is_bitwise(runs: dict[str, Any]) -> None:
    """``lptrain replay --nproc-per-node 2``: the step and every stage's masters (each rank
    compares the ones it holds) are bitwise the run's; and the run's layout is in its summary."""
    for r in runs["two"]:
        assert r["replay"][1].startswith("bitwise the same: loss, grad norm, 15 fp32 master weights"), r["replay"]
        assert r["parallel"] == {"tp": 1, "cp": 1, "pp": 2, "dp": 1, "ep": 1, "etp": 1, "world_size": 2}


def test_replay_at_the_wrong_size_says_the_flag(runs: dict[str, Any]) -> None:
    from typer.testing import CliRunner

    from lptrain.cli import app

    run = runs["root"] / "pp2_split"
    r = CliRunner().invoke(app, ["replay", str(run), "--step", "3"])
    assert r.exit_code == 2
    assert r.stderr == (f"error: {run}/ckpt/iter_0000002 was written by 2 rank(s) (TP 1 x PP 2 x DP 1), "
                        "this replay runs 1: a step is bitwise the same only at the run's size; fix: "
                        f"lptrain replay {run} --step 3 --nproc-per-node 2\n")


def test_tied_embeddings_stay_in_sync_within_tolerance(runs: dict[str, Any]) -> None:
    """Tied embeddings at PP 2: the first stage's table and the last stage's copy get the
    same summed gradient and stay equal (``_joined`` checks the copies bitwise); the run
    follows the unpipelined one within :data:`TIED_RTOL` / :data:`TIED_NORM_RTOL` (module
    doc: not bitwise)."""
    want = runs["tied"]
    got = [r["tied"] for r in runs["two"]]
    assert "embedding.weight" in got[0]["masters"] and "embedding.weight" in got[1]["masters"]
    joined = _joined(got)
    assert joined.keys() == want["masters"].keys()
    for key, rtol in (("losses", TIED_RTOL), ("grad_norms", TIED_NORM_RTOL)):
        drift = max(abs(g - w) / abs(w) for g, w in zip(got[0][key], want[key], strict=True))
        assert 0 < drift < rtol, (key, drift)  # (0: it would be bitwise after all)


def test_split_resume_is_bitwise_at_pp2(runs: dict[str, Any]) -> None:
    root = runs["root"]
    for r in runs["two"]:
        assert r["split_status"] == ("exit_interval", "completed", CKPT_STEPS // 2)
    view = [(m["step"], m["loss"], m["grad_norm"], m["consumed_samples"]) for m in metrics(root / "pp2_split")]
    assert view == [(m["step"], m["loss"], m["grad_norm"], m["consumed_samples"])
                    for m in metrics(root / "pp2_straight")]


@pytest.mark.parametrize(("resumed", "straight"), [
    ("from_pp1", "pp2_straight"),  # saved at PP 1, resumed at PP 2
    ("from_pp2_uneven", "pp2_straight"),  # saved at PP 2 (1F1B, even), resumed on ZBV's uneven V split
    ("pp1_from_pp2", "pp1_straight"),  # saved at PP 2, resumed at PP 1
    ("pp2_straight", "pp1_straight"),  # (and the two straight runs agree)
])
def test_resume_across_pp_sizes_is_bitwise(runs: dict[str, Any], resumed: str, straight: str) -> None:
    """A checkpoint holds one logical model (each stage writes its parameters under their
    canonical names; the tied copy once): saved at one pipeline size, it resumes at another
    and continues exactly as the uninterrupted run at the same data-parallel size."""
    view = [(m["step"], m["loss"], m["grad_norm"], m["consumed_samples"]) for m in metrics(runs["root"] / resumed)]
    assert view == [(m["step"], m["loss"], m["grad_norm"], m["consumed_samples"])
                    for m in metrics(runs["root"] / straight)]


@pytest.mark.parametrize(("resumed", "straight"), [
    ("from_pp2", "pp2dp2_straight"),  # saved at PP 2, resumed at PP 2 x DP 2
    ("pp1_from_pp2dp2", "pp1_straight"),  # saved at PP 2 x DP 2, resumed at PP 1
])
def test_resume_across_pp_and_dp_sizes(runs: dict[str, Any], resumed: str, straight: str) -> None:
    got, want = metrics(runs["root"] / resumed), metrics(runs["root"] / straight)
    assert [m["step"] for m in got] == list(range(1, CKPT_STEPS + 1))
    assert [m["consumed_samples"] for m in got] == [m["consumed_samples"] for m in want]
    for g, w in zip(got[CKPT_STEPS // 2:], want[CKPT_STEPS // 2:], strict=True):
        assert g["loss"] == pytest.approx(w["loss"], rel=RESUME_RTOL), g["step"]


def test_hf_export_of_a_pp_run_equals_the_pp1_export(runs: dict[str, Any], tmp_path: Path) -> None:
    """The PP 2 run's checkpoint exports to the same Hugging Face folder, byte for byte, as
    the PP 1 run's (the training is bitwise, and the checkpoint one logical model)."""
    from lptrain.checkpoint import find_checkpoints
    from lptrain.interop.hf_export import export_hf

    names = ("pp1_straight", "pp2_straight", "from_pp2_uneven")  # (the last: saved on the uneven V split)
    for name in names:
        export_hf(find_checkpoints(runs["root"] / name / "ckpt").valid[0], tmp_path / name)
    files = sorted(p.name for p in (tmp_path / "pp1_straight").iterdir())
    assert "model.safetensors" in files
    for name in names[1:]:
        assert files == sorted(p.name for p in (tmp_path / name).iterdir()), name
        for f in files:
            assert (tmp_path / "pp1_straight" / f).read_bytes() == (tmp_path / name / f).read_bytes(), (name, f)
