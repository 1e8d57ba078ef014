"""The config system: `_base_` merge order, typed --opts, errors that name the field."""

from __future__ import annotations

import textwrap

import pytest
import yaml

from deepspec.config import load_config, save_config
from deepspec.errors import ConfigError


def write(path, text):
    path.write_text(textwrap.dedent(text))
    return path


def test_base_merge_order(tmp_path):
    write(tmp_path / "a.yaml", """
        project: from_a
        train: {lr: 1.0e-3, epochs: 2, betas: [0.1, 0.2]}
        model: {algorithm: dflash}
    """)
    write(tmp_path / "b.yaml", """
        project: from_b
        train: {lr: 2.0e-3}
    """)
    (tmp_path / "sub").mkdir()
    write(tmp_path / "sub" / "c.yaml", """
        _base_: [../a.yaml, ../b.yaml]
        train: {epochs: 5, betas: [0.5]}
    """)
    cfg = load_config(tmp_path / "sub" / "c.yaml")
    assert cfg.project == "from_b"  # later base wins over earlier
    assert cfg.train.lr == 2e-3  # b overrides a, key by key
    assert cfg.train.epochs == 5.0  # the file itself wins over its bases
    assert cfg.train.betas == [0.5]  # lists are replaced, not merged
    assert cfg.model.algorithm == "dflash"  # untouched keys of a survive
    cfg2 = load_config(tmp_path / "sub" / "c.yaml", ["train.lr=7e-4"])
    assert cfg2.train.lr == 7e-4  # --opts win over every file


def test_base_loop_is_an_error(tmp_path):
    write(tmp_path / "a.yaml", "_base_: b.yaml\n")
    write(tmp_path / "b.yaml", "_base_: a.yaml\n")
    with pytest.raises(ConfigError, match="loop"):
        load_config(tmp_path / "a.yaml")


def test_yaml_exponent_without_dot_is_a_float(tmp_path):
    # PyYAML reads `3e-4` as a string; the schema must still give a float.
    write(tmp_path / "c.yaml", "train:\n  lr: 3e-4\n")
    cfg = load_config(tmp_path / "c.yaml")
    assert cfg.train.lr == 3e-4 and isinstance(cfg.train.lr, float)


@pytest.mark.parametrize(
    "opt, getter, expected, typ",
    [
        ("train.lr=3e-4", lambda c: c.train.lr, 3e-4, float),
        ("train.lr=1", lambda c: c.train.lr, 1.0, float),
        ("train.global_batch_size=64", lambda c: c.train.global_batch_size, 64, int),
        ("train.compile=true", lambda c: c.train.compile, True, bool),
        ("train.compile=False", lambda c: c.train.compile, False, bool),
        ("model.target_layer_ids=[1,9,17]", lambda c: c.model.target_layer_ids, [1, 9, 17], list),
        ("project=123", lambda c: c.project, "123", str),
        ("exp=1e-3", lambda c: c.exp, "1e-3", str),
        ("model.draft_vocab_size=null", lambda c: c.model.draft_vocab_size, None, type(None)),
        ("model.draft_vocab_size=8192", lambda c: c.model.draft_vocab_size, 8192, int),
        ("target.chat_template_kwargs={enable_thinking: true}", lambda c: c.target.chat_template_kwargs, {"enable_thinking": True}, dict),
    ],
)
def test_opts_are_typed(opt, getter, expected, typ):
    cfg = load_config(None, [opt])
    assert getter(cfg) == expected
    assert type(getter(cfg)) is typ
    assert cfg.overrides == [opt]


def test_unknown_key_names_close_keys():
    with pytest.raises(ConfigError) as e:
        load_config(None, ["train.lrr=1e-3"])
    assert "train.lrr" in str(e.value) and "train.lr" in str(e.value)
    with pytest.raises(ConfigError, match="model.block_size"):
        load_config(None, ["model.blok_size=3"])


def test_unknown_key_in_yaml(tmp_path):
    write(tmp_path / "c.yaml", "train:\n  warmup_ratoi: 0.1\n")
    with pytest.raises(ConfigError, match="train.warmup_ratio"):
        load_config(tmp_path / "c.yaml")


@pytest.mark.parametrize(
    "opt, field, expected",
    [
        ("train.lr=fast", "train.lr", "float"),
        ("train.global_batch_size=1.5", "train.global_batch_size", "int"),
        ("train.compile=maybe", "train.compile", "bool"),
        ("model.target_layer_ids=[a,b]", "model.target_layer_ids", "list[int]"),
        ("train.optimizer=sgd", "train.optimizer", "'adamw' | 'muon'"),
    ],
)
def test_wrong_type_names_field_and_type(opt, field, expected):
    with pytest.raises(ConfigError) as e:
        load_config(None, [opt])
    assert field in str(e.value) and expected in str(e.value)


def test_wrong_type_in_yaml(tmp_path):
    write(tmp_path / "c.yaml", "train:\n  epochs: [1, 2]\n")
    with pytest.raises(ConfigError, match=r"train.epochs.*float"):
        load_config(tmp_path / "c.yaml")


def test_section_validation():
    with pytest.raises(ConfigError, match="mutually exclusive"):
        load_config(None, ["model.norm_before_fc=true"])  # fc_norm is on by default
    cfg = load_config(None, ["model.norm_before_fc=true", "model.fc_norm=false"])
    assert cfg.model.norm_before_fc and not cfg.model.fc_norm


def test_opts_malformed():
    with pytest.raises(ConfigError, match="key=value"):
        load_config(None, ["train.lr"])
    with pytest.raises(ConfigError, match="section"):
        load_config(None, ["train=1"])


def test_resolved_config_round_trips(tmp_path):
    cfg = load_config(None, ["train.lr=3e-4", "model.target_layer_ids=[1,2]"])
    path = save_config(cfg, tmp_path)
    data = yaml.safe_load(path.read_text())
    assert data["train"]["lr"] == 3e-4
    assert data["overrides"] == ["train.lr=3e-4", "model.target_layer_ids=[1,2]"]
    again = load_config(path)
    assert again.train.lr == 3e-4 and again.model.target_layer_ids == [1, 2]


def test_run_name_records_overrides():
    cfg = load_config(None, ["train.lr=3e-4", "model.block_size=5", "train.output_root=/tmp/x"])
    assert cfg.run_name == "default__lr=3e-4__block_size=5"
    assert load_config(None).run_name == "default"
    # path-valued or long overrides get a hash, so two different runs never share a directory
    a = load_config(None, ["target.name=/models/a/smollm2", "model.block_size=5"]).run_name
    b = load_config(None, ["target.name=/models/b/smollm2", "model.block_size=5"]).run_name
    assert a != b and len(a) <= 112


def test_every_shipped_recipe_loads():
    from pathlib import Path

    recipes = sorted(p for p in (Path(__file__).parents[1] / "config").rglob("*.yaml") if "_base_" not in p.parts and not p.name.startswith("_"))
    assert recipes, "no recipes under config/"
    for recipe in recipes:
        load_config(recipe)
