"""The world a config is checked against: data-parallel size, GPU generation, CUDA and TE versions.

Read from the running environment, or given explicitly (``--dp``, ``--target``,
``--te-version``) so a config can be checked for a cluster from a laptop. Detection avoids
importing torch when there is visibly no NVIDIA driver, to keep ``validate-config`` fast.

A world is known either by its data-parallel size (``--dp N``: the world is then
``tensor x context x pipeline x N`` ranks) or by its rank count (``$WORLD_SIZE`` of a launched
rank, ``--nproc-per-node``: the data-parallel size is then ``ranks / (TP x CP x PP)``).
:meth:`World.for_config` settles the other number from the config's parallel sizes; the
checker and ``derive`` call it, so every rule reads ``world.dp`` as the data-parallel size and
``world.ranks`` as the world size (:mod:`lptrain.catalog.parallel_dims` has the arithmetic).
"""

from __future__ import annotations

import importlib.metadata
import os
import re
import shutil
from dataclasses import dataclass, replace
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

    dp: int = 1  # data-parallel size
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
    # Total ranks when the launch fixes them ($WORLD_SIZE, --nproc-per-node); None: model-
    # parallel sizes x dp (set by for_config).
    ranks: Optional[int] = None
    # Ranks that hold one model copy (TP x PP), set by for_config.
    model_parallel: int = 1
    # The rank count follows the model-parallel sizes (a --dp world), set by for_config; else
    # the launch fixed it (--nproc-per-node, $WORLD_SIZE) and dp follows.
    ranks_from_dp: bool = False
    # What sets the rank count of a launch (a fix that asks for more ranks names it).
    launcher: str = "--nproc-per-node"

    @property
    def world_size(self) -> int:
        """Total ranks (known after :meth:`for_config`; ``dp`` before it)."""
        return self.ranks if self.ranks is not None else self.dp

    def for_config(self, cfg: object) -> World:
        """This world with both sizes settled for ``cfg``'s model-parallel sizes (idempotent):
        a known rank count gives ``dp = ranks / (TP x CP x PP)`` (rounded down;
        LAUNCH-TP-DIVIDES-WORLD, LAUNCH-CP-DIVIDES-WORLD and LAUNCH-PP-DIVIDES-WORLD report a
        remainder), a known ``dp`` gives ``ranks = TP x CP x PP x dp``."""
        mp = model_parallel_size(cfg)
        if self.ranks is None or self.ranks_from_dp:
            return replace(self, ranks=self.dp * mp, model_parallel=mp, ranks_from_dp=True)
        return replace(self, dp=max(1, self.ranks // mp), model_parallel=mp)

    def describe(self) -> str:
        """The sizes a report's header names: ``dp N``, and the rank count where model
        parallelism makes it differ; a rank count that ``TP x PP`` does not divide has no
        data-parallel size, and is said so instead of a rounded-down one."""
        if self.ranks is not None and self.ranks % self.model_parallel:
            return f"{self.ranks} ranks, not a multiple of TP x PP = {self.model_parallel}"
        if self.ranks is not None and self.ranks != self.dp:
            return f"dp {self.dp}, {self.ranks} ranks"
        return f"dp {self.dp}"

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
        ranks: Optional[int] = None,
    ) -> World:
        """Explicit values win; the rest comes from the environment.

        ``dp`` is the data-parallel size (``--dp``), ``ranks`` the total rank count of a
        launch (``--nproc-per-node``); with neither, ``$WORLD_SIZE`` (a launched rank) gives
        the rank count, else one data-parallel rank.
        A given GPU ``target`` means "checking for a cluster": CUDA is assumed present at
        ``cuda_version`` or :data:`ASSUMED_CUDA_VERSION`, and Transformer Engine at
        ``te_version`` or :data:`ASSUMED_TE_VERSION`. ``cuda_version`` also checks this
        machine as if its CUDA (and cuBLAS) were that version.
        """
        if dp is None and ranks is None and "WORLD_SIZE" in os.environ:
            ranks = _env_int("WORLD_SIZE", 1)
        sizes = {"dp": dp or 1, "ranks": ranks if dp is None else None}
        if te_version is not None:
            te_version = check_version(te_version)
        if target is not None:
            if target not in TARGETS:
                raise ValueError(f"unknown target {target!r}; choose from {', '.join(TARGETS)}")
            if target == "cpu":
                return cls(target="cpu", te_version=te_version, cuda=False, **sizes)
            return cls(target=target, te_version=te_version or ASSUMED_TE_VERSION,
                       cuda=True, cuda_version=cuda_version or ASSUMED_CUDA_VERSION, **sizes)
        env_target = _detect_gpu_target()
        installed = te_version or installed_te_version()
        if env_target is None:
            return cls(target="cpu", te_version=installed, cuda=False, **sizes)
        return cls(target=env_target, te_version=installed, cuda=True,
                   cuda_version=cuda_version or _torch_cuda_version(),
                   cublas_version=None if cuda_version else installed_cublas_version(), **sizes)


def model_parallel_size(cfg: object) -> int:
    """Ranks that train one data-parallel replica between them: tensor x context x pipeline
    parallel size (context-parallel ranks hold the same weights but split each sequence)."""
    model = getattr(cfg, "model", None)
    tp = max(1, int(getattr(model, "tensor_model_parallel_size", 1) or 1))
    cp = max(1, int(getattr(model, "context_parallel_size", 1) or 1))
    pp = max(1, int(getattr(model, "pipeline_model_parallel_size", 1) or 1))
    return tp * cp * pp


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
