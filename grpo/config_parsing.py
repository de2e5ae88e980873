"""How grpo/config.py's dataclasses are declared, read and checked, whatever their fields.

A field is declared with `setting` (its default, its help and its rule together) or `section` (a nested dataclass).
`build_dataclass` turns a mapping (a YAML file with dotted overrides applied) into the dataclasses, checking every
key and every value's type against the annotations; `check_rule` checks one value against its field's ``range`` or
``choices``. Every failure is a `ConfigError` whose message names the key, the value and what is allowed.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
import types
import typing
from dataclasses import field
from pathlib import Path

import yaml


class ConfigError(ValueError):
    """A recipe config or override is invalid; the message names the key and what is allowed."""


def setting(default, help: str, **rule):
    """A config field: its default, its help and its rule (``range``, ``choices``, ``check``), declared together."""
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata=dict(help=help, **rule))
    return field(default=default, metadata=dict(help=help, **rule))


def section(cls, help: str):
    return field(default_factory=cls, metadata=dict(help=help))


def field_leaves(config, prefix: str = ""):
    """``(dotted key, value, metadata)`` of every field, the sections' fields included."""
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if dataclasses.is_dataclass(value):
            yield from field_leaves(value, f"{prefix}{f.name}.")
        else:
            yield prefix + f.name, value, f.metadata


_COMPARISON = re.compile(r"(>=|>) (\S+)")
_INTERVAL = re.compile(r"in ([\[(])(\S+), (\S+?)([\])])")


def check_rule(key: str, value, meta) -> None:
    """A field's ``choices`` or ``range`` (None passes where the type allows it: the type is checked at load)."""
    if value is None:
        return
    if "choices" in meta and value not in meta["choices"]:
        raise ConfigError(f"{key}={value!r} is not allowed; choose one of {list(meta['choices'])}")
    rule = meta.get("range")
    if rule is None:
        return
    if isinstance(value, (str, list)):  # a text or a list: non-empty, and what `check` accepts
        ok = bool(value) and meta.get("check", bool)(value)
    elif match := _COMPARISON.match(rule):
        low = float(match[2])
        ok = value >= low if match[1] == ">=" else value > low
    else:
        opening, low, high, closing = _INTERVAL.match(rule).groups()
        ok = ((value >= float(low)) if opening == "[" else (value > float(low))) and (
            (value <= float(high)) if closing == "]" else (value < float(high))
        )
    if not ok:
        raise ConfigError(f"{key}={value!r} is out of range: it must be {rule}")


def _typed(value, tp, key: str):
    """``value`` checked against a field's annotation (``X``, ``X | None``, ``list[X]``); an int is taken for a
    float. Returns the value."""
    options = typing.get_args(tp) if typing.get_origin(tp) in (typing.Union, types.UnionType) else (tp,)
    if value is None and type(None) in options:
        return None
    (tp,) = [t for t in options if t is not type(None)]
    if typing.get_origin(tp) is list:
        (item,) = typing.get_args(tp)
        if not isinstance(value, list) or not all(isinstance(v, item) for v in value):
            raise ConfigError(f"{key}={value!r} must be a list of {item.__name__}")
        return value
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if not isinstance(value, tp) or (tp is int and isinstance(value, bool)):
        raise ConfigError(f"{key}={value!r} must be of type {tp.__name__}, got {type(value).__name__}")
    return value


def build_dataclass(cls, data: dict, prefix: str = ""):
    """``cls`` from ``data``: unknown keys refused (with the closest allowed one), each value checked against its
    annotation, nested mappings built into their sections."""
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix.rstrip('.') or 'config'} must be a mapping, got {data!r}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in data.items():
        if key not in names:
            close = difflib.get_close_matches(key, names, n=1)
            hint = f"; did you mean {prefix + close[0]!r}?" if close else ""
            raise ConfigError(f"unknown config key {prefix + key!r}{hint} Allowed keys: {', '.join(names)}")
        tp = hints[key]
        if dataclasses.is_dataclass(tp):
            kwargs[key] = build_dataclass(tp, value, f"{prefix}{key}.")
        else:
            kwargs[key] = _typed(value, tp, f"{prefix}{key}")
    return cls(**kwargs)


class _YAMLLoader(yaml.SafeLoader):
    """PyYAML's safe loader with YAML 1.2's floats: YAML 1.1 reads ``1e-5`` (no dot) as a string."""


_YAMLLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float", re.compile(r"^[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+$"), list("-+0123456789.")
)


def _set_dotted(data: dict, dotted: str, value) -> None:
    *parents, leaf = dotted.split(".")
    node = data
    for part in parents:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"override {dotted!r}: {part!r} is not a section")
    node[leaf] = value


def read_config_file(path: str | Path) -> dict:
    """A config file's mapping (empty for an empty file), read with YAML 1.2's floats."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} does not exist")
    try:
        return yaml.load(path.read_text(), Loader=_YAMLLoader) or {}
    except yaml.YAMLError as err:  # one line: where the file stops being YAML
        raise ConfigError(f"config file {str(path)!r} is not valid YAML: {' '.join(str(err).split())}") from None


def apply_overrides(data: dict, overrides: list[str], aliases: dict[str, str]) -> None:
    """Set each ``key=value`` / ``section.key=value`` override into ``data`` (values parsed as YAML; a key may be
    one of ``aliases``)."""
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {item!r} must look like key=value (e.g. lora.merge=false)")
        key = aliases.get(key.strip(), key.strip())
        try:
            value = yaml.load(raw, Loader=_YAMLLoader)
        except yaml.YAMLError:  # e.g. "Q: {question}": not YAML, but a fine string
            value = raw
        _set_dotted(data, key, value)
