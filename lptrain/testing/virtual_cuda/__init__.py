"""A virtual CUDA device on a CPU-only machine: runs real training steps and enforces CUDA's
device rules, so code that would crash on a GPU fails here, with the op that broke the rule.

Why not ``FakeTensorMode``: it has no values (losses, ``.item()``, data-dependent shapes of an
MoE dispatch are meaningless) and on a CPU-only build any backward through fake ``cuda``
tensors aborts the process (AccumulateGrad needs a CUDA device guard). Here every tensor is a
real CPU tensor; what is virtual is its *placement*:

* a :class:`~torch.overrides.TorchFunctionMode` maps ``cuda`` placements onto the CPU --
  ``device=`` arguments of factories, ``Tensor.to``/``.cuda()``/``.cpu()``, ``nn.Module.to``,
  ``with torch.device("cuda")`` -- and labels the storage of what it creates as *device*
  memory; it reports ``.device``/``.is_cuda`` of labelled tensors as ``cuda:0``, so code follows
  its CUDA paths (bf16 activations, native bf16 GEMMs, NCCL process groups);
* a :class:`~torch.utils._python_dispatch.TorchDispatchMode` sees every aten op (forward,
  backward and optimizer alike), propagates the label to outputs and enforces the rules:

  1. no op mixes device and host tensors, except a 0-dim host tensor used as an input (what
     CUDA kernels accept as a scalar);
  2. no in-place op writes device results into a host tensor;
  3. a random op on device tensors draws from a device generator;
  4. every collective's tensors are on the device the process group requires (NCCL: CUDA);

  and counts **host syncs** (``.item()``/``float()``/``.tolist()``, device-to-host copies,
  ``nonzero`` and other ops whose output size depends on device values,
  ``torch.cuda.synchronize``) so a test can show that a step's syncs do not grow with the
  number of parameters;
* the ``torch.cuda`` queries the code asks (``is_available``, ``current_device``,
  ``get_device_capability``, RNG state, memory statistics, ...) answer as one GPU of the
  requested capability; memory statistics count the bytes of labelled storages.

Labels live on storage objects (torch keeps a storage's Python object, and its attributes, as
long as the storage lives), so views and ``param.data = x`` follow their storage without
extra bookkeeping, and a storage created any other way (``torch.from_numpy``, a data loader,
before the device was entered) is host memory. Quantized wrapper subclasses (lptrain's and
Transformer Engine's, which have no storage of their own) are created on the CPU with the
label on the wrapper.

A violation raises :class:`DeviceRuleError` (an ``AssertionError``) at the op; the message
names the rule, the op, and each tensor's placement, shape and dtype. Used by the tests, by
``lptrain pretrain --dry-run`` on a GPU target, and by nothing at run time.
"""

from .device import VirtualCuda, active
from .labels import CUDA, DeviceGenerator, DeviceRuleError, DeviceStats, is_device

__all__ = ["CUDA", "DeviceGenerator", "DeviceRuleError", "DeviceStats", "VirtualCuda", "active",
           "is_device"]
