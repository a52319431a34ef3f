"""Other values to try for every schema key (the key-effect test perturbs each key to them).

``CANDIDATES[key](value, cfg)`` lists values in order of preference, given the key's value
in the recipe (after ``derive``) and the derived config; the test takes the first one that
is valid in the recipe's context (it skips values other rules refuse, such as a width the
recipe's quantization blocks do not divide). Each is chosen to make an effect visible in
a model built from the config or in two optimizer steps, where the key has one.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

Candidates = Callable[[Any, Any], list[Any]]


def _flip(v: Any, c: Any) -> list[Any]:
    return [not v]


def _others(*values: Any) -> Candidates:
    return lambda v, c: [x for x in values if x != v]


def _scaled(*factors: float) -> Candidates:
    return lambda v, c: [type(v)(v * f) for f in factors]


def _int_steps(*deltas: int) -> Candidates:
    return lambda v, c: [v + d for d in deltas if v + d >= 0]


def _halve_or_double(v: Any, c: Any) -> list[Any]:
    return [x for x in (v // 2, v * 2) if x >= 1]


def _decay_iters(v: Any, c: Any) -> list[Any]:
    t, w = c.train.train_iters, c.optimizer.warmup_iters
    return [x for x in ((w + t) // 2 + 1, 2 * t) if x != v and x > w]


def _ns_steps(v: Any, c: Any) -> list[Any]:
    return [v * 2, v + 1, 4, 8]


def _topk(v: Any, c: Any) -> list[Any]:
    return [x for x in (v + 1, v - 1, 1) if x >= 1]


def _ep(v: Any, c: Any) -> list[Any]:
    return [x for x in (2, v // 2, v * 2) if x >= 1 and x != v]


def _shifted_layout(c: Any) -> str:
    """A layout string moving one layer from the first chunk to the last (else ``Et|tL``)."""
    m = c.model
    vpp = m.virtual_pipeline_model_parallel_size or 1
    chunks = max(1, m.pipeline_model_parallel_size) * vpp
    n = m.num_layers // chunks
    if chunks < 2 or n < 2 or m.num_layers % chunks:
        return "Et|tL"
    sizes = [n - 1, *[n] * (chunks - 2), n + 1]
    return "|".join(("E" if i == 0 else "") + "t" * k + ("L" if i == chunks - 1 else "")
                    for i, k in enumerate(sizes))


CANDIDATES: dict[str, Candidates] = {
    "run.name": _others("renamed"),
    "run.output_dir": _others("runs/elsewhere"),
    "run.device": _others("cpu", "auto", "cuda"),
    "run.cpu_threads": lambda v, c: [1] if v is None else [None],
    "model.num_layers": _int_steps(2),
    "model.hidden_size": _scaled(2),
    "model.recompute_granularity": _others("full", "selective", None),
    "model.recompute_method": _others("block", "uniform"),
    "model.recompute_num_layers": _int_steps(1, -1),
    "model.recompute_modules": lambda v, c: [["core_attn", "mlp_act"], ["mlp"]],
    "model.ffn_hidden_size": _scaled(2),
    "model.num_attention_heads": lambda v, c: [v * 2, v // 2],
    "model.num_query_groups": _halve_or_double,
    "model.seq_length": _halve_or_double,
    "model.vocab_size": _int_steps(256),  # past the next padded size (divisible_by 128)
    "model.make_vocab_size_divisible_by": _others(64, 128),
    "model.rotary_base": _scaled(10.0),
    "model.norm_epsilon": _others(1e-3),
    "model.tie_embeddings": _flip,
    "model.qk_layernorm": _flip,
    "model.init_method_std": _scaled(2.0),
    "model.tensor_model_parallel_size": _others(2, 4),
    "model.sequence_parallel": _flip,
    "model.pipeline_model_parallel_size": _others(2, 4),
    "model.virtual_pipeline_model_parallel_size": _others(2, None),
    "model.pipeline_schedule": _others("interleaved_1f1b", "1f1b", "interleaved_zero_bubble", "zbv_zero_bubble",
                                       "dualpipev"),
    "model.decoder_first_pipeline_num_layers": _others(2, 1, None),
    "model.decoder_last_pipeline_num_layers": _others(2, 1, None),
    "model.account_for_embedding_in_pipeline_split": _flip,
    "model.account_for_loss_in_pipeline_split": _flip,
    "model.pipeline_model_parallel_layout": lambda v, c: [None] if v is not None else [_shifted_layout(c)],
    "model.context_parallel_size": _others(2, 4),
    "model.cp_comm_type": _others("a2a", "allgather", "p2p"),
    "model.hierarchical_context_parallel_sizes": _others([2, 1], [1, 2], None),
    "model.moe.num_experts": lambda v, c: [v * 2] if v else [4],
    "model.moe.router_topk": _topk,
    "model.moe.moe_layer_freq": _others(2, 3, 1),
    "model.moe.ffn_hidden_size": lambda v, c: [64] if v is None else [v * 2],
    "model.moe.grouped_gemm": _flip,
    "model.moe.single_grouped_weight": _flip,
    "model.moe.load_balancing_type": _others("seq_aux_loss", "none", "aux_loss"),
    "model.moe.aux_loss_coeff": lambda v, c: [1e-2] if v == 0 else [v * 10, 0.0],
    "model.moe.z_loss_coeff": lambda v, c: [1e-3] if v == 0 else [v * 10, 0.0],
    "model.moe.score_function": _others("sigmoid", "sqrtsoftplus", "softmax"),
    "model.moe.enable_expert_bias": _flip,
    "model.moe.bias_update_rate": _scaled(10.0),
    "model.moe.expert_model_parallel_size": _ep,
    "model.moe.expert_tensor_parallel_size": _others(2),
    "precision.params_dtype": _others("fp32", "bf16"),
    "precision.backend": _others("emulated", "te", "auto"),
    "precision.fp8_format": _others("e4m3", "hybrid", None),
    "precision.fp8_recipe": _others("tensorwise", "blockwise", "mxfp8", "delayed"),
    "precision.fp4_format": _others("e2m1", None),
    "precision.fp4_recipe": _others("nvfp4"),
    "precision.fp8_param_gather": _flip,
    "precision.fp4_param_gather": _flip,
    "precision.fp8_margin": _int_steps(1),
    "precision.fp8_amax_history_len": lambda v, c: [16] if v == 1 else [1],
    "precision.fp8_amax_compute_algo": _others("max", "most_recent"),
    "precision.first_last_layers_bf16": _flip,
    "precision.num_layers_at_start_in_bf16": _int_steps(1, -1),
    "precision.num_layers_at_end_in_bf16": _int_steps(1, -1),
    "precision.amax_epsilon": _others(1.0),
    "precision.nvfp4_rht": _flip,
    "precision.nvfp4_stochastic_rounding": _flip,
    "precision.nvfp4_2d_weights": _flip,
    "precision.quantized_gemm": _others("scaled_mm", "dequantized", "auto"),
    "dist.distributed_timeout_minutes": _others(0.5, 30.0),
    "ddp.use_distributed_optimizer": _flip,
    "ddp.overlap_grad_reduce": _flip,
    "ddp.overlap_param_gather": _flip,
    "ddp.grad_reduce_in_fp32": _flip,
    "ddp.bucket_size": _others(10_000, 1_000_000),
    "ddp.num_distributed_optimizer_instances": _others(2, 4),
    "ddp.reuse_grad_buf_for_mxfp8_param_ag": _flip,
    "ddp.average_in_collective": _flip,
    "ddp.check_for_nan_in_grad": _flip,
    "ddp.data_parallel_sharding_strategy": _others("optim_grads", "optim_grads_params", "optim"),
    "optimizer.name": _others("muon", "adamw"),
    "optimizer.lr": _scaled(2.0),
    "optimizer.min_lr": _scaled(0.5),
    "optimizer.weight_decay": lambda v, c: [v * 2] if v else [0.1],
    "optimizer.adam_beta1": _others(0.8),
    "optimizer.adam_beta2": _others(0.99),
    "optimizer.adam_eps": _others(1e-6),
    "optimizer.lion_beta1": _others(0.9),
    "optimizer.lion_beta2": _others(0.99),
    "optimizer.clip_grad": _others(0.1, 0.0),
    "optimizer.lr_schedule": _others("linear", "wsd", "cosine", "constant"),
    "optimizer.warmup_iters": _int_steps(1, -1),
    "optimizer.decay_iters": _decay_iters,
    "optimizer.override_opt_param_scheduler": _flip,
    "optimizer.use_checkpoint_opt_param_scheduler": _flip,
    "optimizer.layer_wise_param_layout": _others("padded", "compact"),
    "optimizer.use_layer_wise_optimizer": _flip,
    "optimizer.muon.lr": lambda v, c: [c.optimizer.lr * 2] if v is None else [v * 2],
    "optimizer.muon.momentum": _others(0.9),
    "optimizer.muon.nesterov": _flip,
    "optimizer.muon.ns_steps": _ns_steps,
    "optimizer.muon.coefficients": _others("simple", "polar_express", "aol", "quintic"),
    "optimizer.muon.scale_mode": _others("shape_scaling", "unit_rms_norm", "spectral"),
    "optimizer.muon.extra_scale_factor": _others(0.5),
    "optimizer.muon.tp_mode": _others("distributed", "duplicated"),
    "optimizer.muon.split_qkv": _flip,
    "optimizer.muon.scalar_optimizer": _others("lion", "adamw"),
    "optimizer.use_precision_aware_optimizer": _flip,
    "optimizer.main_grads_dtype": _others("bf16", "fp32"),
    "optimizer.main_params_dtype": _others("fp16", "fp32"),
    "optimizer.exp_avg_dtype": _others("bf16", "fp8", "fp16", "fp32"),
    "optimizer.exp_avg_sq_dtype": _others("bf16", "fp8", "fp16", "fp32"),
    "optimizer.store_param_remainders": _others(True, False),
    "data.source": _others("/nonexistent/lptrain-key-effects"),
    "data.paths": lambda v, c: [["/nonexistent/a"]],
    "data.weights": lambda v, c: [[2.0] * max(1, len(c.data.paths))],
    "data.cache_dir": _others("/nonexistent/cache"),
    "data.builtin_max_mb": _scaled(0.5),
    "data.tokenizer": _others("/nonexistent/tokenizer.json"),
    "data.split_valid_fraction": _others(0.1),
    "data.seed": _int_steps(1),
    "data.num_workers": _int_steps(1),
    "train.seed": _int_steps(1),
    "train.compile": _flip,
    "train.micro_batch_size": _halve_or_double,
    "train.global_batch_size": _scaled(2),
    "train.train_iters": _scaled(2),
    "train.eval_interval": lambda v, c: [5] if v is None else [v + 1],
    "train.eval_iters": _int_steps(1),
    "train.log_interval": lambda v, c: [1] if v is None else [v + 1],
    "train.exit_interval": lambda v, c: [5] if v is None else [v + 1],
    "train.exit_duration_mins": lambda v, c: [30.0] if v is None else [v + 1],
    "train.on_nonfinite": _others("skip", "stop"),
    "train.on_anomaly": _others("stop", "skip_batch", "rollback"),
    "train.spike_zscore": lambda v, c: [6.0] if v is None else [None],
    "train.spike_window": _int_steps(1),
    "train.check_for_spiky_loss": _flip,
    "train.spiky_loss_factor": _scaled(2.0),
    "train.uniform_loss_factor": _scaled(2.0),
    "train.max_rollbacks": _int_steps(1),
    "train.gradient_accumulation_fusion": _flip,
    "checkpoint.save": lambda v, c: ["/nonexistent/ckpt"] if v is None else [None],
    "checkpoint.load": lambda v, c: ["/nonexistent/ckpt"],
    "checkpoint.init_from_hf": lambda v, c: ["/nonexistent/hf"],
    "checkpoint.save_interval": lambda v, c: [5] if v is None else [v + 1],
    "checkpoint.keep_latest": _int_steps(1),
    "checkpoint.sharding_type": _others("fully_reshardable", "dp_reshardable",
                                        "fully_sharded_model_space"),
    "checkpoint.async_save": _flip,
    "checkpoint.save_on_interrupt": _flip,
    "checkpoint.load_optimizer": _flip,
    "logging.wandb": _flip,
    "logging.wandb_project": _others("other-project"),
    "logging.wandb_mode": _others("online", "disabled", "offline"),
    "logging.plots": _flip,
    "logging.progress": _flip,
    "logging.numerics_interval": lambda v, c: [1] if not v else [0],
    "debug.nan_sample": lambda v, c: [3] if v is None else [None],
    "debug.nan_module": _others("layers.0.mlp.linear_fc2"),
    "debug.nan_tensor": _others("output", "output_grad"),
}
