"""The multi-tensor Adam kernels TE's ``FusedAdam.step`` launches (``multi_tensor/adam.cu``).

Both take ``(chunk_size, noop_flag, tensor_lists, lr, beta1, beta2, epsilon, step, mode,
bias_correction, weight_decay)``; the scalars arrive as C++ ``float`` / ``int`` (pybind rounds
a Python float to fp32), and the host computes ``bias_correction{1,2} = 1 - pow(beta, step)``
in double, rounded to fp32 (:func:`lptrain.precision.fused_adam.adam_kernel_`, which does the
kernel's per-element fp32 math one rounded operation at a time):

* ``multi_tensor_adam``: lists ``[g, p, m, v]`` (the param is its own master: read into fp32,
  written back with a round-to-nearest-even cast) or ``[g, p, m, v, p_master]`` (fp32 master
  read and written, the param written as the master's cast);
* ``multi_tensor_adam_param_remainder``: ``[g, p, m, v, p_remainder]``, bf16 params and int16
  remainders: the fp32 master is rebuilt from the two halves (``if (rem < 0) p--``), stepped,
  and split again (``if (rem < 0) p++``: :mod:`lptrain.precision.optimizer_states`).

Each list must hold tensors of one dtype, moments fp32 (from TE 2.14 also both bf16: the
kernel then reads and writes them as bf16, ``FusedAdam``'s fused unscale), masters fp32, as
the host code checks (``NVTE_CHECK``: a :class:`RuntimeError` here). The kernel never reads
the no-op flag (its check is commented out): non-finite values propagate.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from lptrain.precision.fused_adam import adam_kernel_
from lptrain.precision.optimizer_states import join_remainders, split_remainders

# the first release whose kernels take bf16 moments (TE PR 2632, "fuse scaling and unscaling
# of bf16 momentums into kernels")
BF16_MOMENTS_FROM = (2, 14)


def _check(lists: Sequence[Sequence[torch.Tensor]], counts: tuple[int, ...], version: tuple[int, ...],
           param_dtype: Any = None, master_dtype: Any = torch.float32) -> None:
    if len(lists) not in counts:
        raise RuntimeError(f"Expected {' or '.join(map(str, counts))} tensor lists, but found {len(lists)}")
    n = len(lists[0])
    for i, ts in enumerate(lists[1:], 1):
        if len(ts) != n:
            raise RuntimeError(f"Tensor list {i} has size={len(ts)}, but expected size={n}")
    moments = (torch.float32, torch.bfloat16) if version >= BF16_MOMENTS_FROM else (torch.float32,)
    for j in range(n):
        g, p, m, v = (lists[i][j] for i in range(4))
        if g.dtype != lists[0][0].dtype:
            raise RuntimeError(f"Grad tensor {j} has dtype={g.dtype}, but expected dtype={lists[0][0].dtype}")
        want = param_dtype or lists[1][0].dtype
        if p.dtype != want:
            raise RuntimeError(f"Param tensor {j} has dtype={p.dtype}, but expected dtype={want}")
        if m.dtype != v.dtype or m.dtype not in moments:
            raise RuntimeError(f"First and second moment tensors of tensor {j} must both be one of {moments}, "
                               f"but are {m.dtype} and {v.dtype}")
        if len(lists) == 5 and lists[4][j].dtype != master_dtype:
            raise RuntimeError(f"Master param tensor {j} has dtype={lists[4][j].dtype}, but expected "
                               f"dtype={master_dtype}")


def _step(g: torch.Tensor, master: torch.Tensor, m: torch.Tensor, v: torch.Tensor, lr: float, beta1: float,
          beta2: float, eps: float, step: int, mode: int, bias_correction: int, weight_decay: float) -> None:
    """One tensor: fp32 ``master`` and the moments stepped in place (moments in their dtype)."""
    m32, v32 = m.float(), v.float()  # a copy unless fp32 (then the tensor itself)
    adam_kernel_(g.reshape(master.shape), master, m32, v32, lr=lr, beta1=beta1, beta2=beta2, eps=eps, step=int(step),
                 weight_decay=weight_decay, adam_w_mode=bool(mode), bias_correction=bias_correction == 1)
    if m32 is not m:
        m.copy_(m32)  # static_cast<bf16>: round to nearest even
        v.copy_(v32)


def multi_tensor_adam(version: tuple[int, ...]) -> Callable[..., None]:
    def multi_tensor_adam(chunk_size: int, noop_flag: torch.Tensor, tensor_lists: Sequence[Sequence[torch.Tensor]],
                          lr: float, beta1: float, beta2: float, epsilon: float, step: int, mode: int,
                          bias_correction: int, weight_decay: float) -> None:
        _check(tensor_lists, (4, 5), version)
        with torch.no_grad():
            for j in range(len(tensor_lists[0])):
                g, p, m, v = (tensor_lists[i][j] for i in range(4))
                master = tensor_lists[4][j] if len(tensor_lists) == 5 else p.float()
                _step(g, master, m, v, lr, beta1, beta2, epsilon, step, mode, bias_correction, weight_decay)
                if master is not p:
                    p.copy_(master)  # static_cast<PARAM_T>
    return multi_tensor_adam


def multi_tensor_adam_param_remainder(version: tuple[int, ...]) -> Callable[..., None]:
    def multi_tensor_adam_param_remainder(chunk_size: int, noop_flag: torch.Tensor,
                                          tensor_lists: Sequence[Sequence[torch.Tensor]], lr: float, beta1: float,
                                          beta2: float, epsilon: float, step: int, mode: int, bias_correction: int,
                                          weight_decay: float) -> None:
        _check(tensor_lists, (5,), version, param_dtype=torch.bfloat16, master_dtype=torch.int16)
        with torch.no_grad():
            for j in range(len(tensor_lists[0])):
                g, p, m, v, rem = (tensor_lists[i][j] for i in range(5))
                master = join_remainders(p, rem)
                _step(g, master, m, v, lr, beta1, beta2, epsilon, step, mode, bias_correction, weight_decay)
                hi, lo = split_remainders(master)
                p.copy_(hi.view(p.shape))
                rem.copy_(lo.view(rem.shape))
    return multi_tensor_adam_param_remainder


def functions(version: tuple[int, ...]) -> dict[str, Callable[..., None]]:
    return {"multi_tensor_adam": multi_tensor_adam(version),
            "multi_tensor_adam_param_remainder": multi_tensor_adam_param_remainder(version)}
