"""World detection: explicit values win; a GPU --target means "checking for a cluster"."""

from __future__ import annotations

import pytest

from lptrain.config.world import ASSUMED_TE_VERSION, World, parse_version


def test_gpu_target_assumes_cuda_and_recent_te() -> None:
    w = World.detect(dp=8, target="sm100")
    assert (w.dp, w.target, w.cuda, w.te_version, w.sm) == (8, "sm100", True, ASSUMED_TE_VERSION, 100)
    assert World.detect(target="sm90", te_version="2.3").te_version == "2.3"


def test_cpu_target() -> None:
    w = World.detect(target="cpu")
    assert (w.cuda, w.sm) == (False, 0)


def test_dp_from_world_size(monkeypatch: pytest.MonkeyPatch) -> None:
    from lptrain.config import compose

    monkeypatch.setenv("WORLD_SIZE", "16")
    launched = World.detect(target="cpu")
    assert launched.ranks == 16
    assert launched.for_config(compose(None, [])).dp == 16
    assert World.detect(dp=2, target="cpu").dp == 2


def test_dp_and_ranks_under_tensor_parallelism() -> None:
    """``--dp N`` judges a world of TP x N ranks; a launch's rank count leaves ranks / TP
    data-parallel ranks; settling twice changes nothing."""
    from lptrain.config import compose

    tp4 = compose(None, ["model.tensor_model_parallel_size=4"])
    by_dp = World(dp=2).for_config(tp4)
    assert (by_dp.dp, by_dp.ranks, by_dp.world_size) == (2, 8, 8)
    by_ranks = World(ranks=16).for_config(tp4)
    assert (by_ranks.dp, by_ranks.ranks) == (4, 16)
    assert by_ranks.for_config(tp4) == by_ranks
    assert World(ranks=6).for_config(tp4).dp == 1  # LAUNCH-TP-DIVIDES-WORLD reports the rest


def test_dp_and_ranks_under_context_and_pipeline_parallelism() -> None:
    """``--dp N`` judges a world of TP x CP x PP x N ranks (the 128k recipe at --dp 4: 512);
    a launch's rank count leaves ranks / (TP x CP x PP) data-parallel ranks."""
    from lptrain.config import compose

    cfg = compose(None, ["model.tensor_model_parallel_size=8", "model.context_parallel_size=16"])
    assert World(dp=4).for_config(cfg).ranks == 512
    both = compose(None, ["model.tensor_model_parallel_size=2", "model.context_parallel_size=2",
                          "model.pipeline_model_parallel_size=2"])
    assert World(ranks=16).for_config(both).dp == 2
    assert World(dp=3).for_config(both).ranks == 24


def test_unknown_target_rejected() -> None:
    with pytest.raises(ValueError, match="unknown target"):
        World.detect(target="sm75")


@pytest.mark.parametrize(
    ("text", "expected"),
    [("2.14", (2, 14)), ("2.14.0.dev0+abc123", (2, 14, 0)), ("2.2.1", (2, 2, 1)), ("1.x", (1,))],
)
def test_parse_version(text: str, expected: tuple[int, ...]) -> None:
    assert parse_version(text) == expected
    assert parse_version("2.14") > parse_version("2.3")  # numeric, not lexicographic
