"""Megatron-LM's names for lptrain's keys, for the habits a Megatron user brings.

lptrain keeps Megatron's argument names as its key names where it has the same setting
(``model.tensor_model_parallel_size`` is ``--tensor-model-parallel-size``), so most flags map
by their last part; :data:`ALIASES` lists the ones whose names differ or whose last part is
ambiguous (``--seed``, ``--lr``, ``--ffn-hidden-size``), the usual abbreviations (``tp``,
``pp``, ``ep``...), and :data:`FIXED` the flags that set a value by themselves
(``--bf16``, ``--untie-embeddings-and-output-weights``, ``--no-load-optim``). The command
line reads such flags as the key they name (:mod:`lptrain.cli.megatron_flags`), and an unknown
key's "did you mean" names the key an abbreviation stands for
(:func:`lptrain.config.compose.suggest_key`).
"""

from __future__ import annotations

from typing import Optional

ALIASES: dict[str, str] = {
    # abbreviations
    "tp": "model.tensor_model_parallel_size",
    "pp": "model.pipeline_model_parallel_size",
    "vpp": "model.virtual_pipeline_model_parallel_size",
    "sp": "model.sequence_parallel",
    "ep": "model.moe.expert_model_parallel_size",
    "etp": "model.moe.expert_tensor_parallel_size",
    "mbs": "train.micro_batch_size",
    "gbs": "train.global_batch_size",
    # Megatron-LM argument names that differ from lptrain's, or are ambiguous here
    "lr": "optimizer.lr",
    "seed": "train.seed",
    "ffn_hidden_size": "model.ffn_hidden_size",
    "lr_warmup_iters": "optimizer.warmup_iters",
    "lr_decay_iters": "optimizer.decay_iters",
    "lr_decay_style": "optimizer.lr_schedule",
    "save": "checkpoint.save",
    "load": "checkpoint.load",
    "optimizer": "optimizer.name",
    "exit_duration_in_mins": "train.exit_duration_mins",
    "accumulate_allreduce_grads_in_fp32": "ddp.grad_reduce_in_fp32",
    "ddp_bucket_size": "ddp.bucket_size",
    "ddp_average_in_collective": "ddp.average_in_collective",
    "check_for_nan_in_loss_and_grad": "ddp.check_for_nan_in_grad",
    "moe_router_load_balancing_type": "model.moe.load_balancing_type",
    "moe_router_score_function": "model.moe.score_function",
    "moe_router_enable_expert_bias": "model.moe.enable_expert_bias",
    "moe_router_bias_update_rate": "model.moe.bias_update_rate",
    "muon_num_ns_steps": "optimizer.muon.ns_steps",
    "muon_use_nesterov": "optimizer.muon.nesterov",
    "muon_scalar_optimizer": "optimizer.muon.scalar_optimizer",
}

# Flags that take no value and set one.
FIXED: dict[str, tuple[str, str]] = {
    "bf16": ("precision.params_dtype", "bf16"),
    "untie_embeddings_and_output_weights": ("model.tie_embeddings", "false"),
    "no_load_optim": ("checkpoint.load_optimizer", "false"),
}

# Names that are not keys at all, and what stands for them.
NOT_KEYS: dict[str, str] = {
    "dp": "the data-parallel size is not a key: it is the ranks left by TP x PP "
          "(--nproc-per-node, or --dp N to check a config)",
    "data_parallel_size": "the data-parallel size is not a key: it is the ranks left by TP x PP "
                          "(--nproc-per-node, or --dp N to check a config)",
}


def key_for(name: str, keys: tuple[str, ...]) -> Optional[str]:
    """The lptrain key Megatron-LM's argument (or an abbreviation) ``name`` stands for:
    ``name`` in underscores (``tensor_model_parallel_size``); None when lptrain has none.
    ``keys``: every valid dotted key (:func:`lptrain.config.compose.all_keys`)."""
    name = name.replace("-", "_")
    valid = set(keys)
    if name in ALIASES and ALIASES[name] in valid:
        return ALIASES[name]
    for prefix, section in (("moe_router_", "model.moe."), ("moe_", "model.moe."),
                            ("muon_", "optimizer.muon.")):
        if name.startswith(prefix) and section + name[len(prefix):] in valid:
            return section + name[len(prefix):]
    leaves = [k for k in keys if k.rsplit(".", 1)[-1] == name and "." in k]
    return leaves[0] if len(leaves) == 1 else None
