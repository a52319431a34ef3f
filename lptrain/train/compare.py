"""``lptrain compare RUN_A RUN_B``: where two runs part, step by step and layer by layer.

Both runs' ``metrics.jsonl`` are read (torch-free); on the steps both have, the loss, the
grad norm, the learning rate of every param group, the validation loss and every operand's
quantization statistics (``logging.numerics_interval``: at the steps where both runs collected
them, the statistics both report) are compared. Two values differ when
their relative difference ``|a - b| / max(|a|, |b|)`` is above the tolerance (0: bitwise; a
value missing or null on one side only differs too). The report names the first step where
anything differs and what, and -- among the steps with statistics -- the first step and the
first operand, in the order the step computes them (forward operands, then output grads
from the last layer back), whose statistics differ: for "FP8 against bf16" or "which
commit broke it", where the runs part and which layer parts first. The settings that differ
between the two ``resolved_config.yaml`` are listed too, and :func:`write_overlay` draws the
loss and grad norm of both runs with the first difference marked.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from lptrain.errors import InputError
from lptrain.train.jsonl import step_records

STEP_FIELDS = ("loss", "grad_norm", "lr", "val_loss")


def _records(run_dir: Path) -> dict[int, dict[str, Any]]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise InputError(f"{path} not found: not a run folder written by lptrain pretrain",
                         file=str(path), fix="pass two run folders (each holds metrics.jsonl)")
    return {int(rec["step"]): rec for rec in step_records(path)}


def rel_diff(a: Any, b: Any) -> float:
    """``|a - b| / max(|a|, |b|)`` (0 when equal, inf when one side is missing or not a
    number)."""
    if a == b:
        return 0.0
    if not isinstance(a, (int, float)) or not isinstance(b, (int, float)):
        return math.inf
    if not (math.isfinite(a) and math.isfinite(b)):
        return math.inf
    return abs(a - b) / max(abs(a), abs(b))


@dataclass(frozen=True)
class Difference:
    step: int
    what: str  # "loss", "lr (adamw_decay)", "layers.0.mlp.linear_fc1.grad: amax", ...
    a: Any
    b: Any
    rel: float


@dataclass
class Comparison:
    """What :func:`compare_runs` found."""

    steps_a: int
    steps_b: int
    common: list[int]
    tolerance: float
    first: list[Difference] = field(default_factory=list)  # everything differing at first step
    first_layer: Optional[Difference] = None
    settings: list[tuple[str, Any, Any]] = field(default_factory=list)
    operands: int = 0

    @property
    def identical(self) -> bool:
        return not self.first and self.first_layer is None

    @property
    def first_step(self) -> Optional[int]:
        return self.first[0].step if self.first else None


def _step_values(rec: dict[str, Any]) -> dict[str, Any]:
    out = {k: rec.get(k) for k in STEP_FIELDS if k != "lr"}
    for group, lr in (rec.get("lrs") or {"lr": rec.get("lr")}).items():
        out[f"lr ({group})"] = lr
    return out


def _step_diffs(step: int, a: dict[str, Any], b: dict[str, Any], tol: float) -> list[Difference]:
    va, vb = _step_values(a), _step_values(b)
    out = []
    for k in dict.fromkeys([*va, *vb]):
        r = rel_diff(va.get(k), vb.get(k))
        if r > tol:
            out.append(Difference(step, k, va.get(k), vb.get(k), r))
    return out


def execution_order(operands: list[str]) -> list[str]:
    """Operands (``<module>.<role>[i]``, modules in forward order) in the order a step
    computes them: the inputs and weights in forward order, then the output grads in
    backward order (the last module's first)."""
    modules: dict[str, int] = {}
    for op in operands:
        modules.setdefault(op.rpartition(".")[0], len(modules))

    def key(op: str) -> tuple[int, int, str]:
        module, _, tail = op.rpartition(".")
        i = modules[module]
        return (1, -i, tail) if tail.startswith("grad") else (0, i, tail)

    return sorted(dict.fromkeys(operands), key=key)


def _layer_diff(step: int, a: dict[str, Any], b: dict[str, Any], tol: float) -> Optional[Difference]:
    """The first operand, in the order the step computes them (:func:`execution_order`),
    whose statistics differ at ``step``: its statistic with the largest relative difference. Only the
    statistics both runs report for it are compared (a bf16 GEMM reports its amax, an FP8
    one its scales and errors too); an operand one run lacks differs."""
    for op in execution_order([*a, *b]):
        if (op in a) != (op in b):
            return Difference(step, f"{op}: present", op in a, op in b, math.inf)
        sa, sb = a[op] or {}, b[op] or {}
        worst: Optional[Difference] = None
        for stat in [k for k in sa if k in sb]:
            r = rel_diff(sa.get(stat), sb.get(stat))
            if r > tol and (worst is None or r > worst.rel):
                worst = Difference(step, f"{op}: {stat}", sa.get(stat), sb.get(stat), r)
        if worst is not None:
            return worst
    return None


def _flat(d: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(d, dict):
        return {prefix: d}
    out: dict[str, Any] = {}
    for k, v in d.items():
        out.update(_flat(v, f"{prefix}{k}." if isinstance(v, dict) else f"{prefix}{k}"))
    return out


# settings that name the run or where it writes: different for any two runs
_IDENTITY = ("run.name", "run.output_dir", "checkpoint.save", "checkpoint.load", "logging.")


def _settings(run: Path) -> Optional[dict[str, Any]]:
    """A run's resolved settings, flattened; None without the file (the comparison goes on
    without them); a file that is not UTF-8 or not YAML is an :class:`InputError` (exit 2)."""
    import yaml

    from lptrain.config.yaml_files import load_bounded

    path = run / "resolved_config.yaml"
    try:
        text = path.read_bytes().decode("utf-8")
        loaded = load_bounded(text, str(path))
    except OSError:
        return None
    except (UnicodeDecodeError, yaml.YAMLError) as e:
        what = "is not UTF-8 text" if isinstance(e, UnicodeDecodeError) else "is not valid YAML"
        raise InputError(f"{path} {what} (the file was damaged or edited)", file=str(path),
                         fix="restore it from the run's checkpoint (iter_*/resolved_config.yaml) "
                             "or remove it to compare without settings") from None
    return _flat(loaded) if isinstance(loaded, dict) else {}


def setting_differences(a: Path, b: Path) -> list[tuple[str, Any, Any]]:
    """``(key, value in A, value in B)`` for the resolved settings that differ (where a run
    writes and what it is called left out)."""
    ca, cb = _settings(a), _settings(b)
    if ca is None or cb is None:
        return []
    keys = [k for k in dict.fromkeys([*ca, *cb]) if not k.startswith(_IDENTITY)]
    return [(k, ca.get(k), cb.get(k)) for k in keys if ca.get(k) != cb.get(k)]


def compare_runs(run_a: str | Path, run_b: str | Path, tol: float = 0.0) -> Comparison:
    a_dir, b_dir = Path(run_a), Path(run_b)
    ra, rb = _records(a_dir), _records(b_dir)
    common = sorted(set(ra) & set(rb))
    cmp = Comparison(len(ra), len(rb), common, tol, settings=setting_differences(a_dir, b_dir))
    ops: set[str] = set()
    for step in common:
        na, nb = ra[step].get("numerics"), rb[step].get("numerics")
        layer = None
        if isinstance(na, dict) and isinstance(nb, dict):  # steps where both runs collected
            ops.update(na, nb)
            if cmp.first_layer is None:
                layer = cmp.first_layer = _layer_diff(step, na, nb, tol)
        if not cmp.first:
            cmp.first = _step_diffs(step, ra[step], rb[step], tol) + ([layer] if layer else [])
        if cmp.first and cmp.first_layer is not None:
            break
    cmp.operands = len(ops)
    return cmp


def _fmt(v: Any) -> str:
    return f"{v:.6g}" if isinstance(v, float) else str(v)


def distinct(a: Any, b: Any) -> tuple[str, str]:
    """``a`` and ``b`` with enough digits to tell them apart (6 significant digits when
    those already differ, up to the 17 that round-trip a float): a differing value never
    prints the same as its counterpart."""
    if not (isinstance(a, float) and isinstance(b, float)) or a == b:
        return _fmt(a), _fmt(b)
    for digits in range(6, 18):
        sa, sb = f"{a:.{digits}g}", f"{b:.{digits}g}"
        if sa != sb:
            return sa, sb
    return repr(a), repr(b)


def _diff_text(d: Difference) -> str:
    a, b = distinct(d.a, d.b)
    rel = "" if math.isinf(d.rel) else f" (relative {d.rel:.2g})"
    return f"{d.what} {a} vs {b}{rel}"


def report_lines(cmp: Comparison, a: str, b: str) -> list[str]:
    tol = "0 (bitwise)" if cmp.tolerance == 0 else f"{cmp.tolerance:g} (relative)"
    lines = [f"A: {a} ({cmp.steps_a} steps), B: {b} ({cmp.steps_b} steps); {len(cmp.common)} "
             f"common steps; tolerance {tol}"]
    if cmp.settings:
        shown = ", ".join(f"{k} ({_fmt(x)} vs {_fmt(y)})" for k, x, y in cmp.settings[:8])
        more = f" and {len(cmp.settings) - 8} more" if len(cmp.settings) > 8 else ""
        lines.append(f"settings that differ: {shown}{more}")
    if not cmp.common:
        lines.append("no common steps to compare")
        return lines
    if cmp.identical:
        what = "loss, grad norm, lr" + (f" and {cmp.operands} operands' statistics" if cmp.operands else "")
        extra = "" if cmp.steps_a == cmp.steps_b == len(cmp.common) else " (over the common steps)"
        lines.append(f"identical{extra}: {what} equal at every common step")
        return lines
    if cmp.first:
        d0 = cmp.first[0]
        diffs = "; ".join(_diff_text(d) for d in cmp.first[:6])
        lines.append(f"first difference at step {d0.step}: {diffs}")
    if cmp.first_layer is not None:
        d = cmp.first_layer
        a, b = distinct(d.a, d.b)
        lines.append(f"first layer to differ: {d.what.split(':')[0]} at step {d.step} "
                     f"({d.what.split(': ')[1]} {a} vs {b}, relative {d.rel:.2g})")
    elif cmp.operands:
        lines.append("no layer's statistics differ on the steps that have them")
    return lines


PLOT_FIX = "pass --plot FILE.png or --plot DIR naming a writable folder, or --no-plot"


def plot_path(plot: Optional[Path], run_a: Path, run_b: Path) -> Path:
    """Where the overlay goes: ``--plot FILE.png`` as named; ``--plot DIR`` (an existing
    folder) or no ``--plot``: ``compare_vs_<B>.png`` in DIR, or in run A's folder (beside its
    own plots, never the current folder). :class:`InputError` for a name that is not a PNG
    or a folder that does not exist, before anything is compared."""
    name = f"compare_vs_{run_b.resolve().name or 'run'}.png"
    if plot is None:
        return run_a / name
    if plot.is_dir():
        return plot / name
    if plot.suffix.lower() != ".png":
        raise InputError(f"--plot {plot}: the overlay is a PNG, and {plot.name!r} neither ends in "
                         ".png nor is an existing folder", fix=PLOT_FIX)
    if not plot.parent.is_dir():
        raise InputError(f"--plot {plot}: folder {plot.parent} does not exist",
                         fix=f"create it first, or {PLOT_FIX}")
    return plot


def write_overlay(run_a: str | Path, run_b: str | Path, path: str | Path,
                  first_step: Optional[int], labels: tuple[str, str]) -> Path:
    """Loss and grad norm of both runs, one panel each, the first difference marked;
    a file that cannot be written is an :class:`InputError` (exit 2) naming it."""
    try:
        return _write_overlay(run_a, run_b, path, first_step, labels)
    except OSError as e:
        raise InputError(f"cannot write the overlay plot {path}: {e.strerror or e}",
                         fix=PLOT_FIX) from None


def _write_overlay(run_a: str | Path, run_b: str | Path, path: str | Path,
                   first_step: Optional[int], labels: tuple[str, str]) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from lptrain.train.plots import save_png

    runs = [_records(Path(run_a)), _records(Path(run_b))]
    fig, axes = plt.subplots(2, 1, figsize=(7, 6), sharex=True)
    for ax, key, label in ((axes[0], "loss", "train loss"), (axes[1], "grad_norm", "grad norm")):
        for recs, name, style in zip(runs, labels, ("-", "--"), strict=True):
            pts = [(s, r[key]) for s, r in sorted(recs.items()) if r.get(key) is not None]
            if pts:
                ax.plot(*zip(*pts, strict=True), style, label=name)
        if first_step is not None:
            ax.axvline(first_step, color="red", alpha=0.5, label=f"first difference (step {first_step})")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    if axes[0].get_legend_handles_labels()[0]:  # two empty runs: no curve, no legend
        axes[0].legend(fontsize=8)
    axes[1].set_xlabel("step")
    fig.tight_layout()
    try:
        return save_png(fig, Path(path), dpi=110)
    finally:
        plt.close(fig)
