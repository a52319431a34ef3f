"""Every refusal a constructor can make for a config reason is a rule that fires first.

The scan walks the model, data, engine, optimizer, distributed and precision modules and
collects each ``raise`` inside a constructor (``__init__``, ``__post_init__``,
``add_param_group``, ``build_*`` functions, and the functions of the same module they call,
transitively). Every site must be in :data:`SITES`: either the rule that refuses the same
config before anything is built (``validate-config`` and ``pretrain --dry-run`` report it) --
checked on a config that reaches the site, and where a cheap build exists, checked to really
raise there when validation is skipped -- or why no config value can reach it (a guard on the
API, on data files, or on an invariant the code upholds itself). A new raise in a
constructor fails this test until it is classified.
"""

from __future__ import annotations

import ast
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import pytest
import torch

from lptrain.config import World, check, compose, derive
from lptrain.config.compose import repo_root

SCANNED = [
    "lptrain/model", "lptrain/data/loader.py", "lptrain/data/blend.py",
    "lptrain/data/gpt_dataset.py", "lptrain/data/sampler.py", "lptrain/data/indexed.py",
    "lptrain/train/engine.py", "lptrain/optim", "lptrain/distributed",
    "lptrain/precision/factory.py", "lptrain/precision/recipes.py", "lptrain/precision/delayed_scaling.py",
    "lptrain/precision/layers.py",
    "lptrain/precision/te_adapter.py", "lptrain/precision/fused_adam.py",
]
ROOT_NAMES = {"__init__", "__post_init__", "add_param_group"}
# Called from a constructor in another module (build_factory -> runtime_backend ->
# resolve_backend, recipe_from_config -> selected_recipe).
EXTRA_ROOTS = {("lptrain/precision/te_adapter.py", "resolve_backend"),
               ("lptrain/precision/recipes.py", "selected_recipe")}


def _snippet(exc: ast.expr) -> str:
    """``Type: first literal text`` of a raised exception (stable under message edits)."""
    call = exc if isinstance(exc, ast.Call) else None
    name = ast.unparse(call.func if call else exc)
    text = ""
    if call and call.args:
        first = call.args[0]
        if isinstance(first, ast.Constant):
            text = str(first.value)
        elif isinstance(first, ast.JoinedStr):
            text = "".join(v.value if isinstance(v, ast.Constant) else "{}" for v in first.values)
    return f"{name}: {text}"


def _functions(tree: ast.AST) -> dict[str, ast.AST]:
    """Module functions and methods by qualified name (``Class.method``)."""
    funcs: dict[str, ast.AST] = {}

    def collect(node: ast.AST, prefix: str) -> None:
        for n in ast.iter_child_nodes(node):
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)):
                funcs[prefix + n.name] = n
            elif isinstance(n, ast.ClassDef):
                collect(n, prefix + n.name + ".")

    collect(tree, "")
    return funcs


def _callees(funcs: dict[str, ast.AST], q: str) -> set[str]:
    """The functions of the same module that ``q`` calls by name (or as ``self.``/``cls.``)."""
    cls = q.rsplit(".", 1)[0] if "." in q else None
    out: set[str] = set()
    for n in ast.walk(funcs[q]):
        if not isinstance(n, ast.Call):
            continue
        fn = n.func
        if isinstance(fn, ast.Name):
            out |= {fn.id, f"{fn.id}.__init__", f"{fn.id}.__post_init__"} & funcs.keys()
        elif (isinstance(fn, ast.Attribute) and isinstance(fn.value, ast.Name)
              and fn.value.id in ("self", "cls") and cls):
            out |= {f"{cls}.{fn.attr}"} & funcs.keys()
    return out


def _module_sites(rel: str, tree: ast.AST) -> set[str]:
    funcs = _functions(tree)
    todo = [q for q in funcs if q.rsplit(".", 1)[-1] in ROOT_NAMES
            or q.rsplit(".", 1)[-1].startswith("build_") or (rel, q) in EXTRA_ROOTS]
    seen: set[str] = set()
    while todo:
        q = todo.pop()
        if q not in seen:
            seen.add(q)
            todo.extend(_callees(funcs, q))
    return {f"{rel}::{q}::{_snippet(n.exc)}" for q in seen for n in ast.walk(funcs[q])
            if isinstance(n, ast.Raise) and n.exc is not None}


def scan() -> set[str]:
    """``path::function::Type: message`` of every raise reachable from a constructor."""
    root = repo_root()
    sites: set[str] = set()
    for entry in SCANNED:
        p = root / entry
        for f in sorted(p.rglob("*.py")) if p.is_dir() else [p]:
            sites |= _module_sites(str(f.relative_to(root)), ast.parse(f.read_text()))
    return sites


@dataclass(frozen=True)
class ByRule:
    """Reached by ``overrides`` (on the schema defaults) in ``world``; ``rule`` refuses it.
    ``build`` (optional) runs the constructor on the derived config, which must raise."""

    rule: str
    overrides: tuple[str, ...]
    world: World = field(default_factory=World)
    build: Optional[Callable[[Any], Any]] = None


@dataclass(frozen=True)
class NotConfig:
    why: str


def _meta_build(cfg: Any) -> Any:
    from lptrain.model.build import build_model

    with torch.device("meta"):
        return build_model(cfg)


def _cpu_build(cfg: Any) -> Any:
    from lptrain.model.build import build_model

    return build_model(cfg)


def _groups(cfg: Any) -> Any:
    from lptrain.distributed.groups import build_groups

    moe = cfg.model.moe
    return build_groups(cfg.ddp.num_distributed_optimizer_instances,
                        ep=moe.expert_model_parallel_size if moe.num_experts else 1,
                        tp=cfg.model.tensor_model_parallel_size, pp=cfg.model.pipeline_model_parallel_size,
                        cp=cfg.model.context_parallel_size)


def _tp_orthogonalizer(cfg: Any) -> Any:
    from lptrain.optim.tp_muon import TPOrthogonalizer

    return TPOrthogonalizer(cfg.optimizer.muon.tp_mode)


def _muon(cfg: Any) -> Any:
    from lptrain.optim.muon import MuonWithAdamW

    w = torch.zeros(4, 4)
    w.use_muon = True
    return MuonWithAdamW([w], [], cfg.optimizer)


def _fused_adam(cfg: Any) -> Any:
    from lptrain.optim.precision_aware import fused_adam, state_precision

    return fused_adam([torch.zeros(4, dtype=torch.bfloat16)], [], cfg.optimizer, state_precision(cfg))


def _recipe(cfg: Any) -> Any:
    from lptrain.precision.factory import recipe_from_config

    return recipe_from_config(cfg.precision)


def _sampler(cfg: Any) -> Any:
    from lptrain.data.sampler import GlobalBatchSampler

    t = cfg.train
    return GlobalBatchSampler(t.global_batch_size, t.micro_batch_size, 0, 1)


MOE = ("model.moe.num_experts=4",)
MUON = ("optimizer.name=muon",)
PAO = ("optimizer.use_precision_aware_optimizer=true", "ddp.use_distributed_optimizer=true")
E4M3 = ("precision.fp8_format=e4m3",)
FILES = "the dataset's files on disk, not a config value (the loader checks them in full)"
API = "a guard on how the class is called by code, not reachable from a config"

SITES: dict[str, ByRule | NotConfig] = {
    # model
    "lptrain/model/attention.py::attention_shape::ValueError: hidden {}, heads {}, groups {} do not divide":
        ByRule("MODEL-HEADS", ("model.num_attention_heads=3",), build=_meta_build),
    "lptrain/model/rope.py::RotaryEmbedding.__init__::ValueError: RoPE needs an even head_dim, got {}":
        ByRule("MODEL-HEADS", ("model.hidden_size=68",), build=_meta_build),
    "lptrain/model/moe/layer.py::MoELayer.__init__::ValueError: num_experts {} not divisible by EP size {}":
        ByRule("MOE-EP-DIVIDES", (*MOE, "model.moe.expert_model_parallel_size=3",
                                  "train.global_batch_size=24"), World(dp=6), build=_meta_build),
    "lptrain/model/moe/router.py::TopKRouter.__init__::ValueError: unknown load_balancing_type {}":
        ByRule("MOE-CHOICES", (*MOE, "model.moe.load_balancing_type=balanced"), build=_meta_build),
    "lptrain/model/moe/router.py::TopKRouter.__init__::ValueError: router_topk {} not in [1, {}]":
        ByRule("MOE-TOPK", (*MOE, "model.moe.router_topk=5"), build=_meta_build),
    "lptrain/model/moe/router.py::TopKRouter.__init__::ValueError: enable_expert_bias needs score_function=sigm":
        ByRule("MOE-EXPERT-BIAS-SCORE", (*MOE, "model.moe.enable_expert_bias=true"), build=_meta_build),
    "lptrain/model/build.py::params_dtype_of::ValueError: unknown params_dtype {}; expected one of {}":
        ByRule("PREC-CHOICES", ("precision.params_dtype=fp16",)),
    "lptrain/model/build.py::build_model::ValueError: expert_model_parallel_rank {} not in [0, {})":
        NotConfig("the engine passes its own expert-parallel rank, always inside [0, EP)"),
    "lptrain/model/build.py::build_model::DeviceError: precision.backend=te builds Transformer Engine ":
        ByRule("PREC-TE-NEEDS-CUDA-DEVICE", ("precision.backend=te", "run.device=cpu"),
               World(dp=1, target="sm90", te_version="2.14", cuda=True)),
    "lptrain/model/build.py::resolve_device::DeviceError: run.device=cuda but torch.cuda.is_available() is Fal":
        ByRule("RUN-DEVICE-CUDA", ("run.device=cuda",),
               build=None if torch.cuda.is_available() else _cpu_build),
    "lptrain/model/build.py::resolve_device::DeviceError: run.device must be auto, cpu or cuda, got {}":
        ByRule("RUN-CHOICES", ("run.device=gpu",), build=_cpu_build),
    # data
    "lptrain/data/loader.py::build_streams::DataError: data.weights has {} entries for {} data.paths":
        ByRule("RANGE-DATA", ("data.paths=[/nonexistent/a,/nonexistent/b]", "data.weights=[1.0]")),
    "lptrain/data/loader.py::open_dataset::DataError: dataset {} was tokenized with {} (sha256 {})":
        ByRule("DATA-FITS-MODEL", ()),  # see test_data_sites_refused_where_the_data_is_readable
    "lptrain/data/gpt_dataset.py::GPTDataset.__init__::DataError: dataset {}: {} tokens in {} documents is fewer":
        ByRule("DATA-FITS-MODEL", ()),  # (ditto)
    "lptrain/data/blend.py::BlendedStream.__init__::DataError: a blend needs at least one dataset":
        NotConfig("the loader always builds a blend of at least one dataset"),
    "lptrain/data/blend.py::BlendedStream.__init__::DataError: blended datasets disagree on seq_length: {}":
        NotConfig("the loader gives every dataset of a blend the one model.seq_length"),
    "lptrain/data/blend.py::BlendedStream.__init__::DataError: {} blend weights for {} datasets":
        ByRule("RANGE-DATA", ("data.paths=[/nonexistent/a,/nonexistent/b]", "data.weights=[1.0]")),
    "lptrain/data/blend.py::BlendedStream.__init__::DataError: blend weights must be finite, >= 0 and not a":
        ByRule("RANGE-DATA", ("data.paths=[/nonexistent/a,/nonexistent/b]", "data.weights=[0.0,0.0]")),
    "lptrain/data/sampler.py::GlobalBatchSampler.__init__::DataError: bad sampler layout: micro_batch_size={}, dp_":
        ByRule("RANGE-TRAIN", ("train.micro_batch_size=0",), build=_sampler),
    "lptrain/data/sampler.py::GlobalBatchSampler.__init__::DataError: global_batch_size {} is not a multiple of ":
        ByRule("BATCH-DIVISIBLE", ("train.global_batch_size=6",), build=_sampler),
    **{f"lptrain/data/indexed.py::{site}": NotConfig(FILES) for site in (
        "IndexedDataset.__init__::DataError: {}: unsupported token dtype {}",
        "IndexedDataset.__init__::DataError: wrong dtype in {}: {} cannot hold vocabulary {}",
        "IndexedDataset.__init__::DataError: token file not found: {} (its index exists: {}",
        "IndexedDataset.__init__::DataError: size mismatch for {}: {} bytes on disk, the ind",
        "IndexedDataset.__init__::DataError: token checksum mismatch for {}: the dataset is",
        "check_present::DataError: dataset index not found: {} (not prepared yet, or",
        "check_present::DataError: token file not found: {} (its index exists: {}",
        "read_index::DataError: {} is not an lptrain index (bad magic bytes)",
        "read_index::DataError: {}: unsupported index format {} v{}",
        "read_index::DataError: index size mismatch in {}: {} offset bytes for {} ",
        "read_index::DataError: offsets checksum mismatch in {}: the index is corr",
        "read_index::DataError: inconsistent document offsets in {}",
        "read_index::DataError: corrupt index header in {}: {}",
        "read_index::DataError: corrupt index header in {}: not a JSON object",
    )},
    "lptrain/data/loader.py::open_dataset::DataError: dataset {} records EOS id {} but its tokeni":
        NotConfig("a corrupt index: the tokenizer's identity matched, only its recorded EOS id "
                  "disagrees (the dataset's files, not a config value)"),
    "lptrain/data/indexed.py::IndexedDatasetWriter.__post_init__::OutputDirError: cannot write the dataset {}: {}":
        NotConfig("prepare-data's --output folder (a command-line argument, not a config key)"),
    # data-parallel buffers
    "lptrain/distributed/buffers.py::ParamAndGradBuffer.__init__::ValueError: ddp.reuse_grad_buf_for_mxfp8_param_ag needs":
        ByRule("DDP-SHARDED-GRADS-NO-GRAD-BUF-REUSE",
               ("ddp.data_parallel_sharding_strategy=optim_grads", *E4M3, "precision.fp8_recipe=mxfp8",
                "precision.fp8_param_gather=true", "ddp.reuse_grad_buf_for_mxfp8_param_ag=true")),
    "lptrain/distributed/buffers.py::ParamAndGradBuffer.param_slice::IndexError: params [{}, {}) are outside":
        NotConfig("ranges the buffer computes from its own layout (its buckets' shards)"),
    # optimizers
    "lptrain/optim/distributed.py::param_location::RuntimeError: {} param: TE holds masters of plain params only":
        ByRule("PAO-TE-MASTERS-QUANTIZED-PG", (*PAO, *E4M3, "precision.fp8_recipe=mxfp8",
                                               "precision.fp8_param_gather=true",
                                               "ddp.reuse_grad_buf_for_mxfp8_param_ag=true",
                                               "optimizer.main_params_dtype=fp16")),
    "lptrain/precision/fused_adam.py::EmulatedFusedAdam.__init__::RuntimeError: FusedAdam only supports fp32/fp16 master w":
        ByRule("OPT-CHOICES", (*PAO, "optimizer.main_params_dtype=bf16"), build=_fused_adam),
    "lptrain/precision/fused_adam.py::EmulatedFusedAdam.__init__::RuntimeError: FusedAdam only supports fp32/fp16/bf16/fp8":
        ByRule("OPT-CHOICES", (*PAO, "optimizer.exp_avg_dtype=fp64")),
    "lptrain/optim/distributed.py::ShardedMasterOptimizer.__init__::RuntimeError: Muon params must be whole on a rank (unsh":
        NotConfig("the layout never shards Muon buffers (plan_layout keeps them whole)"),
    "lptrain/optim/muon.py::MuonWithAdamW.__init__::ValueError: optimizer.muon.scalar_optimizer={} is not on":
        ByRule("OPT-CHOICES", (*MUON, "optimizer.muon.scalar_optimizer=sgd"), build=_muon),
    "lptrain/optim/muon.py::MuonWithAdamW.__init__::ValueError: MuonWithAdamW: give names for all params or":
        NotConfig(API),
    "lptrain/optim/muon.py::MuonWithAdamW.__init__::ValueError: MuonWithAdamW: duplicate param names": NotConfig(API),
    "lptrain/optim/muon.py::MuonWithAdamW.__init__::ValueError: MuonWithAdamW: a tensor was passed twice (o":
        NotConfig(API),
    "lptrain/optim/muon.py::MuonWithAdamW.add_param_group::ValueError: MuonWithAdamW param group needs optimize":
        NotConfig(API),
    "lptrain/optim/muon.py::_validate_hparams::ValueError: optimizer.muon.momentum={} not in [0, 1)":
        ByRule("MUON-HPARAMS", (*MUON, "optimizer.muon.momentum=1.0"), build=_muon),
    "lptrain/optim/muon.py::_validate_hparams::ValueError: optimizer.muon.ns_steps={} must be >= 1":
        ByRule("MUON-HPARAMS", (*MUON, "optimizer.muon.ns_steps=0"), build=_muon),
    "lptrain/optim/muon.py::_validate_hparams::ValueError: optimizer.muon.ns_steps: {}":
        ByRule("MUON-HPARAMS", (*MUON, "optimizer.muon.coefficients=aol"), build=_muon),
    "lptrain/optim/muon.py::_validate_hparams::ValueError: optimizer.lr={} must be >= 0":
        ByRule("MUON-HPARAMS", (*MUON, "optimizer.lr=-1.0", "optimizer.min_lr=0"), build=_muon),
    "lptrain/optim/muon.py::_validate_hparams::ValueError: optimizer.weight_decay={} must be >= 0":
        ByRule("OPT-VALUES", (*MUON, "optimizer.weight_decay=-0.1"), build=_muon),
    "lptrain/optim/muon.py::_validate_param::ValueError: Muon got a 3-D param of shape {} with num_":
        NotConfig("the model tags every grouped expert weight (lptrain.model.params)"),
    "lptrain/optim/muon.py::_validate_param::ValueError: Muon handles 2-D matrices (or grouped 3-D":
        NotConfig("the model routes only matrices to Muon (is_muon_param)"),
    "lptrain/optim/muon.py::_validate_param::ValueError: is_qkv param of shape {} needs qkv_split_sh":
        NotConfig("attention sets qkv_split_shapes from the validated head counts"),
    "lptrain/optim/tp_muon.py::TPOrthogonalizer.__init__::ValueError: optimizer.muon.tp_mode={} must be one of {}":
        ByRule("OPT-CHOICES", (*MUON, "optimizer.muon.tp_mode=blockwise", "model.tensor_model_parallel_size=2"),
               build=_tp_orthogonalizer),
    "lptrain/model/build.py::build_model::ValueError: model.tensor_model_parallel_size={} but the tensor-pa":
        NotConfig("the engine passes its own tensor-parallel group, of the configured size (build_groups)"),
    "lptrain/model/build.py::build_model::ValueError: model.context_parallel_size={} but no context-parall":
        NotConfig("the engine passes its own context-parallel groups, of the configured size (build_groups)"),
    # process groups
    "lptrain/distributed/groups.py::_check_sizes::ConfigError: model.tensor_model_parallel_size={} must divi":
        ByRule("LAUNCH-TP-DIVIDES-WORLD", ("model.tensor_model_parallel_size=2",), World(ranks=1), build=_groups),
    "lptrain/distributed/groups.py::_check_sizes::ConfigError: tensor x context parallel = {} x {} must divide the world size {}":
        ByRule("LAUNCH-CP-DIVIDES-WORLD", ("model.context_parallel_size=2",), World(ranks=1), build=_groups),
    "lptrain/distributed/groups.py::_check_sizes::ConfigError: tensor x context x pipeline parallel = {} x {} x {} must divide the world size {}":
        ByRule("LAUNCH-PP-DIVIDES-WORLD", ("model.pipeline_model_parallel_size=2",), World(ranks=1),
               build=_groups),
    "lptrain/distributed/groups.py::_check_sizes::ConfigError: ddp.num_distributed_optimizer_instances={} mu":
        ByRule("DDP-INSTANCES-DIVIDE-DP", ("ddp.use_distributed_optimizer=true",
                                           "ddp.num_distributed_optimizer_instances=2"), build=_groups),
    "lptrain/distributed/groups.py::_check_sizes::ConfigError: model.moe.expert_model_parallel_size={} must ":
        ByRule("LAUNCH-EP-DIVIDES-WORLD", (*MOE, "model.moe.expert_model_parallel_size=2"), build=_groups),
    "lptrain/distributed/groups.py::_check_sizes::ConfigError: expert_model_parallel_size={} x num_distribu":
        ByRule("EP-INSTANCES-DIVIDE-WORLD", (*MOE, "model.moe.expert_model_parallel_size=2",
                                             "ddp.use_distributed_optimizer=true",
                                             "ddp.num_distributed_optimizer_instances=2"), World(dp=2)),
    # precision
    "lptrain/precision/factory.py::params_dtype_of::ValueError: precision.params_dtype must be one of {}, g":
        ByRule("PREC-CHOICES", ("precision.params_dtype=fp64",), build=_cpu_build),
    "lptrain/precision/recipes.py::selected_recipe::ValueError: precision.fp8_recipe must be {}, got {}":
        ByRule("PREC-CHOICES", (*E4M3, "precision.fp8_recipe=mxfp88"), build=_recipe),
    "lptrain/precision/recipes.py::selected_recipe::ValueError: precision.fp4_format/fp4_recipe: only {} is":
        ByRule("PREC-CHOICES", ("precision.fp4_format=e3m0",), build=_recipe),
    "lptrain/precision/recipes.py::DelayedScaling.__post_init__::ValueError: amax_compute_algo must be {}, got {}":
        ByRule("PREC-CHOICES", (*E4M3, "precision.fp8_amax_compute_algo=mean"), build=_recipe),
    "lptrain/precision/delayed_scaling.py::DelayedScalingState.__post_init__::ValueError: amax_history_len must be >= 1":
        ByRule("RANGE-PRECISION", (*E4M3, "precision.fp8_amax_history_len=0"),
               build=lambda cfg: _recipe(cfg).make_state("input")),
    "lptrain/precision/recipes.py::BlockwiseScaling.__post_init__::ValueError: block scaling dims must be 1 or 2, got {}":
        NotConfig("the block dims are the recipe's constants; no config key sets them"),
    "lptrain/precision/recipes.py::NVFP4Scaling.__post_init__::ValueError: NVFP4 block scales are E4M3":
        NotConfig("the factory builds NVFP4 with its E4M3 scale format; no config key sets it"),
    "lptrain/precision/te_adapter.py::resolve_backend::BackendUnavailableError: precision.backend=te needs a CUDA":
        ByRule("PREC-BACKEND-AVAILABLE", ("precision.backend=te",)),
    "lptrain/precision/te_adapter.py::resolve_backend::BackendUnavailableError: precision.backend=te needs Transformer":
        ByRule("PREC-BACKEND-AVAILABLE", ("precision.backend=te",),
               World(dp=1, target="sm90", te_version=None, cuda=True)),
    "lptrain/precision/te_adapter.py::resolve_backend::ValueError: precision.backend must be {}, got {}":
        ByRule("PREC-CHOICES", ("precision.backend=tensorrt",)),
    "lptrain/precision/te_adapter.py::resolve_backend::ValueError: precision.backend=auto is resolved by lptr":
        NotConfig("runtime_backend resolves auto (through derive) before it calls resolve_backend"),
}


def _matches(entry: str, site: str) -> bool:
    """An entry ``path::function::Type: start of the message`` names the sites whose message
    starts so (``{}`` stands for each interpolated value)."""
    return site.startswith(entry)


def test_every_constructor_raise_is_classified() -> None:
    found = scan()
    assert found, "the scan found no raise at all: it is broken"
    unclassified = sorted(s for s in found if not any(_matches(e, s) for e in SITES))
    assert not unclassified, f"classify these raise sites: {unclassified}"
    ambiguous = sorted(s for s in found if sum(_matches(e, s) for e in SITES) > 1)
    assert not ambiguous, ambiguous
    stale = sorted(e for e in SITES if not any(_matches(e, s) for s in found))
    assert not stale, f"entries that match no raise: {stale}"


RULE_SITES = [(k, v) for k, v in SITES.items() if isinstance(v, ByRule) and v.overrides]


@pytest.mark.parametrize(("site", "entry"), RULE_SITES, ids=[k.split("::", 1)[1] for k, _ in RULE_SITES])
def test_a_rule_refuses_it_before_the_constructor_runs(site: str, entry: ByRule) -> None:
    cfg = compose(None, list(entry.overrides))
    errors = [v.rule for v in check(cfg, entry.world) if v.severity == "error"]
    assert entry.rule in errors, (site, errors)
    if entry.build is not None:
        with pytest.raises(Exception):  # noqa: B017  (each constructor raises its own type)
            entry.build(derive(cfg, entry.world))


def test_data_sites_refused_where_the_data_is_readable(tmp_path: Path) -> None:
    """The loader's tokenizer and sample-size refusals, reached with a real dataset, are
    DATA-FITS-MODEL findings first (the rule reads the same headers and split)."""
    from lptrain.data.loader import build_streams
    from lptrain.data.prepare import prepare_dataset

    src = tmp_path / "src"
    src.mkdir()
    for i in range(20):
        (src / f"{i}.txt").write_text(f"doc{i} " * 8)
    prepare_dataset([src], tmp_path / "ds")
    prefix = str(tmp_path / "ds")
    for overrides, words in (
        ([f"data.source={prefix}", "model.seq_length=4096"], "fewer than one sample"),
        ([f"data.source={prefix}", f"data.tokenizer={tmp_path / 'tok.json'}"], "tokenized with"),
    ):
        if "tokenizer" in overrides[-1]:  # another tokenizer than the data's (byte)
            from tokenizers import Tokenizer, models

            tok = Tokenizer(models.BPE())
            tok.add_special_tokens(["</s>"])
            tok.save(str(tmp_path / "tok.json"))
        cfg = compose(None, overrides)
        assert "DATA-FITS-MODEL" in {v.rule for v in check(cfg, World())}, overrides
        with pytest.raises(Exception, match=words):
            d = derive(cfg, World())
            build_streams(d.data, d.model.seq_length, d.model.vocab_size)
