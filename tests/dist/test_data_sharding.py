"""Global-batch sharding with real data-parallel ranks, and resume at another DP size.

A synthetic dataset (documents of globally unique token ids, so every sample row is unique
within an epoch) is read through the real ``GPTDataset -> BlendedStream -> BatchIterator``
path. Global batch b of a run that starts at ``consumed_samples = c0`` is, by definition,
the stream positions ``[c0 + b*G, c0 + (b+1)*G)``; every rank gathers all ranks' rows with
``all_gather_object`` and checks that they are disjoint and together exactly that batch.

One 4-rank run: dp=2 (ranks 0-1, a subgroup) reads 3 global batches from scratch; dp=4
resumes from its state (broadcast from rank 0) for 2 batches; dp=2 resumes from that for 1
more. Over the three phases the positions read are exactly ``range(6*G)``: no repeats, no
gaps.
"""

from __future__ import annotations

from typing import Any, Optional

import numpy as np
import pytest
import torch.distributed as dist

from lptrain.testing.dist import run_distributed

pytestmark = pytest.mark.dist

SEQ = 8
GBS = 16
MBS = 2


def _stream(prefix: str) -> Any:
    from lptrain.data.blend import BlendedStream
    from lptrain.data.gpt_dataset import GPTDataset
    from lptrain.data.indexed import IndexedDataset

    ds = IndexedDataset(prefix)
    return BlendedStream([GPTDataset(ds, np.arange(len(ds)), SEQ, seed=5)])


def _read_global_batches(
    stream: Any,
    dp_rank: int,
    dp_size: int,
    state: Optional[dict[str, Any]],
    n_batches: int,
    group: Any,
) -> tuple[list[int], dict[str, Any]]:
    """Read ``n_batches`` global batches on this rank, check each across the group's ranks;
    return the positions read by *all* ranks (same list on every rank) and the final state."""
    from lptrain.data.loader import BatchIterator, collate
    from lptrain.data.sampler import GlobalBatchSampler

    it = BatchIterator(stream, GlobalBatchSampler(GBS, MBS, dp_rank, dp_size))
    if state is not None:
        it.load_state_dict(state)
    c0 = it.consumed_samples
    horizon = np.arange(c0, c0 + n_batches * GBS)
    ref_rows = collate(stream, horizon)["tokens"].tolist()
    where = {tuple(row): int(p) for row, p in zip(ref_rows, horizon, strict=True)}
    assert len(where) == len(horizon), "sample rows are not unique; the test data is too small"
    seen: list[int] = []
    for b in range(n_batches):
        mine = []
        for _ in range(it.sampler.num_micro_batches):
            mine += [tuple(r) for r in next(it)["tokens"].tolist()]
        gathered: list[Any] = [None] * dp_size
        dist.all_gather_object(gathered, mine, group=group)
        rows = [row for per_rank in gathered for row in per_rank]
        want = set(map(tuple, ref_rows[b * GBS : (b + 1) * GBS]))
        assert len(rows) == GBS, (b, len(rows))
        assert len(set(rows)) == GBS, f"global batch {b}: ranks read overlapping samples"
        assert set(rows) == want, f"global batch {b}: union over ranks is not the global batch"
        for q in range(dp_size):  # every rank got its share, and only its share
            assert len(gathered[q]) == GBS // dp_size, (b, q, len(gathered[q]))
        seen += sorted(where[row] for row in rows)
    st = it.state_dict()
    states: list[Any] = [None] * dp_size
    dist.all_gather_object(states, st, group=group)
    assert all(s == st for s in states), states  # consumed_samples is global: one state for all
    assert st["consumed_samples"] == c0 + n_batches * GBS
    return seen, st


def _data_rank(rank: int, world_size: int, prefix: str) -> dict[str, Any]:
    """dp=2 (ranks 0-1) from scratch -> dp=4 resumes -> dp=2 resumes. The state is handed
    over from rank 0 with a broadcast, as a checkpoint would be."""
    stream = _stream(prefix)
    pair = dist.new_group([0, 1])  # every rank must take part in creating it
    out: dict[str, Any] = {}
    state: list[Any] = [None]
    if rank < 2:
        out["seen_a"], state[0] = _read_global_batches(stream, rank, 2, None, 3, group=pair)
    dist.broadcast_object_list(state, src=0)
    out["seen_b"], st_b = _read_global_batches(stream, rank, world_size, state[0], 2, group=None)
    if rank < 2:
        out["seen_c"], out["state_c"] = _read_global_batches(stream, rank, 2, st_b, 1, group=pair)
    return out


@pytest.fixture(scope="module")
def dataset_prefix(tmp_path_factory: pytest.TempPathFactory) -> str:
    from lptrain.data.indexed import IndexedDatasetWriter

    prefix = tmp_path_factory.mktemp("dist_data") / "unique"
    rng = np.random.default_rng(0)
    lengths = rng.integers(3, 40, size=80)
    docs = np.split(np.arange(int(lengths.sum())), np.cumsum(lengths)[:-1])  # ids never repeat
    vocab = 60000
    w = IndexedDatasetWriter(str(prefix), vocab, vocab - 1, {"name": "synthetic", "sha256": "0" * 64})
    w.add_documents([d.astype(np.int64) for d in docs])
    w.finalize()
    return str(prefix)


def test_dp2_then_resume_at_dp4_and_dp2(dataset_prefix: str) -> None:
    out = run_distributed(_data_rank, 4, args=(dataset_prefix,))
    for key, ranks in (("seen_a", 2), ("seen_b", 4), ("seen_c", 2)):
        assert all(o[key] == out[0][key] for o in out[:ranks]), key  # one view on every rank
    assert "seen_a" not in out[2] and "seen_c" not in out[3]
    assert out[0]["seen_a"] == list(range(3 * GBS))
    assert out[0]["seen_b"] == list(range(3 * GBS, 5 * GBS))
    assert out[0]["seen_c"] == list(range(5 * GBS, 6 * GBS))
    everything = out[0]["seen_a"] + out[0]["seen_b"] + out[0]["seen_c"]
    assert sorted(everything) == list(range(6 * GBS))  # no repeats, no gaps across the resumes
    assert out[0]["state_c"]["consumed_samples"] == 6 * GBS
