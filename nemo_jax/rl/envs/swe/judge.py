"""The swe judge: which changes earn nothing (`protected`), hidden tests sealed (`seal`: their literals stay on the
host), run by `runner.py` in a fresh sandbox (`run_judge`), and the host's verdict on what it reports (`verdict`).
The package's docstring tells the whole procedure."""

from __future__ import annotations

import ast
import fnmatch
import json
import os
import secrets

from nemo_jax.rl.envs.episode import Task
from nemo_jax.sandbox import SandboxSpec, open_sandbox


PROTECTED = ("conftest.py", "pytest.ini", "pyproject.toml", "setup.cfg", "tox.ini", "noxfile.py", ".coveragerc",
             "setup.py", "sitecustomize.py", "usercustomize.py", "*.pth", "test_*.py", "*_test.py", "junit*.xml",
             "report*.xml", "report*.json", "*.junit.xml", ".pytest_cache", "__nj_check__*")


TEST_DIRS = ("tests", "test", "testing")


RUNNER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "runner.py")  # run in the judge's sandbox


def protected(rel: str) -> bool:
    """A path whose change earns nothing: tests, conftest files, pytest and packaging configuration, import hooks,
    test reports."""
    parts = rel.split("/")
    return any(p in TEST_DIRS for p in parts[:-1]) or any(fnmatch.fnmatch(parts[-1], pat) for pat in PROTECTED)


def _literal(node):
    try:
        return True, ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return False, None


def seal(source: str, path: str) -> tuple[str, dict]:
    """A hidden test file -> (its source with every `assert EXPR == LITERAL` (either side literal) inside a
    module-level test function replaced by `__nj_check__(site, EXPR)`, {site: (test id, LITERAL)})."""
    tree = ast.parse(source, path)
    sites: dict = {}

    class Seal(ast.NodeTransformer):
        def __init__(self, test):
            self.test, self.k = test, 0

        def visit_Assert(self, node):
            t = node.test
            if isinstance(t, ast.Compare) and len(t.ops) == 1 and isinstance(t.ops[0], ast.Eq):
                for expr, lit in ((t.left, t.comparators[0]), (t.comparators[0], t.left)):
                    ok, value = _literal(lit)
                    if ok and not _literal(expr)[0]:
                        site = f"{self.test}#{self.k}"
                        self.k += 1
                        sites[site] = (self.test, value)
                        new = ast.Expr(ast.Call(ast.Name("__nj_check__", ast.Load()), [ast.Constant(site), expr], []))
                        return ast.copy_location(new, node)
            return node

    for fn in tree.body:
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) and fn.name.startswith("test"):
            Seal(f"{path}::{fn.name}").visit(fn)
    return ast.unparse(ast.fix_missing_locations(tree)) + "\n", sites


def verdict(stdout: bytes, nonce: str, tests: list[str], sites: dict) -> dict[str, bool]:
    """The runner's report -> {test id: passed}: reported exactly once and ok, and every site of the test checked
    at least once with every value equal to the literal the host kept."""
    reports: dict = {}
    seen: dict = {}
    tag = nonce + " "
    for line in stdout.decode("utf-8", "replace").splitlines():
        if not line.startswith(tag):
            continue
        try:
            rec = json.loads(line[len(tag):])
        except ValueError:
            continue
        if not isinstance(rec, dict):
            continue
        if "test" in rec:
            reports.setdefault(rec["test"], []).append(rec.get("ok") is True)
        elif "site" in rec and isinstance(rec.get("repr"), str):
            seen.setdefault(rec["site"], []).append(rec["repr"])
    out = {}
    for t in tests:
        ok = reports.get(t) == [True]
        for site, (test, want) in sites.items():
            if test == t:
                got = seen.get(site, [])
                ok = ok and bool(got) and all(_equal(r, want) for r in got)
        out[t] = ok
    return out


def _equal(text: str, want) -> bool:
    """A reported repr against the kept literal: equal as Python compares them (1 == 1.0), but a bool is not a
    number here; a repr that is no literal must equal the literal's repr."""
    ok, value = _literal_text(text)
    if not ok:
        return text == repr(want)
    numbers = (int, float, complex)
    same_kind = type(value) is type(want) or (isinstance(value, numbers) and isinstance(want, numbers)
                                              and not isinstance(value, bool) and not isinstance(want, bool))
    try:
        return same_kind and bool(value == want)
    except Exception:  # a comparison that raises is no match
        return False


def _literal_text(text: str):
    try:
        return True, ast.literal_eval(text)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return False, None


def run_judge(spec: SandboxSpec, tree: dict, task: Task, name: str = "") -> dict[str, bool]:
    """The hidden tests of `task` on the files `tree` ({path: bytes}) in a fresh sandbox -> {test id: passed}."""
    tests = task.data["f2p"] + task.data["p2p"]
    nonce = secrets.token_hex(16)
    with open(RUNNER, encoding="utf-8") as f:
        runner = f.read()
    with open_sandbox(spec, f"judge-{name}") as sb:
        for p, data in tree.items():
            sb.put(p, data)
        for p, src in task.data["hidden"].items():
            sb.put(p, src)
        r = sb.run(["python", "-I", "-B", "-c", runner], stdin=json.dumps({"nonce": nonce, "tests": tests}) + "\n")
    return verdict(r.stdout, nonce, tests, task.data["sites"])
