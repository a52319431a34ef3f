"""How a launch turns its ranks' exits into one status and one line: the signal-stop rule,
the lost-peer line, and the torchrun wrapper the sbatch script runs (torchrun stubbed)."""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

import pytest

from lptrain.errors import EXIT_RUN_FAILED, RunFailedError
from lptrain.launch import peers, torchrun
from lptrain.launch.exit_status import describe, normalized, signal_stop_status
from lptrain.launch.local import _first_real_failure


@pytest.mark.parametrize(("codes", "status"), [
    ([143, 143], 143),  # both ranks saved and stopped on SIGTERM
    ([143, 0], 143),  # one rank stopped, the other finished its last step
    ([130, 143], 143),
    ([130], 130),
    ([-15], 143),  # killed by SIGTERM before its handler was installed
    ([143, -9], None),  # a rank was killed: the run failed
    ([143, 3], None),
    ([1], None),
    ([0, 0], None),
])
def test_signal_stop_status(codes: list[int], status: int | None) -> None:
    assert signal_stop_status(codes) == status


def test_describe_and_normalize() -> None:
    assert describe(-9) == "exit 137 (SIGKILL)" and describe(3) == "exit 3"  # as a shell says it
    assert normalized(-9) == 137 and normalized(143) == 143


def test_first_real_failure_skips_ranks_stopped_by_the_teardown() -> None:
    fail = {0: SimpleNamespace(exitcode=143, timestamp=1.0),  # stopped by the agent, first seen
            1: SimpleNamespace(exitcode=-9, timestamp=2.0)}
    assert _first_real_failure(fail)[0] == 1


def _no_siblings(monkeypatch: pytest.MonkeyPatch) -> None:
    """The test process's siblings are whatever else its parent runs (make under CI; init,
    with every orphan on the machine, when pytest was started detached): some may say
    RANK=1. The launcher's ranks are the children of one agent; here there are none."""
    monkeypatch.setattr(peers, "_children", lambda pid: [])


def test_lost_peer_line_only_for_a_peer_failure_in_a_world(monkeypatch: pytest.MonkeyPatch) -> None:
    gone = RuntimeError("[gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:4242")
    _no_siblings(monkeypatch)
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert peers.lost_peer_error(gone) is None  # one process: no peers to lose
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert peers.lost_peer_error(ValueError("a real bug")) is None
    err = peers.lost_peer_error(gone)
    assert isinstance(err, RunFailedError) and err.exit_code == EXIT_RUN_FAILED
    # no sibling says RANK=1, so rank 1 is the missing local peer
    assert str(err).startswith("rank 0 lost peer 1 (exit "), str(err)
    assert ", signal " in str(err) and "\n" not in str(err)
    chained = RuntimeError("allreduce failed")
    chained.__cause__ = gone
    assert peers.lost_peer_error(chained) is not None


def test_published_exit_names_how_the_peer_ended(monkeypatch: pytest.MonkeyPatch,
                                                 tmp_path: Path) -> None:
    """The launcher's record (written under publish_peer_exits) wins over /proc guessing."""
    _no_siblings(monkeypatch)
    with peers.publish_peer_exits():
        path = Path(os.environ[peers.PEER_EXITS_ENV])
        assert path.parent.is_dir()
        path.write_text('{"1": -9}')
        assert peers._published_exit(1) == -9
        monkeypatch.setenv("WORLD_SIZE", "2")
        monkeypatch.setenv("RANK", "0")
        monkeypatch.setenv("LOCAL_RANK", "0")
        monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
        assert peers.describe_lost_peer(0, 2) == "rank 0 lost peer 1 (exit 137, signal SIGKILL)"
    assert peers.PEER_EXITS_ENV not in os.environ and not path.parent.exists()


def test_zombie_wait_status_is_decoded() -> None:
    assert peers._how_it_ended(9) == "exit 137, signal SIGKILL"  # waitpid status: killed by 9
    assert peers._how_it_ended(3 << 8) == "exit 3, signal none"
    assert peers._how_it_ended(None).startswith("exit unknown, signal unknown")


def _failed(*codes: int):  # type: ignore[no-untyped-def]
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    failures = {r: ProcessFailure(local_rank=r, pid=100 + r, exitcode=c, error_file="")
                for r, c in enumerate(codes)}
    return ChildFailedError("lptrain", failures)


@pytest.mark.parametrize(("raised", "status", "line"), [
    (lambda: _failed(143, 143), 143, "the ranks stopped on a signal (exit 143)"),
    (lambda: _failed(1, 143), EXIT_RUN_FAILED, "lptrain FAILED"),
])
def test_torchrun_wrapper_maps_the_status(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str], raised, status: int,
                                          line: str) -> None:
    import torch.distributed.run as tdr

    def fake_run(args):  # type: ignore[no-untyped-def]
        raise raised()

    monkeypatch.setattr(tdr, "run", fake_run)
    monkeypatch.setenv("SLURM_NODEID", "3")
    log_dir = tmp_path / "ranks"
    code = torchrun.main(["--nproc-per-node=2", f"--log-dir={log_dir}", "-m", "lptrain", "pretrain"])
    err = capsys.readouterr().err
    assert code == status and line in err, err
    assert "Traceback" not in err
    if status == 143:  # the report and traceback went to the rank logs only
        assert "Traceback" in (log_dir / "torchrun-node3.log").read_text()
        assert str(log_dir / "torchrun-node3.log") in err


def test_torchrun_wrapper_on_its_own_signal(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    import signal

    import torch.distributed.run as tdr
    from torch.distributed.elastic.multiprocessing.api import SignalException

    def fake_run(args):  # type: ignore[no-untyped-def]
        raise SignalException("got SIGUSR1", signal.SIGUSR1)

    monkeypatch.setattr(tdr, "run", fake_run)
    code = torchrun.main(["--nproc-per-node=2", f"--log-dir={tmp_path}", "-m", "lptrain"])
    err = capsys.readouterr().err
    assert code == 143 and "torchrun got SIGUSR1" in err and "Traceback" not in err
    assert os.listdir(tmp_path)


def test_cli_turns_a_lost_peer_into_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    """Through the CLI's error surface, also for a BaseException such as torch's
    CheckpointException wrapping the backend error (a peer died mid-save)."""
    import typer
    from typer.testing import CliRunner

    from lptrain.cli.errors import LPTrainGroup

    class CheckpointLike(BaseException):
        pass

    app = typer.Typer(cls=LPTrainGroup)
    raised: list[BaseException] = []

    @app.command()
    def boom() -> None:
        raise raised[0]

    @app.command()
    def other() -> None:
        pass

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    for exc in (RuntimeError("[gloo] Connection reset by peer"),
                CheckpointLike("ranks [1]: RuntimeError: Connection closed by peer [10.0.0.2]:1")):
        raised[:] = [exc]
        r = CliRunner().invoke(app, ["boom"])
        assert r.exit_code == 3, r.output
        assert r.stderr.startswith("error: rank 1 lost peer 0 (") and r.stderr.count("\n") == 1
        assert "Traceback" not in r.output and "bug in lptrain" not in r.output
