"""`arithmetic`: single turn, "What is A plus B?" (plus / minus / times), exact integer answer."""

from __future__ import annotations

import numpy as np

from nemo_jax.rl.envs.episode import Score, SingleTurn, Task, last_assistant, last_number


class Arithmetic(SingleTurn):
    """'What is A op B?' with A, B drawn from [lo, hi]; reward 1 when the answer's last number is A op B.
    `n_train` / `n_eval` tasks, disjoint, fixed by `seed`."""
    name = "arithmetic"
    OPS = {"plus": lambda a, b: a + b, "minus": lambda a, b: a - b, "times": lambda a, b: a * b}

    def __init__(self, ops=("plus", "minus"), lo: int = 0, hi: int = 30, n_train: int = 256, n_eval: int = 64,
                 seed: int = 0, template: str = "What is {a} {op} {b}?"):
        unknown = set(ops) - set(self.OPS)
        if unknown:
            raise ValueError(f"arithmetic: unknown ops {sorted(unknown)} (known: {sorted(self.OPS)})")
        rng = np.random.default_rng(seed)
        triples = {(op, int(a), int(b)) for op in ops for a in range(lo, hi + 1) for b in range(lo, hi + 1)
                   if op != "minus" or a >= b}  # non-negative differences
        triples = sorted(triples)
        if len(triples) < n_train + n_eval:
            raise ValueError(f"arithmetic: only {len(triples)} distinct problems for {n_train} + {n_eval} tasks")
        order = rng.permutation(len(triples))
        self._split = {"train": [triples[i] for i in order[:n_train]],
                       "eval": [triples[i] for i in order[n_train:n_train + n_eval]]}
        self.template = template

    def tasks(self, split: str) -> list[Task]:
        return [Task(f"{op}-{a}-{b}", ({"role": "user", "content": self.template.format(a=a, op=op, b=b)},),
                     {"answer": self.OPS[op](a, b)}, op) for op, a, b in self._split[split]]

    def score(self, task: Task, history: list[dict]) -> Score:
        x = last_number(last_assistant(history))
        ok = x is not None and x == task.data["answer"]
        return Score(float(ok), ok)
