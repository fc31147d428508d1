"""The base install runs every shipped config, and each extra installs whole.

Fast (this module, the default suite): from pyproject.toml and the installed packages' metadata, every import in
nemo_jax of a package outside the core dependencies (their whole dependency closure) must go through
`nemo_jax.extras.require` naming an extra that brings it, or sit in a `try` that catches ImportError; every
`require` names a real extra; `EXTRA_MODULES` lists every extra. This is what `pip install -c constraints.txt .`
lacking Pillow broke (the VL configs died on `from PIL import Image` after minutes of work).

The venv tier (tests/test_venvs.py, `-m venv`, tools/tiers/test_venvs.sh) checks the same in real venvs.
"""

import ast
import functools
import importlib.metadata as md
import os
import sys

import pytest

from nemo_jax.extras import EXTRA_MODULES
from venvs import ROOT, core_requirements, extra_requirements, pyproject

packaging = pytest.importorskip("packaging.requirements")


@functools.cache
def _closure(reqs: tuple[str, ...]) -> set[str]:
    """Requirement strings -> the canonical names of every distribution they bring (their installed metadata
    followed; a requirement not installed here counts by its own name)."""
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    seen: set[str] = set()
    todo = [(Requirement(r), "") for r in reqs]
    while todo:
        r, via_extra = todo.pop()
        if r.marker is not None and not r.marker.evaluate({"extra": via_extra}):
            continue
        name = canonicalize_name(r.name)
        key = f"{name}[{','.join(sorted(r.extras))}]"
        if key in seen:
            continue
        seen.add(key)
        try:
            dist = md.distribution(r.name)
        except md.PackageNotFoundError:
            continue
        for sub in dist.requires or []:
            s = Requirement(sub)
            for e in ("", *r.extras):
                if s.marker is None or s.marker.evaluate({"extra": e}):
                    todo.append((s, e))
                    break
    return {k.partition("[")[0] for k in seen}


@functools.cache
def _installed() -> dict:
    return md.packages_distributions()


def _dists(top: str) -> set[str]:
    from packaging.utils import canonicalize_name

    return {canonicalize_name(d) for d in _installed().get(top, [])}


def _catches_import_error(handler: ast.ExceptHandler) -> bool:
    names = [handler.type] if not isinstance(handler.type, ast.Tuple) else list(handler.type.elts)
    return handler.type is None or any(isinstance(n, ast.Name) and n.id in ("ImportError", "ModuleNotFoundError")
                                 for n in names)


def _imports(tree):
    """-> (import node, its top-level module, [enclosing nodes])."""
    def walk(node, stack):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Import):
                for a in child.names:
                    yield child, a.name.split(".")[0], stack
            elif isinstance(child, ast.ImportFrom) and not child.level and child.module:
                yield child, child.module.split(".")[0], stack
            yield from walk(child, stack + [child])
    yield from walk(tree, [tree])


def _required(func) -> list[tuple[str, str]]:
    """(module, extra) of every `require(MODULE, EXTRA, ...)` call in a function."""
    out = []
    for n in ast.walk(func):
        if isinstance(n, ast.Call) and getattr(n.func, "id", getattr(n.func, "attr", None)) == "require" \
                and len(n.args) >= 2 and all(isinstance(a, ast.Constant) for a in n.args[:2]):
            out.append((n.args[0].value, n.args[1].value))
    return out


def _sources():
    for top, _, files in os.walk(os.path.join(ROOT, "nemo_jax")):
        for f in sorted(files):
            if f.endswith(".py"):
                path = os.path.join(top, f)
                with open(path) as fh:
                    yield os.path.relpath(path, ROOT), ast.parse(fh.read(), path)


def test_every_import_outside_the_core_dependencies_belongs_to_an_extra_module_or_an_import_error_handler():
    """An import of a package no core dependency brings is allowed only in a module of an extra that brings it
    (listed in EXTRA_MODULES, or calling `require(..., EXTRA, ...)`: it says what to install), or inside a
    `try` that catches ImportError."""
    extras = pyproject()["project"]["optional-dependencies"]
    core = _closure(tuple(core_requirements()))
    closures = {e: _closure(tuple(extra_requirements(e))) for e in extras if e != "test"}
    bad = []
    for rel, tree in _sources():
        module = rel[:-3].replace(os.sep, ".").removesuffix(".__init__")
        own = {e for e, mods in EXTRA_MODULES.items() if module in mods}
        own |= {extra for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
                for _, extra in _required(n)}
        for node, top, stack in _imports(tree):
            if top in sys.stdlib_module_names or top in ("nemo_jax", "__future__"):
                continue
            dists = _dists(top)
            if dists & core or any(dists & closures[e] for e in own if e in closures):
                continue
            if any(isinstance(s, ast.Try) and any(_catches_import_error(h) for h in s.handlers)
                   and (stack + [node])[i + 1] in s.body for i, s in enumerate(stack)):
                continue
            bad.append(f"{rel}:{node.lineno}: import of {top!r} ({', '.join(sorted(dists)) or 'not installed'}), "
                       "which no core dependency brings, outside an extra's module (EXTRA_MODULES, require()) and "
                       "outside a try/except ImportError")
    assert not bad, "\n".join(bad)


def test_require_names_real_extras_that_bring_the_module_and_every_extra_promises_its_modules():
    extras = {e for e in pyproject()["project"]["optional-dependencies"] if e != "test"}
    assert set(EXTRA_MODULES) == extras, "nemo_jax.extras.EXTRA_MODULES must list exactly pyproject's extras"
    core = _closure(tuple(core_requirements()))
    bad = []
    for rel, tree in _sources():
        for n in ast.walk(tree):
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for mod, extra in _required(n):
                    if extra not in extras:
                        bad.append(f"{rel}:{n.lineno}: require({mod!r}, {extra!r}): no such extra in pyproject.toml")
                    elif _dists(mod.split(".")[0]) and not _dists(mod.split(".")[0]) & (
                            _closure(tuple(extra_requirements(extra))) | core):
                        bad.append(f"{rel}:{n.lineno}: require({mod!r}, {extra!r}): that extra does not bring it")
    for extra, mods in EXTRA_MODULES.items():
        brings = _closure(tuple(extra_requirements(extra))) | core
        for mod in mods:
            top = mod.split(".")[0]
            if top != "nemo_jax" and _dists(top) and not _dists(top) & brings:
                bad.append(f"EXTRA_MODULES[{extra!r}]: {mod} ({', '.join(_dists(top))}) is not in that extra")
    assert not bad, "\n".join(bad)


def test_the_worker_extra_brings_httpx_which_the_worker_imports():
    assert "httpx" in _closure(tuple(extra_requirements("worker")))
