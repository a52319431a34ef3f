"""The world a config is checked against: data-parallel size, GPU generation, TE version.

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

TARGETS: tuple[str, ...] = ("cpu", "sm89", "sm90", "sm100")
# When checking for a cluster (--target given), Transformer Engine is assumed present at
# this version unless --te-version says otherwise: recent enough for every recipe.
ASSUMED_TE_VERSION = "2.14"
_TE_DISTRIBUTIONS = ("transformer_engine", "transformer-engine", "transformer_engine_torch")


@dataclass(frozen=True)
class World:
    """Facts about where the run happens that rules may depend on."""

    dp: int = 1
    target: str = "cpu"
    te_version: Optional[str] = None
    cuda: bool = False

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
    ) -> World:
        """Explicit values win; the rest comes from the environment.

        A given GPU ``target`` means "checking for a cluster": CUDA is assumed present and
        Transformer Engine at ``te_version`` or :data:`ASSUMED_TE_VERSION`.
        """
        if dp is None:
            dp = _env_int("WORLD_SIZE", 1)
        if target is not None:
            if target not in TARGETS:
                raise ValueError(f"unknown target {target!r}; choose from {', '.join(TARGETS)}")
            if target == "cpu":
                return cls(dp=dp, target="cpu", te_version=te_version, cuda=False)
            return cls(dp=dp, target=target, te_version=te_version or ASSUMED_TE_VERSION, cuda=True)
        env_target = _detect_gpu_target()
        installed = te_version or installed_te_version()
        if env_target is None:
            return cls(dp=dp, target="cpu", te_version=installed, cuda=False)
        return cls(dp=dp, target=env_target, te_version=installed, cuda=True)


def sm_number(target: str) -> int:
    m = re.fullmatch(r"sm_?(\d+)", target)
    return int(m.group(1)) if m else 0


def parse_version(text: str) -> tuple[int, ...]:
    """'2.14.0.dev0+abc' -> (2, 14, 0); non-numeric tails are ignored."""
    out: list[int] = []
    for part in text.split("+")[0].split("."):
        m = re.match(r"\d+", part)
        if not m:
            break
        out.append(int(m.group(0)))
    return tuple(out)


def installed_te_version() -> Optional[str]:
    for dist in _TE_DISTRIBUTIONS:
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
