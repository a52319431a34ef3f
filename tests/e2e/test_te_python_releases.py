"""lptrain's version-gated TE paths on older releases of TE's own Python (one subprocess per
release: TE registers global state at import, so one release per process).

Every other TE-backend test runs the newest installed release in-process; this module runs
tests/e2e/_te_release_checks.py on a subset of ``make install``'s matrix:

* 2.8.0, the oldest lptrain supports: ``*TensorBase`` storage classes, ``fp8_autocast``,
  ``FusedAdam`` before its kernels took bf16 moments (2.14);
* 2.12.0: storage without ``.shape``, ``Float8BlockwiseQTensor`` refusing inner-dimension
  reshapes (the blockwise byte param gather must never reshape);
* 2.18.0: the last release whose storage has no ``.shape``, and whose
  ``make_grouped_weights`` drops the members' kept init values (lptrain carries them over).

On 2.8.0 (the first NVFP4, blockwise still Hopper-only) and 2.18.0 (the last with untrained
single grouped weights) the rules' TE version table is held to what the release runs: every
recipe on its GPU, blockwise on Blackwell, a single grouped expert weight that trains (2.19+);
the newest release in-process: tests/unit/config/test_te_versions.py.

Issue 48 finding 1: TE's modules set ``internal=True`` on their quantizers in forward, and
the statistics probe's copy kept it, so the copy returned a storage object: no ``.shape``
before 2.19 (AttributeError in the hook), and on 2.8 a ``*TensorBase`` the readers did not
know (plain statistics, silently). Finding 3: the copy shared the module's live amax, so
probing another tensor (a recomputed input) changed the run's delayed scaling.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from lptrain.testing import te_builds, te_python

SCRIPT = Path(__file__).with_name("_te_release_checks.py")
# one subprocess per release imports torch and TE's Python (about 5 s quiet, much more on a
# loaded machine) and runs its checks
pytestmark = pytest.mark.timeout(900)
RELEASES = {"2.8.0": "probe,adam,versions", "2.12.0": "probe,engine", "2.18.0": "probe,grouped,versions"}


def _run(release: str, only: str) -> dict[str, Any]:
    folders = te_python.installed_folders()
    if release not in folders:
        pytest.fail(f"TE {release}'s Python is not installed; {te_python.HOW_TO_GET}")
    env = {**os.environ, te_python.ENV: str(folders[release]),
           "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[2]), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, str(SCRIPT), "--only", only], env=env, capture_output=True,
                          text=True, timeout=600)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    assert line is not None, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(line[len("RESULT "):])
    assert "exception" not in result, result["exception"]
    return result


@pytest.fixture(scope="module", params=list(RELEASES))
def release(request: pytest.FixtureRequest) -> tuple[str, dict[str, Any]]:
    return request.param, _run(request.param, RELEASES[request.param])


def test_the_probe_reads_block_statistics_and_leaves_delayed_scaling_alone(release: tuple[str, dict]) -> None:
    name, result = release
    fixed, unfixed = result["probe"], result["probe_unfixed"]
    assert fixed["te"] == f"TE {name}, TE's own Python, kernels emulated"
    assert fixed["internal_after_forward"]  # what TE's forward does to its quantizers
    assert fixed["block_stats"] and fixed["history_kept"], fixed
    assert not fixed["class"].endswith(("Storage", "Base"))
    # the code before the fix, on the same release
    if name == "2.8.0":
        assert unfixed["class"] == "Float8TensorBase" and not unfixed["block_stats"], unfixed
    else:
        assert unfixed["class"] == "AttributeError" and "shape" in unfixed["error"], unfixed
    assert not unfixed["history_kept"], unfixed


def test_engine_steps_on_the_release(release: tuple[str, dict]) -> None:
    name, result = release
    if "engine" not in result:
        pytest.skip(f"TE {name}: probe checks only")
    for recipe, losses in result["engine"].items():
        assert len(losses) == 2 and all(x == x for x in losses), (recipe, losses)


def test_te_fused_adam_steps_bitwise_as_the_emulation(release: tuple[str, dict]) -> None:
    """TE's own FusedAdam on the release against lptrain's emulation, bitwise, in every
    stored format lptrain configures (tests/unit/optim/test_precision_aware_optimizer.py runs
    the newest release)."""
    name, result = release
    if "adam" not in result:
        pytest.skip(f"TE {name}: no FusedAdam check")
    assert result["adam"] == []


def test_grouped_masters_start_from_the_members_init_values(release: tuple[str, dict]) -> None:
    """Round 2 finding 2 where TE drops the kept values (2.19+ moves them:
    tests/unit/precision/test_te_findings.py): lptrain's carry-over gives the init values;
    TE's ``make_grouped_weights`` alone gives the MXFP8-rounded bytes."""
    name, result = release
    if "grouped" not in result:
        pytest.skip(f"TE {name}: no grouped-weight check")
    g = result["grouped"]
    assert g["carried_is_init"] and not g["carried_is_rounded"], g
    assert g["uncarried_is_rounded"] and not g["uncarried_is_init"], g


def _minor(release: str) -> str:
    return ".".join(release.split(".")[:2])


def test_rules_accept_each_recipe_exactly_when_the_release_runs_it(release: tuple[str, dict]) -> None:
    name, result = release
    if "versions" not in result:
        pytest.skip(f"TE {name}: no version-table check")
    runs = result["versions"]
    for recipe, overrides in te_builds.RECIPES.items():
        refused = te_builds.refusals(overrides, te_builds.world(te_builds.GPU[recipe], _minor(name)))
        assert (refused == []) == (runs["builds"][recipe] is True), (recipe, refused, runs["builds"][recipe])
    refused = te_builds.refusals(te_builds.RECIPES["blockwise"], te_builds.world("sm100", _minor(name)))
    assert (refused == []) == (runs["blockwise_sm100"] is True), (refused, runs["blockwise_sm100"])


def test_rules_accept_single_grouped_weight_exactly_when_the_release_trains_it(
        release: tuple[str, dict], monkeypatch: pytest.MonkeyPatch) -> None:
    """Round 2 finding 3 on 2.18: with the gate lptrain had (2.14) the rules accept it, and TE
    2.18 runs the experts' GEMMs on members that never give the grouped weight a gradient."""
    from lptrain.config.rulesets import te_backend as rules_te

    name, result = release
    if "versions" not in result:
        pytest.skip(f"TE {name}: no version-table check")
    w = te_builds.world("sm100", _minor(name), cuda="13.3")
    trains = result["versions"]["trains_experts"]
    assert (te_builds.refusals(te_builds.SINGLE_GROUPED_WEIGHT, w) == []) == trains
    if name == "2.18.0":
        assert not trains
        monkeypatch.setattr(rules_te, "SINGLE_GROUPED_WEIGHT_MIN_TE", "2.14")  # the old gate
        assert te_builds.refusals(te_builds.SINGLE_GROUPED_WEIGHT, w) == []  # accepted, trains nothing
