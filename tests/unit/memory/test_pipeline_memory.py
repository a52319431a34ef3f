"""The memory planner under pipeline parallelism: each stage planned from its own model part,
against real stage engines; the activations of the in-flight micro-batches as Megatron-LM
counts them; the schedule's receive buffers; the 405B-class recipe at 512 GPUs."""

from __future__ import annotations

import pytest
import torch

from lptrain.catalog.pipeline import PipelineLayout, bubble_fraction
from lptrain.config import World, compose, derive, load
from lptrain.memory.plan import estimate_memory

BASE = ["data.builtin_max_mb=1", "logging.progress=false", "train.micro_batch_size=2",
        "train.global_batch_size=4", "model.seq_length=32"]
PP2 = ["model.pipeline_model_parallel_size=2"]
CASES = {
    "adamw_distopt": ("tiny_cpu.yaml", ["ddp.use_distributed_optimizer=true", "ddp.bucket_size=3000"]),
    "mxfp8_muon_layerwise": ("mxfp8_muon_cpu.yaml", ["ddp.bucket_size=3000"]),
}


def test_layout_splits_layers_into_chunks_in_loop_order() -> None:
    lay = PipelineLayout(num_layers=8, pp=2, vpp=2)
    assert [list(lay.chunk_layers(c)) for c in range(4)] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert lay.rank_chunks(0) == [0, 2] and lay.rank_chunks(1) == [1, 3]
    assert lay.rank_layers(1) == [2, 3, 6, 7]
    assert [lay.stage_of_layer(i) for i in range(8)] == [0, 0, 1, 1, 0, 0, 1, 1]
    assert not PipelineLayout(num_layers=6, pp=4).divides()


def test_in_flight_micro_batches_as_megatron_counts_them() -> None:
    one_f_one_b = PipelineLayout(num_layers=8, pp=4)
    assert [one_f_one_b.in_flight(r, 8) for r in range(4)] == [4, 3, 2, 1]
    # fewer micro-batches than stages: all forwards before the first backward, on every stage
    assert [one_f_one_b.in_flight(r, 2) for r in range(4)] == [2, 2, 2, 2]
    interleaved = PipelineLayout(num_layers=8, pp=4, vpp=2)
    assert interleaved.in_flight(0, 8) == pytest.approx(4 * (1 + 3 / 8))
    assert bubble_fraction(2, 4) == pytest.approx(1 / 5)
    assert bubble_fraction(2, 4, vpp=2) == pytest.approx(1 / 9)


def _cfg(recipe: str, overrides: list[str], dp: int = 1, target: str = "cpu"):
    return derive(compose(recipe, [*BASE, *overrides]), World.detect(dp=dp, target=target))


def _stage_rank(rank: int, world: int) -> dict[str, dict[str, int]]:
    """One real step of each case at PP 2 on this rank's stage; its measured categories."""
    from lptrain.memory.measure import measure_engine
    from lptrain.train.engine import TrainEngine

    out = {}
    for name, (recipe, ov) in CASES.items():
        cfg = derive(compose(recipe, [*BASE, *ov, *PP2]), World.detect())
        engine = TrainEngine(cfg)
        g = torch.Generator().manual_seed(0)
        tok = torch.randint(0, cfg.model.vocab_size, (2, 2, cfg.model.seq_length + 1), generator=g)
        engine.train_step([{"tokens": t[:, :-1], "labels": t[:, 1:]} for t in tok], 1)
        out[name] = measure_engine(engine)
    return out


@pytest.mark.dist
def test_persistent_categories_match_real_stage_engines() -> None:
    """Each stage's engine (its layers; the embedding on stage 0, the head on stage 1)
    against the planner's stage (its model part, the engine's own layout code): within 1%
    per category, and the two stages add up to the one-rank model's weights."""
    from lptrain.memory.plan import PERSISTENT
    from lptrain.testing.dist import run_distributed

    out = run_distributed(_stage_rank, 2, timeout_s=180)
    for name, (recipe, ov) in CASES.items():
        est = estimate_memory(_cfg(recipe, [*ov, *PP2]), 1, "cpu")
        assert est.pp == 2 and [r.rank for r in est.ranks] == [0, 1]
        for stage in (0, 1):
            est_b, real = est.ranks[stage].bytes, out[stage][name]
            for k in PERSISTENT:
                assert abs(est_b[k] - real[k]) <= 0.01 * max(real[k], 1), (name, stage, k, est_b[k], real[k])
        one = estimate_memory(_cfg(recipe, ov), 1, "cpu")
        assert est.params == one.params
        weights = sum(r.bytes["weights"] + r.bytes["quantized_weights"] for r in est.ranks)
        assert weights == one.ranks[0].bytes["weights"] + one.ranks[0].bytes["quantized_weights"]


def test_first_stage_holds_pp_micro_batches_of_its_layers() -> None:
    """Megatron's count: under 1F1B the first stage keeps PP micro-batches of its L / PP
    layers -- as many layer activations as the whole model keeps at PP 1 for one micro-batch;
    interleaving adds (PP - 1) / (PP x VPP) of that. The last stage keeps one micro-batch."""
    ov = ["model.num_layers=8", "model.hidden_size=256", "model.num_attention_heads=8",
          "model.num_query_groups=8", "model.seq_length=512", "train.micro_batch_size=1",
          "train.global_batch_size=8", "model.vocab_size=256", "model.make_vocab_size_divisible_by=128"]

    def stages(*extra: str) -> list[int]:
        cfg = derive(compose("bf16_adamw.yaml", [*ov, *extra]), World.detect(dp=1, target="sm90"))
        est = estimate_memory(cfg, 1, "sm90")
        return [r.bytes["activations"] for r in est.ranks]

    (whole,) = stages()
    pp4 = stages("model.pipeline_model_parallel_size=4")
    assert pp4[0] > pp4[1] > pp4[2] > pp4[3]
    assert pp4[0] == pytest.approx(whole, rel=0.1)  # (the head's and the embedding's terms differ)
    assert pp4[3] == pytest.approx(whole / 4, rel=0.25)  # one micro-batch of 2 layers + the head
    vpp = stages("model.pipeline_model_parallel_size=4", "model.virtual_pipeline_model_parallel_size=2")
    assert vpp[0] / pp4[0] == pytest.approx(1 + 3 / 8, rel=0.02)


def test_receive_buffers_hold_every_micro_batch() -> None:
    """torch.distributed.pipelining allocates a receive buffer per micro-batch of the step: the
    forward input of every chunk but the first, the output gradient of every chunk but the
    last -- b x s x h activation elements each."""
    est = estimate_memory(_cfg("tiny_cpu.yaml", PP2), 1, "cpu")
    hidden = 2 * 32 * 64 * 4  # micro-batch 2, seq 32, hidden 64, fp32 on the CPU
    m = 2  # micro-batches per step
    assert [r.bytes["pipeline_buffers"] for r in est.ranks] == [m * hidden, m * hidden]
    vpp = estimate_memory(_cfg("tiny_cpu.yaml", [*PP2, "model.virtual_pipeline_model_parallel_size=2",
                                                 "model.num_layers=4"]), 1, "cpu")
    assert [r.bytes["pipeline_buffers"] for r in vpp.ranks] == [3 * m * hidden, 3 * m * hidden]


def test_405b_at_tp8_pp8_fits_80gb_at_512_gpus() -> None:
    """The cluster recipe fp8_tensorwise_405b_tp8_pp8 (TP 8 + SP, PP 8, 8k sequences, full
    recompute, ZeRO-2) at DP 8 = 512 GPUs on sm90; without pipeline parallelism it does not."""
    composed = load("fp8_tensorwise_405b_tp8_pp8.yaml")
    cfg = derive(composed.cfg, World.detect(dp=8, target="sm90"))
    est = estimate_memory(cfg, 8, "sm90")
    assert est.params == pytest.approx(405.85e9, rel=1e-3)  # (126 layers: 15 | 16 x 6 | 15 over 8 stages)
    assert est.worst.total < 80 * 2**30, est.worst.total / 2**30
    assert {r.rank // 64 for r in est.ranks} == set(range(8))  # every stage planned
    flat = load("fp8_tensorwise_405b_tp8_pp8.yaml", ["model.pipeline_model_parallel_size=1"])
    cfg = derive(flat.cfg, World.detect(dp=64, target="sm90"))
    assert estimate_memory(cfg, 64, "sm90").worst.total > 80 * 2**30


def test_every_figure_printed_is_the_most_loaded_stages(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 52 item 9: the breakdown was the worst rank's (stage 1) while the ``layout:`` line
    counted stage 0's elements, the note gave stage 0's micro-batches in flight and the plot
    said "1 micro-batch". Here stage 1 (the untied 8k-vocab head and its logits) is the most
    loaded and holds 1 micro-batch where stage 0 holds 2: the layout line counts stage 1's
    parameters, and the text and the plot name the same activations."""
    import matplotlib.figure
    from typer.testing import CliRunner

    from lptrain.cli import app
    from lptrain.memory.plan import meta_model

    ov = ["model.pipeline_model_parallel_size=2", "model.num_layers=4", "model.vocab_size=8192",
          "train.micro_batch_size=1", "train.global_batch_size=8"]
    cfg = _cfg("tiny_cpu.yaml", ov)
    per_stage = [sum(p.numel() for p in meta_model(cfg, pp_rank=s).parameters()) for s in (0, 1)]
    assert per_stage[0] != per_stage[1]
    plotted: list[list[str]] = []
    real_save = matplotlib.figure.Figure.savefig

    def record(fig: matplotlib.figure.Figure, *a: object, **k: object) -> None:
        plotted.append([t.get_text() for t in fig.axes[0].get_yticklabels()])
        real_save(fig, *a, **k)

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", record)
    r = CliRunner(env={"COLUMNS": "200"}).invoke(
        app, ["estimate-memory", "--recipe", "tiny_cpu.yaml", *BASE, *ov, "--plot", str(tmp_path / "m.png")])
    assert r.exit_code == 0, r.output
    assert "rank 1 (the most loaded)" in r.stdout
    assert f": {per_stage[1]:,} param elements" in r.stdout  # stage 1's layout, not stage 0's
    assert "  activations (1 micro-batch in flight)  " in r.stdout
    assert "stage 1 is the most loaded; it holds 1 micro-batch of activations at most (stage 0: 2)" in r.stdout
    assert "activations (1 micro-batch in flight)" in plotted[0]
