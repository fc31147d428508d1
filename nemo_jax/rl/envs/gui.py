"""`gui`: a computer-use environment at tiny scale. Each task is a generated screen (PIL: a window with coloured
buttons and a text box) and an instruction; the agent sees screenshots and acts with one action per turn:

    click X,Y        a left click at pixel (X, Y) (origin top left)
    type TEXT        types TEXT into the focused text box
    key NAME         presses a key (Enter, Escape, Tab, ...)

After each action the next observation is a tool message with the new screenshot. Task families:

  click   "Click the COLOR button." - one click; reward 1 inside the button, partial credit for a click near it
          (1/2 x (1 - distance / radius) beyond its edge), 0 for anything else. `n_buttons` coloured buttons on the
          screen: the target and n_buttons - 1 distractors; a range [lo, hi] draws the count per task (a ladder of
          difficulty the curriculum climbs; rewards are logged per count: family `click1`, `click2`, ...)
  form    "Type WORD in the box and press Enter." - click the box (it gets a blue border), type the word, press
          Enter; reward = thirds for the box focused, the word typed, Enter pressed after it (a wrong word earns the
          share of its letters that match); success = all three. Typing while no box has focus types nothing, and
          the answer says so

An answer that is not an action ends the episode with the reward earned so far. Screens are `size` pixels square
(64: the tiny VL model's whole patch budget, one language token per 16 x 16 pixels); train and eval screens come
from different seeds. `demonstrations(split, n)` writes the expert's conversations (the SFT data of the tiny VL
recipe: `python -m nemo_jax.rl.envs.gui --out DIR`).
"""

from __future__ import annotations

import re

import numpy as np

from nemo_jax.rl.envs.episode import HistoryEnv, Observation, Task, demonstrations, portable

COLORS = {"red": (220, 40, 40), "green": (40, 180, 60), "blue": (50, 80, 230), "yellow": (235, 210, 40),
          "black": (20, 20, 20), "purple": (150, 60, 190)}
WORDS = ("cat", "dog", "sun", "map", "box", "red", "tea", "pen", "cup", "hat")
ACTION = re.compile(r"^\s*(click)\s*(-?\d+)\s*,\s*(-?\d+)\s*$|^\s*(type)\s+(.+?)\s*$|^\s*(key)\s+(\w+)\s*$", re.I)
BACKGROUND, WINDOW, TITLE = (200, 200, 200), (240, 240, 240), (90, 110, 160)


def parse_action(text: str):
    """'click X,Y' -> ("click", (x, y)); 'type TEXT' -> ("type", text); 'key NAME' -> ("key", name); else None."""
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    m = ACTION.match(lines[-1]) if lines else None
    if not m:
        return None
    if m.group(1):
        return "click", (int(m.group(2)), int(m.group(3)))
    if m.group(4):
        return "type", m.group(5)
    return "key", m.group(7)


def _distance(box, x: int, y: int) -> float:
    x0, y0, x1, y1 = box
    return float(np.hypot(max(x0 - x, 0, x - x1), max(y0 - y, 0, y - y1)))


def _count_range(n) -> tuple[int, int]:
    """n_buttons: a count or [lo, hi] -> (lo, hi); (0, 0) for anything else (refused by the caller)."""
    if isinstance(n, int) and not isinstance(n, bool):
        return n, n
    if isinstance(n, (list, tuple)) and len(n) == 2 and all(isinstance(x, int) and not isinstance(x, bool) for x in n):
        return int(n[0]), int(n[1])
    return 0, 0


class Screen:
    """A window with buttons and (form tasks) a text box; renders itself and takes actions."""

    def __init__(self, layout: dict, size: int):
        self.layout, self.size = layout, size
        self.focused, self.typed, self.entered, self.clicks = False, "", False, []

    def render(self):
        from PIL import Image, ImageDraw

        s, cell = self.size, self.size // 4
        img = Image.new("RGB", (s, s), BACKGROUND)
        d = ImageDraw.Draw(img)
        d.rectangle([1, 1, s - 2, s - 2], fill=WINDOW, outline=(120, 120, 120))
        d.rectangle([1, 1, s - 2, max(3, cell // 4)], fill=TITLE)
        for name, box in self.layout["buttons"].items():
            d.rectangle(box, fill=COLORS[name], outline=(60, 60, 60))
        if "box" in self.layout:
            x0, y0, x1, y1 = self.layout["box"]
            d.rectangle([x0, y0, x1, y1], fill=(255, 255, 255),
                        outline=(40, 90, 240) if self.focused else (90, 90, 90), width=2 if self.focused else 1)
            for i, _ in enumerate(self.typed[:(x1 - x0 - 4) // 3]):  # one dark mark per letter
                d.rectangle([x0 + 3 + 3 * i, y0 + 3, x0 + 4 + 3 * i, y1 - 3], fill=(30, 30, 30))
            if self.entered:
                d.rectangle([x1 - 4, y0 + 2, x1 - 2, y0 + 4], fill=(40, 180, 60))
        return img

    def act(self, action) -> str:
        """Apply an action -> the text of the answer ("ok", or what went wrong where a screen would not show it)."""
        kind, arg = action
        if kind == "click":
            self.clicks.append(arg)
            if "box" in self.layout:
                self.focused = _distance(self.layout["box"], *arg) == 0
        elif kind == "type":
            if not self.focused:
                return "nothing typed: no text box has focus"
            self.typed += arg
        elif kind == "key" and arg.lower() in ("enter", "return") and self.typed:
            self.entered = True
        return "ok"


class GUIEpisode:
    def __init__(self, env: "GUIEnv"):
        self.env = env

    def start(self, task: Task, rollout_id: str) -> Observation:
        self.task, self.screen, self.turns = task, Screen(task.data, self.env.size), 0
        return Observation([{"role": "user", "content": [{"type": "text", "text": task.data["instruction"] + "\n"},
                                                         {"type": "image", "image": self.screen.render()}]}])

    def _score(self) -> tuple[float, bool]:
        d, sc = self.task.data, self.screen
        if d["family"] == "click":
            if not sc.clicks:
                return 0.0, False
            dist = _distance(d["buttons"][d["target"]], *sc.clicks[-1])
            return (1.0, True) if dist == 0 else (max(0.0, 0.5 * (1 - dist / self.env.radius)), False)
        word = d["word"]
        typed = sum(a == b for a, b in zip(sc.typed, word)) / max(len(word), len(sc.typed), 1)
        r = (sc.focused or bool(sc.typed)) / 3 + typed / 3 + (sc.entered and sc.typed == word) / 3
        return r, sc.typed == word and sc.entered

    def step(self, message: dict) -> Observation:
        self.turns += 1
        action = parse_action(message.get("content") or "")
        if action is None:  # not an action: the episode ends here
            reward, success = self._score()
            return Observation([], reward, True, success, {"invalid_action": 1})
        said = self.screen.act(action)
        reward, success = self._score()
        done = success or self.task.data["family"] == "click"
        shot = [{"role": "tool", "content": [{"type": "image", "image": self.screen.render()},
                                             {"type": "text", "text": said}]}]
        return Observation([] if done else shot, reward, done, success)

    def close(self) -> None:
        self.screen = None


class GUIEnv(HistoryEnv):
    """Generated screens; train and eval from disjoint seeds (`n_train`, `n_eval` tasks)."""
    name = "gui"

    def __init__(self, families=("click", "form"), n_train: int = 256, n_eval: int = 64, seed: int = 0,
                 size: int = 64, n_buttons=4, max_turns: int = 4, radius: float = 16.0):
        unknown = set(families) - {"click", "form"}
        if unknown or not families:
            raise ValueError(f"gui env: families {sorted(unknown) or '[]'} (known: click, form)")
        lo, hi = _count_range(n_buttons)
        if size < 32 or size % 4 or not 1 <= lo <= hi <= len(COLORS):
            raise ValueError(f"gui env: size >= 32 (a multiple of 4) and n_buttons a count or a range [lo, hi] "
                             f"within 1..{len(COLORS)} (got size {size}, n_buttons {n_buttons!r})")
        self.families, self.size, self.n_buttons = tuple(families), size, (lo, hi)
        self.max_turns, self.radius = max_turns, radius
        self._split = {s: [self._make(f"{s}-{i}", np.random.default_rng([seed, k, i])) for i in range(n)]
                       for k, (s, n) in enumerate((("train", n_train), ("eval", n_eval)))}

    def _make(self, tid: str, rng) -> Task:
        cell = self.size // 4
        family = self.families[int(rng.integers(len(self.families)))]
        cells = rng.permutation(np.arange(4, 16))  # the top row holds the title bar
        lo, hi = self.n_buttons
        n = lo if lo == hi else int(rng.integers(lo, hi + 1))
        names = rng.choice(sorted(COLORS), n, replace=False).tolist()
        pad = cell // 6
        boxes = {}
        for name, c in zip(names, cells):
            r, q = divmod(int(c), 4)
            boxes[name] = [q * cell + pad, r * cell + pad, (q + 1) * cell - pad - 1, (r + 1) * cell - pad - 1]
        layout = {"family": family, "buttons": boxes}
        if family == "click":
            layout["target"] = names[int(rng.integers(len(names)))]
            layout["instruction"] = f"Click the {layout['target']} button."
            family = f"click{n}"
        else:
            r = int(rng.integers(1, 4))
            free = [b for b in boxes if boxes[b][1] // cell == r]
            for b in free:  # the text box takes a whole row
                del boxes[b]
            layout["box"] = [pad, r * cell + pad, self.size - pad - 1, (r + 1) * cell - pad - 1]
            layout["word"] = str(rng.choice(WORDS))
            layout["instruction"] = f"Type {layout['word']} in the box and press Enter."
        return Task(tid, (), layout, family)

    def tasks(self, split: str) -> list[Task]:
        return self._split[split]

    def episode(self) -> GUIEpisode:
        return GUIEpisode(self)

    # ------------------------------------------------------------------ demonstrations (SFT data)
    @staticmethod
    def expert(task: Task) -> list[str]:
        """The expert's actions for a task (clicks at the target's centre)."""
        d = task.data
        if d["family"] == "click":
            x0, y0, x1, y1 = d["buttons"][d["target"]]
            return [f"click {(x0 + x1) // 2},{(y0 + y1) // 2}"]
        x0, y0, x1, y1 = d["box"]
        return [f"click {(x0 + x1) // 2},{(y0 + y1) // 2}", f"type {d['word']}", "key Enter"]

    def demonstrations(self, split: str, n: int | None = None) -> list[dict]:
        """The expert's conversations on the first `n` tasks of `split` -> SFT records {"messages": [...]}, each
        screenshot an image part holding a PNG data URL (the records stand alone)."""
        return demonstrations(self, split, n, message=portable)


if __name__ == "__main__":  # (the demonstrations as SFT data: `nemo-jax demos --env gui`)
    from nemo_jax.rl.envs.demos import main

    main(env="gui")
