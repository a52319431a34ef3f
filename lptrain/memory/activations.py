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

A pipeline stage counts its own layers (the model part it builds), the head only on the last
stage, and the kept tensors of every micro-batch it has in flight (Megatron's count: the
first stage holds ``min(m, PP)`` under 1F1B; interleaving multiplies that by
``1 + (PP - 1) / (PP x VPP)``).

MoE layers use the same SwiGLU terms for ``router_topk`` expert passes per token (balanced
routing) plus the permuted tokens and fp32 router scores. With full recomputation only each
layer's input (``a*h``) stays, plus one layer's activations while it is recomputed;
:func:`configured_activation_bytes` follows the run's own ``model.recompute_*`` settings.

``tests/unit/memory/test_estimate_memory.py`` holds the result to 25% of the bytes a CPU forward
really leaves allocated (torch.profiler's memory timeline).

**Tensor and sequence parallelism** (``t`` ranks) split each term by where it lives, as
Megatron-LM's activation formula does (per layer, ``s b h (34 + 5 a s / h)`` bytes at one
rank; ``s b h (10 + 24/t + 5 a s / (h t))`` with TP; all of it ``/ t`` with TP + SP): the
terms of the split heads and the split FFN width (attention, SwiGLU, the fc2 and proj inputs,
the vocab logits) are ``/ t``; the norms, the residual stream and the layer inputs are whole
on every rank without SP and ``/ t`` with it (sequence shards). The QKV and fc1 inputs are the
all-gathered sequence under SP: Transformer Engine keeps only its shard and gathers again in
the backward (``/ t``); the emulated layers keep the gathered input (whole). MoE layers run on
the sequence shard (SP is required with TP): all ``/ t``.

**Context parallelism** (``CP`` ranks) divides the tokens: a rank keeps these per-token terms
for its ``seq_length / CP`` tokens (:mod:`lptrain.memory.context_parallel`).
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from lptrain.config.schema import LPTrainConfig
from lptrain.memory.context_parallel import tokens_per_rank


class TPShares:
    """How tensor (and sequence) parallelism divides each kind of activation on one rank."""

    def __init__(self, cfg: LPTrainConfig) -> None:
        m = cfg.model
        self.t = max(1, m.tensor_model_parallel_size)
        sp = m.sequence_parallel and self.t > 1
        self.sharded = 1.0 / self.t  # split heads, FFN width, vocab
        self.sequence = 1.0 / self.t if sp else 1.0  # norms, residuals, layer inputs
        # the gathered QKV / fc1 input: TE keeps its sequence shard, the emulation the whole
        self.gathered = 1.0 / self.t if sp and cfg.precision.backend == "te" else 1.0


def _layer_terms(
    cfg: LPTrainConfig, a: int, quantized: bool, quantizers: Optional[Any], moe: bool
) -> float:
    """Bytes per token of one transformer layer on one rank (see :class:`TPShares`)."""
    tp = TPShares(cfg)
    m = cfg.model
    h, n = m.hidden_size, m.num_attention_heads
    g = m.num_query_groups or n
    d = h // n
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
    if moe:  # the block runs on the sequence shard (experts whole on every TP rank)
        mlp = _mlp_terms(cfg, a, gemm_in, moe)[0] * tp.sequence
        return 2 * norm * tp.sequence + gemm_in(h) * tp.gathered + attn * tp.sharded + mlp
    layer = 2 * norm * tp.sequence + gemm_in(h) * tp.gathered + attn * tp.sharded
    mlp_in = gemm_in(h)
    return layer + mlp_in * tp.gathered + (_mlp_terms(cfg, a, gemm_in, moe)[0] - mlp_in) * tp.sharded


def _mlp_terms(cfg: LPTrainConfig, a: int, gemm_in: Any, moe: bool) -> tuple[float, float]:
    """(bytes per token of the MLP / MoE block, of which its SwiGLU activations' fp32 copies)."""
    m = cfg.model
    h = m.hidden_size
    f = m.ffn_hidden_size or 4 * h
    if moe:
        e = m.moe
        fe = e.ffn_hidden_size or f
        k = e.router_topk
        swiglu = 8 * fe + 4 * fe + gemm_in(fe)
        return k * (gemm_in(h) + swiglu + a * h) + 4 * e.num_experts * 2, k * 12 * fe
    return gemm_in(h) + 8 * f + 4 * f + gemm_in(f), 12 * f


def _selective_saving(cfg: LPTrainConfig, a: int, quantized: bool, quantizers: Optional[Any],
                      moe: bool, modules: tuple[str, ...]) -> float:
    """Bytes per token one layer keeps less under selective recompute of ``modules``:
    ``core_attn`` the kernel's log-sum-exp (its output is the projection's input, kept
    anyway); ``mlp_act`` the SwiGLU's fp32 copies and ``silu(gate)``, less the activation's
    input the region keeps; ``mlp`` the whole block less its input."""
    m = cfg.model
    h, n = m.hidden_size, m.num_attention_heads
    dtype = torch.bfloat16 if a == 2 else torch.float32

    def gemm_in(width: int) -> float:
        if quantized and quantizers is not None:
            return quantizers.input_bytes_per_row(width, dtype)
        return a * width

    save = 4.0 * n if "core_attn" in modules else 0.0
    block, act = _mlp_terms(cfg, a, gemm_in, moe)
    f = m.moe.ffn_hidden_size if moe and m.moe.ffn_hidden_size else (m.ffn_hidden_size or 4 * h)
    passes = m.moe.router_topk if moe else 1
    if "mlp" in modules:
        save += block - a * h
    elif "mlp_act" in modules:
        save += act - passes * a * 2 * f  # the region keeps [gate|up] in the activation dtype
    tp = TPShares(cfg)  # heads and FFN width split; MoE layers on the sequence shard
    return max(0.0, save) * (tp.sequence if moe else tp.sharded)


def _layers(cfg: LPTrainConfig, model: torch.nn.Module, a: int, quantizers: Optional[Any],
            modules: tuple[str, ...]) -> tuple[list[float], list[float]]:
    """(bytes per token of every layer, of which selective recompute of ``modules`` saves)."""
    factory = getattr(model, "factory", None)
    per_layer, savings = [], []
    for i, layer in enumerate(getattr(model, "layers", [])):
        quantized = factory is not None and not factory.is_bf16_layer(i + 1)
        moe = bool(getattr(layer, "is_moe", False))
        per_layer.append(_layer_terms(cfg, a, quantized, quantizers, moe))
        savings.append(_selective_saving(cfg, a, quantized, quantizers, moe, modules))
    return per_layer, savings


def _peak_per_token(cfg: LPTrainConfig, a: int, per_layer: list[float], savings: list[float],
                    granularity: Optional[str], method: str, num_layers: int, head_here: bool = True,
                    in_flight: float = 1.0) -> float:
    """Peak bytes per token: the larger of the two moments a step's activations peak at.

    * the end of the forward: every kept tensor, the head's, and the loss's fp32 gradient of
      the logits (``4 * vocab``, the backward's first allocation, alive with all of them);
    * a layer's backward: what is kept then -- with recompute, the regions' inputs plus the
      region just recomputed (the head and every layer above it are freed by then) -- plus
      the layer's largest activation gradient, the SwiGLU's fp32 ``[gate|up]`` gradient
      (``8f``; ``router_topk`` of them in an MoE layer).

    A pipeline stage without the head (``head_here`` false) has no head terms; one with
    ``in_flight`` micro-batches in flight (:meth:`lptrain.catalog.pipeline.PipelineLayout.
    in_flight`) keeps the others' kept tensors too, ``(in_flight - 1) x kept``.
    """
    m = cfg.model
    tp = TPShares(cfg)
    vocab = 4 * m.vocab_size * tp.sharded  # fp32 logits over this rank's vocab columns
    head = 8 * m.hidden_size * tp.sequence + a * m.hidden_size * tp.gathered + vocab
    if not head_here:
        head = vocab = 0.0
    f = m.ffn_hidden_size or 4 * m.hidden_size
    grad = 8 * f * tp.sharded
    if m.moe.num_experts:
        grad = max(grad, 8 * m.moe.router_topk * (m.moe.ffn_hidden_size or f) * tp.sequence)
    x = a * m.hidden_size * tp.sequence  # a layer's (or chunk's) input
    n = len(per_layer)
    recompute = 0.0  # (no recompute: the backward's moment is the kept tensors')
    if granularity == "full" and n:
        k = min(num_layers, n)
        if method == "block":  # the first k layers, recomputed last
            kept = k * x + sum(per_layer[k:])
            recompute = k * x + max(per_layer[:k])
        else:
            kept = -(-n // k) * x
            recompute = kept + k * max(per_layer)
    elif granularity == "selective" and n:
        kept = sum(per_layer) - sum(savings)
        recompute = kept + max(savings)
    else:
        kept = sum(per_layer)
    return max(kept + head + vocab, max(kept, recompute) + grad) + max(0.0, in_flight - 1) * kept


def _holds_head(model: torch.nn.Module) -> bool:
    return getattr(model, "final_norm", None) is not None


def activation_bytes(
    cfg: LPTrainConfig, model: torch.nn.Module, a: int, quantizers: Optional[Any], in_flight: float = 1.0
) -> tuple[int, int]:
    """(no recompute, full per-layer recompute) peak bytes of one micro-batch's activations
    (of ``in_flight`` micro-batches on a pipeline stage: :func:`_peak_per_token`) on one
    rank: its ``seq_length / CP`` tokens of each sequence under context parallelism."""
    tokens = tokens_per_rank(cfg)
    per_layer, savings = _layers(cfg, model, a, quantizers, ())
    head = _holds_head(model)
    none = _peak_per_token(cfg, a, per_layer, savings, None, "uniform", 1, head, in_flight)
    full = _peak_per_token(cfg, a, per_layer, savings, "full", "uniform", 1, head, in_flight)
    return int(tokens * none), int(tokens * full)


def configured_activation_bytes(
    cfg: LPTrainConfig, model: torch.nn.Module, a: int, quantizers: Optional[Any], in_flight: float = 1.0
) -> int:
    """Peak bytes of one micro-batch's activations under the run's recompute settings
    (``model.recompute_*``), at the larger of the end of the forward and a recompute
    (:func:`_peak_per_token`); the regions are recomputed one by one:

    * none: every layer's activations;
    * full, uniform ``k``: each chunk's input (``a*h`` per token); recomputing, plus ``k``
      layers;
    * full, block ``k``: the first ``k`` layers' inputs and the other layers whole;
      recomputing (the first ``k`` come last, the layers above them are freed by then), the
      inputs plus one layer;
    * selective: every layer less :func:`_selective_saving`; recomputing, plus one layer's
      saving.
    """
    from lptrain.model.recompute import RecomputePlan

    plan = RecomputePlan.of(cfg.model)
    tokens = tokens_per_rank(cfg)
    per_layer, savings = _layers(cfg, model, a, quantizers, plan.modules)
    return int(tokens * _peak_per_token(cfg, a, per_layer, savings, plan.granularity, plan.method,
                                        plan.num_layers, _holds_head(model), in_flight))
