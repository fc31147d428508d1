"""`swe`: software engineering judged by hidden tests, in a sandbox per episode (nemo_jax.sandbox).

Each task is a repository, an issue, hidden tests and two lists of hidden test ids (SWE-bench's): fail-to-pass
(fail before the fix, pass after it) and pass-to-pass (pass before and after). The agent works in a sandbox
holding the repository (never the hidden tests) with three tools (nemo_jax.rl.envs.code_tools): `run` (a shell
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
3. A small runner (nemo_jax.rl.envs.swe.runner) reads its orders before any code under test is imported, calls each
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

import time

from nemo_jax.rl.envs.code_tools import CodeEpisode, call
from nemo_jax.rl.envs.episode import Observation, Task, demonstrations
from nemo_jax.rl.envs.swe.judge import PROTECTED, protected, run_judge, seal, verdict  # noqa: F401
from nemo_jax.rl.envs.swe.tasks import load_folder_tasks, make_task, tiny_task, tiny_tasks  # noqa: F401
from nemo_jax.sandbox import SandboxSpec, check


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
        included) -> SFT records {"messages", "tools"}; every one must succeed."""
        return demonstrations(self, split, n)


if __name__ == "__main__":  # (the demonstrations as SFT data: `nemo-jax demos --env swe`)
    from nemo_jax.rl.envs.demos import main

    main(env="swe")
