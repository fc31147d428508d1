"""Rollouts, their validation, and learner batches made from finished groups.

A rollout is one sampled conversation: `tokens` (prompt and every turn, token ids), `loss_mask` (1 on the tokens
the policy sampled), `logprobs` (the behaviour policy's logprob of each token, 0 where the mask is 0), `reward`,
`task_id`, `group_id` (the G rollouts of one task draw share it), `policy_versions` (the adapter versions that
sampled its tokens; a rollout that spans a policy update has several), and optionally the sampling `temperature`
and a `rollout_id` (unique within its group). Producers in other processes write them
as JSON lines (nemo_jax.rl.spool); `validate` is the one gate every rollout passes before it can be trained on.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field

import numpy as np

from nemo_jax.rl.loss import group_advantages, loss_weights


@dataclass
class Rollout:
    tokens: list[int]
    loss_mask: list[int]
    logprobs: list[float]
    reward: float
    task_id: str
    group_id: str
    policy_versions: list[int] = field(default_factory=lambda: [0])
    success: bool = False  # the environment's verdict (full success), for logging and eval
    temperature: float | None = None  # the sampling temperature its logprobs are of (None: not recorded)
    rollout_id: str = ""  # unique per rollout of a group (the episode's id); duplicates of it are rejected

    @property
    def version(self) -> int:
        """The oldest policy version that sampled any of its tokens (what staleness is measured from)."""
        return min(self.policy_versions)

    def to_json(self) -> dict:
        d = {"tokens": list(map(int, self.tokens)), "loss_mask": list(map(int, self.loss_mask)),
             "logprobs": list(map(float, self.logprobs)), "reward": float(self.reward),
             "task_id": str(self.task_id), "group_id": str(self.group_id),
             "policy_versions": list(map(int, self.policy_versions)), "success": bool(self.success)}
        if self.temperature is not None:
            d["temperature"] = float(self.temperature)
        if self.rollout_id:
            d["rollout_id"] = str(self.rollout_id)
        return d

    def dedupe_key(self) -> str:
        """What makes two records the same rollout: its `rollout_id`, or (a producer that gives none) its content."""
        if self.rollout_id:
            return "id:" + self.rollout_id
        return "sha1:" + hashlib.sha1(json.dumps(self.to_json(), sort_keys=True).encode()).hexdigest()


REJECT_REASONS = ("malformed", "length_mismatch", "bad_reward", "bad_logprob", "bad_token", "no_loss_tokens",
                  "unknown_group", "too_long", "bad_success", "bad_version", "bad_temperature", "duplicate")
MIN_LOGPROB = -1e4  # default floor of a sampled token's behaviour logprob (rollout.min_logprob)
_FP32_MAX = float(np.finfo(np.float32).max)


def _ints(x, bools: bool = False) -> np.ndarray | None:
    """A JSON list of integers (not floats or strings; not bools unless `bools`) -> int64 array, else None."""
    if not isinstance(x, list) or not set(map(type, x)) <= ({int, bool} if bools else {int}):
        return None
    try:
        return np.asarray(x, np.int64)
    except OverflowError:
        return None


def _numbers(x) -> np.ndarray | None:
    """A JSON list of numbers (ints or floats, not bools or strings) -> float64 array, else None."""
    if not isinstance(x, list) or not set(map(type, x)) <= {int, float}:
        return None
    try:
        return np.asarray(x, np.float64)
    except OverflowError:
        return None


def _number(x) -> bool:
    return type(x) in (int, float) and math.isfinite(x)


def validate(d: dict, vocab_size: int, max_len: int | None = None, *, version: int | None = None,
             reward_range: tuple[float, float] | None = None, min_logprob: float = MIN_LOGPROB,
             temperature: float | None = None) -> Rollout | str:
    """A rollout record (dict from JSON) -> Rollout, or the reason it is rejected (one of REJECT_REASONS).

    Types are strict (nothing is coerced): token ids and the mask are JSON integers (3.7 or "3" is `bad_token`,
    not 3), `success` a JSON boolean, policy versions integers in [0, `version`] (the learner's current one:
    a future or negative version is `bad_version`), the reward a number finite in fp32 and inside
    `reward_range` when one is given, each sampled token's logprob in [`min_logprob`, 0]. A record that states
    its sampling `temperature` must state the learner's (`temperature`, when given): its logprobs are of that
    distribution."""
    if not isinstance(d, dict):
        return "malformed"
    for k in ("tokens", "loss_mask", "logprobs", "task_id", "group_id"):
        if k not in d:
            return "malformed"
    if not isinstance(d["task_id"], str) or not isinstance(d["group_id"], str):
        return "malformed"
    rid = d.get("rollout_id", "")
    if not isinstance(rid, str):
        return "malformed"
    toks, mask, lps = _ints(d["tokens"]), _ints(d["loss_mask"], bools=True), _numbers(d["logprobs"])
    if toks is None:
        return "bad_token"
    if mask is None or lps is None:
        return "malformed"
    n = len(toks)
    if len(mask) != n or len(lps) != n or n < 2:
        return "length_mismatch"
    if max_len is not None and n - 1 > max_len:
        return "too_long"
    reward = d.get("reward")
    if not _number(reward) or abs(reward) > _FP32_MAX:  # the learner computes in fp32: 1e39 would be inf there
        return "bad_reward"
    if reward_range is not None and not reward_range[0] <= reward <= reward_range[1]:
        return "bad_reward"
    if np.any(toks < 0) or np.any(toks >= vocab_size):
        return "bad_token"
    if mask[0] or not np.any(mask[1:]) or np.any((mask != 0) & (mask != 1)):
        return "no_loss_tokens"  # the first token has no context to be sampled from
    sampled = lps[mask.astype(bool)]
    if not np.all(np.isfinite(lps)) or np.any(sampled > 0) or np.any(sampled < min_logprob):
        return "bad_logprob"
    success = d.get("success", False)
    if type(success) is not bool:
        return "bad_success"
    versions = d["policy_versions"] if "policy_versions" in d else [d["policy_version"]] if "policy_version" in d \
        else None
    v = _ints(versions)
    if v is None or not len(v) or np.any(v < 0) or (version is not None and np.any(v > version)):
        return "bad_version"
    temp = d.get("temperature")
    if temp is not None and (not _number(temp) or temp < 0
                             or (temperature is not None and abs(temp - temperature) > 1e-6)):
        return "bad_temperature"
    return Rollout(tokens=toks.tolist(), loss_mask=mask.tolist(), logprobs=lps.tolist(), reward=float(reward),
                   task_id=d["task_id"], group_id=d["group_id"], policy_versions=v.tolist(), success=success,
                   temperature=None if temp is None else float(temp), rollout_id=rid)


def learner_batch(groups: list[list[Rollout]], seq_len: int, *, rows: int | None = None, scale: str = "none",
                  reduction: str = "rollout", max_len: int | None = None,
                  drop_zero_variance: bool = True) -> tuple[dict, dict]:
    """Finished groups -> (learner batch of numpy arrays, counts). Groups whose rewards are all equal carry no
    signal: they are counted (`zero_variance_groups`) and left out (kept, with advantage 0, when
    drop_zero_variance=False: e.g. demonstrations for a cross-entropy term). Rows are padded to `rows` (a multiple the
    mesh and micro-batches need) with empty rows (no loss tokens, weight 0). Each rollout is one row: tokens
    [:-1] in, tokens[1:] as targets, mask and logprobs of the targets."""
    kept = []
    zero = 0
    for g in groups:
        adv, z = group_advantages([r.reward for r in g], [0] * len(g), scale)
        if z.all():
            zero += 1
            if drop_zero_variance:
                continue
        kept += list(zip(g, adv))
    n = len(kept)
    rows = n if rows is None else rows
    if n > rows:
        raise ValueError(f"learner batch: {n} rollouts do not fit {rows} rows")
    out = {"tokens": np.zeros((rows, seq_len), np.int32), "targets": np.zeros((rows, seq_len), np.int32),
           "segment_ids": np.zeros((rows, seq_len), np.int32), "loss_mask": np.zeros((rows, seq_len), bool),
           "behaviour_logprobs": np.zeros((rows, seq_len), np.float32), "advantages": np.zeros((rows,), np.float32)}
    for i, (r, a) in enumerate(kept):
        t = len(r.tokens) - 1
        if t > seq_len:
            raise ValueError(f"rollout of group {r.group_id} has {t + 1} tokens > seq_len + 1 = {seq_len + 1}")
        out["tokens"][i, :t] = r.tokens[:-1]
        out["targets"][i, :t] = r.tokens[1:]
        out["segment_ids"][i, :t] = 1
        out["loss_mask"][i, :t] = np.asarray(r.loss_mask[1:], bool)
        out["behaviour_logprobs"][i, :t] = np.where(out["loss_mask"][i, :t], r.logprobs[1:], 0.0)
        out["advantages"][i] = a
    out["loss_weights"] = loss_weights(out["loss_mask"], reduction, max_len, n_rollouts=n)
    counts = {"rollouts": n, "zero_variance_groups": zero, "groups": len(groups),
              "zero_variance_frac": zero / max(len(groups), 1),
              "response_tokens": int(out["loss_mask"].sum())}
    return out, counts
