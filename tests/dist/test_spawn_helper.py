"""Self-tests of ``lptrain.testing.dist`` and of the gloo collectives the engine relies on.

Each ``run_distributed`` call pays a process start-up (~2-4 s with the torch import), so
related checks share one run.
"""

from __future__ import annotations

import socket
import time
import warnings

import pytest
import torch
import torch.distributed as dist

from lptrain.testing import dist as tdist
from lptrain.testing.dist import DistributedTimeoutError, RankFailedError, run_distributed

pytestmark = pytest.mark.dist


# --------------------------------------------------------------------------------------------
# Rank functions (module level: they are pickled into the spawned ranks)


def _fail_on_rank1(rank: int, world_size: int) -> None:
    if rank == 1:
        raise ValueError(f"boom from rank {rank} of {world_size}")
    # Rank 0 waits in a collective its peer never joins: it must fail (peer gone) or be
    # killed after the grace period, never hang the test.
    dist.all_reduce(torch.ones(1))


def _die_hard(rank: int, world_size: int) -> None:
    import os

    os._exit(3)  # like a segfault or an OOM kill: no exception, no report


def _sleep_forever(rank: int, world_size: int) -> None:
    time.sleep(600)


def _collectives(rank: int, world_size: int) -> dict[str, object]:
    """all_reduce / reduce_scatter_tensor / all_gather_into_tensor, async handles, 3 dtypes.

    Values are small integers, exact in every dtype (bf16 holds integers up to 256, uint8
    sums stay < 256), so every comparison is ``torch.equal``.
    """
    import os

    checked = []
    with warnings.catch_warnings():
        # torch 2.13 deprecates the *_tensor names in favour of *_single; both are checked.
        warnings.simplefilter("ignore", FutureWarning)
        for dtype in (torch.float32, torch.bfloat16, torch.uint8):
            n = 4 * world_size
            base = torch.arange(n, dtype=torch.int64)
            x = (base + rank).to(dtype)  # rank r holds [r, r+1, ..., r+n-1]
            rank_sum = world_size * (world_size - 1) // 2
            want_sum = (base * world_size + rank_sum).to(dtype)

            ar = x.clone()
            h_ar = dist.all_reduce(ar, op=dist.ReduceOp.SUM, async_op=True)
            mx = x.clone()
            h_mx = dist.all_reduce(mx, op=dist.ReduceOp.MAX, async_op=True)
            rs = torch.empty(4, dtype=dtype)
            h_rs = dist.reduce_scatter_tensor(rs, x.clone(), op=dist.ReduceOp.SUM, async_op=True)
            shard = torch.full((3,), rank + 1, dtype=dtype)
            ag = torch.empty(3 * world_size, dtype=dtype)
            h_ag = dist.all_gather_into_tensor(ag, shard, async_op=True)
            # Several handles in flight at once, waited in another order than issued.
            for h in (h_ag, h_rs, h_mx, h_ar):
                assert h is not None
                h.wait()
            assert torch.equal(ar, want_sum), (dtype, ar, want_sum)
            assert torch.equal(mx, (base + world_size - 1).to(dtype)), (dtype, mx)
            assert torch.equal(rs, want_sum[4 * rank : 4 * rank + 4]), (dtype, rs)
            want_ag = torch.arange(1, world_size + 1).repeat_interleave(3).to(dtype)
            assert torch.equal(ag, want_ag), (dtype, ag)
            if hasattr(dist, "reduce_scatter_single"):
                rs2 = torch.empty(4, dtype=dtype)
                dist.reduce_scatter_single(rs2, x.clone(), async_op=True).wait()
                ag2 = torch.empty(3 * world_size, dtype=dtype)
                dist.all_gather_single(ag2, shard, async_op=True).wait()
                assert torch.equal(rs2, rs) and torch.equal(ag2, ag), dtype
            assert ar.dtype == rs.dtype == ag.dtype == dtype
            checked.append(str(dtype))
    return {
        "rank": rank,
        "env": (os.environ["RANK"], os.environ["WORLD_SIZE"], os.environ["MASTER_ADDR"]),
        "threads": torch.get_num_threads(),
        "backend": dist.get_backend(),
        "checked": checked,
        "tensor": torch.full((2,), float(rank)),
    }


# --------------------------------------------------------------------------------------------
# Tests


def test_exception_in_rank1_names_rank_and_traceback() -> None:
    t0 = time.monotonic()
    with pytest.raises(RankFailedError) as info:
        run_distributed(_fail_on_rank1, 2, failure_grace_s=20.0)
    elapsed = time.monotonic() - t0
    err = info.value
    msg = str(err)
    assert err.rank == 1
    assert err.failures[0].rank == 1 and err.failures[0].exc_type == "ValueError"
    assert msg.startswith("rank 1 of 2 failed: ValueError: boom from rank 1 of 2"), msg
    # The rank's own traceback text: the raising function and its source line.
    assert "--- traceback of rank 1 ---" in msg
    assert "_fail_on_rank1" in msg and 'raise ValueError(f"boom from rank' in msg
    # The failed rank exits at once, so rank 0's pending collective errors out well before
    # the 20 s grace period (rank 0 then appears as a later consequence, or was killed).
    assert elapsed < 20.0, elapsed


def test_timeout_kills_stragglers() -> None:
    t0 = time.monotonic()
    with pytest.raises(DistributedTimeoutError) as info:
        # One rank is enough to exercise the deadline (it may still be importing torch when
        # the deadline hits: the straggler is killed either way).
        run_distributed(_sleep_forever, 1, timeout_s=4.0)
    elapsed = time.monotonic() - t0
    assert info.value.unfinished == [0]
    assert "timed out after 4 s" in str(info.value)
    assert elapsed < 4.0 + 6.0, elapsed  # killed promptly, not waiting for the sleep


def test_rank_dying_without_report() -> None:
    with pytest.raises(RankFailedError) as info:
        run_distributed(_die_hard, 1)
    assert info.value.rank == 0
    assert "rank 0 of 1 failed: ProcessDied: process exited with code 3" in str(info.value)


def test_unpicklable_fn_is_rejected_up_front() -> None:
    with pytest.raises(TypeError, match="picklable"):
        run_distributed(lambda rank, ws: None, 2)


def test_port_clash_retry_and_collectives(monkeypatch: pytest.MonkeyPatch) -> None:
    """First port handed out is held by a listening socket: rank 0 cannot bind it, the run
    restarts on a fresh port; the second attempt then checks the collectives."""
    blocker = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    blocker.bind(("127.0.0.1", 0))
    blocker.listen(8)
    taken = blocker.getsockname()[1]
    real = tdist.find_free_port
    handed: list[int] = []

    def clashing_port(host: str = "127.0.0.1") -> int:
        port = taken if not handed else real(host)
        handed.append(port)
        return port

    monkeypatch.setattr(tdist, "find_free_port", clashing_port)
    try:
        out = run_distributed(_collectives, 2)
    finally:
        blocker.close()
    assert len(handed) == 2 and handed[0] == taken and handed[1] != taken
    assert [o["rank"] for o in out] == [0, 1]
    for r, o in enumerate(out):
        assert o["env"] == (str(r), "2", "127.0.0.1")
        assert o["threads"] == 1
        assert o["backend"] == "gloo"
        assert o["checked"] == ["torch.float32", "torch.bfloat16", "torch.uint8"]
        assert torch.equal(o["tensor"], torch.full((2,), float(r)))
