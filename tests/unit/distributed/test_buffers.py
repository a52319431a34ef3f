"""Buffers at DP=1 (no processes): storage placement, main_grad views, the bucket state
machine, and the aliasing of params into buffer storage (a param remapped into a buffer must
be a view of it, and a grouped quantized weight cannot be)."""

from __future__ import annotations

import pytest
import torch

from lptrain.config import World, derive
from lptrain.config.compose import load
from lptrain.distributed.bucket_group import IllegalTransition, ParamState
from lptrain.precision.param_storage import is_quantized
from lptrain.train.engine import TrainEngine

BASE = ["data.builtin_max_mb=1", "logging.progress=false", "checkpoint.save=null",
        "ddp.use_distributed_optimizer=true", "precision.backend=emulated"]
MOE = ["model.moe.num_experts=4", "model.moe.router_topk=2", "model.moe.ffn_hidden_size=64",
       "model.moe.grouped_gemm=true", "model.moe.single_grouped_weight=true"]


def _engine(*overrides: str) -> TrainEngine:
    return TrainEngine(derive(load("tiny_cpu.yaml", [*BASE, *overrides]).cfg, World(dp=1)))


def _inside(t: torch.Tensor, buf: torch.Tensor) -> bool:
    lo = buf.data_ptr()
    hi = lo + buf.numel() * buf.element_size()
    return lo <= t.data_ptr() and t.data_ptr() + t.numel() * t.element_size() <= hi


@pytest.mark.parametrize("precision", [
    [],
    ["precision.fp8_format=e4m3", "precision.fp8_recipe=tensorwise", "precision.fp8_param_gather=true"],
    ["precision.fp8_format=e4m3", "precision.fp8_recipe=blockwise", "precision.fp8_param_gather=true"],
    ["precision.fp4_format=e2m1", "precision.fp4_param_gather=true"],
])
def test_storage_and_main_grads_are_views_into_the_buffers(precision: list[str]) -> None:
    """Plain params' data (single grouped bf16 expert weights included) and byte-gathered FP8
    row-wise bytes alias their param-buffer slice (data pointers); every main_grad is a view of
    the grad buffer at the layout's offset. NVFP4 primary weights are staged in bf16 and keep
    their own storage (their column-wise copy is quantized separately: see layout.py)."""
    e = _engine(*MOE, *precision)
    seen = 0
    for buf in e.ddp.buffers:
        assert buf.param_data is not None
        for name, p in buf.params.items():
            s = buf.slots[name]
            assert p.main_grad.data_ptr() == buf.grad_data[s.start:].data_ptr()
            assert p.main_grad.shape == p.shape
            if not is_quantized(p):
                assert p.data_ptr() == buf.param_data[s.start:].data_ptr(), name
                seen += 1
            elif buf.param_data.dtype == torch.uint8:
                raw = p.storage_views()["rowwise_data"]
                assert raw.data_ptr() == buf.param_data[s.start:].data_ptr(), name
                seen += 1
            else:
                assert not any(_inside(v, buf.param_data) for v in p.storage_views().values())
    assert seen > 0
    grouped = [n for n, p in e.model.named_parameters() if p.dim() == 3]
    assert grouped, "the single grouped expert weights should be 3-D params"


def test_a_gather_updates_aliased_params_in_place() -> None:
    """Writing a bucket's staging slice and syncing is what refreshes the model."""
    e = _engine()
    (buf,) = [b for b in e.ddp.buffers if b.sharded]
    name, p = next(iter(buf.params.items()))
    s = buf.slots[name]
    before = p.detach().clone()
    buf.param_data[s.start:s.end].add_(1.0)
    for b in buf.buckets:
        b.mark_staged()
    e.ddp.sync_params()
    assert torch.equal(p.detach(), before + 1.0)
    assert all(b.param_state is ParamState.READY for b in buf.buckets)


def test_state_machine_refuses_illegal_transitions() -> None:
    e = _engine()
    bucket = e.ddp.gathered_buckets()[0]
    with pytest.raises(IllegalTransition, match="has not staged this bucket"):
        bucket.finish_param_sync()  # nothing staged: gathering now would load stale values
    bucket.mark_staged()
    bucket.mark_staged()  # restaging overwrites: allowed
    bucket.start_param_sync(async_op=False)
    assert bucket.param_state is ParamState.READY
    bucket.start_grad_sync(False, 1.0, False, async_op=False)
    with pytest.raises(IllegalTransition, match="start_grad_sync needs idle"):
        bucket.start_grad_sync(False, 1.0, False, async_op=False)  # reduced twice in one step
    bucket.zero_grads()
    name = bucket.param_names[0]
    for other in bucket.param_names[1:]:
        bucket.register_grad_ready(other, False, 1.0, False)
    bucket.register_grad_ready(name, False, 1.0, False)  # the last one dispatches the bucket
    with pytest.raises(IllegalTransition, match="reported ready twice"):
        bucket.register_grad_ready(name, False, 1.0, False)


def test_grouped_mxfp8_primary_weights_need_grad_buffer_reuse() -> None:
    """Grouped MXFP8 primary weights cannot be remapped into a flat buffer; the rule
    catalog refuses them without grad-buffer reuse, before anything is built."""
    from lptrain.config.check import check, has_errors

    ov = [*BASE, *MOE, "precision.fp8_format=e4m3", "precision.fp8_recipe=mxfp8",
          "precision.fp8_param_gather=true"]
    bad = check(load("tiny_cpu.yaml", ov).cfg, World(dp=2))
    assert has_errors(bad) and any("reuse_grad_buf_for_mxfp8_param_ag" in " ".join(v.keys) for v in bad)
    ok = check(load("tiny_cpu.yaml", [*ov, "ddp.reuse_grad_buf_for_mxfp8_param_ag=true"]).cfg, World(dp=2))
    assert not has_errors(ok), ok
