"""train.compile: compiled quantizers write the eager bytes, and every layer is compiled.

Cost: torch.compile on 2 shared cores is slow, so these stay tiny -- one quantizer through
inductor (its C++ kernel is built once: the bulk of the time), and the model test checks the
wiring without running the compiled layers. The other recipes' quantizers were checked the same way by hand
(blockwise, MXFP8, NVFP4: identical bytes; docs/precision.md).
"""

from __future__ import annotations

import pytest
import torch

from lptrain.config import World, derive, load
from lptrain.model.build import build_model
from lptrain.precision.recipes import recipe_from_name


@pytest.mark.slow
def test_compiled_quantizer_gives_the_eager_bytes() -> None:
    """Inductor-compiled per-tensor quantization (amax, scale, scaled cast, byte transpose)
    of a hybrid recipe's gradient (E5M2, the cast torch's CPU kernel gets wrong without the
    clamp): the same codes and scale as eager, bit for bit (torch.equal). Compiled, the
    quantizer takes the device path (no value read back), in one graph (fullgraph)."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(32, 64, generator=g) * 5
    x[0, 0] = 1e4  # a large amax: scales far from 1
    r = recipe_from_name("tensorwise", fp8_format="hybrid")
    torch._dynamo.reset()
    q = r.make_quantizer("grad", True, True)
    eager = q._quantize_fields(x)
    compiled = torch.compile(q._quantize_fields, fullgraph=True)(x)
    assert eager.keys() == compiled.keys()
    for name, t in eager.items():
        assert torch.equal(t, compiled[name]), name


def test_train_compile_compiles_each_layer() -> None:
    """train.compile=true compiles every transformer layer (compiled lazily, at the first
    call: building costs nothing) and keeps the parameter names. (A compiled FP8 layer's
    training step -- dynamo tracing the block, quantizers included -- gave the eager loss and
    grads bit for bit, checked by hand: ~110 s on 2 shared cores, too slow for the suite.)"""
    overrides = ["precision.fp8_format=e4m3", "precision.fp8_recipe=tensorwise",
                 "model.num_layers=1", "model.seq_length=32"]
    cfg = derive(load("tiny_cpu.yaml", [*overrides, "train.compile=true"]).cfg, World.detect(target="cpu"))
    model = build_model(cfg)
    assert all(layer._compiled_call_impl is not None for layer in model.layers)
    eager_cfg = derive(load("tiny_cpu.yaml", overrides).cfg, World.detect(target="cpu"))
    eager = build_model(eager_cfg)
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in eager.named_parameters()]
    assert all(layer._compiled_call_impl is None for layer in eager.layers)
