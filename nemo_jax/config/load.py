"""YAML file + dotted `key=value` overrides -> nested dataclasses. Unknown keys and wrong types are errors
that name the key."""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from typing import Any

import yaml

from nemo_jax.fsutil import read_yaml


def _type_ok(value, tp) -> tuple[bool, Any]:
    origin = typing.get_origin(tp)
    if tp is Any:
        return True, value
    if origin in (typing.Union, types.UnionType):
        for t in typing.get_args(tp):
            ok, v = _type_ok(value, t)
            if ok:
                return True, v
        return False, value
    if tp is type(None):
        return value is None, value
    if tp is bool:
        return isinstance(value, bool), value
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool), value
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return True, float(value)
        if isinstance(value, str):  # YAML 1.1 reads 1e-4 (no dot) as a string
            try:
                return True, float(value)
            except ValueError:
                return False, value
        return False, value
    if tp is str:
        return isinstance(value, str), value
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            return False, value
        args = typing.get_args(tp)
        inner = args[0] if args else Any
        out = []
        for x in value:
            ok, v = _type_ok(x, inner)
            if not ok:
                return False, value
            out.append(v)
        return True, tuple(out) if origin is tuple else out
    if origin is dict or tp is dict:
        return isinstance(value, dict), value
    return True, value


def from_dict(cls, data: dict, where: str = ""):
    if not isinstance(data, dict):
        raise ValueError(f"{where or cls.__name__}: expected a mapping, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kw = {}
    for k, v in data.items():
        key = f"{where}.{k}" if where else k
        if k not in fields:
            near = difflib.get_close_matches(str(k), fields, n=1, cutoff=0.6)
            hint = f"did you mean {(f'{where}.' if where else '') + near[0]!r}? " if near else ""
            raise ValueError(f"unknown config key {key!r} ({hint}known: {', '.join(sorted(fields))})")
        tp = hints[k]
        if dataclasses.is_dataclass(tp):
            kw[k] = from_dict(tp, v or {}, key)
            continue
        ok, val = _type_ok(v, tp)
        if not ok:
            raise ValueError(f"config key {key!r}: expected {_tname(tp)}, got {v!r}")
        kw[k] = val
    try:
        return cls(**kw)
    except TypeError as e:
        raise ValueError(f"{where or cls.__name__}: {e}") from None



def _tname(tp) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def to_dict(obj) -> dict:
    return dataclasses.asdict(obj)


def parse_override(s: str) -> tuple[list[str], Any]:
    if "=" not in s:
        raise ValueError(f"override {s!r}: expected key=value")
    k, v = s.split("=", 1)
    return k.strip().split("."), yaml.safe_load(v) if v != "" else ""


def load_config(cls, path: str | None, overrides: list[str] = (), defaults: dict | None = None):
    data: dict = dict(defaults or {})
    if path:
        data = _merge(data, read_yaml(path, "no such config file", mapping=True))
    for o in overrides:
        keys, val = parse_override(o)
        node = data
        for k in keys[:-1]:
            node = node.setdefault(k, {})
            if not isinstance(node, dict):
                raise ValueError(f"override {o!r}: {k!r} is not a section")
        node[keys[-1]] = val
    try:
        return from_dict(cls, data)
    except ValueError as e:
        raise ValueError(f"{path or 'config'}: {e}") from None


def _merge(a: dict, b: dict) -> dict:
    out = dict(a)
    for k, v in b.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def dump_yaml(obj) -> str:
    return yaml.safe_dump(to_dict(obj), sort_keys=False)
