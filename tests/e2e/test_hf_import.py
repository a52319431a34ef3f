"""``checkpoint.init_from_hf``: start lptrain from a Hugging Face folder built by ``transformers``.

Random ``transformers`` models (norm weights randomised too, so every tensor's mapping is
exercised) are saved with ``save_pretrained``; lptrain starts from them and its logits (and
its first-step loss) must match ``transformers``' within ``lptrain.testing.hf.LOGIT_ATOL``
(1e-5, fp32 rounding; see there). Then: training continues, quantized primary weights are
quantized from the imported masters, export -> import -> export is byte-identical, and a
folder of another shape is refused in one line (exit 2).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from typer.testing import CliRunner

from lptrain.cli import app
from lptrain.config import compose
from lptrain.interop.hf_export import export_hf
from lptrain.interop.hf_import import hf_masters
from lptrain.testing.hf import LOGIT_ATOL, hf_logits, max_abs_diff, reference_logits, sample_tokens
from lptrain.train import pretrain

TINY = dict(hidden_size=64, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=259, max_position_embeddings=128, rms_norm_eps=1e-5,
            tie_word_embeddings=False)
SHAPE = ["model.num_query_groups=2"]  # tiny_cpu is TINY otherwise
BASE = ["logging.progress=false", "logging.plots=false", "train.log_interval=null", "train.eval_iters=1",
        "train.global_batch_size=4", "train.micro_batch_size=4", "model.seq_length=64", "data.builtin_max_mb=1"]


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("cache")


def save_random(kind: str, folder: Path, seed: int = 0, **config: Any) -> Any:
    """A random ``transformers`` model of ``kind`` saved to ``folder``; returns the model."""
    import transformers

    torch.manual_seed(seed)
    save_kwargs = config.pop("_save", {})
    cfg_cls, model_cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM),
        "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM),
    }[kind]
    model = model_cls(cfg_cls(**{**TINY, "rope_theta": 10000.0, **config})).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    model.save_pretrained(str(folder), **save_kwargs)
    return model


def _cfg(cache: Path, out: Path, folder: Path, *extra: str) -> Any:
    return compose("tiny_cpu.yaml", [*BASE, *SHAPE, f"data.cache_dir={cache}", f"checkpoint.save={out}/ckpt",
                                     f"checkpoint.init_from_hf={folder}", *extra])


def test_llama_import_first_step_matches_transformers_then_trains(cache: Path, tmp_path: Path) -> None:
    from lptrain.data import build_train_valid_loaders

    hf = save_random("llama", tmp_path / "hf")
    tokens = sample_tokens(259)
    theirs = hf_logits(hf, tokens)
    ours = reference_logits("tiny_cpu.yaml", SHAPE, hf_masters(_cfg(cache, tmp_path, tmp_path / "hf")), tokens)
    assert max_abs_diff(ours, theirs) <= LOGIT_ATOL

    # Through the loop: the first step's loss is transformers' loss on the same batch.
    cfg = _cfg(cache, tmp_path / "run", tmp_path / "hf", "precision.params_dtype=fp32", "train.train_iters=5")
    summary = pretrain(cfg, tmp_path / "run")
    train_it, _ = build_train_valid_loaders(cfg.data, seq_length=64, micro_batch_size=4, global_batch_size=4,
                                            dp_rank=0, dp_size=1, vocab_size=259)
    batch = next(train_it)
    with torch.no_grad():
        logits = hf(batch["tokens"]).logits.float()
    expected = float(F.cross_entropy(logits.reshape(-1, 259), batch["labels"].reshape(-1), ignore_index=-100))
    assert summary["status"] == "completed" and summary["steps"] == 5
    assert abs(summary["first_loss"] - expected) <= 1e-5 * expected, (summary["first_loss"], expected)
    assert summary["final_loss"] < summary["first_loss"]
    assert summary["checkpoint"]


def test_quantized_primary_weights_are_quantized_from_the_imported_masters(cache: Path, tmp_path: Path) -> None:
    from lptrain.config import World, derive
    from lptrain.interop.hf_import import init_engine_from_hf
    from lptrain.train.engine import TrainEngine

    save_random("llama", tmp_path / "hf")
    cfg = compose("mxfp8_adamw_cpu.yaml", [*BASE, *SHAPE, f"data.cache_dir={cache}",
                                            f"checkpoint.init_from_hf={tmp_path / 'hf'}"])
    assert cfg.precision.fp8_param_gather
    engine = TrainEngine(derive(cfg, World.detect()))
    init_engine_from_hf(engine, cfg)
    expected = hf_masters(cfg)
    with engine.params_synced():
        state = engine.checkpoint_state()["global"]
    assert state["model"].keys() == expected.keys()
    for name, t in expected.items():
        assert torch.equal(state["model"][name], t), name  # the masters are the folder's weights
    assert all(not v for v in state["optimizer"].values())  # fresh optimizer
    qkv = engine.model.layers[0].self_attention.linear_qkv.weight
    assert hasattr(qkv, "dequantize")  # an FP8 primary weight ...
    w = expected["layers.0.self_attention.linear_qkv.weight"]
    rel = float((qkv.dequantize().float() - w).norm() / w.norm())
    assert 0 < rel < 0.05, rel  # ... quantized from the imported master (E4M3: ~2^-5 relative)


@pytest.mark.parametrize("kind", ["mixtral", "mixtral_fused", "qwen3_moe"])
def test_moe_import_matches_transformers(kind: str, cache: Path, tmp_path: Path) -> None:
    moe = ["model.moe.num_experts=4", "model.moe.router_topk=2", "model.moe.ffn_hidden_size=64"]
    if kind.startswith("mixtral"):
        # transformers 5 can also save its fused expert tensors (save_original_format=False).
        save = {"_save": {"save_original_format": False}} if kind == "mixtral_fused" else {}
        hf = save_random("mixtral", tmp_path / "hf", intermediate_size=64, num_local_experts=4,
                         num_experts_per_tok=2, **save)
    else:  # Qwen3-MoE: q/k norms, layer 1 dense (mlp_only_layers), renormalised top-k
        hf = save_random("qwen3_moe", tmp_path / "hf", moe_intermediate_size=64, num_experts=4,
                         num_experts_per_tok=2, mlp_only_layers=[1], norm_topk_prob=True, head_dim=16)
        moe += ["model.qk_layernorm=true", "model.moe.moe_layer_freq=2"]
    if kind == "mixtral_fused":
        assert any(k.endswith("experts.gate_up_proj") for k in _stored_names(tmp_path / "hf"))
    masters = hf_masters(_cfg(cache, tmp_path, tmp_path / "hf", *moe))
    tokens = sample_tokens(259)
    diff = max_abs_diff(reference_logits("tiny_cpu.yaml", [*SHAPE, *moe], masters, tokens), hf_logits(hf, tokens))
    assert diff <= LOGIT_ATOL, diff


def _stored_names(folder: Path) -> list[str]:
    from safetensors import safe_open

    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        return list(f.keys())


def test_export_import_export_is_byte_identical(cache: Path, tmp_path: Path) -> None:
    """Export (bf16) -> a run started from it (one step at lr 0, so the masters stay) ->
    export again: the same bytes."""
    first = tmp_path / "first"
    pretrain(compose("tiny_cpu.yaml", [*BASE, f"data.cache_dir={cache}", f"checkpoint.save={tmp_path}/a/ckpt",
                                       "train.train_iters=2"]), tmp_path / "a")
    export_hf(tmp_path / "a", first)
    pretrain(compose("tiny_cpu.yaml", [*BASE, f"data.cache_dir={cache}", f"checkpoint.save={tmp_path}/b/ckpt",
                                       f"checkpoint.init_from_hf={first}", "train.train_iters=1",
                                       "optimizer.lr=0", "optimizer.min_lr=0"]), tmp_path / "b")
    second = tmp_path / "second"
    export_hf(tmp_path / "b", second)
    for name in ("model.safetensors", "config.json", "generation_config.json"):
        assert (first / name).read_bytes() == (second / name).read_bytes(), name


def test_a_folder_of_another_shape_is_refused_in_one_line(cache: Path, tmp_path: Path) -> None:
    save_random("llama", tmp_path / "hf")
    runner = CliRunner()
    common = ["pretrain", "--recipe", "tiny_cpu.yaml", *BASE, *SHAPE, f"data.cache_dir={cache}",
              "train.train_iters=1", "optimizer.warmup_iters=0"]
    cases = [
        (["model.hidden_size=32", f"checkpoint.init_from_hf={tmp_path / 'hf'}"],
         "config.json hidden_size=64 but the recipe has model.hidden_size=32"),
        (["model.num_query_groups=4", f"checkpoint.init_from_hf={tmp_path / 'hf'}"],
         "num_key_value_heads=2 but the recipe has model.num_query_groups=4"),
        ([f"checkpoint.init_from_hf={tmp_path / 'nothing'}"], "no such folder"),
    ]
    for extra, phrase in cases:
        res = runner.invoke(app, [*common, "--output-dir", str(tmp_path / "run"), "--overwrite", *extra])
        assert res.exit_code == 2, res.output
        errors = [line for line in res.output.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and phrase in errors[0], res.output
        assert "Traceback" not in res.output


def test_dry_run_checks_the_folder(cache: Path, tmp_path: Path) -> None:
    save_random("llama", tmp_path / "hf")
    common = ["pretrain", "--recipe", "tiny_cpu.yaml", "--dry-run", *BASE, *SHAPE, f"data.cache_dir={cache}",
              f"checkpoint.init_from_hf={tmp_path / 'hf'}", "--output-dir", str(tmp_path / "run")]
    ok = CliRunner().invoke(app, common)
    assert ok.exit_code == 0, ok.output
    assert f"checkpoint.init_from_hf: {tmp_path / 'hf'} (LlamaForCausalLM) matches the recipe" in ok.output
    bad = CliRunner().invoke(app, [*common, "model.rotary_base=500000"])
    assert bad.exit_code == 2 and "rope_theta=10000.0 but the recipe has model.rotary_base=500000.0" in bad.output


def test_init_from_hf_with_checkpoint_load_is_a_rule_violation(tmp_path: Path) -> None:
    res = CliRunner().invoke(app, ["validate-config", "--recipe", "tiny_cpu.yaml", "--json",
                                   f"checkpoint.init_from_hf={tmp_path}", f"checkpoint.load={tmp_path}"])
    assert res.exit_code == 1
    rules = [v["rule"] for v in json.loads(res.output)["violations"]]
    assert "CKPT-INIT-FROM-HF-LOAD" in rules
