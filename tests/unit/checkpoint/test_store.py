"""Checkpoint folders: round trip, marker-last validity, corrupt/incomplete fallback, pruning,
and the run-folder policy -- on small hand-made states (no model, no training)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from lptrain.checkpoint import find_checkpoints, load_checkpoint, save_checkpoint, store, validate
from lptrain.train.run_dir import RunDirRefused, plan_run, trim_metrics


def _state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "global": {
            "model": {"layers.0.w": torch.randn(3, 4, generator=g), "b": torch.randn(4, generator=g)},
            # int keys, an empty dict, tuples and Python scalars: what Optimizer.state_dict() holds
            "optimizer": {
                "state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.randn(3, 4, generator=g)}},
                "param_groups": [{"params": [0, 1], "betas": (0.9, 0.95), "lr": 1e-3, "name": None}],
            },
            "scaling": {},
        },
        "local": {"torch_rng": torch.get_rng_state()},
    }


def _save(root: Path, it: int, seed: int = 0, keep: int = 2) -> Path:
    return save_checkpoint(root, it, _state(seed), {"consumed_samples": 8 * it}, "a: 1\n",
                           rank=0, world_size=1, keep_latest=keep)


def _same(a: object, b: object) -> None:
    assert type(a) is type(b), (a, b)
    if isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            _same(a[k], b[k])
    elif isinstance(a, torch.Tensor):
        assert torch.equal(a, b)
    else:
        assert a == b


def test_round_trip_is_exact_and_keeps_key_types(tmp_path: Path) -> None:
    folder = _save(tmp_path, 4, seed=1)
    assert folder.name == "iter_0000004" and validate(folder) is None
    assert (tmp_path / "latest").read_text().strip() == "iter_0000004"
    state, train = load_checkpoint(folder, rank=0, world_size=1)
    _same(state["global"], _state(1)["global"])  # int keys stay ints, {} stays {}
    assert torch.equal(state["local"]["torch_rng"], _state(1)["local"]["torch_rng"])
    assert train["iteration"] == 4 and train["consumed_samples"] == 32
    assert (folder / "resolved_config.yaml").read_text() == "a: 1\n"


def test_local_state_dropped_at_another_world_size(tmp_path: Path) -> None:
    state, _ = load_checkpoint(_save(tmp_path, 2), rank=0, world_size=2)
    assert state["local"] is None and "model" in state["global"]


def test_crash_before_marker_leaves_previous_checkpoint_in_use(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _save(tmp_path, 2)

    def crash(folder: Path) -> None:
        raise RuntimeError("disk full")

    monkeypatch.setattr(store.HOOKS, "before_marker", crash)
    with pytest.raises(RuntimeError, match="disk full"):
        _save(tmp_path, 4)
    assert "no completion marker" in validate(tmp_path / "iter_0000004")
    assert (tmp_path / "latest").read_text().strip() == "iter_0000002"
    found = find_checkpoints(tmp_path)
    assert found.valid == [tmp_path / "iter_0000002"]
    assert "iter_0000004" in found.skipped[0] and "interrupted" in found.skipped[0]


def test_truncated_file_is_detected_and_skipped(tmp_path: Path) -> None:
    _save(tmp_path, 2)
    newest = _save(tmp_path, 4)
    shard = next((newest / "global").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:-7])  # a torn write the marker does not match
    assert "corrupt" in validate(newest)
    found = find_checkpoints(tmp_path)
    assert found.valid == [tmp_path / "iter_0000002"] and "bytes, expected" in found.skipped[0]


def test_keep_latest_prunes_old_and_stale_folders(tmp_path: Path) -> None:
    for it in (1, 2, 3):
        _save(tmp_path, it, keep=2)
    (tmp_path / "iter_0000000").mkdir()  # leftover of an older crashed save
    _save(tmp_path, 4, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["iter_0000003", "iter_0000004", "latest"]


def test_trim_metrics_drops_redone_steps_and_torn_line(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in (1, 2, 3)) + '{"step": 4, "lo')
    trim_metrics(path, 2)
    assert [json.loads(x)["step"] for x in path.read_text().splitlines()] == [1, 2]


def _cfg(save: Path | None, load: Path | None = None, iters: int = 8) -> SimpleNamespace:
    return SimpleNamespace(
        checkpoint=SimpleNamespace(save=str(save) if save else None, load=str(load) if load else None),
        train=SimpleNamespace(train_iters=iters),
    )


def test_run_dir_policy(tmp_path: Path) -> None:
    out, ck = tmp_path / "run", tmp_path / "run" / "ckpt"
    assert plan_run(_cfg(ck), out).source == "fresh"  # nothing there yet
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"step": 1}\n')
    # killed before its first checkpoint (no summary): started over, saying so
    assert "stopped before its first checkpoint" in plan_run(_cfg(ck), out).restart
    (out / "summary.json").write_text("{}")
    with pytest.raises(RunDirRefused, match="--overwrite"):  # a run that ended without one
        plan_run(_cfg(ck), out)
    assert plan_run(_cfg(ck), out, overwrite=True).candidates == []
    _save(ck, 4)
    plan = plan_run(_cfg(ck), out)
    assert plan.source == "auto" and plan.candidates == [ck / "iter_0000004"]
    with pytest.raises(RunDirRefused, match=r"already finished.*train\.train_iters"):
        plan_run(_cfg(ck, iters=4), out)
    with pytest.raises(RunDirRefused, match=r"checkpoint\.load=.*no such folder"):
        plan_run(_cfg(ck, load=tmp_path / "nope"), out)
    assert plan_run(_cfg(None, load=ck / "iter_0000004"), tmp_path / "new").source == "explicit"
    assert (out / "metrics.jsonl").read_text() == '{"step": 1}\n'  # planning wrote nothing
