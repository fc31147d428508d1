"""Reward-variance curriculum: each task is sampled in proportion to max(var(its last K rewards), floor); tasks
never tried get `prior`. For binary rewards var = p (1 - p): tasks the policy solves sometimes, the ones a group
of rollouts can learn from, come up most. Statistics update when a group finishes; the state (reward windows and
the sampler's RNG) goes into the run's checkpoint."""

from __future__ import annotations

from collections import deque

import numpy as np


class Curriculum:
    def __init__(self, tasks, window: int = 16, floor: float = 0.01, prior: float = 0.25, seed: int = 0):
        tasks = list(tasks)
        if not tasks:
            raise ValueError("curriculum: no tasks")
        if len(set(tasks)) != len(tasks):
            raise ValueError("curriculum: task ids must be unique")
        if window < 2 or floor <= 0 or prior <= 0:
            raise ValueError(f"curriculum: window >= 2, floor > 0, prior > 0 (got {window}, {floor}, {prior})")
        self.tasks, self.window, self.floor, self.prior = tasks, window, floor, prior
        self.recent = {t: deque(maxlen=window) for t in tasks}
        self.rng = np.random.default_rng(seed)

    def update(self, task, rewards) -> None:
        """A group of `task` finished with these rewards."""
        if task not in self.recent:
            raise KeyError(f"curriculum: unknown task {task!r}")
        self.recent[task].extend(float(r) for r in rewards)

    def weight(self, task) -> float:
        r = self.recent[task]
        return self.prior if len(r) < 2 else max(float(np.var(np.asarray(r))), self.floor)

    def probabilities(self) -> np.ndarray:
        w = np.array([self.weight(t) for t in self.tasks])
        return w / w.sum()

    def sample(self, n: int) -> list:
        """n task ids drawn with replacement in proportion to their weights."""
        idx = self.rng.choice(len(self.tasks), size=n, p=self.probabilities())
        return [self.tasks[i] for i in idx]

    def sample_with_p(self, n: int) -> list:
        """`sample`, each id with the probability it was drawn with -> [(task id, p)]."""
        p = self.probabilities()
        return [(self.tasks[i], float(p[i])) for i in self.rng.choice(len(self.tasks), size=n, p=p)]

    def state_dict(self) -> dict:
        return {"recent": {str(t): list(r) for t, r in self.recent.items()}, "rng": self.rng.bit_generator.state}

    def load_state_dict(self, state: dict) -> None:
        by_name = {str(t): t for t in self.tasks}
        for name, rewards in state["recent"].items():
            if name in by_name:  # tasks removed from the set since the checkpoint are forgotten
                self.recent[by_name[name]] = deque(rewards, maxlen=self.window)
        self.rng.bit_generator.state = state["rng"]
