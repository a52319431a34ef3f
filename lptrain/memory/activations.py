"""Activation bytes of one micro-batch: what lptrain's forward keeps for backward.

A formula, not a trace: it follows the model code (lptrain/model) tensor by tensor, with
``a`` the activation dtype's bytes (4 on CPU, 2 with bf16 on a GPU) and fp32 wherever the code
upcasts (norms, RoPE, SwiGLU, the loss). Autograd keeps a multiplication's operand only when
the *other* operand needs a gradient, so RoPE's ``x * cos`` keeps nothing and a norm keeps its
fp32 input and normalized value. Per token of one dense layer (h hidden, n heads x d, g KV
groups, f SwiGLU width):

* input norm: fp32 input ``4h`` + normalized ``4h``; pre-MLP norm the same;
* GEMM inputs: ``a*h`` each for QKV and fc1 (``a*f`` for fc2); a quantized GEMM keeps only its
  column-wise quantized input instead (bytes from the run's own input quantizer);
* attention: rotated Q ``a*n*d``; with MHA rotated K ``a*g*d`` and the fused QKV output
  ``a*(n+2g)*d`` (V is a view of it); with GQA the repeated K and V ``2*a*n*d`` instead;
  with ``qk_layernorm`` the norms' ``8*(n+g)*d``; the attention output ``a*n*d`` (the
  projection reads a view of it), ``4n`` log-sum-exp;
* SwiGLU: fp32 ``[gate|up]`` ``8f``, ``silu(gate)`` ``4f``, the product in the activation
  dtype ``a*f`` (the fc2 input);
* head: final norm ``8h``, the head input ``a*h``, fp32 log-softmax over the vocabulary.

MoE layers use the same SwiGLU terms for ``router_topk`` expert passes per token (balanced
routing) plus the permuted tokens and fp32 router scores. With full recomputation only each
layer's input (``a*h``) stays, plus one layer's activations while it is recomputed.

``tests/unit/memory/test_estimate_memory.py`` holds the result to 25% of the bytes a CPU forward
really leaves allocated (torch.profiler's memory timeline).
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from lptrain.config.schema import LPTrainConfig


def _layer_terms(
    cfg: LPTrainConfig, a: int, quantized: bool, quantizers: Optional[Any], moe: bool
) -> float:
    """Bytes per token of one transformer layer."""
    m = cfg.model
    h, n = m.hidden_size, m.num_attention_heads
    g = m.num_query_groups or n
    d = h // n
    f = m.ffn_hidden_size or 4 * h
    dtype = torch.bfloat16 if a == 2 else torch.float32

    def gemm_in(width: int) -> float:
        if quantized and quantizers is not None:
            return quantizers.input_bytes_per_row(width, dtype)
        return a * width

    norm = 8 * h + 4
    attn = a * n * d  # rotated Q
    if g == n:
        attn += a * g * d + a * (n + 2 * g) * d
    else:
        attn += 2 * a * n * d
    attn += a * n * d + 4 * n  # output + log-sum-exp
    if m.qk_layernorm:  # each norm keeps its fp32 input and normalized value, and 1/rms per head
        attn += 8 * (n + g) * d + 4 * (n + g)
    if quantized:
        attn += gemm_in(n * d)  # the projection's own quantized copy of its input
    layer = 2 * norm + gemm_in(h) + attn
    if moe:
        e = m.moe
        fe = e.ffn_hidden_size or f
        k = e.router_topk
        swiglu = 8 * fe + 4 * fe + (a * fe if not quantized else gemm_in(fe))
        layer += k * (gemm_in(h) + swiglu + a * h) + 4 * e.num_experts * 2
    else:
        swiglu = 8 * f + 4 * f + (a * f if not quantized else gemm_in(f))
        layer += gemm_in(h) + swiglu
    return layer


def activation_bytes(
    cfg: LPTrainConfig, model: torch.nn.Module, a: int, quantizers: Optional[Any]
) -> tuple[int, int]:
    """(no recompute, full recompute) bytes of one micro-batch's saved activations."""
    m = cfg.model
    tokens = cfg.train.micro_batch_size * m.seq_length
    factory = getattr(model, "factory", None)
    layers = getattr(model, "layers", [])
    per_layer = []
    for i, layer in enumerate(layers):
        quantized = factory is not None and not factory.is_bf16_layer(i + 1)
        per_layer.append(_layer_terms(cfg, a, quantized, quantizers, bool(getattr(layer, "is_moe", False))))
    vocab = m.vocab_size
    head = 8 * m.hidden_size + a * m.hidden_size + 4 * vocab
    full = tokens * (sum(per_layer) + head)
    recompute = tokens * (len(per_layer) * a * m.hidden_size + max(per_layer, default=0) + head)
    return int(full), int(recompute)
