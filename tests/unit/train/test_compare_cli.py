"""``lptrain compare`` as a CI gate and the run files it reads (issue 52, items 8, 17 and 21),
on hand-written run folders (``metrics.jsonl`` only: no training).

* differing values print with enough digits to differ, and the relative difference;
* exit 0 when the runs agree within ``--tolerance``, 1 otherwise;
* the overlay goes beside run A (into its folder), into a folder ``--plot`` names, or to the
  ``--plot FILE.png``; never into the current folder; a bad ``--plot`` is one line, exit 2;
* a damaged ``metrics.jsonl`` (a byte that is not UTF-8, a step that is not an integer,
  statistics that are not numbers) or ``resolved_config.yaml`` is one line, exit 2, in
  ``compare``, ``numerics`` and ``plot``;
* two empty runs compare without a matplotlib warning.
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from lptrain.cli.app import app

LOSS_A, LOSS_B = 5.54627011, 5.54627043  # differ in the 7th digit: "5.54627 vs 5.54627" before


def _run(folder: Path, losses: list[float], **extra: Any) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps({"step": i + 1, "loss": v, "grad_norm": 1.0, "lr": 1e-3, **extra})
             for i, v in enumerate(losses)]
    (folder / "metrics.jsonl").write_text("".join(x + "\n" for x in lines))
    return folder


def _invoke(*args: str) -> Any:
    return CliRunner().invoke(app, list(args))


def _one_error(r: Any) -> str:
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), r.output
    assert "Traceback" not in r.output
    return lines[0]


def test_compare_prints_digits_that_differ_and_gates_ci(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    a = _run(tmp_path / "a", [6.0, LOSS_A])
    b = _run(tmp_path / "b", [6.0, LOSS_B])
    monkeypatch.chdir(tmp_path)
    r = _invoke("compare", str(a), str(b))
    assert r.exit_code == 1, r.output
    assert "first difference at step 2: loss 5.5462701 vs 5.5462704 (relative 5.8e-08)" in r.stdout
    assert f"wrote {a}/compare_vs_b.png" in r.stdout
    assert (a / "compare_vs_b.png").read_bytes()[:4] == b"\x89PNG"
    assert not (tmp_path / "compare.png").exists()  # never into the current folder
    r = _invoke("compare", str(a), str(b), "--tolerance", "1e-7", "--no-plot")
    assert r.exit_code == 0 and "identical: loss, grad norm, lr equal" in r.stdout, r.output
    r = _invoke("compare", str(a), str(a), "--no-plot")
    assert r.exit_code == 0, r.output

    from lptrain.train import compare  # the fix removed: 6 digits, and "vs" the same number

    monkeypatch.setattr(compare, "distinct", lambda x, y: (compare._fmt(x), compare._fmt(y)))
    r = _invoke("compare", str(a), str(b), "--no-plot")
    assert "loss 5.54627 vs 5.54627" in r.stdout


def test_the_plot_goes_where_asked_or_is_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    a = _run(tmp_path / "a", [6.0, 5.0])
    b = _run(tmp_path / "b", [6.0, 5.0])
    folder = tmp_path / "plots"
    folder.mkdir()
    r = _invoke("compare", str(a), str(b), "--plot", str(folder))
    assert r.exit_code == 0 and f"wrote {folder}/compare_vs_b.png" in r.stdout, r.output
    assert (folder / "compare_vs_b.png").is_file() and not Path(f"{folder}.png").exists()
    cases = {
        str(tmp_path / "c.xyz"): f"error: --plot {tmp_path}/c.xyz: the overlay is a PNG, and 'c.xyz' "
                                 "neither ends in .png nor is an existing folder; fix: pass --plot "
                                 "FILE.png or --plot DIR naming a writable folder, or --no-plot",
        str(tmp_path / "no" / "c.png"): f"error: --plot {tmp_path}/no/c.png: folder {tmp_path}/no does "
                                        "not exist; fix: create it first, or pass --plot FILE.png",
        "/proc/c.png": "error: cannot write the overlay plot /proc/c.png: ",
    }
    for plot, line in cases.items():
        r = _invoke("compare", str(a), str(b), "--plot", plot)
        assert r.exit_code == 2 and _one_error(r).startswith(line), (plot, r.output)
    unwritable = tmp_path / "ro"
    unwritable.mkdir()
    unwritable.chmod(0o500)
    monkeypatch.chdir(unwritable)  # the current folder is never written: it need not be writable
    r = _invoke("compare", str(a), str(b))
    assert r.exit_code == 0, r.output
    assert os.listdir(unwritable) == []


@pytest.mark.parametrize(("line", "what"), [
    (b'{"step": 3, "loss": 1.0, "note": "caf\xe9"}', "byte 0xe9 at column 38 is not UTF-8 text (the file was damaged or edited)"),
    (b'{"step": "x", "loss": 1.0}', '"step" is "x", not an integer'),
    (b'{"step": null, "loss": 1.0}', '"step" is null, not an integer'),
    (b'{"step": 3, "loss": 1.0, "numerics": {"op": 5}}', "\"numerics\" of 'op' is 5, not a mapping of statistics"),
    (b'{"step": 3, "loss": 1.0, "numerics": {"op": {"amax": "str"}}}',
     "\"numerics\" of 'op': 'amax' is \"str\", not a number"),
])
def test_a_damaged_metrics_line_is_one_line_exit_2(line: bytes, what: str, tmp_path: Path) -> None:
    good = _run(tmp_path / "good", [6.0, 5.0, 4.0])
    bad = _run(tmp_path / "bad", [6.0, 5.0])
    with (bad / "metrics.jsonl").open("ab") as f:
        f.write(line + b"\n")
    want = (f"error: {bad}/metrics.jsonl:3: {what}; fix: restore metrics.jsonl from a copy, or "
            f"delete line 3 of {bad}/metrics.jsonl (that step's record is then missing)")
    for args in (["compare", str(good), str(bad), "--no-plot"], ["numerics", str(bad)], ["plot", str(bad)]):
        r = _invoke(*args)
        assert r.exit_code == 2 and _one_error(r) == want, (args, r.output)


def test_a_non_utf8_resolved_config_is_one_line(tmp_path: Path) -> None:
    a = _run(tmp_path / "a", [6.0])
    b = _run(tmp_path / "b", [6.0])
    (b / "resolved_config.yaml").write_bytes(b"run:\n  name: caf\xe9\n")
    r = _invoke("compare", str(a), str(b), "--no-plot")
    assert r.exit_code == 2
    assert _one_error(r) == (
        f"error: {b}/resolved_config.yaml is not UTF-8 text (the file was damaged or edited); fix: "
        "restore it from the run's checkpoint (iter_*/resolved_config.yaml) or remove it to "
        "compare without settings")


def test_two_empty_runs_compare_quietly(tmp_path: Path) -> None:
    a = _run(tmp_path / "a", [])
    b = _run(tmp_path / "b", [])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # matplotlib's "No artists with labels ..." would raise
        r = _invoke("compare", str(a), str(b))
    assert r.exit_code == 1 and "no common steps to compare" in r.stdout, r.output
    assert r.stderr == ""
