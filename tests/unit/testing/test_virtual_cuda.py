"""The virtual CUDA device enforces CUDA's device rules on real CPU values.

Each rule is shown both ways: the op a GPU refuses raises :class:`DeviceRuleError` naming the
rule and the operands, and the legal neighbour of it (a 0-dim host scalar, an explicit copy)
runs. The device model itself is checked too: placements follow views, ``.data`` and
``nn.Module.to``; backward passes and custom autograd functions see device tensors as
``cuda``; host syncs are counted; ``torch.cuda`` answers as one GPU; an NCCL group's
collectives demand device tensors.
"""

from __future__ import annotations

import datetime

import pytest
import torch
import torch.distributed as dist

from lptrain.testing.virtual_cuda import DeviceRuleError, VirtualCuda, is_device


def test_factories_and_moves_place_on_the_device() -> None:
    with VirtualCuda():
        a = torch.zeros(3, device="cuda")
        b = torch.ones(3).to("cuda")
        c = torch.ones(3).cuda()
        with torch.device("cuda"):
            d = torch.randn(2)
        m = torch.nn.Linear(3, 2).to(torch.device("cuda", 0))
        host = torch.ones(3)
        for t in (a, b, c, d, a + 1, a.view(3, 1), a[1:], m.weight, m.bias):
            assert is_device(t) and t.device == torch.device("cuda", 0) and t.is_cuda
        assert not is_device(host) and host.device.type == "cpu" and not host.is_cuda
        p = torch.nn.Parameter(torch.zeros(3))
        p.data = torch.zeros(3, device="cuda")
        assert is_device(p)
        back = a.cpu()
        assert not is_device(back) and back.device.type == "cpu"
    assert not torch.cuda.is_available()  # restored


def test_mixing_device_and_host_tensors_raises() -> None:
    with VirtualCuda() as vc:
        a = torch.zeros(4, device="cuda")
        with pytest.raises(DeviceRuleError, match=r"mixes device and host.*aten\.add\.Tensor"):
            _ = a + torch.ones(4)
        with pytest.raises(DeviceRuleError, match="tensor list"):
            torch.cat([a, torch.ones(4)])
        _ = a * torch.tensor(2.0)  # a 0-dim host tensor is a scalar input: legal on CUDA
        assert len(vc.violations) == 2


def test_in_place_write_of_device_results_into_a_host_tensor_raises() -> None:
    """The bug class of ``host_accumulator += device_scalar`` (a CPU 0-dim output)."""
    with VirtualCuda():
        total = torch.zeros((), dtype=torch.float64)
        sq = torch.ones(3, device="cuda").double().square().sum()
        with pytest.raises(DeviceRuleError, match="in-place op writes device results into a host tensor"):
            total += sq
        dev_total = torch.zeros((), dtype=torch.float64, device=sq.device)
        dev_total += sq
        assert float(dev_total) == 3.0


def test_random_op_on_device_needs_a_device_generator() -> None:
    with VirtualCuda() as vc:
        t = torch.empty(8, device="cuda")
        with pytest.raises(DeviceRuleError, match="host generator"):
            t.random_(generator=torch.Generator().manual_seed(0))
        torch.cuda.manual_seed(5)
        first = torch.empty(8, device="cuda").random_(0, 100)  # CUDA's default generator
        state = torch.cuda.get_rng_state()
        second = torch.empty(8, device="cuda").random_(0, 100)
        torch.cuda.set_rng_state(state)
        assert torch.equal(torch.empty(8, device="cuda").random_(0, 100), second)
        assert not torch.equal(first, second) and vc.generator.initial_seed() == 5


def test_host_syncs_are_counted_where_they_happen() -> None:
    with VirtualCuda() as vc:
        a = torch.arange(6.0, device="cuda")
        float(a.sum())
        a.tolist()
        a.cpu()
        (a > 2).nonzero()
        torch.ones(3).sum().item()  # a host tensor: no sync
        torch.cuda.synchronize()
        assert dict(vc.stats.syncs) == {"item": 1, "tolist": 1, "device-to-host copy": 1,
                                        "nonzero": 1, "torch.cuda.synchronize": 1}
        assert "test_virtual_cuda" not in vc.stats.sync_sites[0]  # named by lptrain frame or outside


def test_backward_and_custom_functions_see_device_tensors() -> None:
    seen = {}

    class Twice(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
            seen["forward"] = x.device.type
            return x * 2

        @staticmethod
        def backward(ctx, g: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
            seen["backward"] = g.device.type
            return g * torch.ones(g.shape, device=g.device)  # created where g lives

    with VirtualCuda():
        x = torch.randn(3, device="cuda", requires_grad=True)
        Twice.apply(x).sum().backward()
        assert is_device(x.grad)
    assert seen == {"forward": "cuda", "backward": "cuda"}


def test_torch_cuda_answers_as_one_gpu() -> None:
    with VirtualCuda(capability=(10, 0), name="NVIDIA B200") as vc:
        assert torch.cuda.is_available() and torch.cuda.device_count() == 1
        assert torch.cuda.get_device_capability() == (10, 0)
        assert torch.cuda.get_device_name() == "NVIDIA B200"
        big = torch.empty(1 << 20, dtype=torch.uint8, device="cuda")
        assert torch.cuda.max_memory_allocated() >= 1 << 20 == big.numel()
        del big
        assert vc.stats.bytes_now < 1 << 20


def test_nccl_group_collectives_demand_device_tensors(tmp_path) -> None:
    with VirtualCuda() as vc:
        dist.init_process_group("nccl", init_method=f"file://{tmp_path / 'store'}", rank=0,
                               world_size=1, timeout=datetime.timedelta(seconds=30))
        try:
            assert dist.get_backend() == "gloo"  # what really runs
            dist.all_reduce(torch.ones(2, device="cuda"))
            with pytest.raises(DeviceRuleError, match="collective on an NCCL process group gets host tensors"):
                dist.all_reduce(torch.ones(2))
            out = [None]
            dist.all_gather_object(out, {"a": 1})  # object collectives move their own pickles
            assert out == [{"a": 1}] and vc.stats.collectives["all_reduce"] == 2
        finally:
            dist.destroy_process_group()


def test_a_real_gpu_is_never_shadowed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(RuntimeError, match="real CUDA device"), VirtualCuda():
        pass
