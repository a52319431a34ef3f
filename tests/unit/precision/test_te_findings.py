"""Regression tests for what a read of Transformer Engine's source found in lptrain's TE path
(each crashed or silently differed on a real TE while the stand-in hid it), on TE's own Python
(newest release; the single grouped weight on its native grouped-tensor path, whose kernels
lptrain.testing.te_python.kernels.grouped emulates). Finding 2 on TE 2.18 (which drops the
members' init values) runs in that release's subprocess: tests/e2e/test_te_python_releases.py.

Finding 3 (the single grouped weight's minimum TE) is in tests/unit/config/test_te_versions.py,
finding 6 (recompute early stop) in tests/unit/model/test_recompute.py, finding 7 (no
build-time ``main_grad``) in tests/unit/precision/test_device_and_backend.py, finding 8 (the
version gates) in tests/unit/precision/test_te_manifest.py.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from lptrain.precision import param_storage, te_adapter, te_storage
from lptrain.testing.fake_gpu import virtual_gpu

N, OUT, IN = 4, 128, 64


def _recorded_init(values: list[torch.Tensor]) -> Callable[[torch.Tensor], None]:
    """An init method that draws from a fixed generator and records what it wrote."""
    g = torch.Generator().manual_seed(7)

    def init(w: torch.Tensor) -> None:
        v = torch.randn(tuple(w.shape), generator=g).to(w.dtype)
        values.append(v.clone())
        with torch.no_grad():
            w.copy_(v)

    return init


def _grouped_mxfp8(init: Callable[[torch.Tensor], None]) -> torch.nn.Module:
    import transformer_engine.common.recipe as ter

    with te_adapter.te_model_init(ter.MXFP8BlockScaling(fp8_format=ter.Format.E4M3)):
        return te_adapter.te_grouped_linear(N, IN, OUT, single_grouped_weight=True,
                                            params_dtype=torch.bfloat16, init_method=init)


# ---- finding 1: the grouped tensor has no quantize_ ---------------------------------------------


def test_a_grouped_weight_takes_the_gathered_values_through_tes_grouped_api() -> None:
    """After a bf16 param gather the grouped weight is requantized through TE's grouped
    storage API (``quantize(list)``): every member then holds the MXFP8 of its slice, bytes
    and scales equal to quantizing that slice alone. The old path called ``quantize_``,
    which TE's ``GroupedTensor`` does not have."""
    with virtual_gpu("sm100", te=True):
        m = _grouped_mxfp8(_recorded_init([]))
        p = m.weight
        staged = torch.randn(N * OUT * IN, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
        param_storage.load_from_staging(p, staged.to("cuda"))
        quantizer = te_storage.grouped_members(p)[0]._get_quantizer()
        for i, member in enumerate(te_storage.grouped_members(p)):
            alone = quantizer.quantize(staged.view(N, OUT, IN)[i].to("cuda"))
            for attr in ("_rowwise_data", "_rowwise_scale_inv", "_columnwise_data", "_columnwise_scale_inv"):
                assert torch.equal(getattr(member, attr), getattr(alone, attr)), (i, attr)
        assert not hasattr(p, "quantize_")
        with pytest.raises(AttributeError, match="quantize_"):
            te_storage.load_from_staging(p, staged.to("cuda"))  # the old path


# ---- finding 2: make_grouped_weights drops the members' init values -----------------------------


def test_grouped_masters_start_from_the_members_init_values(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fp32 masters of a single grouped weight start from the members' high-precision
    init values, stacked -- not from the MXFP8-rounded bytes. TE 2.19+ moves the members'
    kept values when it packs them (2.18 drops them, and lptrain's ``make_grouped_weights``
    carries them over: tests/e2e/test_te_python_releases.py runs that release)."""
    def masters(carry: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        values: list[torch.Tensor] = []
        with virtual_gpu("sm100", te=True):
            if not carry:  # the adapter as it was: TE's make_grouped_weights alone
                cls = te_adapter._te_grouped_linear_cls()
                monkeypatch.setattr(cls, "make_grouped_weights", cls.__mro__[1].make_grouped_weights)
            m = _grouped_mxfp8(_recorded_init(values))
            value = param_storage.high_precision_value(m.weight).cpu()
            rounded = torch.stack([x.dequantize().float() for x in te_storage.grouped_members(m.weight)]).cpu()
            monkeypatch.undo()
        return value, torch.stack(values).float(), rounded

    for carry in (True, False):
        value, init, rounded = masters(carry)
        assert torch.equal(value, init) and not torch.equal(init, rounded), carry


# ---- finding 4: TE 2.19's grouped-tensor path ------------------------------------------------


def test_te_pads_single_grouped_mxfp8_experts_to_128_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    """TE 2.19's grouped MXFP8 quantization needs each expert's rows to be a multiple of 128;
    lptrain pads single grouped MXFP8 experts to that on TE (the recipe's 32 elsewhere), and
    emulated grouped quantize refuses the old padding (TE's kernel checks only the total, and
    its grouped GEMM then reads the members' swizzled scales from the wrong tiles)."""
    from lptrain.config import load
    from lptrain.precision.factory import build_factory

    cfg = load("moe_mxfp8.yaml", []).cfg
    with virtual_gpu("sm100", te=True):
        factory = build_factory(cfg.precision, num_layers=2, run_cfg=cfg)
        assert factory.backend == "te"
        assert factory.grouped_alignment_for(single_grouped_weight=True) == 128
        assert factory.grouped_alignment_for(single_grouped_weight=False) == 32
        import transformer_engine.common.recipe as ter

        m = _grouped_mxfp8(_recorded_init([]))
        x = torch.randn(4 * 128, IN, device="cuda", dtype=torch.bfloat16)
        with te_adapter.te_autocast(ter.MXFP8BlockScaling(fp8_format=ter.Format.E4M3)):
            m(x, [128, 256, 0, 128])
            with pytest.raises(RuntimeError, match="divisible by 128"):
                m(x[:4 * 32], [32, 64, 0, 32])  # the recipe's padding alone


def test_the_grouped_tensor_path_refuses_an_old_cublaslt() -> None:
    """On CUDA 12.9 (cuBLASLt 12.9) TE 2.19+ refuses a single grouped weight at its first GEMM
    (the rule MOE-SGW-TE-GROUPED-PATH says so before a run); on 13.3 it runs."""
    for cuda, ok in (("12.9", False), ("13.3", True)):
        with virtual_gpu("sm100", te=True, cuda_version=cuda):
            import transformer_engine.common.recipe as ter

            m = _grouped_mxfp8(_recorded_init([]))
            x = torch.randn(256, IN, device="cuda", dtype=torch.bfloat16)
            with te_adapter.te_autocast(ter.MXFP8BlockScaling(fp8_format=ter.Format.E4M3)):
                if ok:
                    m(x, [128, 128, 0, 0])
                else:
                    with pytest.raises(RuntimeError, match="grouped-tensor path"):
                        m(x, [128, 128, 0, 0])


# ---- finding 5: nn.Module.to() drops a traceable parameter's __dict__ ---------------------------


def test_te_models_keep_their_init_values_through_the_build(monkeypatch: pytest.MonkeyPatch) -> None:
    """From TE 2.19 quantized tensors are traceable wrapper subclasses: ``model.to(device)``
    swaps each for a fresh parameter and its ``__dict__`` -- the kept init value -- is gone,
    so fp8_param_gather masters would start from dequantized FP8. lptrain builds in place
    and never moves the model (TE's own Python, newest release: the values are kept). The
    old build's loss (``.to()`` swapping each traceable parameter) is not shown here: on the
    virtual GPU a tensor already "on" the device is not moved, so ``.to()`` swaps nothing."""
    from lptrain.config import load
    from lptrain.model import build as build_mod
    from lptrain.precision.factory import build_factory

    cfg = load("tiny_cpu.yaml", ["precision.backend=te", "run.device=cuda", "precision.params_dtype=bf16",
                                 "precision.fp8_format=e4m3", "precision.fp8_recipe=tensorwise",
                                 "precision.fp8_param_gather=true", "ddp.use_distributed_optimizer=true"]).cfg

    def kept() -> list[bool]:
        with virtual_gpu("sm90", te=True):
            factory = build_factory(cfg.precision, num_layers=cfg.model.num_layers, run_cfg=cfg)
            model = build_mod.build_model(cfg, factory)
            quantized = [p for p in model.parameters() if param_storage.is_quantized(p)]
            assert quantized
            return [te_adapter._kept_init(p) is not None for p in quantized]

    assert all(kept())


# ---- the parity snapshot of a grouped weight ----------------------------------------------------


def test_the_parity_snapshot_copies_a_grouped_weights_bytes() -> None:
    """``lptrain.testing.parity.train_steps`` on ``moe_mxfp8_cpu.yaml`` with the TE backend
    raised RecursionError: its raw snapshot took ``p.detach().clone()`` of TE's single grouped
    MXFP8 weight, which is not lptrain's ``QuantizedTensor``. TE's ``GroupedTensor`` dispatch
    dequantizes and stacks its members for that (a bf16 copy, not the bytes the snapshot
    promises); each member's dequantize moves itself to CUDA first when its buffers do not say
    ``cuda``, which inside a dispatch handler on the virtual GPU they do not, and that move is
    itself a dequantize. The snapshot now copies the storage's bytes and scales
    (``param_storage.storage_views``), each a copy equal to TE's buffer."""
    from lptrain.testing import parity

    with virtual_gpu("sm100", te=True):
        p = _grouped_mxfp8(_recorded_init([])).weight
        snap = parity._param_snapshot(p)
        assert {"rowwise_data", "scale_inv", "columnwise_data", "columnwise_scale_inv"} <= set(snap), sorted(snap)
        for name, copy in snap.items():
            raw = getattr(p, name)
            assert torch.equal(copy, raw) and copy.dtype == raw.dtype, name
            assert copy.untyped_storage().data_ptr() != raw.untyped_storage().data_ptr(), name
        with pytest.raises(RecursionError):  # the snapshot before the fix
            p.detach().clone()
