"""`arithmetic`: single turn, "What is A plus B?" (plus / minus / times), an integer answer; an expert that answers in
the chat style the tiny SFT data uses ("A plus B is N."), so its demonstrations can warm-start an expert."""

from __future__ import annotations

import numpy as np

from nemo_jax.rl.envs.episode import Score, SingleTurn, Task, demonstrations, last_assistant, last_number


class Arithmetic(SingleTurn):
    """'What is A op B?' with A, B drawn from [lo, hi]; success when the answer's last number is A op B. The reward
    is 1 for the right answer, 0 for a wrong one, or with `partial` > 0 partial credit for a near one:
    max(0, 1 - |x - answer| / partial). `n_train` / `n_eval` tasks, disjoint, fixed by `seed`. (With plus and
    minus and hi 19 every answer is at most 38: one token of the tiny tokenizer, whose numbers end at 38.)"""
    name = "arithmetic"
    OPS = {"plus": lambda a, b: a + b, "minus": lambda a, b: a - b, "times": lambda a, b: a * b}

    def __init__(self, ops=("plus", "minus"), lo: int = 0, hi: int = 30, n_train: int = 256, n_eval: int = 64,
                 seed: int = 0, template: str = "What is {a} {op} {b}?", partial: float = 0.0):
        unknown = set(ops) - set(self.OPS)
        if unknown:
            raise ValueError(f"arithmetic: unknown ops {sorted(unknown)} (known: {sorted(self.OPS)})")
        if partial < 0:
            raise ValueError(f"arithmetic: partial must be >= 0 (0: exact answers only), got {partial}")
        rng = np.random.default_rng(seed)
        triples = {(op, int(a), int(b)) for op in ops for a in range(lo, hi + 1) for b in range(lo, hi + 1)
                   if op != "minus" or a >= b}  # non-negative differences
        triples = sorted(triples)
        if len(triples) < n_train + n_eval:
            raise ValueError(f"arithmetic: only {len(triples)} distinct problems for {n_train} + {n_eval} tasks")
        order = rng.permutation(len(triples))
        self._split = {"train": [triples[i] for i in order[:n_train]],
                       "eval": [triples[i] for i in order[n_train:n_train + n_eval]]}
        self.template, self.partial = template, float(partial)

    def tasks(self, split: str) -> list[Task]:
        return [Task(f"{op}-{a}-{b}", ({"role": "user", "content": self.template.format(a=a, op=op, b=b)},),
                     {"answer": self.OPS[op](a, b), "a": a, "op": op, "b": b}, op) for op, a, b in self._split[split]]

    def score(self, task: Task, history: list[dict]) -> Score:
        x = last_number(last_assistant(history))
        want = task.data["answer"]
        ok = x is not None and x == want
        if ok or not self.partial or x is None:
            return Score(float(ok), ok)
        return Score(max(0.0, 1.0 - abs(x - want) / self.partial), False)

    @staticmethod
    def expert(task: Task) -> list[str]:
        d = task.data
        return [f"{d['a']} {d['op']} {d['b']} is {d['answer']}."]

    def demonstrations(self, split: str, n: int | None = None) -> list[dict]:
        """The expert's answers to the first `n` tasks of `split` -> SFT records {"messages"}."""
        return demonstrations(self, split, n)
