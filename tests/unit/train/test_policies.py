"""The loop's interval decisions (lptrain.train.policies), one case at a time, no training.

The end-to-end tests (tests/e2e/test_train_loop.py, test_checkpoint_resume.py) run them
inside the loop; these pin the precedence and edge cases that a short run does not reach.
"""

from __future__ import annotations

import signal

import pytest

from lptrain.config import compose
from lptrain.train.policies import EvalPolicy, LogPolicy, SavePolicy, StopPolicy


@pytest.mark.parametrize(
    ("step", "job_steps", "signum", "late", "want"),
    [
        (3, 3, None, False, None),
        (10, 10, None, False, "completed"),
        (10, 10, signal.SIGTERM, True, "interrupted"),  # a signal comes before everything
        (10, 4, None, True, "completed"),  # the last step comes before the deadline
        (5, 5, None, True, "exit_duration"),
        (7, 4, None, False, "exit_interval"),  # counted in this job's steps, not the run's
        (4, 3, None, False, None),
    ],
)
def test_stop_reason_precedence(step: int, job_steps: int, signum: int | None, late: bool,
                                want: str | None) -> None:
    assert StopPolicy(last_step=10, exit_interval=4).reason(step, job_steps, signum, late) == want


def test_no_exit_interval_never_stops_early() -> None:
    assert StopPolicy(last_step=10, exit_interval=None).reason(9, 9, None, False) is None


@pytest.mark.parametrize(
    ("step", "stop", "signum", "on_interrupt", "want"),
    [
        (4, None, None, False, True),  # every save_interval steps
        (3, None, None, False, False),
        (3, "completed", None, False, True),  # every stop saves ...
        (3, "exit_interval", None, False, True),
        (3, "exit_duration", None, False, True),
        (3, "interrupted", signal.SIGTERM, False, True),  # ... the scheduler's signals too
        (3, "interrupted", signal.SIGUSR1, False, True),
        (3, "interrupted", signal.SIGINT, False, False),  # Ctrl-C only when asked to
        (3, "interrupted", signal.SIGINT, True, True),
        (4, "interrupted", signal.SIGINT, False, True),  # the interval save still happens
    ],
)
def test_save_decision(step: int, stop: str | None, signum: int | None, on_interrupt: bool,
                       want: bool) -> None:
    policy = SavePolicy(folder="ckpt", interval=2, on_interrupt=on_interrupt)
    assert policy.due(step, stop, signum) is want


def test_no_save_folder_never_saves() -> None:
    policy = SavePolicy(folder=None, interval=1, on_interrupt=True)
    assert not any(policy.due(4, stop, signal.SIGTERM) for stop in (None, "completed", "interrupted"))


def test_eval_and_log_intervals_include_the_last_step() -> None:
    evals = EvalPolicy(enabled=True, interval=4, last_step=10)
    assert [s for s in range(1, 11) if evals.due(s)] == [4, 8, 10]
    assert [s for s in range(1, 11) if EvalPolicy(True, None, 10).due(s)] == [10]
    assert not any(EvalPolicy(False, 1, 10).due(s) for s in range(1, 11))
    assert [s for s in range(1, 11) if LogPolicy(3, 10).due(s)] == [3, 6, 9, 10]
    assert not any(LogPolicy(0, 10).due(s) or LogPolicy(None, 10).due(s) for s in range(1, 11))


def test_policies_read_their_keys() -> None:
    cfg = compose("tiny_cpu.yaml", ["train.train_iters=12", "train.eval_interval=5",
                                    "train.eval_iters=3", "train.log_interval=6",
                                    "train.exit_interval=7", "checkpoint.save=ck",
                                    "checkpoint.save_interval=4",
                                    "checkpoint.save_on_interrupt=true"])
    assert EvalPolicy.from_config(cfg, has_valid_split=True) == EvalPolicy(True, 5, 12)
    assert not EvalPolicy.from_config(cfg, has_valid_split=False).enabled
    assert LogPolicy.from_config(cfg) == LogPolicy(6, 12)
    assert StopPolicy.from_config(cfg) == StopPolicy(12, 7)
    assert SavePolicy.from_config(cfg) == SavePolicy("ck", 4, True)
