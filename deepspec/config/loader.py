"""YAML recipes with `_base_` inheritance and typed `--opts` overrides.

A recipe is a YAML mapping. ``_base_: path`` (or a list of paths, relative to the file)
names recipes merged *before* it, in order; later files win, mappings merge key by key,
lists and scalars are replaced. The merged mapping is then checked against the typed
schema (dataclasses in :mod:`deepspec.config.schema`), and ``--opts a.b=c`` overrides are
parsed with the schema's type of ``a.b`` (so ``train.lr=3e-4`` is a float, never a string).
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin

import yaml

from deepspec.errors import ConfigError

_BASE_KEY = "_base_"


# ----------------------------------------------------------------------------- YAML + _base_


def load_yaml_with_bases(path: str | Path, _seen: tuple[Path, ...] = ()) -> dict[str, Any]:
    """Load a recipe and merge its `_base_` chain (bases first, the file itself last)."""
    path = Path(path).expanduser().resolve()
    if not path.is_file():
        raise ConfigError(f"Config file {path} does not exist; pass the path of a YAML recipe such as config/quickstart/eagle3.yaml.")
    if path in _seen:
        chain = " -> ".join(str(p) for p in (*_seen, path))
        raise ConfigError(f"Config files include each other in a loop ({chain}); remove one `_base_` entry.")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"Config file {path} is not valid YAML ({e}); fix the syntax.") from None
    if not isinstance(data, dict):
        raise ConfigError(f"Config file {path} must contain a YAML mapping at top level, found {type(data).__name__}.")
    bases = data.pop(_BASE_KEY, None) or []
    if isinstance(bases, str):
        bases = [bases]
    merged: dict[str, Any] = {}
    for base in bases:
        merged = deep_merge(merged, load_yaml_with_bases(path.parent / base, (*_seen, path)))
    return deep_merge(merged, data)


def deep_merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    """Return `base` updated by `override`; nested mappings merge, everything else is replaced."""
    out = dict(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = value
    return out


# ----------------------------------------------------------------------------- typed building


def _type_name(tp: Any) -> str:
    origin = get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in get_args(tp))
    if origin in (Union, types.UnionType):
        return " | ".join(_type_name(a) for a in get_args(tp))
    if origin is list:
        (inner,) = get_args(tp) or (Any,)
        return f"list[{_type_name(inner)}]"
    if origin is dict:
        return "mapping"
    if tp is type(None):
        return "null"
    return getattr(tp, "__name__", str(tp))


class _Mismatch(Exception):
    pass


def coerce(value: Any, tp: Any, *, from_text: bool = False) -> Any:
    """Convert `value` to type `tp` or raise _Mismatch. Strings parse as numbers for numeric fields."""
    if tp is Any:
        return value
    origin = get_origin(tp)
    if origin in (Union, types.UnionType):
        args = get_args(tp)
        if value is None or (from_text and isinstance(value, str) and value.lower() in ("null", "none", "~")):
            if type(None) in args:
                return None
            raise _Mismatch
        for arg in args:
            if arg is type(None):
                continue
            try:
                return coerce(value, arg, from_text=from_text)
            except _Mismatch:
                continue
        raise _Mismatch
    if origin is Literal:
        if value in get_args(tp):
            return value
        raise _Mismatch
    if origin is list:
        (inner,) = get_args(tp) or (Any,)
        if from_text and isinstance(value, str):
            value = _yaml_value(value)
        if isinstance(value, tuple):
            value = list(value)
        if not isinstance(value, list):
            raise _Mismatch
        return [coerce(v, inner) for v in value]
    if origin is dict or tp is dict:
        if from_text and isinstance(value, str):
            value = _yaml_value(value)
        if not isinstance(value, dict):
            raise _Mismatch
        return dict(value)
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "yes", "no", "1", "0", "on", "off"):
            return value.lower() in ("true", "yes", "1", "on")
        raise _Mismatch
    if tp is int:
        if isinstance(value, bool):
            raise _Mismatch
        if isinstance(value, int):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str):
            try:
                f = float(value.replace("_", ""))
            except ValueError:
                raise _Mismatch from None
            if f.is_integer():
                return int(f)
        raise _Mismatch
    if tp is float:
        if isinstance(value, bool):
            raise _Mismatch
        if isinstance(value, (int, float)):
            return float(value)
        if isinstance(value, str):  # PyYAML reads 3e-4 (no dot) as a string: accept it here
            try:
                return float(value)
            except ValueError:
                raise _Mismatch from None
        raise _Mismatch
    if tp is str:
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)
        raise _Mismatch
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise _Mismatch
        return value  # nested dataclasses are built by build_dataclass
    raise _Mismatch


def _yaml_value(text: str) -> Any:
    """An override's text as YAML (`[a, b]`, `{k: v}`); text that is not YAML does not fit (quote items with ':'/'?')."""
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        raise _Mismatch from None


def all_keys(cls: type, prefix: str = "") -> list[str]:
    """Every dotted key of a dataclass schema (sections and leaves)."""
    keys = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        key = f"{prefix}{f.name}"
        keys.append(key)
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            keys.extend(all_keys(tp, key + "."))
    return keys


# Keys renamed for what they mean: the old name is still read, with a warning that names the new one.
RENAMED = {"train.num_workers": "train.prefetch_depth"}


def _renamed(dotted: str, value: Any = True) -> str:
    """The key's current name; a warning when an old name is given a value (saved configs of older runs carry the
    old name with its null default: read silently)."""
    new = RENAMED.get(dotted)
    if new is None or value is None:
        return new or dotted
    from deepspec.log import get_logger

    get_logger(__name__).warning("config key '%s' is now '%s' (it sets how many micro-batches a thread reads ahead); "
                                 "the old name still works: rename it in your recipe", dotted, new)
    return new


def _unknown_key(key: str, root: type) -> ConfigError:
    keys = all_keys(root)
    close = difflib.get_close_matches(key, keys, n=3, cutoff=0.5)
    if not close:
        leaf = key.rsplit(".", 1)[-1]
        close = [k for k in keys if k.rsplit(".", 1)[-1] == leaf][:3] or difflib.get_close_matches(
            leaf, [k.rsplit(".", 1)[-1] for k in keys], n=3, cutoff=0.6
        )
    hint = f" Did you mean: {', '.join(close)}?" if close else ""
    return ConfigError(f"Unknown config key '{key}'.{hint}")


def build_dataclass(cls: type, data: dict[str, Any], prefix: str = "", root: type | None = None) -> Any:
    """Build dataclass `cls` from a mapping, checking every key and type."""
    root = root or cls
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in data.items():
        dotted = f"{prefix}{key}"
        if dotted in RENAMED:
            dotted = _renamed(dotted, value)
            key = dotted.rsplit(".", 1)[-1]
            if key in data:
                raise ConfigError(f"Both '{prefix}{key}' and its old name are set; keep '{prefix}{key}' only.")
        if key not in fields:
            raise _unknown_key(dotted, root)
        tp = hints[key]
        if dataclasses.is_dataclass(tp):
            if value is None:
                value = {}
            if not isinstance(value, dict):
                raise ConfigError(f"Config field '{dotted}' is a section and needs a mapping, got {value!r}.")
            kwargs[key] = build_dataclass(tp, value, dotted + ".", root)
            continue
        try:
            kwargs[key] = coerce(value, tp)
        except _Mismatch:
            raise ConfigError(
                f"Config field '{dotted}' expects {_type_name(tp)}, got {value!r} ({type(value).__name__})."
            ) from None
    obj = cls(**kwargs)
    validate = getattr(obj, "validate", None)
    if callable(validate):
        validate()
    return obj


# ----------------------------------------------------------------------------- --opts


def parse_opts(opts: list[str] | None) -> list[tuple[str, str]]:
    """Split `a.b=c` strings; reject anything without '='."""
    pairs = []
    for opt in opts or []:
        if "=" not in opt:
            raise ConfigError(f"Override '{opt}' must look like key=value (e.g. train.lr=3e-4).")
        key, value = opt.split("=", 1)
        key = key.strip()
        if not key:
            raise ConfigError(f"Override '{opt}' has an empty key; write key=value.")
        pairs.append((key, value))
    return pairs


def apply_opts(data: dict[str, Any], opts: list[str] | None, root: type) -> dict[str, Any]:
    """Apply `--opts` to a raw mapping, parsing each value with the schema's type."""
    data = dict(data)
    for key, text in parse_opts(opts):
        key = _renamed(key)
        parts = key.split(".")
        cls, node = root, data
        for i, part in enumerate(parts):
            hints = typing.get_type_hints(cls)
            names = {f.name for f in dataclasses.fields(cls)}
            if part not in names:
                raise _unknown_key(key, root)
            tp = hints[part]
            last = i == len(parts) - 1
            if dataclasses.is_dataclass(tp):
                if last:
                    raise ConfigError(f"'{key}' is a section, not a field; override one of its fields, e.g. {key}.<field>=value.")
                node[part] = dict(node.get(part) or {})
                node, cls = node[part], tp
                continue
            if not last:
                raise _unknown_key(key, root)
            try:
                node[part] = coerce(_parse_text(text, tp), tp, from_text=True)
            except _Mismatch:
                raise ConfigError(f"Override '{key}={text}' does not fit: '{key}' expects {_type_name(tp)}.") from None
    return data


def _parse_text(text: str, tp: Any) -> Any:
    """Strings stay raw for str fields; everything else goes through YAML first."""
    if tp is str or (get_origin(tp) in (Union, types.UnionType) and str in get_args(tp) and text.lower() not in ("null", "none", "~")):
        return text
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def to_dict(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [to_dict(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    return obj
