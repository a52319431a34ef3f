"""What the extension reports about the GPU and its libraries, for the virtual GPU."""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

# the library versions a current TE container ships (what TE's version gates compare against)
CUBLASLT_VERSION = 130100  # cuBLASLt 13.1
CUDNN_VERSION = 91300  # cuDNN 9.13 (encoded as cudnnGetVersion())


def functions(tex: types.ModuleType, version: tuple[int, ...]) -> dict[str, Callable[..., Any]]:
    return {
        "get_cublasLt_version": lambda: CUBLASLT_VERSION,
        "get_cudnn_version": lambda: CUDNN_VERSION,
        "get_num_cublas_streams": lambda: 4,
        "get_stream_priority_range": lambda *a: (0, -5),
        "device_supports_multicast": lambda *a: False,
        "ubuf_built_with_mpi": lambda: False,
    }
