"""A run's config for a few steps on a virtual GPU: what ``pretrain --dry-run`` does on a GPU
target, and what the tests of the GPU path use.

:func:`virtual_gpu` is the world: one virtual CUDA device of the target's compute capability
(:mod:`lptrain.testing.virtual_cuda`, which enforces CUDA's device rules), and, for
``precision.backend=te`` where Transformer Engine is not installed, TE's own Python with its
kernels emulated (:mod:`lptrain.testing.te_python`). :func:`fake_gpu_steps` shrinks a config to tiny shapes
(keeping its precision, optimizer, data-parallel and MoE settings, and tensor and pipeline
parallelism at 2 where the recipe has them, on 2 or 4 gloo ranks with a virtual GPU each) and
runs training steps, an evaluation and the collection of the checkpoint state on it,
reporting the host syncs and collectives per step, the peak device memory, and the recipe's
parallel paths it ran and did not run.
"""

from __future__ import annotations

import contextlib
import copy
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Optional

from lptrain.catalog.gpus import GPUS as CATALOG_GPUS

# target -> (compute capability, device name): each target's reference part in the one GPU
# table (lptrain.catalog.gpus), whose peaks the MFU figures read
GPUS = {g.target: (g.capability, g.device_name) for g in CATALOG_GPUS if g.target is not None}


@contextlib.contextmanager
def virtual_gpu(target: str = "sm90", *, te: bool = False, te_version: Optional[str] = None,
                cuda_version: Optional[str] = None) -> Iterator[Any]:
    """A virtual GPU of ``target`` with CUDA ``cuda_version`` (default: the version a GPU
    target is checked for), and, when ``te``, TE's own Python (release ``te_version``, or
    the default folder's) with its kernels emulated -- unless a real TE is installed; yields
    the :class:`~lptrain.testing.virtual_cuda.VirtualCuda`, whose ``te_backend`` attribute
    says which TE serves (``None``, ``"installed"`` or ``"TE X.Y.Z, TE's own Python, kernels
    emulated"``). No TE Python folder: :class:`~lptrain.testing.te_python.TEPythonMissing`."""
    from lptrain.config.world import ASSUMED_CUDA_VERSION
    from lptrain.testing import te_python
    from lptrain.testing.virtual_cuda import VirtualCuda

    capability, name = GPUS[target]
    with VirtualCuda(capability=capability, name=name, cuda_version=cuda_version or ASSUMED_CUDA_VERSION) as vc, \
            contextlib.ExitStack() as stack:
        vc.te_backend = None
        if te:
            from lptrain.precision.te_adapter import te_importable

            if te_python.version() is None and te_importable() and not te_python.serves_importable_te():
                vc.te_backend = "installed"
            else:
                stack.enter_context(te_python.installed(te_version))
                vc.te_backend = te_python.describe()
        yield vc


@dataclass
class FakeStepReport:
    """What :func:`fake_gpu_steps` saw."""

    target: str
    backend: str  # "emulated backend", "TE backend, TE 2.20.2, TE's own Python, kernels emulated"
    losses: list[float]
    val_loss: float
    syncs_per_step: dict[str, int]
    collectives_per_step: dict[str, int]
    peak_device_bytes: int
    changed: list[str] = field(default_factory=list)  # what was shrunk for the step
    ranks: int = 1  # gloo ranks the step ran on (TP x PP)
    ran: list[str] = field(default_factory=list)  # the parallel code paths it ran
    not_run: list[str] = field(default_factory=list)  # the recipe's paths it did not run

    def lines(self) -> list[str]:
        syncs = sum(self.syncs_per_step.values())
        kinds = ", ".join(f"{k} {v}" for k, v in sorted(self.syncs_per_step.items())) or "none"
        losses = " -> ".join(f"{x:.4f}" for x in self.losses)
        where, rank0 = (f" on {self.ranks} gloo ranks", " on rank 0") if self.ranks > 1 else ("", "")
        return [
            f"fake GPU step ({self.target}, virtual CUDA, {self.backend}): {len(self.losses)} "
            f"steps{where}, loss {losses}, val {self.val_loss:.4f}; {syncs} host syncs per step "
            f"({kinds}){rank0}; peak device memory {self.peak_device_bytes / 2**20:.1f} MiB",
            "fake GPU step shrank: " + "; ".join(self.changed),
            "fake GPU step ran: " + ("; ".join(self.ran) if self.ran else "no model parallelism (none in the recipe)"),
            *(["fake GPU step did not run: " + "; ".join(self.not_run)] if self.not_run else []),
        ]


# tiny shapes that every recipe's GEMMs align to (all multiples of 32; see configs/model/tiny)
_TINY_MODEL = {"num_layers": 2, "hidden_size": 64, "ffn_hidden_size": 256, "num_attention_heads": 4,
               "num_query_groups": 4, "seq_length": 64, "vocab_size": 259,
               "make_vocab_size_divisible_by": 1}
# Model parallelism is run at 2 (the code paths of any larger size): TP 2 and PP 2 on 2 gloo
# ranks, both on 4; expert and data parallelism are not (a rank per expert group or replica).
_PARALLEL = 2


def shrink(cfg: Any, dp: int = 1) -> tuple[Any, list[str], list[str], list[str]]:
    """A copy of ``cfg`` at tiny shapes on the built-in corpus, with tensor and pipeline
    parallelism at 2 where the recipe has them (everything else -- precision, optimizer,
    data-parallel engine, MoE layout -- as it was) on one data-parallel replica; and what
    changed, which parallel paths it runs, and which of the recipe's it does not (``dp``: the
    data-parallel size the recipe was checked for)."""
    out = copy.deepcopy(cfg)
    m, t, d = out.model, out.train, out.data
    changed = [f"model {m.num_layers}x{m.hidden_size} -> 2x64, seq {m.seq_length} -> 64"]
    for k, v in _TINY_MODEL.items():
        setattr(m, k, v)
    ran: list[str] = []
    not_run: list[str] = []
    tp, pp = m.tensor_model_parallel_size, m.pipeline_model_parallel_size
    if tp > 1:
        m.tensor_model_parallel_size = _PARALLEL
        m.make_vocab_size_divisible_by = _PARALLEL  # the head's rows split over TP
        if tp != _PARALLEL:
            changed.append(f"tensor parallelism {tp} -> {_PARALLEL}")
        ran.append(f"tensor parallelism {_PARALLEL}" + (" + sequence parallelism" if m.sequence_parallel else "")
                   + (f" (Muon tp_mode={out.optimizer.muon.tp_mode})" if out.optimizer.name == "muon" else ""))
    if pp > 1:
        vpp = m.virtual_pipeline_model_parallel_size or 1
        m.pipeline_model_parallel_size = _PARALLEL
        m.virtual_pipeline_model_parallel_size = min(vpp, 2) if vpp > 1 else None
        m.num_layers = _PARALLEL * min(vpp, 2)  # one layer per model chunk
        if pp != _PARALLEL:
            changed.append(f"pipeline parallelism {pp} -> {_PARALLEL}"
                           + (f" x {min(vpp, 2)} virtual chunks" if vpp > 1 else ""))
        ran.append(f"pipeline parallelism {_PARALLEL} ({m.pipeline_schedule or 'schedule derived'}, "
                   f"{m.num_layers} layers)")
    if m.context_parallel_size != 1:
        changed.append(f"context parallelism {m.context_parallel_size} -> 1")
        not_run.append(f"context parallelism {m.context_parallel_size}")
        m.context_parallel_size, m.cp_comm_type, m.hierarchical_context_parallel_sizes = 1, "p2p", None
    if m.moe.num_experts:
        m.moe.ffn_hidden_size = 64
        if m.moe.expert_model_parallel_size != 1:
            changed.append(f"expert parallelism {m.moe.expert_model_parallel_size} -> 1")
            not_run.append(f"expert parallelism {m.moe.expert_model_parallel_size} (the token "
                           "all-to-all: every expert on every rank here)")
            m.moe.expert_model_parallel_size = 1
    if dp > 1:
        not_run.append(f"data parallelism {dp} (the gradient reduce-scatter / all-reduce and the "
                       "param all-gather between replicas: one replica here)")
    changed.append(f"batch {t.global_batch_size} -> 4 (micro 2)")
    t.global_batch_size, t.micro_batch_size, t.eval_iters = 4, 2, 1
    if d.source != "builtin:python-stdlib" or d.paths:
        changed.append(f"data {', '.join(d.paths) or d.source} -> builtin:python-stdlib (byte tokenizer)")
    d.source, d.paths, d.weights, d.tokenizer, d.builtin_max_mb = "builtin:python-stdlib", [], [], "byte", 1.0
    out.run.device = "cuda"
    out.logging.progress = False
    return out, changed, ran, not_run


def fake_gpu_steps(cfg: Any, target: str, *, steps: int = 2, te_version: Optional[str] = None,
                   cuda_version: Optional[str] = None, dp: int = 1) -> FakeStepReport:
    """Run ``steps`` training steps of ``cfg`` (shrunk: :func:`shrink`) on a virtual ``target``
    GPU per rank -- one rank, or TP x PP gloo ranks (:func:`lptrain.testing.dist.run_distributed`)
    when the recipe has tensor or pipeline parallelism -- then an evaluation and the checkpoint
    state (not written). Raises :class:`~lptrain.testing.virtual_cuda.DeviceRuleError` (one
    rank) or :class:`~lptrain.testing.dist.RankFailedError` naming the rank where a GPU would
    fail."""
    small, changed, ran, not_run = shrink(cfg, dp)
    ranks = small.model.tensor_model_parallel_size * small.model.pipeline_model_parallel_size
    if ranks == 1:
        results = [_rank_steps(0, 1, small, target, steps, te_version, cuda_version)]
    else:
        from lptrain.testing.dist import run_distributed

        results = run_distributed(_rank_steps, ranks, args=(small, target, steps, te_version, cuda_version),
                                  init_process_group=False, timeout_s=600)
    first = results[0]
    losses = first["losses"]
    if not all(math.isfinite(x) for x in losses):
        raise FloatingPointError(f"fake GPU step: non-finite loss {losses}")
    return FakeStepReport(target, first["backend"], losses, first["val"], first["syncs"], first["collectives"],
                          max(r["peak"] for r in results), changed, ranks, ran, not_run)


def _rank_steps(rank: int, world: int, small: Any, target: str, steps: int, te_version: Optional[str],
                cuda_version: Optional[str]) -> dict[str, Any]:
    """This rank's steps on its virtual GPU (module level: the ranks are spawned): losses, the
    evaluation, host syncs and collectives of the last step, peak device bytes."""
    import warnings

    from lptrain.config import World, derive
    from lptrain.data import build_train_valid_loaders
    from lptrain.train.engine import TrainEngine

    # TE's own Python calls torch's collectives by their older names, deprecated (a
    # FutureWarning per call) in torch 2.13: a rank's stderr would bury the report in them.
    warnings.filterwarnings("ignore", category=FutureWarning, module="torch.distributed")
    te = small.precision.backend == "te"
    with virtual_gpu(target, te=te, te_version=te_version, cuda_version=cuda_version) as vc:
        small = derive(small, World.detect())
        engine = TrainEngine(small)
        t = small.train
        train_it, valid_it = build_train_valid_loaders(
            small.data, seq_length=small.model.seq_length, micro_batch_size=t.micro_batch_size,
            global_batch_size=t.global_batch_size, dp_rank=engine.dp_rank, dp_size=engine.dp_size,
            vocab_size=small.model.vocab_size,
        )
        n = t.global_batch_size // (t.micro_batch_size * engine.dp_size)
        losses, syncs, coll = [], {}, {}
        for step in range(1, steps + 1):
            before_s, before_c = dict(vc.stats.syncs), dict(vc.stats.collectives)
            losses.append(engine.train_step([next(train_it) for _ in range(n)], step).loss)
            syncs = {k: v - before_s.get(k, 0) for k, v in vc.stats.syncs.items() if v - before_s.get(k, 0)}
            coll = {k: v - before_c.get(k, 0) for k, v in vc.stats.collectives.items() if v - before_c.get(k, 0)}
        val = engine.evaluate(valid_it if valid_it is not None else train_it, 1)
        with engine.params_synced():
            engine.checkpoint_state()
        backend = "emulated backend" if not te else f"TE backend, {vc.te_backend}"
        return {"losses": losses, "val": val, "syncs": syncs, "collectives": coll,
                "peak": vc.stats.bytes_peak, "backend": backend}
