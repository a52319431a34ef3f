"""``quantize``: the one-call entry point used by tests, tools and the ops layer."""

from __future__ import annotations

from typing import Any, Optional

import torch

from .formats import Format
from .recipes import RECIPES, Recipe
from .tensors import QuantizedTensor, Role


def quantize(
    x: torch.Tensor,
    recipe: str | Recipe,
    *,
    role: Role = "input",
    rowwise: bool = True,
    columnwise: bool = True,
    fp8_format: Optional[str] = None,
    **recipe_options: Any,
) -> QuantizedTensor:
    """Quantize ``x`` for ``role`` with a recipe given by name or object.

    With a name, ``fp8_format`` defaults to "e4m3" and ``recipe_options`` are that recipe's
    fields plus quantizer options (``state`` for delayed, ``amax_reduction`` for tensorwise,
    ``block_scaling_dim`` for blockwise, ``rht``/``stochastic_rounding``/``two_d``/
    ``generator``/``seed`` for nvfp4, where RHT and SR default off). With a Recipe object the
    recipe's own fields are used and only quantizer options may be passed.
    """
    if isinstance(recipe, str):
        try:
            cls = RECIPES[recipe]
        except KeyError:
            raise ValueError(f"unknown recipe {recipe!r}; known: {sorted(RECIPES)}") from None
        quantizer = cls.quantizer_from_options(
            role, rowwise, columnwise, fp8_format or "e4m3", **recipe_options
        )
    elif isinstance(recipe, Recipe):
        if fp8_format is not None and Format.parse(fp8_format) is not recipe.fp8_format:
            raise ValueError(
                f"fp8_format={fp8_format!r} conflicts with the recipe's {recipe.fp8_format.value!r}"
            )
        allowed = type(recipe).QUANTIZER_OPTIONS
        extra = sorted(set(recipe_options) - set(allowed))
        if extra:
            raise TypeError(f"options {extra} are recipe fields; set them on the Recipe object")
        quantizer = recipe.make_quantizer(role, rowwise, columnwise, **recipe_options)
    else:
        raise TypeError(f"recipe must be a name or a Recipe, got {type(recipe).__name__}")
    return quantizer.quantize(x)
