"""The random streams a model's quantizers draw from (NVFP4 stochastic rounding), by name.

A quantizer with stochastic rounding owns a ``torch.Generator`` (seeded from the recipe's
``seed``, which the engine sets per rank) that advances every time it quantizes. A resumed
run continues bitwise only if those generators continue where they stopped, so checkpoints
save and restore their states; this module is the one place that knows where they live
(``QuantState`` members of each quantized layer), so the checkpoint code stays format-free.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from lptrain.precision.linear_ops import QuantState


def _recipe_has_generators(recipe: Any) -> bool:
    probe = QuantState(recipe, 1)  # throwaway: tells whether this recipe's quantizers draw bits
    return any(
        isinstance(getattr(q, "generator", None), torch.Generator)
        for m in probe.members
        for q in (m.input, m.weight, m.grad)
    )


def rng_generators(model: torch.nn.Module, recipe: Optional[Any] = None) -> dict[str, torch.Generator]:
    """``{"<module>/<member>.<role>": generator}`` for every quantizer that owns one.

    Quantizers are created lazily at a layer's first forward; with ``recipe`` (the factory's
    recipe), every quantized layer's quantizers for it are created now -- and only when the
    recipe's quantizers carry generators at all, so stateful recipes (delayed scaling) are
    left untouched. Creating them early changes nothing numerically: a generator is seeded
    at creation and only advances when it quantizes, so a freshly built model can receive a
    checkpoint's generator states before its first step.
    """
    if recipe is not None and _recipe_has_generators(recipe):
        for mod in model.modules():
            if callable(getattr(mod, "quant_state", None)) and hasattr(mod, "_qstates"):
                mod.quant_state(recipe)
    out: dict[str, torch.Generator] = {}
    for name, mod in model.named_modules():
        states = getattr(mod, "_qstates", None)
        if not isinstance(states, dict):
            continue
        for st in states.values():
            if recipe is not None and st.recipe is not recipe:
                continue
            for i, m in enumerate(st.members):
                for role in ("input", "weight", "grad"):
                    gen = getattr(getattr(m, role), "generator", None)
                    if isinstance(gen, torch.Generator):
                        out[f"{name}/{i}.{role}"] = gen
    return out


def rng_states(model: torch.nn.Module, recipe: Optional[Any] = None) -> dict[str, torch.Tensor]:
    """``get_state()`` of every generator of :func:`rng_generators` (for a checkpoint)."""
    return {k: g.get_state() for k, g in rng_generators(model, recipe).items()}


def load_rng_states(
    model: torch.nn.Module, states: dict[str, torch.Tensor], recipe: Optional[Any] = None
) -> None:
    """Restore :func:`rng_states`; the names must match (same model, recipe and rank layout)."""
    gens = rng_generators(model, recipe)
    if gens.keys() != states.keys():
        missing = sorted(set(states) ^ set(gens))[:3]
        raise ValueError(f"quantizer RNG streams do not match the checkpoint's (e.g. {missing})")
    for k, g in gens.items():
        g.set_state(states[k])
