"""The stochastic-rounding draws of one NVFP4 quantization, recorded and replayed alone (not a test).

Why: ``bench/quantize.py``'s NVFP4 rht+sr grad figure includes one random byte per element
per orientation, drawn from the quantizer's seeded CPU generator (torch's mt19937: serial,
one int64 word per 8 bytes). Keeping the quantized bytes identical for a given seed means
making exactly those draws, so their time is a floor of the figure; this module measures
it instead of estimating it:

- :func:`record_draws` runs one quantization with the draw seam
  (``lptrain.precision.tensors.nvfp4.draw_rbits``) wrapped and returns the byte count of
  every draw, in order;
- :func:`replay_draws` makes those draws again with nothing around them: the same
  ``draw_rbits`` calls on the same generator, so a generator in the
  quantizer's starting state ends in the quantizer's final state (the tests check that,
  which is what makes the replay's time the draws' time).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from lptrain.precision.formats import draw_rbits
from lptrain.precision.scratch import Workspace
from lptrain.precision.tensors import nvfp4


@contextmanager
def _draw_seam(wrapper: Callable[..., torch.Tensor]) -> Iterator[None]:
    saved = nvfp4.draw_rbits
    nvfp4.draw_rbits = wrapper  # type: ignore[assignment]
    try:
        yield
    finally:
        nvfp4.draw_rbits = saved  # type: ignore[assignment]


def record_draws(quantize: Callable[[], Any]) -> list[int]:
    """Bytes of every SR draw ``quantize()`` makes, in order."""
    sizes: list[int] = []
    inner = nvfp4.draw_rbits

    def wrapped(n: int, *args: Any, **kwargs: Any) -> torch.Tensor:
        sizes.append(n)
        return inner(n, *args, **kwargs)

    with _draw_seam(wrapped):
        quantize()
    return sizes


def replay_draws(sizes: list[int], generator: torch.Generator,
                 ws: Workspace | None = None) -> torch.Tensor:
    """The draws of :func:`record_draws` again, through the quantizer's own
    :func:`lptrain.precision.formats.draw_rbits` (into ``ws``'s reused slot, as the
    quantizer's workspace does); returns the last draw's bytes."""
    ws = ws if ws is not None else Workspace(generator.device)
    out = torch.empty(0, dtype=torch.uint8)
    for n in sizes:
        out = draw_rbits(n, generator, generator.device, ws)
    return out
