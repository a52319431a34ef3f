"""``build_model(cfg)``: the model stage of a run (config + layer factory -> ``GPTModel``)."""

from __future__ import annotations

from typing import Any, Optional

import torch

from lptrain.config.schema import LPTrainConfig
from lptrain.model.build_context import BuildContext
from lptrain.model.gpt import GPTModel
from lptrain.model.params import tag_parameters

_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}


def params_dtype_of(name: str) -> torch.dtype:
    try:
        return _DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown params_dtype {name!r}; expected one of {sorted(_DTYPES)}") from None


def default_factory(cfg: LPTrainConfig) -> Any:
    """The precision package's layer factory for ``cfg`` (recipe, backend, bf16 layers)."""
    from lptrain.precision.factory import build_factory

    return build_factory(
        cfg.precision,
        num_layers=cfg.model.num_layers,
        fuse_wgrad_accumulation=cfg.train.gradient_accumulation_fusion,
    )


def build_model(
    cfg: LPTrainConfig,
    factory: Optional[Any] = None,
    *,
    expert_model_parallel_rank: int = 0,
) -> GPTModel:
    """Build the tagged ``GPTModel`` on the CPU; initial weights depend only on
    ``cfg.train.seed`` and each parameter's canonical name (see ``lptrain.model.init``).

    ``expert_model_parallel_rank`` selects which ``num_experts / EP`` experts this rank
    holds (``cfg.model.moe.expert_model_parallel_size``); their weights equal the same
    experts of a single-rank model.
    """
    if factory is None:
        factory = default_factory(cfg)
    dtype = getattr(factory, "params_dtype", None) or params_dtype_of(cfg.precision.params_dtype)
    ep = cfg.model.moe.expert_model_parallel_size if cfg.model.moe.num_experts else 1
    if not 0 <= expert_model_parallel_rank < ep:
        raise ValueError(f"expert_model_parallel_rank {expert_model_parallel_rank} not in [0, {ep})")
    ctx = BuildContext(
        cfg=cfg.model,
        factory=factory,
        seed=cfg.train.seed,
        params_dtype=dtype,
        expert_model_parallel_size=ep,
        expert_model_parallel_rank=expert_model_parallel_rank,
    )
    model = GPTModel(ctx)
    tag_parameters(model)
    return model
