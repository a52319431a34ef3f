"""Rank side of the Transformer Engine tensor-parallel test (module-level: pickled)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

BASE = ["data.builtin_max_mb=1", "train.eval_iters=1", "logging.progress=false", "run.device=cuda",
        "optimizer.warmup_iters=0", "train.global_batch_size=4", "train.micro_batch_size=2",
        "model.seq_length=64", "model.tensor_model_parallel_size=2", "model.sequence_parallel=true",
        "precision.fp8_format=e4m3", "precision.fp8_recipe=mxfp8"]


def te_vs_emulated(rank: int, world: int, cache: str, extra: Sequence[str] = ()) -> dict[str, Any]:
    """On one virtual sm100 GPU per rank, with TE's own Python (kernels emulated): 3 steps of
    TP 2 + SP on the TE backend and on the emulated one; the TE layers' tensor-parallel
    attributes as TE's own ``Linear.__init__`` set them."""
    from lptrain.testing.fake_gpu import virtual_gpu
    from lptrain.testing.parity import train_steps

    seen: dict[str, dict[str, Any]] = {}

    def record(engine: Any, step: int) -> None:
        if step == 1:
            for name, m in engine.model.named_modules():
                if type(m).__module__.startswith("transformer_engine") or "TEParallel" in type(m).__name__:
                    if getattr(m, "parallel_mode", None) in ("column", "row"):
                        seen[name] = {k: getattr(m, k) for k in ("tp_size", "parallel_mode", "sequence_parallel")}
                        seen[name]["tp_group_ranks"] = _ranks(m.tp_group)
                        seen[name]["weight"] = tuple(m.weight.shape)

    out: dict[str, Any] = {}
    with virtual_gpu("sm100", te=True) as vc:
        for backend in ("te", "emulated"):
            r = train_steps("tiny_cpu.yaml", [*BASE, f"data.cache_dir={cache}", f"precision.backend={backend}",
                                              *extra], steps=3, before_step=record if backend == "te" else None)
            out[backend] = r["losses"]
            out[f"{backend}_norms"] = r["grad_norms"]
        out["violations"] = list(vc.violations)
        out["te_backend"] = vc.te_backend
    out["layers"] = seen
    return out


def pipelined_te(rank: int, world: int, cache: str, steps: int = 2) -> dict[str, Any]:
    """PP 2 x TP 2 + SP on TE's own Python, as :func:`te_vs_emulated`'s TE run otherwise: the
    hidden states cross the stage boundary stored sequence-first (lptrain.model.layout), and
    each stage's TE linears get ``is_first_microbatch`` per micro-batch."""
    from lptrain.testing.fake_gpu import virtual_gpu
    from lptrain.testing.parity import train_steps

    with virtual_gpu("sm100", te=True):
        r = train_steps("tiny_cpu.yaml", [*BASE, f"data.cache_dir={cache}", "precision.backend=te",
                                          "model.pipeline_model_parallel_size=2"], steps=steps)
    return {"losses": r["losses"], "grad_norms": r["grad_norms"]}


def _ranks(pg: Any) -> Any:
    import torch.distributed as dist

    return None if pg is None else list(dist.get_process_group_ranks(pg))


def layout_copies(cache: str) -> dict[str, Any]:
    """Issue 48 finding 6: the activation copies (``clone`` / ``copy_`` of a 3-D tensor, outside
    TE's emulated kernels) in one forward and backward of a one-layer TP 2 + SP model on TE's
    own Python, at micro-batch 1 (where batch- and sequence-first storage coincide) and 2;
    per layer (inside the transformer layer's forward, and in the whole backward), and with
    the fix patched away (the layer stack batch-first and TE's linear wrapped as before)."""
    import functools

    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from lptrain.config import World, derive
    from lptrain.config.compose import load
    from lptrain.precision.layers import LayerFactory
    from lptrain.testing.fake_gpu import virtual_gpu
    from lptrain.train.engine import TrainEngine

    copies = (torch.ops.aten.clone.default, torch.ops.aten.copy_.default)

    class Counter(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.on, self.n = False, 0

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            if self.on and func in copies and args[-1].dim() == 3:
                self.n += 1
            return func(*args, **(kwargs or {}))

    counter = Counter()

    def outside(fn: Any) -> Any:  # TE's kernels (the emulation's own copies) are not counted
        @functools.wraps(fn)
        def call(*a: Any, **k: Any) -> Any:
            was, counter.on = counter.on, False
            try:
                return fn(*a, **k)
            finally:
                counter.on = was
        return call

    def run(mb: int) -> tuple[int, int, Any]:
        cfg = derive(load("tiny_cpu.yaml", [*BASE, f"data.cache_dir={cache}", "precision.backend=te",
                                            "model.num_layers=1", f"train.micro_batch_size={mb}",
                                            f"train.global_batch_size={mb}"]).cfg, World.detect())
        model = TrainEngine(cfg).model
        layer = model.layers[0]
        hooks = [layer.register_forward_pre_hook(lambda *a: setattr(counter, "on", True)),
                 layer.register_forward_hook(lambda *a: setattr(counter, "on", False))]
        tokens = torch.randint(0, 256, (mb, 64), generator=torch.Generator().manual_seed(3)).to("cuda")
        counter.n = 0
        with counter, model.autocast():
            loss, _ = model(tokens, labels=tokens)
        forward, counter.n, counter.on = counter.n, 0, True
        with counter:
            loss.backward()
        counter.on = False
        for h in hooks:
            h.remove()
        grads = {n: g.detach().clone() for n, p in model.named_parameters()
                 for g in (getattr(p, "main_grad", None), p.grad) if g is not None}
        return forward, counter.n, (loss.detach().clone(), grads)

    out: dict[str, Any] = {}
    with virtual_gpu("sm100", te=True):
        import transformer_engine_torch as tex

        for name in tex._lptrain_emulated:
            setattr(tex, name, outside(getattr(tex, name)))
        for mb in (1, 2):
            out[f"mb{mb}"] = run(mb)
        from lptrain.precision import te_adapter

        cls = te_adapter._te_parallel_linear_cls()
        real = LayerFactory.sequence_first_activations, cls.forward

        def old_forward(self: Any, inp: Any, *args: Any, **kw: Any) -> Any:  # the wrapper before the fix
            if not (self.sequence_parallel and inp.dim() == 3):
                return cls.__mro__[1].forward(self, inp, *args, **kw)
            out = cls.__mro__[1].forward(self, inp.transpose(0, 1).contiguous(), *args, **kw)
            return out.transpose(0, 1).contiguous()

        LayerFactory.sequence_first_activations = property(lambda self: False)  # type: ignore[assignment]
        cls.forward = old_forward
        try:
            out["before_fix_mb2"] = run(2)
        finally:
            LayerFactory.sequence_first_activations, cls.forward = real  # type: ignore[assignment]
    # the fix changes no bit: the loss and every parameter's gradient as before it
    (loss, grads), (loss0, grads0) = out["mb2"][2], out["before_fix_mb2"][2]
    out["bitwise_as_before"] = (torch.equal(loss, loss0) and grads.keys() == grads0.keys() and len(grads) > 0
                                and all(torch.equal(grads[n], grads0[n]) for n in grads))
    for key in ("mb1", "mb2", "before_fix_mb2"):
        out[key] = out[key][:2]
    return out


def battery(rank: int, world: int, cache: str) -> dict[str, Any]:
    """Both checks of tests/dist/test_tp_te.py in one spawn of two ranks."""
    return {**te_vs_emulated(rank, world, cache), "copies": layout_copies(cache)}
