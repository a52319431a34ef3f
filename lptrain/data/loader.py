"""Batch iterators for training and validation, and their construction from ``DataConfig``.

:func:`build_train_valid_loaders` resolves ``data.paths``/``data.weights`` (a blend) or
``data.source`` (``builtin:NAME`` or an index prefix), checks tokenizer identity and the model
vocabulary, splits every dataset by documents (``split_valid_fraction``, ``seed``) and returns
two :class:`BatchIterator` objects. Each yields ``{"tokens", "labels"}`` LongTensors of shape
``[micro_batch_size, seq_length]`` forever and exposes its position (``consumed_samples``, in
global samples) through ``state_dict()``/``load_state_dict()`` for checkpoints. Under context
parallelism (``context_parallel=(cp_rank, cp_size)``) each rank reads only its two chunks of
every sample (:func:`lptrain.catalog.parallel_dims.cp_token_ranges`), side by side: tokens and
labels ``[micro_batch_size, seq_length / cp_size]``; which samples, and in which order, does not
depend on the context-parallel size (the sampler counts data-parallel ranks only). The validation
iterator continues where it stopped; to evaluate the same batches every time, reset it with
``valid_iter.load_state_dict({"consumed_samples": 0})`` before each evaluation, and read
:func:`eval_micro_batches` batches per rank (the same samples at any DP size).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from lptrain.data.blend import BlendedStream
from lptrain.data.builtin import ensure_builtin_dataset
from lptrain.data.errors import DataError
from lptrain.data.gpt_dataset import GPTDataset, split_documents, split_seed
from lptrain.data.indexed import IndexedDataset, check_present, tokenizer_fix
from lptrain.data.sampler import GlobalBatchSampler
from lptrain.data.token_file import DatasetChangedError

_DEFAULT_CACHE = "~/.cache/lptrain"  # DataConfig.cache_dir's default: the environment decides


class _PositionDataset(torch.utils.data.Dataset):
    """Map-style view for a torch DataLoader: a list of positions -> one collated micro-batch."""

    def __init__(self, stream: BlendedStream, context_parallel: tuple[int, int] = (0, 1)) -> None:
        self.stream = stream
        self.context_parallel = context_parallel

    def __getitem__(self, positions: Any) -> dict[str, torch.Tensor]:
        return collate(self.stream, positions, self.context_parallel)


def collate(stream: BlendedStream, positions: Any,
            context_parallel: tuple[int, int] = (0, 1)) -> dict[str, torch.Tensor]:
    """Read the samples at ``positions`` into ``tokens``/``labels`` (labels shifted by one);
    under context parallelism only this rank's chunks (see the module doc): each chunk
    ``[lo, hi)`` reads tokens ``[lo, hi + 1)``, its labels one further."""
    cp_rank, cp_size = context_parallel
    if cp_size == 1:
        spans = [(0, stream.seq_length)]
    else:
        from lptrain.catalog.parallel_dims import cp_token_ranges

        spans = cp_token_ranges(stream.seq_length, cp_size, cp_rank)
    width = sum(hi - lo for lo, hi in spans)
    tokens = np.empty((len(positions), width), dtype=np.int64)
    labels = np.empty((len(positions), width), dtype=np.int64)
    buf = np.empty(max(hi - lo for lo, hi in spans) + 1, dtype=np.int64)
    for row, p in enumerate(positions):
        at = 0
        for lo, hi in spans:
            n = hi - lo
            stream.sample_into(int(p), buf[: n + 1], lo)
            tokens[row, at : at + n] = buf[:n]
            labels[row, at : at + n] = buf[1 : n + 1]
            at += n
    # numpy copies + from_numpy: several times cheaper than two small torch ops per batch.
    return {"tokens": torch.from_numpy(tokens), "labels": torch.from_numpy(labels)}


class BatchIterator:
    """Infinite iterator of this rank's micro-batches with a checkpointable position.

    ``num_workers > 0`` reads through a ``torch.utils.data.DataLoader`` (prefetching); the
    position still counts only the batches handed to the caller, so a checkpoint never skips
    prefetched-but-unused samples.
    """

    def __init__(self, stream: BlendedStream, sampler: GlobalBatchSampler, num_workers: int = 0,
                 context_parallel: tuple[int, int] = (0, 1)) -> None:
        self.stream = stream
        self.sampler = sampler
        self.num_workers = num_workers
        self.context_parallel = context_parallel
        self._it: Iterator[dict[str, torch.Tensor]] | None = None

    @property
    def consumed_samples(self) -> int:
        return self.sampler.consumed_samples

    def _worker_iter(self) -> Iterator[dict[str, torch.Tensor]]:
        start = self.sampler.consumed_samples
        ahead = GlobalBatchSampler(
            self.sampler.global_batch_size,
            self.sampler.micro_batch_size,
            self.sampler.dp_rank,
            self.sampler.dp_size,
            start,
        )
        loader = torch.utils.data.DataLoader(
            _PositionDataset(self.stream, self.context_parallel),
            sampler=ahead,
            batch_size=None,
            num_workers=self.num_workers,
            persistent_workers=False,
        )
        return iter(loader)

    def __iter__(self) -> BatchIterator:
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        if self.num_workers <= 0:
            return collate(self.stream, self.sampler.next_positions(), self.context_parallel)
        if self._it is None:
            self._it = self._worker_iter()
        try:
            batch = next(self._it)
        except DatasetChangedError:
            # Re-raised from a worker with the worker's traceback in its message: check the
            # files here, which raises the same fault as its own one line.
            self.stream.check_unchanged()
            raise
        self.sampler.consumed_samples += self.sampler.micro_batch_size * self.sampler.dp_size
        return batch

    def state_dict(self) -> dict[str, Any]:
        """``consumed_samples`` (global) plus the stream fingerprint it refers to."""
        return {**self.sampler.state_dict(), "stream": self.stream.fingerprint}

    def load_state_dict(self, state: dict[str, Any], strict: bool = True) -> None:
        """Resume at ``state["consumed_samples"]`` (any DP size or micro-batch size).

        With ``strict``, a state saved for another stream (other data, split, seed, seq_length
        or blend weights) raises :class:`DataError` instead of resuming at a meaningless position.
        """
        saved = state.get("stream")
        if strict and saved is not None and saved != self.stream.fingerprint:
            raise DataError(
                "data state was saved for a different sample stream (dataset, split, seed, "
                "seq_length or blend weights changed): its position, consumed_samples="
                f"{state['consumed_samples']}, means nothing in this one",
                fix="resume with the data settings and model.seq_length of the checkpoint's "
                    "resolved_config.yaml; to train its weights on other data, export them "
                    "(lptrain export RUN_DIR --format hf --output DIR) and start a new run in "
                    "another --output-dir with checkpoint.init_from_hf=DIR",
            )
        self.sampler.load_state_dict(state)
        self._it = None


def resolve_prefixes(data_cfg: Any) -> list[str]:
    """Index prefixes named by the config (``paths`` wins over ``source``).

    ``builtin:NAME`` is prepared on first use into ``data.cache_dir``; while that is left at its
    default, the cache is :func:`~lptrain.data.builtin.default_cache_dir` (``$LPTRAIN_CACHE_DIR``,
    else ``$XDG_CACHE_HOME/lptrain``, else ``~/.cache/lptrain``).
    """
    paths = list(getattr(data_cfg, "paths", None) or [])
    if paths:
        return [str(p) for p in paths]
    source = str(data_cfg.source)
    if source.startswith("builtin:"):
        cache = getattr(data_cfg, "cache_dir", None)
        if not cache or cache == _DEFAULT_CACHE:
            cache = None  # default: $LPTRAIN_CACHE_DIR, else $XDG_CACHE_HOME/lptrain, else ~/.cache/lptrain
        max_mb = float(getattr(data_cfg, "builtin_max_mb", 32.0))
        return [
            ensure_builtin_dataset(
                source.split(":", 1)[1], cache_dir=cache, tokenizer=data_cfg.tokenizer, max_bytes=int(max_mb * 1e6)
            )
        ]
    return [source]


def check_data_present(data_cfg: Any) -> None:
    """The configured datasets' files exist (``builtin:`` corpora are prepared when the run
    opens them): checked before a run takes or writes its folder, so a missing dataset leaves
    nothing behind (:func:`~lptrain.data.indexed.check_present`)."""
    paths = [str(p) for p in getattr(data_cfg, "paths", None) or []]
    source = str(data_cfg.source)
    for prefix in paths or ([] if source.startswith("builtin:") else [source]):
        check_present(prefix)


def open_dataset(prefix: str, tokenizer: str, vocab_size: int) -> IndexedDataset:
    """Open and check one dataset against the configured tokenizer and model vocabulary."""
    from lptrain.data.tokenizer import load_tokenizer

    ds = IndexedDataset(prefix)
    want = load_tokenizer(tokenizer)
    got = ds.header["tokenizer"]
    if got.get("sha256") != want.sha256:
        raise DataError(
            f"dataset {prefix} was tokenized with {got.get('name')} (sha256 {str(got.get('sha256'))[:12]}) "
            f"but data.tokenizer is {want.name} (sha256 {want.sha256[:12]})",
            key="data.tokenizer",
            fix=tokenizer_fix(prefix, str(got.get("name"))),
        )
    if ds.eos_id != want.eos_id:
        raise DataError(
            f"dataset {prefix} records EOS id {ds.eos_id} but its tokenizer {want.name} has EOS id "
            f"{want.eos_id}: the index is corrupt or was edited",
            key="data.tokenizer",
            fix="prepare the dataset again with `lptrain prepare-data`",
        )
    ds.check_vocab(vocab_size)
    return ds


def build_streams(
    data_cfg: Any, seq_length: int, vocab_size: int
) -> tuple[BlendedStream, BlendedStream | None]:
    """Train and validation streams (validation is None when ``split_valid_fraction == 0``)."""
    prefixes = resolve_prefixes(data_cfg)
    weights = list(getattr(data_cfg, "weights", None) or [])
    if weights and len(weights) != len(prefixes):
        raise DataError(f"data.weights has {len(weights)} entries for {len(prefixes)} data.paths")
    train_parts: list[GPTDataset] = []
    valid_parts: list[GPTDataset] = []
    for k, prefix in enumerate(prefixes):
        ds = open_dataset(prefix, data_cfg.tokenizer, vocab_size)
        seed = split_seed(data_cfg.seed, k)
        tr, va = split_documents(len(ds), float(data_cfg.split_valid_fraction), seed)
        train_parts.append(GPTDataset(ds, tr, seq_length, seed, f"{prefix} (train)"))
        if len(va):
            valid_parts.append(GPTDataset(ds, va, seq_length, seed + 1, f"{prefix} (valid)"))
    train = BlendedStream(train_parts, weights or None)
    valid = BlendedStream(valid_parts, weights or None) if valid_parts else None
    return train, valid


def build_train_valid_loaders(
    data_cfg: Any,
    seq_length: int,
    micro_batch_size: int,
    global_batch_size: int,
    dp_rank: int,
    dp_size: int,
    vocab_size: int,
    context_parallel: tuple[int, int] = (0, 1),
) -> tuple[BatchIterator, BatchIterator | None]:
    """``(train_iter, valid_iter)`` for this DP rank (and context-parallel rank
    ``context_parallel = (cp_rank, cp_size)``: its chunks of the same samples); restore
    positions with ``load_state_dict``."""
    train, valid = build_streams(data_cfg, seq_length, vocab_size)
    workers = int(getattr(data_cfg, "num_workers", 0) or 0)

    def make(stream: BlendedStream) -> BatchIterator:
        sampler = GlobalBatchSampler(global_batch_size, micro_batch_size, dp_rank, dp_size)
        return BatchIterator(stream, sampler, workers, tuple(context_parallel))  # type: ignore[arg-type]

    return make(train), (make(valid) if valid is not None else None)


def eval_micro_batches(valid_iter: BatchIterator, eval_iters: int) -> int:
    """Micro-batches each rank evaluates for ``train.eval_iters``: that many *global* batches
    (Megatron's ``eval_iters x global_batch_size`` samples), split over the DP ranks as in
    training, so an evaluation reads the same samples at any DP size."""
    return int(eval_iters) * valid_iter.sampler.num_micro_batches


def data_state(train_iter: BatchIterator, valid_iter: BatchIterator | None) -> dict[str, Any]:
    """The data position to put in a checkpoint."""
    return {
        "train": train_iter.state_dict(),
        "valid": valid_iter.state_dict() if valid_iter is not None else None,
    }


def load_data_state(
    state: dict[str, Any], train_iter: BatchIterator, valid_iter: BatchIterator | None
) -> None:
    """Restore :func:`data_state` output (works across a change of DP size)."""
    train_iter.load_state_dict(state["train"])
    if valid_iter is not None and state.get("valid") is not None:
        valid_iter.load_state_dict(state["valid"])
