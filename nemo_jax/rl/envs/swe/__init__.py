"""`swe`: software engineering judged by hidden tests, in a sandbox per episode (nemo_jax.sandbox).

Each task is a repository, an issue, hidden tests and two lists of hidden test ids (SWE-bench's): fail-to-pass
(fail before the fix, pass after it) and pass-to-pass (pass before and after). The agent works in a sandbox
holding the repository (never the hidden tests) with three tools (nemo_jax.rl.code_tools): `run` (a shell
command), `python` (a stateful interpreter) and `apply_patch` (a unified diff), called in the chat template's
tool-call format. A turn without a tool call, or the last of `max_turns`, ends the episode, and the judge scores
it:

1. The agent's changes are read from its folder (regular files only: a link is never followed) and compared with
   the repository. No change: reward 0 (a no-op earns nothing). A change to a test file, a conftest, pytest or
   packaging configuration, a `.pth` / sitecustomize file or a test report (`PROTECTED`): reward 0, whatever else
   it did.
2. A FRESH sandbox gets a clean copy of the repository with only those changes, and the hidden test files laid
   over it, SEALED: every `assert EXPR == LITERAL` in a hidden test became `__nj_check__(site, EXPR)`, and the
   LITERALs stay on the host.
3. A small runner (nemo_jax.rl.swe_runner) reads its orders before any code under test is imported, calls each
   test function, and reports every test's outcome and every checked value. A test passes when it is reported
   exactly once, ok, and every value it checked equals its literal, compared on the host. Code under test can
   print or forge any report it likes (at import, at exit): it cannot know the literals, and a second or wrong
   report fails the test. So each hidden test must hold at least one such assert (checked when tasks load).
4. reward = the share of fail-to-pass tests that pass, counted only when every pass-to-pass test passes (else
   0); success = resolved (all of both). Past the judge's time limit nothing passes.

Built-in tasks (`tasks: builtin`): a module `calc.py` of `n_funcs` one-line functions (a count or a range [lo, hi]
within 1..3), the one named in the issue computing the wrong thing (family `op`: the wrong operator; `const`: the
wrong constant); the hidden tests check it on three inputs (fail-to-pass) and the other functions on two
(pass-to-pass; a lone function: the inputs where the wrong version happens to be right, often none). Your tasks (`tasks: PATH`): a folder per
task,

    PATH/<task id>/task.json        {"issue": str, "fail_to_pass": [ids], "pass_to_pass": [ids],
                                     "split": "train" | "eval" (default train), "family": str (optional),
                                     "packages": [distributions the tests import] (optional)}
    PATH/<task id>/repo/...          the repository at the base commit
    PATH/<task id>/hidden/...        hidden test files, laid over the repository at these paths by the judge
    PATH/<task id>/solution.patch    the reference fix (optional: `expert(task)` uses it)

with test ids `path/in/repo.py::test_function` (plain test functions, called with no arguments).
"""

from __future__ import annotations

import ast
import fnmatch
import json
import os
import secrets
import time

import numpy as np

from nemo_jax.fsutil import read_json
from nemo_jax.rl.code_tools import CodeEpisode, call
from nemo_jax.rl.episode import Observation, Task, demonstrate
from nemo_jax.sandbox import SandboxSpec, check, open_sandbox

PROTECTED = ("conftest.py", "pytest.ini", "pyproject.toml", "setup.cfg", "tox.ini", "noxfile.py", ".coveragerc",
             "setup.py", "sitecustomize.py", "usercustomize.py", "*.pth", "test_*.py", "*_test.py", "junit*.xml",
             "report*.xml", "report*.json", "*.junit.xml", ".pytest_cache", "__nj_check__*")
TEST_DIRS = ("tests", "test", "testing")
RUNNER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "swe_runner.py")


def protected(rel: str) -> bool:
    """A path whose change earns nothing: tests, conftest files, pytest and packaging configuration, import hooks,
    test reports."""
    parts = rel.split("/")
    return any(p in TEST_DIRS for p in parts[:-1]) or any(fnmatch.fnmatch(parts[-1], pat) for pat in PROTECTED)


# ----------------------------------------------------------------------------- sealing hidden tests
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


# ----------------------------------------------------------------------------- tasks
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


# ----------------------------------------------------------------------------- the episode
class SWEEpisode(CodeEpisode):
    def __init__(self, env: "SWEEnv"):
        super().__init__(env.spec, env.tools, env.max_calls)
        self.env = env

    def start(self, task: Task, rollout_id: str) -> Observation:
        self.task, self.rollout_id, self.turns = task, rollout_id, 0
        msgs = list(task.messages)
        if self.env.show_files:
            shown = [p for p in sorted(task.data["repo"]) if not protected(p)][:self.env.show_files]
            body = "".join(f"\n{p}:\n{task.data['repo'][p]}" for p in shown)
            msgs[-1] = dict(msgs[-1], content=msgs[-1]["content"] + "\n" + body.rstrip("\n"))
        return Observation(msgs, tools=self.defs)

    def initial_files(self) -> dict:
        return self.task.data["repo"]

    def step(self, message: dict) -> Observation:
        self.turns += 1
        calls = self.calls(message)
        out = self.run_calls(calls) if calls else []
        if calls and self.turns < self.env.max_turns:
            return Observation(out, 0.0, False, False, dict(self.stats))
        reward, success, info = self.judge()
        return Observation([], reward, True, success, dict(self.stats, **info))

    def judge(self) -> tuple[float, bool, dict]:
        """Score the agent's folder as it is now (module docstring)."""
        t0 = time.perf_counter()
        repo = self.task.data["repo"]
        if self.sb is None:
            return 0.0, False, {"changed_files": 0, "judge_s": 0.0}
        files = self.sb.files(max_file_bytes=self.env.max_file_kb * 1024)
        changed = {p: v for p, v in files.items() if repo.get(p) is None or v is None or
                   v.decode("utf-8", "replace") != repo[p]}
        deleted = [p for p in repo if p not in files]
        info = {"changed_files": len(changed) + len(deleted)}
        touched = [p for p in list(changed) + deleted if protected(p) or p in self.task.data["hidden"]]
        if touched or not info["changed_files"]:
            info.update(touched_protected=len(touched), judge_s=time.perf_counter() - t0)
            return 0.0, False, info
        oversize = [p for p, v in changed.items() if v is None]
        tree = {p: v.encode() for p, v in repo.items() if p not in deleted}
        tree.update({p: v for p, v in changed.items() if v is not None})
        passed = run_judge(self.env.judge_spec(self.task), tree, self.task, self.rollout_id)
        f2p = [passed[t] for t in self.task.data["f2p"]]
        p2p = [passed[t] for t in self.task.data["p2p"]]
        share = sum(f2p) / len(f2p)
        reward = share if all(p2p) else 0.0
        info.update(f2p_passed=sum(f2p), p2p_passed=sum(p2p), oversize_files=len(oversize),
                    judge_s=time.perf_counter() - t0)
        return reward, bool(all(f2p) and all(p2p)), info


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


class SWEEnv:
    """Tasks (`tasks`: builtin or a folder), a sandbox per episode (`sandbox`: nemo_jax.sandbox.SandboxSpec's
    fields), the judge in a fresh one (`judge_wall_s` per run of the hidden tests)."""
    name = "swe"

    def __init__(self, tasks: str = "builtin", n_train: int = 256, n_eval: int = 64, seed: int = 0,
                 families=("op", "const"), n_funcs=2, max_turns: int = 4, max_calls: int = 4,
                 sandbox: dict | None = None,
                 tools=("run", "python", "apply_patch"), show_files: int = 1, judge_wall_s: float = 30.0,
                 max_file_kb: int = 512, timeout_s: float = 0.0):
        unknown = set(tools) - {"run", "python", "apply_patch"}
        if unknown or not tools:
            raise ValueError(f"swe env: tools {sorted(unknown) or '[]'} (known: run, python, apply_patch)")
        if set(families) - {"op", "const"} or not families:
            raise ValueError(f"swe env: families {list(families)} (known: op, const)")
        lo, hi = (n_funcs, n_funcs) if isinstance(n_funcs, int) else tuple(n_funcs)
        if not 1 <= lo <= hi <= 3:
            raise ValueError(f"swe env: n_funcs a count or a range [lo, hi] within 1..3, got {n_funcs!r}")
        if max_turns < 1 or max_calls < 1 or judge_wall_s <= 0:
            raise ValueError("swe env: max_turns, max_calls and judge_wall_s must be positive")
        self.spec = SandboxSpec.from_dict(sandbox, "swe env: sandbox")
        self.backend = check(self.spec)  # one clear error now, not a failed episode later
        self.tools, self.max_turns, self.max_calls = tuple(tools), int(max_turns), int(max_calls)
        self.show_files, self.judge_wall_s = int(show_files), float(judge_wall_s)
        self.max_file_kb, self.timeout_s = int(max_file_kb), float(timeout_s)
        if tasks == "builtin":
            train = tiny_tasks("train", n_train, seed, tuple(families), (lo, hi))
            seen = {t.data["repo"]["calc.py"] + t.data["issue"] for t in train}
            self._split = {"train": train, "eval": tiny_tasks("eval", n_eval, seed, tuple(families), (lo, hi), seen)}
        else:
            self._split = load_folder_tasks(tasks)

    def tasks(self, split: str) -> list[Task]:
        return self._split[split] or self._split["train"]

    def episode(self) -> SWEEpisode:
        return SWEEpisode(self)

    def judge_spec(self, task: Task) -> SandboxSpec:
        return self.spec.with_limits(wall_s=self.judge_wall_s).with_packages(*task.data["packages"])

    # ------------------------------------------------------------------ demonstrations (SFT data)
    @staticmethod
    def expert(task: Task) -> list[str]:
        """The expert's turns: the reference patch, then a closing answer."""
        if not task.data.get("patch"):
            raise ValueError(f"swe task {task.id}: no reference patch (solution.patch) for the expert")
        return [call("apply_patch", patch=task.data["patch"]), "Fixed."]

    def demonstrations(self, split: str, n: int | None = None) -> list[dict]:
        """The expert's conversations on the first `n` tasks of `split`, run through real episodes (tool results
        included) -> SFT records {"messages", "tools"}; every one must score 1."""
        recs = []
        for task in self.tasks(split)[:n]:
            obs, msgs, tools = demonstrate(self, task, self.expert(task), f"demo-{task.id}")
            if not (obs.done and obs.success and obs.reward == 1.0):
                raise RuntimeError(f"swe env: the expert failed task {task.id} ({obs.info})")
            recs.append({"messages": msgs, "tools": tools})
        return recs


def main():
    import argparse

    ap = argparse.ArgumentParser(description="write the swe expert's demonstrations as SFT chat data (JSONL)")
    ap.add_argument("--out", required=True, help="a directory: train.jsonl and eval.jsonl go there")
    ap.add_argument("--n-train", type=int, default=1024)
    ap.add_argument("--n-eval", type=int, default=32)
    ap.add_argument("--seed", type=int, default=100)  # not the RL tasks' seed: other tasks
    ap.add_argument("--max-turns", type=int, default=2)
    a = ap.parse_args()
    env = SWEEnv(n_train=a.n_train, n_eval=a.n_eval, seed=a.seed, max_turns=a.max_turns)
    os.makedirs(a.out, exist_ok=True)
    for split in ("train", "eval"):
        with open(os.path.join(a.out, f"{split}.jsonl"), "w") as f:
            for r in env.demonstrations(split):
                f.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    main()
