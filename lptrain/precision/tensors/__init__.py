"""Quantized tensor families: one module per family plus the shared base and the grouped form."""

from .base import QuantizedTensor, Quantizer, Role, flatten_2d
from .blockwise import BlockwiseFP8Tensor, BlockwiseQuantizer
from .float8 import Float8Quantizer, Float8Tensor
from .grouped import GroupedQuantizedTensor
from .mxfp8 import MXFP8Quantizer, MXFP8Tensor
from .nvfp4 import NVFP4Quantizer, NVFP4Tensor

__all__ = [
    "BlockwiseFP8Tensor",
    "BlockwiseQuantizer",
    "Float8Quantizer",
    "Float8Tensor",
    "GroupedQuantizedTensor",
    "MXFP8Quantizer",
    "MXFP8Tensor",
    "NVFP4Quantizer",
    "NVFP4Tensor",
    "QuantizedTensor",
    "Quantizer",
    "Role",
    "flatten_2d",
]
