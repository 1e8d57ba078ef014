"""The `deepspec` command and import hygiene."""

from __future__ import annotations

import subprocess
import sys


def test_help_lists_every_stage():
    out = subprocess.run([sys.executable, "-m", "deepspec.cli", "--help"], capture_output=True, text=True, check=True).stdout
    for stage in ("data", "train", "eval", "export", "run"):
        assert stage in out
    out = subprocess.run([sys.executable, "-m", "deepspec.cli", "data", "--help"], capture_output=True, text=True, check=True).stdout
    for stage in ("prompts", "regenerate", "cache"):
        assert stage in out


def test_import_needs_no_gpu_or_engine_package():
    code = (
        "import sys, builtins\n"
        "real = builtins.__import__\n"
        "def guard(name, *a, **k):\n"
        "    if name.split('.')[0] in ('vllm', 'flash_attn', 'triton'):\n"
        "        raise ImportError('blocked ' + name)\n"
        "    return real(name, *a, **k)\n"
        "builtins.__import__ = guard\n"
        "import deepspec, deepspec.cli, deepspec.config\n"
        "deepspec.cli.build_parser()\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "ok" in out.stdout


def test_user_error_is_one_line_not_a_traceback(tmp_path):
    out = subprocess.run([sys.executable, "-m", "deepspec.cli", "train", str(tmp_path / "missing.yaml")], capture_output=True, text=True)
    assert out.returncode == 2
    assert "Traceback" not in out.stderr
    assert "does not exist" in out.stderr


def test_repeated_opts_add_up_and_later_values_win():
    """scripts/quickstart.sh puts its own --opts before the user's: both must reach the config, the user's last."""
    from deepspec.cli import build_parser
    from deepspec.config.args import config_from_args

    args = build_parser().parse_args(
        ["train", "config/quickstart/eagle3.yaml", "--opts", "train.lr=1e-3", "train.epochs=2", "--opts", "train.lr=5e-4"]
    )
    assert args.opts == ["train.lr=1e-3", "train.epochs=2", "train.lr=5e-4"]
    cfg = config_from_args(args)
    assert (cfg.train.lr, cfg.train.epochs) == (5e-4, 2)
