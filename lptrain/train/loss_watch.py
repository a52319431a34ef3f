"""Which losses are anomalies: a divergence, a spike, and the window a rollback must go before.

:class:`LossWatch` judges each step's loss (every rank sees the same all-reduced loss, so every
rank decides alike) against two things:

* a **divergence** (``train.check_for_spiky_loss``, Megatron's name; on by default): a loss
  above ``train.uniform_loss_factor`` x ln(vocab) -- the loss of a uniform prediction over the
  model's (padded) vocabulary, which a model only exceeds by being confidently wrong, and
  which needs no history, so it also catches a blow-up at step 2 -- or, once the history is
  warm, above ``train.spiky_loss_factor`` x the median of the last ``train.spike_window``
  accepted steps (Megatron's factor 10 against the recent losses; the median, so that a few
  bad steps do not move the baseline);
* a **spike** (``train.spike_zscore``): more than that many standard deviations above the mean
  of that history.

The history is a warm baseline only once it holds :data:`MIN_BASELINE` accepted steps: before
that nothing but the uniform bound is judged (three diverged steps made the baseline that an
earlier version compared with). A step that diverged never joins the history, whatever the
settings, so it is never the normal a later step is judged against. The history starts empty
in each job (and at a rollback forgets the steps after the checkpoint).

:meth:`LossWatch.window_start` is where the anomaly began: the anomalous step, or the first of
the accepted steps right before it whose loss was already above the baseline's median (a
climb the anomaly ends). A rollback goes to a checkpoint before that step
(:class:`lptrain.train.anomalies.AnomalyPolicy`).
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    from lptrain.config.schema import LPTrainConfig

MIN_BASELINE = 10  # accepted steps of history before it is a baseline (a warm baseline)


@dataclass(frozen=True)
class Divergence:
    """The divergence bounds: ``factor`` x the history's median, ``uniform_factor`` x
    ln(``vocab``); ``stops``: whether a divergence is an anomaly (``check_for_spiky_loss``) --
    either way a diverged step never joins the history."""

    factor: float
    uniform_factor: float
    vocab: int
    stops: bool = True

    @property
    def uniform_bound(self) -> float:
        return self.uniform_factor * math.log(self.vocab)


class LossWatch:
    """Divergence and spike detection over the loss history (see the module doc)."""

    def __init__(self, zscore: Optional[float], window: int, divergence: Optional[Divergence] = None) -> None:
        self.zscore = zscore
        self.window = window
        self.divergence = divergence
        self.history: deque[tuple[int, float]] = deque(maxlen=window)

    @classmethod
    def from_config(cls, cfg: LPTrainConfig) -> LossWatch:
        from lptrain.model.gpt import padded_vocab_size

        t, m = cfg.train, cfg.model
        vocab = padded_vocab_size(m.vocab_size, m.make_vocab_size_divisible_by)
        return cls(t.spike_zscore, t.spike_window,
                   Divergence(t.spiky_loss_factor, t.uniform_loss_factor, vocab, t.check_for_spiky_loss))

    @property
    def enabled(self) -> bool:
        """Whether :meth:`check` can find anything."""
        return self.zscore is not None or (self.divergence is not None and self.divergence.stops)

    @property
    def warm(self) -> bool:
        return len(self.history) >= MIN_BASELINE

    def _values(self) -> list[float]:
        return [v for _, v in self.history]

    def diverged(self, loss: float) -> Optional[str]:
        """Why ``loss`` is a divergence (the uniform bound; the median one when warm), or None."""
        d = self.divergence
        if d is None:
            return None
        if loss > d.uniform_bound:
            return (f"loss {loss:.6g} is above {d.uniform_factor:g} x ln({d.vocab}) = {d.uniform_bound:.4g}, "
                    f"{d.uniform_factor:g}x the loss of a uniform prediction (train.uniform_loss_factor="
                    f"{d.uniform_factor:g}): the run diverged")
        if self.warm:
            med = statistics.median(self._values())
            if med > 0 and loss > d.factor * med:
                return (f"loss {loss:.6g} is {loss / med:.1f}x the median of the last {len(self.history)} "
                        f"steps ({med:.4g}; train.spiky_loss_factor={d.factor:g}): the run diverged")
        return None

    def check(self, loss: float) -> Optional[tuple[str, str]]:
        """``(kind, why)`` when ``loss`` is an anomaly -- ``"divergence"`` (when it stops the
        run's normal course: ``check_for_spiky_loss``) or ``"spike"`` -- else None. A NaN loss
        is the non-finite check's."""
        if not math.isfinite(loss):
            return None
        why = self.diverged(loss)
        if why is not None and self.divergence is not None and self.divergence.stops:
            return "divergence", why
        if self.zscore is None or not self.warm:
            return None
        values = self._values()
        mean = sum(values) / len(values)
        std = math.sqrt(sum((v - mean) ** 2 for v in values) / len(values))
        if std == 0.0:
            return None
        z = (loss - mean) / std
        if z <= self.zscore:
            return None
        return "spike", (f"loss {loss:.4f} is {z:.1f} standard deviations above the mean of the last "
                         f"{len(values)} steps ({mean:.4f} +- {std:.4f}; train.spike_zscore={self.zscore:g})")

    def observe(self, step: int, loss: float) -> bool:
        """An accepted step's loss joins the history unless it is not finite or diverged (a
        diverged step is never counted as normal); returns whether it joined."""
        if not math.isfinite(loss) or self.diverged(loss) is not None:
            return False
        self.history.append((step, loss))
        return True

    def window_start(self, step: int) -> int:
        """The first step of the anomaly at ``step``: it, or the first of the accepted steps
        right before it whose loss was above the warm baseline's median."""
        if not self.warm:
            return step
        med = statistics.median(self._values())
        start = step
        for s, v in reversed(self.history):
            if v <= med:
                break
            start = s
        return start

    def forget_after(self, step: int) -> None:
        """A rollback to ``step``: the losses of the steps after it are gone."""
        self.history = deque(((s, v) for s, v in self.history if s <= step), maxlen=self.window)
