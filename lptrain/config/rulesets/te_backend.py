"""Would Transformer Engine run this config in this world? The checks the precision rules
apply to ``precision.backend=te`` (GPU generation, CUDA and TE versions, activations, device)
and that :func:`auto_backend` uses to pick TE for ``backend=auto`` only when none fires."""

from __future__ import annotations

from typing import Any

from lptrain.catalog.optimizer_state import BF16_MOMENTS_MIN_TE, STATE_KEYS
from lptrain.catalog.recipes import (
    GROUPED_AMAX_EPSILON_MIN_TE,
    SINGLE_GROUPED_WEIGHT_MIN_TE,
    TE_MIN_VERSION,
)
from lptrain.config.rules import (
    fp4_on,
    get_key,
    is_mxfp8,
    quant_recipe,
    quant_spec,
    recipe_key,
    runs,
)
from lptrain.config.schema import LPTrainConfig
from lptrain.config.world import World, parse_version

# Each ``te_*`` check below answers "would Transformer Engine refuse this config in this
# world?" regardless of precision.backend; the rules apply them to backend=te, and
# :func:`auto_backend` uses the same checks to pick TE for backend=auto only when none fires.


def te_sm_too_old(c: LPTrainConfig, w: World) -> dict[str, Any]:
    spec = quant_spec(c)
    if not w.cuda or spec is None or w.sm >= spec.min_sm:
        return {}
    return {"keys": ("precision.backend", recipe_key(c)), "recipe": spec.name,
            "need": f"sm{spec.min_sm}"}


def te_sm_excluded(c: LPTrainConfig, w: World) -> dict[str, Any]:
    """The recipe in use is one TE refuses from some compute capability on, and ``w`` has it."""
    spec = quant_spec(c)
    if spec is None or not runs(c, spec) or spec.unsupported_from_sm is None:
        return {}
    if not (w.cuda and w.sm >= spec.unsupported_from_sm):
        return {}
    return {"keys": ("precision.backend", spec.keys.recipe_key)}


def te_mxfp8_sm120(c: LPTrainConfig, w: World) -> dict[str, Any]:
    return te_sm_excluded(c, w) if is_mxfp8(c) else {}


def te_cuda_too_old(c: LPTrainConfig, w: World) -> dict[str, Any]:
    spec = quant_spec(c)
    if spec is None or not runs(c, spec) or spec.min_cuda is None:
        return {}
    if not (w.cuda and w.cuda_version) or parse_version(w.cuda_version) >= parse_version(spec.min_cuda):
        return {}
    return {"keys": ("precision.backend", spec.keys.recipe_key), "need": spec.min_cuda,
            "recipe": spec.name, "family": spec.family.upper()}


def te_version_needs(c: LPTrainConfig, w: World) -> list[tuple[str, str, str]]:
    """``(key, reason, minimum)`` for every feature the TE version ``w.te_version`` lacks."""
    if w.te_version is None:
        return []
    have = parse_version(w.te_version)
    needs: list[tuple[str, str, str]] = []

    def need(key: str, what: str, version: str) -> None:
        if have < parse_version(version):
            needs.append((key, f"{what} needs TE >= {version}", version))

    need("precision.backend", "lptrain's TE backend", TE_MIN_VERSION)
    o = c.optimizer
    for key in STATE_KEYS:
        if o.use_precision_aware_optimizer and get_key(c, key) == "bf16":
            need(key, "bf16 Adam moments (FusedAdam exp_avg_dtype / exp_avg_sq_dtype=bf16)",
                 BF16_MOMENTS_MIN_TE)
    spec = quant_spec(c)
    if spec is not None:
        need(recipe_key(c), spec.name, spec.min_te)
        for sm, version in spec.min_te_from_sm:
            if w.sm >= sm:
                need(spec.keys.recipe_key, f"{spec.name} on {w.target}", version)
    moe = c.model.moe
    if (spec is not None and spec.current_amax and c.precision.amax_epsilon > 0
            and moe.num_experts > 0 and (moe.grouped_gemm or moe.single_grouped_weight)):
        need("precision.amax_epsilon", "amax_epsilon in grouped expert GEMMs",
             GROUPED_AMAX_EPSILON_MIN_TE)
    if moe.single_grouped_weight:
        need("model.moe.single_grouped_weight",
             "single_grouped_weight (up to 2.18 TE's GEMMs use the grouped weight's members, which "
             "get no gradient; or set model.moe.single_grouped_weight=false)",
             SINGLE_GROUPED_WEIGHT_MIN_TE)
    return needs


def te_rht_needs_bf16(c: LPTrainConfig, w: World) -> bool:
    return fp4_on(c) and c.precision.nvfp4_rht and c.precision.params_dtype != "bf16"


def te_device_cpu(c: LPTrainConfig, w: World) -> bool:
    return c.run.device == "cpu"


def te_refusals(c: LPTrainConfig, w: World) -> list[str]:
    """Why TE could not run ``c`` in ``w`` (empty: it can), whatever precision.backend says."""
    out = []
    if not w.cuda:
        out.append("no CUDA device")
    elif w.te_version is None:
        out.append("Transformer Engine is not installed")
    if te_device_cpu(c, w):
        out.append("run.device=cpu")
    if te_sm_too_old(c, w) or te_sm_excluded(c, w):
        out.append(f"{quant_recipe(c)} is not supported on {w.target}")
    cuda = te_cuda_too_old(c, w)
    if cuda:
        out.append(f"{cuda['recipe']} needs CUDA >= {cuda['need']}")
    out.extend(n[1] for n in te_version_needs(c, w))
    from lptrain.config.rulesets.moe import te_grouped_path_refusal

    grouped = te_grouped_path_refusal(c, w)
    if grouped:
        out.append(f"TE's grouped-tensor path for single_grouped_weight {grouped}")
    if te_rht_needs_bf16(c, w):
        out.append("NVFP4 RHT needs bf16 activations")
    return out


def auto_backend(c: LPTrainConfig, w: World) -> str:
    """What ``precision.backend=auto`` runs: ``te`` only for a quantized recipe that TE
    supports here (GPU generation, CUDA and TE versions), else ``emulated`` -- which for an
    unquantized run is plain PyTorch GEMMs (native bf16 on CUDA, fp32 on CPU)."""
    if quant_recipe(c) is None or te_refusals(c, w):
        return "emulated"
    return "te"


def te_only(check: Any) -> Any:
    """A rule predicate applying ``check`` to backend=te configs only."""

    def when(c: LPTrainConfig, w: World) -> Any:
        return check(c, w) if c.precision.backend == "te" else {}

    return when


def te_too_old(c: LPTrainConfig, w: World) -> dict[str, Any]:
    if c.precision.backend != "te":
        return {}
    needs = te_version_needs(c, w)
    if not needs:
        return {}
    best = max((n[2] for n in needs), key=parse_version)
    keys = tuple(dict.fromkeys(("precision.backend", *(n[0] for n in needs))))
    return {"keys": keys, "detail": "; ".join(n[1] for n in needs), "need": best}


def backend_missing(c: LPTrainConfig, w: World) -> dict[str, Any]:
    if c.precision.backend != "te":
        return {}
    if not w.cuda:
        return {"missing": "there is no CUDA device"}
    if w.te_version is None:
        return {"missing": "Transformer Engine is not installed"}
    return {}
