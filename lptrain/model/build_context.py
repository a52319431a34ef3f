"""What every module constructor needs: the layer factory, the dtypes and the init rules."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from lptrain.config.schema import ModelConfig
from lptrain.model.init import InitMethod, grouped_normal_init, named_normal_init
from lptrain.model.process_group import SINGLE_RANK, ProcessGroup


@dataclass(frozen=True)
class BuildContext:
    """Shared construction state, passed down the module tree with a name prefix.

    ``std`` initialises input-side matrices (QKV, fc1, router, embeddings, output head);
    ``output_std = std / sqrt(2 * num_layers)`` the residual-branch outputs (attention
    projection, fc2), as Megatron's ``scaled_init_method_normal``.
    """

    cfg: ModelConfig
    factory: Any
    seed: int
    params_dtype: torch.dtype
    expert_model_parallel_size: int = 1
    expert_model_parallel_rank: int = 0
    # the group the MoE layers dispatch tokens over (its size is the EP size when EP > 1)
    expert_parallel_group: ProcessGroup = SINGLE_RANK

    @property
    def std(self) -> float:
        return self.cfg.init_method_std

    @property
    def output_std(self) -> float:
        return self.cfg.init_method_std / math.sqrt(2.0 * self.cfg.num_layers)

    def init(self, name: str, std: float) -> InitMethod:
        return named_normal_init(self.seed, name, std)

    def grouped_init(self, name: str, std: float, expert_offset: int) -> InitMethod:
        return grouped_normal_init(self.seed, name, std, expert_offset)
