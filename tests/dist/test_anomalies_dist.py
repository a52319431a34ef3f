"""Two ranks: the anomaly forensics name the rank whose micro-batch went bad, every rank
stops with the same message, and the statistics of a step cover the global batch.

Step 2 reads samples 4-7 (global batch 4, one micro-batch of 2 per rank): sample 7 is rank
1's. The statistics are merged over the ranks (counts add), so an operand's elements are
twice one rank's: ``underflow`` and ``zero_blocks`` are fractions of the global batch.
(MXFP8: a stateless recipe, so one micro-batch per rank quantizes exactly as two in one
process; delayed scaling would update its scales between one process's micro-batches.)
"""

from __future__ import annotations

from pathlib import Path

import pytest
from _anomaly_cases import nan_on_rank_one

from lptrain.testing.dist import run_distributed

pytestmark = pytest.mark.dist


def test_the_rank_that_read_the_bad_sample_is_named(tmp_path: Path) -> None:
    got = run_distributed(nan_on_rank_one, 2, args=(str(tmp_path / "run"), str(tmp_path / "cache")),
                          timeout_s=240)
    assert got[0]["error"] == got[1]["error"] != ""
    assert "first non-finite: output grad of 'layers.0.mlp.linear_fc1' (rank 1, micro-batch 0, " \
           "samples 6-7)" in got[0]["error"]
    a = got[0]["anomaly"]
    assert a["step"] == 2 and a["rank"] == 1 and a["ranks"] == [1] and a["batch"] == [4, 8]
    assert a["numerics"]["layers.0.mlp.linear_fc1.grad"]["nonfinite"] >= 1
    # step 1 at DP=2 (each rank one micro-batch) against DP=1 (both micro-batches in one
    # process): the same operands, so merged over ranks the same figures -- counts and
    # maxima exactly, the SNR up to the order of its fp64 sums. Output grads are twice the
    # DP=1 ones (each rank's loss is the mean over its 1 micro-batch, not 2; the reduction
    # averages later): amax x2, scale exponents +1, every fraction the same (MXFP8 scales
    # by powers of two, so the bytes are the same)
    two = got[0]["step1"]["numerics"]
    one = _step1_at_one_rank(tmp_path / "cache")
    assert two.keys() == one.keys()
    for op in one:
        exact = {k: v for k, v in one[op].items() if k != "snr_db"}
        if op.endswith(".grad"):
            exact["amax"] *= 2
            for k in ("scale_exp_min", "scale_exp_median", "scale_exp_max"):
                if k in exact:
                    exact[k] += 1
        assert {k: two[op][k] for k in exact} == exact, op
        if "snr_db" in one[op]:  # (the layer the recipe keeps in bf16 has none)
            assert abs(two[op]["snr_db"] - one[op]["snr_db"]) < 1e-9, op


def _step1_at_one_rank(cache: Path) -> dict:
    from lptrain.config import World, derive
    from lptrain.config.compose import load
    from lptrain.data import build_train_valid_loaders
    from lptrain.train.engine import TrainEngine

    cfg = derive(load("mxfp8_adamw_cpu.yaml", [
        "logging.progress=false", "data.builtin_max_mb=1", f"data.cache_dir={cache}",
        "train.global_batch_size=4", "train.micro_batch_size=2", "model.seq_length=64",
        "optimizer.warmup_iters=0"]).cfg, World.detect(dp=1))
    engine = TrainEngine(cfg)
    it, _ = build_train_valid_loaders(cfg.data, seq_length=64, micro_batch_size=2, global_batch_size=4,
                                      dp_rank=0, dp_size=1, vocab_size=cfg.model.vocab_size)
    return engine.train_step([next(it), next(it)], 1, numerics=True).numerics
