"""Tiny configs and factories for the model tests (2 layers, hidden 64, 4 heads, seq 32)."""

from __future__ import annotations

from typing import Any

import torch

from lptrain.config.schema import LPTrainConfig
from lptrain.model import build_model
from lptrain.model.gpt import GPTModel
from lptrain.precision.layers import LayerFactory

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def tiny_cfg(**overrides: Any) -> LPTrainConfig:
    """The tiny test model; ``overrides`` use ``section__field`` or ``model__moe__field``."""
    cfg = LPTrainConfig()
    m = cfg.model
    m.num_layers, m.hidden_size, m.num_attention_heads = 2, 64, 4
    m.ffn_hidden_size, m.seq_length, m.vocab_size = 128, 32, 259
    cfg.precision.params_dtype = "fp32"
    cfg.train.seed = 1234
    for key, value in overrides.items():
        *path, leaf = key.split("__")
        obj: Any = cfg
        for p in path:
            obj = getattr(obj, p)
        if not hasattr(obj, leaf):
            raise AttributeError(key)
        setattr(obj, leaf, value)
    return cfg


def moe_overrides(**kw: Any) -> dict[str, Any]:
    base = {"model__moe__num_experts": 4, "model__moe__router_topk": 2}
    base.update({f"model__moe__{k}": v for k, v in kw.items()})
    return base


def hp_model(cfg: LPTrainConfig) -> GPTModel:
    """Build with the high-precision ``LayerFactory`` (no quantization)."""
    return build_model(cfg, LayerFactory(params_dtype=DTYPES[cfg.precision.params_dtype]))


def quantized_factory(cfg: LPTrainConfig) -> Any:
    """``build_factory`` for ``cfg`` on the emulated backend."""
    from lptrain.precision.factory import build_factory

    cfg.precision.backend = "emulated"
    return build_factory(cfg.precision, num_layers=cfg.model.num_layers)


def tokens(batch: int = 2, seq: int = 32, vocab: int = 259, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, seq), generator=g)
