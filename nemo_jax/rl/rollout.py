"""Rollouts, their validation, and learner batches made from finished groups.

A rollout is one sampled conversation: `tokens` (prompt and every turn, token ids), `loss_mask` (1 on the tokens
the policy sampled), `logprobs` (the behaviour policy's logprob of each token, 0 where the mask is 0), `reward`,
`task_id`, `group_id` (the G rollouts of one task draw share it) and `policy_versions` (the adapter versions that
sampled its tokens; a rollout that spans a policy update has several). Producers in other processes write them
as JSON lines (nemo_jax.rl.spool); `validate` is the one gate every rollout passes before it can be trained on.
"""

from __future__ import annotations

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

    @property
    def version(self) -> int:
        """The oldest policy version that sampled any of its tokens (what staleness is measured from)."""
        return min(self.policy_versions)

    def to_json(self) -> dict:
        return {"tokens": list(map(int, self.tokens)), "loss_mask": list(map(int, self.loss_mask)),
                "logprobs": list(map(float, self.logprobs)), "reward": float(self.reward),
                "task_id": str(self.task_id), "group_id": str(self.group_id),
                "policy_versions": list(map(int, self.policy_versions)), "success": bool(self.success)}


REJECT_REASONS = ("malformed", "length_mismatch", "bad_reward", "bad_logprob", "bad_token", "no_loss_tokens",
                  "unknown_group", "too_long")


def validate(d: dict, vocab_size: int, max_len: int | None = None) -> Rollout | str:
    """A rollout record (dict from JSON) -> Rollout, or the reason it is rejected (one of REJECT_REASONS)."""
    try:
        versions = d.get("policy_versions", [d["policy_version"]] if "policy_version" in d else None)
        r = Rollout(tokens=[int(t) for t in d["tokens"]], loss_mask=[int(m) for m in d["loss_mask"]],
                    logprobs=[float(x) for x in d["logprobs"]], reward=d.get("reward"), task_id=str(d["task_id"]),
                    group_id=str(d["group_id"]), policy_versions=[int(v) for v in versions],
                    success=bool(d.get("success", False)))
    except (KeyError, TypeError, ValueError):
        return "malformed"
    if not r.policy_versions:
        return "malformed"
    n = len(r.tokens)
    if len(r.loss_mask) != n or len(r.logprobs) != n or n < 2:
        return "length_mismatch"
    if max_len is not None and n - 1 > max_len:
        return "too_long"
    if isinstance(r.reward, bool) or not isinstance(r.reward, (int, float)) or not math.isfinite(r.reward):
        return "bad_reward"
    if any(t < 0 or t >= vocab_size for t in r.tokens):
        return "bad_token"
    if r.loss_mask[0] or not any(r.loss_mask[1:]) or any(m not in (0, 1) for m in r.loss_mask):
        return "no_loss_tokens"  # the first token has no context to be sampled from
    lp = np.asarray(r.logprobs)
    if not np.all(np.isfinite(lp)) or np.any(lp[np.asarray(r.loss_mask, bool)] > 0):
        return "bad_logprob"
    r.reward = float(r.reward)
    return r


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
