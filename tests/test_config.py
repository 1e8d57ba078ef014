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


def test_a_renamed_key_is_read_under_its_old_name_with_a_warning(tmp_path, logs):
    from deepspec.config import load_config

    assert load_config(None, ["train.num_workers=3"]).train.prefetch_depth == 3
    assert "'train.num_workers' is now 'train.prefetch_depth'" in logs.text
    recipe = tmp_path / "r.yaml"
    recipe.write_text("train:\n  num_workers: 1\n")
    assert load_config(recipe).train.prefetch_depth == 1
    recipe.write_text("train:\n  num_workers: 1\n  prefetch_depth: 2\n")
    with pytest.raises(ConfigError, match="Both 'train.prefetch_depth' and its old name are set"):
        load_config(recipe)
    logs.clear()
    recipe.write_text("train:\n  num_workers: null\n")  # an older run's saved config.yaml: read silently
    assert load_config(recipe).train.prefetch_depth is None and "now" not in logs.text


def test_section_validation():
    with pytest.raises(ConfigError, match="mutually exclusive"):
        load_config(None, ["model.norm_before_fc=true"])  # fc_norm is on by default
    cfg = load_config(None, ["model.norm_before_fc=true", "model.fc_norm=false"])
    assert cfg.model.norm_before_fc and not cfg.model.fc_norm
    with pytest.raises(ConfigError, match="train.val_every must be >= 0"):
        load_config(None, ["train.val_every=-1"])
    with pytest.raises(ConfigError, match="train.save_every must be >= 1"):
        load_config(None, ["train.save_every=0"])
    assert load_config(None, ["train.val_every=0"]).train.val_every == 0  # at the end only


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


def test_run_name_is_the_experiment_not_the_overrides(tmp_path):
    """Overrides do not rename a run (they are in its config.yaml); `run.name` does; a folder named the old way
    (exp + overrides) is still found when it exists."""
    cfg = load_config(None, ["train.lr=3e-4", "model.block_size=5", f"train.output_root={tmp_path}"])
    assert cfg.run_name == "default" and cfg.run_dir == tmp_path / "deepspec" / "default"
    assert cfg.legacy_run_name == "default__lr=3e-4__block_size=5"
    named = load_config(None, ["run.name=lr-sweep-1", "train.lr=3e-4", f"train.output_root={tmp_path}"])
    assert named.run_dir == tmp_path / "deepspec" / "lr-sweep-1"
    # a run started by an earlier version under the override-named folder
    (tmp_path / "deepspec" / cfg.legacy_run_name).mkdir(parents=True)
    assert cfg.run_dir == tmp_path / "deepspec" / "default__lr=3e-4__block_size=5"
    with pytest.raises(ConfigError, match="run.name"):
        load_config(None, ["run.name=a/b"])
    # path-valued or long overrides gave the old names a hash, so two different runs never shared a directory
    a = load_config(None, ["target.name=/models/a/smollm2", "model.block_size=5"]).legacy_run_name
    b = load_config(None, ["target.name=/models/b/smollm2", "model.block_size=5"]).legacy_run_name
    assert a != b and len(a) <= 112


def test_resuming_a_run_with_other_settings_names_them_and_stops_unless_allowed(tmp_path, logs):
    """A typo in --opts must not silently continue a run with other settings: the differences are named and the
    resume stops; worker counts and eval settings may change; run.allow_changes resumes with a warning."""
    from deepspec.config import save_config
    from deepspec.errors import CheckpointError
    from deepspec.train.checkpoint import check_resume_settings

    step = tmp_path / "run" / "step_4"
    step.mkdir(parents=True)
    save_config(load_config(None, ["train.lr=3e-4", "run.name=x"]), step)
    check_resume_settings(load_config(None, ["train.lr=3e-4", "run.name=x", "train.prefetch_depth=0", "eval.max_new_tokens=5"]), step)
    typo = load_config(None, ["train.lr=3e-3", "run.name=x", "model.block_size=5"])
    with pytest.raises(CheckpointError) as err:
        check_resume_settings(typo, step)
    message = str(err.value)
    assert "train.lr: 0.0003 -> 0.003" in message and "model.block_size" in message and "run.allow_changes=true" in message
    allowed = load_config(None, ["train.lr=3e-3", "run.name=x", "run.allow_changes=true"])
    check_resume_settings(allowed, step)
    assert any("resuming" in m and "train.lr: 0.0003 -> 0.003" in m for m in logs.messages)


def test_quickstart_folder_is_the_same_with_or_without_native_bf16():
    """scripts/quickstart.sh adds data.prompts.max_samples=212 on CPUs without bf16: the run folder stays eagle3."""
    from pathlib import Path

    recipe = Path(__file__).parents[1] / "config" / "quickstart" / "eagle3_blend.yaml"
    plain, small = load_config(recipe), load_config(recipe, ["data.prompts.max_samples=212"])
    assert plain.run_dir == small.run_dir == Path("checkpoints/quickstart-blend/eagle3")


def test_settings_diff_names_what_changed():
    from deepspec.config import config_to_dict
    from deepspec.config.diff import settings_diff

    a = config_to_dict(load_config(None, ["train.lr=3e-4"]))
    b = config_to_dict(load_config(None, ["train.lr=1e-3", "train.num_workers=0", "eval.max_new_tokens=5", "run.name=x"]))
    assert settings_diff(a, b) == ["train.lr: 0.0003 -> 0.001"]
    assert settings_diff(a, a) == []


def test_every_shipped_recipe_loads():
    from pathlib import Path

    recipes = sorted(p for p in (Path(__file__).parents[1] / "config").rglob("*.yaml") if "_base_" not in p.parts and not p.name.startswith("_"))
    assert recipes, "no recipes under config/"
    for recipe in recipes:
        load_config(recipe)


def test_gpu_recipes_pack_their_micro_batches():
    """The Qwen3 GPU recipes pack several samples per micro-batch into rows of >= 8,192 tokens, and one node of
    8 GPUs divides their global batch."""
    from pathlib import Path

    recipes = sorted((Path(__file__).parents[1] / "config").glob("*/qwen3-*.yaml"))
    assert len(recipes) >= 9
    for recipe in recipes:
        tc = load_config(recipe).train
        assert tc.pack_tokens >= 8192 and tc.micro_batch_size > 1, recipe
        assert tc.global_batch_size % (8 * tc.micro_batch_size) == 0, recipe


def test_regeneration_concurrency_auto_follows_the_hardware():
    from deepspec.config.data import CPU_CONCURRENCY_PER_SERVER, GPU_CONCURRENCY_PER_SERVER

    rc = load_config(None).data.regenerate
    assert rc.concurrency_per_server == "auto"
    assert rc.resolved_concurrency(gpu=True) == GPU_CONCURRENCY_PER_SERVER >= 128
    assert rc.resolved_concurrency(gpu=False) == CPU_CONCURRENCY_PER_SERVER == 32
    set64 = load_config(None, ["data.regenerate.concurrency_per_server=64"]).data.regenerate
    assert set64.concurrency_per_server == 64 and set64.resolved_concurrency(gpu=True) == 64
    with pytest.raises(ConfigError, match="concurrency_per_server"):
        load_config(None, ["data.regenerate.concurrency_per_server=0"])
    with pytest.raises(ConfigError, match="concurrency_per_server"):
        load_config(None, ["data.regenerate.concurrency_per_server=many"])
