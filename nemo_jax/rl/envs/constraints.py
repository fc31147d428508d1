"""`constraints`: single turn, a request with several checkable constraints on the answer's form; reward = share
satisfied, success = all."""

from __future__ import annotations

import re

import numpy as np

from nemo_jax.rl.envs.episode import Score, SingleTurn, Task, last_assistant


TOPICS = ("the sea", "a city", "winter", "a cat", "music", "the moon", "a garden", "trains", "coffee", "a river")


WORDS = ("blue", "quiet", "bright", "small", "green", "cold", "warm", "old")


def _check(kind: str, arg, text: str) -> bool:
    words = re.findall(r"[A-Za-z']+", text)
    if kind == "max_words":
        return 0 < len(words) <= arg
    if kind == "min_words":
        return len(words) >= arg
    if kind == "include":
        return arg.lower() in (w.lower() for w in words)
    if kind == "exclude":
        return arg.lower() not in (w.lower() for w in words)
    if kind == "lowercase":
        return text.strip() != "" and text == text.lower()
    if kind == "end_with":
        return text.rstrip().endswith(arg)
    if kind == "no_digits":
        return not any(ch.isdigit() for ch in text)
    raise ValueError(f"constraints: unknown check {kind!r}")


_PHRASES = {"max_words": "use at most {} words", "min_words": "use at least {} words", "include": "use the word '{}'",
            "exclude": "do not use the word '{}'", "lowercase": "write only lowercase letters",
            "end_with": "end with '{}'", "no_digits": "use no digits"}


class Constraints(SingleTurn):
    """'Write a sentence about TOPIC. Rules: ...' with `k` checkable rules (drawn from `rules`, default every kind:
    max_words, min_words, include, exclude, lowercase, end_with, no_digits); reward = share of rules met."""
    name = "constraints"

    def __init__(self, k: int = 3, n_train: int = 256, n_eval: int = 64, seed: int = 0, rules=None):
        rng = np.random.default_rng(seed)
        unknown = set(rules or ()) - set(_PHRASES)
        if unknown or (rules is not None and len(rules) < k):
            raise ValueError(f"constraints: rules {sorted(rules)} must name at least k={k} of {sorted(_PHRASES)}")
        self._split = {}
        for split, n in (("train", n_train), ("eval", n_eval)):
            out = []
            for i in range(n):
                pool = [("max_words", int(rng.integers(5, 15))), ("min_words", int(rng.integers(2, 5))),
                        ("include", str(rng.choice(WORDS))), ("exclude", "the"), ("lowercase", None),
                        ("end_with", str(rng.choice([".", "!"]))), ("no_digits", None)]
                pool = [x for x in pool if rules is None or x[0] in rules]  # (drawn all the same: fixed tasks)
                chosen = [pool[j] for j in sorted(rng.choice(len(pool), size=min(k, len(pool)), replace=False))]
                topic = str(rng.choice(TOPICS))
                said = "; ".join(_PHRASES[c].format(a) for c, a in chosen)
                out.append(Task(f"{split}-{i}", ({"role": "user", "content": f"Write a sentence about {topic}. "
                                                                            f"Rules: {said}."},),
                                {"checks": chosen}, "constraints"))
            self._split[split] = out

    def tasks(self, split: str) -> list[Task]:
        return self._split[split]

    def score(self, task: Task, history: list[dict]) -> Score:
        text = last_assistant(history)
        met = [_check(c, a, text) for c, a in task.data["checks"]]
        return Score(sum(met) / len(met), all(met))
