"""GPT decoder: embedding, pre-norm transformer layers (attention + dense/MoE SwiGLU MLP),
final RMSNorm and an output head (tied to the embedding or untied).

Plain PyTorch math that knows nothing about formats or parallelism: every GEMM of the
transformer layers comes from the precision layer factory, each layer's forward runs in
``factory.layer_context(layer_number)`` (1-based, as Megatron's ``layer_number``).
Quantized GEMMs run only inside ``factory.autocast()``, which the caller (trainer, eval,
tests) wraps around the forward as with TE's autocast -- ``with model.autocast(): loss, aux
= model(tokens, labels)`` -- so the amax-reduction group stays the trainer's choice and
regions never nest by accident. Activations between layers flow in ``compute_dtype``: fp32
on the CPU (bf16 math is both slower there and less accurate), the 16-bit params dtype on
CUDA (``lptrain.model.build.compute_dtype_for``; TE layers then get bf16 inputs). Norms,
softmax, the router, the MoE combine and the loss are computed in fp32 either way.

The embedding and the output head are not quantized (Megatron keeps its output layer out
of TE/FP8): on the CPU the head is an fp32 GEMM with the (possibly bf16) weight upcast; with
16-bit activations it is a 16-bit GEMM (fp32 accumulation) whose logits are upcast for the
fp32 loss, as Megatron's output layer.

Tensor parallelism is not this module's business: the parallelize step
(:mod:`lptrain.model.tensor_parallel`) builds the model against a factory that shards the
planned GEMMs and then swaps the embedding, the head (``output_layer``, or ``tied_head`` for
a tied one), the loss (``lm_loss``) and the norms for their tensor-parallel versions.

Neither is pipeline parallelism: a pipeline rank builds the :class:`ModelPart` it holds --
some layers (under their global names, ``layers.<i>.``), the embedding on the first stage,
the final norm and head on the last -- and :mod:`lptrain.model.pipeline` runs its chunks
through the same :meth:`GPTModel.embed` / :meth:`GPTModel.run_layers` /
:meth:`GPTModel.logits` / :meth:`GPTModel.loss` steps :meth:`GPTModel.forward` is made of.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Optional, Union

import torch
import torch.nn.functional as F
from torch import nn

from lptrain.model.attention import SelfAttention
from lptrain.model.build_context import BuildContext
from lptrain.model.mlp import MLP
from lptrain.model.moe.layer import MoELayer
from lptrain.model.moe.router import TopKRouter
from lptrain.model.norm import RMSNorm
from lptrain.model.recompute import RecomputePlan, run_checkpointed
from lptrain.model.rope import RotaryEmbedding

AUX_KEYS = ("load_balancing_loss", "z_loss")


def padded_vocab_size(vocab: int, divisible_by: int) -> int:
    """Embedding/head rows: ``vocab`` rounded up to a multiple of ``divisible_by``."""
    d = max(1, divisible_by)
    return (vocab + d - 1) // d * d


def is_moe_layer(index: int, moe_layer_freq: int, num_experts: int) -> bool:
    """Megatron's integer ``moe_layer_freq`` pattern: layer ``i`` (0-based) is MoE iff
    ``i % freq == 0`` (freq 1 = all layers)."""
    return num_experts > 0 and index % max(1, moe_layer_freq) == 0


class TokenEmbedding(nn.Embedding):
    """``nn.Embedding`` whose table is upcast to the compute dtype before the gather, so the
    backward accumulates repeated tokens in that dtype and casts to the param dtype once.
    A module call (not a bare ``F.embedding`` on the weight), so forward pre-hooks -- the
    data-parallel engine's overlapped param gather -- see every use of the weight."""

    def forward(self, tokens: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:  # type: ignore[override]
        return F.embedding(tokens, self.weight.to(dtype))


class OutputHead(nn.Linear):
    """The unquantized LM head: an fp32 GEMM on CPU (bf16 weight upcast), bf16 on CUDA."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return head_logits(x, self.weight)


def head_logits(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    if x.dtype == torch.float32:
        return x @ weight.float().t()
    return F.linear(x, weight.to(x.dtype)).float()


class TiedHead(nn.Module):
    """The head of a tied model: the embedding's weight (already gathered before the first
    layer), applied to the final hidden states. A module so the parallelize step can swap it."""

    def forward(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return head_logits(x, weight)


class LMLoss(nn.Module):
    """Mean next-token cross-entropy over the real vocabulary (the padded rows' logits are cut
    off), ``-100`` labels ignored; ``logits()`` gives the whole ``[b, s, vocab]`` logits.
    ``token_count`` divides the sum instead of this batch's own count of labels (context
    parallelism: the count of the whole sequences, of which this rank holds chunks)."""

    def __init__(self, vocab_size: int) -> None:
        super().__init__()
        self.vocab_size = vocab_size

    def logits(self, logits: torch.Tensor) -> torch.Tensor:
        return logits[..., : self.vocab_size] if logits.shape[-1] != self.vocab_size else logits

    def forward(self, logits: torch.Tensor, labels: torch.Tensor,
                token_count: Optional[torch.Tensor] = None) -> torch.Tensor:
        logits = self.logits(logits)
        flat, targets = logits.reshape(-1, self.vocab_size), labels.reshape(-1)
        if token_count is None:
            return F.cross_entropy(flat, targets, ignore_index=-100)
        return F.cross_entropy(flat, targets, ignore_index=-100, reduction="sum") / token_count


class TransformerLayer(nn.Module):
    """``x + attn(norm(x))`` then ``x + mlp(norm(x))``."""

    def __init__(self, ctx: BuildContext, index: int) -> None:
        super().__init__()
        cfg = ctx.cfg
        prefix = f"layers.{index}."
        self.layer_number = index + 1
        self.factory = ctx.factory
        self.input_norm = RMSNorm(cfg.hidden_size, cfg.norm_epsilon, ctx.params_dtype)
        self.self_attention = SelfAttention(ctx, f"{prefix}self_attention.")
        self.pre_mlp_norm = RMSNorm(cfg.hidden_size, cfg.norm_epsilon, ctx.params_dtype)
        self.is_moe = is_moe_layer(index, cfg.moe.moe_layer_freq, cfg.moe.num_experts)
        self.mlp: nn.Module = MoELayer(ctx, f"{prefix}mlp.") if self.is_moe else MLP(ctx, f"{prefix}mlp.")
        self.recompute_mlp = RecomputePlan.of(cfg).selects("mlp")

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        with self.factory.layer_context(self.layer_number):
            x = x + self.self_attention(self.input_norm(x), cos, sin)
            m, losses = run_checkpointed(self.recompute_mlp, self.factory, self.mlp, self.pre_mlp_norm(x))
            return x + m, losses


def run_layers(
    layers: Any, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, totals: dict[str, torch.Tensor]
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``layers`` in order, adding each layer's losses to ``totals`` (in the same order with
    or without recompute chunks, so the sums are bitwise the same)."""
    totals = dict(totals)
    for layer in layers:
        x, losses = layer(x, cos, sin)
        for k, v in losses.items():
            totals[k] = totals[k] + v
    return x, totals


@dataclass(frozen=True)
class ModelPart:
    """The piece of the model one rank builds: the transformer layers ``layers`` (global
    0-based indices, in order), the token embedding when ``embedding``, the final norm, the
    output head and the loss when ``head`` (a tied head's table too:
    :class:`GPTModel` keeps a copy of the embedding there). The whole model by default."""

    layers: tuple[int, ...]
    embedding: bool = True
    head: bool = True

    @staticmethod
    def whole(num_layers: int) -> ModelPart:
        return ModelPart(tuple(range(num_layers)))


class LayerStack(nn.Module):
    """The transformer layers a model holds, registered under their global indices
    (``layers.<i>.`` stays the canonical name on every pipeline stage) and read by position
    like an ``nn.ModuleList``: ``len``, iteration and ``[i]`` / ``[a:b]`` in layer order."""

    def __init__(self, layers: Iterable[nn.Module]) -> None:
        super().__init__()
        for layer in layers:
            self.add_module(str(layer.layer_number - 1), layer)

    def __len__(self) -> int:
        return len(self._modules)

    def __iter__(self) -> Iterator[nn.Module]:
        return iter(self._modules.values())  # type: ignore[arg-type]

    def __getitem__(self, i: Union[int, slice]) -> Any:
        return list(self._modules.values())[i]


class GPTModel(nn.Module):
    """Decoder-only LM. ``forward(tokens)`` -> fp32 logits ``[b, s, vocab]``;
    ``forward(tokens, labels)`` -> ``(loss, aux)`` with ``loss = lm_loss + sum of the
    coefficient-weighted MoE losses of all MoE layers`` and ``aux`` holding the detached
    parts for logging: ``lm_loss``, ``load_balancing_loss``, ``z_loss`` (sums over layers,
    already multiplied by their coefficients; zero for dense models).

    ``sequence_first``: the layer stack stores its hidden states sequence-first
    (:mod:`lptrain.model.layout`; set by the parallelize step under sequence parallelism on
    TE); a pipeline stage then sends and receives them as ``[s, b, h]``.
    """

    sequence_first: bool = False

    def __init__(self, ctx: BuildContext, compute_dtype: torch.dtype = torch.float32,
                 part: Optional[ModelPart] = None) -> None:
        super().__init__()
        cfg = ctx.cfg
        part = part or ModelPart.whole(cfg.num_layers)
        self.part = part
        self.cfg = cfg
        self.factory = ctx.factory
        self.compute_dtype = compute_dtype
        self.vocab_size = cfg.vocab_size
        self.padded_vocab_size = padded_vocab_size(cfg.vocab_size, cfg.make_vocab_size_divisible_by)
        self.tie_embeddings = cfg.tie_embeddings
        self.seed = ctx.seed
        self.expert_model_parallel_size = ctx.expert_model_parallel_size
        self.expert_model_parallel_rank = ctx.expert_model_parallel_rank
        self.recompute = RecomputePlan.of(cfg)
        with ctx.factory.model_init():
            # (a tied head's pipeline stage keeps its own copy of the table: Megatron's
            # word-embedding copy on the last stage, its gradient summed with the first's)
            self.embedding: Optional[TokenEmbedding] = None
            if part.embedding or (part.head and cfg.tie_embeddings):
                self.embedding = TokenEmbedding(self.padded_vocab_size, cfg.hidden_size, dtype=ctx.params_dtype)
                ctx.init("embedding.weight", ctx.std)(self.embedding.weight.data)
            head_dim = cfg.hidden_size // cfg.num_attention_heads
            self.rotary = RotaryEmbedding(head_dim, cfg.rotary_base, cfg.seq_length)
            self.layers = LayerStack(TransformerLayer(ctx, i) for i in part.layers)
            self.final_norm: Optional[RMSNorm] = None
            if part.head:
                self.final_norm = RMSNorm(cfg.hidden_size, cfg.norm_epsilon, ctx.params_dtype)
            self.output_layer: Optional[OutputHead] = None
            if part.head and not cfg.tie_embeddings:
                self.output_layer = OutputHead(
                    cfg.hidden_size, self.padded_vocab_size, bias=False, dtype=ctx.params_dtype
                )
                ctx.init("output_layer.weight", ctx.std)(self.output_layer.weight.data)
            self.tied_head = TiedHead()
            self.lm_loss = LMLoss(cfg.vocab_size)

    @property
    def device(self) -> torch.device:
        """Where the model's parameters live (the run device ``build_model`` placed it on)."""
        return next(self.parameters()).device

    @property
    def output_weight(self) -> torch.Tensor:
        if self.output_layer is not None:
            return self.output_layer.weight
        assert self.embedding is not None, "a model part without the head has no output weight"
        return self.embedding.weight

    def autocast(self, amax_reduction_group: Any = None) -> Any:
        """The factory's quantization context for this model's forward (no-op if none)."""
        autocast = getattr(self.factory, "autocast", None)
        if autocast is None:
            return contextlib.nullcontext()
        return autocast(amax_reduction_group) if amax_reduction_group is not None else autocast()

    def micro_batch(self, first: bool) -> Any:
        """The factory's context around one micro-batch's forward of a training step."""
        ctx = getattr(self.factory, "micro_batch", None)
        return contextlib.nullcontext() if ctx is None else ctx(first)

    def evaluation_guard(self) -> Any:
        """The factory's guard around an evaluation (TE: its delayed scaling left as it was)."""
        guard = getattr(self.factory, "evaluation_guard", None)
        return contextlib.nullcontext() if guard is None else guard(self)

    def forward(
        self, tokens: torch.Tensor, labels: Optional[torch.Tensor] = None
    ) -> Union[torch.Tensor, tuple[torch.Tensor, dict[str, torch.Tensor]]]:
        if not (self.part.embedding and self.part.head and len(self.layers) == self.cfg.num_layers):
            raise RuntimeError("this model holds one pipeline stage: run it through its schedule "
                               "(lptrain.model.pipeline), not as a whole model")
        x = self.embed(tokens)
        totals = {k: x.new_zeros((), dtype=torch.float32) for k in AUX_KEYS}
        x, totals = self.run_layers(self.layers, x, totals, tokens.shape[1])
        logits = self.logits(x)
        if labels is None:
            return self.lm_loss.logits(logits)
        return self.loss(logits, labels, totals)

    # ---- the steps of a forward (a pipeline chunk runs some of them) -------------------------

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """The token embedding: hidden states ``[b, s, h]`` in the compute dtype."""
        assert self.embedding is not None, "this model part does not hold the embedding"
        # Upcast the embedding table: the gather's backward then accumulates repeated tokens
        # in fp32 and casts to the parameter dtype once.
        return self.embedding(tokens, self.compute_dtype)

    def run_layers(self, layers: Sequence[nn.Module], x: torch.Tensor, totals: dict[str, torch.Tensor],
                   seq_len: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """``layers`` (consecutive, in order) on ``x`` (a sequence of ``seq_len`` tokens: ``x``
        holds a shard of it under sequence parallelism), in the recompute chunks of the plan
        (counted within ``layers``: Megatron's recompute runs per pipeline stage), adding the
        layers' MoE losses to ``totals``."""
        cos, sin = self.rotary(seq_len)
        for start, end, ckpt in self.recompute.layer_chunks(len(layers)):
            chunk = layers[start:end]
            x, totals = run_checkpointed(ckpt, self.factory, run_layers, chunk, x, cos, sin, totals)
        return x, totals

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """Final norm and head: fp32 logits over the padded vocabulary."""
        assert self.final_norm is not None, "this model part does not hold the head"
        x = self.final_norm(x)
        x = x.float() if self.compute_dtype == torch.float32 else x
        if self.output_layer is not None:
            return self.output_layer(x)
        # Tied: the embedding's weight (on one rank already gathered before the first layer;
        # a pipeline's last stage gathers its copy first: lptrain.model.pipeline)
        assert self.embedding is not None
        return self.tied_head(x, self.embedding.weight)

    def loss(self, logits: torch.Tensor, labels: torch.Tensor,
             totals: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """``(loss, aux)`` of :meth:`forward` from the logits and the MoE loss totals."""
        lm_loss = self.lm_loss(logits, labels)
        loss = lm_loss + totals["load_balancing_loss"] + totals["z_loss"]
        aux = {"lm_loss": lm_loss.detach(), **{k: v.detach() for k, v in totals.items()}}
        return loss, aux

    def quantizer_recipe(self) -> Any:
        """The recipe the factory's quantized layers run (None for an unquantized run):
        whose quantizer random streams a checkpoint saves."""
        return getattr(self.factory, "recipe", None)

    def routers(self) -> list[TopKRouter]:
        """The MoE routers, in module order (empty for a dense model)."""
        return [m for m in self.modules() if isinstance(m, TopKRouter)]

    def expert_bias_counts(self) -> list[torch.Tensor]:
        """The live per-expert token counts (``local_tokens_per_expert``) that the routers
        with an expert bias accumulate for :meth:`update_expert_bias`, in router order
        (empty when no router keeps an expert bias)."""
        return [r.local_tokens_per_expert for r in self.routers() if r.enable_expert_bias]

    def update_expert_bias(self) -> None:
        """Aux-loss-free balancing step for every router (call after the optimizer step).

        Distributed callers all-reduce each router's ``local_tokens_per_expert`` over the
        data-parallel group before calling this.
        """
        for r in self.routers():
            r.update_expert_bias()
