"""The data-parallel engine on Transformer Engine's tensors, through TE's own Python (newest
installed release, kernels emulated: lptrain.testing.te_python) on a virtual GPU (one rank;
the two-rank byte gather is in tests/dist/test_te_dist.py).

Each test holds one defect the engine had with TE's classes (read against TE's source) and
fails on the engine as it was, where TE tensors fell through to the plain-tensor path:

* fp32 masters started from the dequantized FP8 weights, not from TE's kept high-precision
  init values, and those CPU copies were never released;
* TE params were not "quantized" to the layout: no byte gather for current-scaling and
  blockwise FP8, no grad-buffer reuse for MXFP8, an extra bf16 param buffer;
* placing a param in its buffer reshaped it (MXFP8 / grouped / blockwise <= 2.13 raise) and
  assigned ``.data`` (TE requantizes into new storage: the bytes no longer alias the buffer);
* a single grouped expert weight was indexed with ``weight[i]`` (``GroupedTensor`` refuses);
* checkpoints carried neither TE's per-module scaling state (``_extra_state``) nor the CUDA
  generator TE's stochastic rounding draws from, which was also seeded alike on every rank.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from lptrain.config import World, derive
from lptrain.config.compose import load
from lptrain.testing import te_python
from lptrain.testing.fake_gpu import virtual_gpu

BASE = ["data.builtin_max_mb=1", "logging.progress=false", "run.device=cuda", "precision.backend=te",
        "train.global_batch_size=4", "train.micro_batch_size=2", "model.seq_length=64",
        "optimizer.warmup_iters=0", "optimizer.lr=0.01", "train.eval_iters=1",
        "ddp.use_distributed_optimizer=true"]
TENSORWISE = ["precision.fp8_format=e4m3", "precision.fp8_recipe=tensorwise", "precision.fp8_param_gather=true"]
BLOCKWISE = ["precision.fp8_format=e4m3", "precision.fp8_recipe=blockwise", "precision.fp8_param_gather=true"]
MXFP8 = ["precision.fp8_format=e4m3", "precision.fp8_recipe=mxfp8", "precision.fp8_param_gather=true",
         "ddp.reuse_grad_buf_for_mxfp8_param_ag=true"]
NVFP4 = ["precision.fp4_format=e2m1", "precision.fp4_param_gather=true"]
DELAYED = ["precision.fp8_format=hybrid", "precision.fp8_recipe=delayed", "precision.fp8_amax_history_len=4"]
MOE = ["model.moe.num_experts=4", "model.moe.router_topk=2", "model.moe.ffn_hidden_size=64",
       "model.moe.grouped_gemm=true", "model.moe.single_grouped_weight=true"]
NO_BF16_EDGES = ["precision.first_last_layers_bf16=false"]
MOE_DISCRETE = [o for o in MOE if "single_grouped_weight" not in o]


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("cache")


def _engine(overrides: list[str], cache: Path) -> object:
    from lptrain.train.engine import TrainEngine

    cfg = derive(load("tiny_cpu.yaml", [*BASE, f"data.cache_dir={cache}", *overrides]).cfg, World.detect())
    return TrainEngine(cfg)


def _batches(engine: object, cache: Path) -> Iterator[list[dict[str, torch.Tensor]]]:
    from lptrain.data import build_train_valid_loaders

    cfg = engine.cfg  # type: ignore[attr-defined]
    it, _ = build_train_valid_loaders(cfg.data, seq_length=64, micro_batch_size=2, global_batch_size=4,
                                      dp_rank=0, dp_size=1, vocab_size=cfg.model.vocab_size)
    while True:
        yield [next(it), next(it)]


def _te_classes() -> tuple[type, ...]:
    return tuple(c for c in (te_python.te_class("QuantizedTensor"), te_python.te_class("GroupedTensor")) if c)


def _te_params(engine: object) -> dict[str, torch.Tensor]:
    return {n: p for n, p in engine.model.named_parameters() if isinstance(p, _te_classes())}  # type: ignore[attr-defined]


@pytest.mark.parametrize(("target", "recipe"), [("sm90", TENSORWISE), ("sm100", MXFP8), ("sm100", NVFP4)],
                         ids=["tensorwise", "mxfp8", "nvfp4"])
def test_masters_start_from_te_init_values_and_the_cpu_copies_are_released(
        target: str, recipe: list[str], cache: Path) -> None:
    from lptrain.model.build import build_model
    from lptrain.precision.factory import build_factory

    with virtual_gpu(target, te=True):
        cfg = derive(load("tiny_cpu.yaml", [*BASE, f"data.cache_dir={cache}", *recipe, *NO_BF16_EDGES]).cfg,
                     World.detect())
        ref = build_model(cfg, build_factory(cfg.precision, num_layers=2, run_cfg=cfg))
        inits = {n: p.get_high_precision_init_val().float() for n, p in ref.named_parameters()
                 if isinstance(p, _te_classes())}
        dequantized = {n: p.dequantize().float().cpu() for n, p in ref.named_parameters() if n in inits}
        engine = _engine([*recipe, *NO_BF16_EDGES], cache)
        masters = engine.checkpoint_state()["global"]["model"]
        te = _te_params(engine)
    assert inits and set(inits) == set(te)
    assert any(not torch.equal(inits[n], dequantized[n]) for n in inits)  # the test can tell
    for n, value in inits.items():
        assert torch.equal(masters[n].cpu(), value), n
        assert te[n].get_high_precision_init_val() is None, n  # host copy released


@pytest.mark.parametrize(("target", "recipe", "staging"), [
    ("sm90", TENSORWISE, torch.uint8),
    ("sm90", BLOCKWISE, torch.uint8),
    ("sm100", MXFP8, torch.bfloat16),
    ("sm100", NVFP4, torch.bfloat16),
    ("sm100", [*MXFP8, *MOE], torch.bfloat16),
    ("sm100", [*MXFP8, *MOE_DISCRETE], torch.bfloat16),
], ids=["tensorwise", "blockwise", "mxfp8-reuse", "nvfp4", "moe-grouped-mxfp8", "moe-discrete-mxfp8"])
def test_te_params_take_the_quantized_buffer_paths(target: str, recipe: list[str], staging: torch.dtype,
                                                   cache: Path) -> None:
    """(Blockwise reshapes refused up to TE 2.13: tests/e2e/test_te_python_releases.py.)"""
    with virtual_gpu(target, te=True):
        engine = _engine([*recipe, *NO_BF16_EDGES], cache)
        te = _te_params(engine)
        quantized = [b for b in engine.ddp.buffers if b.key.quantized]  # type: ignore[attr-defined]
        assert te and quantized, "TE params must be laid out as quantized primary weights"
        for buf in quantized:
            assert buf.key.param_dtype == staging
            for name in buf.params:
                p, s = te[name], buf.slots[name]
                if staging == torch.uint8:  # bytes aliased: the gather moves 1 byte per element
                    raw = p._data if type(p).__name__ == "Float8Tensor" else p._rowwise_data
                    assert buf.aliased[name]
                    assert raw.data_ptr() == buf.param_data[s.start:s.end].data_ptr(), name
                else:
                    assert not buf.aliased[name]
            if "ddp.reuse_grad_buf_for_mxfp8_param_ag=true" in recipe:
                assert buf.reuses_grad_buffer and "param" not in buf.nbytes()
        batches = _batches(engine, cache)
        loss = engine.train_step(next(batches), 1).loss  # the whole step runs on TE's tensors
        mem = engine.memory_breakdown()
    assert loss == loss and mem["params"] > 0


@pytest.mark.parametrize("recipe", [TENSORWISE, BLOCKWISE, MXFP8], ids=["tensorwise", "blockwise", "mxfp8"])
def test_te_param_gather_on_equals_off(recipe: list[str], cache: Path) -> None:
    """Quantized primary weights staged from the masters hold exactly what a bf16 param
    quantizes to in its forward: the losses of ON and OFF are bitwise equal."""
    target = "sm100" if recipe is MXFP8 else "sm90"
    off = [o for o in recipe if "param_gather" not in o and "reuse" not in o]
    runs = {}
    for name, ov in (("on", recipe), ("off", off)):
        with virtual_gpu(target, te=True):
            engine = _engine([*ov, *NO_BF16_EDGES], cache)
            batches = _batches(engine, cache)
            runs[name] = [engine.train_step(next(batches), s).loss for s in (1, 2, 3)]
    assert runs["on"] == runs["off"], runs


def test_member_weight_of_a_single_grouped_te_weight(cache: Path) -> None:
    with virtual_gpu("sm100", te=True):
        engine = _engine([*MXFP8, *MOE], cache)
        module = next(m for m in engine.model.modules() if getattr(m, "single_grouped_weight", False))  # type: ignore[attr-defined]
        with pytest.raises(RuntimeError, match="forbids shape-manipulation"):
            module.weight[0]
        members = [module.member_weight(i) for i in range(module.num_gemms)]
        assert [tuple(m.shape) for m in members] == [tuple(module.weight.shape[1:])] * module.num_gemms
        # each member views its slice of the grouped weight's bytes (TE's GroupedTensor has no
        # dequantize of its own: the members are how its values are read)
        flat = module.weight.rowwise_data.reshape(-1)
        n = members[0]._rowwise_data.numel()
        for i, m in enumerate(members):
            assert m._rowwise_data.data_ptr() == flat[i * n:].data_ptr(), i
            assert torch.equal(m._rowwise_data.reshape(-1), flat[i * n:(i + 1) * n]), i


def _resume(overrides: list[str], target: str, cache: Path, drop: str) -> dict[str, list[float]]:
    """Losses of 4 steps straight, and of 2 steps whose checkpoint state is loaded into a
    fresh engine that runs steps 3 and 4 (the bits a step draws show in the next step's
    loss): once with the whole state, once without the per-rank entry ``drop`` (to show the
    test can tell)."""
    with virtual_gpu(target, te=True):
        straight = _engine(overrides, cache)
        b = _batches(straight, cache)
        batches = [next(b) for _ in range(4)]
        out = {"straight": [straight.train_step(batches[i], i + 1).loss for i in range(4)]}
        first = _engine(overrides, cache)
        head = [first.train_step(batches[i], i + 1).loss for i in range(2)]
        with first.params_synced():
            state = first.checkpoint_state()
        partial = {**state, "local": {k: v for k, v in state["local"].items() if k != drop}}
        for name, st in (("resumed", state), ("without", partial)):
            resumed = _engine(overrides, cache)
            resumed.load_checkpoint_state(st)
            out[name] = head + [resumed.train_step(batches[i], i + 1).loss for i in (2, 3)]
    return out


def test_resume_restores_te_delayed_scaling_state(cache: Path) -> None:
    """TE keeps the scales and amax histories in each module's ``_extra_state`` only."""
    runs = _resume([*DELAYED, *NO_BF16_EDGES], "sm90", cache, drop="module_extra_state")
    assert runs["resumed"] == runs["straight"]
    assert runs["without"][2:] != runs["straight"][2:]  # scales restarting at 1 change step 3


def test_resume_restores_the_cuda_generator_of_te_stochastic_rounding(cache: Path) -> None:
    """TE's NVFP4 stochastic rounding draws from CUDA's generator, saved per rank."""
    ov = ["precision.fp4_format=e2m1", "precision.nvfp4_stochastic_rounding=true", *NO_BF16_EDGES]
    runs = _resume(ov, "sm100", cache, drop="cuda_rng")
    assert runs["resumed"] == runs["straight"]
    assert runs["without"][3] != runs["straight"][3]


@pytest.mark.parametrize(("target", "recipe"), [("sm90", TENSORWISE), ("sm100", MXFP8)], ids=["tensorwise", "mxfp8-reuse"])
def test_te_engine_holds_the_bytes_the_emulated_engine_holds(target: str, recipe: list[str], cache: Path) -> None:
    """Same buffers, masters and moments on both backends (what the memory planner, built on
    the emulated layout, predicts); before, TE runs allocated an extra bf16 param buffer."""
    mem = {}
    for backend in ("te", "emulated"):
        with virtual_gpu(target, te=backend == "te"):
            engine = _engine([*recipe, *NO_BF16_EDGES, f"precision.backend={backend}"], cache)
            engine.train_step(next(_batches(engine, cache)), 1)
            mem[backend] = engine.memory_breakdown()
    for category in ("grads", "param_buffer", "masters", "moments", "padding"):
        assert mem["te"][category] == mem["emulated"][category], (category, mem)


def _train_eval_train(cache: Path, with_eval: bool) -> list[float]:
    with virtual_gpu("sm90", te=True):
        engine = _engine([*DELAYED, "precision.fp8_amax_history_len=1", *NO_BF16_EDGES], cache)
        b = _batches(engine, cache)
        losses = [engine.train_step(next(b), 1).loss]
        held_out = next(b)  # drawn either way: the training batches are the same
        if with_eval:
            engine.evaluate(iter(held_out), 2)
        losses += [engine.train_step(next(b), s).loss for s in (2, 3)]
    return losses


def test_evaluation_leaves_te_delayed_scaling_as_it_was(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 48 finding 4: TE's delayed-scaling cast max-reduces the evaluation's amaxes into
    ``amax_history[0]`` under no_grad; the next step's update then used max(eval, train).
    Train-eval-train equals train-train bitwise; without the guard it does not."""
    from lptrain.precision import te_adapter

    plain = _train_eval_train(cache, with_eval=False)
    assert _train_eval_train(cache, with_eval=True) == plain
    import contextlib

    monkeypatch.setattr(te_adapter, "forward_amax_slots_kept", lambda model: contextlib.nullcontext())
    assert _train_eval_train(cache, with_eval=True) != plain


def _weight_casts(cache: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[int, int]:
    """(TE weight casts in one step of 2 micro-batches, TE linears) on TE's own Python."""
    with virtual_gpu("sm90", te=True):
        import transformer_engine_torch as tex

        engine = _engine([*E4M3_TENSORWISE, *NO_BF16_EDGES], cache)
        weights = {p.data_ptr() for n, p in engine.model.named_parameters() if n.endswith("weight") and p.dim() == 2}  # type: ignore[attr-defined]
        casts = []
        real = tex.quantize

        def counting(tensor: torch.Tensor, quantizer: object, *a: object, **k: object) -> object:
            if isinstance(tensor, torch.Tensor) and tensor.data_ptr() in weights:
                casts.append(tensor.data_ptr())
            return real(tensor, quantizer, *a, **k)

        monkeypatch.setattr(tex, "quantize", counting)
        engine.train_step(next(_batches(engine, cache)), 1)
        monkeypatch.setattr(tex, "quantize", real)
        linears = sum(1 for m in engine.model.modules() if type(m).__module__.startswith("transformer_engine")  # type: ignore[attr-defined]
                      or "TEParallel" in type(m).__name__)
    return len(casts), linears


E4M3_TENSORWISE = ["precision.fp8_format=e4m3", "precision.fp8_recipe=tensorwise"]


def test_each_te_weight_is_cast_once_per_step(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 48 finding 5: TE's modules get Megatron's ``is_first_microbatch`` (the first
    micro-batch casts and caches each bf16 weight, the others reuse it); with ``None``, as
    before, TE cast every weight on every micro-batch (2 here)."""
    import contextlib

    from lptrain.precision import te_adapter

    casts, linears = _weight_casts(cache, monkeypatch)
    assert linears > 0 and casts == linears, (casts, linears)
    monkeypatch.setattr(te_adapter, "micro_batch", lambda first: contextlib.nullcontext())
    casts, linears = _weight_casts(cache, monkeypatch)
    assert casts == 2 * linears, (casts, linears)
