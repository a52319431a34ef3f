#!/usr/bin/env python3
"""Write ``tests/data/te_api.json``: the Transformer Engine API lptrain touches, per TE release,
read from TE's own source (a git checkout; nothing is imported, so no GPU or build is needed).

    python scripts/te_manifest.py --repo PATH/TO/TransformerEngine [--out tests/data/te_api.json]

``--repo`` is a clone of https://github.com/NVIDIA/TransformerEngine (a bare clone will do): every
release tag from ``--since`` (default: lptrain's oldest supported TE, 2.2) and every
``release_vX.Y`` branch of a newer release that has no tag yet (2.19 at the time of writing) are
read with ``git``; ``--release 2.20=.te-python/2.20.2`` adds a release from its installed Python
wheel (``make install``'s folders) where the clone has neither. For each release the script parses the Python sources with :mod:`ast` and
records, for the classes and functions lptrain reaches (``CLASSES`` / ``FUNCTIONS`` below, by
the public path lptrain imports them from):

* each class's methods, properties, attributes (class-level, and instance attributes assigned in
  its methods, ``instance.x = ...`` in a storage ``__new__`` included), constructor keywords,
  its bases and the non-TE bases it ends in (``torch.Tensor``, ``torch.nn.Module``, ...),
  *flattened* over its TE bases, so a member is listed where Python would find it;
* each function's parameters, and whether each module path exists and what it exports;
* a few behaviours lptrain depends on per release, as predicates on the source
  (``FEATURES``): whether ``prepare_forward`` restores the recompute state in a ``finally``,
  whether quantized tensors are traceable wrapper subclasses, ...

Each fact is stored with the releases it holds for, as ranges (``"2.8-2.13,2.15"``), so the
file stays small and a diff between two generations reads as "what changed in TE". The tests
in ``tests/unit/precision/test_te_manifest.py`` hold lptrain's TE-facing calls and its version
gates to this file.
"""

from __future__ import annotations

import argparse
import ast
import json
import re
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / "tests" / "data" / "te_api.json"

# Public paths lptrain imports or reaches (module, name). Bases are followed automatically.
CLASSES: tuple[tuple[str, str], ...] = (
    ("transformer_engine.pytorch.tensor", "QuantizedTensor"),
    ("transformer_engine.pytorch.tensor", "Quantizer"),
    ("transformer_engine.pytorch.tensor.float8_tensor", "Float8Tensor"),
    ("transformer_engine.pytorch.tensor.float8_tensor", "Float8Quantizer"),
    ("transformer_engine.pytorch.tensor.float8_tensor", "Float8CurrentScalingQuantizer"),
    ("transformer_engine.pytorch.tensor.mxfp8_tensor", "MXFP8Tensor"),
    ("transformer_engine.pytorch.tensor.mxfp8_tensor", "MXFP8Quantizer"),
    ("transformer_engine.pytorch.tensor.float8_blockwise_tensor", "Float8BlockwiseQTensor"),
    ("transformer_engine.pytorch.tensor.float8_blockwise_tensor", "Float8BlockQuantizer"),
    ("transformer_engine.pytorch.tensor.nvfp4_tensor", "NVFP4Tensor"),
    ("transformer_engine.pytorch.tensor.nvfp4_tensor", "NVFP4Quantizer"),
    ("transformer_engine.pytorch.tensor.grouped_tensor", "GroupedTensor"),
    # the storage classes an internal quantizer returns (TE's modules set internal=True in
    # forward): ``*TensorStorage`` from 2.9, ``*TensorBase`` before (issue 48)
    *((f"transformer_engine.pytorch.tensor.storage.{m}_storage", f"{c}Storage")
      for m, c in (("float8_tensor", "Float8Tensor"), ("mxfp8_tensor", "MXFP8Tensor"),
                   ("float8_blockwise_tensor", "Float8BlockwiseQTensor"), ("nvfp4_tensor", "NVFP4Tensor"),
                   ("grouped_tensor", "GroupedTensor"))),
    *((f"transformer_engine.pytorch.tensor._internal.{m}_base", f"{c}Base")
      for m, c in (("float8_tensor", "Float8Tensor"), ("mxfp8_tensor", "MXFP8Tensor"),
                   ("float8_blockwise_tensor", "Float8BlockwiseQTensor"), ("nvfp4_tensor", "NVFP4Tensor"))),
    ("transformer_engine.pytorch", "Linear"),
    ("transformer_engine.pytorch", "LayerNormLinear"),
    ("transformer_engine.pytorch", "GroupedLinear"),
    ("transformer_engine.common.recipe", "Recipe"),
    ("transformer_engine.common.recipe", "DelayedScaling"),
    ("transformer_engine.common.recipe", "Float8CurrentScaling"),
    ("transformer_engine.common.recipe", "Float8BlockScaling"),
    ("transformer_engine.common.recipe", "MXFP8BlockScaling"),
    ("transformer_engine.common.recipe", "NVFP4BlockScaling"),
    ("transformer_engine.common.recipe", "QParams"),
    ("transformer_engine.common.recipe", "Format"),
    ("transformer_engine.pytorch.fp8", "FP8GlobalStateManager"),
    ("transformer_engine.pytorch.quantization", "FP8GlobalStateManager"),
    ("transformer_engine.pytorch.distributed", "activation_recompute_forward"),
    ("transformer_engine.pytorch.optimizers", "FusedAdam"),
)
FUNCTIONS: tuple[tuple[str, str], ...] = (
    ("transformer_engine.pytorch", "autocast"),
    ("transformer_engine.pytorch", "fp8_autocast"),
    ("transformer_engine.pytorch", "quantized_model_init"),
    ("transformer_engine.pytorch", "fp8_model_init"),
    ("transformer_engine.pytorch", "checkpoint"),
    ("transformer_engine.pytorch.distributed", "checkpoint"),
    ("transformer_engine.pytorch.distributed", "get_activation_recompute_contexts"),
    ("transformer_engine.pytorch.distributed", "is_fp8_activation_recompute_enabled"),
    ("transformer_engine.pytorch.distributed", "in_fp8_activation_recompute_phase"),
    ("transformer_engine.pytorch.tensor.utils", "replace_raw_data"),
    ("transformer_engine.pytorch.tensor.utils", "cast_master_weights_to_fp8"),
    ("transformer_engine.pytorch.tensor.utils", "quantize_master_weights"),
    ("transformer_engine.pytorch.tensor.utils", "post_all_gather_processing"),
    ("transformer_engine.pytorch.tensor.utils", "_cast_master_weights_to_fp8_blockwise_scaling"),
)
# Modules whose existence (and public exports) are recorded.
MODULES: tuple[str, ...] = tuple(dict.fromkeys(
    ["transformer_engine", "transformer_engine.common"] + [m for m, _ in CLASSES]
    + [m for m, _ in FUNCTIONS]
))


# ---- reading one release ------------------------------------------------------------------------

class Tree:
    """The ``transformer_engine`` Python sources of one git ref, parsed on demand; a ref
    ``dir:PATH`` reads a folder instead (TE's Python wheel installed with ``pip install
    --target``: a release whose tag the clone lacks)."""

    def __init__(self, repo: Path, ref: str) -> None:
        self.repo, self.ref = repo, ref
        self.folder = Path(ref[4:]) if ref.startswith("dir:") else None
        if self.folder is not None:
            out = "\n".join(str(p.relative_to(self.folder)) for p in (self.folder / "transformer_engine").rglob("*.py"))
        else:
            out = _git(repo, "ls-tree", "-r", "--name-only", ref, "--", "transformer_engine")
        self.paths = {p for p in out.splitlines() if p.endswith(".py")}
        self._asts: dict[str, Optional[ast.Module]] = {}
        self._text: dict[str, str] = {}

    def path_of(self, module: str) -> Optional[str]:
        base = module.replace(".", "/")
        for p in (f"{base}.py", f"{base}/__init__.py"):
            if p in self.paths:
                return p
        return None

    def is_package(self, module: str) -> bool:
        return f"{module.replace('.', '/')}/__init__.py" in self.paths

    def text(self, module: str) -> str:
        p = self.path_of(module)
        if p is None:
            return ""
        if p not in self._text:
            self._text[p] = ((self.folder / p).read_text() if self.folder is not None
                             else _git(self.repo, "show", f"{self.ref}:{p}"))
        return self._text[p]

    def module(self, module: str) -> Optional[ast.Module]:
        p = self.path_of(module)
        if p is None:
            return None
        if p not in self._asts:
            try:
                self._asts[p] = ast.parse(self.text(module))
            except SyntaxError:
                self._asts[p] = None
        return self._asts[p]


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True,
                          text=True).stdout


def _top_level(body: list[ast.stmt]) -> Iterator[ast.stmt]:
    """Module-level statements, looking into if/try/with blocks (not into defs)."""
    for node in body:
        yield node
        if isinstance(node, (ast.If, ast.With)):
            yield from _top_level(node.body)
            yield from _top_level(getattr(node, "orelse", []))
        elif isinstance(node, ast.Try):
            for block in (node.body, node.orelse, node.finalbody, *[h.body for h in node.handlers]):
                yield from _top_level(block)


def _absolute(module: str, is_pkg: bool, level: int, target: Optional[str]) -> str:
    if level == 0:
        return target or ""
    parts = module.split(".")
    if not is_pkg:
        parts = parts[:-1]
    parts = parts[: len(parts) - (level - 1)] if level > 1 else parts
    return ".".join(parts + ([target] if target else []))


@dataclass
class Resolved:
    kind: str  # "class" | "function" | "module" | "value" | "external"
    module: str
    name: str
    node: Any = None


class Resolver:
    """Name resolution inside one release (imports followed, aliases too)."""

    def __init__(self, tree: Tree) -> None:
        self.tree = tree

    def resolve(self, module: str, name: str, depth: int = 0) -> Optional[Resolved]:
        if depth > 25:
            return None
        if not module.startswith("transformer_engine"):
            return Resolved("external", module, name)
        mod = self.tree.module(module)
        if mod is None:
            return None
        found: Optional[Resolved] = None
        star: list[str] = []
        for node in _top_level(mod.body):
            if isinstance(node, ast.ClassDef) and node.name == name:
                found = Resolved("class", module, name, node)
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
                found = Resolved("function", module, name, node)
            elif isinstance(node, ast.Assign) and any(
                    isinstance(t, ast.Name) and t.id == name for t in node.targets):
                if isinstance(node.value, ast.Name):
                    found = self.resolve(module, node.value.id, depth + 1) or found
                elif isinstance(node.value, ast.Attribute):
                    found = self._resolve_attr(module, node.value, depth) or Resolved(
                        "value", module, name, node)
                else:
                    found = Resolved("value", module, name, node)
            elif isinstance(node, ast.ImportFrom):
                src = _absolute(module, self.tree.is_package(module), node.level, node.module)
                for alias in node.names:
                    if alias.name == "*":
                        star.append(src)
                    elif (alias.asname or alias.name) == name:
                        sub = f"{src}.{alias.name}"
                        if self.tree.path_of(sub) is not None:
                            found = Resolved("module", sub, alias.name)
                        else:
                            found = self.resolve(src, alias.name, depth + 1) or found
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.asname == name:
                        found = Resolved("module", alias.name, name)
        if found is None and self.tree.is_package(module) and self.tree.path_of(f"{module}.{name}"):
            found = Resolved("module", f"{module}.{name}", name)
        if found is None:
            for src in star:
                if not name.startswith("_"):
                    found = self.resolve(src, name, depth + 1)
                    if found is not None:
                        break
        return found

    def _resolve_attr(self, module: str, node: ast.Attribute, depth: int) -> Optional[Resolved]:
        base = self.resolve_expr(module, node.value, depth + 1)
        if base is not None and base.kind == "module":
            return self.resolve(base.module, node.attr, depth + 1)
        return None

    def resolve_expr(self, module: str, node: ast.expr, depth: int = 0) -> Optional[Resolved]:
        if isinstance(node, ast.Name):
            return self.resolve(module, node.id, depth)
        if isinstance(node, ast.Attribute):
            inner = self.resolve_expr(module, node.value, depth + 1)
            if inner is None:
                return Resolved("external", ast.unparse(node.value), node.attr)
            if inner.kind == "module":
                return self.resolve(inner.module, node.attr, depth + 1)
            if inner.kind == "external":
                return Resolved("external", f"{inner.module}.{inner.name}".strip("."), node.attr)
        return None

    def exports(self, module: str) -> set[str]:
        mod = self.tree.module(module)
        if mod is None:
            return set()
        names: set[str] = set()
        for node in _top_level(mod.body):
            if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                names.add(node.name)
            elif isinstance(node, ast.Assign):
                names.update(t.id for t in node.targets if isinstance(t, ast.Name))
            elif isinstance(node, ast.ImportFrom):
                names.update(a.asname or a.name for a in node.names if a.name != "*")
            elif isinstance(node, ast.Import):
                names.update(a.asname for a in node.names if a.asname)
        return {n for n in names if not n.startswith("__")}


# ---- what one class offers ----------------------------------------------------------------------

_NEW_CALLS = ("__new__", "_make_wrapper_subclass", "_make_subclass")


def _decorator_names(fn: ast.AST) -> list[str]:
    return [ast.unparse(d) for d in getattr(fn, "decorator_list", [])]


def _is_property(fn: ast.AST) -> bool:
    return any(d in ("property", "functools.cached_property", "cached_property")
               or d.endswith((".setter", ".getter", ".deleter")) for d in _decorator_names(fn))


def _params(fn: ast.AST) -> dict[str, Any]:
    a = fn.args  # type: ignore[attr-defined]
    names = [p.arg for p in a.posonlyargs + a.args + a.kwonlyargs]
    return {"names": names, "varkw": a.kwarg is not None}


def _instance_targets(fn: ast.AST) -> Iterator[str]:
    """``self.x = ...`` (and ``instance.x`` in a ``__new__``) attribute names in ``fn``."""
    params = [p.arg for p in fn.args.posonlyargs + fn.args.args]  # type: ignore[attr-defined]
    owners = {params[0]} if params else set()
    for node in ast.walk(fn):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call):
            call = ast.unparse(node.value.func)
            if any(c in call for c in _NEW_CALLS):
                owners.update(t.id for t in node.targets if isinstance(t, ast.Name))
    owners.discard("cls")
    for node in ast.walk(fn):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = list(node.targets)
        elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
            targets = [node.target]
        elif isinstance(node, ast.Call) and ast.unparse(node.func) in ("setattr", "object.__setattr__"):
            if len(node.args) >= 2 and isinstance(node.args[0], ast.Name) and isinstance(
                    node.args[1], ast.Constant) and node.args[0].id in owners:
                yield str(node.args[1].value)
            continue
        for t in targets:
            for el in (t.elts if isinstance(t, ast.Tuple) else [t]):
                if isinstance(el, ast.Attribute) and isinstance(el.value, ast.Name) and el.value.id in owners:
                    yield el.attr


@dataclass
class ClassFacts:
    methods: set[str] = field(default_factory=set)
    properties: set[str] = field(default_factory=set)
    attributes: set[str] = field(default_factory=set)
    init_kwargs: list[str] = field(default_factory=list)
    init_varkw: bool = False
    bases: list[str] = field(default_factory=list)
    external_bases: set[str] = field(default_factory=set)
    defined_in: str = ""


def class_facts(res: Resolver, module: str, name: str) -> Optional[ClassFacts]:
    r = res.resolve(module, name)
    if r is None or r.kind != "class":
        return None
    facts = ClassFacts(defined_in=f"{r.module}.{r.name}")
    init_from: Optional[dict[str, Any]] = None
    dataclass_fields: list[str] = []
    is_dataclass = False
    seen: set[tuple[str, str]] = set()

    def visit(cr: Resolved, top: bool) -> None:
        nonlocal init_from, is_dataclass
        key = (cr.module, cr.name)
        if key in seen:
            return
        seen.add(key)
        node: ast.ClassDef = cr.node
        if any(d.split("(")[0].endswith("dataclass") for d in _decorator_names(node)):
            is_dataclass = True
        for stmt in node.body:
            if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)):
                if _is_property(stmt):
                    facts.properties.add(stmt.name)
                else:
                    facts.methods.add(stmt.name)
                    facts.attributes.update(_instance_targets(stmt))
                if stmt.name in ("__init__", "__new__") and init_from is None and not (
                        stmt.name == "__new__" and any(x.name == "__init__" for x in node.body
                                                       if isinstance(x, ast.FunctionDef))):
                    init_from = _params(stmt)
            elif isinstance(stmt, ast.Assign):
                for t in stmt.targets:
                    if isinstance(t, ast.Name):
                        is_prop = isinstance(stmt.value, ast.Call) and ast.unparse(stmt.value.func) == "property"
                        (facts.properties if is_prop else facts.attributes).add(t.id)
            elif isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                facts.attributes.add(stmt.target.id)
                if not ast.unparse(stmt.annotation).startswith(("ClassVar", "typing.ClassVar")):
                    dataclass_fields.append(stmt.target.id)
        for b in node.bases:
            text = ast.unparse(b)
            if top:
                facts.bases.append(text)
            br = res.resolve_expr(cr.module, b)
            if br is not None and br.kind == "class":
                visit(br, False)
            else:
                ext = text if br is None or br.kind != "external" else f"{br.module}.{br.name}".strip(".")
                facts.external_bases.add(_canonical_external(ext))

    visit(r, True)
    if is_dataclass and init_from is None:
        facts.init_kwargs, facts.init_varkw = list(dict.fromkeys(dataclass_fields)), False
    elif init_from is not None:
        facts.init_kwargs = [n for n in init_from["names"] if n not in ("self", "cls")]
        facts.init_varkw = bool(init_from["varkw"])
    facts.attributes -= facts.methods | facts.properties
    return facts


def _canonical_external(text: str) -> str:
    text = re.sub(r"^(nn|torch\.nn)\.", "torch.nn.", text)
    return {"Enum": "enum.Enum", "enum.Enum": "enum.Enum", "Tensor": "torch.Tensor",
            "object": "object", "ABC": "abc.ABC"}.get(text, text)


# ---- behaviours (predicates on the source) -------------------------------------------------------

def _method(res: Resolver, module: str, cls: str, meth: str) -> Optional[ast.FunctionDef]:
    r = res.resolve(module, cls)
    if r is None or r.kind != "class":
        return None
    for stmt in r.node.body:
        if isinstance(stmt, ast.FunctionDef) and stmt.name == meth:
            return stmt
    return None


def _prepare_forward_finally(res: Resolver) -> bool:
    """A module's forward puts the recompute state back (``restore_fp8_meta_tensors``, via
    ``end_forward`` from 2.12) in a ``finally``, so an exception raised inside the forward --
    torch's checkpoint early stop -- cannot skip it. Up to 2.11 ``prepare_forward`` is a
    generator context manager that restores after its ``yield`` with no ``finally``."""
    fn = _method(res, "transformer_engine.pytorch.module.linear", "Linear", "forward")
    if fn is None:
        return False
    return any(isinstance(n, ast.Try) and n.finalbody and any(
        "end_forward" in ast.unparse(s) or "restore_fp8_meta_tensors" in ast.unparse(s)
        for s in n.finalbody) for n in ast.walk(fn))


def _traceable_quantized_tensors(res: Resolver) -> bool:
    facts = class_facts(res, "transformer_engine.pytorch.tensor.float8_tensor", "Float8Tensor")
    return bool(facts and {"__tensor_flatten__", "__tensor_unflatten__"} <= facts.methods)


def _grouped_gemm_on_members(res: Resolver) -> bool:
    """A single grouped weight's GEMMs run on ``weight.quantized_tensors`` (the members),
    whose ``main_grad`` TE reads, rather than on the grouped parameter itself."""
    fn = _method(res, "transformer_engine.pytorch.module.grouped_linear", "GroupedLinear",
                 "_get_weight_tensors")
    return fn is not None and "quantized_tensors" in ast.unparse(fn) and not _grouped_param_gemm(res)


def _grouped_param_gemm(res: Resolver) -> bool:
    """The grouped-tensor GEMM path takes the grouped parameter (2.19's
    ``_prepare_weights_for_grouped_tensor_gemm``)."""
    fn = _method(res, "transformer_engine.pytorch.module.grouped_linear", "_GroupedLinear",
                 "_prepare_weights_for_grouped_tensor_gemm")
    return fn is not None and "single_grouped_weight" in _params(fn)["names"]


def _single_param_env(res: Resolver) -> bool:
    return "NVTE_GROUPED_LINEAR_SINGLE_PARAM" in res.tree.text(
        "transformer_engine.pytorch.module.grouped_linear") or any(
        "NVTE_GROUPED_LINEAR_SINGLE_PARAM" in res.tree.text(m) for m in (
            "transformer_engine.pytorch.module._common", "transformer_engine.pytorch.utils"))


def _grouped_path_cublaslt_check(res: Resolver) -> bool:
    return "get_cublasLt_version" in res.tree.text("transformer_engine.pytorch.module.grouped_linear")


def _make_grouped_weights_keeps_init(res: Resolver) -> bool:
    fn = _method(res, "transformer_engine.pytorch.module.grouped_linear", "GroupedLinear",
                 "make_grouped_weights")
    return fn is not None and "high_precision_init_val" in ast.unparse(fn)


def _extra_state_pickles_recipe(res: Resolver) -> bool:
    fn = _method(res, "transformer_engine.pytorch.module.base", "TransformerEngineBaseModule",
                 "get_extra_state")
    return fn is not None and '"recipe"' in ast.unparse(fn).replace("'", '"')


def _block_scaling_check(res: Resolver) -> str:
    """The source of TE's block-scaling support check (``_compute_...`` from 2.15, when the
    public check started caching it)."""
    for module in ("transformer_engine.pytorch.quantization", "transformer_engine.pytorch.fp8"):
        for name in ("_compute_fp8_block_scaling_support", "check_fp8_block_scaling_support"):
            r = res.resolve(module, name)
            if r is not None and r.kind == "function":
                return ast.unparse(r.node)
    return ""


def _blockwise_beyond_hopper(res: Resolver) -> bool:
    """TE's block-scaling check admits compute capabilities from 9.0 up (before: Hopper only)."""
    body = _block_scaling_check(res)
    return bool(body) and "(10, 0)" not in body


def _blockwise_needs_cuda_12_9(res: Resolver) -> bool:
    return "12.9" in _block_scaling_check(res)


def _grouped_linear_amax_epsilon(res: Resolver) -> bool:
    """GroupedLinear applies the recipe's QParams ``amax_epsilon`` to its quantizers."""
    return "amax_epsilon" in res.tree.text("transformer_engine.pytorch.module.grouped_linear")


FEATURES = {
    "prepare_forward_restores_in_finally": _prepare_forward_finally,
    "quantized_tensors_traceable": _traceable_quantized_tensors,
    "single_grouped_weight_gemm_on_members": _grouped_gemm_on_members,
    "single_grouped_weight_gemm_on_param": _grouped_param_gemm,
    "single_grouped_weight_env_gated": _single_param_env,
    "grouped_tensor_path_checks_cublaslt": _grouped_path_cublaslt_check,
    "make_grouped_weights_keeps_init_values": _make_grouped_weights_keeps_init,
    "extra_state_pickles_recipe": _extra_state_pickles_recipe,
    "blockwise_beyond_hopper": _blockwise_beyond_hopper,
    "blockwise_needs_cuda_12_9": _blockwise_needs_cuda_12_9,
    "grouped_linear_reads_amax_epsilon": _grouped_linear_amax_epsilon,
}


# ---- one release, then all of them --------------------------------------------------------------

# Attributes TE's modules attach to their parameters (not members of any class): the kept
# high-precision init value and its bound get/clear methods (``quantized_model_init(...,
# preserve_high_precision_init_val=True)``).
_PARAM_ATTR = re.compile(r"\b\w+\.(_high_precision_init_val|get_high_precision_init_val|"
                         r"clear_high_precision_init_val)\s*=")


def parameter_attributes(tree: Tree) -> set[str]:
    names: set[str] = set()
    for path in tree.paths:
        if path.startswith("transformer_engine/pytorch/module/"):
            module = path[:-3].replace("/", ".").removesuffix(".__init__")
            names.update(_PARAM_ATTR.findall(tree.text(module)))
    return names


def read_release(repo: Path, ref: str) -> dict[str, Any]:
    res = Resolver(Tree(repo, ref))
    out: dict[str, Any] = {"classes": {}, "functions": {}, "modules": {}, "features": {},
                           "parameter_attributes": parameter_attributes(res.tree)}
    for module, name in CLASSES:
        facts = class_facts(res, module, name)
        if facts is not None:
            out["classes"][f"{module}.{name}"] = facts
    for module, name in FUNCTIONS:
        r = res.resolve(module, name)
        if r is not None and r.kind == "function":
            out["functions"][f"{module}.{name}"] = _params(r.node)
        elif r is not None and r.kind == "class":  # a context-manager class (autocast, 2.16+)
            facts = class_facts(res, module, name)
            if facts is not None:
                out["functions"][f"{module}.{name}"] = {"names": facts.init_kwargs,
                                                        "varkw": facts.init_varkw}
    for module in MODULES:
        if res.tree.path_of(module) is not None:
            out["modules"][module] = res.exports(module)
    for fname, pred in FEATURES.items():
        out["features"][fname] = bool(pred(res))
    return out


def _version(ref: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", ref)[:2])


def release_refs(repo: Path, since: tuple[int, ...]) -> dict[str, str]:
    """``{"2.8": "v2.8", ..., "2.19": "release_v2.19"}``: the first tag of each minor release
    from ``since`` on (``v2.14`` rather than ``v2.14.1``), plus release branches newer than the
    newest tag."""
    tags = [t for t in _git(repo, "tag", "--list", "v2.*").split() if re.fullmatch(r"v\d+\.\d+", t)]
    refs = {f"{a}.{b}": f"v{a}.{b}" for a, b in sorted(_version(t) for t in tags) if (a, b) >= since}
    branches = _git(repo, "for-each-ref", "--format=%(refname:short)", "refs/heads", "refs/remotes")
    for br in branches.split():
        m = re.fullmatch(r"(?:origin/)?release_v(\d+)\.(\d+)", br)
        if m and (int(m[1]), int(m[2])) >= since and f"{m[1]}.{m[2]}" not in refs:
            refs[f"{m[1]}.{m[2]}"] = br
    return dict(sorted(refs.items(), key=lambda kv: _version(kv[0])))


def _ranges(present: list[bool], versions: list[str]) -> str:
    """``[T, T, F, T]`` over versions -> ``"2.8-2.9,2.11"``."""
    parts, start = [], None
    for i, ok in enumerate([*present, False]):
        if ok and start is None:
            start = i
        elif not ok and start is not None:
            first, last = versions[start], versions[i - 1]
            parts.append(first if first == last else f"{first}-{last}")
            start = None
    return ",".join(parts)


def _by_member(per_version: list[Optional[set[str]]], versions: list[str]) -> dict[str, str]:
    names = sorted(set().union(*[s for s in per_version if s is not None]))
    return {n: _ranges([s is not None and n in s for s in per_version], versions) for n in names}


def build_manifest(repo: Path, since: tuple[int, ...], progress: bool = True,
                   folders: Optional[dict[str, Path]] = None) -> dict[str, Any]:
    refs = release_refs(repo, since)
    for v, path in (folders or {}).items():
        refs[v] = f"dir:{path}"
    refs = dict(sorted(refs.items(), key=lambda kv: _version(kv[0])))
    versions = list(refs)
    releases = []
    for _v, ref in refs.items():
        if progress:
            print(f"reading {ref} ...", file=sys.stderr, flush=True)
        releases.append(read_release(repo, ref))
    head = _git(repo, "rev-parse", "HEAD").strip()
    manifest: dict[str, Any] = {
        "generated_by": "scripts/te_manifest.py",
        "source": "https://github.com/NVIDIA/TransformerEngine",
        "versions": versions,
        "refs": {v: ({"ref": ref, "commit": _git(repo, "rev-parse", f"{ref}^{{commit}}").strip()}
                     if not ref.startswith("dir:") else {"ref": f"transformer-engine=={_wheel_release(ref)} (PyPI wheel)"})
                 for v, ref in refs.items()},
        "checkout_head": head,
        "classes": {}, "functions": {}, "modules": {}, "features": {},
        "parameter_attributes": _by_member([r["parameter_attributes"] for r in releases], versions),
    }
    for key in dict.fromkeys(k for r in releases for k in r["classes"]):
        per = [r["classes"].get(key) for r in releases]
        entry: dict[str, Any] = {"present": _ranges([f is not None for f in per], versions)}
        for attr in ("methods", "properties", "attributes", "external_bases"):
            entry[attr] = _by_member([getattr(f, attr) if f else None for f in per], versions)
        entry["bases"] = _by_member([set(f.bases) if f else None for f in per], versions)
        entry["init_kwargs"] = _by_member([set(f.init_kwargs) if f else None for f in per], versions)
        entry["init_varkw"] = _ranges([bool(f and f.init_varkw) for f in per], versions)
        entry["defined_in"] = _by_member([{f.defined_in} if f else None for f in per], versions)
        manifest["classes"][key] = entry
    for key in dict.fromkeys(k for r in releases for k in r["functions"]):
        per = [r["functions"].get(key) for r in releases]
        manifest["functions"][key] = {
            "present": _ranges([p is not None for p in per], versions),
            "params": _by_member([set(p["names"]) if p else None for p in per], versions),
            "varkw": _ranges([bool(p and p["varkw"]) for p in per], versions),
        }
    for key in MODULES:
        per = [r["modules"].get(key) for r in releases]
        manifest["modules"][key] = {"present": _ranges([p is not None for p in per], versions),
                                    "exports": _by_member(per, versions)}
    for fname in FEATURES:
        manifest["features"][fname] = _ranges([r["features"][fname] for r in releases], versions)
    return manifest


def _wheel_release(ref: str) -> str:
    infos = sorted(Path(ref[4:]).glob("transformer_engine-*.dist-info"))
    return infos[-1].name[len("transformer_engine-"):-len(".dist-info")] if infos else "?"


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repo", type=Path, required=True, help="a git clone of NVIDIA/TransformerEngine")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--since", default="2.2", help="oldest release to read (default: 2.2)")
    ap.add_argument("--release", action="append", default=[], metavar="X.Y=DIR",
                    help="also read release X.Y from DIR, TE's Python wheel installed with pip "
                         "--target (a release the clone has no tag for: .te-python/2.20.2)")
    args = ap.parse_args(argv)
    folders = {v: Path(d) for v, _, d in (r.partition("=") for r in args.release)}
    if not (args.repo / "HEAD").exists() and not (args.repo / ".git").exists():
        print(f"error: {args.repo} is not a git checkout of TransformerEngine; fix: clone "
              "https://github.com/NVIDIA/TransformerEngine and pass its path", file=sys.stderr)
        return 2
    manifest = build_manifest(args.repo, _version(args.since), folders=folders)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(manifest, indent=1, sort_keys=False) + "\n")
    print(f"wrote {args.out}: {len(manifest['versions'])} releases "
          f"({manifest['versions'][0]}..{manifest['versions'][-1]}), {len(manifest['classes'])} "
          f"classes, {len(manifest['functions'])} functions", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
