"""Algorithm registry: a name in `model.algorithm` -> a DraftModel class."""

from __future__ import annotations

import difflib
import importlib

from deepspec.errors import ConfigError

# name -> module that defines and registers it (imported on first use)
_MODULES = {"eagle3": "deepspec.drafts.eagle3", "dflash": "deepspec.drafts.dflash", "dspark": "deepspec.drafts.dspark",
            "dflash2": "deepspec.drafts.dflash2"}
REGISTRY: dict[str, type] = {}


def register(name: str):
    def wrap(cls):
        cls.algorithm = name
        REGISTRY[name] = cls
        return cls

    return wrap


def get_algorithm(name: str):
    if name not in REGISTRY and name in _MODULES:
        importlib.import_module(_MODULES[name])
    if name not in REGISTRY:
        close = difflib.get_close_matches(name, list(_MODULES), n=2)
        hint = f" Did you mean {' or '.join(close)}?" if close else ""
        raise ConfigError(f"Unknown draft algorithm model.algorithm='{name}'; choose one of {', '.join(_MODULES)}.{hint}")
    return REGISTRY[name]


def available_algorithms() -> list[str]:
    return list(_MODULES)
