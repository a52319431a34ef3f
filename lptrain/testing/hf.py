"""Helpers for the Hugging Face round-trip tests: both sides' fp32 logits on the same tokens.

:func:`reference_logits` is lptrain's own forward, in fp32 and unquantized, with given
canonical weights (the masters of a checkpoint, or what an import produced): the model a
``transformers`` folder must reproduce. :func:`hf_logits` loads a folder with
``transformers`` itself (a test dependency, imported here only) in fp32.

Tolerance (``LOGIT_ATOL``): both sides run the same fp32 math in a different order (one fused
QKV GEMM against three, RoPE tables from fp64 against fp32 angles, SDPA kernels that may
differ), so they agree to fp32 rounding carried through the layers: measured a few 1e-7 on
logits of magnitude ~1 for the tiny models; 1e-5 leaves room for another BLAS and stays
orders of magnitude below what any wrong mapping gives (a swapped head, K/V or gate/up moves
logits by 1e-2 and more).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

LOGIT_ATOL = 1e-5

FP32_UNQUANTIZED = (
    "precision.params_dtype=fp32", "precision.fp8_format=null", "precision.fp4_format=null",
    "precision.fp8_param_gather=false", "precision.fp4_param_gather=false",
    "precision.backend=emulated", "model.moe.expert_model_parallel_size=1", "run.device=cpu",
)


def reference_model(recipe: str, overrides: Sequence[str], state: Mapping[str, torch.Tensor]) -> Any:
    """lptrain's model of ``recipe`` + ``overrides`` in fp32 without quantization, loaded
    with the canonical ``state``; in eval mode."""
    from lptrain.config import compose
    from lptrain.model import build_model
    from lptrain.model.state_dict_adapter import load_canonical_state_dict

    cfg = compose(recipe, [*overrides, *FP32_UNQUANTIZED])
    model = build_model(cfg, device="cpu")
    load_canonical_state_dict(model, dict(state))
    return model.eval()


@torch.no_grad()
def reference_logits(recipe: str, overrides: Sequence[str], state: Mapping[str, torch.Tensor],
                     tokens: torch.Tensor) -> torch.Tensor:
    return reference_model(recipe, overrides, state)(tokens)


def load_hf(folder: str | Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()


@torch.no_grad()
def hf_logits(folder_or_model: Any, tokens: torch.Tensor) -> torch.Tensor:
    model = folder_or_model if isinstance(folder_or_model, torch.nn.Module) else load_hf(folder_or_model)
    return model(tokens).logits.float()


def sample_tokens(vocab: int, batch: int = 2, seq: int = 48, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(seed))


def max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return float((a - b).abs().max())
