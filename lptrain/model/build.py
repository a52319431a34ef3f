"""``build_model(cfg)``: the model stage of a run (config + layer factory -> ``GPTModel``),
placed on the run's device (``run.device``; ``auto`` = CUDA when available).

Placement: the model is built under ``torch.device(device)``, so every parameter -- quantized
primary weights included, TE's layers (created on CUDA by TE) too -- is created where it
lives and the model is never moved. ``model.to(device)`` would not do: from TE 2.19 TE's
quantized tensors are traceable wrapper subclasses, which ``nn.Module._apply`` swaps for
fresh parameters (``torch.utils.swap_tensors``), dropping each parameter's ``__dict__`` --
the kept high-precision init value fp32 masters start from among it. Initial values do not
depend on the device: they are drawn on the CPU from per-parameter generators and copied in
(``lptrain.model.init``).
"""

from __future__ import annotations

from typing import Any, Optional, Union

import torch

from lptrain.config.schema import LPTrainConfig
from lptrain.errors import DeviceError
from lptrain.model.build_context import BuildContext
from lptrain.model.gpt import GPTModel, ModelPart
from lptrain.model.params import tag_parameters
from lptrain.model.process_group import SINGLE_RANK, ProcessGroup

_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}


def resolve_device(cfg: LPTrainConfig) -> torch.device:
    """``run.device`` as a ``torch.device``: ``auto`` -> the current CUDA device when CUDA is
    available, else CPU; ``cuda`` without CUDA raises ``DeviceError`` (one line with the fix;
    the rule RUN-DEVICE-CUDA reports the same before a run starts)."""
    name = cfg.run.device
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        if not torch.cuda.is_available():
            raise DeviceError(
                "run.device=cuda but torch.cuda.is_available() is False",
                key="run.device",
                fix="set run.device=auto or run.device=cpu, or install a CUDA build of torch",
            )
        return torch.device("cuda", torch.cuda.current_device())
    if name == "cpu":
        return torch.device("cpu")
    raise DeviceError(f"run.device must be auto, cpu or cuda, got {name!r}", key="run.device",
                      fix="set run.device=auto")


def compute_dtype_for(device: torch.device, params_dtype: torch.dtype) -> torch.dtype:
    """Activation dtype between layers: the 16-bit params dtype on CUDA (TE then gets bf16
    inputs, which NVFP4's RHT requires, and GEMMs run at bf16 speed), fp32 elsewhere (bf16
    math is slow on CPU; the emulated GEMMs round their operands to the storage format
    anyway)."""
    if device.type == "cuda" and params_dtype in (torch.bfloat16, torch.float16):
        return params_dtype
    return torch.float32


def params_dtype_of(name: str) -> torch.dtype:
    try:
        return _DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown params_dtype {name!r}; expected one of {sorted(_DTYPES)}") from None


def default_factory(cfg: LPTrainConfig) -> Any:
    """The precision package's layer factory for ``cfg`` (recipe, backend, bf16 layers)."""
    from lptrain.precision.factory import build_factory

    return build_factory(
        cfg.precision,
        num_layers=cfg.model.num_layers,
        fuse_wgrad_accumulation=cfg.train.gradient_accumulation_fusion,
        run_cfg=cfg,
    )


def _target_device(cfg: LPTrainConfig, device: Union[str, torch.device, None]) -> torch.device:
    """An explicit ``device`` wins, then a caller's ``with torch.device(...)`` context that
    is not the CPU (e.g. ``meta`` for a dry run), then ``run.device``."""
    if device is not None:
        return torch.device(device)
    ambient = torch.get_default_device()
    if ambient.type != "cpu":
        return ambient
    return resolve_device(cfg)


def build_model(
    cfg: LPTrainConfig,
    factory: Optional[Any] = None,
    *,
    expert_model_parallel_rank: int = 0,
    expert_parallel_group: ProcessGroup = SINGLE_RANK,
    tensor_parallel_group: ProcessGroup = SINGLE_RANK,
    device: Union[str, torch.device, None] = None,
    part: Optional[ModelPart] = None,
    context_parallel: Optional[Any] = None,
) -> GPTModel:
    """Build the tagged ``GPTModel`` with every parameter and buffer on the run's device.

    ``device`` overrides ``run.device`` (see :func:`resolve_device`). Initial weights depend
    only on ``cfg.train.seed`` and each parameter's canonical name (see
    ``lptrain.model.init``), not on the device. Activations flow in
    :func:`compute_dtype_for` (bf16 on CUDA with bf16 params, fp32 otherwise).

    ``expert_model_parallel_rank`` selects which ``num_experts / EP`` experts this rank
    holds (``cfg.model.moe.expert_model_parallel_size``); their weights equal the same
    experts of a single-rank model; ``expert_parallel_group`` is the group of
    ``expert_model_parallel_size`` ranks the MoE layers exchange tokens over (needed to run
    a forward when EP > 1: the ``ep`` group of :func:`lptrain.distributed.groups.build_groups`).

    ``tensor_parallel_group`` (``model.tensor_model_parallel_size`` ranks: the ``tp`` group of
    ``build_groups``) makes this rank's tensor-parallel model through the parallelize step
    (:mod:`lptrain.model.tensor_parallel`; sequence parallel with ``model.sequence_parallel``):
    its shards equal the same slices of the single-rank model's weights.

    On the TE backend, layers built with fused wgrad accumulation
    (``train.gradient_accumulation_fusion``) read ``main_grad`` on each GEMM weight in their
    backward; the data-parallel engine installs it, as a view into its grad buffer. Nothing
    is allocated for it here: a zero fp32 ``main_grad`` per weight before the engine builds
    its buffer would hold 8 bytes per parameter at start-up (64 GB at 8B parameters). A
    backward outside the engine needs :func:`lptrain.precision.params.attach_main_grads`
    first. Emulated layers fuse only into a ``main_grad`` someone installed, so a model built
    here takes ordinary ``.grad`` gradients on the CPU.

    ``part`` (:class:`lptrain.model.gpt.ModelPart`) builds one pipeline rank's layers (their
    weights equal the same layers of the whole model: init depends on names only), the
    embedding on the first stage and the head on the last
    (:func:`lptrain.model.pipeline.model_part`); None builds the whole model.

    ``context_parallel`` (:class:`lptrain.model.context_parallel.ContextParallel`, from the
    ``cp`` groups of ``build_groups``) makes the model run on this rank's two chunks of each
    sequence (``model.context_parallel_size``): its weights are the single-rank ones, its
    attention exchanges keys and values over the CP group (:mod:`lptrain.model.context_parallel`).
    """
    if factory is None:
        factory = default_factory(cfg)
    dtype = getattr(factory, "params_dtype", None) or params_dtype_of(cfg.precision.params_dtype)
    ep = cfg.model.moe.expert_model_parallel_size if cfg.model.moe.num_experts else 1
    if not 0 <= expert_model_parallel_rank < ep:
        raise ValueError(f"expert_model_parallel_rank {expert_model_parallel_rank} not in [0, {ep})")
    tp = max(1, cfg.model.tensor_model_parallel_size)
    if tensor_parallel_group.size != tp:
        raise ValueError(
            f"model.tensor_model_parallel_size={tp} but the tensor-parallel group has "
            f"{tensor_parallel_group.size} rank(s); build the model with build_model(..., "
            "tensor_parallel_group=groups.tp) (lptrain.distributed.groups.build_groups(..., tp=TP)), "
            "as TrainEngine does"
        )
    target = _target_device(cfg, device)
    te_backend = getattr(factory, "backend", "emulated") == "te"
    if te_backend and target.type not in ("cuda", "meta"):
        raise DeviceError(
            f"precision.backend=te builds Transformer Engine layers on CUDA, but the model "
            f"device is {target}", key="run.device",
            fix="set run.device=auto (or cuda), or precision.backend=emulated",
        )
    ctx = BuildContext(
        cfg=cfg.model,
        factory=factory,
        seed=cfg.train.seed,
        params_dtype=dtype,
        expert_model_parallel_size=ep,
        expert_model_parallel_rank=expert_model_parallel_rank,
        expert_parallel_group=expert_parallel_group,
    )
    compute_dtype = compute_dtype_for(target, dtype)
    cp = max(1, cfg.model.context_parallel_size)
    if cp > 1 and (context_parallel is None or context_parallel.group.size != cp):
        raise ValueError(
            f"model.context_parallel_size={cp} but no context-parallel group of {cp} ranks was "
            "given; build the model with build_model(..., context_parallel=ContextParallel.of("
            "groups, cfg.model.cp_comm_type)) (lptrain.model.context_parallel), as TrainEngine does"
        )

    def construct() -> GPTModel:
        from dataclasses import replace

        c = ctx
        if cp > 1:
            from lptrain.model.context_parallel import ContextParallelFactory

            c = replace(ctx, factory=ContextParallelFactory(ctx.factory, context_parallel.group))
        if tp == 1:
            model = GPTModel(c, compute_dtype=compute_dtype, part=part)
        else:
            from lptrain.model.tensor_parallel import build_parallel

            model = build_parallel(c, tensor_parallel_group, cfg.model.sequence_parallel,
                                   compute_dtype=compute_dtype, part=part)
        model.factory = ctx.factory  # the run's own factory from here on
        if cp > 1:
            from lptrain.model.context_parallel import parallelize_context

            parallelize_context(model, context_parallel)
        return model

    with torch.device(target):
        model = construct()
    tag_parameters(model)
    if cfg.train.compile:  # after tagging: compiling wraps forwards, not parameters
        from lptrain.model.compile import compile_layers

        compile_layers(model)
    return model
