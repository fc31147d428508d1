"""Merge recipes: YAML -> `Recipe` (validated; unknown keys are errors naming the key). Schema in
docs/merging.md."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from nemo_jax.config.load import parse_override
from nemo_jax.fsutil import read_yaml

KINDS = ("take", "linear", "task_arithmetic", "add_adapters", "ties", "dare", "slerp")
WHOLE_TENSOR = ("ties", "slerp")  # need a whole tensor at once (a global threshold / norm); others go by rows
TOP_KEYS = ("output", "models", "adapters", "base", "seed", "max_shard_size", "rules", "overwrite", "allow_nonfinite")


class RecipeError(ValueError):
    """A recipe that cannot be run (nothing is written)."""


@dataclass(frozen=True)
class Rule:
    index: int
    match: str
    kind: str
    weights: dict[str, float] = field(default_factory=dict)  # model (or adapter) name -> weight
    model: str = ""  # take
    density: float = 1.0  # ties, dare
    seed: int = 0  # dare
    a: str = ""  # slerp
    b: str = ""
    t: float = 0.5

    @property
    def where(self) -> str:
        return f"rules[{self.index}] (match {self.match!r})"

    def inputs(self, base: str) -> list[str]:
        """The models this rule reads (the base is read by every rule, as the reference for the report)."""
        if self.kind == "take":
            names = [self.model]
        elif self.kind == "slerp":
            names = [self.a, self.b]
        elif self.kind == "add_adapters":
            names = []
        else:
            names = list(self.weights)
        return list(dict.fromkeys([base] + names))


@dataclass(frozen=True)
class Recipe:
    output: str
    models: dict[str, str]
    rules: tuple[Rule, ...]
    adapters: dict[str, str] = field(default_factory=dict)
    base: str = ""
    seed: int = 0
    max_shard_size: str = "5GB"
    overwrite: bool = False  # replace an existing `output` (only an earlier HF checkpoint written by nemo-jax)
    allow_nonfinite: bool = False  # write NaN / Inf tensors instead of stopping at the first one


def _weights(v, where: str, names: dict, what: str) -> dict[str, float]:
    if not isinstance(v, dict) or not v:
        raise RecipeError(f"{where}: expected a non-empty mapping of {what} name -> weight, got {v!r}")
    out = {}
    for k, w in v.items():
        if k not in names:
            raise RecipeError(f"{where}: unknown {what} {k!r} (known: {', '.join(names) or 'none'})")
        if isinstance(w, bool) or not isinstance(w, (int, float)):
            raise RecipeError(f"{where}: weight of {k!r} must be a number, got {w!r}")
        out[k] = float(w)
    return out


def _keys(d: dict, allowed: tuple, where: str):
    for k in d:
        if k not in allowed:
            raise RecipeError(f"{where}: unknown key {k!r} (known: {', '.join(allowed)})")


def _number(d: dict, key: str, where: str, default, lo=None, hi=None):
    v = d.get(key, default)
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise RecipeError(f"{where}.{key}: expected a number, got {v!r}")
    if (lo is not None and v <= lo) or (hi is not None and v > hi):
        raise RecipeError(f"{where}.{key}: {v} is outside ({lo}, {hi}]")
    return v


def _model(v, where: str, models: dict) -> str:
    if v not in models:
        raise RecipeError(f"{where}: unknown model {v!r} (known: {', '.join(models)})")
    return v


def parse_rule(i: int, d, models: dict, adapters: dict, seed: int) -> Rule:
    where = f"rules[{i}]"
    if not isinstance(d, dict):
        raise RecipeError(f"{where}: expected a mapping with 'match' and one of {', '.join(KINDS)}")
    _keys(d, ("match",) + KINDS, where)
    kinds = [k for k in KINDS if k in d]
    if len(kinds) != 1:
        raise RecipeError(f"{where}: needs exactly one of {', '.join(KINDS)} (has {kinds or 'none'})")
    match = d.get("match")
    if not isinstance(match, str):
        raise RecipeError(f"{where}: 'match' must be a regex string, got {match!r}")
    try:
        re.compile(match)
    except re.error as e:
        raise RecipeError(f"{where}: match {match!r} is not a valid regex ({e})") from None
    kind, v = kinds[0], d[kinds[0]]
    w = f"{where}.{kind}"
    if kind == "take":
        return Rule(i, match, kind, model=_model(v, w, models))
    if kind in ("linear", "task_arithmetic"):
        return Rule(i, match, kind, weights=_weights(v, w, models, "model"))
    if kind == "add_adapters":
        return Rule(i, match, kind, weights=_weights(v, w, adapters, "adapter"))
    if not isinstance(v, dict):
        raise RecipeError(f"{w}: expected a mapping, got {v!r}")
    if kind in ("ties", "dare"):
        _keys(v, ("models", "density", "seed") if kind == "dare" else ("models", "density"), w)
        seed_ = v.get("seed", seed)
        if kind == "dare" and (isinstance(seed_, bool) or not isinstance(seed_, int)):
            raise RecipeError(f"{w}.seed: expected an integer, got {seed_!r}")
        return Rule(i, match, kind, weights=_weights(v.get("models"), f"{w}.models", models, "model"),
                    density=float(_number(v, "density", w, None if "density" not in v else 1.0, 0, 1)),
                    seed=int(seed_) if kind == "dare" else 0)
    _keys(v, ("a", "b", "t"), w)
    return Rule(i, match, kind, a=_model(v.get("a"), f"{w}.a", models), b=_model(v.get("b"), f"{w}.b", models),
                t=float(_number(v, "t", w, 0.5)))


def _names(v, where: str, required: bool) -> dict[str, str]:
    if v is None and not required:
        return {}
    if not isinstance(v, dict) or (required and not v) or not all(isinstance(p, str) for p in v.values()):
        raise RecipeError(f"{where}: expected a mapping of name -> path, got {v!r}")
    return {str(k): p for k, p in v.items()}


def parse_recipe(d: dict, where: str = "recipe") -> Recipe:
    if not isinstance(d, dict):
        raise RecipeError(f"{where}: top level must be a mapping")
    _keys(d, TOP_KEYS, where)
    for k in ("output", "models", "rules"):
        if k not in d:
            raise RecipeError(f"{where}: missing key {k!r}")
    if not isinstance(d["output"], str) or not d["output"]:
        raise RecipeError(f"{where}: output must be a path, got {d['output']!r}")
    models = _names(d["models"], f"{where}: models", True)
    adapters = _names(d.get("adapters"), f"{where}: adapters", False)
    base = d.get("base") or ("base" if "base" in models else next(iter(models)))
    _model(base, f"{where}: base", models)
    seed = d.get("seed", 0)
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise RecipeError(f"{where}: seed must be an integer, got {seed!r}")
    rules = d["rules"]
    if not isinstance(rules, list) or not rules:
        raise RecipeError(f"{where}: rules must be a non-empty list")
    try:
        parsed = tuple(parse_rule(i, r, models, adapters, seed) for i, r in enumerate(rules))
    except RecipeError as e:
        raise RecipeError(f"{where}: {e}") from None
    flags = {}
    for k in ("overwrite", "allow_nonfinite"):
        flags[k] = d.get(k, False)
        if not isinstance(flags[k], bool):
            raise RecipeError(f"{where}: {k} must be true or false, got {flags[k]!r}")
    return Recipe(output=d["output"], models=models, rules=parsed, adapters=adapters, base=base, seed=seed,
                  max_shard_size=str(d.get("max_shard_size", "5GB")), **flags)


def _set(node, keys: list[str], value, o: str):
    for k in keys[:-1]:
        node = node[int(k)] if isinstance(node, list) else node.setdefault(k, {})
        if not isinstance(node, (dict, list)):
            raise RecipeError(f"override {o!r}: {k!r} is not a section")
    if isinstance(node, list):
        node[int(keys[-1])] = value
    else:
        node[keys[-1]] = value


def load_recipe(path: str, overrides=()) -> Recipe:
    """YAML file + `key=value` overrides (dotted keys; list items by index, e.g. rules.1.linear.sft=0.3)."""
    d = read_yaml(path, "no such recipe file", error=RecipeError, missing_error=RecipeError) or {}
    for o in overrides:
        try:
            keys, val = parse_override(o)
            _set(d, keys, val, o)
        except (ValueError, IndexError, KeyError) as e:
            raise RecipeError(f"override {o!r}: {e}") from None
    return parse_recipe(d, path)
