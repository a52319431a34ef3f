"""Context parallelism on this machine: gloo ranks, one thread each.

* **bytes** (target 1.05 both ways, i.e. within 5%): the bytes one training step's
  context-parallel attention sends from a rank, counted at the collectives
  (``lptrain.model.context_parallel.comm.count_cp_traffic``), against the analytic count
  ``cp_attention_traffic`` (ring: keys and values ``CP - 1`` hops forward and backward, their
  fp32 gradients ``CP`` hops; Ulysses: q, k, v, the output and their gradients all-to-all'd;
  all-gather: k and v gathered, their gradients reduce-scattered), per layer and micro-batch:
  ``p2p``, ``a2a`` and ``allgather`` at CP 2 on 2 ranks, ``a2a+p2p`` at CP 4 (2 x 2) on 4.
  Deterministic, one sample each.
* **ring overlap** (target 1.25): a CP 2 training step with ring attention against the same
  step with the ring's sends replaced by local copies (the same blocks computed, nothing
  moved): ``step / compute`` is 1.00 when the communication hides entirely behind the block
  computations it overlaps (each step posts its send before computing on the block it holds).
* **step time** (info): CP 2 (p2p, a2a, allgather) against DP 2 on the same model and global
  batch: on 2 CPU cores CP pays attention traffic DP does not; it is for sequences whose
  activations do not fit one GPU, not a speed-up.

    .venv/bin/python bench/cp.py [--cap 60] [--save-baseline]
"""

from __future__ import annotations

import argparse
from typing import Any

from harness import Figure, Ratio, add_args, report, rounds

COMMON = ["data.builtin_max_mb=2", "logging.progress=false", "checkpoint.save=null",
          "model.num_layers=2", "model.hidden_size=128", "model.num_attention_heads=4",
          "model.num_query_groups=4", "model.ffn_hidden_size=256", "model.seq_length=1024",
          "train.global_batch_size=2", "train.micro_batch_size=1"]
CP2 = ["model.context_parallel_size=2"]
VARIANTS = {"DP=2": [], "CP=2 p2p": [*CP2, "model.cp_comm_type=p2p"],
            "CP=2 a2a": [*CP2, "model.cp_comm_type=a2a"],
            "CP=2 allgather": [*CP2, "model.cp_comm_type=allgather"]}
HIERARCHICAL = ["model.context_parallel_size=4", "model.cp_comm_type=a2a+p2p",
                "model.hierarchical_context_parallel_sizes=[2,2]", "train.global_batch_size=1"]


def _ratios() -> list[Ratio]:
    return [Ratio("CP=2 ring step / the same step without communication", "CP=2 p2p", "p2p compute only", 1.25),
            Ratio("CP=2 p2p vs DP=2", "CP=2 p2p", "DP=2"), Ratio("CP=2 a2a vs DP=2", "CP=2 a2a", "DP=2"),
            Ratio("CP=2 allgather vs DP=2", "CP=2 allgather", "DP=2")]


class _LocalExchange:
    """A :class:`RingExchange` that moves nothing: "receives" a copy of what it sends."""

    def __init__(self, tensor: Any, *args: Any, **kwargs: Any) -> None:
        self.out = tensor.clone()

    def wait(self) -> Any:
        return self.out


def _engine(extra: list[str]) -> tuple[Any, Any, int]:
    from workload import train_batches

    from lptrain.config import World, derive
    from lptrain.config.compose import load
    from lptrain.train.engine import TrainEngine

    cfg = derive(load("tiny_cpu.yaml", [*COMMON, *extra]).cfg, World.detect())
    e = TrainEngine(cfg)
    it, micro = train_batches(cfg, e.dp_rank, e.dp_size)
    if e.context_parallel[1] > 1:  # (train_batches reads whole sequences: this rank's chunks)
        from lptrain.data import build_train_valid_loaders

        t = cfg.train
        it, _ = build_train_valid_loaders(cfg.data, seq_length=cfg.model.seq_length,
                                          micro_batch_size=t.micro_batch_size,
                                          global_batch_size=t.global_batch_size, dp_rank=e.dp_rank,
                                          dp_size=e.dp_size, vocab_size=cfg.model.vocab_size,
                                          context_parallel=e.context_parallel)
    return e, it, micro


def _bytes(e: Any, it: Any, micro: int) -> tuple[int, int]:
    """(counted, analytic) attention bytes this rank sends in one training step."""
    from lptrain.model.context_parallel.comm import count_cp_traffic, cp_attention_traffic

    m, t = e.cfg.model, e.cfg.train
    with count_cp_traffic() as traffic:
        e.train_step([next(it) for _ in range(micro)], 1)
    sizes = m.hierarchical_context_parallel_sizes or [1]
    per_layer = cp_attention_traffic(
        m.cp_comm_type, cp=m.context_parallel_size, batch=t.micro_batch_size,
        local_tokens=m.seq_length // m.context_parallel_size, heads=m.num_attention_heads,
        kv_heads=m.num_query_groups or m.num_attention_heads,
        head_dim=m.hidden_size // m.num_attention_heads, itemsize=4, a2a=int(sizes[0]))
    return traffic.total, per_layer * m.num_layers * micro


def _rank(rank: int, world: int, args: argparse.Namespace) -> dict[str, Any]:

    from lptrain.model.context_parallel import attention
    from lptrain.testing.parity import patched

    engines = {name: _engine(ov) for name, ov in VARIANTS.items()}
    traffic = {name: _bytes(*engines[name]) for name in VARIANTS if name != "DP=2"}

    def step_of(name: str) -> Any:
        e, it, micro = engines[name]
        return lambda s: e.train_step([next(it) for _ in range(micro)], s)

    fns: dict[str, Any] = {name: step_of(name) for name in VARIANTS}
    ring = step_of("CP=2 p2p")

    def compute_only(s: int) -> None:
        with patched(attention, "RingExchange", _LocalExchange):
            ring(s)

    fns["p2p compute only"] = compute_only
    r = rounds(args, _ratios()).run_across_ranks(fns, first_step=2)  # (step 1: the set-up's)
    return {"series": r.series, "traffic": traffic}


def _hierarchical_rank(rank: int, world: int) -> tuple[int, int]:
    return _bytes(*_engine(HIERARCHICAL))


def main() -> None:
    import statistics

    from harness import Rounds
    from rich.console import Console

    from lptrain.testing.dist import run_distributed

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_args(ap, cap_s=60.0)
    args = ap.parse_args()
    res = run_distributed(_rank, 2, args=(args,), timeout_s=900)[0]
    res["traffic"]["CP=4 a2a+p2p (2 x 2)"] = run_distributed(_hierarchical_rank, 4, timeout_s=600)[0]
    r = Rounds(_ratios(), series=res["series"])
    figures = r.figures()
    lines = [f"{r.n} rounds; " + ", ".join(f"{name} {statistics.median(v) * 1e3:.1f} ms"
                                          for name, v in r.series.items())]
    for name, (counted, analytic) in res["traffic"].items():
        figures.append(Figure(f"{name}: CP bytes / analytic count", [counted / analytic], 1.05))
        figures.append(Figure(f"{name}: analytic count / CP bytes", [analytic / counted], 1.05))
        lines.append(f"{name}: {counted:,} bytes of attention traffic per step from rank 0 (analytic {analytic:,})")
    report(Console(width=140), "cp", "Context parallelism: CP=2 vs its compute and vs DP=2 (2 gloo ranks, "
           "slowest rank per round)", figures, args, "\n".join(lines))


if __name__ == "__main__":
    main()
