"""Deterministic, layout- and world-size-independent parameter initialisation.

Every parameter (and every expert member of a grouped parameter) draws its initial values
from its own CPU generator, seeded by a hash of ``(train.seed, canonical name)``. The
canonical name is the per-expert checkpoint key (see ``state_dict_adapter``), e.g.
``layers.3.mlp.experts.linear_fc1.weight.5`` for expert 5 (global index) of layer 3. So the
initial weights do not depend on the order in which modules are built, on the global RNG
state, on whether experts are stored as one grouped tensor or as discrete tensors, or on how
experts are split over expert-parallel ranks. Values are drawn in fp32 on the CPU and cast
once into the storage dtype (``copy_``), so bf16 and fp32 runs round the same numbers.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable

import torch

InitMethod = Callable[[torch.Tensor], None]


def param_seed(seed: int, name: str) -> int:
    """A 63-bit generator seed derived from the run seed and a canonical parameter name."""
    digest = hashlib.sha256(f"{int(seed)}/{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def init_values(seed: int, name: str, shape: tuple[int, ...] | torch.Size, std: float) -> torch.Tensor:
    """The fp32 CPU values of N(0, std^2) that parameter ``name`` starts from."""
    gen = torch.Generator(device="cpu")
    gen.manual_seed(param_seed(seed, name))
    # device="cpu" explicitly: models are built under ``torch.device(run device)``, and the
    # values must not depend on it.
    return torch.randn(tuple(shape), generator=gen, dtype=torch.float32, device="cpu") * std


def named_normal_init(seed: int, name: str, std: float) -> InitMethod:
    """An in-place init method for the single tensor with canonical name ``name``."""

    @torch.no_grad()
    def init(t: torch.Tensor) -> None:
        if t.is_meta:  # shapes only (dry run, memory planner): no values to draw
            return
        t.copy_(init_values(seed, name, t.shape, std))

    return init


def grouped_normal_init(seed: int, name: str, std: float, expert_offset: int = 0) -> InitMethod:
    """Init method for a grouped (per-expert) weight whose canonical keys are ``name.{e}``.

    Accepts either the whole grouped tensor ``[num_gemms, out, in]`` (filled member by
    member) or one member ``[out, in]`` per call, in member order -- the factory's
    ``GroupedLinear`` calls it once per member. ``expert_offset`` is the global index of
    local member 0 (expert parallelism).
    """
    calls = [0]

    @torch.no_grad()
    def init(t: torch.Tensor) -> None:
        if t.is_meta:  # shapes only (dry run, memory planner): no values to draw
            calls[0] += 1 if t.dim() != 3 else 0
            return
        if t.dim() == 3:
            for i in range(t.shape[0]):
                t[i].copy_(init_values(seed, f"{name}.{expert_offset + i}", t.shape[1:], std))
            return
        t.copy_(init_values(seed, f"{name}.{expert_offset + calls[0]}", t.shape, std))
        calls[0] += 1

    return init


@torch.no_grad()
def fill_(t: torch.Tensor, value: float) -> None:
    """Constant init (norm weights: 1, biases: 0); trivially layout independent."""
    t.fill_(value)
