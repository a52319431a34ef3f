"""``train.compile``: each transformer layer compiled on its own, the way torchtitan does.

Why per layer: one compiled region per block keeps compile time independent of depth (every
layer has the same code, so dynamo reuses one graph for all of them) and leaves what sits
between blocks -- pipeline stage boundaries, activation recompute, the data-parallel hooks --
in eager mode. ``nn.Module.compile`` keeps the parameter names (no ``_orig_mod.`` prefix), so
checkpoints, optimizers and the numerics tools see the same model.

The quantizers run inside the compiled region: the emulated backend's quantize ops take
their device path there (no value read back: ``lptrain.precision.scratch.host_shortcuts``),
so a block is a few graphs rather than one per quantizer step, and on the CPU the compiled
quantizers give the eager bytes bit for bit (``tests/unit/precision/test_compile_bits.py``).
"""

from __future__ import annotations

from typing import Any


def compile_layers(model: Any, **options: Any) -> int:
    """Compile every transformer layer of ``model`` in place (``options``: ``torch.compile``'s,
    the defaults for ``train.compile``); returns how many."""
    layers = list(getattr(model, "layers", []) or [])
    for layer in layers:
        layer.compile(**options)
    return len(layers)
