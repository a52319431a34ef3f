"""MoE layer benchmark on 2 gloo ranks: expert parallel (EP=2) against EP=1 (not a test).

Both configurations process the same tokens per rank with the same experts per token
(top-k of E experts): at EP=1 every rank holds all E experts and computes its own tokens
(plain data parallelism); at EP=2 each rank holds E/2 experts and the token dispatcher moves
the rows with ``all_to_all_single`` (uneven splits, counts exchanged first).

Reported per configuration: MoE layer forward+backward time (rounds alternate EP=1 and
EP=2, the slowest rank per round, repeated until the ratio's median is known within
``--spread`` or ``--cap`` seconds pass; ``bench/harness.py``, REGRESSED against
``bench/baseline.json``; one torch thread per rank), and for EP=2 the bytes the row all-to-alls moved per step
(forward: dispatch + combine; backward: the same again), against the analytic minimum
``tokens x hidden x k x bytes per element x 2`` (dispatch and combine, tokens summed over
ranks; rows a rank keeps for itself are counted, as in the formula). The dispatcher pads
per expert only after the exchange, so forward bytes should equal the minimum exactly; the
count exchange (int64 per expert) is listed separately.

    .venv/bin/python bench/moe.py [--tokens 2048] [--hidden 256] [--experts 8] [--topk 2] [--mxfp8]
        [--cap 30] [--save-baseline]
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch
from harness import Figure, Ratio, Rounds, add_args, report, rounds
from rich.console import Console
from rich.table import Table

from lptrain.testing.dist import run_distributed


def _layer(ep: int, rank: int, a: argparse.Namespace, group: Any) -> Any:
    from lptrain.config import World, compose, derive
    from lptrain.model import build_model

    ov = [
        "model.num_layers=1", f"model.hidden_size={a.hidden}", "model.num_attention_heads=4",
        f"model.moe.num_experts={a.experts}", f"model.moe.router_topk={a.topk}",
        f"model.moe.ffn_hidden_size={a.ffn}", "model.moe.grouped_gemm=true",
        f"model.moe.expert_model_parallel_size={ep}", "precision.params_dtype=fp32",
        "precision.backend=emulated", "run.device=cpu",
    ]
    if a.mxfp8:
        ov += ["precision.fp8_format=e4m3", "precision.fp8_recipe=mxfp8"]
    cfg = derive(compose(None, ov), World(dp=2))
    model = build_model(cfg, expert_model_parallel_rank=rank if ep > 1 else 0,
                        expert_parallel_group=group, device="cpu")
    return model, model.layers[0].mlp


def _rank(rank: int, world: int, a: argparse.Namespace) -> dict[str, Any]:
    import lptrain.model.moe.dispatcher as disp
    from lptrain.distributed.groups import build_groups

    moved = {"rows": 0, "bytes": 0, "counts": 0}
    real_rows, real_a2a = disp.all_to_all_rows, torch.distributed.all_to_all_single

    def counting_rows(x: torch.Tensor, out_splits: list[int], in_splits: list[int], pg: Any) -> torch.Tensor:
        moved["rows"] += sum(in_splits)
        moved["bytes"] += sum(in_splits) * x[0].numel() * x.element_size() if x.shape[0] else 0
        return real_rows(x, out_splits, in_splits, pg)

    def counting_a2a(out: torch.Tensor, inp: torch.Tensor, *args: Any, **kw: Any) -> Any:
        if inp.dtype == torch.int64:  # the per-expert count exchange
            moved["counts"] += inp.numel() * inp.element_size()
        return real_a2a(out, inp, *args, **kw)

    disp.all_to_all_rows = counting_rows
    disp.dist.all_to_all_single = counting_a2a
    out: dict[Any, Any] = {}
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(a.tokens, a.hidden, generator=g)
    layers = {}
    for ep in (1, 2):
        groups = build_groups(1, ep=ep)
        layers[ep] = _layer(ep, rank, a, groups.ep)

    def step(ep: int) -> float:
        model, layer = layers[ep]
        for k in moved:
            moved[k] = 0
        xi = x.clone().requires_grad_()
        torch.distributed.barrier()
        t0 = time.perf_counter()
        with model.autocast():
            y, _ = layer(xi.view(1, a.tokens, a.hidden))
        out[ep] = {"fwd": dict(moved)}
        y.float().sum().backward()
        out[ep]["total"] = dict(moved)
        return time.perf_counter() - t0

    r = rounds(a, _ratios())
    i = 0
    while True:
        i += 1
        times = {f"EP={ep}": step(ep) for ep in (1, 2)}
        if i > a.warmup and r.add_max_over_ranks(times):
            break
    out["series"] = r.series
    return out


def _ratios() -> list[Ratio]:
    return [Ratio("EP=2 vs EP=1 time", "EP=2", "EP=1")]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=2048, help="tokens per rank")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--ffn", type=int, default=512)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--topk", type=int, default=2)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--mxfp8", action="store_true", help="emulated MXFP8 expert GEMMs")
    add_args(p, cap_s=30.0)
    a = p.parse_args()
    res = run_distributed(_rank, 2, args=(a,), timeout_s=900)
    elem = 4  # fp32 activations on CPU (bf16 on GPU would halve every byte figure)
    analytic = 2 * a.tokens * a.hidden * a.topk * elem * 2  # tokens summed over 2 ranks
    t = Table(title=f"MoE layer fwd+bwd, 2 ranks, {a.tokens} tokens/rank, hidden {a.hidden}, "
              f"ffn {a.ffn}, {a.experts} experts top-{a.topk}{' MXFP8' if a.mxfp8 else ''}")
    for col in ("config", "ms (slowest rank)", "a2a fwd bytes", "analytic min", "fwd / min",
                "fwd+bwd bytes", "count bytes"):
        t.add_column(col, justify="right")
    series = res[0]["series"]  # the slowest rank's times, the same on every rank
    for ep in (1, 2):
        ms = f"{1e3 * statistics.median(series[f'EP={ep}']):.1f}"
        fwd = sum(r[ep]["fwd"]["bytes"] for r in res)
        tot = sum(r[ep]["total"]["bytes"] for r in res)
        cnt = sum(r[ep]["total"]["counts"] for r in res)
        ratio = f"{fwd / analytic:.3f}" if ep > 1 else "-"
        t.add_row(f"EP={ep}", ms, f"{fwd:,}", f"{analytic:,}" if ep > 1 else "-", ratio, f"{tot:,}", f"{cnt:,}")
    console = Console(width=140)
    console.print(t)
    fwd = sum(r[2]["fwd"]["bytes"] for r in res)
    figures = [*Rounds(_ratios(), series=series).figures(),
               Figure("EP=2 a2a fwd bytes / analytic min", [fwd / analytic], 1.0)]  # exact count
    report(console, "moe" + ("_mxfp8" if a.mxfp8 else ""), "MoE layer, EP=2 vs EP=1", figures, a,
           "gloo over loopback on a shared CPU: the all-to-all is a memory copy here, not a network "
           "transfer (the time ratio is informational)")


if __name__ == "__main__":
    main()
