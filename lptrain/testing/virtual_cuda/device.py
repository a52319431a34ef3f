"""The virtual GPU itself: one context manager that patches, enters the two modes and counts."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any, Optional

import torch

from .labels import DeviceGenerator, DeviceRuleError, DeviceStats, caller, describe, tensors_in
from .patches import Patched, Patches, Props
from .placement import Placement, PlacementHandlers
from .rules import DispatchRules


class VirtualCuda(PlacementHandlers, Patches):
    """Context manager: while active, this process has one virtual CUDA GPU (see module doc).

    ``capability``: the compute capability ``torch.cuda.get_device_capability()`` reports
    (``(9, 0)`` an H100, ``(10, 0)`` a B200); ``name``: the device name (what the MFU table
    matches); ``stats``: the counters. Not re-entrant; one per process at a time.
    """

    _active: Optional[VirtualCuda] = None

    def __init__(self, capability: tuple[int, int] = (9, 0), name: str = "NVIDIA H100 80GB HBM3",
                 total_memory: int = 80 * 2**30, cuda_version: str = "12.9") -> None:
        self.capability = capability
        self.props = Props(name, capability[0], capability[1], total_memory)
        self.cuda_version = cuda_version
        self.stats = DeviceStats()
        self.violations: list[str] = []
        self.nccl_groups: set[Any] = set()
        self.scaled_gemms: list[Any] = []  # every scaled GEMM run (scaled_mm.ScaledGemmCall)
        # every grouped scaled GEMM run (scaled_grouped_mm.GroupedGemmCall)
        self.grouped_gemms: list[Any] = []
        self._undo: list[Callable[[], None]] = []
        self._modes: list[Any] = []
        self._checks_paused = 0
        self._ambient = threading.local()
        self.generator = DeviceGenerator()  # the device's default generator (CUDA RNG state)
        self.special = self.python_handlers()

    # -- rules ---------------------------------------------------------------------------------

    def violation(self, rule: str, func: Any, args: Any) -> None:
        if self._checks_paused:
            return
        operands = ", ".join(describe(t) for t in tensors_in(args)) or "no tensors"
        msg = f"virtual CUDA: {rule}: {func} on [{operands}] at {caller()}"
        self.violations.append(msg)
        raise DeviceRuleError(msg)

    def ambient(self) -> Optional[str]:
        """Where the innermost Python-level call of this thread places new tensors."""
        stack = getattr(self._ambient, "stack", None)
        return stack[-1] if stack else None

    def ambient_stack(self) -> list[str]:
        """This thread's stack of placements (innermost last), which :meth:`ambient` reads."""
        try:
            return self._ambient.stack
        except AttributeError:
            self._ambient.stack = []
            return self._ambient.stack

    def placed(self, where: str) -> _Placed:
        """Context: Python-level calls inside place new tensors at ``where``."""
        return _Placed(self.ambient_stack(), where)

    @contextlib.contextmanager
    def mode_active(self) -> Iterator[None]:
        """Inside a placement handler: the placement mode on again, for a function whose own
        torch-function check is skipped (``torch.autograd``'s, so it does not recurse)."""
        import torch.autograd as autograd_pkg

        saved = autograd_pkg.has_torch_function
        autograd_pkg.has_torch_function = lambda *a, **k: False
        torch.overrides._push_mode(self._modes[0])
        try:
            yield
        finally:
            torch.overrides._pop_mode()
            autograd_pkg.has_torch_function = saved

    def checks_paused(self) -> _ChecksPaused:
        """Context: the rules suspended (object collectives move their own pickles, as on
        NCCL; a counted host sync reads its scalar)."""
        return _ChecksPaused(self)

    # -- context -------------------------------------------------------------------------------

    def __enter__(self) -> VirtualCuda:
        if VirtualCuda._active is not None:
            raise RuntimeError("a virtual CUDA device is already active in this process")
        if torch.cuda.is_available() and not isinstance(torch.cuda.is_available, Patched):
            raise RuntimeError("a real CUDA device is present: use it instead of the virtual one")
        VirtualCuda._active = self
        self._patch_cuda()
        self._patch_wrapper_subclass()
        self._patch_checkpoint_metadata()
        self._patch_distributed()
        self._modes = [Placement(self), DispatchRules(self)]
        for m in self._modes:
            m.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        for m in reversed(self._modes):
            m.__exit__(None, None, None)
        self._modes = []
        for undo in reversed(self._undo):
            undo()
        self._undo = []
        VirtualCuda._active = None


class _Placed:
    """:meth:`VirtualCuda.placed` (a class, not a generator context: it is entered for
    every Python-level torch call)."""

    __slots__ = ("stack", "where")

    def __init__(self, stack: list[str], where: str) -> None:
        self.stack = stack
        self.where = where

    def __enter__(self) -> None:
        self.stack.append(self.where)

    def __exit__(self, *exc: object) -> None:
        self.stack.pop()


class _ChecksPaused:
    __slots__ = ("vd",)

    def __init__(self, vd: VirtualCuda) -> None:
        self.vd = vd

    def __enter__(self) -> None:
        self.vd._checks_paused += 1

    def __exit__(self, *exc: object) -> None:
        self.vd._checks_paused -= 1


def active() -> Optional[VirtualCuda]:
    """The virtual device of this process, if one is active."""
    return VirtualCuda._active
