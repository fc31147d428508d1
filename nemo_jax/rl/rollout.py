"""Rollouts, their validation, and learner batches made from finished groups.

A rollout is one sampled conversation: `tokens` (prompt and every turn, token ids), `loss_mask` (1 on the tokens
the policy sampled), `logprobs` (the behaviour policy's logprob of each token, 0 where the mask is 0), `reward`,
`task_id`, `group_id` (the G rollouts of one task draw share it) and `policy_versions` (the adapter versions that
sampled its tokens; a rollout that spans a policy update has several), `images` (its pictures, in the order of
their placeholder tokens: files under the run dir named by content hash, see `ImageStore`), `rollout_id` (unique
within its group) and the sampling `temperature` its logprobs are of. Producers in other
processes write them as JSON lines (nemo_jax.rl.spool); `validate` is the one gate every rollout passes before it
can be trained on.
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import os
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
    images: list = field(default_factory=list)  # [{"path": relative to the image root, "sha256"}] in token order
    rollout_id: str = ""  # the episode's id (what `Episode.start` was given)
    timed_out: bool = False  # the episode ran past its time limit (scored 0)
    temperature: float | None = None  # the sampling temperature its logprobs are of (None: not recorded)
    # the conversation's reward after each assistant turn (an episode's step() answers it), in turn order: the
    # turns are the runs of loss_mask; per-turn credit reads it (loss.turn_credit); [] when not recorded
    turn_rewards: list = field(default_factory=list)
    # the conversation as chat messages and its tool definitions (the in-process sampler's; not written to spool
    # files): what rejection-sampling fine-tuning keeps of a verified success
    messages: list | None = field(default=None, repr=False, compare=False)
    tools: list | None = field(default=None, repr=False, compare=False)
    # where each later BRANCH starts (token offsets, increasing): an episode whose conversation was rewritten (a
    # sub-agent, a compacted history) holds one token record per branch, back to back, each opening with its own
    # prompt; the learner trains each as a segment of the rollout's row (`segments`). [] for one conversation
    branches: list = field(default_factory=list)
    # the numbers of the episode's last observation's `info` (an environment's own metrics: verifiers' rubric
    # functions, a tool count): logged as env/<key> means per step and in evals
    info: dict = field(default_factory=dict)

    @property
    def version(self) -> int:
        """The oldest policy version that sampled any of its tokens (what staleness is measured from)."""
        return min(self.policy_versions)

    def to_json(self) -> dict:
        return {"tokens": list(map(int, self.tokens)), "loss_mask": list(map(int, self.loss_mask)),
                "logprobs": list(map(float, self.logprobs)), "reward": float(self.reward),
                "task_id": str(self.task_id), "group_id": str(self.group_id),
                "policy_versions": list(map(int, self.policy_versions)), "success": bool(self.success),
                "images": [dict(x) for x in self.images], "rollout_id": str(self.rollout_id),
                "timed_out": bool(self.timed_out),
                **({} if self.temperature is None else {"temperature": float(self.temperature)}),
                **({"turn_rewards": list(map(float, self.turn_rewards))} if self.turn_rewards else {}),
                **({"branches": list(map(int, self.branches))} if self.branches else {}),
                **({"info": numbers(self.info)} if self.info else {})}

    @property
    def row_tokens(self) -> int:
        """The learner row positions it takes whole: each branch's tokens but its last (the last has no target)."""
        return len(self.tokens) - 1 - len(self.branches)

    def dedupe_key(self) -> str:
        """What makes two records the same rollout: its `rollout_id`, or (a producer that gives none) its content."""
        if self.rollout_id:
            return "id:" + self.rollout_id
        return "sha1:" + hashlib.sha1(json.dumps(self.to_json(), sort_keys=True).encode()).hexdigest()


class ImageStore:
    """The pictures of rollouts as PNG files under `root` (RUN/images), each named by the SHA-256 of its bytes:
    `put` -> the record {"path": "<sha[:2]>/<sha>.png" (relative to root), "sha256"} a rollout carries. Files are
    written whole (temporary name, rename) and never pickled; the same picture is stored once."""

    def __init__(self, root: str):
        self.root = os.path.abspath(root)

    def put(self, img) -> dict:
        from PIL import Image

        from nemo_jax.data.images import load_image

        img = load_image(img) if isinstance(img, str) else img
        img = img if hasattr(img, "getbbox") else Image.fromarray(np.asarray(img, np.uint8))
        buf = io.BytesIO()
        img.convert("RGB").save(buf, format="PNG")
        data = buf.getvalue()
        sha = hashlib.sha256(data).hexdigest()
        rel = os.path.join(sha[:2], sha + ".png")
        path = os.path.join(self.root, rel)
        if not os.path.exists(path):
            os.makedirs(os.path.dirname(path), exist_ok=True)
            tmp = f"{path}.tmp-{os.getpid()}-{id(buf)}"
            with open(tmp, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
        return {"path": rel, "sha256": sha}

    def path(self, rec: dict) -> str:
        return os.path.join(self.root, rec["path"])


def check_images(r: "Rollout", vision, root: str | None) -> str | None:
    """None when a rollout's image records are sound for a model with `vision` (None: a text model): each file
    under `root` exists, has its recorded SHA-256, and the pictures' token counts fill its placeholder tokens
    exactly; else the reject reason."""
    if not r.images:
        return None if vision is None or vision.image_token_id not in r.tokens else "bad_images"
    if vision is None or root is None:
        return "bad_images"  # a text model cannot train on pictures
    from nemo_jax.data.images import ImageError, load_image, picture_tokens

    need = 0
    for rec in r.images:
        if not isinstance(rec, dict) or not isinstance(rec.get("path"), str) or not isinstance(rec.get("sha256"), str):
            return "bad_images"
        path = os.path.normpath(os.path.join(root, rec["path"]))
        if not path.startswith(os.path.abspath(root) + os.sep):
            return "bad_images"  # outside the image root
        try:
            with open(path, "rb") as f:
                data = f.read()
            if hashlib.sha256(data).hexdigest() != rec["sha256"]:
                return "bad_images"
            need += picture_tokens(vision, load_image(path))
        except (OSError, ImageError):
            return "bad_images"
    return None if need == sum(t == vision.image_token_id for t in r.tokens) else "bad_images"


REJECT_REASONS = ("malformed", "length_mismatch", "bad_reward", "bad_logprob", "bad_token", "no_loss_tokens",
                  "unknown_group", "too_long", "bad_success", "bad_version", "bad_temperature", "duplicate",
                  "bad_images")
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
             temperature: float | None = None, vision=None, image_root: str | None = None) -> Rollout | str:
    """A rollout record (dict from JSON) -> Rollout, or the reason it is rejected (one of REJECT_REASONS).

    Types are strict (nothing is coerced): token ids and the mask are JSON integers (3.7 or "3" is `bad_token`,
    not 3), `success` a JSON boolean, policy versions integers in [0, `version`] (the learner's current one:
    a future or negative version is `bad_version`), the reward a number finite in fp32 and inside
    `reward_range` when one is given, each sampled token's logprob in [`min_logprob`, 0]. A record that states
    its sampling `temperature` must state the learner's (`temperature`, when given): its logprobs are of that
    distribution. Pictures (`images`) are checked against the files under `image_root` for a model with `vision`."""
    if not isinstance(d, dict):
        return "malformed"
    for k in ("tokens", "loss_mask", "logprobs", "task_id", "group_id"):
        if k not in d:
            return "malformed"
    if not isinstance(d["task_id"], str) or not isinstance(d["group_id"], str):
        return "malformed"
    rid, images, timed_out = d.get("rollout_id", ""), d.get("images") or [], d.get("timed_out", False)
    if not isinstance(rid, str) or not isinstance(images, list) or type(timed_out) is not bool:
        return "malformed"
    toks, mask, lps = _ints(d["tokens"]), _ints(d["loss_mask"], bools=True), _numbers(d["logprobs"])
    if toks is None:
        return "bad_token"
    if mask is None or lps is None:
        return "malformed"
    n = len(toks)
    if len(mask) != n or len(lps) != n or n < 2:
        return "length_mismatch"
    branches, info = _ints(d.get("branches", [])), d.get("info", {})
    if branches is None or not isinstance(info, dict) or not all(map(_number, info.values())):
        return "malformed"
    if len(branches) and (np.any(np.diff(np.concatenate([[0], branches, [n]])) < 2)):
        return "length_mismatch"  # (each branch holds at least a prompt token and a sampled one)
    if max_len is not None and n - 1 - len(branches) > max_len:
        return "too_long"
    reward = d.get("reward")
    if not _number(reward) or abs(reward) > _FP32_MAX:  # the learner computes in fp32: 1e39 would be inf there
        return "bad_reward"
    if reward_range is not None and not reward_range[0] <= reward <= reward_range[1]:
        return "bad_reward"
    if np.any(toks < 0) or np.any(toks >= vocab_size):
        return "bad_token"
    if mask[0] or np.any(mask[branches]) or not np.any(mask[1:]) or np.any((mask != 0) & (mask != 1)):
        return "no_loss_tokens"  # the first token (of each branch) has no context to be sampled from
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
    turn_rewards = _numbers(d.get("turn_rewards", []))
    if turn_rewards is None or not np.all(np.isfinite(turn_rewards)) or len(turn_rewards) > len(turn_spans(mask)):
        return "bad_reward"  # (at most one reward per assistant turn)
    r = Rollout(tokens=toks.tolist(), loss_mask=mask.tolist(), logprobs=lps.tolist(), reward=float(reward),
                task_id=d["task_id"], group_id=d["group_id"], policy_versions=v.tolist(), success=success,
                images=list(images), rollout_id=rid, timed_out=timed_out,
                temperature=None if temp is None else float(temp), turn_rewards=turn_rewards.tolist(),
                branches=branches.tolist(), info=numbers(info))
    if check_images(r, vision, image_root):
        return "bad_images"
    return r


class RolloutImages:
    """The pictures of learner rows: each rollout's images read from the store under `root` and processed as the
    sampler processed them (`nemo_jax.data.images.picture`), laid out per row within `max_patches` patches and
    `max_images` images (`rollout.max_image_patches` / `rollout.max_images`)."""

    def __init__(self, vision, root: str, max_patches: int, max_images: int):
        from nemo_jax.data.images import RowImages

        self.v, self.root = vision, root
        self.rows = RowImages(vision, max_patches, max_images)

    def row(self, r: Rollout | None, row_tokens=()) -> dict:
        """The row arrays of rollout `r` (None: an empty row) whose learner row holds `row_tokens` (its input
        tokens, pictures in order): a picture whose placeholders are not among them is left out."""
        from nemo_jax.data.images import picture

        if r is None or not r.images:
            return self.rows.row([])
        pics, start = [], 0
        ph = np.flatnonzero(np.asarray(row_tokens) == self.v.image_token_id)
        for rec in r.images:
            if start >= len(ph):
                break
            pix, grid = picture(self.v, os.path.join(self.root, rec["path"]))
            pics.append((pix, [grid]))
            start += grid[0] * grid[1] // self.v.merge ** 2
        patches = sum(len(p) for p, _ in pics)
        if patches > self.rows.max_patches or len(pics) > self.rows.max_images:
            raise ValueError(f"rollout {r.rollout_id or r.group_id}: {len(pics)} pictures of {patches} patches exceed "
                             f"rollout.max_images={self.rows.max_images} / rollout.max_image_patches="
                             f"{self.rows.max_patches}")
        return self.rows.row(pics)


def numbers(info: dict) -> dict:
    """The finite numbers of an observation's `info` (what a rollout keeps of it)."""
    return {str(k): float(v) for k, v in (info or {}).items() if _number(v)}


def info_means(rollouts: list[Rollout]) -> dict:
    """env/<key>: the mean of each `info` number over the rollouts that report it."""
    sums, counts = {}, {}
    for r in rollouts:
        for k, v in r.info.items():
            sums[k], counts[k] = sums.get(k, 0.0) + v, counts.get(k, 0) + 1
    return {f"env/{k}": sums[k] / counts[k] for k in sorted(sums)}


def segments(r: Rollout) -> list[tuple[int, int]]:
    """[start, end) of each branch's tokens in `r.tokens` (one span for a rollout without branches)."""
    bounds = [0, *r.branches, len(r.tokens)]
    return list(zip(bounds[:-1], bounds[1:]))


def turn_spans(mask) -> list[tuple[int, int]]:
    """The assistant turns of a rollout: [start, end) of each run of sampled tokens (1s) in its loss mask."""
    m = np.concatenate([[0], np.asarray(mask, np.int8) != 0, [0]]).astype(np.int8)
    edges = np.flatnonzero(np.diff(m))
    return list(zip(edges[0::2].tolist(), edges[1::2].tolist()))


def turn_credits(r: Rollout, gamma: float = 1.0) -> list[float]:
    """Each assistant turn's credit: the reward still earned from that turn on, discounted by `gamma` per turn:
    c_t = sum_{k >= t} gamma^(k - t) d_k with d_k = R_k - R_(k-1) the progress turn k made (R_k: the
    conversation's reward after turn k, `turn_rewards`, a turn without one keeping the reward before it; the
    rollout's own reward after its last turn; R_0 = 0). With gamma 1, c_t = reward - R_(t-1): a turn is credited
    with what was earned from it on, not before it (without turn rewards every turn gets the rollout's reward)."""
    n = len(turn_spans(r.loss_mask))
    after = [float(x) for x in r.turn_rewards[:n]]
    after += [after[-1] if after else 0.0] * (n - len(after))
    if n:
        after[-1] = float(r.reward)  # (the rollout's reward is the last word: a timed-out episode scores 0)
    progress = np.diff([0.0] + after)
    credit, out = 0.0, []
    for d in progress[::-1]:
        credit = d + gamma * credit
        out.append(credit)
    return out[::-1]


def token_advantages(group: list[Rollout], advantages, beta: float, gamma: float = 1.0) -> list[np.ndarray]:
    """Per-token advantages of a group's rollouts under per-turn credit: a token of turn t of rollout i gets
    A_i + beta * (c_t - mean c), the mean over every turn of the group (`turn_credits`); tokens outside the turns
    get A_i (they carry no loss)."""
    credits = [turn_credits(r, gamma) for r in group]
    flat = [c for cs in credits for c in cs]
    mean = float(np.mean(flat)) if flat else 0.0
    out = []
    for r, a, cs in zip(group, advantages, credits):
        t = np.full(len(r.tokens), float(a), np.float32)
        for (lo, hi), c in zip(turn_spans(r.loss_mask), cs):
            t[lo:hi] = a + beta * (c - mean)
        out.append(t)
    return out


def learner_batch(groups: list[list[Rollout]], seq_len: int, *, rows: int | None = None, scale: str = "none",
                  reduction: str = "rollout", max_len: int | None = None, drop_zero_variance: bool = True,
                  images: RolloutImages | None = None, turn_credit: float = 0.0,
                  turn_gamma: float = 1.0) -> tuple[dict, dict]:
    """Finished groups -> (learner batch of numpy arrays, counts). Groups whose rewards are all equal carry no
    signal: they are counted (`zero_variance_groups`) and left out (kept, with advantage 0, when
    drop_zero_variance=False: e.g. demonstrations for a cross-entropy term). Rows are padded to `rows` (a multiple the
    mesh and micro-batches need) with empty rows (no loss tokens, weight 0). Each rollout is one row: tokens
    [:-1] in, tokens[1:] as targets, mask and logprobs of the targets. A rollout longer than a row (seq_len + 1
    tokens) is TRUNCATED to its first seq_len + 1 tokens: the loss covers the kept part, its group and advantage
    stay (counted: `truncated`, `truncated_tokens`). A rollout with branches fills its row with one segment per
    branch (segment ids 1, 2, ...: attention and the Mamba state do not cross them), each shifted on its own, and
    is one rollout of its group (one advantage, one rollout's weight). With `images`, each row's pictures
    (`pixel_values` and the vision layout arrays) come along, so the learner's logprobs see what the sampler saw.
    With `turn_credit` > 0 the advantages are per token ([rows, seq_len]: `token_advantages`), else one per row
    ([rows])."""
    kept = []
    zero = 0
    for g in groups:
        adv, z = group_advantages([r.reward for r in g], [0] * len(g), scale)
        if z.all():
            zero += 1
            if drop_zero_variance:
                continue
        if turn_credit:
            adv = token_advantages(g, adv, turn_credit, turn_gamma)
        kept += list(zip(g, adv))
    n = len(kept)
    rows = n if rows is None else rows
    if n > rows:
        raise ValueError(f"learner batch: {n} rollouts do not fit {rows} rows")
    out = {"tokens": np.zeros((rows, seq_len), np.int32), "targets": np.zeros((rows, seq_len), np.int32),
           "segment_ids": np.zeros((rows, seq_len), np.int32), "loss_mask": np.zeros((rows, seq_len), bool),
           "behaviour_logprobs": np.zeros((rows, seq_len), np.float32),
           "advantages": np.zeros((rows, seq_len) if turn_credit else (rows,), np.float32)}
    truncated = truncated_tokens = 0
    pictures = []
    for i, (r, a) in enumerate(kept):
        at = 0  # the row's positions filled so far: each branch a segment of its own
        for k, (s, e) in enumerate(segments(r)):
            t = min(e - s - 1, seq_len - at)
            if t <= 0:
                break
            row, src = slice(at, at + t), slice(s + 1, s + t + 1)  # (targets: the tokens after the inputs)
            out["tokens"][i, row] = r.tokens[s:s + t]
            out["targets"][i, row] = r.tokens[src]
            out["segment_ids"][i, row] = k + 1
            out["loss_mask"][i, row] = np.asarray(r.loss_mask[src], bool)
            out["behaviour_logprobs"][i, row] = np.where(out["loss_mask"][i, row], r.logprobs[src], 0.0)
            if turn_credit:
                out["advantages"][i, row] = a[src]
            at += t
        if r.row_tokens > seq_len:
            truncated += 1
            truncated_tokens += r.row_tokens - seq_len
        if not turn_credit:
            out["advantages"][i] = a
        if images is not None:
            pictures.append(images.row(r, out["tokens"][i, :at]))
    if images is not None:
        pictures += [images.row(None, 0)] * (rows - n)
        out.update({k: np.stack([p[k] for p in pictures]) for k in pictures[0]})
    out["loss_weights"] = loss_weights(out["loss_mask"], reduction, max_len, n_rollouts=n)
    counts = {"rollouts": n, "zero_variance_groups": zero, "groups": len(groups),
              "zero_variance_frac": zero / max(len(groups), 1),
              "response_tokens": int(out["loss_mask"].sum()), "truncated": truncated,
              "truncated_tokens": truncated_tokens}
    return out, counts
