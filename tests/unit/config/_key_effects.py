"""What a config observably does, for the key-effect test (test_key_effects.py).

:class:`Fingerprint` computes, lazily and in this order (cheapest first), what the run code
builds from a config -- never the config's own values:

* ``settings``: the values ``derive`` resolves (backend, buffer and optimizer choices,
  default sizes) and the data sampler's layout (micro-batches per step);
* ``model``: the model built on the meta device at full size (parameter and buffer names,
  shapes, dtypes and optimizer tags), through the memory planner's ``meta_model``;
* ``layout``: the engine's buffer layout for those parameters at the validated world size
  (buffer keys, sharding, buckets), through ``run_param_specs`` and ``plan_run_layout``;
* ``engine``: a real ``TrainEngine`` (one CPU rank; a cluster recipe shrunk to tiny widths
  first, see :data:`SHRINK`): its buffer layout, its optimizers' classes and param groups with
  every hyper-parameter, the learning rate of every group at sampled steps, and the hooks
  the data-parallel engine installs;
* ``steps``: two optimizer steps of that engine on fixed synthetic tokens (two micro-batches
  of 2 x 32 tokens): losses, gradient norms, step metrics, and the exact bytes of every fp32
  master, optimizer state tensor, delayed-scaling state and model buffer afterwards.

Two fingerprints are compared component by component; the first component that differs is
the evidence that a key changed something.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
from collections.abc import Callable
from typing import Any, Optional

import torch

from lptrain.config import World, derive
from lptrain.config.rules import get_key
from lptrain.config.schema import LPTrainConfig

# Values derive() fills in: part of the resolved settings.
DERIVED_KEYS = (
    "precision.backend", "ddp.grad_reduce_in_fp32", "ddp.bucket_size",
    "optimizer.use_layer_wise_optimizer", "model.ffn_hidden_size", "model.num_query_groups",
    "model.moe.ffn_hidden_size",
)

# A cluster recipe runs its engine at the tiny model's widths on one CPU rank (the model
# fragment configs/model/tiny[_moe].yaml and configs/train/tiny.yaml), keeping every other
# setting, and at most 3 layers (enough for the first/last-bf16 layer counts to matter).
# A key in this set is judged on the full-size components only (model, layout, settings).
SHRINK: dict[str, Any] = {
    "model.hidden_size": 64, "model.ffn_hidden_size": 256, "model.num_attention_heads": 4,
    "model.num_query_groups": 4, "model.seq_length": 128, "model.vocab_size": 259,
    "model.make_vocab_size_divisible_by": 1, "model.moe.ffn_hidden_size": 64,
    "model.moe.expert_model_parallel_size": 1, "train.micro_batch_size": 4,
    "train.global_batch_size": 8, "precision.backend": "emulated", "run.device": "cpu",
    "ddp.num_distributed_optimizer_instances": 1,
    # one CPU rank: no tensor parallelism (its effects: tests/dist/test_tensor_parallel.py)
    "model.tensor_model_parallel_size": 1, "model.sequence_parallel": False,
    # (nor pipeline parallelism: tests/dist/test_pipeline_parallel.py)
    "model.pipeline_model_parallel_size": 1, "model.virtual_pipeline_model_parallel_size": None,
    "model.pipeline_schedule": None,
    # (nor context parallelism: tests/dist/test_context_parallel.py)
    "model.context_parallel_size": 1, "model.cp_comm_type": "p2p",
    "model.hierarchical_context_parallel_sizes": None,
}
MAX_SHRUNK_LAYERS = 3
STEPS = 1
# Synthetic micro-batches of the first steps: 2 of 2 sequences x 32 tokens (every recipe's
# blocks divide 64 tokens; two sequences, so per-sequence losses differ from per-batch ones);
# the configured batch shape is observed by the settings component instead.
STEP_MICRO_BATCHES, STEP_SEQS, STEP_TOKENS = 1, 2, 32

Component = Callable[["Fingerprint"], Any]


def set_key(cfg: Any, key: str, value: Any) -> None:
    *path, leaf = key.split(".")
    obj = cfg
    for p in path:
        obj = getattr(obj, p)
    setattr(obj, leaf, value)


def shrunk(cfg: LPTrainConfig) -> LPTrainConfig:
    """``cfg`` (composed, not derived) at tiny widths on one CPU rank; unchanged for a recipe
    that already runs on the CPU (the ``*_cpu`` siblings and tiny_cpu)."""
    out = copy.deepcopy(cfg)
    for key, value in SHRINK.items():
        if key == "model.moe.ffn_hidden_size" and not out.model.moe.num_experts:
            continue
        set_key(out, key, value)
    out.model.num_layers = min(out.model.num_layers, MAX_SHRUNK_LAYERS)
    return out


def _tags(p: torch.Tensor) -> tuple[Any, ...]:
    from lptrain.optim.param_groups import PARAM_ATTRIBUTES

    return tuple((a, repr(getattr(p, a))) for a in PARAM_ATTRIBUTES if hasattr(p, a))


def _layout_summary(layout: Any) -> Any:
    """Buffers (key, staging dtype, sharding, buckets) and the shard count they split into."""
    return layout.dp, tuple(
        (b.key.describe(), str(b.key.param_dtype), b.sharded, b.shards_grads, b.shards_params,
         tuple((k.start, k.end, k.numel_unpadded, k.params) for k in b.buckets))
        for b in layout.buffers
    )


def _value(v: Any) -> Any:
    """A hashable, comparable stand-in for a param-group entry."""
    if torch.is_tensor(v):
        return ("tensor", tuple(v.shape), str(v.dtype))
    if isinstance(v, (list, tuple)):
        return tuple(_value(x) for x in v)
    return v


def _digest(tensors: dict[str, torch.Tensor]) -> str:
    h = hashlib.blake2b(digest_size=16)
    for name in sorted(tensors):
        t = tensors[name].detach().cpu().contiguous()
        h.update(name.encode())
        h.update(str((tuple(t.shape), t.dtype)).encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def _flat_tensors(tree: Any, prefix: str = "") -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    if torch.is_tensor(tree):
        out[prefix] = tree
    elif isinstance(tree, dict):
        for k, v in tree.items():
            out.update(_flat_tensors(v, f"{prefix}/{k}"))
    return out


_META_MODELS: dict[str, torch.nn.Module] = {}


class Fingerprint:
    """The observable components of one config in one world (see the module doc)."""

    ORDER = ("settings", "model", "layout", "engine", "steps")

    def __init__(self, cfg: LPTrainConfig, world: World, *, engine_cfg: Optional[LPTrainConfig]) -> None:
        self.cfg = derive(cfg, world)
        self.world = world
        # None: the engine components are not comparable (a shrink key was changed).
        self.engine_cfg = derive(engine_cfg, World(dp=1)) if engine_cfg is not None else None
        self._cache: dict[str, Any] = {}
        self._built: Any = None  # the TrainEngine, built on first use

    def get(self, name: str) -> Any:
        if name not in self._cache:
            self._cache[name] = getattr(self, f"_{name}")()
        return self._cache[name]

    def first_difference(self, other: Fingerprint, ignore_settings: tuple[str, ...] = ()) -> Optional[str]:
        """The first component in which ``other`` differs, or None."""
        for name in self.ORDER:
            if name in ("engine", "steps") and (self.engine_cfg is None or other.engine_cfg is None):
                continue
            if name == "settings":
                a, b = self._settings(ignore_settings), other._settings(ignore_settings)
            else:
                a, b = self.get(name), other.get(name)
            if a != b:
                return name
        return None

    # ---- components ----------------------------------------------------------------------

    def _settings(self, ignore: tuple[str, ...] = ()) -> Any:
        from lptrain.data.sampler import GlobalBatchSampler

        c = self.cfg
        derived = tuple((k, get_key(c, k)) for k in DERIVED_KEYS if k not in ignore)
        try:
            s = GlobalBatchSampler(c.train.global_batch_size, c.train.micro_batch_size, 0, self.world.dp)
            sampler: Any = (s.num_micro_batches, s.micro_batch_size)
        except Exception as e:  # a valid config never gets here; recorded, not hidden
            sampler = repr(e)
        return derived, sampler

    def _meta_model(self) -> torch.nn.Module:
        """The meta-device model, shared between configs whose model-building sections are
        equal. Safe for the test's purpose: sharing can only hide a difference (a key would
        then be reported as ignored, a visible failure), never invent one."""
        from lptrain.memory.plan import meta_model

        c = self.cfg
        key = repr((c.model, c.precision, c.train.seed, c.train.gradient_accumulation_fusion))
        if key not in _META_MODELS:
            _META_MODELS[key] = meta_model(c)
        return _META_MODELS[key]

    def _model(self) -> Any:
        m = self._meta_model()
        params = tuple((n, tuple(p.shape), str(p.dtype), _tags(p)) for n, p in m.named_parameters())
        buffers = tuple((n, tuple(b.shape), str(b.dtype)) for n, b in m.named_buffers())
        return params, buffers

    def _layout(self) -> Any:
        from lptrain.distributed.layout import run_param_specs
        from lptrain.memory.plan import _group_sizes, engine_layout

        named = [(n, p) for n, p in self._meta_model().named_parameters() if p.requires_grad]
        dense, _ = _group_sizes(self.cfg, self.world.dp)
        return _layout_summary(engine_layout(self.cfg, run_param_specs(self.cfg, named), dense))

    def _train_engine(self) -> Any:
        if self._built is None:
            from lptrain.train.engine import TrainEngine

            self._built = TrainEngine(self.engine_cfg)
        return self._built

    def _engine(self) -> Any:
        e = self._train_engine()
        optimizers = []
        for child in e.optimizer.children:
            for opt in getattr(child, "optimizers", []):
                groups = tuple(
                    (*sorted((k, _value(v)) for k, v in g.items() if k not in ("params", "lr")),
                     ("params", tuple(tuple(p.shape) for p in g["params"])))
                    for g in opt.param_groups
                )
                optimizers.append((type(child).__name__, child.label, type(opt).__name__, groups))
        t = e.cfg.train
        end = max(t.train_iters, e.cfg.optimizer.decay_iters or 0, e.cfg.optimizer.warmup_iters + 2)
        steps = sorted({1, 2, e.cfg.optimizer.warmup_iters, e.cfg.optimizer.warmup_iters + 1,
                        *(max(1, end * k // 64) for k in range(1, 65)), end + 1})
        schedule = tuple((s, tuple(sorted(e.lr_for_step(s).items()))) for s in steps)
        # The hooks the data-parallel engine installs on the model (grad-ready hooks on every
        # param, forward pre-hooks for the overlapped param gather) and when it stages masters.
        hooks = tuple((n, len(m._forward_pre_hooks)) for n, m in e.model.named_modules()
                      if m._forward_pre_hooks)
        return (_layout_summary(e.layout), tuple(optimizers), schedule, e.optimizer.clip_grad,
                hooks, e.defer_staging)

    def _steps(self) -> Any:
        e = self._train_engine()
        c = e.cfg
        g = torch.Generator().manual_seed(0)
        out = []
        for step in range(1, STEPS + 1):
            batches = []
            for _ in range(STEP_MICRO_BATCHES):
                tok = torch.randint(0, c.model.vocab_size, (STEP_SEQS, STEP_TOKENS + 1), generator=g)
                batches.append({"tokens": tok[:, :-1].contiguous(), "labels": tok[:, 1:].contiguous()})
            r = e.train_step(batches, step)
            out.append((r.loss, r.grad_norm, r.skipped, tuple(sorted(r.extra.items()))))
        state = e.checkpoint_state()["global"]
        buffers = {n: b for n, b in e.model.named_buffers()}
        return tuple(out), _digest(_flat_tensors(state)), _digest(buffers)


def fields_of(cfg: LPTrainConfig) -> list[str]:
    """Every leaf key of the schema, in declaration order."""
    out: list[str] = []

    def walk(obj: Any, prefix: str) -> None:
        for f in dataclasses.fields(obj):
            v = getattr(obj, f.name)
            if dataclasses.is_dataclass(v):
                walk(v, f"{prefix}{f.name}.")
            else:
                out.append(prefix + f.name)

    walk(cfg, "")
    return out
