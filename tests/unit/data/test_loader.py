"""build_train_valid_loaders: batches, labels, determinism, resume across DP sizes, workers."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lptrain.config.schema import DataConfig
from lptrain.data.errors import DataError
from lptrain.data.loader import (
    build_streams,
    build_train_valid_loaders,
    data_state,
    load_data_state,
)
from lptrain.data.prepare import prepare_dataset

SEQ, MBS, GBS = 16, 2, 8


def _corpus(tmp_path: Path, name: str = "ds", n: int = 60, word: str = "tok") -> str:
    d = tmp_path / f"{name}_src"
    d.mkdir()
    for i in range(n):
        (d / f"{i:03d}.txt").write_text(f"{word}{i} " * (3 + i % 11))
    prepare_dataset([d], tmp_path / name)
    return str(tmp_path / name)


def _cfg(paths: list[str], **kw: object) -> DataConfig:
    return DataConfig(source=paths[0], paths=paths if len(paths) > 1 else [], split_valid_fraction=0.1, **kw)


def _global_batches(cfg: DataConfig, dp: int, steps: int, state: dict | None = None) -> tuple[list[list[tuple]], dict]:
    """Per optimizer step, the sorted rows (as tuples) read by all DP ranks together."""
    iters = [build_train_valid_loaders(cfg, SEQ, MBS, GBS, r, dp, 259) for r in range(dp)]
    if state is not None:
        for tr, va in iters:
            load_data_state(state, tr, va)
    out = []
    for _ in range(steps):
        rows: list[tuple] = []
        for tr, _va in iters:
            for _m in range(GBS // (MBS * dp)):
                b = next(tr)
                rows += [tuple(r.tolist()) for r in b["tokens"]]
        out.append(sorted(rows))
    return out, data_state(*iters[0])


def test_batches_shapes_and_shifted_labels(tmp_path: Path) -> None:
    tr, va = build_train_valid_loaders(_cfg([_corpus(tmp_path)]), SEQ, MBS, GBS, 0, 1, 259)
    assert va is not None
    for it in (tr, va):
        b = next(it)
        assert b["tokens"].shape == b["labels"].shape == (MBS, SEQ)
        assert b["tokens"].dtype == b["labels"].dtype == torch.int64
        assert torch.equal(b["tokens"][:, 1:], b["labels"][:, :-1])
    assert tr.state_dict()["consumed_samples"] == MBS


def test_train_and_valid_do_not_share_documents(tmp_path: Path) -> None:
    train, valid = build_streams(_cfg([_corpus(tmp_path)]), SEQ, 259)
    assert valid is not None
    tr, va = set(train.datasets[0].doc_ids.tolist()), set(valid.datasets[0].doc_ids.tolist())
    assert not tr & va and tr | va == set(range(60)) and len(va) == 6  # 10% of 60 documents


def test_same_seed_same_batches_other_seed_differs(tmp_path: Path) -> None:
    p = _corpus(tmp_path)
    a, _ = _global_batches(_cfg([p], seed=1), 1, 3)
    b, _ = _global_batches(_cfg([p], seed=1), 1, 3)
    c, _ = _global_batches(_cfg([p], seed=2), 1, 3)
    assert a == b and a != c


@pytest.mark.parametrize(("dp_before", "dp_after"), [(2, 1), (1, 4), (4, 2)])
def test_resume_at_other_dp_matches_uninterrupted_run(tmp_path: Path, dp_before: int, dp_after: int) -> None:
    cfg = _cfg([_corpus(tmp_path)])
    reference, _ = _global_batches(cfg, 1, 6)
    first, state = _global_batches(cfg, dp_before, 2)
    assert state["train"]["consumed_samples"] == 2 * GBS
    rest, _ = _global_batches(cfg, dp_after, 4, state)
    assert first + rest == reference  # same samples per global batch: no repeats, no gaps


def test_blend_of_two_datasets(tmp_path: Path) -> None:
    a = _corpus(tmp_path, "a", word="aaa")
    b = _corpus(tmp_path, "b", word="bbb")
    tr, _ = build_train_valid_loaders(_cfg([a, b], weights=[0.75, 0.25]), SEQ, MBS, GBS, 0, 1, 259)
    counts = {"a": 0, "b": 0}
    for _ in range(100):
        for row in next(tr)["tokens"].tolist():
            text = bytes(t for t in row if t < 256).decode(errors="replace")
            counts["a" if "aaa" in text else "b"] += 1
    # Greedy blend: 200 samples split 150/50 up to one sample per dataset (a row never mixes datasets).
    assert abs(counts["a"] - 150) <= 1 and abs(counts["b"] - 50) <= 1


def test_worker_loader_matches_in_process(tmp_path: Path) -> None:
    p = _corpus(tmp_path)
    tr0, _ = build_train_valid_loaders(_cfg([p]), SEQ, MBS, GBS, 1, 2, 259)
    tr2, _ = build_train_valid_loaders(_cfg([p], num_workers=1), SEQ, MBS, GBS, 1, 2, 259)
    for _ in range(5):
        b0, b2 = next(tr0), next(tr2)
        assert torch.equal(b0["tokens"], b2["tokens"]) and torch.equal(b0["labels"], b2["labels"])
    assert tr2.state_dict() == tr0.state_dict()
    assert tr0.state_dict()["consumed_samples"] == 5 * MBS * 2


def test_vocab_and_weights_errors(tmp_path: Path) -> None:
    p = _corpus(tmp_path)
    with pytest.raises(DataError, match=f"dataset {p} has token id 257 .*model vocabulary of 128"):
        build_train_valid_loaders(_cfg([p]), SEQ, MBS, GBS, 0, 1, 128)
    with pytest.raises(DataError, match=r"data\.weights has 1 entries for 2 data\.paths"):
        build_train_valid_loaders(_cfg([p, p], weights=[1.0]), SEQ, MBS, GBS, 0, 1, 259)


def test_no_validation_split(tmp_path: Path) -> None:
    cfg = _cfg([_corpus(tmp_path)])
    cfg.split_valid_fraction = 0.0
    tr, va = build_train_valid_loaders(cfg, SEQ, MBS, GBS, 0, 1, 259)
    assert va is None and next(tr)["tokens"].shape == (MBS, SEQ)


def test_state_from_another_stream_is_refused(tmp_path: Path) -> None:
    p = _corpus(tmp_path)
    tr, _ = build_train_valid_loaders(_cfg([p], seed=1), SEQ, MBS, GBS, 0, 1, 259)
    next(tr)
    state = tr.state_dict()
    other, _ = build_train_valid_loaders(_cfg([p], seed=2), SEQ, MBS, GBS, 0, 1, 259)
    with pytest.raises(DataError, match="data state was saved for a different sample stream") as err:
        other.load_state_dict(state)
    # the fix names what the command line can do (it said "pass strict=False", a Python
    # argument no command takes: issue 52, item 21)
    assert str(err.value) == (
        "data state was saved for a different sample stream (dataset, split, seed, seq_length or "
        f"blend weights changed): its position, consumed_samples={MBS}, means nothing in this "
        "one; fix: resume with the data settings and model.seq_length of the checkpoint's "
        "resolved_config.yaml; to train its weights on other data, export them (lptrain export "
        "RUN_DIR --format hf --output DIR) and start a new run in another --output-dir with "
        "checkpoint.init_from_hf=DIR")
    other.load_state_dict(state, strict=False)
    assert other.consumed_samples == MBS
    # Another DP size or micro-batch size is the same stream: accepted.
    same, _ = build_train_valid_loaders(_cfg([p], seed=1), SEQ, 1, GBS, 1, 4, 259)
    same.load_state_dict(state)
    assert same.consumed_samples == MBS


@pytest.mark.parametrize("cp", [2, 4])
def test_context_parallel_ranks_read_only_their_chunks_of_the_same_samples(tmp_path: Path, cp: int) -> None:
    """Each CP rank's batch is its two chunks (i and 2CP-1-i of 2CP) of the CP 1 batch, tokens
    and labels, side by side: the same samples in the same order at any CP size. The rank
    reads only those spans of each sample (each chunk's tokens plus the one label after it),
    documents crossing chunk boundaries included."""
    from lptrain.catalog.parallel_dims import cp_token_ranges
    from lptrain.data.gpt_dataset import GPTDataset

    cfg = _cfg([_corpus(tmp_path)])
    whole, _ = build_train_valid_loaders(cfg, SEQ, MBS, GBS, 0, 1, 259)
    ranks = [build_train_valid_loaders(cfg, SEQ, MBS, GBS, 0, 1, 259, context_parallel=(r, cp))[0]
             for r in range(cp)]
    spans: list[tuple[int, int]] = []
    read = GPTDataset.sample_into

    def recording(self: GPTDataset, index: int, out: object, start: int = 0) -> None:
        spans.append((start, start + len(out)))  # type: ignore[arg-type]
        read(self, index, out, start)  # type: ignore[arg-type]

    for _ in range(3):
        ref = next(whole)
        for r, it in enumerate(ranks):
            GPTDataset.sample_into = recording  # type: ignore[method-assign]
            try:
                got = next(it)
            finally:
                GPTDataset.sample_into = read  # type: ignore[method-assign]
            cols = torch.cat([torch.arange(lo, hi) for lo, hi in cp_token_ranges(SEQ, cp, r)])
            assert got["tokens"].shape == (MBS, SEQ // cp)
            assert torch.equal(got["tokens"], ref["tokens"][:, cols])
            assert torch.equal(got["labels"], ref["labels"][:, cols])
            assert sorted(set(spans)) == [(lo, hi + 1) for lo, hi in cp_token_ranges(SEQ, cp, r)]
            spans.clear()
