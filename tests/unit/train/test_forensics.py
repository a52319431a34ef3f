"""The pieces of the anomaly forensics on their own: the spike detector's window and
threshold, which samples a step's micro-batches read, the hooks that find the first
non-finite tensor, and the policy's rollback decisions."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from lptrain.config import compose
from lptrain.data.sampler import GlobalBatchSampler
from lptrain.errors import InputError
from lptrain.train.anomalies import AnomalyPolicy, trim_anomalies
from lptrain.train.forensics import FirstNonFinite, NaNInjector, SpikeDetector, micro_batch_samples


def test_spike_detector_window_and_threshold() -> None:
    t = compose("tiny_cpu.yaml", ["train.spike_zscore=3", "train.spike_window=4"]).train
    d = SpikeDetector(t.spike_zscore, t.spike_window)
    for step, loss in enumerate([2.0, 2.1, 1.9, 2.0], 1):
        assert d.check(loss) is None  # not enough history for the first 4 (window 4)
        d.observe(step, loss)
    # mean 2.0, std sqrt(0.005) = 0.0707: 2.2 is 2.8 std above, 2.3 is 4.2
    assert d.check(2.2) is None
    note = d.check(2.3)
    assert note is not None and "4.2 standard deviations above the mean of the last 4 steps" in note
    d.observe(5, 10.0)  # the window keeps the last 4 only: 2.1, 1.9, 2.0, 10.0
    assert [v for _, v in d.history] == [2.1, 1.9, 2.0, 10.0]
    assert d.check(float("nan")) is None  # a NaN loss is the non-finite check's, not a spike
    d.forget_after(3)
    assert [s for s, _ in d.history] == [2, 3]
    assert SpikeDetector(None, 100).check(1e9) is None and not SpikeDetector(None, 100).enabled


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
