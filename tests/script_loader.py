"""Loading a script of benchmarks/ or scripts/ as a module, for the tests that call its functions directly."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def load_script(path: str | Path, name: str | None = None):
    """The module `path` (relative to the repository root, or absolute) defines; its own folder is importable while it
    loads, as when it runs as a script (a benchmark importing a sibling benchmark)."""
    path = ROOT / path
    spec = importlib.util.spec_from_file_location(name or path.stem, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # as an import does: a dataclass in it looks its module up there
    sys.path.insert(0, str(path.parent))
    try:
        spec.loader.exec_module(mod)
    finally:
        sys.path.remove(str(path.parent))
    return mod
