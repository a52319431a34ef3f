"""The pieces of the anomaly forensics on their own: the loss watch's window, thresholds and
divergence bounds, the operand whose statistics moved most, which samples a step's
micro-batches read, the hooks that find the first non-finite tensor, and the policy's
rollback decisions."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from lptrain.config import compose
from lptrain.data.sampler import GlobalBatchSampler
from lptrain.errors import InputError
from lptrain.train.anomalies import AnomalyPolicy, trim_anomalies
from lptrain.train.forensics import FirstNonFinite, NaNInjector, micro_batch_samples, moved_most
from lptrain.train.loss_watch import LossWatch


def test_spike_detector_window_and_threshold() -> None:
    t = compose("tiny_cpu.yaml", ["train.spike_zscore=3", "train.spike_window=10",
                                  "train.check_for_spiky_loss=false"]).train
    d = LossWatch(t.spike_zscore, t.spike_window)
    losses = [2.0, 2.1, 1.9, 2.0] * 2 + [2.1, 1.9]
    for step, loss in enumerate(losses, 1):
        assert d.check(9.0) is None  # no warm baseline before 10 accepted steps
        d.observe(step, loss)
    # mean 2.0, std sqrt(0.006) = 0.0775: 2.2 is 2.6 std above, 2.3 is 3.9
    assert d.check(2.2) is None
    kind, note = d.check(2.3)  # type: ignore[misc]
    assert kind == "spike" and "3.9 standard deviations above the mean of the last 10 steps" in note
    d.observe(11, 10.0)  # the window keeps the last 10 only
    assert [v for _, v in d.history] == [*losses[1:], 10.0]
    assert d.check(float("nan")) is None  # a NaN loss is the non-finite check's, not a spike
    d.forget_after(3)
    assert [s for s, _ in d.history] == [2, 3]
    assert LossWatch(None, 100).check(1e9) is None and not LossWatch(None, 100).enabled


def test_divergence_needs_a_warm_baseline_or_the_uniform_bound() -> None:
    """Issue 52 item 6: a loss that goes from 5.55 to 2346 at step 2 and stays there ended
    "completed". ln(vocab) bounds a loss from the first step; the running median once 10
    steps are in; a diverged step never joins the history, so it is never the normal that
    later steps are judged against (steps 2-4 at 79 +- 43 were the baseline of a spike)."""
    cfg = compose("tiny_cpu.yaml", ["model.vocab_size=256", "model.make_vocab_size_divisible_by=128",
                                    "train.spike_window=10"])
    w = LossWatch.from_config(cfg)
    assert w.enabled and w.divergence is not None and w.divergence.vocab == 256
    assert w.check(5.55) is None and w.observe(1, 5.55)
    kind, why = w.check(2346.0)  # type: ignore[misc]
    assert kind == "divergence"
    assert why == ("loss 2346 is above 3 x ln(256) = 16.64, 3x the loss of a uniform prediction "
                   "(train.uniform_loss_factor=3): the run diverged")
    assert not w.observe(2, 79.0) and [s for s, _ in w.history] == [1]  # never counted as normal
    for step in range(2, 11):
        assert w.check(1.0) is None  # 1.0 x 10 = 10 < 16.64, but no warm baseline yet
        w.observe(step, 1.0 + 0.01 * step)
    kind, why = w.check(12.0)  # type: ignore[misc]
    assert kind == "divergence" and "loss 12 is 11.3x the median of the last 10 steps (1.065;" in why
    assert "train.spiky_loss_factor=10" in why and w.check(9.0) is None
    # with the check off a diverged loss is no anomaly -- and still never joins the history
    off = LossWatch.from_config(compose("tiny_cpu.yaml", ["train.check_for_spiky_loss=false"]))
    assert not off.enabled and off.check(2346.0) is None and not off.observe(1, 2346.0)


def test_the_anomaly_window_starts_where_the_climb_began() -> None:
    w = LossWatch(None, 100, None)
    for step in range(1, 11):
        w.observe(step, 3.0 + 0.1 * (step % 2))  # median 3.05
    assert w.window_start(11) == 11  # the step before (3.0) was at the median's level
    w.observe(11, 3.2)
    w.observe(12, 3.4)
    assert w.window_start(13) == 11  # 3.2 and 3.4 were already climbing
    assert LossWatch(None, 100, None).window_start(5) == 5  # no warm baseline: the step itself


def test_moved_most_names_the_operand_in_binades() -> None:
    then = {"layers.0.mlp.linear_fc1.input": {"amax": 2.0, "snr_db": 30.0, "nonfinite": 0.0},
            "layers.1.mlp.linear_fc2.input": {"amax": 3.0, "scale_exp_median": -5.0, "nonfinite": 0.0},
            "layers.1.mlp.linear_fc2.grad": {"amax": 1e-3, "snr_db": 20.0}}
    now = {"layers.0.mlp.linear_fc1.input": {"amax": 4.0, "snr_db": 10.0, "nonfinite": 0.0},  # 1, 3.3
           "layers.1.mlp.linear_fc2.input": {"amax": 3072.0, "scale_exp_median": 4.0, "nonfinite": 0.0},
           "layers.1.mlp.linear_fc2.grad": {"amax": 1e-3, "snr_db": 20.0}}
    got = moved_most(now, then)
    assert got == {"module": "layers.1.mlp.linear_fc2", "tensor": "input",
                   "operand": "layers.1.mlp.linear_fc2.input", "statistic": "amax",
                   "value": 3072.0, "reference": 3.0, "binades": 10.0}
    assert moved_most(then, then) is None
    now["layers.0.mlp.linear_fc1.input"]["nonfinite"] = 2.0  # newly non-finite beats any binade
    assert moved_most(now, then)["operand"] == "layers.0.mlp.linear_fc1.input"  # type: ignore[index]


def test_micro_batch_samples_follow_the_sampler() -> None:
    """Rank 1 of 2, micro-batch 2, global batch 8: positions c + t*4 + 2 .. + 3."""
    s = GlobalBatchSampler(8, 2, dp_rank=1, dp_size=2, consumed_samples=16)
    got = micro_batch_samples(s, 16, 2)
    want = [s.next_positions().tolist() for _ in range(2)]
    assert got == want == [[18, 19], [22, 23]]


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)
        self.c = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(torch.relu(self.b(self.a(x))))


def test_first_non_finite_forward_output_and_output_grad() -> None:
    net = _Net()
    # the fault's hook comes first, as the NaN injection's (registered when the job starts)
    bad = net.b.register_forward_hook(lambda m, i, o: o * float("inf"))
    finder = FirstNonFinite(net)
    finder.on_micro_batch(1)
    net(torch.ones(2, 4)).sum().backward()
    bad.remove()
    assert finder.forward == ("b", 1)  # b's output, before c's (which inherits it)
    assert finder.finding(0, [[0, 1], [2, 3]]) == {"module": "b", "tensor": "output", "rank": 0,
                                                   "micro_batch": 1, "samples": [2, 3]}
    finder.remove()
    net.b.register_forward_hook(lambda m, i, o: o.register_hook(lambda g: g * float("nan")) and None)
    finder = FirstNonFinite(net)
    net(torch.ones(2, 4)).sum().backward()
    # the grads reach c's output first (finite), then b's: poisoned there
    assert finder.forward is None and finder.backward == ("b", 0)
    assert finder.finding(3, [[5, 6]])["tensor"] == "output grad"  # type: ignore[index]
    finder.remove()


def test_nan_injector_names_a_missing_module_with_its_key() -> None:
    cfg = compose("tiny_cpu.yaml", ["debug.nan_sample=3", "debug.nan_module=layers.9.nothing"])
    with pytest.raises(InputError, match=r"debug.nan_module='layers.9.nothing' names no module"):
        NaNInjector(cfg, _Net())


def test_nan_injector_poisons_the_micro_batch_holding_the_sample() -> None:
    net = _Net()
    cfg = compose("tiny_cpu.yaml", ["debug.nan_sample=5", "debug.nan_module=a", "debug.nan_tensor=output"])
    inj = NaNInjector(cfg, net)
    inj.arm([[2, 3], [4, 5]])
    inj.on_micro_batch(0)
    assert torch.isfinite(net(torch.ones(1, 4))).all()
    inj.on_micro_batch(1)
    assert not torch.isfinite(net(torch.ones(1, 4))).all()
    assert torch.isfinite(net(torch.ones(1, 4))).all()  # once per micro-batch


def test_rollback_decisions(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import lptrain.train.anomalies as A

    cfg = compose("tiny_cpu.yaml", ["train.on_anomaly=rollback", f"checkpoint.save={tmp_path}",
                                    "checkpoint.save_interval=2", "train.max_rollbacks=2"])
    valid = [tmp_path / "iter_0000004", tmp_path / "iter_0000002"]
    monkeypatch.setattr(A, "find_checkpoints", lambda path: type("C", (), {"valid": valid})())
    monkeypatch.setattr(A, "read_train_state", lambda f: {"iteration": int(f.name[-7:]),
                                                          "consumed_samples": 8 * int(f.name[-7:])})
    p = AnomalyPolicy(cfg)
    d = p.decide(5)
    assert (d.action, d.to_step, d.from_samples) == ("rollback", 4, 32)
    d = p.decide(4)  # the checkpoint of step 4 is not before step 4
    assert (d.action, d.to_step) == ("rollback", 2)
    d = p.decide(5)
    assert d.action == "stop" and "train.max_rollbacks=2 reached" in d.why
    assert AnomalyPolicy(cfg).decide(2).why == "no checkpoint before step 2 to roll back to"
    # before the anomaly window, never to a checkpoint inside it
    d = AnomalyPolicy(cfg).decide(5, window_start=4)
    assert (d.action, d.to_step) == ("rollback", 2)
    assert AnomalyPolicy(cfg).decide(5, window_start=2).why == (
        "no checkpoint before step 2 (the anomaly window began there) to roll back to")
    # failing again from the checkpoint it went to, before passing the anomaly's step: further back
    p = AnomalyPolicy(cfg)
    assert p.decide(5).to_step == 4
    again = p.decide(5)
    assert (again.action, again.to_step) == ("rollback", 2)
    stop = compose("tiny_cpu.yaml", ["train.on_nonfinite=skip"])
    assert AnomalyPolicy(stop).decide(3).action == "skip_batch"


def test_a_resume_keeps_the_rollbacks_of_the_history_it_continues(tmp_path: Path) -> None:
    import json

    recs = [{"step": 3, "action": "skip_batch"}, {"step": 9, "action": "rollback", "to_step": 6},
            {"step": 11, "action": "stop"}]
    (tmp_path / "anomalies.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    trim_anomalies(tmp_path, 8)  # resumed at step 8: the rollback to 6 shaped the data since
    kept = [json.loads(x)["step"] for x in (tmp_path / "anomalies.jsonl").read_text().splitlines()]
    assert kept == [3, 9]
    trim_anomalies(tmp_path, 4)
    kept = [json.loads(x)["step"] for x in (tmp_path / "anomalies.jsonl").read_text().splitlines()]
    assert kept == [3]
