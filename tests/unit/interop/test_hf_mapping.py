"""The pure parts of the Hugging Face mapping: architecture choice and refusals, config.json
read back by ``transformers``, the shape check's messages, canonical shapes, the tensor cuts
and the shard planner. (The numerics are proven end to end in tests/e2e/test_hf_*.py.)"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from lptrain.config import compose
from lptrain.config.schema import ModelConfig, MoEConfig
from lptrain.interop.hf_arch import (
    LLAMA,
    MIXTRAL,
    QWEN3,
    QWEN3_MOE,
    HFFormatError,
    architecture_for,
    check_against_recipe,
    hf_config,
)
from lptrain.interop.hf_weights import canonical_shapes, from_hf, to_hf
from lptrain.interop.safetensors_io import parse_size, plan_shards

DENSE = ModelConfig(num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4,
                    num_query_groups=2, vocab_size=259, make_vocab_size_divisible_by=64)


def _moe(**kw: object) -> ModelConfig:
    return dataclasses.replace(DENSE, moe=MoEConfig(num_experts=4, router_topk=2, ffn_hidden_size=32, **kw))


def test_architecture_choice() -> None:
    assert architecture_for(DENSE) is LLAMA
    assert architecture_for(dataclasses.replace(DENSE, qk_layernorm=True)) is QWEN3
    assert architecture_for(_moe()) is MIXTRAL
    assert architecture_for(dataclasses.replace(_moe(moe_layer_freq=2), qk_layernorm=True)) is QWEN3_MOE


@pytest.mark.parametrize(("model", "names"), [
    (_moe(score_function="sigmoid", enable_expert_bias=True),
     ("model.moe.score_function=sigmoid", "model.moe.enable_expert_bias=true")),
    (_moe(score_function="sigmoid"), ("model.moe.score_function=sigmoid",)),
    (_moe(moe_layer_freq=2), ("model.moe.moe_layer_freq=2", "model.qk_layernorm=true")),
])
def test_refusals_name_the_setting(model: ModelConfig, names: tuple[str, ...]) -> None:
    with pytest.raises(HFFormatError) as e:
        architecture_for(model)
    text = str(e.value)
    assert "\n" not in text and all(n in text for n in names), text


@pytest.mark.parametrize("model", [DENSE, dataclasses.replace(DENSE, qk_layernorm=True, tie_embeddings=True),
                                   _moe(), dataclasses.replace(_moe(moe_layer_freq=2), qk_layernorm=True)])
def test_config_json_reads_back_in_transformers_and_passes_the_check(model: ModelConfig, tmp_path: Path) -> None:
    from transformers import AutoConfig

    arch = architecture_for(model)
    cfg = hf_config(model, arch, "bfloat16", {"bos": 256, "eos": 257, "pad": 258})
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    hf = AutoConfig.from_pretrained(str(tmp_path))
    assert hf.architectures == [arch.name]
    assert (hf.hidden_size, hf.num_hidden_layers, hf.num_key_value_heads, hf.vocab_size) == (64, 2, 2, 259)
    assert hf.eos_token_id == 257 and hf.tie_word_embeddings == model.tie_embeddings
    assert check_against_recipe(json.loads(hf.to_json_string()), model, "here") is arch


def test_shape_check_names_both_values_and_the_fix() -> None:
    cfg = hf_config(DENSE, LLAMA, "float32", {})
    wrong = dataclasses.replace(DENSE, hidden_size=128, num_layers=3)
    with pytest.raises(HFFormatError) as e:
        check_against_recipe(cfg, wrong, "init")
    text = str(e.value)
    assert "config.json num_hidden_layers=2 but the recipe has model.num_layers=3" in text
    assert "config.json hidden_size=64 but the recipe has model.hidden_size=128" in text
    assert "fix: set model.num_layers=2 model.hidden_size=64" in text
    with pytest.raises(HFFormatError, match="RoPE scaling"):
        check_against_recipe({**cfg, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, DENSE, "init")
    with pytest.raises(HFFormatError, match="model_type 'gpt2'"):
        check_against_recipe({**cfg, "model_type": "gpt2"}, DENSE, "init")
    qwen = hf_config(dataclasses.replace(_moe(moe_layer_freq=2), qk_layernorm=True), QWEN3_MOE, "float32", {})
    with pytest.raises(HFFormatError, match=r"MoE layers \[0\] but model.moe.moe_layer_freq=1 gives \[0, 1\]"):
        check_against_recipe(qwen, dataclasses.replace(_moe(), qk_layernorm=True), "init")


@pytest.mark.parametrize("overrides", [[], ["model.qk_layernorm=true", "model.tie_embeddings=true"],
                                       ["model.moe.num_experts=4", "model.moe.moe_layer_freq=2",
                                        "model.moe.ffn_hidden_size=32", "model.qk_layernorm=true",
                                        "model.moe.single_grouped_weight=true", "model.moe.grouped_gemm=true"]])
def test_canonical_shapes_are_the_models(overrides: list[str]) -> None:
    from lptrain.model import build_model
    from lptrain.model.state_dict_adapter import canonical_state_dict

    cfg = compose("tiny_cpu.yaml", ["model.make_vocab_size_divisible_by=128", "model.num_query_groups=2", *overrides])
    model = build_model(cfg, device="meta")
    real = {k: v.shape for k, v in canonical_state_dict(model).items()}
    assert canonical_shapes(cfg.model, architecture_for(cfg.model)) == real


def test_cuts_are_exact_inverses() -> None:
    m = _moe()
    arch = architecture_for(m)
    shapes = canonical_shapes(m, arch)
    gen = torch.Generator().manual_seed(0)
    state = {k: torch.randn(s, generator=gen) for k, s in shapes.items()}
    for rows in ("embedding.weight", "output_layer.weight"):
        state[rows][259:] = 0  # padding rows come back as zeros
    hf = to_hf(state, m, arch, torch.float32)
    assert hf["model.embed_tokens.weight"].shape == (259, 64)
    q = hf["model.layers.0.self_attn.q_proj.weight"]  # group 1's first query head = head 2
    assert torch.equal(q[32:48], state["layers.0.self_attention.linear_qkv.weight"][64:80])
    back = from_hf(hf, m, arch, shapes, "here")
    assert back.keys() == state.keys() and all(torch.equal(back[k], state[k]) for k in state)
    with pytest.raises(HFFormatError, match=r"no tensor 'model\.norm\.weight'"):
        from_hf({k: v for k, v in hf.items() if k != "model.norm.weight"}, m, arch, shapes, "here")
    with pytest.raises(HFFormatError, match="no place for"):
        from_hf({**hf, "model.layers.0.self_attn.q_proj.bias": torch.zeros(64)}, m, arch, shapes, "here")


def test_sizes_and_shards() -> None:
    assert parse_size("5GB") == 5 * 10**9 and parse_size("2GiB") == 2 * 2**30 and parse_size(1000) == 1000
    with pytest.raises(Exception, match="not a size"):
        parse_size("lots")
    tensors = {n: torch.zeros(s) for n, s in (("a", 10), ("b", 10), ("c", 30), ("d", 5))}  # 40, 40, 120, 20 B
    assert plan_shards(tensors, 100) == [["a", "b"], ["c"], ["d"]]
    assert plan_shards(tensors, 10**6) == [["a", "b", "c", "d"]]
