"""The world a config is checked against: data-parallel size, GPU generation, CUDA and TE versions.

Read from the running environment, or given explicitly (``--dp``, ``--target``,
``--te-version``) so a config can be checked for a cluster from a laptop. Detection avoids
importing torch when there is visibly no NVIDIA driver, to keep ``validate-config`` fast.
"""

from __future__ import annotations

import importlib.metadata
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from lptrain.catalog.recipes import parse_version  # noqa: F401  (re-exported: the rules' version parser)

TARGETS: tuple[str, ...] = ("cpu", "sm89", "sm90", "sm100", "sm120")
# When checking for a cluster (--target given), the newest stack lptrain is checked against
# is assumed unless --te-version / --cuda-version say otherwise: Transformer Engine 2.19
# (every recipe and feature lptrain uses; see the TE facts in lptrain.catalog.recipes) and
# CUDA 13.3 with its cuBLAS, which TE 2.19's grouped-tensor GEMM path (single grouped expert
# weights) needs; blockwise FP8 needs 12.9.
ASSUMED_TE_VERSION = "2.19"
ASSUMED_CUDA_VERSION = "13.3"
_TE_DISTRIBUTIONS = ("transformer_engine", "transformer-engine", "transformer_engine_torch")
_CUBLAS_DISTRIBUTIONS = ("nvidia-cublas", "nvidia-cublas-cu13", "nvidia-cublas-cu12")


@dataclass(frozen=True)
class World:
    """Facts about where the run happens that rules may depend on."""

    dp: int = 1
    target: str = "cpu"
    te_version: Optional[str] = None
    cuda: bool = False
    # The CUDA version torch was built with ("12.9"); None when unknown or without CUDA.
    cuda_version: Optional[str] = None
    # The cuBLAS(Lt) release TE links against, where known apart from CUDA (a pip
    # ``nvidia-cublas`` wheel); None: the one shipped with ``cuda_version``.
    cublas_version: Optional[str] = None

    @property
    def cublaslt_version(self) -> Optional[str]:
        """The cuBLASLt version TE's GEMMs would see (cuBLAS ships with its CUDA toolkit)."""
        return self.cublas_version or self.cuda_version

    @property
    def sm(self) -> int:
        """Compute capability as an int (sm90 -> 90); 0 for cpu."""
        return sm_number(self.target)

    @classmethod
    def detect(
        cls,
        dp: Optional[int] = None,
        target: Optional[str] = None,
        te_version: Optional[str] = None,
        cuda_version: Optional[str] = None,
    ) -> World:
        """Explicit values win; the rest comes from the environment.

        A given GPU ``target`` means "checking for a cluster": CUDA is assumed present at
        ``cuda_version`` or :data:`ASSUMED_CUDA_VERSION`, and Transformer Engine at
        ``te_version`` or :data:`ASSUMED_TE_VERSION`. ``cuda_version`` also checks this
        machine as if its CUDA (and cuBLAS) were that version.
        """
        if dp is None:
            dp = _env_int("WORLD_SIZE", 1)
        if te_version is not None:
            te_version = check_version(te_version)
        if target is not None:
            if target not in TARGETS:
                raise ValueError(f"unknown target {target!r}; choose from {', '.join(TARGETS)}")
            if target == "cpu":
                return cls(dp=dp, target="cpu", te_version=te_version, cuda=False)
            return cls(dp=dp, target=target, te_version=te_version or ASSUMED_TE_VERSION, cuda=True,
                       cuda_version=cuda_version or ASSUMED_CUDA_VERSION)
        env_target = _detect_gpu_target()
        installed = te_version or installed_te_version()
        if env_target is None:
            return cls(dp=dp, target="cpu", te_version=installed, cuda=False)
        return cls(dp=dp, target=env_target, te_version=installed, cuda=True,
                   cuda_version=cuda_version or _torch_cuda_version(),
                   cublas_version=None if cuda_version else installed_cublas_version())


def sm_number(target: str) -> int:
    m = re.fullmatch(r"sm_?(\d+)", target)
    return int(m.group(1)) if m else 0


_VERSION_RE = re.compile(r"\d+(\.\d+)*([.-]?(a|b|rc|dev|post)\d*)*(\+[0-9A-Za-z.]+)?")  # PEP 440-ish


def check_version(text: str, key: str = "--te-version") -> str:
    """``text`` stripped, or :class:`ConfigError` when it is not a version (``--te-version
    banana`` would otherwise compare as the empty tuple, older than every real version)."""
    from lptrain.config.errors import ConfigError

    value = str(text).strip()
    if not _VERSION_RE.fullmatch(value):
        what = "a CUDA version such as 13.3 or 12.9" if key == "--cuda-version" else (
            "a Transformer Engine version such as 2.14 or 2.8.0")
        raise ConfigError(f"{key} {text!r} is not a version number", key=key, fix=f"give {what}")
    return value


def installed_te_version() -> Optional[str]:
    for dist in _TE_DISTRIBUTIONS:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def installed_cublas_version() -> Optional[str]:
    """The version of a pip-installed cuBLAS wheel, if any (NVIDIA's containers install
    cuBLAS with the toolkit instead: then None, and the CUDA version stands for it)."""
    for dist in _CUBLAS_DISTRIBUTIONS:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def _env_int(name: str, default: int) -> int:
    try:
        return int(os.environ.get(name, default))
    except ValueError:
        return default


def _torch_cuda_version() -> Optional[str]:
    """``torch.version.cuda`` ("12.9"), or None (CPU build, or torch unimportable)."""
    try:
        import torch

        return torch.version.cuda
    except Exception:
        return None


def _detect_gpu_target() -> Optional[str]:
    """'sm90' etc. for the local GPU, or None. Imports torch only if a driver is visible."""
    if not (Path("/dev/nvidiactl").exists() or shutil.which("nvidia-smi")):
        return None
    try:
        import torch

        if not torch.cuda.is_available():
            return None
        major, minor = torch.cuda.get_device_capability()
    except Exception:
        return None
    return f"sm{major * 10 + minor}"
