"""SGLang's own code, imported from a side folder (scripts/sglang_side.sh) into a process of its own.

SGLang is not a dependency of deepspec: its sources are installed with `pip install --no-deps --target` into a
side folder and imported only in a subprocess (its import chain and its torch.distributed init must not leak into
the caller). Shared by `deepspec check` (export/check_sglang.py) and the SGLang export tests (tests/sglang_probe.py).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import socket
import sys
import types
from pathlib import Path

SGLANG_RELEASE = "0.5.23"


def find_side_dir() -> Path | None:
    """The side folder with SGLang's sources: $DEEPSPEC_SGLANG_SIDE, else ~/.cache/deepspec/sglang-<release>-py<3X>
    (where scripts/sglang_side.sh installs it for this Python: some of its packages are compiled for one); None when
    neither holds a complete install. Never installs."""
    env = os.environ.get("DEEPSPEC_SGLANG_SIDE")
    cands = [Path(env)] if env else []
    release = os.environ.get("DEEPSPEC_SGLANG_VERSION", SGLANG_RELEASE)
    cands.append(Path.home() / ".cache" / "deepspec" / f"sglang-{release}-py{sys.version_info[0]}{sys.version_info[1]}")
    for c in cands:
        if (c / "sglang" / "srt").is_dir() and (c / ".complete").is_file():
            return c
    return None


class _Anything(types.ModuleType):
    """Stand-in for torchvision: SGLang's multimodal utilities import it at module level; no draft uses it."""

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Anything(f"{self.__name__}.{name}")

    def __call__(self, *args, **kwargs):
        return _Anything(self.__name__ + "()")


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] == "torchvision":
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _Anything(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module):
        pass


def import_sglang(side: str | Path) -> None:
    """Make SGLang importable from `side` and initialise its single-process (gloo) groups, as SGLang's own layer
    tests do. Call once per process, in a process that does nothing else with torch.distributed."""
    import transformers.utils.import_utils as iu

    iu.is_torchvision_available = lambda: False  # the stub must not look like a real torchvision to transformers
    sys.meta_path.insert(0, _StubFinder())
    sys.path.append(str(side))
    from sglang.test.layer_ut_utils import init_single_process_dist

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    init_single_process_dist(master_port=port)
