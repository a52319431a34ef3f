"""One failure, one line (issue 52, item 18), through the CLI's error surface and the local
launcher with the elastic agent stubbed.

A rank SIGKILLed at TP 2 x PP 2 printed a survivor's ``lost peer 1 (exit 137, signal
SIGKILL)`` and the launcher's ``rank 1 of 4 failed with exit -9 (SIGKILL)``; "no checkpoint
could be loaded" printed once per rank. Now the first rank of a launch to print an error
claims the word (a file beside the launcher's exits record), later lost-peer lines and the
launcher's own stay silent, and an error every rank meets alike is rank 0's to print.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from lptrain.cli import errors as cli_errors
from lptrain.cli.errors import LPTrainGroup
from lptrain.errors import EXIT_RUN_FAILED, RunFailedError
from lptrain.launch import local, peers

GONE = RuntimeError("[gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:4242")


def _app(raised: list[BaseException]) -> typer.Typer:
    app = typer.Typer(cls=LPTrainGroup)

    @app.command()
    def boom() -> None:
        raise raised[0]

    @app.command()
    def other() -> None:
        pass

    return app


def _rank(monkeypatch: pytest.MonkeyPatch, rank: int, exits: Path | None) -> None:
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", str(rank))
    monkeypatch.setenv("LOCAL_RANK", str(rank))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    if exits is None:
        monkeypatch.delenv(peers.PEER_EXITS_ENV, raising=False)
    else:
        monkeypatch.setenv(peers.PEER_EXITS_ENV, str(exits))
    monkeypatch.setattr(peers, "_children", lambda pid: [])  # no real siblings to inspect


def test_only_the_first_rank_to_speak_prints_a_lost_peer_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    exits = tmp_path / "exits.json"
    exits.write_text('{"1": -9}')
    app = _app([GONE])
    _rank(monkeypatch, 0, exits)
    r = CliRunner().invoke(app, ["boom"])
    assert r.exit_code == 3 and r.stderr.startswith("error: rank 0 lost peer 1 (exit 137, signal SIGKILL)")
    _rank(monkeypatch, 2, exits)  # another survivor of the same launch: silent, same status
    r = CliRunner().invoke(app, ["boom"])
    assert r.exit_code == 3 and r.stderr == "", r.stderr
    monkeypatch.setattr(cli_errors, "_claim_the_word", lambda: True)  # the fix, removed
    r = CliRunner().invoke(app, ["boom"])
    assert r.stderr.startswith("error: rank 2 lost peer")  # the second line of the old output
    monkeypatch.undo()
    _rank(monkeypatch, 2, None)  # a plain torchrun (no exits record): every rank says it
    assert peers.claim_the_word() and peers.claim_the_word()


def test_an_lptrain_error_claims_the_word_first(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 0 stops on its own error (a deleted run folder); a peer that then loses it is quiet."""
    exits = tmp_path / "exits.json"
    exits.write_text('{"0": 3}')
    _rank(monkeypatch, 0, exits)
    r = CliRunner().invoke(_app([RunFailedError("the run folder x was deleted")]), ["boom"])
    assert r.exit_code == 3 and r.stderr == "error: the run folder x was deleted\n"
    _rank(monkeypatch, 1, exits)
    r = CliRunner().invoke(_app([GONE]), ["boom"])
    assert r.exit_code == 3 and r.stderr == ""


def test_no_loadable_checkpoint_is_said_by_rank_0_only(monkeypatch: pytest.MonkeyPatch) -> None:
    from lptrain.train.resume import NoCheckpointLoaded

    left: list[int] = []

    def leave(status: int, limit_s: float = 60.0) -> None:  # what a rank other than 0 does
        left.append(status)
        raise typer.Exit(status)

    monkeypatch.setattr(cli_errors, "_leave_with_the_job", leave)
    app = _app([NoCheckpointLoaded("no checkpoint could be loaded: x")])
    _rank(monkeypatch, 1, None)
    r = CliRunner().invoke(app, ["boom"])
    assert r.exit_code == 2 and r.stderr == "" and left == [2]
    _rank(monkeypatch, 0, None)
    r = CliRunner().invoke(app, ["boom"])
    assert r.exit_code == 2 and r.stderr == "error: no checkpoint could be loaded: x\n"


def _failed(*codes: int) -> Exception:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    failures = {r: ProcessFailure(local_rank=r, pid=100 + r, exitcode=c, error_file="")
                for r, c in enumerate(codes)}
    for r, f in failures.items():
        f.timestamp = r  # rank 0 failed first
    return ChildFailedError("lptrain", failures)


@pytest.mark.parametrize("survivor_spoke", [True, False])
def test_the_launcher_names_a_killed_rank_only_when_no_rank_did(
    survivor_spoke: bool, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import torch.distributed.launcher.api as api

    def fake_launch(config: object, entrypoint: str):  # type: ignore[no-untyped-def]
        def run(*args: str) -> None:
            if survivor_spoke:  # rank 1 printed "rank 1 lost peer 0 (...)" and exited 3
                assert peers.claim_the_word()
            raise _failed(-9, 3)

        return run

    monkeypatch.setattr(api, "elastic_launch", fake_launch)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    if survivor_spoke:
        with pytest.raises(SystemExit) as exited:
            local.launch_local(2, ["pretrain"])
        assert exited.value.code == EXIT_RUN_FAILED
    else:
        with pytest.raises(RunFailedError) as err:
            local.launch_local(2, ["pretrain"])
        assert str(err.value).startswith("rank 0 of 2 failed with exit 137 (SIGKILL)")  # as a shell says it
    assert capsys.readouterr().err == ""
