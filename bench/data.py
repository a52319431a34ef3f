"""Data-pipeline benchmark: tokenization MB/s and loader tokens/s (not a test; prints tables).

1. ``prepare-data`` throughput on the Python stdlib sources (capped, see ``--mb``): byte and
   BPE tokenizers, 1 and 2 worker processes (end to end: read, tokenize, write, checksum).
2. Loader throughput: tokens/s delivered by GPTDataset + BlendedStream + GlobalBatchSampler
   + collation into torch tensors, against a plain ``numpy.memmap`` slice-and-copy of the same
   token file at random offsets (target: loader >= 50% of raw).
   Both are timed in alternating short rounds, best round each (robust on a shared machine).
3. Loader tokens/s over the tokens/s one tiny_cpu training step consumes (2 layers, hidden 64,
   seq 128, batch 4, plain PyTorch forward + backward; or ``--step-tokens-per-s``),
   target >= 100x.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from rich.console import Console
from rich.table import Table

from lptrain.config.schema import DataConfig
from lptrain.data.builtin import stdlib_files
from lptrain.data.indexed import IndexedDataset
from lptrain.data.loader import build_train_valid_loaders
from lptrain.data.prepare import prepare_dataset
from lptrain.data.sources import iter_documents
from lptrain.data.tokenizer import train_bpe


def bench_tokenize(files: list[Path], tmp: Path, bpe_vocab: int) -> list[tuple[str, int, float, int]]:
    rows = []
    tok_path = tmp / "bench.tokenizer.json"
    sample = [t for t, _ in iter_documents(files[: max(1, len(files) // 4)]) if t]
    train_bpe(sample, bpe_vocab, tok_path)
    mb = sum(f.stat().st_size for f in files) / 1e6
    for name, spec in (("byte", "byte"), (f"bpe-{bpe_vocab}", str(tok_path))):
        for workers in (1, 2):
            t0 = time.perf_counter()
            rep = prepare_dataset([], tmp / f"tok-{name}-{workers}", spec, files=files, workers=workers)
            dt = time.perf_counter() - t0
            rows.append((name, workers, mb / dt, rep.header["num_tokens"]))
    return rows


def _timed(fn, tokens_per_call: int, seconds: float) -> float:  # type: ignore[no-untyped-def]
    fn()
    n, t0 = 0, time.perf_counter()
    while (dt := time.perf_counter() - t0) < seconds:
        fn()
        n += 1
    return n * tokens_per_call / dt


def _best_interleaved(fns: list, tokens_per_call: int, seconds: float, rounds: int = 6) -> list[float]:  # type: ignore[type-arg]
    """Best-of-rounds rate of each fn, alternating short rounds so that load from other
    processes on a shared machine hits all candidates alike."""
    best = [0.0] * len(fns)
    for _ in range(rounds):
        for k, fn in enumerate(fns):
            best[k] = max(best[k], _timed(fn, tokens_per_call, seconds / rounds))
    return best


def bench_loader(prefix: str, seq: int, mbs: int, seconds: float) -> tuple[float, float]:
    cfg = DataConfig(source=prefix, split_valid_fraction=0.0)
    train, _ = build_train_valid_loaders(cfg, seq, mbs, mbs, 0, 1, 259)

    mm = IndexedDataset(prefix).tokens
    rng = np.random.default_rng(0)
    starts = rng.integers(0, len(mm) - seq - 1, size=1 << 16)
    state = {"i": 0}

    def raw() -> None:
        i = state["i"]
        state["i"] = (i + mbs) % (len(starts) - mbs)
        buf = np.empty((mbs, seq + 1), dtype=np.int64)
        for r in range(mbs):
            s = int(starts[i + r])
            buf[r] = mm[s : s + seq + 1]
        _ = (torch.from_numpy(np.ascontiguousarray(buf[:, :-1])), torch.from_numpy(np.ascontiguousarray(buf[:, 1:])))

    loader_rate, raw_rate = _best_interleaved([lambda: next(train), raw], mbs * seq, 2 * seconds)
    return loader_rate, raw_rate


def tiny_step_tokens_per_s(seconds: float) -> float:
    """Forward + backward + AdamW step of a 2-layer, hidden-64 causal transformer (seq 128, batch 4)."""
    torch.manual_seed(0)
    vocab, hidden, seq, batch = 259, 64, 128, 4
    layer = torch.nn.TransformerEncoderLayer(hidden, 4, 4 * hidden, dropout=0.0, batch_first=True, norm_first=True)
    model = torch.nn.ModuleDict(
        {
            "emb": torch.nn.Embedding(vocab, hidden),
            "blocks": torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False),
            "head": torch.nn.Linear(hidden, vocab),
        }
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    mask = torch.nn.Transformer.generate_square_subsequent_mask(seq)
    tokens = torch.randint(0, vocab, (batch, seq))
    labels = torch.randint(0, vocab, (batch, seq))

    def step() -> None:
        h = model["blocks"](model["emb"](tokens), mask=mask, is_causal=True)
        loss = torch.nn.functional.cross_entropy(model["head"](h).flatten(0, 1), labels.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return _timed(step, batch * seq, seconds)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", type=float, default=8.0, help="corpus size: first N MB of the stdlib sources")
    ap.add_argument("--bpe-vocab", type=int, default=4096)
    ap.add_argument("--seconds", type=float, default=1.5, help="time per loader/step measurement")
    ap.add_argument("--step-tokens-per-s", type=float, default=None, help="skip timing the tiny step")
    args = ap.parse_args()
    torch.set_num_threads(2)
    console = Console()
    files = stdlib_files(int(args.mb * 1e6))
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        tok_rows = bench_tokenize(files, tmp, args.bpe_vocab)
        t = Table(title=f"prepare-data throughput ({len(files)} stdlib files, {sum(f.stat().st_size for f in files) / 1e6:.1f} MB)")
        for c in ("tokenizer", "workers", "MB/s", "tokens"):
            t.add_column(c, justify="right")
        for name, w, mbs, ntok in tok_rows:
            t.add_row(name, str(w), f"{mbs:.1f}", f"{ntok:,}")
        console.print(t)

        prefix = str(tmp / "tok-byte-1")
        # Fastest of 1 and 2 torch threads (oversubscribed threads can be far slower on a busy
        # machine); the faster step is the stricter bound for the loader/step ratio.
        step = args.step_tokens_per_s
        if step is None:
            rates = {}
            for threads in (1, 2):
                torch.set_num_threads(threads)
                rates[threads] = tiny_step_tokens_per_s(args.seconds)
            step_threads = max(rates, key=lambda k: rates[k])
            step = rates[step_threads]
        t = Table(title="loader throughput (byte dataset, tokens/s)")
        for c in ("seq", "mbs", "loader", "raw memmap", "loader/raw", "loader/tiny step"):
            t.add_column(c, justify="right")
        for seq, mbs in ((128, 4), (1024, 8), (4096, 8)):
            loader, raw = bench_loader(prefix, seq, mbs, args.seconds)
            t.add_row(str(seq), str(mbs), f"{loader / 1e6:.1f} M", f"{raw / 1e6:.1f} M",
                      f"{loader / raw:.0%}", f"{loader / step:.0f}x" if seq == 128 else "")
        console.print(t)
        src = (
            "given"
            if args.step_tokens_per_s
            else f"measured: 2 layers, hidden 64, seq 128, batch 4, fwd+bwd+AdamW, {step_threads} torch thread(s)"
        )
        console.print(f"tiny_cpu step consumes {step:,.0f} tokens/s ({src}); targets: loader/raw >= 50%, loader/step >= 100x")


if __name__ == "__main__":
    main()
