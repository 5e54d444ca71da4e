"""A raw config mapping (YAML) to the :class:`RunConfig` dataclasses: each section built from its
mapping, each scalar converted to its field's type ("1e-3" -> 0.001 for a float field), an
unknown key an error naming the nearest valid one."""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from typing import Any, get_type_hints

from emdlm.config.errors import ConfigError
from emdlm.config.schema import RunConfig


def _build(cls: type, data: Any, where: str) -> Any:
    """Build dataclass ``cls`` from a mapping, recursing into dataclass-typed fields."""
    if data is None:
        return cls()
    if not isinstance(data, dict):
        raise ConfigError(f"{where or 'config'}: expected a mapping, got {type(data).__name__}")
    hints = get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        if key not in names:
            close = difflib.get_close_matches(str(key), names, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(
                f"unknown config key {where + key!r}{hint}; valid keys: {', '.join(names)}"
            )
        sub = _dataclass_in(hints[key])
        if sub is not None and (isinstance(value, dict) or value is None):
            kwargs[key] = None if value is None and _is_optional(hints[key]) else _build(
                sub, value, f"{where}{key}."
            )
        elif key == "tokenizer" and cls is RunConfig and not isinstance(value, str):
            raise ConfigError(f"tokenizer must be a name or a folder path, got {value!r}")
        else:
            kwargs[key] = _coerce(hints[key], value, where + key)
    return cls(**kwargs)


def _coerce(hint: Any, value: Any, where: str) -> Any:
    """Convert YAML scalars to the field's scalar type ("1e-3" -> 0.001 for a float field); a
    field that takes a mapping (a section or a ``dict[...]``) refuses any other value."""
    origin = typing.get_origin(hint)
    is_union = _is_union(hint)
    args = typing.get_args(hint) if is_union else ()
    if value is None:
        if hint is type(None) or type(None) in args:
            return None
        raise ConfigError(f"{where} may not be null")
    if not isinstance(value, dict) and _takes_mapping(hint):
        raise ConfigError(_not_a_mapping(hint, value, where))
    if origin is not None and not is_union:  # list[...] / dict[...]: checked by the consumer
        return value
    scalar = [t for t in (args or (hint,)) if t in (bool, int, float, str)]
    if not scalar or type(value) in scalar:
        return value
    target = scalar[0]
    try:
        if target is bool:
            if isinstance(value, str) and value.lower() in ("true", "false", "1", "0"):
                return value.lower() in ("true", "1")
            raise ValueError
        if target is int and isinstance(value, float) and value.is_integer():
            return int(value)
        if target is float and isinstance(value, (int, str)) and not isinstance(value, bool):
            return float(value)
        if target is int and isinstance(value, str):
            return int(value)
        if target is str and isinstance(value, (int, float)):
            return str(value)
    except ValueError:
        pass
    raise ConfigError(f"{where} must be {target.__name__}, got {value!r}")


def _takes_mapping(hint: Any) -> bool:
    """Whether every value ``hint`` allows (other than None) is a mapping."""
    allowed = [a for a in (typing.get_args(hint) if _is_union(hint) else (hint,))
               if a is not type(None)]
    return bool(allowed) and all(
        dataclasses.is_dataclass(a) or typing.get_origin(a) is dict or a is dict for a in allowed)


def _not_a_mapping(hint: Any, value: Any, where: str) -> str:
    """The one-line error for a non-mapping value of a mapping-valued key."""
    section = _dataclass_in(hint)
    if section is None:
        return (f"{where} must be a mapping (set its entries as {where}.NAME=VALUE, or "
                f"{where}={{NAME: VALUE}}), got {value!r}")
    keys = [f.name for f in dataclasses.fields(section)]
    return (f"{where} must be a mapping of {', '.join(keys)} (set them as {where}.{keys[0]}=..., "
            f"or {where}={{{keys[0]}: ...}}), got {value!r}")


def _is_union(hint: Any) -> bool:
    origin = typing.get_origin(hint)
    return origin is typing.Union or origin is types.UnionType


def _dataclass_in(hint: Any) -> type | None:
    if dataclasses.is_dataclass(hint):
        return hint
    for arg in getattr(hint, "__args__", ()) or ():
        if dataclasses.is_dataclass(arg):
            return arg
    return None


def _is_optional(hint: Any) -> bool:
    return type(None) in (getattr(hint, "__args__", ()) or ())


def build_config(data: dict[str, Any]) -> RunConfig:
    """Validated :class:`RunConfig` from a raw mapping."""
    cfg = _build(RunConfig, data, "")
    cfg.validate()
    return cfg
