"""``lptrain export --format hf``: train a few steps, export, load with ``transformers``.

Each case trains a tiny run, exports its newest checkpoint and compares
``AutoModelForCausalLM.from_pretrained(folder)``'s fp32 logits with lptrain's own fp32
forward from the checkpoint's masters on the same tokens, within
``lptrain.testing.hf.LOGIT_ATOL`` (1e-5; the two sides differ by fp32 rounding only, see
there). Cases cover every architecture (Llama, Qwen3, Mixtral, Qwen3-MoE), GQA, tied and
padded vocabularies, both expert layouts and quantized primary weights (whose masters, not
their FP8 copies, are exported). The EP=2 case is in ``tests/dist/test_hf_export_ep.py``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from typer.testing import CliRunner

from lptrain.cli import app
from lptrain.config import compose
from lptrain.interop.hf_export import export_hf, find_checkpoint, read_masters
from lptrain.testing.hf import LOGIT_ATOL, hf_logits, max_abs_diff, reference_logits, sample_tokens
from lptrain.train import pretrain

STEPS = 3


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("cache")


def overrides(cache: Path, out: Path, *extra: str) -> list[str]:
    return [f"data.cache_dir={cache}", "data.builtin_max_mb=1", "logging.progress=false",
            "logging.plots=false", "train.eval_iters=1", "train.log_interval=null",
            f"train.train_iters={STEPS}", "train.global_batch_size=4", "train.micro_batch_size=4",
            "model.seq_length=64", f"checkpoint.save={out}/ckpt", *extra]


def train(recipe: str, cache: Path, out: Path, *extra: str) -> dict[str, Any]:
    summary = pretrain(compose(recipe, overrides(cache, out, *extra)), out)
    assert summary["status"] == "completed"
    return summary


def assert_logits_match(recipe: str, extra: tuple[str, ...], run: Path, folder: Path) -> float:
    masters = read_masters(find_checkpoint(run))
    tokens = sample_tokens(259)
    ours = reference_logits(recipe, list(extra), masters, tokens)
    theirs = hf_logits(folder, tokens)
    diff = max_abs_diff(ours, theirs)
    assert diff <= LOGIT_ATOL, f"max |logit difference| {diff:.3g} > {LOGIT_ATOL}"
    return diff


CASES = {
    # name: (recipe, overrides, architecture)
    "llama_mha_untied": ("tiny_cpu.yaml", (), "LlamaForCausalLM"),
    "qwen3_gqa_tied_padded": ("tiny_cpu.yaml", ("model.qk_layernorm=true", "model.tie_embeddings=true",
                              "model.num_query_groups=2", "model.make_vocab_size_divisible_by=64"),
                              "Qwen3ForCausalLM"),
    "mixtral_loop_experts": ("tiny_cpu.yaml", ("model.moe.num_experts=4", "model.moe.router_topk=2",
                             "model.moe.ffn_hidden_size=64", "model.moe.grouped_gemm=false",
                             "model.num_query_groups=2"), "MixtralForCausalLM"),
    # MXFP8 with FP8 primary weights and single grouped expert weights; dense layer 1.
    "qwen3moe_mxfp8_params_dense_layer": ("moe_mxfp8_cpu.yaml", ("model.qk_layernorm=true",
                                          "model.moe.moe_layer_freq=2"), "Qwen3MoeForCausalLM"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_export_loads_in_transformers_with_the_same_logits(case: str, cache: Path, tmp_path: Path) -> None:
    recipe, extra, architecture = CASES[case]
    run = tmp_path / "run"
    train(recipe, cache, run, *extra)
    folder = tmp_path / "hf"
    rep = export_hf(run, folder, dtype="fp32")
    config = json.loads((folder / "config.json").read_text())
    assert rep.architecture == architecture == config["architectures"][0]
    assert rep.iteration == STEPS
    assert config["vocab_size"] == 259  # padding removed
    assert_logits_match(recipe, extra, run, folder)


def test_export_casts_the_fp32_masters_of_quantized_primary_weights(cache: Path, tmp_path: Path) -> None:
    """mxfp8_adamw_cpu keeps FP8 primary weights (fp8_param_gather): the export holds the
    fp32 masters cast to bf16, bit for bit -- not the FP8 values, which differ."""
    from safetensors.torch import load_file

    from lptrain.model import build_model
    from lptrain.model.state_dict_adapter import canonical_state_dict, load_canonical_state_dict

    run = tmp_path / "run"
    train("mxfp8_adamw_cpu.yaml", cache, run)
    cfg = compose("mxfp8_adamw_cpu.yaml", overrides(cache, run))
    assert cfg.precision.fp8_param_gather
    export_hf(run, tmp_path / "hf")  # default --dtype bf16
    exported = load_file(str(tmp_path / "hf" / "model.safetensors"))
    masters = read_masters(find_checkpoint(run))
    q = exported["model.layers.0.self_attn.q_proj.weight"]
    assert q.dtype == torch.bfloat16
    assert torch.equal(q, masters["layers.0.self_attention.linear_qkv.weight"].view(4, 3, 16, 64)[:, 0]
                       .reshape(64, 64).to(torch.bfloat16))
    assert torch.equal(exported["model.layers.1.mlp.down_proj.weight"],
                       masters["layers.1.mlp.linear_fc2.weight"].to(torch.bfloat16))
    # The run's own FP8 copy of the same weight is something else.
    model = build_model(cfg, device="cpu")
    load_canonical_state_dict(model, masters)
    fp8 = canonical_state_dict(model)["layers.1.mlp.linear_fc2.weight"]
    assert hasattr(fp8, "dequantize")
    assert not torch.equal(fp8.dequantize().to(torch.bfloat16), exported["model.layers.1.mlp.down_proj.weight"])


def test_export_shards_above_the_threshold_with_an_index(cache: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    train("tiny_cpu.yaml", cache, run)
    one, sharded = tmp_path / "one", tmp_path / "sharded"
    export_hf(run, one, dtype="fp32")
    rep = export_hf(run / "ckpt", sharded, dtype="fp32", max_shard_size="200KB")
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and shards == [f for f in rep.files if f.startswith("model-")]
    assert not (one / "model.safetensors.index.json").exists()
    tokens = sample_tokens(259)
    assert torch.equal(hf_logits(one, tokens), hf_logits(sharded, tokens))


def test_export_ships_the_runs_tokenizer(tmp_path: Path) -> None:
    """A run on a BPE dataset: tokenizer.json + tokenizer_config.json load with
    AutoTokenizer and encode like lptrain's tokenizer; the configs carry its EOS id."""
    from transformers import AutoTokenizer

    from lptrain.data.prepare import prepare_dataset
    from lptrain.data.tokenizer import load_tokenizer

    docs = tmp_path / "docs.jsonl"
    text = [f"def f{i}(x):\n    return x * {i} + {i % 7}\n" for i in range(400)]
    docs.write_text("".join(json.dumps({"text": t}) + "\n" for t in text))
    rep = prepare_dataset([docs], tmp_path / "bpe", train_tokenizer="bpe", vocab_size=320)
    tok = load_tokenizer(str(rep.tokenizer_path))
    run = tmp_path / "run"
    train("tiny_cpu.yaml", tmp_path, run, f"data.source={tmp_path / 'bpe'}", f"data.tokenizer={rep.tokenizer_path}",
          f"model.vocab_size={tok.vocab_size}", "data.split_valid_fraction=0.1")
    export_hf(run, tmp_path / "hf")
    hf_tok = AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    sample = "def g(y):\n    return y + 3\n"
    assert hf_tok(sample, add_special_tokens=False)["input_ids"] == tok.encode_batch([sample])[0].tolist()
    assert hf_tok.eos_token_id == tok.eos_id
    assert json.loads((tmp_path / "hf" / "generation_config.json").read_text())["eos_token_id"] == tok.eos_id


def test_cli_export_and_its_one_line_refusals(cache: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    train("tiny_cpu.yaml", cache, run, "model.moe.num_experts=4", "model.moe.score_function=sigmoid",
          "model.moe.enable_expert_bias=true", "model.moe.ffn_hidden_size=64")
    runner = CliRunner()
    refused = runner.invoke(app, ["export", str(run), "--output", str(tmp_path / "hf")])
    assert refused.exit_code == 2
    lines = refused.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: model.moe.score_function=sigmoid"), refused.output
    assert "enable_expert_bias" in lines[0] and "Traceback" not in refused.output
    assert not (tmp_path / "hf").exists()  # refused before anything was written

    for args, phrase in (
        (["export", str(tmp_path / "missing"), "-o", str(tmp_path / "x")], "no such folder"),
        (["export", str(cache), "-o", str(tmp_path / "x")], "neither a run folder nor a checkpoint folder"),
        (["export", str(run), "-o", str(tmp_path / "x"), "--format", "gguf"], "--format 'gguf'"),
        (["export", str(run), "-o", str(tmp_path / "x"), "--dtype", "int8"], "--dtype 'int8'"),
        (["export", str(run), "-o", str(tmp_path / "x"), "--max-shard-size", "big"], "--max-shard-size"),
    ):
        res = runner.invoke(app, args)
        assert res.exit_code == 2, (args, res.output)
        assert res.output.count("\n") == 1 and phrase in res.output, res.output
