"""Rank-side functions for the data-parallel engine tests (module-level: they are pickled).

Each function runs several configurations inside ONE spawned world (process start-up costs
seconds on this machine, a tiny training step milliseconds) and returns plain results; the
parent test compares them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from lptrain.testing.parity import train_steps

TINY = "tiny_cpu.yaml"
BASE = [
    "data.builtin_max_mb=1",
    "train.eval_iters=1",
    "logging.progress=false",
    "optimizer.warmup_iters=0",
    "optimizer.lr=0.01",  # large enough to amplify any mismatch
]
DISTOPT = ["ddp.use_distributed_optimizer=true"]
OVERLAP = ["ddp.overlap_grad_reduce=true", "ddp.overlap_param_gather=true", "ddp.bucket_size=20000"]
NO_OVERLAP = ["ddp.bucket_size=20000"]
MOE = [
    "model.moe.num_experts=4",
    "model.moe.router_topk=2",
    "model.moe.ffn_hidden_size=64",
    "model.moe.grouped_gemm=true",
]
EMU = ["precision.backend=emulated"]
TENSORWISE = [*EMU, "precision.fp8_format=e4m3", "precision.fp8_recipe=tensorwise"]
BLOCKWISE = [*EMU, "precision.fp8_format=e4m3", "precision.fp8_recipe=blockwise"]
MXFP8 = [*EMU, "precision.fp8_format=e4m3", "precision.fp8_recipe=mxfp8"]
DELAYED = [*EMU, "precision.fp8_format=hybrid", "precision.fp8_recipe=delayed", "precision.fp8_amax_history_len=16"]
NVFP4 = [*EMU, "precision.fp4_format=e2m1", "precision.fp4_recipe=nvfp4"]
FP8_PG = ["precision.fp8_param_gather=true"]
FP4_PG = ["precision.fp4_param_gather=true"]
REUSE = ["ddp.reuse_grad_buf_for_mxfp8_param_ag=true"]


def run_cases(
    rank: int, world: int, cases: dict[str, Sequence[str]], steps: int = 3, **kw: Any
) -> dict[str, dict[str, Any]]:
    """``{case: train_steps(...)}`` for every case (overrides appended to BASE)."""
    return {
        name: train_steps(TINY, [*BASE, *ov], steps=steps, **kw) for name, ov in cases.items()
    }


def run_case_variants(
    rank: int, world: int, overrides: Sequence[str], variants: dict[str, dict[str, Any]], steps: int = 3
) -> dict[str, dict[str, Any]]:
    """Same config, different ``train_steps`` keyword arguments (eval_every, sync_after...)."""
    return {
        name: train_steps(TINY, [*BASE, *overrides], steps=steps, **kw) for name, kw in variants.items()
    }


def run_config_variants(
    rank: int, world: int, configs: dict[str, Sequence[str]], variants: dict[str, dict[str, Any]], steps: int = 3
) -> dict[str, dict[str, dict[str, Any]]]:
    """``{config: {variant: train_steps(...)}}``."""
    return {
        c: {v: train_steps(TINY, [*BASE, *ov], steps=steps, **kw) for v, kw in variants.items()}
        for c, ov in configs.items()
    }


def run_stale_dispatch(rank: int, world: int, overrides: Sequence[str], remove_fix: bool) -> dict[str, Any]:
    """Train-only vs train-eval-train. With ``remove_fix``, restaging right after a forced
    sync no longer resets the bucket's dispatch state: the upstream stale
    ``param_gather_dispatched`` flag, reproduced on lptrain's state machine."""
    import contextlib

    from lptrain.distributed.bucket_group import Bucket, ParamState
    from lptrain.distributed.ddp import DataParallel
    from lptrain.testing.parity import patched

    out = {"train": train_steps(TINY, [*BASE, *overrides], steps=4)}
    if not remove_fix:
        out["eval"] = train_steps(TINY, [*BASE, *overrides], steps=4, eval_every=1)
        return out
    fixed_mark_staged = Bucket.mark_staged
    fixed_params_synced = DataParallel.params_synced
    in_forced_sync = [False]

    def stale_mark_staged(self: Bucket) -> None:
        stale = getattr(self, "_forced", False) and not in_forced_sync[0]
        if self.param_state is ParamState.READY and stale:
            self._forced = False  # type: ignore[attr-defined]
            return  # the bug: still counted as gathered, so the pre-hooks skip it
        fixed_mark_staged(self)

    @contextlib.contextmanager
    def flagging_params_synced(self: DataParallel, stage: Any) -> Any:
        in_forced_sync[0] = True
        try:
            with fixed_params_synced(self, stage):
                in_forced_sync[0] = False
                yield
        finally:
            in_forced_sync[0] = False
        for b in self.gathered_buckets():
            b._forced = True  # type: ignore[attr-defined]

    with patched(Bucket, "mark_staged", stale_mark_staged), patched(
        DataParallel, "params_synced", flagging_params_synced
    ):
        out["eval"] = train_steps(TINY, [*BASE, *overrides], steps=4, eval_every=1)
    return out


def run_deferred_param_sync(rank: int, world: int, overrides: Sequence[str]) -> dict[str, Any]:
    """Dense + expert optimizers, MXFP8 reuse, overlap off: the fixed chained step, a step
    that syncs after the first child (refused by the state machine), and the same with the
    state check bypassed (what upstream did: expert weights receive zeros)."""
    from lptrain.distributed.bucket_group import ParamState
    from lptrain.optim.chained import ChainedOptimizer
    from lptrain.testing.parity import patched

    def expert_zero_fraction(result: dict[str, Any]) -> float:
        """Fraction of expert weight tensors (canonical, per expert) that are all zeros."""
        vals = [v for k, v in result["canonical"].items() if "expert" in k]
        assert vals, "no expert weights found"
        return sum(bool((v == 0).all()) for v in vals) / len(vals)

    out: dict[str, Any] = {}
    out["fixed_expert_zero_fraction"] = expert_zero_fraction(train_steps(TINY, [*BASE, *overrides], steps=1))
    engine_ref: dict[str, Any] = {}

    def grab(engine: Any, step: int) -> None:
        engine_ref["e"] = engine

    def eager_stage(self: ChainedOptimizer) -> None:  # the bug: sync after each child
        for child in self.children:
            child.stage()
            engine_ref["e"].ddp.sync_params()

    with patched(ChainedOptimizer, "stage", eager_stage):
        try:
            train_steps(TINY, [*BASE, *overrides], steps=1, before_step=grab)
            out["strict_error"] = ""
        except Exception as e:  # the state machine refuses to gather an unstaged bucket
            out["strict_error"] = f"{type(e).__name__}: {e}"

    def unchecked_sync(self: Any, buckets: Any = None) -> None:
        for b in self.gathered_buckets():
            if b.param_state is ParamState.READY:
                b.param_state = ParamState.STAGED  # what a flag-less engine would do
            b.finish_param_sync()

    from lptrain.distributed.ddp import DataParallel

    with patched(ChainedOptimizer, "stage", eager_stage), patched(DataParallel, "sync_params", unchecked_sync):
        res = train_steps(TINY, [*BASE, *overrides], steps=1, before_step=grab)
    out["unchecked_expert_zero_fraction"] = expert_zero_fraction(res)
    return out


def run_nan_injection(rank: int, world: int, overrides: Sequence[str]) -> dict[str, Any]:
    """Rank 1 gets a NaN in one parameter's gradient at step 2."""
    name = "layers.1.mlp.linear_fc2.weight"

    def inject(engine: Any, step: int) -> None:
        p = dict(engine.model.named_parameters())[name]
        if step == 2 and rank == 1:
            engine._nan_hook = p.register_hook(lambda g: g * float("nan"))
        elif getattr(engine, "_nan_hook", None) is not None:
            engine._nan_hook.remove()
            engine._nan_hook = None

    skipped: list[bool] = []
    from lptrain.train.engine import TrainEngine

    orig = TrainEngine.train_step

    def record(self: Any, mb: Any, step: int) -> Any:
        res = orig(self, mb, step)
        skipped.append(res.skipped)
        return res

    from lptrain.testing.parity import patched

    with patched(TrainEngine, "train_step", record):
        train_steps(TINY, [*BASE, *overrides], steps=3, before_step=inject)
    return {"skipped": skipped}
