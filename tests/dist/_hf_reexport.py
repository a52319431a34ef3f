"""The export check the CP and TP batteries share: a checkpoint saved by a parallel run,
loaded by a one-rank engine and saved again, exports to the same Hugging Face folder byte for
byte -- the export does not depend on the parallel layout it came from."""

from __future__ import annotations

from pathlib import Path


def assert_reexport_at_one_rank_is_identical(ckpt_root: Path, recipe: str, overrides: list[str], step: int,
                                             tmp_path: Path) -> None:
    """Export the newest valid checkpoint under ``ckpt_root`` and its one-rank re-save (the
    engine of ``recipe`` + ``overrides`` at one rank); every exported file must be equal."""
    from lptrain.checkpoint import find_checkpoints, load_checkpoint, save_checkpoint
    from lptrain.config import World, compose, derive
    from lptrain.config.render import config_yaml
    from lptrain.interop.hf_export import export_hf
    from lptrain.testing.parity import first_difference
    from lptrain.train.engine import TrainEngine

    src = find_checkpoints(ckpt_root).valid[0]
    state, _ = load_checkpoint(src, rank=0, world_size=1)
    cfg = derive(compose(recipe, [*overrides, f"checkpoint.save={tmp_path}/ckpt"]), World.detect())
    engine = TrainEngine(cfg)
    engine.load_checkpoint_state(state)
    with engine.params_synced():
        again = engine.checkpoint_state()
    assert first_difference(again["global"]["model"], state["global"]["model"]) is None
    resaved = save_checkpoint(tmp_path / "ckpt", step, again, {"iteration": step}, config_yaml(cfg),
                              rank=0, world_size=1, keep_latest=2)
    export_hf(src, tmp_path / "hf_parallel")
    export_hf(resaved, tmp_path / "hf_one_rank")
    files = sorted(p.name for p in (tmp_path / "hf_parallel").iterdir())
    assert files == sorted(p.name for p in (tmp_path / "hf_one_rank").iterdir()) and "model.safetensors" in files
    for name in files:
        assert (tmp_path / "hf_parallel" / name).read_bytes() == (tmp_path / "hf_one_rank" / name).read_bytes(), name
