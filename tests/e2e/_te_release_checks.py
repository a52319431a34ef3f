"""Checks of lptrain's version-gated TE paths on one TE release (run in a subprocess: one TE
per process), printing one JSON object. ``LPTRAIN_TE_PYTHON`` names the folder;
``probe_unfixed`` runs the probe check with the code its fix replaced, so the caller can
show the check fails without it. Used by tests/e2e/test_te_python_releases.py."""

from __future__ import annotations

import argparse
import json
import sys
import traceback
from pathlib import Path
from typing import Any

import torch


def _old_probe_copy(q: Any) -> Any:
    """The statistics probe's quantizer copy before issue 48 (keeps ``internal``, shares the
    delayed-scaling amax buffer)."""
    c = q.copy()
    c.set_usage(rowwise=True, columnwise=False)
    if hasattr(c, "optimize_for_gemm"):
        c.optimize_for_gemm = False
    return c


def probe(unfixed: bool) -> dict[str, Any]:
    """Issue 48 findings 1 and 3: a TE Linear's forward quantizer (internal after TE's forward)
    copied by the probe gives block statistics, not a crash (no ``.shape`` on 2.9-2.18's
    storage) or plain ones (``*TensorBase`` unread up to 2.8); and the copy's cast of another
    input leaves the module's amax history as it was."""
    from lptrain.precision import operand_stats as S
    from lptrain.precision import te_numerics as N
    from lptrain.testing.fake_gpu import virtual_gpu

    out: dict[str, Any] = {}
    copy = _old_probe_copy if unfixed else N._probe_copy
    readers = N.READERS
    if unfixed:  # the readers before the fix: no *TensorBase (TE <= 2.8's storage classes)
        N.READERS = {k: v for k, v in readers.items() if not k.endswith("Base")}
    with virtual_gpu("sm90", te=True) as vc:
        from transformer_engine.common import recipe as R

        from lptrain.precision import te_adapter

        out["te"] = vc.te_backend
        torch.manual_seed(0)
        lin = te_adapter.te_linear(64, 64)
        x = torch.randn(64, 64, device="cuda", dtype=torch.bfloat16)
        with te_adapter.te_autocast(R.DelayedScaling(amax_history_len=4)):
            lin(x.requires_grad_())
        q = lin.quantizers["scaling_fwd"][0]
        out["internal_after_forward"] = bool(getattr(q, "internal", False))
        hist = lin.fp8_meta["scaling_fwd"].amax_history
        before = hist.clone()
        try:
            qt = copy(q)(x * 3)
            out["class"] = type(qt).__name__
            vec = N._vector(qt, x * 3)
            out["block_stats"] = not torch.equal(vec, S.plain_stats(x * 3))
        except AttributeError as e:
            out["class"], out["error"] = "AttributeError", str(e)
        out["history_kept"] = bool(torch.equal(hist, before))
    N.READERS = readers
    return out


def grouped_masters() -> dict[str, bool]:
    """Issue 48 round 2 finding 2 on a release whose ``make_grouped_weights`` drops the
    members' kept init values (2.18): the single grouped weight's fp32 masters start from the
    members' init values with lptrain's carry-over, and from the MXFP8-rounded bytes with TE's
    ``make_grouped_weights`` alone (the adapter as it was)."""
    from lptrain.precision import param_storage, te_adapter, te_storage
    from lptrain.testing.fake_gpu import virtual_gpu

    out: dict[str, bool] = {}
    for carry in (True, False):
        values: list[torch.Tensor] = []
        g = torch.Generator().manual_seed(7)

        def init(w: torch.Tensor, g: torch.Generator = g, values: list[torch.Tensor] = values) -> None:
            v = torch.randn(tuple(w.shape), generator=g).to(w.dtype)
            values.append(v.clone())
            with torch.no_grad():
                w.copy_(v)

        with virtual_gpu("sm100", te=True):
            import transformer_engine.common.recipe as ter

            cls = te_adapter._te_grouped_linear_cls()
            own = cls.__dict__.get("make_grouped_weights")
            if not carry:
                cls.make_grouped_weights = cls.__mro__[1].make_grouped_weights
            try:
                with te_adapter.te_model_init(ter.MXFP8BlockScaling(fp8_format=ter.Format.E4M3)):
                    m = te_adapter.te_grouped_linear(4, 64, 128, single_grouped_weight=True,
                                                     params_dtype=torch.bfloat16, init_method=init)
            finally:
                if own is not None:
                    cls.make_grouped_weights = own
            value = param_storage.high_precision_value(m.weight).cpu()
            rounded = torch.stack([x.dequantize().float() for x in te_storage.grouped_members(m.weight)]).cpu()
        key = "carried" if carry else "uncarried"
        out[f"{key}_is_init"] = bool(torch.equal(value, torch.stack(values).float()))
        out[f"{key}_is_rounded"] = bool(torch.equal(value, rounded))
    return out


def engine_steps() -> dict[str, Any]:
    """Two training steps, an evaluation and the checkpoint state on the virtual GPU for the
    recipes this release has (blockwise with its byte param gather: reshapes refused up to
    2.13)."""
    from lptrain.config.compose import load
    from lptrain.testing import te_python
    from lptrain.testing.fake_gpu import fake_gpu_steps

    te_python.load()
    v = tuple(int(p) for p in (te_python.version() or "0").split(".")[:2])
    runs = {"delayed": ("sm90", ["precision.fp8_recipe=delayed", "precision.fp8_format=hybrid"]),
            "blockwise-param-gather": ("sm90", ["precision.fp8_recipe=blockwise", "precision.fp8_format=e4m3",
                                                "precision.fp8_param_gather=true",
                                                "ddp.use_distributed_optimizer=true"])}
    if v >= (2, 8):
        runs["nvfp4"] = ("sm100", ["precision.fp4_format=e2m1"])
    out = {}
    for name, (target, ov) in runs.items():
        cfg = load("tiny_cpu.yaml", ["precision.backend=te", *ov]).cfg
        report = fake_gpu_steps(cfg, target, steps=2)
        out[name] = report.losses
    return out


def adam() -> list[str]:
    """TE's own FusedAdam against the emulation (lptrain.testing.adam_parity): on TE <= 2.13
    the kernels take fp32 moments only, and TE's Python unscales bf16 moments before them."""
    from lptrain.config import World, compose, derive
    from lptrain.testing import adam_parity
    from lptrain.testing.fake_gpu import virtual_gpu

    cfg = derive(compose("tiny_cpu.yaml", ["optimizer.use_precision_aware_optimizer=true",
                                           "ddp.use_distributed_optimizer=true"]), World(dp=1))
    with virtual_gpu("sm90", te=True):
        return adam_parity.mismatches(cfg.optimizer)


def versions() -> dict[str, Any]:
    """What the release runs of each recipe on its GPU, of blockwise on Blackwell (TE's own
    error where it refuses), and whether a single grouped expert weight trains
    (lptrain.testing.te_builds): the caller holds the rules' TE version table to it."""
    from lptrain.testing import te_builds

    try:
        blockwise_sm100: Any = te_builds.builds(te_builds.RECIPES["blockwise"], "sm100")
    except Exception as e:  # TE's own refusal
        blockwise_sm100 = f"{type(e).__name__}: {e}"
    return {"builds": {name: te_builds.builds(ov, te_builds.GPU[name]) for name, ov in te_builds.RECIPES.items()},
            "blockwise_sm100": blockwise_sm100, "trains_experts": te_builds.trains_experts()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default="probe,engine")
    args = ap.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    result: dict[str, Any] = {}
    try:
        if "probe" in args.only:
            result["probe"] = probe(unfixed=False)
            result["probe_unfixed"] = probe(unfixed=True)
        if "engine" in args.only:
            result["engine"] = engine_steps()
        if "grouped" in args.only:
            result["grouped"] = grouped_masters()
        if "adam" in args.only:
            result["adam"] = adam()
        if "versions" in args.only:
            result["versions"] = versions()
    except Exception:  # the caller shows it
        result["exception"] = traceback.format_exc()
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
