"""The stand-in TE, lptrain's TE calls and its TE version gates, held to TE's own source.

``tests/data/te_api.json`` is written by ``scripts/te_manifest.py`` from TE's release tags (and
the 2.19 release branch); see its docstring. These tests use it three ways:

1. the stand-in TE of each release exposes no public member -- class member, instance
   attribute, constructor keyword, function parameter, module export -- that TE's class
   lacks at that release (a stand-in richer than TE hides crashes: the grouped tensor's
   ``quantize_`` was one);
2. every TE member lptrain calls (``lptrain.precision.te_api.TE_CALLS``) exists at every
   release lptrain allows for the path that calls it, and the table names every TE member
   the TE-facing modules touch;
3. every version gate (stand-in, adapter, catalog, rules) is the release the manifest says
   the feature first appears in.

No exceptions are listed: a mismatch is fixed in lptrain, or the manifest is regenerated.
"""

from __future__ import annotations

import inspect
import types
from typing import Any

import pytest
import torch
from torch import nn

from lptrain.testing import te_manifest as M
from lptrain.testing import te_standin

STANDIN_VERSIONS = [v for v in te_standin.VERSIONS if v in M.versions()]


def _public(names: Any) -> set[str]:
    return {n for n in names if not n.startswith("_")}


def _standin_classes(mods: dict[str, types.ModuleType]) -> dict[str, type]:
    """Manifest class path -> the stand-in class at that path (where the stand-in has one)."""
    out = {}
    for path in M.manifest()["classes"]:
        module, _, name = path.rpartition(".")
        mod = mods.get(module)
        if mod is not None and isinstance(getattr(mod, name, None), type):
            out[path] = getattr(mod, name)
    return out


def _own_public_members(cls: type) -> set[str]:
    """Public names of a stand-in class beyond what its non-TE bases give it."""
    inherited: set[str] = set()
    for base in cls.__mro__[1:]:
        if base.__module__.split(".")[0] in ("torch", "builtins", "enum", "abc", "contextlib",
                                             "dataclasses", "typing"):
            inherited |= set(dir(base))
    return _public(set(dir(cls)) - inherited)


def test_manifest_covers_the_stand_in_releases() -> None:
    assert M.versions()[0] == "2.2" and "2.19" in M.versions()
    assert set(te_standin.VERSIONS) <= set(M.versions()), "regenerate tests/data/te_api.json"


@pytest.mark.parametrize("version", STANDIN_VERSIONS)
def test_stand_in_classes_and_members_exist_in_te(version: str) -> None:
    mods = te_standin.make(version)
    problems = []
    for path, cls in _standin_classes(mods).items():
        if not M.class_present(path, version):
            problems.append(f"{path}: the stand-in has it, TE {version} does not")
            continue
        extra = _own_public_members(cls) - M.members(path, version)
        if extra:
            problems.append(f"{path}: {sorted(extra)} not on TE {version}'s class")
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("version", STANDIN_VERSIONS)
def test_stand_in_functions_and_exports_exist_in_te(version: str) -> None:
    mods = te_standin.make(version)
    problems = []
    for module, mod in mods.items():
        exports = M.module_exports(module, version)
        if exports is None:
            if module in M.manifest()["modules"]:
                problems.append(f"{module}: the stand-in has it, TE {version} does not")
            continue
        for name in _public(vars(mod)):
            value = getattr(mod, name)
            sub = isinstance(value, types.ModuleType) and value.__name__ == f"{module}.{name}"
            if name not in exports and not (sub and M.module_exports(value.__name__, version) is not None):
                problems.append(f"{module}.{name}: not exported by TE {version}")
    for path in M.manifest()["functions"]:
        module, _, name = path.rpartition(".")
        fn = getattr(mods.get(module), name, None)
        if fn is None:
            continue
        te = M.function_params(path, version)
        if te is None:
            problems.append(f"{path}: the stand-in has it, TE {version} does not")
            continue
        params, varkw = te
        ours = {p.name for p in inspect.signature(fn).parameters.values()
                if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
        if not varkw and ours - params:
            problems.append(f"{path}: parameters {sorted(ours - params)} not in TE {version}")
    assert not problems, "\n".join(problems)


def _constructed(version: str, mods: dict[str, types.ModuleType]) -> list[tuple[str, Any]]:
    """One stand-in object of each class lptrain meets, made the way TE makes them."""
    pt = mods["transformer_engine.pytorch"]
    rec = mods["transformer_engine.common.recipe"]
    out: list[tuple[str, Any]] = [("transformer_engine.pytorch.Linear", pt.Linear(32, 32, bias=False))]
    grouped_kw = {"single_grouped_weight": True} if M.version_tuple(version) >= (2, 14) else {}
    out.append(("transformer_engine.pytorch.GroupedLinear", pt.GroupedLinear(2, 32, 32, bias=False)))
    recipes = [("DelayedScaling", {}), ("MXFP8BlockScaling", {}), ("Float8CurrentScaling", {}),
               ("Float8BlockScaling", {}), ("NVFP4BlockScaling", {})]
    for name, kw in recipes:
        cls = getattr(rec, name, None)
        if cls is None:
            continue
        r = cls(**kw)
        out.append((f"transformer_engine.common.recipe.{name}", r))
        init = getattr(pt, "quantized_model_init", None) or pt.fp8_model_init
        with init(enabled=True, recipe=r, preserve_high_precision_init_val=True):
            lin = pt.Linear(64, 128, bias=False)
            grouped = pt.GroupedLinear(2, 64, 128, bias=False, **(
                grouped_kw if name in ("MXFP8BlockScaling", "NVFP4BlockScaling") else {}))
        w = lin.weight
        out.append((f"{type(w).__module__}.{type(w).__name__}", w))
        out.append((f"{type(w._get_quantizer()).__module__}.{type(w._get_quantizer()).__name__}",
                    w._get_quantizer()))
        gw = getattr(grouped, "weight", None)
        if gw is not None:
            out.append((f"{type(gw).__module__}.{type(gw).__name__}", gw))
    return out


@pytest.mark.parametrize("version", STANDIN_VERSIONS)
def test_stand_in_instances_carry_only_te_attributes(version: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from lptrain.testing.virtual_cuda import VirtualCuda

    monkeypatch.setenv("NVTE_GROUPED_LINEAR_SINGLE_PARAM", "1")
    module_attrs = set(vars(nn.Module()))
    problems = []
    with VirtualCuda(), te_standin.installed(version) as mods:
        for path, obj in _constructed(version, mods):
            if path not in M.manifest()["classes"]:
                problems.append(f"{path}: a stand-in class the manifest does not know")
                continue
            names = set(vars(obj)) - module_attrs if isinstance(obj, nn.Module) else set(vars(obj))
            allowed = M.members(path, version)
            if isinstance(obj, torch.Tensor):
                allowed |= M.parameter_attributes(version)
            extra = _public(names) - allowed
            if extra:
                problems.append(f"{path} instance: {sorted(extra)} not on TE {version}'s objects")
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("version", STANDIN_VERSIONS)
def test_stand_in_constructors_take_only_te_keywords(version: str) -> None:
    """The classes lptrain constructs (modules and recipes) take TE's keywords."""
    mods = te_standin.make(version)
    problems = []
    for path, cls in _standin_classes(mods).items():
        if not (issubclass(cls, nn.Module) or path.startswith("transformer_engine.common.recipe")):
            continue
        if issubclass(cls, type(torch.Tensor)) or not M.class_present(path, version):
            continue
        te_kw, te_varkw = M.init_kwargs(path, version)
        sig = inspect.signature(cls.__init__)
        ours = {p.name for p in list(sig.parameters.values())[1:]
                if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
        ours |= set(getattr(cls, "_TE_FIELDS", ()))
        if not te_varkw and ours - te_kw:
            problems.append(f"{path}(...): keywords {sorted(ours - te_kw)} not taken by TE {version}")
    assert not problems, "\n".join(problems)


# ---- 2. lptrain's TE calls -------------------------------------------------------------------


def _te_has(call: Any, version: str) -> bool:
    from lptrain.precision.te_api import PARAM

    owner = call.owner
    if owner == PARAM:
        return call.member in M.parameter_attributes(version)
    if call.kind == "class":
        exports = M.module_exports(owner, version)
        return (exports is not None and call.member in exports) or M.class_present(
            f"{owner}.{call.member}", version)
    if call.kind == "function":
        return M.function_params(f"{owner}.{call.member}", version) is not None
    if call.kind == "kwarg":
        if owner in M.manifest()["classes"]:
            if not M.class_present(owner, version):
                return False
            kws, varkw = M.init_kwargs(owner, version)
        else:
            found = M.function_params(owner, version)
            if found is None:
                return False
            kws, varkw = found
        return varkw or call.member in kws
    return M.class_present(owner, version) and call.member in M.members(owner, version)


def _missing_calls(calls: Any) -> list[str]:
    vt = M.version_tuple
    problems = []
    for call in calls:
        on = [v for v in M.versions()
              if vt(v) >= vt(call.since) and (call.until is None or vt(v) <= vt(call.until))]
        assert on, call
        missing = [v for v in on if not _te_has(call, v)]
        if missing:
            problems.append(f"{call.owner}.{call.member} ({call.kind}) missing on TE {missing}")
    return problems


def test_every_te_member_lptrain_calls_exists_where_lptrain_calls_it() -> None:
    from lptrain.precision.te_api import TE_CALLS

    problems = _missing_calls(TE_CALLS)
    assert not problems, "\n".join(problems)


def test_a_call_gated_below_tes_first_release_is_caught() -> None:
    """The existence check can fail: the grouped tensor's storage API gated at 2.13, the
    byte-gather rebuild at 2.8, a ``quantize_`` on the grouped tensor (finding 1: TE has none)."""
    from lptrain.precision.te_api import GT, UTILS, TECall

    assert _missing_calls([TECall(GT, "quantize", "2.13")])
    assert _missing_calls([TECall(UTILS, "post_all_gather_processing", "2.8", kind="function")])
    assert _missing_calls([TECall(GT, "quantize_", "2.19")])
    assert _missing_calls([TECall(GT, "dequantize", "2.19")]) == []  # torch.Tensor's, through dispatch


def _names_touched(path: str) -> set[str]:
    """Attribute names a module reads or writes: ``x.name``, ``getattr(x, "name")``, and the
    names in tuples of strings (``for a in ("_data", ...): getattr(p, a)``)."""
    import ast
    from pathlib import Path

    tree = ast.parse(Path(path).read_text())
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            out.add(node.attr)
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in ("getattr", "hasattr", "setattr") and len(node.args) >= 2
              and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)):
            out.add(node.args[1].value)
        elif isinstance(node, (ast.Tuple, ast.List)):
            out.update(e.value for e in node.elts if isinstance(e, ast.Constant)
                       and isinstance(e.value, str) and e.value.isidentifier())
    return out


def _undeclared(calls: Any) -> list[str]:
    """TE-specific names (on a TE class lptrain reaches, not on torch.Tensor / nn.Module) the
    TE-facing modules touch without a declaration in ``calls``."""
    import lptrain.precision.te_adapter as adapter
    import lptrain.precision.te_numerics as numerics
    import lptrain.precision.te_storage as storage

    generic = set(dir(torch.Tensor)) | set(dir(nn.Module)) | set(dir(object))
    te_names: set[str] = set()
    for entry in M.manifest()["classes"].values():
        for kind in ("methods", "properties", "attributes"):
            te_names |= set(entry[kind])
    te_names |= {p.rpartition(".")[2] for p in M.manifest()["functions"]}
    te_names |= set(M.manifest()["parameter_attributes"])
    te_names -= generic
    touched = (_names_touched(adapter.__file__) | _names_touched(storage.__file__)
               | _names_touched(numerics.__file__))
    return sorted((touched & te_names) - {c.member for c in calls})


def test_the_te_facing_modules_call_only_declared_te_members() -> None:
    from lptrain.precision.te_api import TE_CALLS

    undeclared = _undeclared(TE_CALLS)
    assert not undeclared, f"TE members used but not declared in lptrain.precision.te_api: {undeclared}"


def test_an_undeclared_te_member_is_caught() -> None:
    from lptrain.precision.te_api import TE_CALLS

    assert _undeclared([c for c in TE_CALLS if c.member != "_get_quantizer"]) == ["_get_quantizer"]


# ---- 3. version gates ------------------------------------------------------------------------


def _gates() -> list[tuple[str, str, Any]]:
    """``(what, lptrain's gate, the manifest's first release)`` for every version gate."""
    from lptrain.catalog import recipes as C
    from lptrain.precision import te_api, te_storage
    from lptrain.testing.te_standin import _FIRST, TRACEABLE_FROM
    from lptrain.testing.te_standin import utils as standin_utils

    def vt_text(t: tuple[int, ...]) -> str:
        return ".".join(map(str, t))

    first_export = lambda module, name: M.first(M.manifest()["modules"][module]["exports"].get(name, ""))  # noqa: E731
    gl = "transformer_engine.pytorch.GroupedLinear"
    out = [
        (f"recipe {s.name} (catalog min_te)", s.min_te,
         M.first(M.manifest()["classes"][f"transformer_engine.common.recipe.{s.te_recipe_class}"]["present"]))
        for s in C.RECIPES
    ]
    out += [
        ("catalog SINGLE_GROUPED_WEIGHT_MIN_TE: GEMMs on the grouped parameter", C.SINGLE_GROUPED_WEIGHT_MIN_TE,
         M.feature_first("single_grouped_weight_gemm_on_param")),
        ("catalog SINGLE_GROUPED_WEIGHT_MIN_TE: use_grouped_tensor", C.SINGLE_GROUPED_WEIGHT_MIN_TE,
         M.member_first(gl, "use_grouped_tensor")),
        ("catalog GROUPED_AMAX_EPSILON_MIN_TE", C.GROUPED_AMAX_EPSILON_MIN_TE,
         M.feature_first("grouped_linear_reads_amax_epsilon")),
        ("catalog blockwise min_te_from_sm (Blackwell)", dict(C.recipe("blockwise").min_te_from_sm)[100],
         M.feature_first("blockwise_beyond_hopper")),
        ("te_storage.BLOCKWISE_BYTES_MIN_TE", vt_text(te_storage.BLOCKWISE_BYTES_MIN_TE),
         M.function_first("transformer_engine.pytorch.tensor.utils._cast_master_weights_to_fp8_blockwise_scaling")),
        ("te_storage.POST_ALL_GATHER_MIN_TE", vt_text(te_storage.POST_ALL_GATHER_MIN_TE),
         M.function_first("transformer_engine.pytorch.tensor.utils.post_all_gather_processing")),
        ("te_api.BLOCKWISE_BYTES", te_api.BLOCKWISE_BYTES, vt_text(te_storage.BLOCKWISE_BYTES_MIN_TE)),
        ("te_api.POST_ALL_GATHER", te_api.POST_ALL_GATHER, vt_text(te_storage.POST_ALL_GATHER_MIN_TE)),
        ("te_api.NEW_API (autocast)", te_api.NEW_API, M.function_first("transformer_engine.pytorch.autocast")),
        ("te_api.NEW_API (quantized_model_init)", te_api.NEW_API,
         M.function_first("transformer_engine.pytorch.quantized_model_init")),
        ("te_api.QUANTIZE_MASTER", te_api.QUANTIZE_MASTER,
         M.function_first("transformer_engine.pytorch.tensor.utils.quantize_master_weights")),
        ("stand-in GroupedTensor module", vt_text(_FIRST["grouped_tensor"]),
         M.first(M.manifest()["classes"]["transformer_engine.pytorch.tensor.grouped_tensor.GroupedTensor"]["present"])),
        ("stand-in nvfp4 module", vt_text(_FIRST["nvfp4_tensor"]),
         M.first(M.manifest()["classes"]["transformer_engine.pytorch.tensor.nvfp4_tensor.NVFP4Tensor"]["present"])),
        ("stand-in blockwise module", vt_text(_FIRST["float8_blockwise_tensor"]),
         M.first(M.manifest()["classes"]["transformer_engine.pytorch.tensor.float8_blockwise_tensor.Float8BlockwiseQTensor"]["present"])),
        ("stand-in TRACEABLE_FROM", vt_text(TRACEABLE_FROM), M.feature_first("quantized_tensors_traceable")),
        ("stand-in utils BLOCKWISE_BYTES_FROM", vt_text(standin_utils.BLOCKWISE_BYTES_FROM),
         M.function_first("transformer_engine.pytorch.tensor.utils._cast_master_weights_to_fp8_blockwise_scaling")),
        ("stand-in tensor package re-exports", "2.9",
         first_export("transformer_engine.pytorch.tensor", "Float8Tensor")),
    ]
    return out


def test_every_version_gate_is_tes_first_release_of_the_feature() -> None:
    wrong = [f"{what}: lptrain says {gate}, TE's source says {first}" for what, gate, first in _gates()
             if M.version_tuple(str(gate)) != M.version_tuple(str(first)) and not (
                 # a feature older than lptrain's oldest TE: the gate is that oldest TE
                 first == M.versions()[0] and M.version_tuple(str(gate)) <= M.version_tuple(first))]
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize("version", STANDIN_VERSIONS)
def test_stand_in_behaviours_follow_tes_release(version: str) -> None:
    """Each behaviour the stand-in switches per release switches where TE's source does."""
    mods = te_standin.make(version)
    pt = mods["transformer_engine.pytorch"]
    v = M.version_tuple(version)
    gl = pt.GroupedLinear
    assert gl._env_gated == M.feature("single_grouped_weight_env_gated", version)
    assert gl._gemm_on_param == M.feature("single_grouped_weight_gemm_on_param", version)
    assert (v >= (2, 12)) == M.feature("prepare_forward_restores_in_finally", version)
    assert hasattr(gl, "make_grouped_weights") == ("make_grouped_weights" in M.members(
        "transformer_engine.pytorch.GroupedLinear", version))
    assert (v >= te_standin.TRACEABLE_FROM) == M.feature("quantized_tensors_traceable", version)
    keeps = M.feature("make_grouped_weights_keeps_init_values", version)
    assert keeps == (v >= (2, 19))
    utils = mods["transformer_engine.pytorch.tensor.utils"]
    assert hasattr(utils, "post_all_gather_processing") == (
        M.function_params("transformer_engine.pytorch.tensor.utils.post_all_gather_processing", version) is not None)
    assert hasattr(utils, "quantize_master_weights") == (
        M.function_params("transformer_engine.pytorch.tensor.utils.quantize_master_weights", version) is not None)


@pytest.mark.parametrize("recipe", ["DelayedScaling", "MXFP8BlockScaling"])
def test_te_extra_state_as_lptrain_checkpoints_it(recipe: str) -> None:
    """TE's own ``get_extra_state`` (newest release, on a CPU): empty until the module has run
    FP8, then the pickled recipe for every recipe (the manifest: every release), plus the
    delayed-scaling tensors for a delayed one; ``set_extra_state`` round-trips it."""
    import pickle

    from lptrain.testing import te_python
    from lptrain.testing.fake_gpu import virtual_gpu

    assert M.feature("extra_state_pickles_recipe", M.versions()[-1])
    with virtual_gpu("sm100", te=True) as _:  # TE's own Python: the newest release installed
        import transformer_engine.common.recipe as ter
        import transformer_engine.pytorch as te

        r = getattr(ter, recipe)()
        lin = te.Linear(64, 64, bias=False, params_dtype=torch.bfloat16)
        assert lin.get_extra_state().numel() == 0
        autocast = getattr(te, "autocast", None)
        ctx = autocast(enabled=True, recipe=r) if autocast else te.fp8_autocast(enabled=True, fp8_recipe=r)
        with ctx:
            lin(torch.randn(32, 64, device="cuda", dtype=torch.bfloat16))
        raw = lin.get_extra_state()
        if recipe != "DelayedScaling" and tuple(int(x) for x in str(te_python.version()).split(".")[:2]) >= (2, 20):
            assert raw.numel() == 0  # from 2.20 a stateless recipe saves nothing (_extra_state.py)
            return
        state = pickle.loads(raw.numpy().tobytes())
        assert type(state["recipe"]).__name__ == recipe and "extra_fp8_variables" in state
        assert ("scale_fwd" in state) == (recipe == "DelayedScaling")
        if recipe != "DelayedScaling":  # (a delayed module takes its tensors at its first forward)
            fresh = te.Linear(64, 64, bias=False, params_dtype=torch.bfloat16)
            fresh.set_extra_state(lin.get_extra_state())
            assert torch.equal(fresh.get_extra_state(), lin.get_extra_state())


def test_the_manifest_holds_tes_storage_classes_and_the_probe_reads_each() -> None:
    """Issue 48 finding 7: the manifest lacked the storage classes an internal quantizer
    returns (``*TensorStorage`` from 2.9, ``*TensorBase`` before) and TE 2.20, which is how the
    probe's crash on them (finding 1) slipped through. Every quantized storage class TE has
    at any release is a class the statistics probe reads; the readers before the fix (no
    ``*TensorBase``) did not cover TE <= 2.8's."""
    from lptrain.precision import te_numerics

    assert M.versions()[-1] == "2.20", "regenerate tests/data/te_api.json (scripts/te_manifest.py --release)"
    storage = {path.rpartition(".")[2]: M.class_entry(path)["present"] for path in M.manifest()["classes"]
               if path.endswith(("Storage", "Base")) and "Grouped" not in path}
    assert {"Float8TensorStorage", "Float8TensorBase", "NVFP4TensorStorage", "MXFP8TensorBase"} <= set(storage)
    assert M.holds(storage["Float8TensorStorage"], "2.20") and M.holds(storage["Float8TensorBase"], "2.8")
    assert set(storage) <= set(te_numerics.READERS)
    before = {k for k in te_numerics.READERS if not k.endswith("Base")}
    assert not set(storage) <= before
