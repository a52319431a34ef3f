"""Property: over random flag combinations check() never raises and reports well-formed
violations; the verdict matches the exit-code contract (0 or 1)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from lptrain.config import World, check, compose
from lptrain.config.compose import all_keys
from lptrain.config.rules import rule_ids

BOOL = st.sampled_from(["true", "false"])
FLAGS = {
    "precision.params_dtype": st.sampled_from(["bf16", "fp32", "fp16"]),
    "precision.backend": st.sampled_from(["auto", "te", "emulated"]),
    "precision.fp8_format": st.sampled_from(["null", "e4m3", "hybrid", "e5m2"]),
    "precision.fp8_recipe": st.sampled_from(["delayed", "tensorwise", "blockwise", "mxfp8", "x"]),
    "precision.fp4_format": st.sampled_from(["null", "e2m1"]),
    "precision.fp8_param_gather": BOOL,
    "precision.fp4_param_gather": BOOL,
    "precision.first_last_layers_bf16": BOOL,
    "precision.num_layers_at_start_in_bf16": st.integers(-1, 3).map(str),
    "ddp.use_distributed_optimizer": BOOL,
    "ddp.overlap_grad_reduce": BOOL,
    "ddp.overlap_param_gather": BOOL,
    "ddp.num_distributed_optimizer_instances": st.integers(0, 4).map(str),
    "ddp.reuse_grad_buf_for_mxfp8_param_ag": BOOL,
    "ddp.bucket_size": st.sampled_from(["null", "0", "-5", "1000"]),
    "ddp.grad_reduce_in_fp32": st.sampled_from(["null", "true", "false"]),
    "optimizer.name": st.sampled_from(["adamw", "muon", "sgd"]),
    "optimizer.layer_wise_param_layout": st.sampled_from(["compact", "padded"]),
    "optimizer.use_layer_wise_optimizer": st.sampled_from(["null", "true", "false"]),
    "optimizer.muon.momentum": st.sampled_from(["0.0", "0.95", "1.0", "-0.1"]),
    "optimizer.muon.ns_steps": st.integers(-1, 6).map(str),
    "optimizer.lr": st.sampled_from(["0.0", "3e-4", "-1.0"]),
    "model.num_attention_heads": st.integers(0, 8).map(str),
    "model.num_query_groups": st.sampled_from(["null", "0", "1", "2", "3"]),
    "model.hidden_size": st.sampled_from(["0", "48", "64", "100"]),
    "model.moe.num_experts": st.integers(0, 8).map(str),
    "model.moe.router_topk": st.integers(0, 9).map(str),
    "model.moe.expert_model_parallel_size": st.integers(0, 4).map(str),
    "model.moe.grouped_gemm": BOOL,
    "model.moe.single_grouped_weight": BOOL,
    "train.micro_batch_size": st.integers(0, 4).map(str),
    "checkpoint.sharding_type": st.sampled_from(
        ["dp_reshardable", "fully_reshardable", "fully_sharded_model_space", "bogus"]
    ),
}
WORLDS = st.builds(
    World,
    dp=st.integers(1, 16),
    target=st.sampled_from(["cpu", "sm89", "sm90", "sm100"]),
    te_version=st.sampled_from([None, "2.1", "2.3", "2.14.0.dev0"]),
    cuda=st.booleans(),
)


@settings(max_examples=200, deadline=None)
@given(
    chosen=st.fixed_dictionaries({}, optional=FLAGS),  # type: ignore[arg-type]
    world=WORLDS,
)
def test_check_never_raises_and_is_well_formed(chosen: dict[str, str], world: World) -> None:
    cfg = compose(None, [f"{k}={v}" for k, v in chosen.items()])
    found = check(cfg, world)
    ids, keys = set(rule_ids()), set(all_keys())
    for v in found:
        d = v.to_dict()
        assert list(d) == ["rule", "severity", "keys", "message", "fix"]
        assert d["rule"] in ids and d["severity"] in ("error", "warning")
        assert d["keys"] and set(d["keys"]) <= keys
        assert d["message"].strip() and d["fix"].strip()
    assert len({v.rule for v in found}) == len(found)  # each rule at most once
    exit_code = 1 if any(v.severity == "error" for v in found) else 0
    assert exit_code in (0, 1)
