"""Per-thread scratch for the chunked quantization kernels, and their cached scalar operands.

Both exist for the CPU emulation's host cost: chunk-sized temporaries that are reused
instead of page-faulted in on every call (:class:`Workspace`), and scalar operands that are
not wrapped into a fresh tensor on every call (:func:`operand`). Neither changes a value.
"""

from __future__ import annotations

import threading

import torch

_CPU_OPERANDS: dict[tuple[str, torch.dtype], torch.Tensor] = {}


def host_shortcuts(t: torch.Tensor) -> bool:
    """Whether an op on ``t`` may take the CPU-only shortcuts: reading a value back to skip a
    pass that cannot change anything, table gathers, Python-float scale set-up. Only on the
    CPU in eager mode: under ``torch.compile`` (``train.compile``) a value read back would
    break the graph, so the device path runs there -- the same bits by construction (the
    shortcuts and the device path are tested against each other on the virtual GPU)."""
    return t.device.type == "cpu" and not torch.compiler.is_compiling()


def operand(value: float | int, like: torch.Tensor) -> torch.Tensor | float | int:
    """``value`` as the scalar operand of a binary op on ``like``: on the CPU a cached 0-dim
    tensor of ``like``'s dtype, elsewhere the Python number itself.

    Why: torch wraps a Python scalar operand into a fresh tensor and converts it on every
    call (four dispatcher ops, ~2.5 us against ~1 us for the op's own dispatch), and the
    per-chunk integer kernels (``formats``, ``scaling``, NVFP4) make a dozen such calls per chunk. A 0-dim tensor of
    the operand's dtype takes part in the op exactly as the scalar does (the same value in
    the same dtype, and 0-dim operands never widen a dimensioned one's dtype). Keyed by
    ``repr`` so that -0.0 and 0.0 (equal, same hash) stay apart.
    """
    if like.device.type != "cpu":
        return value
    key = (repr(value), like.dtype)
    t = _CPU_OPERANDS.get(key)
    if t is None:
        with torch.inference_mode(False):  # usable by later normal-mode calls as well
            t = _CPU_OPERANDS[key] = torch.tensor(value, dtype=like.dtype, device="cpu")
    return t


class Workspace:
    """Scratch buffers reused across the chunks of one quantization (keyed by slot name).

    Why: on CPU a fresh 2 MiB temporary is mmapped/trimmed by malloc and page-faulted on first
    touch, which costs several times the arithmetic of the integer kernels below; reusing a
    few chunk-sized buffers removes that. ``get`` returns a view of the first numel elements.
    """

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self._bufs: dict[tuple[str, torch.dtype], torch.Tensor] = {}
        # views handed out, per (slot, dtype, shape): a small model asks for the same few
        # shapes every step, and each fresh view costs two dispatcher calls
        self._views: dict[tuple[str, torch.dtype, tuple[int, ...]], torch.Tensor] = {}

    def get(self, slot: str, shape: tuple[int, ...] | torch.Size, dtype: torch.dtype) -> torch.Tensor:
        key = (slot, dtype, tuple(shape))
        v = self._views.get(key)
        if v is not None and v.shape == key[2]:  # (an out= resize would have changed it)
            return v
        n = 1
        for d in shape:
            n *= d
        buf = self._bufs.get((slot, dtype))
        if buf is None or buf.numel() < n:
            if buf is not None:  # views of the old buffer go with it
                self._views = {k: t for k, t in self._views.items() if k[:2] != (slot, dtype)}
            # a normal tensor even when first made in inference mode: a workspace may
            # outlive that context (``shared``) and be written by later normal-mode calls
            with torch.inference_mode(False):
                buf = torch.empty(n, dtype=dtype, device=self.device)
            self._bufs[(slot, dtype)] = buf
        with torch.inference_mode(False):
            v = self._views[key] = buf[:n].view(shape)
        return v

    @classmethod
    def shared(cls, device: torch.device | str = "cpu") -> Workspace:
        """This thread's reused CPU workspace (a fresh one on other devices).

        Why: a quantization's scratch buffers are chunk-sized (~2 MiB), which glibc serves by
        mmap and the kernel page-faults in on first touch: a fresh workspace per quantization
        costs about as much as one of its elementwise passes. Every caller consumes what it
        gets from a slot before the next quantization on the same thread starts, so one
        workspace per thread is safe; the device's caching allocator makes this moot elsewhere.
        """
        dev = torch.device(device)
        if dev.type != "cpu":
            return cls(dev)
        ws = getattr(_SHARED, "ws", None)
        if ws is None:
            ws = _SHARED.ws = cls(dev)
        return ws


_SHARED = threading.local()
