"""``scripts/te_manifest.py`` on a tiny git repository laid out like Transformer Engine: it reads
each release tag (and a release branch without a tag) from git, follows imports and bases,
flattens members over TE bases, and stores each fact with the releases it holds for."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]
_spec = importlib.util.spec_from_file_location("te_manifest_script", ROOT / "scripts" / "te_manifest.py")
S = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = S  # (its dataclasses look their module up)
_spec.loader.exec_module(S)

_STORAGE = '''
class Float8TensorStorage:
    def __new__(cls, *args, data, fp8_scale_inv, **kw):
        instance = super().__new__(cls, *args, **kw)
        instance._data = data
        instance._scale_inv = fp8_scale_inv
        return instance
    def update_usage(self, rowwise_usage=None, columnwise_usage=None):
        pass
'''
_TENSOR_V1 = '''
import torch
from .storage.float8_tensor_storage import Float8TensorStorage
class Float8Tensor(Float8TensorStorage, torch.Tensor):
    def dequantize(self, *, dtype=None):
        self._transpose_invalid = True
    @property
    def data(self):
        return self
'''
_TENSOR_V2 = _TENSOR_V1 + '''
    def __tensor_flatten__(self):
        return [], {}
    @classmethod
    def __tensor_unflatten__(cls, inner, ctx, size, stride):
        return cls
'''
_UTILS_V2 = '''
def post_all_gather_processing(model_weights):
    pass
'''


def _git(repo: Path, *args: str) -> None:
    subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True)


def _commit(repo: Path, files: dict[str, str], message: str) -> None:
    for rel, text in files.items():
        path = repo / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    _git(repo, "add", "-A")
    _git(repo, "-c", "user.email=t@t", "-c", "user.name=t", "commit", "-qm", message)


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    repo = tmp_path_factory.mktemp("te")
    _git(repo, "init", "-q", "-b", "main")
    pkg = "transformer_engine/pytorch"
    _commit(repo, {
        "transformer_engine/__init__.py": "",
        f"{pkg}/__init__.py": "",
        f"{pkg}/tensor/__init__.py": "",
        f"{pkg}/tensor/storage/__init__.py": "",
        f"{pkg}/tensor/storage/float8_tensor_storage.py": _STORAGE,
        f"{pkg}/tensor/float8_tensor.py": _TENSOR_V1,
        f"{pkg}/tensor/utils.py": "def replace_raw_data(tensor, new_raw_data):\n    pass\n",
    }, "2.2")
    _git(repo, "tag", "v2.2")
    _commit(repo, {f"{pkg}/tensor/utils.py": "def replace_raw_data(tensor, new_raw_data):\n    pass\n" + _UTILS_V2},
            "2.3")
    _git(repo, "tag", "v2.3")
    _git(repo, "checkout", "-q", "-b", "release_v2.4")
    _commit(repo, {f"{pkg}/tensor/float8_tensor.py": _TENSOR_V2}, "2.4")
    _git(repo, "checkout", "-q", "main")
    return repo


def test_releases_are_the_tags_and_an_untagged_release_branch(repo: Path) -> None:
    assert S.release_refs(repo, (2, 2)) == {"2.2": "v2.2", "2.3": "v2.3", "2.4": "release_v2.4"}
    assert list(S.release_refs(repo, (2, 3))) == ["2.3", "2.4"]


def test_members_are_flattened_over_te_bases_with_their_releases(repo: Path) -> None:
    m = S.build_manifest(repo, (2, 2), progress=False)
    f8 = m["classes"]["transformer_engine.pytorch.tensor.float8_tensor.Float8Tensor"]
    assert f8["present"] == "2.2-2.4"
    assert f8["methods"]["dequantize"] == "2.2-2.4" and f8["methods"]["update_usage"] == "2.2-2.4"
    assert f8["methods"]["__tensor_flatten__"] == "2.4"
    assert f8["properties"]["data"] == "2.2-2.4"
    # instance attributes set in the storage's __new__ (instance.x) and in methods (self.x)
    assert {"_data", "_scale_inv", "_transpose_invalid"} <= set(f8["attributes"])
    assert f8["external_bases"] == {"torch.Tensor": "2.2-2.4"}
    assert {"data", "fp8_scale_inv"} <= set(f8["init_kwargs"])
    utils = m["functions"]
    assert utils["transformer_engine.pytorch.tensor.utils.post_all_gather_processing"]["present"] == "2.3-2.4"
    assert utils["transformer_engine.pytorch.tensor.utils.replace_raw_data"]["params"] == {
        "tensor": "2.2-2.4", "new_raw_data": "2.2-2.4"}
    assert m["features"]["quantized_tensors_traceable"] == "2.4"


def test_ranges_compress_and_keep_holes() -> None:
    versions = ["2.2", "2.3", "2.4", "2.5"]
    assert S._ranges([True, True, False, True], versions) == "2.2-2.3,2.5"
    assert S._ranges([False] * 4, versions) == ""


def test_a_path_that_is_not_a_git_checkout_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert S.main(["--repo", str(tmp_path), "--out", str(tmp_path / "x.json")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is not a git checkout" in err[0]
