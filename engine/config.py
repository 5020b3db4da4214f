"""Typed run configs: one JSON file per run, validated by pydantic, with dotted overrides.

A config class is a tree of :class:`Config` models (pydantic, strict JSON types, no unknown keys, finite
numbers) whose fields are made with :func:`option` (a default, a one-line description and, for numbers, the
range of allowed values), :func:`required` (no default) and :func:`section` (a nested model).
:func:`load_config` reads the JSON file, applies command-line overrides such as ``--ppo.clip_ratio 0.2``, and
builds the tree; pydantic's errors are reworded to name the file, the dotted key, the allowed range and, for
an unknown key, the closest known one. :func:`json_schema` exports the same rules as a JSON Schema
(``ds_configs/schema/``) that editors use to validate and complete config files. A :data:`DeepSpeedDict`
field may be given inline or as a path to a JSON file (relative to the config file, or to the project's
``ds_configs/``). Cross-field checks are each class's :meth:`Config.check` and raise :class:`ConfigError`
with the values involved. Loading reads no environment: rules on the number of ranks are
:meth:`Config.check_world_size`, which ``start_run`` calls once the run knows it; the one value a check fills
in is a ``bf16`` left out, from the DeepSpeed config's own ``bf16.enabled``.
"""

from __future__ import annotations

import difflib
import json
import os
import typing
from collections.abc import Sequence
from typing import Annotated, Any, ClassVar, Self, TypeVar

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    ValidationInfo,
    model_validator,
)

DS_CONFIGS_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "ds_configs")
T = TypeVar("T")  # a Config subclass (start_run passes its own unbound T)


class ConfigError(ValueError):
    """A config that cannot be used; the message names the file and the key."""


class Config(BaseModel):
    """A config section: JSON types only (no "1" for 1), no unknown keys, no NaN or infinity, then :meth:`check`."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)
    _source: str = PrivateAttr("")  # the file it was loaded from, for the errors found once a run starts
    # keys the section had once, each with what replaces it: the error for a config that still sets one
    retired_keys: ClassVar[dict[str, str]] = {}

    @model_validator(mode="before")
    @classmethod
    def _skip_schema_key(cls, data: Any) -> Any:  # "$schema": an editor's pointer to ds_configs/schema/
        return {k: v for k, v in data.items() if k != "$schema"} if isinstance(data, dict) else data

    @model_validator(mode="after")
    def _check(self) -> Self:
        self.check()
        return self

    def check(self) -> None:
        """The section's cross-field rules, once its fields are valid: raise :class:`ConfigError` with the values."""

    def check_world_size(self, world: int) -> None:
        """Rules on the number of ranks, which only a started run knows (engine/run/launch.start_run calls this)."""

    def generation_ranks(self) -> int:
        """How many of the launched ranks only generate (PPO's async rollout; engine/run/distributed.py)."""
        return 0


def option(
    default: Any,
    help: str,
    *,
    gt: float | None = None,
    ge: float | None = None,
    lt: float | None = None,
    le: float | None = None,
) -> Any:
    """A field with its default, one-line description and, for a number, its allowed range (``gt``/``ge``:
    exclusive/inclusive lower bound, ``lt``/``le``: upper; None, when the type allows it, is accepted; the
    items of a list take theirs in the type: ``list[Annotated[float, Field(ge=0)]]``). Mutable defaults are
    copied per instance."""
    return Field(default, description=help, gt=gt, ge=ge, lt=lt, le=le)


def required(help: str) -> Any:
    """A field without a default: the file (or command line) must give it."""
    return Field(description=help)


def section(cls: type[Config], help: str) -> Any:
    """A nested section, defaulting to the section class's own defaults."""
    return Field(default_factory=cls, description=help)


def _deepspeed_file(value: Any, info: ValidationInfo) -> Any:
    """A DeepSpeed config path: relative to the run config's folder, else to ds_configs/."""
    if not isinstance(value, str):
        return value
    for candidate in (
        os.path.join((info.context or {}).get("base_dir", ""), value),
        os.path.join(DS_CONFIGS_DIR, value),
    ):
        if os.path.isfile(candidate):
            try:
                with open(candidate) as f:
                    ds_config = json.load(f)
            except json.JSONDecodeError as e:
                raise ConfigError(f"{candidate}:{e.lineno}: not valid JSON ({e.msg})") from None
            if not isinstance(ds_config, dict):
                raise ConfigError(f"{candidate} must hold a JSON object, got {type(ds_config).__name__}")
            return ds_config
    raise ConfigError(f"no file {value!r} next to the config or in {DS_CONFIGS_DIR}")


DeepSpeedDict = Annotated[dict[str, Any], BeforeValidator(_deepspeed_file, json_schema_input_type=dict[str, Any] | str)]


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
    """Build a config tree from plain data; ``source`` (a file name) prefixes every error, one per line
    (unknown keys first: a misspelt key also reads as a missing one)."""
    model: Any = cls
    try:
        config = model.model_validate(data, context={"base_dir": os.path.dirname(os.path.abspath(source))})
    except ValidationError as e:
        errors = sorted(e.errors(), key=lambda err: err["type"] != "extra_forbidden")
        raise ConfigError("\n".join(f"{source}: {_message(model, err)}" for err in errors)) from None
    config._source = source
    return config


def config_to_dict(config: Config) -> dict[str, Any]:
    """Plain, JSON-serialisable data of a config tree (what checkpoints store)."""
    return config.model_dump()


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


def _set_dotted(cls: Any, data: dict[str, Any], key: str, value: Any) -> None:
    """Put an override into the raw data, checking its path against the schema first (an optional
    section the file leaves out or null is created; in a dict of sections, a part names the entry)."""
    node, node_cls = data, cls
    parts = key.split(".")
    depth = 0
    while True:
        part, fields = parts[depth], node_cls.model_fields
        if part not in fields:
            raise ConfigError(f"command line: unknown key '--{key}'{_suggest(part, node_cls, '.'.join(parts[:depth]))}")
        if depth == len(parts) - 1:
            node[part] = value
            return
        node_cls = _section_or_type(fields[part].annotation)
        entries = _entry_section(node_cls)
        if not (_is_section(node_cls) or (entries and depth + 2 < len(parts))):
            raise ConfigError(f"command line: '--{key}': '{part}' is not a section")
        node = _child(node, part, key)
        if entries:
            depth += 1
            node, node_cls = _child(node, parts[depth], key), entries
        depth += 1


def _child(node: dict[str, Any], part: str, key: str) -> dict[str, Any]:
    child = node.setdefault(part, {})
    if child is None:  # an optional section the file left null
        child = node[part] = {}
    if not isinstance(child, dict):
        raise ConfigError(f"command line: '--{key}': '{part}' in the file is not an object")
    return child


_EXPECTED = {
    "int_type": "an integer",
    "bool_type": "true or false",
    "float_type": "a number",
    "finite_number": "a finite number",
    "string_type": "a string",
    "list_type": "a list",
    "dict_type": "an object",
    "model_type": "an object",
}
_BOUNDS = (("gt", ">"), ("ge", ">="), ("lt", "<"), ("le", "<="))


def _message(cls: type[Config], err: Any) -> str:
    """One pydantic error in the loader's words: the dotted key and what it must be."""
    loc, kind, value = err["loc"], err["type"], err["input"]
    key = _dotted(loc)
    model: Any = cls  # walk the path: the innermost config field on it, and what that field holds
    field, field_depth = None, 0
    for depth, part in enumerate(loc):
        fields = model.model_fields if _is_section(model) else {}
        if kind == "extra_forbidden" and depth == len(loc) - 1:
            return f"unknown key '{key}'{_suggest(str(part), model, _dotted(loc[:-1]))}"
        if part in fields:
            field, field_depth, model = fields[part], depth + 1, _section_or_type(fields[part].annotation)
        elif _is_section(entries := _entry_section(model)):  # the name of an entry of a dict of sections
            field_depth, model = depth + 1, entries
    if kind == "missing":
        return f"missing required key '{key}' ({field.description if field else ''})"
    if kind in _EXPECTED:
        return f"'{key}' must be {_EXPECTED[kind]}, got {json.dumps(value)} ({type(value).__name__})"
    if kind == "literal_error" and field:
        return f"'{key}' must be one of {list(typing.get_args(field.annotation))}, got {value!r}"
    if kind in ("greater_than", "greater_than_equal", "less_than", "less_than_equal") and field:
        items = (
            m for a in typing.get_args(field.annotation) for i in getattr(a, "__metadata__", ()) for m in i.metadata
        )
        bounds = [
            f"{sign} {getattr(m, name):g}"
            for m in [*field.metadata, *items]
            for name, sign in _BOUNDS
            if hasattr(m, name)
        ]
        return f"'{_dotted(loc[:field_depth])}' must be {' and '.join(bounds)}, got {value!r}"
    if kind == "value_error" and _is_section(model):
        return f"{key or 'config'}: {err['ctx']['error']}"  # a section's cross-field check
    return f"'{key}': {err['ctx']['error'] if kind == 'value_error' else err['msg']}"  # e.g. a DeepSpeed file


def _dotted(loc: tuple[int | str, ...]) -> str:
    return "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc).lstrip(".")


def _is_section(tp: Any) -> bool:
    return isinstance(tp, type) and issubclass(tp, Config)


def _section_or_type(tp: Any) -> Any:
    """The section of an optional section (``Section | None``), else ``tp``."""
    sections = [a for a in typing.get_args(tp) if _is_section(a)] if type(None) in typing.get_args(tp) else []
    return sections[0] if len(sections) == 1 else tp


def _entry_section(tp: Any) -> Any:
    """The entries' section of a ``dict[str, Section]``, else None."""
    args = typing.get_args(tp)
    return args[1] if typing.get_origin(tp) is dict and len(args) == 2 and _is_section(args[1]) else None


def _suggest(key: str, cls: Any, section: str) -> str:
    """What follows "unknown key" for ``key`` in the section class ``cls``: what replaced a retired key,
    else the closest known key and the known keys."""
    fields = cls.model_fields if _is_section(cls) else {}
    where = f" in '{section}'" if section else ""
    if _is_section(cls) and key in cls.retired_keys:
        return f"{where}: {cls.retired_keys[key]}"
    close = difflib.get_close_matches(key, list(fields), n=1)
    hint = f" (did you mean '{close[0]}'?)" if close else ""
    return f"{where}{hint}; known keys: {', '.join(fields)}"


def json_schema(cls: type[Config], title: str) -> dict[str, Any]:
    """The JSON Schema (draft 2020-12) of a config class, inlined: types, enums, ranges, defaults,
    descriptions, required keys, and no other keys (what :func:`load_config` checks, but the
    cross-field rules)."""
    schema = cls.model_json_schema()
    defs = schema.pop("$defs", {})

    def inline(node: Any) -> Any:
        if isinstance(node, list):
            return [inline(n) for n in node]
        if not isinstance(node, dict):
            return node
        if "$ref" in node:
            node = {**defs[node["$ref"].rsplit("/", 1)[1]], **{k: v for k, v in node.items() if k != "$ref"}}
        out = {k: inline(v) for k, v in node.items() if not (k == "title" and isinstance(v, str))}
        if "properties" in out:
            out["properties"] = {"$schema": {"type": "string"}, **out["properties"]}
            out.setdefault("required", [])
        return out

    body = inline(schema)
    body.pop("description", None)
    return {"$schema": "https://json-schema.org/draft/2020-12/schema", "title": title, **body}
