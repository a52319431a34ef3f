"""Data pipeline: ``prepare-data``, indexed token datasets, GPT sampling, blends, loaders.

Submodules: ``tokenizer`` (byte / tokenizers JSON), ``sources`` (reading inputs), ``prepare``
(tokenize + write), ``indexed`` (on-disk format), ``gpt_dataset`` (samples), ``blend``,
``sampler`` (global-batch DP slices), ``loader`` (iterators from ``DataConfig``), ``builtin``
(offline corpora), ``commands`` (CLI). Names below are imported lazily so that importing
``lptrain.data.commands`` stays light.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "DataError": "lptrain.data.errors",
    "IndexedDataset": "lptrain.data.indexed",
    "GPTDataset": "lptrain.data.gpt_dataset",
    "BlendedStream": "lptrain.data.blend",
    "GlobalBatchSampler": "lptrain.data.sampler",
    "BatchIterator": "lptrain.data.loader",
    "build_train_valid_loaders": "lptrain.data.loader",
    "data_state": "lptrain.data.loader",
    "load_data_state": "lptrain.data.loader",
    "eval_micro_batches": "lptrain.data.loader",
    "ensure_builtin_dataset": "lptrain.data.builtin",
    "prepare_dataset": "lptrain.data.prepare",
    "load_tokenizer": "lptrain.data.tokenizer",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'lptrain.data' has no attribute {name!r}")
