"""Data-pipeline benchmark: tokenization MB/s and loader tokens/s (not a test; prints tables).

1. ``prepare-data`` throughput on the Python stdlib sources (capped, see ``--mb``), byte and
   BPE tokenizers, 1 and 2 workers, end to end (read, tokenize, pack, checksum, write),
   against the tokenizer's own batch encoding of the same documents already in memory, in
   the same run: ``tokenizers``' ``encode_batch`` single-threaded (the 1-worker baseline)
   and on its Rust thread pool (the 2-worker baseline); for the byte tokenizer, its own
   ``encode_batch``. Targets: prepare-data >= 85% of the baseline, 2 workers >= 1.6x one.
   All candidates are timed in alternating rounds (``bench/harness.py``: repeated until each
   ratio's median is known within ``--spread`` or ``--cap`` seconds pass).
2. Loader throughput: tokens/s delivered by GPTDataset + BlendedStream + GlobalBatchSampler
   + collation into torch tensors, against a plain ``numpy.memmap`` slice-and-copy of the same
   token file at random offsets (target: loader >= 50% of raw).
   Both are timed in alternating short rounds (``--seconds`` each), repeated the same way.
3. Loader tokens/s over the tokens/s one tiny_cpu training step consumes (2 layers, hidden 64,
   seq 128, batch 4, plain PyTorch forward + backward; or ``--step-tokens-per-s``),
   target >= 100x.
Every ratio is the median of per-round ratios, with its spread and min/min; a figure more
than 25% worse than ``bench/baseline.json`` reads REGRESSED (``--save-baseline`` accepts).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import os
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import torch
from harness import Figure, Ratio, add_args, report, rounds
from rich.console import Console

from lptrain.config.schema import DataConfig
from lptrain.data.builtin import stdlib_files
from lptrain.data.indexed import IndexedDataset
from lptrain.data.loader import build_train_valid_loaders
from lptrain.data.prepare import available_cpus, prepare_dataset
from lptrain.data.sources import iter_documents
from lptrain.data.tokenizer import ByteTokenizer, train_bpe


@contextlib.contextmanager
def _parallelism(on: bool) -> Iterator[None]:
    old = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "true" if on else "false"
    try:
        yield
    finally:
        if old is None:
            del os.environ["TOKENIZERS_PARALLELISM"]
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = old


def bench_tokenize(files: list[Path], tmp: Path, bpe_vocab: int, args: argparse.Namespace) -> tuple[list[Figure], str]:
    """Per tokenizer: prepare-data against the baselines and 2 workers against 1 (figures)."""
    import tokenizers

    tok_path = tmp / "bench.tokenizer.json"
    docs = [t for t, _ in iter_documents(files) if t]
    train_bpe(docs[: max(1, len(docs) // 4)], bpe_vocab, tok_path)
    mb = sum(len(d.encode()) for d in docs) / 1e6
    raw_bpe = tokenizers.Tokenizer.from_file(str(tok_path))

    def bpe_single() -> None:
        with _parallelism(False):
            raw_bpe.encode_batch(docs, add_special_tokens=False)

    def bpe_pool() -> None:
        with _parallelism(True):
            raw_bpe.encode_batch(docs, add_special_tokens=False)

    def prepare(name: str, spec: str, workers: int) -> Callable[[], object]:
        return lambda: prepare_dataset([], tmp / f"tok-{name}-{workers}", spec, files=files, workers=workers)

    def io_floor() -> None:
        """What any byte-level dataset costs without tokenizing: read every file, widen to
        uint16, checksum (blake2b, as the index does) and write -- prepare-data's floor."""
        h = hashlib.blake2b(digest_size=32)
        with open(tmp / "floor.bin", "wb") as out:
            for f in files:
                data = np.frombuffer(f.read_bytes(), dtype=np.uint8).astype(np.uint16).tobytes()
                h.update(data)
                out.write(data)

    figures, lines = [], []
    for name, spec, base1, base2 in (
        ("byte", "byte", ("own encode_batch", lambda: ByteTokenizer().encode_batch(docs)),
         ("read+checksum+write", io_floor)),
        (f"bpe-{bpe_vocab}", str(tok_path), ("encode_batch 1 thread", bpe_single),
         ("encode_batch Rust pool", bpe_pool)),
    ):
        fns = {"base1": base1[1], "base2": base2[1], "prep1": prepare(name, spec, 1), "prep2": prepare(name, spec, 2)}
        byte = name == "byte"
        # MB/s ratios are time ratios inverted (num = the baseline's time); byte: its encoding
        # is a memory copy and a second worker has nothing to take over: its rows are info
        ratios = [
            Ratio(f"{name} prepare 1 worker / {base1[0]}", "base1", "prep1", None if byte else 0.85, True),
            Ratio(f"{name} prepare 2 workers / {base2[0] if not byte else base1[0]}",
                  "base1" if byte else "base2", "prep2", None if byte else 0.85, True),
            Ratio(f"{name} 2 workers / 1 worker", "prep1", "prep2", None if byte else 1.6, True),
        ]
        if byte:
            ratios.append(Ratio(f"{name} prepare 1 worker / {base2[0]}", "base2", "prep1", None, True))
        r = rounds(args, ratios).run(fns, warmup=0)
        figures += r.figures()
        lines.append(f"{name}: {mb:.1f} MB, {r.n} rounds ({r.stop_reason()}); "
                     + ", ".join(f"{k} {mb / min(v):.2f} MB/s best" for k, v in r.series.items()))
    return figures, "\n".join(lines)


def _timed(fn, tokens_per_call: int, seconds: float) -> float:  # type: ignore[no-untyped-def]
    fn()
    n, t0 = 0, time.perf_counter()
    while (dt := time.perf_counter() - t0) < seconds:
        fn()
        n += 1
    return n * tokens_per_call / dt


def bench_loader(prefix: str, seq: int, mbs: int, args: argparse.Namespace, step_rate: float) -> list[Figure]:
    cfg = DataConfig(source=prefix, split_valid_fraction=0.0)
    train, _ = build_train_valid_loaders(cfg, seq, mbs, mbs, 0, 1, 259)

    ds = IndexedDataset(prefix)
    # the baseline stays a plain memory map of the token file: the loader reads with pread
    # (no SIGBUS on a truncated file), and that cost belongs to the loader's side
    mm = np.memmap(ds.tokens.path, dtype=ds.dtype, mode="r", shape=(ds.tokens.num_tokens,))
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

    # costs in seconds per token (the inverse of each short window's rate)
    window = args.seconds / 3
    costs = {"loader": lambda: 1 / _timed(lambda: next(train), mbs * seq, window),
             "raw": lambda: 1 / _timed(raw, mbs * seq, window)}
    r = rounds(args, [Ratio(f"loader / raw memmap, seq {seq} mbs {mbs}", "raw", "loader", 0.5, True)])
    while not r.done():
        r.add({k: f() for k, f in costs.items()})
    figures = r.figures()
    if seq == 128:
        figures.append(Figure(f"loader / tiny step, seq {seq} mbs {mbs}",
                              [1 / c / step_rate for c in r.series["loader"]], 100.0, True, unit="x"))
    return figures


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
    ap.add_argument("--seconds", type=float, default=1.5, help="time per loader/step measurement round")
    ap.add_argument("--step-tokens-per-s", type=float, default=None, help="skip timing the tiny step")
    add_args(ap, cap_s=25.0, min_rounds=3)
    args = ap.parse_args()
    torch.set_num_threads(2)
    console = Console(width=130)
    files = stdlib_files(int(args.mb * 1e6))
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        figures, tok_note = bench_tokenize(files, tmp, args.bpe_vocab, args)
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
        for seq, mbs in ((128, 4), (1024, 8), (4096, 8)):
            figures += bench_loader(prefix, seq, mbs, args, step)
        src = (
            "given"
            if args.step_tokens_per_s
            else f"measured: 2 layers, hidden 64, seq 128, batch 4, fwd+bwd+AdamW, {step_threads} torch thread(s)"
        )
    note = (f"prepare-data on {len(files)} stdlib files, {available_cpus()} CPUs (other load on a shared machine "
            f"lowers the 2-worker scaling)\n{tok_note}\ntiny_cpu step consumes {step:,.0f} tokens/s ({src})")
    report(console, "data", "data pipeline: prepare-data and loader throughput (ratios of rates)", figures, args, note)


if __name__ == "__main__":
    main()
