"""bench/harness.py: the stopping rule, the spread, and REGRESSED against the accepted figures.

The benches themselves are not tests (no timings are asserted anywhere); this checks the
shared logic that turns timings into verdicts, on synthetic numbers."""

from __future__ import annotations

import io
import math
import sys
from pathlib import Path

import pytest
from rich.console import Console

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import harness


def test_median_spread_ignores_how_far_an_outlier_is() -> None:
    xs = [1.0, 1.01, 0.99, 1.02, 0.98, 1.0, 1.01, 0.99, 1.0, 1.0, 1.01, 0.99]
    tight = harness.median_spread(xs)
    assert 0 < tight < 0.02
    # one 5x spike moves the interval by one rank, not by 5x
    assert harness.median_spread([*xs[:-1], 5.0]) < 0.03
    assert math.isinf(harness.median_spread([1.0, 2.0]))


def test_rounds_stop_when_tight_or_at_the_cap() -> None:
    r = harness.Rounds([harness.Ratio("a", "cand", "base")], cap_s=1e9, spread=0.05, min_rounds=5)
    for _ in range(4):
        r.add({"cand": 2.0, "base": 1.0})
    assert not r.done()  # below min_rounds
    r.add({"cand": 2.0, "base": 1.0})
    assert r.done() and r.stop_reason().startswith("spread")
    noisy = harness.Rounds([harness.Ratio("a", "cand", "base")], cap_s=0.0, spread=0.01, min_rounds=3)
    for c in (1.0, 3.0, 2.0):
        noisy.add({"cand": c, "base": 1.0})
    assert not noisy.converged() and noisy.done() and noisy.stop_reason().startswith("time cap")
    fig = noisy.figures()[0]
    assert fig.median == 2.0 and fig.minmin == 1.0


@pytest.mark.parametrize(("median", "higher", "accepted", "regressed"), [
    (1.30, False, 1.0, True), (1.20, False, 1.0, False),  # cost: more than 25% up
    (0.70, True, 1.0, True), (0.85, True, 1.0, False),  # rate: more than 25% down
])
def test_regressed_is_25_percent_worse_than_accepted(median: float, higher: bool, accepted: float,
                                                     regressed: bool) -> None:
    fig = harness.Figure("f", [median], target=None, higher_is_better=higher)
    assert fig.worse_than(accepted) is regressed
    assert ("REGRESSED" in harness.verdict(fig, accepted)) is regressed


def test_report_saves_and_then_flags_against_the_saved_baseline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(harness, "BASELINE_PATH", tmp_path / "baseline.json")
    out = io.StringIO()
    console = Console(file=out, width=200)

    class Args:
        save_baseline = True

    assert harness.report(console, "b", "t", [harness.Figure("x", [1.0, 1.0, 1.0], target=2.0)], Args())
    Args.save_baseline = False
    assert harness.BaselineStore("b").accepted("x") == 1.0
    assert not harness.report(console, "b", "t", [harness.Figure("x", [1.5, 1.5, 1.5], target=2.0)], Args())
    assert "PASS REGRESSED" in out.getvalue()


def test_save_baseline_accepts_only_converged_figures(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(harness, "BASELINE_PATH", tmp_path / "baseline.json")

    class Args:
        save_baseline = True
        spread = 0.05

    noisy = harness.Figure("noisy", [1.0, 3.0, 2.0, 5.0, 1.0])
    harness.report(Console(file=io.StringIO()), "b", "t", [noisy, harness.Figure("tight", [1.0] * 5)], Args())
    store = harness.BaselineStore("b")
    assert store.accepted("tight") == 1.0 and store.accepted("noisy") is None


def test_a_target_that_could_not_be_computed_is_incomplete_not_pass() -> None:
    out = io.StringIO()
    figs = [harness.Figure("x", [1.0, 1.0, 1.0], target=2.0), harness.Figure("y", [3.0, 3.0, 3.0])]
    assert harness.report(Console(file=out, width=200), "b", "t", figs)  # every target passes
    assert not harness.report(Console(file=out, width=200), "b", "t", figs, unevaluated=["y: no figure"])
    text = out.getvalue()
    assert "target not evaluated: y: no figure" in text
    assert "overall: INCOMPLETE (1 target(s) not evaluated)" in text


def test_model_step_names_each_recipe_whose_linear_figure_is_missing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """model_step's per-recipe targets come from quantize's accepted linear figures; with one
    missing, that recipe's target is reported as not evaluated (it read 'info' and the bench
    said PASS before)."""
    import model_step

    monkeypatch.setattr(harness, "BASELINE_PATH", tmp_path / "baseline.json")
    store = harness.BaselineStore("quantize")
    store.save([harness.Figure(f"{fig} linear fwd+bwd", [1.2] * 3)
                for name, fig in model_step.LINEAR_FIGURE.items() if name != "mxfp8"])
    missing = model_step.unevaluated_targets()
    assert len(missing) == 1 and missing[0].startswith("lptrain mxfp8: no accepted 'mxfp8 linear fwd+bwd'")
    store.save([harness.Figure("mxfp8 linear fwd+bwd", [1.2] * 3)])
    assert model_step.unevaluated_targets() == []
