"""An environment's expert demonstrations as SFT chat data: `nemo-jax demos --env NAME --out DIR` writes
OUT/train.jsonl and OUT/eval.jsonl (records {"messages", "tools"}, pictures as PNG data URLs), each conversation
run through a real episode (`episode.demonstrations`), the folder written whole or not at all. The environment
needs an `expert(task)` (its assistant turns) and `demonstrations(split, n, **demo_args)`: the built-in gui, mcp,
swe and chart environments have them."""

from __future__ import annotations

import argparse
import json
import os

from nemo_jax.fsutil import atomic_dir

SPLITS = ("train", "eval")


def write_demonstrations(env, out: str, counts: dict, *, overwrite: bool = False, **demo_args) -> dict[str, int]:
    """OUT/<split>.jsonl for each split of `counts` ({split: tasks, None: all}) -> records written per split."""
    if not callable(getattr(env, "demonstrations", None)):
        raise ValueError(f"environment {getattr(env, 'name', type(env).__name__)} has no demonstrations (an expert)")
    written = {}
    with atomic_dir(out, "demonstration set", overwrite=overwrite, own_files=tuple(f"{s}.jsonl" for s in counts)) as tmp:
        for split, n in counts.items():
            recs = env.demonstrations(split, n, **demo_args)
            with open(os.path.join(tmp, f"{split}.jsonl"), "w", encoding="utf-8") as f:
                for r in recs:
                    f.write(json.dumps(r) + "\n")
            written[split] = len(recs)
    return written


def add_arguments(ap: argparse.ArgumentParser, env: str | None = None) -> None:
    if env is None:
        ap.add_argument("--env", required=True, help="an environment with an expert: gui, mcp, swe, chart, or "
                                                      "package.module:Class")
    ap.add_argument("--out", required=True, help="a new folder (or earlier demonstrations, with --overwrite): "
                                                 "train.jsonl and eval.jsonl go there")
    ap.add_argument("--n-train", type=int, default=1024, help="tasks of the train split (default 1024)")
    ap.add_argument("--n-eval", type=int, default=32, help="tasks of the eval split (default 32)")
    ap.add_argument("--seed", type=int, default=100,
                    help="the environment's task seed (default 100: other tasks than an RL run's seed 0)")
    ap.add_argument("--env-args", default=None, help="more environment arguments, a JSON object")
    ap.add_argument("--demo-args", default=None, help="the environment's demonstration arguments, a JSON object "
                                                      "(chart: {\"direct\": share answered at a glance})")
    ap.add_argument("--overwrite", action="store_true", help="replace earlier demonstrations in --out")


def json_object(text: str | None, flag: str) -> dict:
    if not text:
        return {}
    try:
        d = json.loads(text)
    except ValueError as e:
        raise ValueError(f"{flag}: not valid JSON ({e})") from None
    if not isinstance(d, dict):
        raise ValueError(f"{flag}: expected a JSON object")
    return d


def run(a, env: str | None = None) -> dict[str, int]:
    """The command, on parsed arguments (`env`: fixed by a module's own entry point)."""
    from nemo_jax.rl.envs import make_env

    env_args = {"n_train": a.n_train, "n_eval": a.n_eval, "seed": a.seed, **json_object(a.env_args, "--env-args")}
    demo_args = json_object(a.demo_args, "--demo-args")
    name = env or a.env
    written = write_demonstrations(make_env(name, **env_args), a.out, {"train": None, "eval": None},
                                   overwrite=a.overwrite, **demo_args)
    print(f"demos: {name}: " + ", ".join(f"{n} {s}" for s, n in written.items()) + f" demonstrations in {a.out}")
    return written


def main(argv=None, env: str | None = None) -> dict[str, int]:
    """`python -m nemo_jax.rl.envs.<env> --out DIR` (the environment's own entry point)."""
    ap = argparse.ArgumentParser(description=f"write the {env or 'environment'}'s expert demonstrations as SFT "
                                             "chat data (JSONL)")
    add_arguments(ap, env)
    return run(ap.parse_args(argv), env)
