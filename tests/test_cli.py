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


def _exit_in_child(tmp_path, body: str) -> tuple[subprocess.CompletedProcess, int]:
    """Run `body` (which ends in exit_process) in a new interpreter whose atexit handler records how many objects were
    frozen when it ran, beyond those frozen at its start (Python 3.12 starts with a few hundred): (the process, that
    count)."""
    code = (
        "import atexit, gc, sys\n"
        "from deepspec.exiting import exit_process\n"
        "start = gc.get_freeze_count()\n"
        "atexit.register(lambda: open(sys.argv[1], 'w').write(str(gc.get_freeze_count() - start)))\n"
        + body
    )
    marker = tmp_path / "atexit.txt"
    out = subprocess.run([sys.executable, "-c", code, str(marker)], capture_output=True, text=True)
    return out, int(marker.read_text())


def test_an_entry_point_exits_with_its_code_its_output_and_atexit_handlers_but_no_final_collection(tmp_path):
    """deepspec/exiting.py: the exit code and buffered output survive, atexit handlers run (wandb, tensorboard and
    logging close there), and the heap is frozen first, so the interpreter's last collection has nothing to walk."""
    out, frozen = _exit_in_child(tmp_path, "sys.stdout.write('unflushed line')\nexit_process(3)\n")
    assert out.returncode == 3 and out.stdout == "unflushed line", (out.returncode, out.stdout, out.stderr)
    assert frozen > 1_000  # the atexit handler ran, after the freeze (0 objects frozen without it)


def test_an_entry_point_with_triton_loaded_exits_as_usual_without_leak_reports(tmp_path):
    """Triton's nanobind extension counts the objects alive at the interpreter's end: a frozen heap would print dozens of
    "nanobind: leaked ..." lines after every training run. With it loaded, the heap is not frozen and nothing is printed."""
    out, frozen = _exit_in_child(tmp_path, "import triton\nexit_process(0)\n")
    assert out.returncode == 0 and "nanobind" not in out.stderr, out.stderr[-2000:]
    assert frozen == 0
