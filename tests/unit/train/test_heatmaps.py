"""The quantization statistics' heatmaps (``numerics_<statistic>.png``) of a deep model:
every operand's row labelled and readable, and a colour scale that means something.

Issue 52 item 11: all-zero data got a colour bar from -0.1 to 0.1 (negative fractions), and at
16 layers the image was 550 x 2400 px with only every third of its 192 rows labelled.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import matplotlib.figure
import pytest

from lptrain.train.numerics_report import write_heatmaps

LINEARS = ("self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1", "mlp.linear_fc2")


def _operands(layers: int) -> list[str]:
    return [f"layers.{i}.{m}.{r}" for i in range(layers) for m in LINEARS for r in ("input", "weight", "grad")]


def _run(tmp_path: Path, layers: int, steps: int = 6, amax: bool = True) -> list[str]:
    ops = _operands(layers)
    with (tmp_path / "metrics.jsonl").open("w") as f:
        for s in range(1, steps + 1):
            stats = {op: {"zero_blocks": 0.0, **({"amax": 2.0 ** (k % 7 - s)} if amax else {})}
                     for k, op in enumerate(ops)}
            f.write(json.dumps({"step": s, "loss": 5.0, "numerics": stats}) + "\n")
    return ops


@pytest.fixture()
def drawn(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, matplotlib.figure.Figure]]:
    """Every figure saved, with its file name. Recorded instead of rendered (what is checked
    is the figure's layout, and rendering 192 labels takes seconds); tests/e2e/test_compare.py
    renders real heatmaps."""
    out: list[tuple[str, matplotlib.figure.Figure]] = []

    def record(fig: matplotlib.figure.Figure, path: object, *a: object, **k: object) -> None:
        Path(str(path)).write_bytes(b"")
        # save_png draws into ".<name>.tmp<pid>" beside the file and renames it
        out.append((re.sub(r"^\.(.*)\.tmp\d+$", r"\1", Path(str(path)).name), fig))

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", record)
    return out


def _labelled_rows(fig: matplotlib.figure.Figure) -> list[tuple[str, float]]:
    """(label, row height in pixels) of every labelled heatmap row of a figure."""
    rows = []
    for ax in fig.axes:
        if not ax.images or ax.get_label() == "<colorbar>":
            continue
        labels = [t.get_text() for t in ax.get_yticklabels()]
        height_px = ax.get_position().height * fig.get_size_inches()[1] * fig.dpi
        pitch = height_px / abs(ax.get_ylim()[0] - ax.get_ylim()[1])
        rows += [(x, pitch) for x in labels if x]
    return rows


def test_sixteen_layers_label_every_operand_on_a_zero_based_scale(tmp_path: Path, drawn: list) -> None:
    ops = _run(tmp_path, 16)
    assert len(ops) == 192
    written = write_heatmaps(tmp_path)
    assert sorted(p.name for p in written) == ["numerics_amax.png", "numerics_zero_blocks.png"]
    for name, fig in drawn:
        rows = _labelled_rows(fig)
        assert [x for x, _ in rows] == ops, name  # every operand, in order, once
        assert min(h for _, h in rows) >= 9, name  # a 6-point label (8.3 px at 100 dpi) fits its row
        width, height = fig.get_size_inches() * fig.dpi
        assert height <= 1200 and width <= 2400, (name, width, height)
    zero = dict(drawn)["numerics_zero_blocks.png"]
    (vmin, vmax) = {im.get_clim() for ax in zero.axes for im in ax.images}.pop()
    assert (vmin, vmax) == (0.0, 1.0)  # all-zero fractions: 0 to 1, never a negative fraction
    amax = dict(drawn)["numerics_amax.png"]
    assert len({im.get_clim() for ax in amax.axes for im in ax.images}) == 1  # one scale for all panels


def test_a_deeper_model_gets_one_figure_per_group_of_layers(tmp_path: Path, drawn: list) -> None:
    from lptrain.train.numerics_report import PANEL_ROWS, panels

    ops = _run(tmp_path, 20, steps=2, amax=False)
    (tmp_path / "numerics_zero_blocks.png").write_bytes(b"")  # an earlier drawing, one figure
    (tmp_path / "numerics_zero_blocks_layers_0-99.png").write_bytes(b"")  # another split's
    names = sorted(p.name for p in write_heatmaps(tmp_path))
    assert names == ["numerics_zero_blocks_layers_0-15.png", "numerics_zero_blocks_layers_16-19.png"]
    assert sorted(p.name for p in tmp_path.glob("*.png")) == names
    assert [x for _, fig in drawn for x, _ in _labelled_rows(fig)] == ops
    # a layer larger than a panel (many experts) is cut in rows; whole layers otherwise
    moe = [f"layers.0.mlp.experts.linear_fc1.grad{i}" for i in range(60)] + _operands(2)[12:]
    cut = panels(moe)
    assert [len(p) for p in cut] == [PANEL_ROWS, 12 + 12]
    assert [o for p in cut for o in p] == moe
