"""The optimizer's part of the memory model: where its state lives and in which dtypes.

:func:`optimizer_layout` is the :class:`~lptrain.memory.accounting.OptimizerLayout` the
planner hands the accounting (layer-wise Muon owners, the scalar optimizer, and with the
precision-aware optimizer the stored dtypes of the moments and of the masters TE holds);
:func:`optimizer_state_dtypes` says the same in words for ``estimate-memory``.
"""

from __future__ import annotations

from typing import Optional

from lptrain.config.schema import LPTrainConfig
from lptrain.distributed.layout import BufferLayout
from lptrain.memory.accounting import OptimizerLayout


def optimizer_layout(cfg: LPTrainConfig, layout: BufferLayout, dense_n: int, expert_n: int) -> OptimizerLayout:
    """The run's optimizer state placement (layer-wise Muon owners planned once, over shard
    groups of ``dense_n`` / ``expert_n`` ranks) and the dtypes it is stored in."""
    from lptrain.optim.layerwise import plan_ownership
    from lptrain.optim.lion import scalar_optimizer_name

    o = cfg.optimizer
    layer_wise = bool(o.use_layer_wise_optimizer)
    muon_specs = [b for b in layout.buffers if b.key.is_muon] if layer_wise else []
    owners = (plan_ownership(muon_specs, dense_size=dense_n, expert_size=expert_n,
                             param_layout=o.layer_wise_param_layout) if muon_specs else {})
    if not o.use_precision_aware_optimizer:
        return OptimizerLayout(layer_wise, o.layer_wise_param_layout, owners, scalar_optimizer_name(o))
    from lptrain.optim.precision_aware import state_precision

    sp = state_precision(cfg)
    assert sp is not None
    te_master = ("remainders" if sp.remainders else sp.main_params) if sp.te_holds_masters else None
    return OptimizerLayout(layer_wise, o.layer_wise_param_layout, owners, scalar_optimizer_name(o),
                           precision_aware=True, exp_avg=sp.exp_avg, exp_avg_sq=sp.exp_avg_sq,
                           te_master=te_master)


def optimizer_state_dtypes(cfg: Optional[LPTrainConfig]) -> dict[str, str]:
    """How the optimizer stores its tensors (``cfg`` derived; None: without the
    precision-aware optimizer), as ``estimate-memory`` reports them."""
    from lptrain.catalog.optimizer_state import BYTES, SCALE_BYTES
    from lptrain.optim.precision_aware import state_precision

    sp = state_precision(cfg) if cfg is not None else None
    grads = sp.main_grads if sp is not None else "fp32"

    def stored(dtype: str) -> str:
        scale = f" + {SCALE_BYTES[dtype]} B of scale per optimizer tensor" if dtype in SCALE_BYTES else ""
        return f"{dtype} ({BYTES[dtype]} B/element{scale})"

    if sp is not None and sp.te_holds_masters and sp.remainders:
        masters = "held by TE: the bf16 param + an int16 remainder (2 B/element)"
    elif sp is not None and sp.te_holds_masters:
        masters = "held by TE: " + stored(sp.main_params)
    else:
        masters = "fp32 (4 B/element)"
    return {"main_grads": f"{grads} ({BYTES[grads]} B/element)", "masters": masters,
            "exp_avg": stored(sp.exp_avg if sp else "fp32"),
            "exp_avg_sq": stored(sp.exp_avg_sq if sp else "fp32")}
