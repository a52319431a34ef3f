"""fp64 copies of flat grads for the grad norms, into a buffer kept across steps on the CPU.

The grad norms are summed in fp64 (see ``ShardedMasterOptimizer.grad_norm_sq`` and the
layer-wise ``unit_sums_and_zeros``), which casts each bucket's span of the flat fp32 grad
buffer once per step. On the CPU a fresh fp64 copy of a 1M-element span is an 8 MiB
allocation that glibc serves by mmap and the kernel page-faults in on every step: measured
~7 ms per such bucket inside a DP=2 step, against ~0.25 ms for the same cast into a kept
buffer. The values are the same either way (the cast is exact). Other devices have a caching
allocator, so they keep the plain cast (and no buffer is held there).
"""

from __future__ import annotations

import threading

import torch

# the largest cast served from the kept buffer (32 MiB of fp64); larger spans get a fresh one
MAX_KEPT_ELEMS = 1 << 22

_LOCAL = threading.local()


def fp64_copy(grads: torch.Tensor) -> torch.Tensor:
    """``grads`` cast to fp64, flattened. On the CPU it is a view of this thread's kept buffer
    (grown to the largest cast asked for, up to :data:`MAX_KEPT_ELEMS`): valid until the next
    call on the same thread, so callers reduce it before casting the next span."""
    n = grads.numel()
    if grads.device.type != "cpu" or n > MAX_KEPT_ELEMS:
        return grads.reshape(-1).to(torch.float64)
    buf = getattr(_LOCAL, "buf", None)
    if buf is None or buf.numel() < n:
        with torch.inference_mode(False):  # a normal tensor even when first made in inference
            buf = _LOCAL.buf = torch.empty(n, dtype=torch.float64, device=grads.device)
    return buf[:n].copy_(grads.reshape(-1))
