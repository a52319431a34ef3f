"""lptrain's canonical tensors <-> a Hugging Face architecture's tensors.

One table of :class:`Link` s (canonical name, Hugging Face names, how the tensor is cut)
drives both directions, so export and import cannot drift apart. The cuts:

* ``copy`` -- same tensor (norms, projections, router, ``fc2`` / ``down_proj``);
* ``vocab`` -- embedding / output head: lptrain pads the rows to
  ``make_vocab_size_divisible_by``; Hugging Face holds exactly ``vocab_size`` rows (the
  padding rows are never read by lptrain's forward, and come back as zeros);
* ``qkv`` -- the fused QKV weight is laid out per query group (``q_per_group`` query
  heads, then the group's key head, then its value head, see ``model.attention``), so
  viewed as ``[groups, q_per_group + 2, head_dim, hidden]`` it splits into
  ``q_proj [heads*head_dim]`` (head ``g*q_per_group + j``, the order ``repeat_kv`` expects),
  ``k_proj`` and ``v_proj [groups*head_dim]``;
* ``gate_up`` -- SwiGLU ``fc1`` is ``[gate | up]`` along its rows: ``gate_proj`` / ``w1``
  first, ``up_proj`` / ``w3`` second.

Experts use lptrain's canonical per-expert names (``...experts.linear_fc1.weight.<e>``,
global expert index), so the table does not depend on the expert layout or the EP size a
checkpoint was written with. On import, the fused ``experts.gate_up_proj`` /
``experts.down_proj`` tensors of ``transformers`` 5 (``save_original_format=False``) are
accepted too and cut per expert first.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

import torch

from lptrain.config.schema import ModelConfig
from lptrain.interop.hf_arch import (
    Architecture,
    HFFormatError,
    dense_ffn,
    expert_ffn,
    head_dim,
    moe_layer_indices,
    query_groups,
)

# Keys some Hugging Face checkpoints carry that are not weights (recomputed RoPE tables).
_IGNORED = re.compile(r"\.rotary_emb\.inv_freq$")
_FUSED_EXPERTS = re.compile(r"^(?P<layer>model\.layers\.\d+)\.(?:mlp|block_sparse_moe)\.experts\.(?P<what>gate_up_proj|down_proj)$")
_FUSED_ROUTER = re.compile(r"^(?P<layer>model\.layers\.\d+)\.mlp\.gate\.weight$")


@dataclass(frozen=True)
class Link:
    """One canonical tensor and the Hugging Face tensor(s) it becomes."""

    canonical: str
    hf: tuple[str, ...]
    cut: str  # copy | vocab | qkv | gate_up


def links(m: ModelConfig, arch: Architecture) -> Iterator[Link]:
    """Every tensor of ``m`` as ``arch``, in ``transformers``' module order."""
    yield Link("embedding.weight", ("model.embed_tokens.weight",), "vocab")
    moe = set(moe_layer_indices(m))
    for i in range(m.num_layers):
        c, h = f"layers.{i}.", f"model.layers.{i}."
        att = f"{h}self_attn."
        yield Link(f"{c}self_attention.linear_qkv.weight",
                   (f"{att}q_proj.weight", f"{att}k_proj.weight", f"{att}v_proj.weight"), "qkv")
        yield Link(f"{c}self_attention.linear_proj.weight", (f"{att}o_proj.weight",), "copy")
        if arch.qk_norm:
            yield Link(f"{c}self_attention.q_layernorm.weight", (f"{att}q_norm.weight",), "copy")
            yield Link(f"{c}self_attention.k_layernorm.weight", (f"{att}k_norm.weight",), "copy")
        if i in moe:
            block = f"{h}{arch.moe_block}."
            gate, up, down = arch.expert_proj
            yield Link(f"{c}mlp.router.weight", (f"{block}gate.weight",), "copy")
            for e in range(m.moe.num_experts):
                x = f"{block}experts.{e}."
                yield Link(f"{c}mlp.experts.linear_fc1.weight.{e}", (f"{x}{gate}.weight", f"{x}{up}.weight"), "gate_up")
                yield Link(f"{c}mlp.experts.linear_fc2.weight.{e}", (f"{x}{down}.weight",), "copy")
        else:
            yield Link(f"{c}mlp.linear_fc1.weight", (f"{h}mlp.gate_proj.weight", f"{h}mlp.up_proj.weight"), "gate_up")
            yield Link(f"{c}mlp.linear_fc2.weight", (f"{h}mlp.down_proj.weight",), "copy")
        yield Link(f"{c}input_norm.weight", (f"{h}input_layernorm.weight",), "copy")
        yield Link(f"{c}pre_mlp_norm.weight", (f"{h}post_attention_layernorm.weight",), "copy")
    yield Link("final_norm.weight", ("model.norm.weight",), "copy")
    if not m.tie_embeddings:
        yield Link("output_layer.weight", ("lm_head.weight",), "vocab")


def canonical_shapes(m: ModelConfig, arch: Architecture) -> dict[str, torch.Size]:
    """The shape of every canonical tensor of ``m`` (vocabulary rows padded as the model pads
    them; every expert, whatever the EP size), in :func:`links` order."""
    from lptrain.model.gpt import padded_vocab_size

    h, hd = m.hidden_size, head_dim(m)
    heads, g = m.num_attention_heads, query_groups(m)
    f, fe = dense_ffn(m), expert_ffn(m)
    vocab = padded_vocab_size(m.vocab_size, m.make_vocab_size_divisible_by)
    by_suffix = {
        "embedding.weight": (vocab, h), "output_layer.weight": (vocab, h), "final_norm.weight": (h,),
        "linear_qkv.weight": ((heads + 2 * g) * hd, h), "linear_proj.weight": (h, heads * hd),
        "q_layernorm.weight": (hd,), "k_layernorm.weight": (hd,), "router.weight": (m.moe.num_experts, h),
        "mlp.linear_fc1.weight": (2 * f, h), "mlp.linear_fc2.weight": (h, f),
        "input_norm.weight": (h,), "pre_mlp_norm.weight": (h,),
    }
    out: dict[str, torch.Size] = {}
    for link in links(m, arch):
        name = link.canonical
        if ".experts.linear_fc1." in name:
            out[name] = torch.Size((2 * fe, h))
        elif ".experts.linear_fc2." in name:
            out[name] = torch.Size((h, fe))
        else:
            out[name] = torch.Size(next(v for k, v in by_suffix.items() if name.endswith(k)))
    return out


# ----------------------------------------------------------------------------- the cuts


def _qkv_view(m: ModelConfig) -> tuple[int, int, int]:
    """``(groups, q_per_group, head_dim)``."""
    g = query_groups(m)
    return g, m.num_attention_heads // g, head_dim(m)


def _split_qkv(m: ModelConfig, w: torch.Tensor) -> tuple[torch.Tensor, ...]:
    g, qpg, hd = _qkv_view(m)
    grouped = w.view(g, qpg + 2, hd, w.shape[-1])
    q = grouped[:, :qpg].reshape(g * qpg * hd, -1)
    return q, grouped[:, qpg].reshape(g * hd, -1), grouped[:, qpg + 1].reshape(g * hd, -1)


def _merge_qkv(m: ModelConfig, parts: tuple[torch.Tensor, ...], want: torch.Size) -> torch.Tensor:
    q, k, v = parts
    g, qpg, hd = _qkv_view(m)
    cols = q.shape[-1]
    grouped = torch.cat([q.reshape(g, qpg, hd, cols), k.reshape(g, 1, hd, cols), v.reshape(g, 1, hd, cols)], dim=1)
    return grouped.reshape(-1, cols)


def _split_vocab(m: ModelConfig, w: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return (w[: m.vocab_size],)


def _merge_vocab(m: ModelConfig, parts: tuple[torch.Tensor, ...], want: torch.Size) -> torch.Tensor:
    (w,) = parts
    if w.shape[0] >= want[0]:
        return w
    out = w.new_zeros(want[0], *w.shape[1:])
    out[: w.shape[0]] = w
    return out


_SPLIT: dict[str, Callable[[ModelConfig, torch.Tensor], tuple[torch.Tensor, ...]]] = {
    "copy": lambda m, w: (w,),
    "vocab": _split_vocab,
    "qkv": _split_qkv,
    "gate_up": lambda m, w: tuple(w.chunk(2, dim=0)),
}
_MERGE: dict[str, Callable[[ModelConfig, tuple[torch.Tensor, ...], torch.Size], torch.Tensor]] = {
    "copy": lambda m, parts, want: parts[0],
    "vocab": _merge_vocab,
    "qkv": _merge_qkv,
    "gate_up": lambda m, parts, want: torch.cat(parts, dim=0),
}


def to_hf(state: Mapping[str, torch.Tensor], m: ModelConfig, arch: Architecture, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Hugging Face tensors (``dtype``, contiguous, module order) from canonical fp32 ``state``.

    Every tensor of ``state`` must be used: a leftover one means the checkpoint and its
    config disagree, which is refused rather than exported without it."""
    out: dict[str, torch.Tensor] = {}
    used = set()
    for link in links(m, arch):
        if link.canonical not in state:
            raise HFFormatError(
                f"the checkpoint has no tensor {link.canonical!r}, which its config "
                f"({arch.name} shape) needs", fix="export a checkpoint written by lptrain with this config")
        used.add(link.canonical)
        parts = _SPLIT[link.cut](m, state[link.canonical])
        for name, t in zip(link.hf, parts, strict=True):
            out[name] = t.detach().to(dtype=dtype, memory_format=torch.contiguous_format)  # one pass
    extra = sorted(set(state) - used)
    if extra:
        raise HFFormatError(
            f"the checkpoint holds {len(extra)} tensor(s) that {arch.name} has no place for, "
            f"e.g. {extra[0]!r}", fix="export a checkpoint whose resolved_config.yaml matches it")
    return out


def unfuse_experts(hf: Mapping[str, torch.Tensor], arch: Architecture) -> dict[str, torch.Tensor]:
    """``hf`` with ``transformers`` 5's fused expert tensors cut into per-expert ones (and
    Mixtral's ``mlp.gate`` back under ``block_sparse_moe``); other keys unchanged."""
    if not arch.is_moe:
        return dict(hf)
    gate, up, down = arch.expert_proj
    out: dict[str, torch.Tensor] = {}
    for key, t in hf.items():
        m = _FUSED_EXPERTS.match(key)
        if m:
            base = f"{m['layer']}.{arch.moe_block}.experts."
            for e, member in enumerate(t.unbind(0)):
                if m["what"] == "gate_up_proj":
                    g, u = member.chunk(2, dim=0)
                    out[f"{base}{e}.{gate}.weight"], out[f"{base}{e}.{up}.weight"] = g, u
                else:
                    out[f"{base}{e}.{down}.weight"] = member
            continue
        r = _FUSED_ROUTER.match(key)
        if r and arch.moe_block != "mlp":
            out[f"{r['layer']}.{arch.moe_block}.gate.weight"] = t
            continue
        out[key] = t
    return out


def from_hf(
    hf: Mapping[str, torch.Tensor], m: ModelConfig, arch: Architecture, shapes: Mapping[str, torch.Size], source: str
) -> dict[str, torch.Tensor]:
    """Canonical fp32 tensors of ``m`` from a Hugging Face state; ``shapes`` are the
    canonical shapes of the model being built (vocabulary rows padded as it pads them)."""
    hf = {k: v for k, v in unfuse_experts(hf, arch).items() if not _IGNORED.search(k)}
    out: dict[str, torch.Tensor] = {}
    used = set()
    for link in links(m, arch):
        missing = [n for n in link.hf if n not in hf]
        if missing:
            raise HFFormatError(f"{source}: no tensor {missing[0]!r} in the safetensors files",
                                fix=f"use a complete {arch.name} folder")
        used.update(link.hf)
        parts = tuple(hf[n].float() for n in link.hf)
        want = shapes[link.canonical]
        t = _MERGE[link.cut](m, parts, want)
        if t.shape != want:
            raise HFFormatError(
                f"{source}: {', '.join(link.hf)} make a {tuple(t.shape)} tensor but the model's "
                f"{link.canonical} is {tuple(want)}", fix="use a folder whose tensors match its config.json")
        out[link.canonical] = t.contiguous()
    extra = sorted(set(hf) - used)
    if extra:
        raise HFFormatError(f"{source}: {len(extra)} tensor(s) lptrain's model has no place for, "
                            f"e.g. {extra[0]!r}", fix=f"use a plain {arch.name} folder")
    return out
