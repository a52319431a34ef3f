"""Pipeline stages of the GPT model: which part of it a pipeline rank builds, and the chunk
modules a ``torch.distributed.pipelining`` schedule runs.

A pipeline rank builds one :class:`~lptrain.model.gpt.GPTModel` holding all of its layers
(:func:`model_part`; the split -- even or uneven, loop or V placement -- is
:class:`lptrain.catalog.pipeline.PipelineLayout`'s) under
their global names, so buffers, optimizers and checkpoints see one model per rank with the
canonical parameter names. Each of its model chunks (one per virtual stage) is a
:class:`PipelineChunk`: a thin module over that model running the same steps
:meth:`GPTModel.forward` is made of -- :meth:`~GPTModel.embed` on the first chunk, its layers
through :meth:`~GPTModel.run_layers`, :meth:`~GPTModel.logits` on the last -- so each
micro-batch goes through exactly the operations of the unpipelined model, in the same
order, and its loss is :meth:`~GPTModel.loss` of the same operands.

What travels between stages: the hidden states ``[b, s, h]`` (``s / TP`` rows under sequence
parallelism; stored ``[s / TP, b, h]`` on TE, as the layer stack keeps them:
:mod:`lptrain.model.layout`) and, for a MoE model, the running totals of the auxiliary losses
(``load_balancing_loss``, ``z_loss``) the unpipelined forward threads through its layers: the
graph of the pipelined model is the unpipelined graph cut at the stage boundaries, so every
gradient (those of the auxiliary losses included) is the same sum of the same terms.

**Delayed scaling.** Each chunk forward runs in its own autocast region, over the stage's
amax-reduction group (tensor x data parallel ranks of the stage): the delayed-scaling state of
a layer is updated once per micro-batch, forward roles when the region exits and gradient
roles after the chunk's backward -- for every layer at the same point of its own sequence of
quantizations as in the unpipelined run, whatever order the schedule runs the micro-batches
and chunks in (a layer's forwards, and its backwards, still come in micro-batch order). Under
a split backward (the zero-bubble schedules) the gradient operand is quantized, and its role
updated, in the I step; the W step only multiplies the operands that step kept.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Optional

import torch
from torch import nn

from lptrain.catalog.pipeline import PipelineLayout, layout_for
from lptrain.config.schema import ModelConfig
from lptrain.model.gpt import AUX_KEYS, GPTModel, ModelPart, is_moe_layer


def pipeline_layout(cfg: ModelConfig) -> PipelineLayout:
    """The run's split of the layers over pipeline ranks and model chunks (even, or as
    Megatron-LM's uneven keys ask: :mod:`lptrain.catalog.pipeline_split`)."""
    return layout_for(cfg)


def model_part(cfg: ModelConfig, pp_rank: int) -> Optional[ModelPart]:
    """The part of the model pipeline rank ``pp_rank`` builds (None without pipeline
    parallelism: the whole model)."""
    lay = pipeline_layout(cfg)
    if lay.pp == 1:
        return None
    return ModelPart(tuple(lay.rank_layers(pp_rank)), embedding=lay.holds_embedding(pp_rank),
                     head=lay.holds_head(pp_rank))


def aux_requires_grad(cfg: ModelConfig, layers_before: int) -> tuple[bool, bool]:
    """Whether the (load-balancing, z) loss totals carry a gradient after the first
    ``layers_before`` layers: some MoE layer among them adds a loss that has one."""
    moe = cfg.moe
    any_moe = any(is_moe_layer(i, moe.moe_layer_freq, moe.num_experts) for i in range(layers_before))
    lb = any_moe and moe.aux_loss_coeff > 0 and moe.load_balancing_type != "none"
    return lb, any_moe and moe.z_loss_coeff > 0


class PipelineChunk(nn.Module):
    """Model chunk ``chunk`` of a pipeline rank's ``model``: the module its pipeline stage
    runs (see the module doc). ``forward`` takes the tokens (first chunk) or the previous
    chunk's outputs and returns ``(hidden, *aux totals)`` -- or, on the last chunk, the
    logits in place of the hidden states (the schedule's loss function gets them with the
    labels). ``amax_group`` is the stage's delayed-scaling reduction group.

    The model is held without registering it (the chunks share it; the engine owns it), so
    ``parameters()`` of a chunk is empty: nothing here is optimized per chunk."""

    def __init__(self, model: GPTModel, layout: PipelineLayout, chunk: int, amax_group: Any,
                 seq_length: int) -> None:
        super().__init__()
        self.__dict__["model"] = model  # not a submodule (see the class doc)
        self.chunk = chunk
        self.first = chunk == 0
        self.last = chunk == layout.chunks - 1
        indices = set(layout.chunk_layers(chunk))
        self.layers = [layer for layer in model.layers if layer.layer_number - 1 in indices]
        self.amax_group = amax_group
        self.seq_length = seq_length
        self.carries_aux = model.cfg.moe.num_experts > 0
        # set by the engine on a tied head's last stage: make the copy of the table current
        # (its gather) before the head reads it (no module call of the table runs there)
        self.before_tied_head: Optional[Callable[[], None]] = None

    def forward(self, *inputs: torch.Tensor) -> Any:
        model = self.model
        with model.autocast(self.amax_group):
            if self.first:
                (tokens,) = inputs
                x = model.embed(tokens)
                totals = {k: x.new_zeros((), dtype=torch.float32) for k in AUX_KEYS}
            else:
                x, *aux = inputs
                if model.sequence_first:  # received [s, b, h]: the stack's [b, s, h] view
                    x = x.transpose(0, 1)
                totals = (dict(zip(AUX_KEYS, aux, strict=True)) if self.carries_aux else
                          {k: x.new_zeros((), dtype=torch.float32) for k in AUX_KEYS})
            x, totals = model.run_layers(self.layers, x, totals, self.seq_length)
            if self.last:
                if self.before_tied_head is not None and model.output_layer is None:
                    self.before_tied_head()
                x = model.logits(x)
            elif model.sequence_first:
                x = x.transpose(0, 1).contiguous()  # sent [s, b, h] (no copy: stored so)
        if not self.carries_aux:
            return x
        return (x, *(totals[k] for k in AUX_KEYS))


def chunk_io(cfg: ModelConfig, layout: PipelineLayout, chunk: int, micro_batch: int,
             dtype: torch.dtype, vocab_rows: int,
             sequence_first: bool = False) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
    """Example ``(inputs, outputs)`` of model chunk ``chunk`` on the meta device: what a
    ``PipelineStage`` needs to allocate its receive buffers without running the model
    (static metadata: no forward is run to infer shapes). ``vocab_rows``: the logits' last
    dimension on this rank (the padded vocabulary, ``/ TP`` under tensor parallelism). A
    context-parallel rank holds ``seq_length / CP`` tokens of each sequence; the hidden
    states travel ``[s, b, h]`` when the model stores them ``sequence_first``."""
    tp = max(1, cfg.tensor_model_parallel_size)
    seq = cfg.seq_length // max(1, cfg.context_parallel_size)
    rows = seq // tp if cfg.sequence_parallel and tp > 1 else seq
    meta = torch.device("meta")

    def hidden(requires_grad: bool) -> torch.Tensor:
        shape = (rows, micro_batch) if sequence_first else (micro_batch, rows)
        return torch.empty(*shape, cfg.hidden_size, dtype=dtype, device=meta, requires_grad=requires_grad)

    def aux(layers_before: int) -> tuple[torch.Tensor, ...]:
        if cfg.moe.num_experts == 0:
            return ()
        grads = aux_requires_grad(cfg, layers_before)
        return tuple(torch.empty((), dtype=torch.float32, device=meta, requires_grad=g) for g in grads)

    start = layout.chunk_layers(chunk).start
    end = layout.chunk_layers(chunk).stop
    if chunk == 0:
        inputs: tuple[torch.Tensor, ...] = (torch.empty(micro_batch, seq, dtype=torch.long,
                                                        device=meta),)
    else:
        inputs = (hidden(True), *aux(start))
    if chunk == layout.chunks - 1:
        logits = torch.empty(micro_batch, seq, vocab_rows, dtype=torch.float32,
                             device=meta, requires_grad=True)
        outputs: tuple[torch.Tensor, ...] = (logits, *aux(end))
    else:
        outputs = (hidden(True), *aux(end))
    return inputs, outputs
