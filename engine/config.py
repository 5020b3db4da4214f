"""Typed run configs: one JSON file per run, loaded into dataclasses, with dotted overrides.

A config class is a tree of dataclasses whose fields are made with :func:`option` (a type, a
default, a one-line description and, for numbers, the range of allowed values), :func:`required`
(no default) and :func:`section` (a nested dataclass). :func:`load_config` reads the JSON file, applies
command-line overrides such as ``--ppo.clip_ratio 0.2``, and builds the tree, rejecting
unknown keys, wrong types and values out of range with a message naming the file and the dotted
key. :func:`json_schema` exports the same rules as a JSON Schema (``ds_configs/schema/``) that
editors use to validate and complete config files. A field named
``deepspeed`` typed ``dict`` may be given inline or as a path to a JSON file (relative to the
config file, or to the project's ``ds_configs/``). Cross-field checks live in each class's
``__post_init__`` and raise :class:`ConfigError` with the values involved.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import os
import types
import typing
from collections.abc import Sequence
from typing import Any, Literal, TypeVar, Union

DS_CONFIGS_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "ds_configs")
T = TypeVar("T")


class ConfigError(ValueError):
    """A config that cannot be used; the message names the file and the key."""


def option(
    default: Any,
    help: str,
    *,
    gt: float | None = None,
    ge: float | None = None,
    lt: float | None = None,
    le: float | None = None,
) -> Any:
    """A config field with its default, one-line description and, for a number, its allowed range
    (``gt``/``ge``: exclusive/inclusive lower bound, ``lt``/``le``: upper; None, when the type allows
    it, is always accepted). Mutable defaults are copied."""
    metadata = {
        "help": help,
        "range": {k: v for k, v in (("gt", gt), ("ge", ge), ("lt", lt), ("le", le)) if v is not None},
    }
    if isinstance(default, (list, dict)):
        return dataclasses.field(default_factory=lambda: json.loads(json.dumps(default)), metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def required(help: str) -> Any:
    """A config field without a default: the file (or command line) must give it.

    Dataclass rule: required fields come before fields with defaults in their class.
    """
    return dataclasses.field(metadata={"help": help})


def section(cls: type, help: str) -> Any:
    """A nested config section, defaulting to the section class's own defaults."""
    return dataclasses.field(default_factory=cls, metadata={"help": help})


def load_config(cls: type[T], path: str, overrides: Sequence[str] = ()) -> T:
    """Read ``path`` (JSON), apply ``--dotted.key value`` overrides, and build ``cls``."""
    try:
        with open(path) as f:
            data = json.load(f)
    except OSError as e:
        raise ConfigError(f"{path}: cannot read config ({e.strerror})") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}:{e.lineno}: not valid JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the config must be a JSON object, got {type(data).__name__}")
    for key, value in parse_overrides(overrides).items():
        _set_dotted(cls, data, key, value)
    return build_config(cls, data, source=path)


def build_config(cls: type[T], data: dict[str, Any], source: str) -> T:
    """Build a config tree from plain data; ``source`` (a file name) prefixes every error."""
    try:
        return _build(cls, data, prefix="", base_dir=os.path.dirname(os.path.abspath(source)))
    except ConfigError as e:
        raise ConfigError(f"{source}: {e}") from None


def config_to_dict(config: Any) -> dict[str, Any]:
    """Plain, JSON-serialisable data of a config tree (what checkpoints store)."""
    return dataclasses.asdict(config)


def parse_overrides(argv: Sequence[str]) -> dict[str, Any]:
    """``["--a.b", "1", "--c=x"]`` -> ``{"a.b": 1, "c": "x"}``; values parse as JSON when they can."""
    overrides: dict[str, Any] = {}
    i = 0
    while i < len(argv):
        token = argv[i]
        if not token.startswith("--") or len(token) == 2:
            raise ConfigError(f"command line: expected --dotted.key VALUE, got {token!r}")
        if "=" in token:
            key, text = token[2:].split("=", 1)
            i += 1
        elif i + 1 < len(argv):
            key, text = token[2:], argv[i + 1]
            i += 2
        else:
            raise ConfigError(f"command line: {token} has no value")
        try:
            overrides[key] = json.loads(text)
        except json.JSONDecodeError:
            overrides[key] = text  # a bare string such as a path
    return overrides


def _set_dotted(cls: type, data: dict[str, Any], key: str, value: Any) -> None:
    """Put an override into the raw data, checking its path against the schema first."""
    node, node_cls = data, cls
    parts = key.split(".")
    for depth, part in enumerate(parts):
        fields = {f.name: f for f in dataclasses.fields(node_cls)}
        if part not in fields:
            raise ConfigError(f"command line: unknown key '--{key}'{_suggest(part, fields, '.'.join(parts[:depth]))}")
        if depth == len(parts) - 1:
            node[part] = value
            return
        field_type = typing.get_type_hints(node_cls)[part]
        if not (isinstance(field_type, type) and dataclasses.is_dataclass(field_type)):
            raise ConfigError(f"command line: '--{key}': '{part}' is not a section")
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"command line: '--{key}': '{part}' in the file is not an object")
        node, node_cls = child, field_type


def _build(cls: type, data: Any, prefix: str, base_dir: str) -> Any:
    if not isinstance(data, dict):
        raise ConfigError(f"'{prefix.rstrip('.') or '<top>'}' must be an object, got {type(data).__name__}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for key in data:
        if key == "$schema":  # an editor's pointer to ds_configs/schema/ (json_schema)
            continue
        if key not in fields:
            raise ConfigError(f"unknown key '{prefix}{key}'{_suggest(key, fields, prefix.rstrip('.'))}")
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for name, f in fields.items():
        if name not in data and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise ConfigError(f"missing required key '{prefix}{name}' ({f.metadata.get('help', '')})")
        if name in data:
            key = prefix + name
            if name == "deepspeed" and isinstance(data[name], str):
                kwargs[name] = _load_deepspeed_file(data[name], key, base_dir)
            else:
                kwargs[name] = _convert(hints[name], data[name], key, base_dir)
                _check_range(kwargs[name], f.metadata.get("range", {}), key)
    try:
        return cls(**kwargs)
    except ConfigError as e:
        raise ConfigError(f"{prefix.rstrip('.') or 'config'}: {e}") from None


def _convert(tp: Any, value: Any, key: str, base_dir: str) -> Any:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return _build(tp, value, key + ".", base_dir)
    if origin in (Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        (inner,) = [a for a in args if a is not type(None)]
        return _convert(inner, value, key, base_dir)
    if origin is Literal:
        if value not in args:
            raise ConfigError(f"'{key}' must be one of {list(args)}, got {value!r}")
        return value
    if origin is list:
        _check(isinstance(value, list), key, "a list", value)
        return [_convert(args[0], v, f"{key}[{i}]", base_dir) for i, v in enumerate(value)]
    if origin is dict:
        _check(isinstance(value, dict), key, "an object", value)
        return {k: _convert(args[1], v, f"{key}.{k}", base_dir) for k, v in value.items()}
    if tp is Any:
        return value
    if tp is bool:
        _check(isinstance(value, bool), key, "true or false", value)
    elif tp is int:
        _check(isinstance(value, int) and not isinstance(value, bool), key, "an integer", value)
    elif tp is float:
        _check(isinstance(value, (int, float)) and not isinstance(value, bool), key, "a number", value)
        _check(math.isfinite(value), key, "a finite number", value)
        return float(value)
    elif tp is str:
        _check(isinstance(value, str), key, "a string", value)
    else:
        raise TypeError(f"config field '{key}' has an unsupported type {tp!r}")
    return value


_BOUNDS = {"gt": (">", float.__gt__), "ge": (">=", float.__ge__), "lt": ("<", float.__lt__), "le": ("<=", float.__le__)}


def _check_range(value: Any, bounds: dict[str, float], key: str) -> None:
    """A number (or each number of a list, each value of an object) within the field's declared range."""
    values = value if isinstance(value, list) else list(value.values()) if isinstance(value, dict) else [value]
    for v in values:
        if (
            isinstance(v, (int, float))
            and not isinstance(v, bool)
            and not all(ok(float(v), b) for name, b in bounds.items() for _, ok in [_BOUNDS[name]])
        ):
            raise ConfigError(
                f"'{key}' must be {' and '.join(f'{_BOUNDS[n][0]} {b:g}' for n, b in bounds.items())}, got {v!r}"
            )


def _check(ok: bool, key: str, expected: str, value: Any) -> None:
    if not ok:
        raise ConfigError(f"'{key}' must be {expected}, got {json.dumps(value)} ({type(value).__name__})")


def _load_deepspeed_file(path: str, key: str, base_dir: str) -> dict[str, Any]:
    """A DeepSpeed config path: relative to the run config's folder, else to ds_configs/."""
    for candidate in (os.path.join(base_dir, path), os.path.join(DS_CONFIGS_DIR, path)):
        if os.path.isfile(candidate):
            try:
                with open(candidate) as f:
                    ds_config = json.load(f)
            except json.JSONDecodeError as e:
                raise ConfigError(f"'{key}': {candidate}:{e.lineno}: not valid JSON ({e.msg})") from None
            _check(isinstance(ds_config, dict), key, "a JSON object file", ds_config)
            return ds_config
    raise ConfigError(f"'{key}': no file {path!r} next to the config or in {DS_CONFIGS_DIR}")


def _suggest(key: str, fields: dict[str, Any], section: str) -> str:
    close = difflib.get_close_matches(key, list(fields), n=1)
    where = f" in '{section}'" if section else ""
    hint = f" (did you mean '{close[0]}'?)" if close else ""
    return f"{where}{hint}; known keys: {', '.join(fields)}"


def json_schema(cls: type, title: str) -> dict[str, Any]:
    """The JSON Schema (draft 2020-12) of a config class: types, enums, ranges, defaults,
    descriptions, required keys, and no other keys (what :func:`load_config` checks, but the
    cross-field rules)."""
    return {"$schema": "https://json-schema.org/draft/2020-12/schema", "title": title, **_schema(cls, {})}


def _schema(tp: Any, bounds: dict[str, float]) -> dict[str, Any]:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if dataclasses.is_dataclass(tp):
        hints, props, required_keys = typing.get_type_hints(tp), {"$schema": {"type": "string"}}, []
        for f in dataclasses.fields(tp):
            prop = _schema(hints[f.name], f.metadata.get("range", {}))
            if f.name == "deepspeed":  # a file name is accepted too
                prop = {"anyOf": [prop, {"type": "string"}]}
            prop["description"] = f.metadata.get("help", "")
            if f.default is not dataclasses.MISSING:
                prop["default"] = f.default
            elif f.default_factory is not dataclasses.MISSING and not dataclasses.is_dataclass(hints[f.name]):
                prop["default"] = f.default_factory()
            elif f.default_factory is dataclasses.MISSING:
                required_keys.append(f.name)
            props[f.name] = prop
        return {"type": "object", "properties": props, "required": required_keys, "additionalProperties": False}
    if origin in (Union, types.UnionType):
        (inner,) = [a for a in args if a is not type(None)]
        return {"anyOf": [_schema(inner, bounds), {"type": "null"}]}
    if origin is Literal:
        return {"enum": list(args)}
    if origin is list:
        return {"type": "array", "items": _schema(args[0], bounds)}
    if origin is dict:
        return {"type": "object", "additionalProperties": _schema(args[1], bounds)}
    if tp in (int, float):
        keyword = {"gt": "exclusiveMinimum", "ge": "minimum", "lt": "exclusiveMaximum", "le": "maximum"}
        return {"type": "integer" if tp is int else "number", **{keyword[k]: v for k, v in bounds.items()}}
    return {bool: {"type": "boolean"}, str: {"type": "string"}}.get(tp, {})
