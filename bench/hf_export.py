"""Hugging Face export / import speed for the 1B layout's shapes (not a test; prints a table).

The canonical fp32 masters of ``bf16_adamw.yaml``'s model (configs/model/gpt_1b.yaml: 16
layers, hidden 2048, GQA 16/8, SwiGLU 8192) are laid out from a model built on the meta
device, then materialised once (``torch.empty``: the values do not matter for speed).

* export: canonical fp32 -> Hugging Face tensors in ``--dtype`` (QKV split per group,
  ``[gate | up]`` split, vocabulary padding cut) -> sharded ``model.safetensors``
  (``lptrain.interop``), against ``safetensors.torch.save_file`` of the same tensors cast
  to ``--dtype`` (no cuts);
* import: the folder -> canonical fp32 (``read_safetensors`` + ``from_hf``), against
  ``safetensors.torch.load_file`` of the baseline's file and the cast to fp32.

Both are reported in seconds per GB of written weights, each with its ratio to the baseline
measured in the same run (alternating rounds, the page cache warm for both, repeated until
each ratio's median is known within ``--spread`` or ``--cap`` seconds pass; ``bench/harness.py``,
REGRESSED against ``bench/baseline.json``). ``--layers`` shrinks the layer count for machines with little memory (peak is about
3x the fp32 size).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

import torch
from harness import Ratio, add_args, report, rounds
from rich.console import Console

from lptrain.config import compose
from lptrain.interop.hf_arch import architecture_for
from lptrain.interop.hf_weights import canonical_shapes, from_hf, to_hf
from lptrain.interop.safetensors_io import read_safetensors, write_safetensors
from lptrain.model import build_model
from lptrain.model.state_dict_adapter import canonical_state_dict

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=16, help="layers of the 1B layout to build (default: all 16)")
    ap.add_argument("--dtype", choices=list(DTYPES), default="bf16")
    ap.add_argument("--max-shard-size", type=int, default=5 * 10**9, help="bytes per shard (transformers: 5GB)")
    add_args(ap, cap_s=60.0, min_rounds=3)
    args = ap.parse_args()
    torch.set_num_threads(2)
    cfg = compose("bf16_adamw.yaml", [f"model.num_layers={args.layers}", "run.device=cpu",
                                      "precision.backend=emulated"])
    arch = architecture_for(cfg.model)
    with torch.device("meta"):
        meta = build_model(cfg, device="meta")
    shapes = {k: v.shape for k, v in canonical_state_dict(meta).items()}
    assert shapes == canonical_shapes(cfg.model, arch)
    masters = {k: torch.empty(s, dtype=torch.float32) for k, s in shapes.items()}
    dtype = DTYPES[args.dtype]
    gb = sum(t.numel() * t.element_size() for t in to_hf(masters, cfg.model, arch, dtype).values()) / 1e9
    st = __import__("safetensors.torch", fromlist=["save_file"])
    with tempfile.TemporaryDirectory() as d:
        ours, base = Path(d) / "ours", Path(d) / "base"
        ours.mkdir()
        base.mkdir()

        def export() -> None:
            write_safetensors(to_hf(masters, cfg.model, arch, dtype), ours, args.max_shard_size)

        def save_file() -> None:
            cast = {k: v.to(dtype) for k, v in masters.items()}  # the same cast, no cuts
            st.save_file(cast, str(base / "model.safetensors"), metadata={"format": "pt"})

        def import_() -> None:
            from_hf(read_safetensors(ours), cfg.model, arch, shapes, "bench")

        def load_file() -> None:
            _ = {k: v.float() for k, v in st.load_file(str(base / "model.safetensors")).items()}

        ratios = [Ratio("export / safetensors save_file", "export", "save_file"),
                  Ratio("import / safetensors load_file", "import", "load_file")]
        r = rounds(args, ratios).run(
            {"export": export, "save_file": save_file, "import": import_, "load_file": load_file}, warmup=0)
    n = sum(s.numel() for s in shapes.values()) / 1e9
    note = (f"{arch.name} {args.layers}-layer 1B layout, {n:.2f}B weights, {gb:.2f} GB in {args.dtype}, "
            f"{r.n} rounds ({r.stop_reason()}): "
            + ", ".join(f"{k} {statistics.median(v) / gb:.2f} s/GB" for k, v in r.series.items())
            + "\nboth sides cast (fp32 -> dtype on export, back to fp32 on import); lptrain also cuts and "
            "merges QKV and gate/up and drops the vocabulary padding")
    report(Console(width=120), "hf_export", "Hugging Face export / import vs safetensors", r.figures(), args, note)


if __name__ == "__main__":
    main()
