"""The pre-engine single-process trainer (fp32 masters, grads accumulated in the params' own
.grad), kept as the reference the DP=1 engine is compared with in test_engine_baseline.py."""
from __future__ import annotations

import torch

from lptrain.config.schema import LPTrainConfig


def _master_copy(p: torch.Tensor) -> torch.Tensor:
    """The fp32 master of a model param.

    A quantized primary weight (FP8/FP4 param gather) is seeded from its high-precision init
    value, not from its dequantized bytes, so training starts from the true init; the
    model-side copy of that value is then freed.
    """
    from lptrain.precision.tensors import QuantizedTensor

    if isinstance(p, QuantizedTensor):
        init = p.high_precision_init_value()
        master = (init if init is not None else p.dequantize()).detach().float().clone()
        p.clear_high_precision_init_value()
        return master
    return p.detach().float().clone()


class MasterOptimizer:
    """AdamW, or Muon + AdamW, over fp32 master copies of (possibly bf16 or quantized) params.

    Why masters: updating bf16 params in place loses small updates to rounding; the masters
    keep full precision and the model params are refreshed from them after every step
    (``copy_`` into a quantized param requantizes it: fp32 -> params dtype -> quantize).
    The masters carry the model params' optimizer tags (``use_muon``, ``is_qkv``, ...), so
    Muon routing and the QKV split read the same explicit metadata the model set.
    """

    def __init__(self, model: torch.nn.Module, cfg: LPTrainConfig) -> None:
        from lptrain.optim.param_groups import copy_param_attributes, split_params_for_muon

        o = cfg.optimizer
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.masters = [copy_param_attributes(p, _master_copy(p)) for p in self.params]
        if o.name == "muon":
            from lptrain.optim.muon import MuonWithAdamW

            self.opt = MuonWithAdamW(*split_params_for_muon(self.masters), o)
        else:
            decay = [m for m in self.masters if m.ndim >= 2]
            no_decay = [m for m in self.masters if m.ndim < 2]
            self.opt = torch.optim.AdamW(
                [
                    {"params": decay, "weight_decay": o.weight_decay},
                    {"params": no_decay, "weight_decay": 0.0},
                ],
                lr=o.lr,
                betas=(o.adam_beta1, o.adam_beta2),
                eps=o.adam_eps,
            )
        self.clip = o.clip_grad

    def step(self, lr: float) -> float:
        for p, m in zip(self.params, self.masters, strict=True):
            m.grad = None if p.grad is None else p.grad.float()
        norm = torch.nn.utils.clip_grad_norm_(
            self.masters, self.clip if self.clip > 0 else float("inf")
        )
        for g in self.opt.param_groups:
            g["lr"] = lr
        self.opt.step()
        with torch.no_grad():
            for p, m in zip(self.params, self.masters, strict=True):
                p.copy_(m.to(p.dtype))
                p.grad = None
        return float(norm)
