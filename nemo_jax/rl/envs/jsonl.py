"""`jsonl:PATH`: a user task set, one JSON object per line: {"id", "prompt" | "messages", "answer", "verifier":
"exact" | "regex" | "numeric", "tolerance" (numeric), "split" (train | eval)}."""

from __future__ import annotations

import json
import math
import re

from nemo_jax.rl.envs.episode import Score, SingleTurn, Task, last_assistant, last_number


def json_objects(path: str):
    """The JSON objects of a JSONL file, one per non-blank line -> (line number, "PATH:LINE", object); a line that is
    not a JSON object is one error naming the file and line. A UTF-8 BOM at the start is not data."""
    with open(path, encoding="utf-8-sig") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{n}"
            try:
                d = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: invalid JSON ({e.msg})") from None
            if not isinstance(d, dict):
                raise ValueError(f"{where}: a line must be a JSON object")
            yield n, where, d


class JsonlTasks(SingleTurn):
    """Tasks from a JSONL file with built-in verifiers (exact, regex, numeric with tolerance)."""
    VERIFIERS = ("exact", "regex", "numeric")

    def __init__(self, path: str):
        self.name = f"jsonl:{path}"
        self._split = {"train": [], "eval": []}
        for n, where, d in json_objects(path):
            if "answer" not in d or not ("prompt" in d or "messages" in d):
                raise ValueError(f"{where}: a task needs 'answer' and 'prompt' or 'messages'")
            v = d.get("verifier", "exact")
            if v not in self.VERIFIERS:
                raise ValueError(f"{where}: verifier {v!r} (expected one of {', '.join(self.VERIFIERS)})")
            if v == "regex":
                try:
                    re.compile(d["answer"])
                except re.error as e:
                    raise ValueError(f"{where}: answer is not a valid regex ({e})") from None
            split = d.get("split", "train")
            if split not in self._split:
                raise ValueError(f"{where}: split {split!r} (expected train or eval)")
            msgs = tuple(d["messages"]) if "messages" in d else ({"role": "user", "content": str(d["prompt"])},)
            self._split[split].append(Task(str(d.get("id", f"line{n}")), msgs,
                                           {"answer": d["answer"], "verifier": v,
                                            "tolerance": float(d.get("tolerance", 1e-6))},
                                           str(d.get("family", "default"))))
        if not self._split["train"] and not self._split["eval"]:
            raise ValueError(f"{path}: no tasks")

    def tasks(self, split: str) -> list[Task]:
        return self._split[split] or self._split["train"]  # no eval split: evaluate on the train tasks

    def score(self, task: Task, history: list[dict]) -> Score:
        text = last_assistant(history).strip()
        d = task.data
        if d["verifier"] == "exact":
            ok = text == str(d["answer"]).strip()
        elif d["verifier"] == "regex":
            ok = re.search(d["answer"], text) is not None
        else:
            x = last_number(text)
            ok = x is not None and math.isclose(x, float(d["answer"]), rel_tol=0, abs_tol=d["tolerance"])
        return Score(float(ok), ok)
