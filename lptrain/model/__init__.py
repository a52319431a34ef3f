"""GPT model: decoder, MoE layers, init, parameter metadata, state-dict layouts, FLOPs."""

from lptrain.model.build import build_model, default_factory, params_dtype_of
from lptrain.model.flops import FlopsBreakdown, active_gemm_params, flops_per_token
from lptrain.model.gpt import GPTModel
from lptrain.model.params import (
    dense_parameters,
    expert_parameters,
    named_dense_parameters,
    named_expert_parameters,
    tag_parameters,
)
from lptrain.model.state_dict_adapter import (
    canonical_state_dict,
    from_canonical,
    load_canonical_state_dict,
    to_canonical,
)

__all__ = [
    "FlopsBreakdown",
    "GPTModel",
    "active_gemm_params",
    "build_model",
    "canonical_state_dict",
    "default_factory",
    "dense_parameters",
    "expert_parameters",
    "flops_per_token",
    "from_canonical",
    "load_canonical_state_dict",
    "named_dense_parameters",
    "named_expert_parameters",
    "params_dtype_of",
    "tag_parameters",
    "to_canonical",
]
