"""Does a policy use its pictures? An environment wrapper that blanks or shuffles every picture its episodes show.

    real     the pictures as the environment made them (no wrapper)
    blank    each picture replaced by a picture of the same size in one colour (its own mean colour): the layout
             is gone, the sizes (and so the token counts) are kept
    shuffle  each picture replaced by a picture of another task of the same split (a fixed derangement of the
             tasks, drawn from `seed`: task i is shown task j's opening picture, j != i), resized to its size; the
             opening pictures are read once when the split's tasks are listed (each task's episode started and
             closed once)

A policy whose success does not drop under `blank` or `shuffle` does not look at the screen: its reward comes from
priors (a favourite click position, a likely word). `nemo-jax eval --images blank|shuffle` runs the held-out eval
this way; rewards, success and every other rule of the environment are unchanged (the episode still scores the
real task), only what the policy sees is replaced.
"""

from __future__ import annotations

import inspect

import numpy as np

from nemo_jax.data.chat import _image_ref
from nemo_jax.data.images import load_image

MODES = ("real", "blank", "shuffle")


def _pil(ref):
    """An image part's reference (PIL image, [H, W, C] array, path or data URL) -> an RGB PIL image."""
    from PIL import Image

    if hasattr(ref, "getbbox"):
        return ref.convert("RGB")
    if isinstance(ref, np.ndarray):
        return Image.fromarray(np.asarray(ref, np.uint8)).convert("RGB")
    return load_image(ref)


def _blank(img):
    from PIL import Image

    mean = np.asarray(img, np.float32).reshape(-1, 3).mean(0)
    return Image.new("RGB", img.size, tuple(int(round(c)) for c in mean))


def _maybe_await(out, then):
    """then(out), or a coroutine that awaits `out` first (episode methods may be `async def`)."""
    if inspect.isawaitable(out):
        async def done():
            return then(await out)
        return done()
    return then(out)


class ImageAblation:
    """`env` with every picture of its episodes' observations replaced (`mode`: blank | shuffle)."""

    def __init__(self, env, mode: str, seed: int = 0):
        if mode not in MODES[1:]:
            raise ValueError(f"image ablation: mode {mode!r} (expected one of {', '.join(MODES[1:])})")
        self.env, self.mode, self.seed = env, mode, seed
        self.name = getattr(env, "name", type(env).__name__)
        self.max_turns = getattr(env, "max_turns", 1)
        self._donor: dict[str, object] = {}  # task id -> the task whose opening picture it is shown (shuffle)
        self._pictures: dict[str, object] = {}  # task id -> its opening picture
        self.replaced = 0  # pictures replaced so far

    def tasks(self, split: str):
        tasks = self.env.tasks(split)
        if self.mode == "shuffle" and len(tasks) > 1:
            n = len(tasks)
            rng = np.random.default_rng([self.seed, n])
            shift = rng.permutation(n)  # i -> order[(pos(i) + 1) % n]: a derangement (a single cycle)
            for k in range(n):
                self._donor[tasks[shift[k]].id] = tasks[shift[(k + 1) % n]]
            for t in tasks:  # here, on the caller's thread: episodes may be async and run on an event loop later
                self.opening_picture(t)
        return tasks

    def episode(self):
        return _AblatedEpisode(self, self.env.episode())

    # ------------------------------------------------------------------ the replacement pictures
    def picture_for(self, task, img):
        if self.mode == "blank":
            return _blank(img)
        donor = self._donor.get(task.id)
        if donor is None:
            raise ValueError(f"image ablation shuffle: task {task.id!r} has no other task of its split to take a "
                             "picture from (call tasks(split) first; a split needs two tasks or more)")
        return self.opening_picture(donor).resize(img.size)

    def opening_picture(self, task):
        """The first picture of `task`'s opening observation (its episode started and closed once, cached)."""
        if task.id not in self._pictures:
            ep = self.env.episode()
            try:
                obs = _run(ep.start(task, f"ablation-{task.id}"))
            finally:
                _run(ep.close())
            pics = [p for m in obs.messages for p in _parts(m)]
            if not pics:
                raise ValueError(f"image ablation shuffle: task {task.id!r} opens without a picture")
            self._pictures[task.id] = _pil(_image_ref(pics[0], f"task {task.id}"))
        return self._pictures[task.id]


def _run(out):
    if inspect.isawaitable(out):
        import asyncio

        async def wait():
            return await out
        return asyncio.run(wait())
    return out


def _is_picture(part) -> bool:
    return isinstance(part, dict) and part.get("type") in ("image", "image_url")


def _parts(message: dict) -> list[dict]:
    content = message.get("content") if isinstance(message, dict) else None
    return [p for p in content if _is_picture(p)] if isinstance(content, list) else []


class _AblatedEpisode:
    def __init__(self, owner: ImageAblation, inner):
        self.owner, self.inner, self.task = owner, inner, None

    def _replace(self, obs):
        """The observation with new message dicts (the environment's own, e.g. a task's opening messages, are
        never changed) whose pictures are replaced."""
        def swap(p):
            if not _is_picture(p):
                return p
            self.owner.replaced += 1
            return {"type": "image", "image": self.owner.picture_for(self.task, _pil(_image_ref(p, "observation")))}

        obs.messages = [dict(m, content=[swap(p) for p in m["content"]])
                        if isinstance(m, dict) and isinstance(m.get("content"), list) else m for m in obs.messages]
        return obs

    def start(self, task, rollout_id: str):
        self.task = task
        return _maybe_await(self.inner.start(task, rollout_id), self._replace)

    def step(self, message: dict):
        return _maybe_await(self.inner.step(message), self._replace)

    def close(self):
        return self.inner.close()


def ablate(env, mode: str, seed: int = 0):
    """`env` as it is (`real`) or wrapped (`blank`, `shuffle`)."""
    return env if mode == "real" else ImageAblation(env, mode, seed)


def ablation_note(env) -> str | None:
    """After an eval: the line that says an ablation changed nothing (an environment that showed no picture, e.g.
    a text one), else None."""
    if isinstance(env, ImageAblation) and env.replaced == 0:
        return (f"--images {env.mode}: the {env.name} environment showed no pictures, so nothing was replaced: "
                "these figures are those of --images real")
    return None
