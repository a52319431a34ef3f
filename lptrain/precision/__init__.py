"""Low-precision emulation core: formats, scaling primitives, recipes, quantized tensors.

Pure PyTorch (CPU, fp32 math, never fp64), bit-faithful to Transformer Engine's kernels: the
quantized bytes, scales and amaxes equal TE's (stochastic-rounding bits and GEMM outputs
excepted). The math it follows (formats, scale computations, rounding, the section labels
such as P3 or 2.5 cited in the modules) is specified in docs/numerics.md; the public contract
is docs/precision-interface.md. Importing this package never imports Transformer Engine.

Also re-exported: the layer-level API of the ops modules (``quantized_model_init``,
``build_factory``, ``recipe_from_config``, ``LayerFactory``). The ``autocast`` *function* is
not: the name would shadow the ``lptrain.precision.autocast`` submodule, which the ops modules
import as a module; use ``lptrain.precision.autocast.autocast``.
"""

from .api import quantize
from .autocast import quantized_model_init
from .factory import build_factory, recipe_from_config
from .formats import E4M3, E5M2, Format, FP8Format
from .layers import LayerFactory
from .params import attach_main_grads, master_weight_init
from .recipes import (
    RECIPES,
    BlockwiseScaling,
    DelayedScaling,
    DelayedScalingState,
    MXFP8Scaling,
    NVFP4Scaling,
    Recipe,
    TensorwiseScaling,
    recipe_from_name,
)
from .tensors import (
    BlockwiseFP8Tensor,
    BlockwiseQuantizer,
    Float8Quantizer,
    Float8Tensor,
    GroupedQuantizedTensor,
    MXFP8Quantizer,
    MXFP8Tensor,
    NVFP4Quantizer,
    NVFP4Tensor,
    QuantizedTensor,
    Quantizer,
    Role,
)

__all__ = [
    "E4M3",
    "E5M2",
    "RECIPES",
    "BlockwiseFP8Tensor",
    "BlockwiseQuantizer",
    "BlockwiseScaling",
    "DelayedScaling",
    "DelayedScalingState",
    "FP8Format",
    "Float8Quantizer",
    "Float8Tensor",
    "Format",
    "GroupedQuantizedTensor",
    "LayerFactory",
    "MXFP8Quantizer",
    "MXFP8Scaling",
    "MXFP8Tensor",
    "NVFP4Quantizer",
    "NVFP4Scaling",
    "NVFP4Tensor",
    "QuantizedTensor",
    "Quantizer",
    "Recipe",
    "Role",
    "TensorwiseScaling",
    "attach_main_grads",
    "build_factory",
    "master_weight_init",
    "quantize",
    "quantized_model_init",
    "recipe_from_config",
    "recipe_from_name",
]
