"""Which ``transformers`` architecture an lptrain model is, and its ``config.json``.

lptrain's GPT is the Llama block (pre-norm RMSNorm, rotate-half RoPE, SwiGLU, GQA, no
biases); the architectures below differ only where lptrain has a setting for it:

==================  ===============================================  =====================
architecture        lptrain model                                    MoE layers
==================  ===============================================  =====================
LlamaForCausalLM    dense                                            --
Qwen3ForCausalLM    dense, ``model.qk_layernorm=true``               --
MixtralForCausalLM  MoE in every layer, softmax top-k                every layer
Qwen3MoeForCausalLM MoE, softmax top-k, ``model.qk_layernorm=true``  any (``mlp_only_layers``)
==================  ===============================================  =====================

Both MoE routers take softmax over all experts, the top k and renormalise them (Qwen3-MoE
with ``norm_topk_prob=true``), which is exactly lptrain's softmax router (top-k of the
logits, softmax over the k chosen). A sigmoid router (with or without the aux-loss-free
expert bias) has no counterpart on a GQA model in ``transformers`` and is refused, as is a
dense/MoE layer mix without q/k norms (Mixtral has no dense layers).

The same table read backwards checks a Hugging Face ``config.json`` against a recipe: every
shape value must match the recipe's (one line naming both values when not), and features
lptrain does not have (RoPE scaling, biases, sliding windows, other activations) are refused.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from lptrain.config.schema import ModelConfig
from lptrain.errors import InputError


class HFFormatError(InputError):
    """A model that has no matching Hugging Face architecture, or a Hugging Face folder that
    does not fit the recipe (exit 2; the message names the setting and both values)."""


@dataclass(frozen=True)
class Architecture:
    """One ``transformers`` causal-LM architecture and where its tensors live."""

    name: str  # config.json "architectures"
    model_type: str
    moe_block: str | None  # the MoE module inside a layer ("block_sparse_moe", "mlp"); None: dense
    expert_proj: tuple[str, str, str]  # (gate, up, down) names of one expert's linears
    qk_norm: bool  # q_norm / k_norm over each head
    dense_layers: bool  # can hold dense MLP layers next to MoE layers (mlp_only_layers)

    @property
    def is_moe(self) -> bool:
        return self.moe_block is not None


LLAMA = Architecture("LlamaForCausalLM", "llama", None, ("", "", ""), False, True)
QWEN3 = Architecture("Qwen3ForCausalLM", "qwen3", None, ("", "", ""), True, True)
MIXTRAL = Architecture("MixtralForCausalLM", "mixtral", "block_sparse_moe", ("w1", "w3", "w2"), False, False)
QWEN3_MOE = Architecture(
    "Qwen3MoeForCausalLM", "qwen3_moe", "mlp", ("gate_proj", "up_proj", "down_proj"), True, True
)
ARCHITECTURES = {a.model_type: a for a in (LLAMA, QWEN3, MIXTRAL, QWEN3_MOE)}


def head_dim(m: ModelConfig) -> int:
    return m.hidden_size // m.num_attention_heads


def query_groups(m: ModelConfig) -> int:
    return m.num_query_groups or m.num_attention_heads


def dense_ffn(m: ModelConfig) -> int:
    return m.ffn_hidden_size or 4 * m.hidden_size


def expert_ffn(m: ModelConfig) -> int:
    return m.moe.ffn_hidden_size or dense_ffn(m)


def moe_layer_indices(m: ModelConfig) -> list[int]:
    """0-based MoE layers (``lptrain.model.gpt.is_moe_layer``: ``i % moe_layer_freq == 0``)."""
    if not m.moe.num_experts:
        return []
    return [i for i in range(m.num_layers) if i % max(1, m.moe.moe_layer_freq) == 0]


def architecture_for(m: ModelConfig) -> Architecture:
    """The architecture ``m`` exports to, or :class:`HFFormatError` naming the setting."""
    if not m.moe.num_experts:
        return QWEN3 if m.qk_layernorm else LLAMA
    moe = m.moe
    if moe.score_function != "softmax" or moe.enable_expert_bias:
        bias = " with model.moe.enable_expert_bias=true" if moe.enable_expert_bias else ""
        raise HFFormatError(
            f"model.moe.score_function={moe.score_function}{bias}: no transformers architecture "
            "routes a GQA model with sigmoid scores (Mixtral and Qwen3-MoE take softmax top-k), "
            "so this run cannot be exported to a Hugging Face folder",
            fix="export runs trained with model.moe.score_function=softmax and "
            "model.moe.enable_expert_bias=false",
        )
    if m.qk_layernorm:
        return QWEN3_MOE
    if len(moe_layer_indices(m)) != m.num_layers:
        raise HFFormatError(
            f"model.moe.moe_layer_freq={moe.moe_layer_freq} mixes dense and MoE layers: Mixtral "
            "(the architecture without q/k norms) has an MoE block in every layer, and Qwen3-MoE "
            "(which allows dense layers) normalises q and k (model.qk_layernorm=true)",
            fix="export runs with model.moe.moe_layer_freq=1, or train with model.qk_layernorm=true",
        )
    return MIXTRAL


def hf_config(m: ModelConfig, arch: Architecture, dtype: str, tokens: Mapping[str, int | None]) -> dict[str, Any]:
    """``config.json`` for ``m`` as ``arch``. Both spellings of the RoPE base (``rope_theta``,
    transformers 4; ``rope_parameters``, transformers 5) and of the dtype are written, so
    either major version reads the folder."""
    cfg: dict[str, Any] = {
        "architectures": [arch.name],
        "model_type": arch.model_type,
        "hidden_size": m.hidden_size,
        "intermediate_size": expert_ffn(m) if arch is MIXTRAL else dense_ffn(m),
        "num_hidden_layers": m.num_layers,
        "num_attention_heads": m.num_attention_heads,
        "num_key_value_heads": query_groups(m),
        "head_dim": head_dim(m),
        "hidden_act": "silu",
        "max_position_embeddings": m.seq_length,
        "rms_norm_eps": m.norm_epsilon,
        "rope_theta": m.rotary_base,
        "rope_parameters": {"rope_type": "default", "rope_theta": m.rotary_base},
        "rope_scaling": None,
        "tie_word_embeddings": m.tie_embeddings,
        "vocab_size": m.vocab_size,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "initializer_range": m.init_method_std,
        "use_cache": True,
        "torch_dtype": dtype,
        "dtype": dtype,
        **{f"{k}_token_id": v for k, v in tokens.items()},
    }
    if arch is LLAMA:
        cfg["mlp_bias"] = False
    if arch.qk_norm or arch is MIXTRAL:
        cfg["sliding_window"] = None
        cfg["use_sliding_window"] = False
    if arch.is_moe:
        moe = m.moe
        cfg.update({
            "num_experts_per_tok": moe.router_topk,
            "num_local_experts": moe.num_experts,
            "router_aux_loss_coef": moe.aux_loss_coeff,
            "output_router_logits": False,
        })
        if arch is MIXTRAL:
            cfg["router_jitter_noise"] = 0.0
        else:
            sparse = set(moe_layer_indices(m))
            cfg.update({
                "num_experts": moe.num_experts,
                "moe_intermediate_size": expert_ffn(m),
                "decoder_sparse_step": 1,
                "mlp_only_layers": [i for i in range(m.num_layers) if i not in sparse],
                "norm_topk_prob": True,
            })
    return dict(sorted(cfg.items()))


# ---------------------------------------------------------------------------------- import


def _get(cfg: Mapping[str, Any], *names: str, default: Any = None) -> Any:
    for n in names:
        if cfg.get(n) is not None:
            return cfg[n]
    return default


def rope_base(cfg: Mapping[str, Any]) -> Any:
    params = cfg.get("rope_parameters") or {}
    return _get(params, "rope_theta") or _get(cfg, "rope_theta", default=10000.0)


def architecture_of(cfg: Mapping[str, Any], source: str) -> Architecture:
    """The architecture a Hugging Face ``config.json`` describes, or :class:`HFFormatError`."""
    model_type = cfg.get("model_type")
    arch = ARCHITECTURES.get(str(model_type))
    if arch is None:
        supported = ", ".join(f"{a.model_type} ({a.name})" for a in ARCHITECTURES.values())
        raise HFFormatError(
            f"{source}: model_type {model_type!r} is not an architecture lptrain can start from",
            fix=f"use a folder of one of: {supported}",
        )
    return arch


def _unsupported(cfg: Mapping[str, Any], arch: Architecture) -> list[str]:
    """Features of the folder lptrain's model does not have."""
    out = []
    params = cfg.get("rope_parameters") or {}
    rope_type = params.get("rope_type") or (cfg.get("rope_scaling") or {}).get("rope_type") or "default"
    if cfg.get("rope_scaling") or rope_type != "default":
        out.append(f"RoPE scaling ({rope_type}; lptrain has plain RoPE)")
    if cfg.get("attention_bias") or cfg.get("mlp_bias"):
        out.append("linear biases (attention_bias/mlp_bias; lptrain has none)")
    if _get(cfg, "hidden_act", default="silu") != "silu":
        out.append(f"hidden_act={cfg.get('hidden_act')} (lptrain's MLP is SwiGLU)")
    if cfg.get("sliding_window") and (arch is MIXTRAL or cfg.get("use_sliding_window")):
        out.append(f"sliding_window={cfg.get('sliding_window')} (lptrain attends causally over the whole sequence)")
    if arch is QWEN3_MOE and cfg.get("norm_topk_prob") is False:
        out.append("norm_topk_prob=false (lptrain's softmax router renormalises the top-k probabilities)")
    if cfg.get("num_shared_experts") or cfg.get("shared_expert_intermediate_size"):
        out.append("shared experts (lptrain has routed experts only)")
    return out


def expected_settings(cfg: Mapping[str, Any], arch: Architecture) -> list[tuple[str, str, Any]]:
    """``(lptrain key, config.json key, value)`` for every shape value a recipe must match."""
    heads = cfg.get("num_attention_heads")
    out: list[tuple[str, str, Any]] = [
        ("model.num_layers", "num_hidden_layers", cfg.get("num_hidden_layers")),
        ("model.hidden_size", "hidden_size", cfg.get("hidden_size")),
        ("model.num_attention_heads", "num_attention_heads", heads),
        ("model.num_query_groups", "num_key_value_heads", _get(cfg, "num_key_value_heads", default=heads)),
        ("model.vocab_size", "vocab_size", cfg.get("vocab_size")),
        ("model.rotary_base", "rope_theta", rope_base(cfg)),
        ("model.norm_epsilon", "rms_norm_eps", cfg.get("rms_norm_eps")),
        ("model.tie_embeddings", "tie_word_embeddings", bool(cfg.get("tie_word_embeddings", False))),
        ("model.qk_layernorm", f"model_type={arch.model_type} q/k norms", arch.qk_norm),
    ]
    if cfg.get("head_dim") is not None:
        out.append(("model.hidden_size / model.num_attention_heads", "head_dim", cfg.get("head_dim")))
    if arch is MIXTRAL:
        out.append(("model.moe.ffn_hidden_size", "intermediate_size", cfg.get("intermediate_size")))
    elif len(hf_moe_layers(cfg, arch)) < int(cfg.get("num_hidden_layers") or 0):  # has dense layers
        out.append(("model.ffn_hidden_size", "intermediate_size", cfg.get("intermediate_size")))
    if arch.is_moe:
        out += [
            ("model.moe.num_experts", "num_local_experts", _get(cfg, "num_local_experts", "num_experts")),
            ("model.moe.router_topk", "num_experts_per_tok", cfg.get("num_experts_per_tok")),
            ("model.moe.score_function", "the router (softmax top-k)", "softmax"),
            ("model.moe.enable_expert_bias", "the router (no expert bias)", False),
        ]
        if arch is QWEN3_MOE:
            out.append(("model.moe.ffn_hidden_size", "moe_intermediate_size", cfg.get("moe_intermediate_size")))
    else:
        out.append(("model.moe.num_experts", f"model_type={arch.model_type} (dense)", 0))
    return out


def hf_moe_layers(cfg: Mapping[str, Any], arch: Architecture) -> list[int]:
    """0-based MoE layers of a Hugging Face config (Qwen3-MoE's ``mlp_only_layers`` and
    ``decoder_sparse_step``; every layer for Mixtral)."""
    n = int(cfg.get("num_hidden_layers") or 0)
    if not arch.is_moe:
        return []
    if arch is MIXTRAL:
        return list(range(n))
    dense = set(cfg.get("mlp_only_layers") or [])
    step = int(cfg.get("decoder_sparse_step") or 1)
    return [i for i in range(n) if i not in dense and (i + 1) % step == 0]


def _recipe_value(m: ModelConfig, key: str) -> Any:
    values = {
        "model.num_query_groups": query_groups(m),
        "model.ffn_hidden_size": dense_ffn(m),
        "model.moe.ffn_hidden_size": expert_ffn(m),
        "model.hidden_size / model.num_attention_heads": head_dim(m),
    }
    if key in values:
        return values[key]
    obj: Any = m
    for part in key.split(".")[1:]:
        obj = getattr(obj, part)
    return obj


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, float) or isinstance(b, float):
        try:
            return abs(float(a) - float(b)) <= 1e-12 * max(1.0, abs(float(b)))
        except (TypeError, ValueError):
            return False
    return bool(a == b)


def check_against_recipe(cfg: Mapping[str, Any], m: ModelConfig, source: str) -> Architecture:
    """The folder's architecture when its ``config.json`` describes exactly ``m``; otherwise
    :class:`HFFormatError` listing every mismatch (each naming both values) on one line."""
    arch = architecture_of(cfg, source)
    unsupported = _unsupported(cfg, arch)
    if unsupported:
        raise HFFormatError(f"{source}: {'; '.join(unsupported)}",
                            fix="start from a folder without these features")
    bad, fixes = [], []
    for key, hf_key, value in expected_settings(cfg, arch):
        mine = _recipe_value(m, key)
        if value is None:
            raise HFFormatError(f"{source}: config.json has no {hf_key}", fix="use a complete config.json")
        if not _same(mine, value):
            bad.append(f"config.json {hf_key}={value} but the recipe has {key}={mine}")
            if "/" not in key:
                fixes.append(f"{key}={str(value).lower() if isinstance(value, bool) else value}")
    if arch.is_moe and not bad:
        theirs, mine_layers = hf_moe_layers(cfg, arch), moe_layer_indices(m)
        if theirs != mine_layers:
            bad.append(f"config.json has MoE layers {theirs} but model.moe.moe_layer_freq="
                       f"{m.moe.moe_layer_freq} gives {mine_layers}")
    if bad:
        fix = f"set {' '.join(fixes)}" if fixes else "use a recipe of the folder's shape"
        raise HFFormatError(f"{source}: {'; '.join(bad)}", fix=fix + " (or start from a matching folder)")
    return arch
