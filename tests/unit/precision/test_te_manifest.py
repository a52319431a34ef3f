"""lptrain's TE calls and its TE version gates, held to TE's own source.

``tests/data/te_api.json`` is written by ``scripts/te_manifest.py`` from TE's release tags (and
the 2.19 release branch); see its docstring. These tests use it to hold that:

1. it covers every release whose Python the TE-backend tests run (``make install``'s matrix;
   those tests run TE's own code, so what TE's classes have is TE's, not a copy's);
2. every TE member lptrain calls (``lptrain.precision.te_api.TE_CALLS``) exists at every
   release lptrain allows for the path that calls it, and the table names every TE member
   the TE-facing modules touch;
3. every version gate (adapter, catalog, rules) is the release the manifest says the
   feature first appears in -- which is how the releases without an installed wheel (2.2 to
   2.7, and those between the matrix's) are held to TE.

No exceptions are listed: a mismatch is fixed in lptrain, or the manifest is regenerated.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from lptrain.testing import te_manifest as M
from lptrain.testing import te_python


def test_manifest_covers_the_installed_releases() -> None:
    """Every release ``make install`` puts under .te-python/ (TE's own Python the TE-backend
    tests run) is in the manifest, from lptrain's oldest TE on."""
    assert M.versions()[0] == "2.2"
    assert {".".join(r.split(".")[:2]) for r in te_python.MATRIX} <= set(M.versions()), "regenerate tests/data/te_api.json"


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

    def vt_text(t: tuple[int, ...]) -> str:
        return ".".join(map(str, t))

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
        ("te_adapter: Float8CurrentScaling's power-of-2 choice off the QParams (te_power_2_attr)", "2.8",
         M.member_first("transformer_engine.common.recipe.Float8CurrentScaling",
                        str(C.recipe("tensorwise").te_power_2_attr))),
        ("te_api.NEW_API (autocast)", te_api.NEW_API, M.function_first("transformer_engine.pytorch.autocast")),
        ("te_api.NEW_API (quantized_model_init)", te_api.NEW_API,
         M.function_first("transformer_engine.pytorch.quantized_model_init")),
        ("te_api.QUANTIZE_MASTER", te_api.QUANTIZE_MASTER,
         M.function_first("transformer_engine.pytorch.tensor.utils.quantize_master_weights")),
    ]
    return out


def test_every_version_gate_is_tes_first_release_of_the_feature() -> None:
    wrong = [f"{what}: lptrain says {gate}, TE's source says {first}" for what, gate, first in _gates()
             if M.version_tuple(str(gate)) != M.version_tuple(str(first)) and not (
                 # a feature older than lptrain's oldest TE: the gate is that oldest TE
                 first == M.versions()[0] and M.version_tuple(str(gate)) <= M.version_tuple(first))]
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize("recipe", ["DelayedScaling", "MXFP8BlockScaling"])
def test_te_extra_state_as_lptrain_checkpoints_it(recipe: str) -> None:
    """TE's own ``get_extra_state`` (newest release, on a CPU): empty until the module has run
    FP8, then the pickled recipe for every recipe (the manifest: every release), plus the
    delayed-scaling tensors for a delayed one; ``set_extra_state`` round-trips it, and
    lptrain's restricted checkpoint reader lets it through (it names only TE's recipe
    classes and tensors: ``lptrain.checkpoint.restricted.check_te_extra_state``)."""
    import pickle

    from lptrain.checkpoint import restricted
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
        restricted.check_te_extra_state(raw, "m")
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
