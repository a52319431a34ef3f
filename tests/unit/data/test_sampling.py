"""GPT samples, epochs, blends and the global-batch sampler (coverage, resume, determinism)."""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest
from datasynth import unique_docs, write_token_dataset

from lptrain.data.blend import BlendedStream
from lptrain.data.errors import DataError
from lptrain.data.gpt_dataset import GPTDataset, split_documents
from lptrain.data.sampler import GlobalBatchSampler

SEQ = 8
EOS = 59999


def _gpt(tmp_path: Path, num_docs: int = 40, seed: int = 7, name: str = "ds") -> GPTDataset:
    ds = write_token_dataset(tmp_path / name, unique_docs(num_docs, seed=seed))
    return GPTDataset(ds, np.arange(len(ds)), SEQ, seed=seed)


def _read_positions(sampler: GlobalBatchSampler, n_micro: int) -> list[int]:
    return [int(p) for _ in range(n_micro) for p in sampler.next_positions()]


def test_samples_tile_a_document_permutation(tmp_path: Path) -> None:
    """Samples in epoch order concatenate to whole documents (each once) joined by EOS."""
    docs = unique_docs(40, seed=3)
    ds = write_token_dataset(tmp_path / "d", docs)
    g = GPTDataset(ds, np.arange(len(ds)), SEQ, seed=1)
    inv = np.argsort(g.epoch_order(0))  # unshuffled sample j is read at stream index inv[j]
    samples = [g.sample(int(inv[j])) for j in range(len(g))]
    for a, b in itertools.pairwise(samples):
        assert a[-1] == b[0]  # consecutive windows share one token: every token is a label once
    stream = np.concatenate([s[:-1] for s in samples] + [samples[-1][-1:]])
    assert len(stream) == len(g) * SEQ + 1
    pieces = np.split(stream, np.flatnonzero(stream == EOS) + 1)
    by_first = {int(d[0]): d for d in docs}
    seen = set()
    for piece in pieces[:-1]:  # complete documents
        d = by_first[int(piece[0])]
        assert np.array_equal(piece, np.append(d, EOS))
        seen.add(int(piece[0]))
    assert len(seen) == len(pieces) - 1  # no document twice
    tail = pieces[-1]  # a prefix of a document not used yet (dropped remainder of the epoch)
    if len(tail):
        assert int(tail[0]) not in seen and np.array_equal(by_first[int(tail[0])][: len(tail)], tail)
    assert g.num_tokens - len(stream) < SEQ + 1 + 40  # at most a partial sample + one doc dropped


@pytest.mark.parametrize("dp", [1, 2, 4])
def test_one_epoch_covers_every_sample_once(tmp_path: Path, dp: int) -> None:
    g = _gpt(tmp_path)
    stream = BlendedStream([g])
    n = len(g)
    gbs, mbs = 8, 2 if dp < 4 else 1
    n_batches = -(-n // gbs)  # enough global batches to pass the end of epoch 0
    seen: list[int] = []
    for r in range(dp):
        s = GlobalBatchSampler(gbs, mbs, r, dp)
        seen += _read_positions(s, n_batches * s.num_micro_batches)
    assert sorted(seen) == list(range(n_batches * gbs))  # ranks together: no repeats, no gaps
    perm = g.epoch_order(0)
    epoch0 = sorted(int(perm[stream.locate(p)[1]]) for p in seen if p < n)
    assert epoch0 == list(range(n))  # every sample of the epoch exactly once
    assert all(stream.locate(p)[1] // n == 1 for p in seen if p >= n)  # the rest is epoch 1


def test_dp_ranks_read_disjoint_slices_of_each_global_batch() -> None:
    gbs, mbs, dp = 16, 2, 4
    per_batch: list[set[int]] = [set() for _ in range(3)]
    for r in range(dp):
        s = GlobalBatchSampler(gbs, mbs, r, dp)
        for b in range(3):
            pos = _read_positions(s, s.num_micro_batches)
            assert not per_batch[b] & set(pos)
            per_batch[b] |= set(pos)
    assert per_batch == [set(range(b * gbs, (b + 1) * gbs)) for b in range(3)]


@pytest.mark.parametrize(("dp_before", "dp_after"), [(2, 4), (4, 1), (1, 2)])
def test_resume_with_different_dp_has_no_repeats_or_gaps(dp_before: int, dp_after: int) -> None:
    gbs, mbs = 8, 1
    seen: list[int] = []
    states = []
    for r in range(dp_before):
        s = GlobalBatchSampler(gbs, mbs, r, dp_before)
        seen += _read_positions(s, 3 * s.num_micro_batches)  # 3 optimizer steps
        states.append(s.state_dict())
    assert all(st == {"consumed_samples": 3 * gbs} for st in states)
    for r in range(dp_after):
        s = GlobalBatchSampler(gbs, mbs, r, dp_after)
        s.load_state_dict(states[0])
        seen += _read_positions(s, 2 * s.num_micro_batches)
    assert sorted(seen) == list(range(5 * gbs))


def test_multi_epoch_reshuffles(tmp_path: Path) -> None:
    g = _gpt(tmp_path)
    n = len(g)
    e0 = [g.sample(s)[0] for s in range(n)]
    e1 = [g.sample(s)[0] for s in range(n, 2 * n)]
    assert sorted(g.epoch_order(0)) == sorted(g.epoch_order(1)) == list(range(n))
    assert not np.array_equal(g.epoch_order(0), g.epoch_order(1))
    assert e0 != e1
    # The documents are also laid out in another order, so sample boundaries move.
    assert set(map(int, e0)) != set(map(int, e1))


def test_same_seed_same_samples_different_seed_differs(tmp_path: Path) -> None:
    ds = write_token_dataset(tmp_path / "d", unique_docs(40))
    a = GPTDataset(ds, np.arange(len(ds)), SEQ, seed=5)
    b = GPTDataset(ds, np.arange(len(ds)), SEQ, seed=5)
    c = GPTDataset(ds, np.arange(len(ds)), SEQ, seed=6)
    sa = np.stack([a.sample(i) for i in range(30)])
    assert np.array_equal(sa, np.stack([b.sample(i) for i in range(30)]))
    assert not np.array_equal(sa, np.stack([c.sample(i) for i in range(30)]))


@pytest.mark.parametrize("weights", [[0.5, 0.3, 0.2], [1.0, 1.0, 8.0], [0.7, 0.0, 0.3]])
def test_blend_follows_weights(tmp_path: Path, weights: list[float]) -> None:
    parts = [_gpt(tmp_path, 20 + 10 * k, seed=k, name=f"b{k}") for k in range(3)]
    blend = BlendedStream(parts, weights)
    w = np.asarray(weights) / sum(weights)
    which = blend.dataset_of(np.arange(5000))
    counts = np.zeros(3)
    for n, k in enumerate(which, start=1):
        counts[k] += 1
        # Greedy error-minimising interleave: every prefix is within one sample of w * n.
        assert np.all(np.abs(counts - w * n) <= 1.0)
    # Each dataset's picks read its own stream in order 0, 1, 2, ... (it cycles its epochs).
    for k in range(3):
        pos = [blend.locate(p)[1] for p in np.flatnonzero(which == k)[:50]]
        assert pos == list(range(len(pos)))


def test_blend_default_weights_by_size_and_bad_weights(tmp_path: Path) -> None:
    a, b = _gpt(tmp_path, 20, name="a"), _gpt(tmp_path, 60, seed=2, name="b")
    blend = BlendedStream([a, b])
    expect = len(a) / (len(a) + len(b))
    assert abs(blend.weights[0] - expect) < 1e-12
    with pytest.raises(DataError, match="2 datasets"):
        BlendedStream([a, b], [1.0])
    with pytest.raises(DataError, match="not all 0"):
        BlendedStream([a, b], [0.0, 0.0])


def test_split_is_disjoint_and_seeded() -> None:
    tr, va = split_documents(100, 0.1, seed=3)
    assert len(va) == 10 and len(tr) == 90 and not set(tr) & set(va)
    assert sorted([*tr, *va]) == list(range(100))
    tr2, va2 = split_documents(100, 0.1, seed=3)
    assert np.array_equal(va, va2) and np.array_equal(tr, tr2)
    assert not np.array_equal(va, split_documents(100, 0.1, seed=4)[1])
    assert len(split_documents(10, 0.001, seed=0)[1]) == 1  # a positive fraction holds out >= 1 doc
    with pytest.raises(DataError, match="no training documents left"):
        split_documents(1, 0.5, seed=0)


def test_too_small_dataset(tmp_path: Path) -> None:
    ds = write_token_dataset(tmp_path / "t", [np.array([1, 2])])
    with pytest.raises(DataError, match="fewer than one sample of seq_length \\+ 1 = 9 tokens"):
        GPTDataset(ds, np.arange(1), SEQ, seed=0)


def test_sampler_layout_errors() -> None:
    with pytest.raises(DataError, match="global_batch_size 10 is not a multiple of micro_batch_size 2 x dp_size 4"):
        GlobalBatchSampler(10, 2, 0, 4)
    with pytest.raises(DataError, match="dp_rank=4"):
        GlobalBatchSampler(8, 1, 4, 4)
