"""What the extension reports about the GPU and its libraries, for the virtual GPU."""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

# cuDNN of a current TE container (what TE's version gates compare against)
CUDNN_VERSION = 91300  # cuDNN 9.13 (encoded as cudnnGetVersion())


def cublaslt_version() -> int:
    """``cublasLtGetVersion()`` of the cuBLAS shipped with the (virtual) GPU's CUDA:
    ``torch.version.cuda`` "13.3" -> 130300 (TE's grouped-tensor path and FP8 gates compare
    against it)."""
    import torch

    parts = [int(p) for p in (torch.version.cuda or "13.1").split(".")[:3] if p.isdigit()]  # no GPU: 13.1
    major, minor, patch = [*parts, 0, 0, 0][:3]
    return major * 10000 + minor * 100 + patch


def functions(tex: types.ModuleType, version: tuple[int, ...]) -> dict[str, Callable[..., Any]]:
    return {
        "get_cublasLt_version": cublaslt_version,
        "get_cudnn_version": lambda: CUDNN_VERSION,
        "get_num_cublas_streams": lambda: 4,
        "get_stream_priority_range": lambda *a: (0, -5),
        "device_supports_multicast": lambda *a: False,
        "ubuf_built_with_mpi": lambda: False,
    }
