"""Typed configuration schema: one dataclass per section.

Every field carries a one-line help text in its metadata (``field(metadata={"help": ...})``);
that text is the documentation shown by ``--help`` and ``show-config --explain``; the rule
catalog (``docs/rules.md``) names the keys by these dotted names. Values that other settings
determine (``ddp.grad_reduce_in_fp32``, ``ddp.bucket_size``, ...) default to ``None`` here and
are filled in by :func:`lptrain.config.derive.derive`, never computed ad hoc deeper in the code.

The allowed values of every choice key are declared once, with :func:`choice` (from
:mod:`lptrain.config.fields`; the recipe, coefficient-set and scale-mode names come from
:mod:`lptrain.catalog`; the ``optimizer`` section lives in :mod:`lptrain.config.optimizer_schema`
and is re-exported here): the value-set
rules (``rulesets/choices.py``), the help texts and the rule messages all read them through
:func:`choices_of`. They are tuples in the field metadata rather than ``Literal`` annotations
on purpose: OmegaConf validates a ``Literal`` field while merging, so an unknown value would
stop composition with OmegaConf's own error (exit 2) instead of the value-set rule that lists
every allowed value and the fix next to the config's other violations (exit 1).
"""

# opt_factory() is a dataclasses.field(default_factory=...) wrapper, not a shared default.
# ruff: noqa: RUF009

from __future__ import annotations

from dataclasses import dataclass, fields, is_dataclass
from typing import Any, Optional

from lptrain.catalog import pipeline
from lptrain.catalog import recipes as catalog_recipes
from lptrain.catalog import scaled_gemm as catalog_scaled_gemm
from lptrain.config.fields import choice, one_of, opt, opt_factory, show_value
from lptrain.config.optimizer_schema import (
    LAYER_WISE_LAYOUTS,
    LR_SCHEDULES,
    MUON_COEFFICIENTS,
    MUON_SCALE_MODES,
    MUON_TP_MODES,
    OPTIMIZERS,
    SCALAR_OPTIMIZERS,
    MuonConfig,
    OptimizerConfig,
)

__all__ = [
    "LAYER_WISE_LAYOUTS", "LR_SCHEDULES", "MUON_COEFFICIENTS", "MUON_SCALE_MODES", "MUON_TP_MODES",
    "OPTIMIZERS", "SCALAR_OPTIMIZERS", "MuonConfig", "OptimizerConfig", "choice", "one_of", "opt",
    "opt_factory", "show_value",
]


# Allowed values of the choice keys (see the module docstring), read through choices_of().
DEVICES = ("auto", "cpu", "cuda")
LOAD_BALANCING = ("aux_loss", "seq_aux_loss", "none")
SCORE_FUNCTIONS = ("softmax", "sigmoid", "sqrtsoftplus")
PARAMS_DTYPES = ("bf16", "fp32")
BACKENDS = ("auto", "te", "emulated")
QUANTIZED_GEMMS = catalog_scaled_gemm.QUANTIZED_GEMMS
FP8_FORMATS = (None, *catalog_recipes.family_formats("fp8"))
FP8_RECIPES = catalog_recipes.recipe_names("fp8")
FP4_FORMATS = (None, *catalog_recipes.family_formats("fp4"))
FP4_RECIPES = catalog_recipes.recipe_names("fp4")
AMAX_ALGOS = ("most_recent", "max")
ON_NONFINITE = ("stop", "skip")
ON_ANOMALY = (None, "stop", "skip_batch", "rollback")
NAN_TENSORS = ("output_grad", "output")
SHARDING_STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")
RECOMPUTE_GRANULARITIES = (None, "selective", "full")
RECOMPUTE_METHODS = ("uniform", "block")
RECOMPUTE_MODULES = ("core_attn", "mlp_act", "mlp")
SHARDING_TYPES = ("dp_reshardable", "fully_reshardable", "fully_sharded_model_space")
PIPELINE_SCHEDULES = pipeline.SCHEDULES
CP_COMM_TYPES = ("p2p", "a2a", "allgather", "a2a+p2p")  # model.cp_comm_type (Megatron's names)
WANDB_MODES = ("online", "offline", "disabled")


@dataclass
class RunConfig:
    """Identity and placement of one run."""

    name: str = opt("lptrain", "Run name, used for the output folder and the W&B run.")
    output_dir: str = opt("runs/${run.name}", "Folder for resolved config, logs, plots and metrics.")
    device: str = choice("auto", DEVICES, "Compute device: {choices}.",
                         {"auto": "cuda when available, else cpu"})
    cpu_threads: Optional[int] = opt(
        None, "Intra-op CPU threads per rank (torch.set_num_threads); null = $OMP_NUM_THREADS when "
              "set, else the CPUs this rank can have: its affinity (and cgroup quota) shared among "
              "the node's ranks, less the CPUs other processes keep busy."
    )


@dataclass
class MoEConfig:
    """Mixture-of-experts layers (``num_experts == 0`` means a dense model)."""

    num_experts: int = opt(0, "Number of routed experts per MoE layer; 0 = dense model.")
    router_topk: int = opt(2, "Experts chosen per token.")
    moe_layer_freq: int = opt(1, "Every k-th layer is MoE (1 = all layers); the rest are dense.")
    ffn_hidden_size: Optional[int] = opt(None, "Expert MLP hidden size; null = model.ffn_hidden_size.")
    grouped_gemm: bool = opt(False, "Run all local experts as one grouped GEMM instead of a loop.")
    single_grouped_weight: bool = opt(
        False, "Store all experts' fc1 (and fc2) as one contiguous grouped parameter."
    )
    load_balancing_type: str = choice("aux_loss", LOAD_BALANCING, "Load balancing: {choices}.")
    aux_loss_coeff: float = opt(0.0, "Coefficient of the load-balancing auxiliary loss.")
    z_loss_coeff: float = opt(0.0, "Coefficient of the router z-loss (0 = off).")
    score_function: str = choice("softmax", SCORE_FUNCTIONS, "Router score function: {choices}.",
                                 {"sqrtsoftplus": "sqrt(softplus(logit))"})
    enable_expert_bias: bool = opt(
        False,
        "Aux-loss-free balancing: a per-expert bias updated from token counts (sigmoid or "
        "sqrtsoftplus scores).",
    )
    bias_update_rate: float = opt(1e-3, "Step size of the aux-loss-free expert bias update.")
    expert_model_parallel_size: int = opt(1, "Expert-parallel group size (experts split across ranks).")
    expert_tensor_parallel_size: int = opt(
        1, "Expert tensor-parallel size: 1 (experts are whole on every tensor-parallel rank, "
        "which routes its own sequence shard's tokens); larger sizes are not built."
    )


@dataclass
class ModelConfig:
    """GPT decoder shape."""

    num_layers: int = opt(2, "Number of transformer layers.")
    hidden_size: int = opt(64, "Model (residual stream) width.")
    ffn_hidden_size: Optional[int] = opt(None, "SwiGLU hidden size; null = derived (4 * hidden_size).")
    num_attention_heads: int = opt(4, "Query heads per layer.")
    num_query_groups: Optional[int] = opt(None, "Key/value heads (GQA); null = num_attention_heads.")
    seq_length: int = opt(128, "Training sequence length in tokens.")
    vocab_size: int = opt(259, "Vocabulary size (byte tokenizer: 256 bytes + BOS/EOS/PAD = 259).")
    make_vocab_size_divisible_by: int = opt(
        1, "Pad the embedding/output rows to a multiple of this (GEMM alignment)."
    )
    rotary_base: float = opt(10000.0, "RoPE base frequency.")
    norm_epsilon: float = opt(1e-5, "RMSNorm epsilon.")
    qk_layernorm: bool = opt(
        False, "RMSNorm over each query and key head before RoPE (Qwen3's q_norm/k_norm)."
    )
    tie_embeddings: bool = opt(False, "Share the token embedding and the output head weight.")
    init_method_std: float = opt(0.02, "Std of the normal weight initialisation.")
    tensor_model_parallel_size: int = opt(
        1, "Tensor-parallel size: QKV/fc1 split by output rows, proj/fc2 by input columns, "
        "embedding and output head by vocab rows over this many consecutive ranks (the world "
        "is this x the data-parallel size)."
    )
    sequence_parallel: bool = opt(
        False, "Sequence parallelism (needs tensor_model_parallel_size > 1): norms, residuals "
        "and the MoE router run on 1/TP of the sequence; all-gather / reduce-scatter around "
        "the tensor-parallel GEMMs instead of all-reduces."
    )
    pipeline_model_parallel_size: int = opt(
        1, "Pipeline-parallel size: the layers cut into this many stages in layer order, the "
        "embedding on the first and the output head and loss on the last (the world is "
        "tensor x data x this many ranks; pipeline ranks are outermost)."
    )
    virtual_pipeline_model_parallel_size: Optional[int] = opt(
        None, "Model chunks per pipeline rank (null = 1: each rank runs one contiguous stage; "
        "derived from pipeline_model_parallel_layout when that is set); without an uneven split, "
        "num_layers must divide into pipeline x virtual chunks."
    )
    pipeline_schedule: Optional[str] = choice(
        None, (None, *PIPELINE_SCHEDULES), "Pipeline schedule (torch.distributed.pipelining): {choices}.",
        {None: "derived: interleaved_1f1b with virtual chunks, else 1f1b",
         "1f1b": "one forward, one backward (Schedule1F1B)",
         "interleaved_1f1b": "virtual chunks per rank (ScheduleInterleaved1F1B)",
         "interleaved_zero_bubble": "1F1B with each backward split into its input- and weight-gradient "
                                    "parts, the weight parts filling the bubble (ScheduleInterleavedZeroBubble)",
         "zbv_zero_bubble": "zero bubble over two chunks per rank in a V (ScheduleZBVZeroBubble)",
         "dualpipev": "DeepSeek's DualPipe in a V, two chunks per rank (ScheduleDualPipeV)"},
    )
    decoder_first_pipeline_num_layers: Optional[int] = opt(
        None, "Transformer layers on the first pipeline stage (null = an even split); the stages "
        "between the first and the last split the rest evenly (Megatron-LM's uneven pipeline)."
    )
    decoder_last_pipeline_num_layers: Optional[int] = opt(
        None, "Transformer layers on the last pipeline stage (null = an even split)."
    )
    account_for_embedding_in_pipeline_split: bool = opt(
        False, "Count the token embedding as one layer when splitting the layers over the stages "
        "(the first chunk holds one transformer layer fewer)."
    )
    account_for_loss_in_pipeline_split: bool = opt(
        False, "Count the final norm, output layer and loss as one layer when splitting the layers "
        "over the stages (the last chunk holds one transformer layer fewer)."
    )
    pipeline_model_parallel_layout: Optional[str] = opt(
        None, "Every chunk's layers spelled out, Megatron-LM's grammar: E embedding, t transformer "
        "layer, L loss, | between chunks (model order), (...)*n and x*n repeat, e.g. 'Et|(tt|)*2,tL'."
    )
    context_parallel_size: int = opt(1, "Context-parallel size: each sequence split over this many "
                                     "ranks, 2 chunks each (the world: TP x CP x DP x PP ranks).")
    cp_comm_type: str = choice("p2p", CP_COMM_TYPES, "Context-parallel attention: {choices}.", {
        "p2p": "ring, KV passed round", "a2a": "Ulysses all-to-all: heads for sequence",
        "allgather": "KV all-gathered", "a2a+p2p": "a2a in the first hierarchical level, ring across"})
    hierarchical_context_parallel_sizes: Optional[list[int]] = opt(None, "cp_comm_type=a2a+p2p: "
                                                                   "[a2a size, p2p size], product CP.")
    recompute_granularity: Optional[str] = choice(
        None, RECOMPUTE_GRANULARITIES, "Activation recompute: {choices}.",
        {None: "off", "selective": "the recompute_modules of every layer",
         "full": "whole layers, by recompute_method"},
    )
    recompute_method: str = choice(
        "uniform", RECOMPUTE_METHODS, "Full recompute: {choices}.",
        {"uniform": "every layer, in chunks of recompute_num_layers",
         "block": "only the first recompute_num_layers layers"},
    )
    recompute_num_layers: int = opt(1, "Full recompute: layers per chunk (uniform) or recomputed layers (block).")
    recompute_modules: list[str] = opt_factory(
        lambda: ["core_attn"], "Selective recompute: any of core_attn, mlp_act, mlp."
    )
    moe: MoEConfig = opt_factory(MoEConfig, "Mixture-of-experts settings.")


@dataclass
class PrecisionConfig:
    """Compute/storage precision and the quantized-GEMM recipe."""

    params_dtype: str = choice("bf16", PARAMS_DTYPES, "Model parameter dtype: {choices}.")
    backend: str = choice("auto", BACKENDS, "{choices}.", {"auto": "te with CUDA+TE, else emulated"})
    fp8_format: Optional[str] = choice(None, FP8_FORMATS, "FP8 format: {choices}.",
                                       {None: "off", "hybrid": "E4M3 fwd, E5M2 bwd"})
    fp8_recipe: str = choice("delayed", FP8_RECIPES, "FP8 recipe: {choices}.")
    fp4_format: Optional[str] = choice(None, FP4_FORMATS, "FP4 format: {choices}.", {None: "off"})
    fp4_recipe: str = choice("nvfp4", FP4_RECIPES, "FP4 recipe: {choices}.")
    fp8_param_gather: bool = opt(False, "Keep primary weights in FP8 and all-gather them in FP8.")
    fp4_param_gather: bool = opt(False, "Keep primary weights in FP4 and all-gather them in FP4.")
    fp8_margin: int = opt(0, "Delayed scaling: scale margin (powers of two of headroom).")
    fp8_amax_history_len: int = opt(1, "Delayed scaling: length of the amax history window.")
    fp8_amax_compute_algo: str = choice("most_recent", AMAX_ALGOS, "Delayed scaling: {choices}.")
    first_last_layers_bf16: bool = opt(False, "Run the first/last layers without quantized GEMMs.")
    num_layers_at_start_in_bf16: int = opt(1, "Layers at the start kept in bf16.")
    num_layers_at_end_in_bf16: int = opt(1, "Layers at the end kept in bf16.")
    amax_epsilon: float = opt(0.0, "Floor under block/tensor amax before the scale division.")
    nvfp4_rht: bool = opt(True, "NVFP4: random Hadamard transform on the wgrad operands.")
    nvfp4_stochastic_rounding: bool = opt(True, "NVFP4: stochastic rounding of gradients.")
    nvfp4_2d_weights: bool = opt(True, "NVFP4: 16x16 block scales for weights.")
    quantized_gemm: str = choice("auto", QUANTIZED_GEMMS, "Quantized GEMMs of the emulated backend: {choices}.", {
        "auto": "scaled_mm where torch has the kernel on this GPU, else dequantized; CPU: dequantized",
        "dequantized": "fp32 GEMM of the dequantized operands", "scaled_mm": "torch's scaled GEMM on the stored codes and scales"})


@dataclass
class DDPConfig:
    """Data-parallel engine: buffers, buckets, gradient reduction and param gather."""

    use_distributed_optimizer: bool = opt(False, "Shard optimizer state over data-parallel ranks.")
    overlap_grad_reduce: bool = opt(False, "Overlap gradient reduction with backward, per bucket.")
    overlap_param_gather: bool = opt(False, "Overlap parameter all-gather with the next forward.")
    grad_reduce_in_fp32: Optional[bool] = opt(
        None, "Reduce grads in fp32; null = derived (true when params_dtype is bf16)."
    )
    bucket_size: Optional[int] = opt(
        None, "Bucket size in elements; null = derived (max(40M, 1M*dp), one bucket w/o overlap)."
    )
    num_distributed_optimizer_instances: int = opt(1, "Partial sharding: optimizer instances.")
    data_parallel_sharding_strategy: Optional[str] = choice(
        None, (None, *SHARDING_STRATEGIES), "What is sharded over data-parallel ranks: {choices}.",
        {None: "derived from use_distributed_optimizer: optim or no_shard",
         "optim": "fp32 masters and moments (ZeRO-1)",
         "optim_grads": "plus grads: each bucket keeps its reduced shard (ZeRO-2)",
         "optim_grads_params": "plus params, gathered per bucket for forward and backward (ZeRO-3)"},
    )
    reuse_grad_buf_for_mxfp8_param_ag: bool = opt(
        False, "MXFP8 param gather rides a bf16 view of the grad buffer."
    )
    average_in_collective: bool = opt(False, "Average in the collective instead of pre-scaling.")
    check_for_nan_in_grad: bool = opt(True, "Check each bucket's grads for NaN/Inf before reducing (one process: through the grad norm).")


@dataclass
class DistConfig:
    """Process groups, as Megatron-Bridge's ``dist`` section (Megatron-LM's distributed args)."""

    distributed_timeout_minutes: float = opt(
        10.0,
        "Minutes a collective may wait for its peers (the process-group timeout, Megatron's "
        "--distributed-timeout-minutes) and a rank may make no progress before the launcher's "
        "watchdog names it and stops the job (exit 3).",
    )


@dataclass
class DataConfig:
    """Training data."""

    source: str = opt("builtin:python-stdlib", "Dataset: builtin:python-stdlib or an index prefix.")
    paths: list[str] = opt_factory(list, "Index prefixes of prepared datasets for a blend.")
    weights: list[float] = opt_factory(list, "Blend weights, one per path (empty = by size).")
    cache_dir: str = opt(
        "~/.cache/lptrain",
        "Where built-in datasets are prepared and reused; left at this default: $LPTRAIN_CACHE_DIR, "
        "else $XDG_CACHE_HOME/lptrain, else ~/.cache/lptrain.",
    )
    builtin_max_mb: float = opt(32.0, "Cap on a built-in corpus: its first N MB in sorted file order.")
    tokenizer: str = opt("byte", "Tokenizer: byte or a path to a tokenizers JSON file.")
    split_valid_fraction: float = opt(0.02, "Fraction of documents held out for validation.")
    seed: int = opt(1234, "Seed for the document split and the shuffling.")
    num_workers: int = opt(0, "DataLoader worker processes.")


@dataclass
class TrainConfig:
    """Training loop."""

    seed: int = opt(1234, "Seed for parameter init (independent of world size and layout).")
    micro_batch_size: int = opt(4, "Sequences per micro-batch per rank.")
    global_batch_size: int = opt(8, "Sequences per optimizer step over all ranks.")
    train_iters: int = opt(100, "Optimizer steps to run.")
    eval_interval: Optional[int] = opt(None, "Evaluate every N steps (null = only at the end).")
    eval_iters: int = opt(10, "Global batches per evaluation (the same samples at any DP size).")
    log_interval: Optional[int] = opt(10, "Log metrics every N steps.")
    exit_interval: Optional[int] = opt(None, "Stop after N steps in this job (for requeue).")
    exit_duration_mins: Optional[float] = opt(
        None, "Save (when checkpoint.save is set) and stop after N minutes of this job."
    )
    on_nonfinite: str = choice(
        "stop", ON_NONFINITE, "NaN/Inf loss or grad norm: {choices}.",
        {"stop": "raise, naming step and tensor", "skip": "no optimizer update that step"},
    )
    on_anomaly: Optional[str] = choice(
        None, ON_ANOMALY,
        "A non-finite loss or grad, a diverged loss (train.check_for_spiky_loss) or a loss spike "
        "(train.spike_zscore): {choices}; each is logged with its step, rank, sample ids and "
        "culprit (the first non-finite tensor, or the operand whose statistics moved most).",
        {None: "follows train.on_nonfinite: stop or skip_batch",
         "stop": "raise after the forensics", "skip_batch": "no optimizer update that step",
         "rollback": "reload the last checkpoint before the anomaly window and skip the data since it"},
    )
    check_for_spiky_loss: bool = opt(
        True, "Megatron's check: a diverged loss is an anomaly (train.on_anomaly; by default the "
              "run stops, exit 3): above train.uniform_loss_factor x ln(vocab), or above "
              "train.spiky_loss_factor x the median of the last train.spike_window accepted steps "
              "(once 10 of them are there). A diverged step never joins that history either way."
    )
    spiky_loss_factor: float = opt(
        10.0, "A loss above this multiple of the running median of the loss diverged (Megatron's 10)."
    )
    uniform_loss_factor: float = opt(
        3.0, "A loss above this multiple of ln(vocab), the loss of a uniform prediction, diverged "
             "(needs no history: a blow-up at step 2 is caught)."
    )
    spike_zscore: Optional[float] = opt(
        None, "A loss more than this many standard deviations above the mean of the last "
              "train.spike_window steps (at least 10 of them) is an anomaly (null = no spike detection)."
    )
    spike_window: int = opt(100, "Steps of loss history the spike and divergence checks compare with.")
    max_rollbacks: int = opt(
        3, "train.on_anomaly=rollback: rollbacks allowed in a job; the next anomaly stops the run."
    )
    gradient_accumulation_fusion: bool = opt(
        True, "Quantized linears accumulate wgrad straight into main_grad."
    )
    compile: bool = opt(False, "torch.compile each transformer block (quantizers included), as torchtitan does.")


@dataclass
class CheckpointConfig:
    """Checkpoint save/load."""

    save: Optional[str] = opt(None, "Folder to save checkpoints to (null = no saving).")
    load: Optional[str] = opt(None, "Folder to resume from (null = checkpoint.save if it holds one).")
    init_from_hf: Optional[str] = opt(
        None,
        "Hugging Face model folder (Llama, Qwen3, Mixtral, Qwen3-MoE) a fresh run starts from: "
        "its weights become the fp32 masters, the optimizer starts fresh; a run that resumes "
        "from checkpoint.save ignores it.",
    )
    save_interval: Optional[int] = opt(None, "Save every N steps.")
    keep_latest: int = opt(2, "Checkpoints kept (at least 2, the newest may be half-written).")
    sharding_type: str = choice("dp_reshardable", SHARDING_TYPES, "{choices}.")
    async_save: bool = opt(False, "Save in the background.")
    save_on_interrupt: bool = opt(
        False, "Also save on SIGINT (Ctrl-C); SIGTERM/SIGUSR1 always save when save is set."
    )
    load_optimizer: bool = opt(
        True,
        "Resume the optimizer state from the checkpoint; false keeps the saved weights, data "
        "position and step, and starts a fresh optimizer (e.g. to switch optimizer.name).",
    )


@dataclass
class LoggingConfig:
    """Metrics and logging."""

    wandb: bool = opt(False, "Log to Weights & Biases.")
    wandb_project: str = opt("lptrain", "W&B project.")
    wandb_mode: str = choice("offline", WANDB_MODES, "W&B mode: {choices}.")
    plots: bool = opt(True, "Write PNG plots (loss curves, memory) into the run folder.")
    progress: bool = opt(True, "Show a rich progress bar.")
    numerics_interval: int = opt(
        0, "Every N steps, per-layer quantization statistics of every GEMM operand into "
           "metrics.jsonl (0 = off; see docs/numerics-debugging.md)."
    )


@dataclass
class DebugConfig:
    """Test hooks for the anomaly tooling (never set in a real run)."""

    nan_sample: Optional[int] = opt(
        None, "Inject a NaN in the step whose batch holds this global sample position, on the "
              "rank and micro-batch that read it (null = never)."
    )
    nan_module: str = opt("", "debug.nan_sample: the module (state-dict name) whose tensor gets the NaN.")
    nan_tensor: str = choice("output_grad", NAN_TENSORS, "debug.nan_sample: which tensor: {choices}.")


@dataclass
class LPTrainConfig:
    """The whole run configuration; its sections map one-to-one to recipe YAML sections."""

    run: RunConfig = opt_factory(RunConfig, "Run identity.")
    model: ModelConfig = opt_factory(ModelConfig, "Model shape.")
    precision: PrecisionConfig = opt_factory(PrecisionConfig, "Precision and quantization recipe.")
    ddp: DDPConfig = opt_factory(DDPConfig, "Data-parallel engine.")
    dist: DistConfig = opt_factory(DistConfig, "Process groups: collective timeout, hung-rank watchdog.")
    optimizer: OptimizerConfig = opt_factory(OptimizerConfig, "Optimizer and LR schedule.")
    data: DataConfig = opt_factory(DataConfig, "Training data.")
    train: TrainConfig = opt_factory(TrainConfig, "Training loop.")
    checkpoint: CheckpointConfig = opt_factory(CheckpointConfig, "Checkpointing.")
    logging: LoggingConfig = opt_factory(LoggingConfig, "Metrics and logging.")
    debug: DebugConfig = opt_factory(DebugConfig, "Test hooks for the anomaly tooling.")


def iter_fields(cls: type = LPTrainConfig, prefix: str = "") -> list[tuple[str, Any, str]]:
    """All leaf fields as ``(dotted_key, type, help)``, in declaration order."""
    out: list[tuple[str, Any, str]] = []
    for f in fields(cls):
        key = f"{prefix}{f.name}"
        sub = f.default_factory() if callable(f.default_factory) else None  # type: ignore[misc]
        if sub is not None and is_dataclass(sub):
            out.extend(iter_fields(type(sub), key + "."))
        else:
            out.append((key, f.type, f.metadata.get("help", "")))
    return out


def choices_of(key: str) -> tuple[Any, ...]:
    """The allowed values of the choice key ``key`` (dotted), as declared by :func:`choice`."""
    cls: Any = LPTrainConfig
    *sections, leaf = key.split(".")
    for name in sections:
        cls = type(next(f for f in fields(cls) if f.name == name).default_factory())  # type: ignore[misc]
    meta = next(f for f in fields(cls) if f.name == leaf).metadata
    if "choices" not in meta:
        raise KeyError(f"{key} is not a choice key")
    return meta["choices"]


def choice_keys() -> dict[str, tuple[Any, ...]]:
    """Every choice key and its allowed values, in schema order."""
    out: dict[str, tuple[Any, ...]] = {}

    def walk(cls: type, prefix: str) -> None:
        for f in fields(cls):
            sub = f.default_factory() if callable(f.default_factory) else None  # type: ignore[misc]
            if sub is not None and is_dataclass(sub):
                walk(type(sub), f"{prefix}{f.name}.")
            elif "choices" in f.metadata:
                out[prefix + f.name] = f.metadata["choices"]

    walk(LPTrainConfig, "")
    return out
