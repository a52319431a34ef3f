"""Bytes one rank holds, by the memory model's persistent categories.

:class:`MemoryBreakdown` is what every view of the model produces: the planner
(:func:`lptrain.memory.plan.estimate_memory`, from a config), the analytic model of
parameter descriptions (:func:`lptrain.memory.analytic.analytic_memory`) and the measurement
of a live engine (:func:`lptrain.memory.measure.measured_memory`), so any two can be compared
category by category. The categories (:data:`PERSISTENT`) are described in
:mod:`lptrain.memory.plan`; their sum is :attr:`MemoryBreakdown.total`.

:meth:`MemoryBreakdown.engine_report` regroups the same bytes into the keys of
``TrainEngine.memory_breakdown()`` (and ``summary.json``'s ``memory_breakdown_bytes``):
padding folded into the buffer it pads, the 0-dim optimizer states left out.
"""

from __future__ import annotations

from dataclasses import dataclass

PERSISTENT = (
    "weights",
    "quantized_weights",
    "grads",
    "masters",
    "optimizer_states",
    "padding",
    "param_gather_staging",
)
# TrainEngine.memory_breakdown()'s keys; "total" sums the first five ("padding" is inside
# "grads" and "param_buffer").
REPORT_KEYS = ("params", "param_buffer", "grads", "masters", "moments", "padding", "total")


@dataclass
class MemoryBreakdown:
    """Bytes per persistent category on one rank, and the splits the engine report needs.

    ``grad_padding``: the part of ``padding`` in grad buffers (the rest pads param buffers);
    ``optimizer_scalars``: the part of ``optimizer_states`` in 0-dim tensors (AdamW's
    ``step``); ``view_padding``: padding of param views that lie inside a reused grad buffer
    (no memory of their own, so in no category; the report's ``padding`` counts every view).
    """

    weights: int = 0
    quantized_weights: int = 0
    grads: int = 0
    masters: int = 0
    optimizer_states: int = 0
    padding: int = 0
    param_gather_staging: int = 0
    grad_padding: int = 0
    optimizer_scalars: int = 0
    view_padding: int = 0

    def categories(self) -> dict[str, int]:
        """``{category: bytes}`` for the :data:`PERSISTENT` categories."""
        return {c: getattr(self, c) for c in PERSISTENT}

    @property
    def total(self) -> int:
        return sum(self.categories().values())

    def as_dict(self) -> dict[str, int]:
        """The categories and ``total``."""
        return {**self.categories(), "total": self.total}

    def engine_report(self) -> dict[str, int]:
        """The same bytes under :data:`REPORT_KEYS`: ``params`` (every parameter's storage),
        ``param_buffer`` (param-buffer bytes that are not a parameter's storage: staging and
        padding), ``grads`` (the grad buffers, padding included), ``masters``, ``moments``
        (optimizer state tensors, without 0-dim ones), ``padding`` (every buffer view's
        padding, already inside ``grads`` / ``param_buffer``) and ``total`` (excluding it)."""
        out = {
            "params": self.weights + self.quantized_weights,
            "param_buffer": self.param_gather_staging + self.padding - self.grad_padding,
            "grads": self.grads + self.grad_padding,
            "masters": self.masters,
            "moments": self.optimizer_states - self.optimizer_scalars,
        }
        return {**out, "padding": self.padding + self.view_padding, "total": sum(out.values())}
