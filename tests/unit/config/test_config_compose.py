"""Recipe composition: defaults order, overrides, interpolation and readable input errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from lptrain.config import ConfigError, LPTrainConfig, compose, load, resolve_recipe
from lptrain.config.compose import repo_root


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    """A private recipes/ + configs/ tree (fragments are found next to the recipe dir)."""
    write(tmp_path / "configs/model/small.yaml", "num_layers: 3\nhidden_size: 96\n")
    write(tmp_path / "configs/model/wide.yaml", "hidden_size: 128\n")
    write(tmp_path / "configs/model/moe/four.yaml", "num_experts: 4\nrouter_topk: 1\n")
    write(
        tmp_path / "recipes/base.yaml",
        "meta:\n  target: sm90\ndefaults:\n  - model: small\n  - model: wide\n"
        "  - model/moe: four\nmodel:\n  num_layers: 5\n",
    )
    return tmp_path


def test_returns_typed_config_with_schema_defaults() -> None:
    cfg = compose(None)
    assert isinstance(cfg, LPTrainConfig)
    assert cfg == LPTrainConfig(run=cfg.run)  # only run.output_dir interpolation differs
    assert cfg.run.output_dir == "runs/lptrain"


def test_layers_apply_in_order_and_overrides_win(tree: Path) -> None:
    c = load(tree / "recipes/base.yaml", ["model.num_layers=7", "model.num_layers=9"])
    # small sets 3 layers / hidden 96, wide then sets hidden 128, the recipe sets 5 layers,
    # the overrides 7 then 9 (last wins).
    assert c.cfg.model.hidden_size == 128
    assert c.cfg.model.num_layers == 9
    assert c.cfg.model.moe.num_experts == 4 and c.cfg.model.moe.router_topk == 1
    assert c.meta.target == "sm90"


def test_recipe_include_and_meta_override(tree: Path) -> None:
    write(tree / "recipes/child.yaml",
          "meta:\n  target: cpu\ndefaults:\n  - recipe: base\n  - model: small\n")
    c = load(tree / "recipes/child.yaml")
    assert c.meta.target == "cpu"  # own meta wins over the included recipe's
    assert c.cfg.model.num_layers == 3  # fragment after the include wins over it
    assert c.cfg.model.hidden_size == 96
    assert c.cfg.model.moe.num_experts == 4  # inherited


def test_include_cycle_is_reported(tree: Path) -> None:
    write(tree / "recipes/a.yaml", "defaults:\n  - recipe: b\n")
    write(tree / "recipes/b.yaml", "defaults:\n  - recipe: a\n")
    with pytest.raises(ConfigError, match=r"includes itself"):
        load(tree / "recipes/a.yaml")


def test_interpolation() -> None:
    cfg = compose(None, ["model.ffn_hidden_size=${model.hidden_size}", "run.name=abc",
                         "checkpoint.save=${run.output_dir}/ckpt"])
    assert cfg.model.ffn_hidden_size == 64
    assert cfg.checkpoint.save == "runs/abc/ckpt"


def test_missing_interpolation_target_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match=r"model.nope|nope"):
        compose(None, ["run.name=${model.nope}"])


def test_override_values_are_typed() -> None:
    cfg = compose(None, ["ddp.bucket_size=null", "optimizer.lr=1e-3", "run.name=123",
                         "precision.fp8_format=e4m3", "ddp.overlap_grad_reduce=true"])
    assert cfg.ddp.bucket_size is None
    assert cfg.optimizer.lr == pytest.approx(1e-3)
    assert cfg.run.name == "123"  # string field keeps the raw text
    assert cfg.ddp.overlap_grad_reduce is True


def test_unknown_key_in_file_names_file_line_and_suggestion(tmp_path: Path) -> None:
    p = write(tmp_path / "r.yaml", "model:\n  hidden_size: 64\n  num_layrs: 3\n")
    with pytest.raises(ConfigError) as e:
        load(p)
    msg = str(e.value)
    assert f"{p}:3" in msg and "model.num_layrs" in msg and "did you mean 'model.num_layers'" in msg


def test_unknown_section_suggestion() -> None:
    with pytest.raises(ConfigError, match=r"did you mean 'precision.fp8_format'"):
        compose(None, ["precison.fp8_format=e4m3"])


def test_unknown_key_right_name_wrong_section() -> None:
    with pytest.raises(ConfigError, match=r"did you mean 'ddp.overlap_param_gather'"):
        compose(None, ["precision.overlap_param_gather=true"])


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("model:\n  hidden_size: abc\n", "model.hidden_size expects int, got 'abc'"),
        ("model:\n  hidden_size: 1.5\n", "model.hidden_size expects int"),
        ("ddp:\n  overlap_grad_reduce: yes_please\n", "ddp.overlap_grad_reduce expects bool"),
        ("ddp:\n  overlap_grad_reduce: 1\n", "ddp.overlap_grad_reduce expects bool"),
        ("precision:\n  fp8_format: 3\n", "precision.fp8_format expects str or null"),
        ("data:\n  paths: x\n", "data.paths expects list of str"),
        ("model:\n  moe: 3\n", "model.moe must be a mapping"),
    ],
)
def test_wrong_type_names_key_file_line_and_type(tmp_path: Path, text: str, expected: str) -> None:
    p = write(tmp_path / "r.yaml", text)
    with pytest.raises(ConfigError) as e:
        load(p)
    assert expected in str(e.value)
    assert f"{p}:2" in str(e.value)


def test_yaml_syntax_error_names_file_and_line(tmp_path: Path) -> None:
    p = write(tmp_path / "r.yaml", "model:\n  hidden_size: 64\n   num_layers: 2\n")
    with pytest.raises(ConfigError) as e:
        load(p)
    assert str(e.value).startswith(f"{p}:3: YAML syntax error")


def test_missing_recipe_lists_available() -> None:
    with pytest.raises(ConfigError) as e:
        load("no_such_recipe.yaml")
    assert "no_such_recipe.yaml" in str(e.value) and "tiny_cpu.yaml" in str(e.value)


def test_missing_fragment(tmp_path: Path) -> None:
    p = write(tmp_path / "recipes/r.yaml", "defaults:\n  - model: nope\n")
    with pytest.raises(ConfigError, match=r"fragment 'model: nope' not found"):
        load(p)


def test_bad_override_syntax() -> None:
    with pytest.raises(ConfigError, match=r"expected key=value"):
        compose(None, ["model.num_layers"])


def test_bad_meta(tmp_path: Path) -> None:
    p = write(tmp_path / "r.yaml", "meta:\n  target: sm80\n")
    with pytest.raises(ConfigError, match=r"meta.target must be one of"):
        load(p)
    p = write(tmp_path / "r2.yaml", "meta:\n  targt: sm90\n")
    with pytest.raises(ConfigError, match=r"did you mean 'meta.target'"):
        load(p)


def test_bare_name_resolution_order(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    repo_tiny = resolve_recipe("tiny_cpu")
    assert repo_tiny == repo_root() / "recipes" / "tiny_cpu.yaml"
    local = write(tmp_path / "recipes/tiny_cpu.yaml", "model:\n  num_layers: 1\n")
    monkeypatch.chdir(tmp_path)
    assert resolve_recipe("tiny_cpu.yaml").resolve() == local.resolve()  # ./recipes first
    assert compose("tiny_cpu.yaml").model.num_layers == 1
    assert resolve_recipe("mxfp8_muon.yaml") == repo_root() / "recipes" / "mxfp8_muon.yaml"
    other = write(tmp_path / "elsewhere/x.yaml", "model:\n  num_layers: 4\n")
    assert compose("elsewhere/x.yaml").model.num_layers == 4  # with a '/' it is a path
    with pytest.raises(ConfigError, match=r"not found"):
        resolve_recipe("elsewhere/missing.yaml")
    assert other.exists()
