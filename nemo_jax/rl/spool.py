"""The filesystem transport between the learner and external rollout producers (any engine that hot-loads LoRA).

    RUN/policy/<version>/   each published adapter version, PEFT format (written to a temp dir, renamed)
    RUN/policy/LATEST       the newest version number (a small file replaced atomically)
    RUN/requests/<gid>.json the groups the learner wants sampled: {group_id, task_id, messages, group_size,
                            policy_version}; a producer claims one by renaming it into requests/claimed/ (the
                            rename succeeds for exactly one producer), samples group_size rollouts of the task
                            with the newest policy, and spools them under that group id
    RUN/spool/*.jsonl       rollouts, one JSON object per line (`Rollout.to_json` keys; see nemo_jax.rl.rollout),
                            written to a dot-prefixed temp name and renamed, so a reader never sees half a file
    RUN/spool/consumed/     files the learner has read (kept for inspection; delete freely)

Every record passes `rollout.validate` and then the pool (its group must be one the learner opened and requested):
a rejected record is counted by reason and never trained on.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections import Counter

from nemo_jax.rl.pool import RolloutPool
from nemo_jax.rl.rollout import Rollout, validate


def _atomic_write(path: str, text: str) -> None:
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix="." + os.path.basename(path) + ".tmp-", dir=d)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def write_rollouts(spool_dir: str, rollouts: list[Rollout], name: str) -> str:
    """Write rollouts as `spool_dir/<name>.jsonl`, complete or not at all."""
    path = os.path.join(spool_dir, name + ".jsonl")
    _atomic_write(path, "".join(json.dumps(r.to_json()) + "\n" for r in rollouts))
    return path


def publish_policy(run_dir: str, version: int, cfg, adapters, **peft_kw) -> str:
    """Publish adapters as policy `version` (PEFT dir) and point LATEST at it."""
    from nemo_jax.lora.peft import save_peft

    path = os.path.join(run_dir, "policy", str(version))
    save_peft(cfg, adapters, path, **peft_kw)
    _atomic_write(os.path.join(run_dir, "policy", "LATEST"), f"{version}\n")
    return path


def latest_policy(run_dir: str) -> tuple[int, str] | None:
    """(version, PEFT dir) of the newest published policy, or None before the first."""
    try:
        with open(os.path.join(run_dir, "policy", "LATEST")) as f:
            v = int(f.read().strip())
    except FileNotFoundError:
        return None
    return v, os.path.join(run_dir, "policy", str(v))


def post_request(run_dir: str, group_id: str, task, group_size: int, version: int) -> None:
    """Ask external producers for one group of `task` (an rl.envs.Task)."""
    _atomic_write(os.path.join(run_dir, "requests", f"{group_id}.json"), json.dumps(
        {"group_id": group_id, "task_id": task.id, "messages": list(task.messages), "group_size": group_size,
         "policy_version": version}))


def claim_request(run_dir: str, producer: str) -> dict | None:
    """Take the oldest open request (atomically: one producer wins each) -> the request, or None when none."""
    d = os.path.join(run_dir, "requests")
    try:
        names = sorted(n for n in os.listdir(d) if n.endswith(".json") and not n.startswith("."))
    except FileNotFoundError:
        return None
    os.makedirs(os.path.join(d, "claimed"), exist_ok=True)
    for n in names:
        dst = os.path.join(d, "claimed", f"{producer}--{n}")
        try:
            os.rename(os.path.join(d, n), dst)
        except FileNotFoundError:  # another producer claimed it first
            continue
        with open(dst) as f:
            return json.load(f)
    return None


class SpoolReader:
    """Reads finished rollout files from `spool_dir` into a RolloutPool."""

    def __init__(self, spool_dir: str, vocab_size: int, max_len: int | None = None, *, vision=None,
                 image_root: str | None = None):
        self.dir, self.vocab_size, self.max_len = spool_dir, vocab_size, max_len
        self.vision, self.image_root = vision, image_root  # pictures: checked against files under image_root
        self.rejected = Counter()  # reason -> records
        self.accepted = 0
        os.makedirs(os.path.join(spool_dir, "consumed"), exist_ok=True)

    def poll(self, pool: RolloutPool) -> list[str]:
        """Read every complete file now in the spool -> ids of the groups that finished."""
        names = sorted(n for n in os.listdir(self.dir) if n.endswith(".jsonl") and not n.startswith("."))
        finished = []
        for name in names:
            path = os.path.join(self.dir, name)
            with open(path) as f:
                lines = f.readlines()
            os.replace(path, os.path.join(self.dir, "consumed", name))
            for line in lines:
                if not line.strip():
                    continue
                try:
                    d = json.loads(line)
                except json.JSONDecodeError:
                    self.rejected["malformed"] += 1
                    continue
                r = (validate(d, self.vocab_size, self.max_len, vision=self.vision, image_root=self.image_root)
                     if isinstance(d, dict) else "malformed")
                if isinstance(r, str):
                    self.rejected[r] += 1
                    continue
                done = pool.add(r)
                if done == "unknown_group":
                    self.rejected["unknown_group"] += 1
                    continue
                self.accepted += 1
                if done is not None:
                    finished.append(done)
        return finished
