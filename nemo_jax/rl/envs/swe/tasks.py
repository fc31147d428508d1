"""swe task sources: folder tasks (`load_folder_tasks`: repo/, hidden/, task.json, solution.patch) and the built-in
tiny generator (`tiny_tasks`: a module of one-line functions, one of them wrong)."""

from __future__ import annotations

import os

import numpy as np

from nemo_jax.fsutil import read_json
from nemo_jax.rl.envs.episode import Task
from nemo_jax.rl.envs.swe.judge import seal


def _read_tree(root: str) -> dict:
    out = {}
    for top, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in ("__pycache__", ".git"))
        for f in sorted(files):
            p = os.path.join(top, f)
            if os.path.islink(p):
                continue
            with open(p, "rb") as fh:
                out[os.path.relpath(p, root).replace(os.sep, "/")] = fh.read().decode("utf-8", "replace")
    return out


def make_task(tid: str, issue: str, repo: dict, hidden: dict, f2p: list, p2p: list, *, family: str = "swe",
              patch: str | None = None, packages=(), where: str = "") -> Task:
    """A task from its parts (hidden tests sealed here; a test id naming no hidden test function, or a hidden test
    with no `assert EXPR == LITERAL`, is an error naming it)."""
    where = where or f"swe task {tid}"
    sealed, sites = {}, {}
    for path, src in hidden.items():
        try:
            sealed[path], s = seal(src, path)
        except SyntaxError as e:
            raise ValueError(f"{where}: hidden test {path}: {e.msg} (line {e.lineno})") from None
        sites.update(s)
    if not f2p:
        raise ValueError(f"{where}: fail_to_pass lists no test")
    checked = {test for test, _ in sites.values()}
    for t in list(f2p) + list(p2p):
        path, _, name = t.partition("::")
        if path not in hidden or not name:
            raise ValueError(f"{where}: test {t!r} is not in a hidden test file (hidden: {', '.join(sorted(hidden))})")
        if t not in checked:
            raise ValueError(f"{where}: hidden test {t!r} has no `assert EXPR == LITERAL` (the judge checks those "
                             "on the host, out of the code's reach)")
    user = (f"Fix this issue in the repository (your working folder).\nIssue: {issue}")
    return Task(tid, ({"role": "user", "content": user},),
                {"repo": repo, "issue": issue, "hidden": sealed, "sites": sites, "f2p": list(f2p), "p2p": list(p2p),
                 "patch": patch, "packages": list(packages)}, family)


def load_folder_tasks(root: str) -> dict[str, list[Task]]:
    """A folder of task folders (module docstring) -> {"train": [...], "eval": [...]}."""
    if not os.path.isdir(root):
        raise ValueError(f"swe tasks: {root} is not a folder of task folders")
    out = {"train": [], "eval": []}
    for tid in sorted(os.listdir(root)):
        d = os.path.join(root, tid)
        if not os.path.isdir(d):
            continue
        meta = os.path.join(d, "task.json")
        m = read_json(meta, "missing (every task folder needs task.json)", missing_error=ValueError)
        for k, kind in (("issue", str), ("fail_to_pass", list), ("pass_to_pass", list)):
            if not isinstance(m.get(k), kind):
                raise ValueError(f"{meta}: field {k!r} must be a {kind.__name__}")
        split = m.get("split", "train")
        if split not in out:
            raise ValueError(f"{meta}: split {split!r} (expected train or eval)")
        for sub in ("repo", "hidden"):
            if not os.path.isdir(os.path.join(d, sub)):
                raise ValueError(f"{d}: no {sub}/ folder")
        patch = None
        if os.path.exists(os.path.join(d, "solution.patch")):
            with open(os.path.join(d, "solution.patch")) as f:
                patch = f.read()
        out[split].append(make_task(tid, m["issue"], _read_tree(os.path.join(d, "repo")),
                                    _read_tree(os.path.join(d, "hidden")), m["fail_to_pass"], m["pass_to_pass"],
                                    family=str(m.get("family", "swe")), patch=patch,
                                    packages=m.get("packages") or (), where=meta))
    if not out["train"] and not out["eval"]:
        raise ValueError(f"swe tasks: no task folders in {root}")
    return out


FUNCS = ("scale", "shift", "grow", "trim", "boost", "shrink", "bump", "warp", "tune", "step", "lift", "drop",
         "fold", "spin", "push", "pull")


OPS = {"+": ("add {c} to x", "adds {c}"), "-": ("subtract {c} from x", "subtracts {c}"),
       "*": ("multiply x by {c}", "multiplies by {c}")}


INPUTS = (0, 1, 2, 3, 4, 5, 7, 10)


def _apply(op: str, x: int, c: int) -> int:
    return x + c if op == "+" else x - c if op == "-" else x * c


def _module(funcs: list) -> str:
    return "\n\n\n".join(f"def {f}(x):\n    return x {op} {c}" for f, op, c in funcs) + "\n"


def tiny_task(tid: str, rng, families=("op", "const"), n_funcs=(2, 2)) -> Task:
    """One built-in task (module docstring): `n_funcs` functions (a count drawn from [lo, hi]), one of them wrong."""
    family = str(families[int(rng.integers(len(families)))])
    lo, hi = n_funcs
    n = lo if lo == hi else int(rng.integers(lo, hi + 1))
    names = [str(x) for x in rng.choice(FUNCS, n, replace=False)]
    ops = list(OPS)
    good = [(f, ops[int(rng.integers(3))], int(rng.integers(2, 10))) for f in names]
    k = int(rng.integers(n))
    name, op, c = good[k]
    if family == "op":
        bad = (name, str(rng.choice([o for o in ops if o != op])), c)
    else:
        bad = (name, op, int(rng.choice([v for v in range(2, 10) if v != c])))
    buggy = [bad if i == k else g for i, g in enumerate(good)]
    src = _module(buggy)
    differ = [x for x in INPUTS if _apply(bad[1], x, bad[2]) != _apply(op, x, c)]
    picks = sorted(int(x) for x in rng.choice(differ, 3, replace=False))
    tests, f2p, p2p = [f"from calc import {', '.join(names)}\n"], [], []
    for i, x in enumerate(picks):
        tests.append(f"def test_{name}_{i}():\n    assert {name}({x}) == {_apply(op, x, c)}\n")
        f2p.append(f"tests/test_calc.py::test_{name}_{i}")
    others = [g for i, g in enumerate(good) if i != k]
    if others:  # pass-to-pass: the other functions
        checks = [(g, int(x)) for g in others for x in rng.choice(INPUTS, 2 if len(others) == 1 else 1, replace=False)]
    else:  # a lone function: the inputs where the wrong one happens to be right (often none)
        checks = [(good[k], x) for x in INPUTS if x not in differ][:2]
    for i, ((f, o, v), x) in enumerate(checks):
        tests.append(f"def test_{f}_same_{i}():\n    assert {f}({x}) == {_apply(o, x, v)}\n")
        p2p.append(f"tests/test_calc.py::test_{f}_same_{i}")
    line = 2 + 4 * k
    patch = (f"--- a/calc.py\n+++ b/calc.py\n@@ -{line} +{line} @@\n-    return x {bad[1]} {bad[2]}\n"
             f"+    return x {op} {c}\n")
    issue = f"{name}(x) should {OPS[op][0].format(c=c)}, but it {OPS[bad[1]][1].format(c=bad[2])}."
    repo = {"calc.py": src}
    if others:  # the repository's own (visible) test
        f, o, v = others[0]
        repo["tests/test_calc.py"] = f"from calc import {f}\n\n\ndef test_{f}():\n    assert {f}(1) == {_apply(o, 1, v)}\n"
    task = make_task(tid, issue, repo, {"tests/test_calc.py": "\n\n".join(tests)}, f2p, p2p, family=f"swe-{family}",
                     patch=patch)
    task.data["fixed"] = _module(good)
    return task


def tiny_tasks(split: str, n: int, seed: int, families=("op", "const"), n_funcs=(2, 2),
               avoid=frozenset()) -> list[Task]:
    rng = np.random.default_rng([seed, 0 if split == "train" else 1])
    out, seen = [], set(avoid)
    for _ in range(100 * n + 1000):
        if len(out) == n:
            return out
        t = tiny_task(f"{split}-{len(out)}", rng, families, n_funcs)
        key = t.data["repo"]["calc.py"] + t.data["issue"]
        if key not in seen:
            seen.add(key)
            out.append(t)
    raise ValueError(f"swe env: only {len(out)} distinct {split} tasks of families {list(families)} and n_funcs "
                     f"{list(n_funcs)} (asked for {n})")
