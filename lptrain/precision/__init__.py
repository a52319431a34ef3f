"""Low-precision emulation core: formats, scaling primitives, recipes, quantized tensors.

Pure PyTorch (CPU, fp32 math), bit-faithful to Transformer Engine's kernels as described in
/work/shared/reference/numerics.md. Importing this package never imports Transformer Engine.
The public contract is documented in docs/precision-interface.md.

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
    "build_factory",
    "quantize",
    "quantized_model_init",
    "recipe_from_config",
    "recipe_from_name",
]
