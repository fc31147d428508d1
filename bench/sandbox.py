"""Sandboxed-code environments' throughput: start-up cost per episode of each sandbox backend, episodes/s of the
`swe` and `chart` environments with the expert's actions (one worker, and `--workers` in parallel as the RL
driver runs them: `rollout.env_workers` threads), and the sandbox's share of an RL step (from a GRPO run's
metrics: `env_s` / step time).

    python bench/sandbox.py [--episodes 16 --workers 4 --rounds 3 --backends bwrap,rlimit --runs runs/swe-s0 ...]

Start-up: open a sandbox, run `true`, close it (median of `--startups` per backend, interleaved), next to the same
`true` run as a plain host process. Docker / kubernetes rows are printed only where their CLI reaches an engine.
Episodes: the first `--episodes` held-out tasks of the tiny configs' environments, each the whole episode (start,
the expert's turns with their tools, the judge for swe, close).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from nemo_jax.rl.envs import make_env  # noqa: E402
from nemo_jax.sandbox import SandboxError, SandboxSpec, open_sandbox  # noqa: E402


def startup(backend: str) -> float:
    t0 = time.perf_counter()
    with open_sandbox(SandboxSpec(backend=backend), "bench") as sb:
        r = sb.run(["true"])
    assert r.ok, r.text()
    return time.perf_counter() - t0


def plain() -> float:
    t0 = time.perf_counter()
    subprocess.run(["true"], check=True)
    return time.perf_counter() - t0


def episode(env, task) -> float:
    t0 = time.perf_counter()
    ep = env.episode()
    try:
        ep.start(task, "bench")
        for turn in env.expert(task):
            obs = ep.step({"role": "assistant", "content": turn})
            if obs.done:
                break
    finally:
        ep.close()
    assert obs.reward == 1.0, (task.id, obs.info)
    return time.perf_counter() - t0


def episodes_per_s(env, tasks, workers: int) -> float:
    t0 = time.perf_counter()
    with ThreadPoolExecutor(workers) as pool:
        list(pool.map(lambda t: episode(env, t), tasks))
    return len(tasks) / (time.perf_counter() - t0)


def engine_reachable(backend: str) -> bool:
    try:
        with open_sandbox(SandboxSpec(backend=backend, start_timeout_s=60), "probe"):
            return True
    except SandboxError:
        return False


def run_share(run: str) -> str:
    """A GRPO run's sandbox share: mean env_s and step time (learner_s + wait_s) over its steps."""
    recs = [json.loads(line) for line in open(os.path.join(run, "metrics.jsonl"))]
    recs = [r for r in recs if "env_s" in r and "learner_s" in r]
    if not recs:
        return f"{run}: no env_s in its metrics"
    env_s = statistics.mean(r["env_s"] for r in recs)
    step = statistics.mean(r["learner_s"] + r["wait_s"] for r in recs)
    frac = statistics.mean(r["env_frac"] for r in recs)
    return (f"{run}: {len(recs)} steps, environment calls {env_s:.2f} s per step (summed over the worker threads) "
            f"of a {step:.2f} s step: env_frac {frac:.3f}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--episodes", type=int, default=16)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--startups", type=int, default=10)
    ap.add_argument("--backends", default="bwrap,rlimit")
    ap.add_argument("--runs", nargs="*", default=[], help="GRPO run dirs whose metrics give the sandbox's share")
    a = ap.parse_args()
    backends = [b for b in a.backends.split(",") if b]
    for b in ("docker", "kubernetes"):
        if b not in backends and engine_reachable(b):
            backends.append(b)
    for rnd in range(a.rounds):
        times = {b: [] for b in backends + ["plain"]}
        for _ in range(a.startups):
            for b in backends:
                times[b].append(startup(b))
            times["plain"].append(plain())
        med = {b: statistics.median(v) * 1000 for b, v in times.items()}
        print(f"round {rnd + 1}: start-up (open + `true` + close), median of {a.startups}: "
              + ", ".join(f"{b} {v:.1f} ms" for b, v in med.items())
              + "; " + ", ".join(f"{b} {med[b] / med['plain']:.1f}x plain" for b in backends), flush=True)
        for name, cfg in (("swe", {"n_train": 1, "n_eval": a.episodes, "max_turns": 2}),
                          ("chart", {"n_train": 1, "n_eval": a.episodes})):
            env = make_env(name, **cfg)
            tasks = env.tasks("eval")
            one = episodes_per_s(env, tasks, 1)
            many = episodes_per_s(env, tasks, a.workers)
            print(f"round {rnd + 1}: {name} with the expert's actions: {one:.2f} episodes/s on 1 worker, "
                  f"{many:.2f} on {a.workers} ({many / one:.2f}x)", flush=True)
    for run in a.runs:
        print(run_share(run))


if __name__ == "__main__":
    main()
