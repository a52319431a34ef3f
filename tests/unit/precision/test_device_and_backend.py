"""Device placement, activation dtype, backend choice, main_grad and master init -- on CPU.

What a GPU run needs from the model stage, checked without a GPU: every parameter and
buffer lands on the run's device (the ``meta`` device stands in for CUDA: anything built on
the CPU and not moved would show up as ``cpu``); ``run.device`` resolution; bf16 activations
only on CUDA; ``backend=auto`` choosing TE only for a quantized recipe the GPU supports;
fused-wgrad weights carrying an overwritable fp32 ``main_grad``; fp32 masters seeded from
the high-precision init values of quantized primary weights, TE's included.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
from torch import nn

from lptrain.config import World, derive
from lptrain.config.rulesets.te_backend import auto_backend
from lptrain.config.schema import LPTrainConfig, PrecisionConfig
from lptrain.errors import DeviceError
from lptrain.model.build import build_model, compute_dtype_for, resolve_device
from lptrain.precision import te_adapter
from lptrain.precision.factory import build_factory, runtime_backend
from lptrain.precision.layers import LayerFactory
from lptrain.precision.params import attach_main_grads, fused_wgrad_weights, master_weight_init


def _cfg(**sections: dict[str, Any]) -> LPTrainConfig:
    """The tiny model (2 layers, hidden 64) with per-section overrides."""
    cfg = LPTrainConfig()
    m = cfg.model
    m.num_layers, m.hidden_size, m.num_attention_heads, m.ffn_hidden_size = 2, 64, 4, 128
    m.seq_length, m.vocab_size = 32, 259
    cfg.precision.params_dtype, cfg.precision.backend = "fp32", "emulated"
    for section, values in sections.items():
        obj = cfg
        for part in section.split("."):
            obj = getattr(obj, part)
        for k, v in values.items():
            assert hasattr(obj, k), k
            setattr(obj, k, v)
    return cfg


MOE_SINGLE = {"model.moe": dict(num_experts=4, router_topk=2, grouped_gemm=True, single_grouped_weight=True,
                                enable_expert_bias=True, score_function="sigmoid")}
MOE_LOOP = {"model.moe": dict(num_experts=4, router_topk=2)}


def _placements(model: nn.Module) -> set[str]:
    return {t.device.type for t in [*model.parameters(), *model.buffers()]}


@pytest.mark.parametrize("layout", [{}, MOE_SINGLE, MOE_LOOP], ids=["dense", "moe-single", "moe-loop"])
def test_every_parameter_and_buffer_is_on_the_build_device(layout: dict) -> None:
    cfg = _cfg(**layout)
    model = build_model(cfg, device="meta")
    assert _placements(model) == {"meta"}
    assert model.device.type == "meta" and len(list(model.buffers())) > 0
    with torch.device("meta"):  # a caller's context (the dry run) is honoured too
        assert _placements(build_model(cfg)) == {"meta"}
    cpu = build_model(cfg)
    assert _placements(cpu) == {"cpu"} and model.compute_dtype == cpu.compute_dtype == torch.float32


def test_initial_weights_do_not_depend_on_the_device_context() -> None:
    """Values are drawn on the CPU: a build under another default device draws the same."""
    cfg = _cfg(**MOE_SINGLE)
    a = build_model(cfg, device="cpu")
    from lptrain.model.init import init_values

    with torch.device("meta"):
        v = init_values(cfg.train.seed, "embedding.weight", a.embedding.weight.shape, 0.02)
    assert v.device.type == "cpu" and torch.equal(v, a.embedding.weight.detach())


def test_resolve_device(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device(_cfg(run=dict(device="auto"))) == torch.device("cpu")
    assert resolve_device(_cfg(run=dict(device="cpu"))) == torch.device("cpu")
    with pytest.raises(DeviceError) as err:
        resolve_device(_cfg(run=dict(device="cuda")))
    line = str(err.value)
    assert "run.device=cuda" in line and "run.device=auto" in line and "\n" not in line
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert resolve_device(_cfg(run=dict(device="auto"))) == torch.device("cuda", 3)


def test_activations_are_bf16_only_on_cuda() -> None:
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert compute_dtype_for(cuda, torch.bfloat16) is torch.bfloat16
    assert compute_dtype_for(cuda, torch.float32) is torch.float32
    assert compute_dtype_for(cpu, torch.bfloat16) is torch.float32
    assert compute_dtype_for(torch.device("meta"), torch.bfloat16) is torch.float32


def test_te_backend_refuses_a_cpu_model() -> None:
    f = LayerFactory(params_dtype=torch.bfloat16, backend="te")
    with pytest.raises(DeviceError, match=r"run\.device=auto"):
        build_model(_cfg(), f, device="cpu")


# ---- backend=auto ----------------------------------------------------------------------------

FP8 = {"fp8_format": "e4m3"}
AUTO_CASES = [
    # (precision overrides, world, expected backend)
    ({}, World(target="sm100", te_version="2.19", cuda=True), "emulated"),  # bf16: plain torch
    ({**FP8, "fp8_recipe": "mxfp8"}, World(target="sm100", te_version="2.19", cuda=True), "te"),
    ({**FP8, "fp8_recipe": "mxfp8"}, World(target="sm90", te_version="2.19", cuda=True), "emulated"),
    ({**FP8, "fp8_recipe": "mxfp8"}, World(target="sm120", te_version="2.19", cuda=True), "emulated"),
    ({**FP8, "fp8_recipe": "tensorwise"}, World(target="sm89", te_version="2.2", cuda=True), "te"),
    ({**FP8, "fp8_recipe": "blockwise"}, World(target="sm90", te_version="2.19", cuda=True,
                                               cuda_version="12.8"), "emulated"),
    ({**FP8, "fp8_recipe": "blockwise"}, World(target="sm90", te_version="2.19", cuda=True,
                                               cuda_version="12.9"), "te"),
    ({"fp4_format": "e2m1", "params_dtype": "bf16"}, World(target="sm100", te_version="2.7", cuda=True),
     "emulated"),
    ({"fp4_format": "e2m1", "params_dtype": "bf16"}, World(target="sm100", te_version="2.8", cuda=True), "te"),
    ({"fp4_format": "e2m1", "params_dtype": "fp32"}, World(target="sm100", te_version="2.19", cuda=True),
     "emulated"),  # RHT needs bf16 activations
    ({**FP8, "fp8_recipe": "tensorwise"}, World(target="sm90", te_version=None, cuda=True), "emulated"),
    ({**FP8, "fp8_recipe": "tensorwise"}, World(), "emulated"),
]


@pytest.mark.parametrize(("prec", "world", "expected"), AUTO_CASES)
def test_auto_backend_decisions(prec: dict, world: World, expected: str) -> None:
    cfg = _cfg(precision=dict(backend="auto", **prec))
    assert auto_backend(cfg, world) == expected
    assert derive(cfg, world).precision.backend == expected


def test_auto_backend_on_a_cpu_device_of_a_gpu_host_is_emulated() -> None:
    cfg = _cfg(precision=dict(backend="auto", **FP8, fp8_recipe="tensorwise"), run=dict(device="cpu"))
    assert auto_backend(cfg, World(target="sm90", te_version="2.19", cuda=True)) == "emulated"


@pytest.mark.parametrize(("recipe", "expected"), [(None, "emulated"), ("tensorwise", "te"), ("mxfp8", "emulated")])
def test_runtime_auto_uses_the_machines_world(monkeypatch: pytest.MonkeyPatch, recipe: Any,
                                              expected: str) -> None:
    """``build_factory`` on an underived config asks ``derive`` with World.detect()."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(te_adapter, "te_available", lambda: True)
    monkeypatch.setattr(World, "detect", classmethod(
        lambda cls, **kw: World(target="sm90", te_version="2.19", cuda=True, cuda_version="12.9")))
    prec = PrecisionConfig(backend="auto", params_dtype="bf16")
    if recipe is not None:
        prec = dataclasses.replace(prec, fp8_format="e4m3", fp8_recipe=recipe)
    assert runtime_backend(prec) == expected


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA fallback")
def test_runtime_auto_without_cuda_is_emulated() -> None:
    prec = PrecisionConfig(backend="auto", fp8_format="e4m3", fp8_recipe="tensorwise")
    assert build_factory(prec, num_layers=2).backend == "emulated"


def test_shipped_recipes_with_backend_auto() -> None:
    from lptrain.config import load

    sm90, auto = World.detect(target="sm90"), ["precision.backend=auto"]
    assert derive(load("fp8_tensorwise.yaml", auto).cfg, sm90).precision.backend == "te"
    assert derive(load("bf16_adamw.yaml", auto).cfg, sm90).precision.backend == "emulated"
    assert derive(load("fp8_tensorwise.yaml", auto).cfg, World()).precision.backend == "emulated"


# ---- main_grad ---------------------------------------------------------------------------------


class _FakeTELinear(nn.Module):
    """What the TE adapter hands back, as far as main_grad is concerned."""

    def __init__(self, in_f: int, out_f: int, *, fuse_wgrad_accumulation: bool = False, **kw: Any) -> None:
        super().__init__()
        self.fuse_wgrad_accumulation = fuse_wgrad_accumulation
        self.weight = nn.Parameter(torch.zeros(out_f, in_f, dtype=kw.get("params_dtype")))
        self.layer_norm_weight = nn.Parameter(torch.ones(in_f))  # like LayerNormLinear: not a GEMM weight


def test_te_models_allocate_no_main_grad_before_the_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    """Finding 7: an fp32 zero ``main_grad`` per TE weight at build time held 4 more bytes per
    parameter until the engine's grad buffer replaced it (8 in transit: ~64 GB at 8B
    parameters, an OOM at start-up). The model leaves it to the engine; a caller outside it
    attaches one explicitly (``attach_main_grads``), an overwritable plain attribute."""
    monkeypatch.setattr(te_adapter, "te_linear", lambda i, o, **kw: _FakeTELinear(i, o, **kw))
    cfg = _cfg(train=dict(gradient_accumulation_fusion=True))
    factory = LayerFactory(params_dtype=torch.bfloat16, backend="te", fuse_wgrad_accumulation=True)
    model = build_model(cfg, factory, device="meta")
    te_layers = [m for m in model.modules() if isinstance(m, _FakeTELinear)]
    assert len(te_layers) == 2 * 4  # qkv, proj, fc1, fc2 per layer
    assert not any(hasattr(p, "main_grad") for p in model.parameters())
    assert attach_main_grads(model) == len(te_layers)
    for m in te_layers:
        mg = m.weight.main_grad
        assert mg.dtype == torch.float32 and mg.shape == m.weight.shape and mg.device.type == "meta"
        assert m.weight.grad_added_to_main_grad is False  # TE flips it only if it exists
        assert not hasattr(m.layer_norm_weight, "main_grad")
    assert not hasattr(model.embedding.weight, "main_grad")
    w = te_layers[0].weight
    view = torch.empty(w.numel(), device="meta").view(w.shape)
    w.main_grad = view  # the DP engine's view into its buffer: kept as given
    assert w.main_grad is view and attach_main_grads(model) == 0


def _te_build_bytes(build: Any) -> tuple[int, int, int]:
    """``(device bytes the build added, parameter+buffer bytes, fused GEMM weight elements)``
    of a fused-wgrad TE model built by ``build(cfg, factory)`` on a virtual GPU."""
    from lptrain.precision.factory import build_factory
    from lptrain.testing.fake_gpu import virtual_gpu

    cfg = _cfg(train=dict(gradient_accumulation_fusion=True))
    prec = dataclasses.replace(cfg.precision, backend="te", params_dtype="bf16")
    cfg = dataclasses.replace(cfg, precision=prec)
    with virtual_gpu("sm90", te=True) as vc:
        factory = build_factory(prec, num_layers=cfg.model.num_layers, fuse_wgrad_accumulation=True)
        before = vc.stats.bytes_now
        model = build(cfg, factory)
        grown = vc.stats.bytes_now - before
        from transformer_engine.pytorch.cpp_extensions import gemm as te_gemm  # TE's own Python

        if te_gemm.get_cublas_workspace.cache_info().currsize:  # TE's one cuBLAS workspace per process
            grown -= te_gemm.get_cublas_workspace_size_bytes()
        held = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
        fused = sum(p.numel() for p in fused_wgrad_weights(model))
    return grown, held, fused


def test_te_model_build_allocates_only_its_weights() -> None:
    """Finding 7 on TE's own Python and a virtual GPU: building a fused-wgrad TE model puts
    its parameters and buffers (and TE's own cuBLAS workspace, once) on the device and nothing more (bound: under one extra byte
    per fused weight element); the build-time fp32 ``main_grad`` it had -- put back here by
    attaching one after the build -- adds 4 per element and breaks the bound."""
    grown, held, fused = _te_build_bytes(build_model)
    assert fused > 0 and grown < held + fused, (grown, held, fused)

    def old_build(cfg: Any, factory: Any) -> Any:
        model = build_model(cfg, factory)
        attach_main_grads(model)
        return model

    grown, held, fused = _te_build_bytes(old_build)
    assert grown >= held + 4 * fused


def test_emulated_models_take_ordinary_grads_until_a_main_grad_is_installed() -> None:
    cfg = _cfg(train=dict(gradient_accumulation_fusion=True), **MOE_SINGLE)
    model = build_model(cfg)
    assert len(list(fused_wgrad_weights(model))) == 8
    assert not any(hasattr(p, "main_grad") for p in model.parameters())
    assert list(fused_wgrad_weights(build_model(_cfg(train=dict(gradient_accumulation_fusion=False))))) == []


def test_emulated_fused_wgrad_lands_in_the_replaced_main_grad() -> None:
    """Gradients of every fused weight reach the buffer the engine installs, bit-exactly equal
    to the unfused gradients (fp32 params: the fused add into zeros is exact)."""
    torch.manual_seed(0)
    tokens = torch.randint(0, 259, (2, 32))
    plain = build_model(_cfg(**MOE_SINGLE))
    plain(tokens, tokens)[0].backward()
    cfg = _cfg(train=dict(gradient_accumulation_fusion=True), **MOE_SINGLE)
    fused = build_model(cfg)
    weights = list(fused_wgrad_weights(fused))
    assert len(weights) == 2 * 2 + 2 * 2  # attention qkv/proj + grouped fc1/fc2, 2 layers
    buffer = torch.zeros(sum(p.numel() for p in weights))
    offset = 0
    for p in weights:
        p.main_grad = buffer[offset: offset + p.numel()].view(p.shape)
        offset += p.numel()
    fused(tokens, tokens)[0].backward()
    by_name = dict(plain.named_parameters())
    for name, p in fused.named_parameters():
        if any(p is w for w in weights):
            assert p.grad_added_to_main_grad and torch.equal(p.main_grad, by_name[name].grad), name
        else:
            assert torch.equal(p.grad, by_name[name].grad), name


# ---- fp32 master init ---------------------------------------------------------------------------


def test_master_init_plain_and_emulated_quantized() -> None:
    from lptrain.precision import quantized_model_init, recipe_from_name
    from lptrain.precision.layers import Linear

    w = nn.Parameter(torch.randn(4, 8).to(torch.bfloat16))
    m = master_weight_init(w)
    assert m.dtype == torch.float32 and torch.equal(m, w.detach().float()) and m is not w

    g = torch.Generator().manual_seed(1)
    init = torch.randn(32, 64, generator=g) * 0.02

    def set_init(t: torch.Tensor) -> None:
        t.copy_(init)

    with quantized_model_init(recipe_from_name("tensorwise", fp8_format="e4m3")):
        lin = Linear(64, 32, params_dtype=torch.bfloat16, init_method=set_init)
    master = master_weight_init(lin.weight)
    assert torch.equal(master, init.to(torch.bfloat16).float())  # the init, not the FP8 bytes
    assert not torch.equal(master, lin.weight.dequantize())
    assert lin.weight.high_precision_init_value() is None  # freed


def test_master_init_uses_te_high_precision_init_val() -> None:
    """A TE primary weight (TE's own Python builds it) starts its master from the kept CPU
    init value, which is then released; without one, from its dequantized bytes."""
    from lptrain.precision import te_adapter
    from lptrain.testing.fake_gpu import virtual_gpu

    init = torch.randn(32, 64)

    def set_init(t: torch.Tensor) -> None:
        with torch.no_grad():
            t.copy_(init.to(t.device))

    with virtual_gpu("sm90", te=True):
        import transformer_engine.common.recipe as r

        recipe = r.Float8CurrentScaling(fp8_format=r.Format.E4M3)
        with te_adapter.te_model_init(recipe):
            lin = te_adapter.te_linear(64, 32, params_dtype=torch.bfloat16, init_method=set_init)
        w = lin.weight
        assert not torch.equal(w.dequantize().float().cpu(), init.to(torch.bfloat16).float())
        m = master_weight_init(w)
        assert torch.equal(m.cpu(), init.to(torch.bfloat16).float()) and m.dtype == torch.float32
        assert w.get_high_precision_init_val() is None  # released
        assert torch.equal(master_weight_init(w).cpu(), w.dequantize().float().cpu())  # the fallback


# Quantizes one operand per emulated recipe and role on the CPU and prints a digest of every
# byte: run in a fresh interpreter whose first import of the precision package happens under
# a caller's ``with torch.device("meta")`` (a meta-device model build, as the dry run and
# the memory planner do), and in this process, where it did not.
_QUANTIZE_DIGEST = r"""
import hashlib, sys
import torch
if sys.argv[1] == "meta":
    from lptrain.config.compose import compose
    with torch.device("meta"):
        from lptrain.model.build import build_model
        build_model(compose("nvfp4_adamw_cpu.yaml"))
from lptrain.precision import recipes as R
digest = hashlib.sha256()
x = torch.randn(64, 64, generator=torch.Generator().manual_seed(3))
for make in (lambda: R.DelayedScaling(fp8_format="hybrid"), R.TensorwiseScaling, R.BlockwiseScaling,
             R.MXFP8Scaling, R.NVFP4Scaling):
    recipe = make()
    for role in ("input", "weight", "grad"):
        kw = {"state": recipe.make_state(role)} if recipe.name == "delayed" else {}
        t = recipe.make_quantizer(role, True, True, **kw).quantize(x)
        for o in ("rowwise", "columnwise"):
            digest.update(t.dequantize(o).numpy().tobytes())
print(digest.hexdigest())
"""


def test_a_first_import_under_a_meta_device_context_keeps_the_kernels_on_the_cpu() -> None:
    """The emulation's constant tables and cached operands (E4M3/E2M1/E8M0 tables, NVFP4
    scale factors, RHT matrix, scalar operands) are made once, at import or first use. Made
    under a caller's ``torch.device("meta")`` they would be meta tensors for the rest of the
    process: the import itself failed (``float()`` of a meta tensor), and a table that did
    not fail would make every later CPU quantization raise. They are pinned to the CPU, so
    quantizing after such an import gives this process's bytes exactly."""
    import subprocess
    import sys

    def digest(mode: str) -> str:
        run = subprocess.run([sys.executable, "-c", _QUANTIZE_DIGEST, mode], capture_output=True,
                             text=True, timeout=120)
        assert run.returncode == 0, run.stderr[-2000:]
        return run.stdout.strip()

    assert digest("meta") == digest("plain")
