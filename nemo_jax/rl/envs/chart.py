"""`chart`: read a value off a chart drawn with known values. The vision-language model sees the chart in its
prompt; its tools (nemo_jax.rl.envs.code_tools) are `python` (a stateful interpreter in a sandbox whose folder holds
the chart as `chart.png`: measure it with PIL / numpy) and the image tools `crop(x0, y0, x1, y1)` and
`zoom(x, y, factor)` (answered with the enlarged part of the chart as an image). A turn without a tool call is
the answer: its last number is graded by relative error |answer - value| / |value|: reward 1 within `tolerance`
(success), else half credit fading to 0 at a relative error of `falloff`; no number (or the last turn spent on
a tool call) earns 0.

Charts (`style`):
  bars    (default) PIL, `size` pixels square (64: the tiny VL model's whole patch budget): 1-3 bars (red, green,
          blue) on a white plot, a grey axis; value 0 at row `BASE`, `PX` pixels per unit, values in halves from
          0.5 to 10. "What is the value of the red bar?"
  plot    matplotlib bar charts with ticks and gridlines, any size, values with one decimal: the scale must be
          read from the tick labels (the expert measures with the axis' pixel transform)

Families `bars1`, `bars2`, `bars3` by bar count. `expert(task)` names the asked bar ("The green bar:"), measures it
with the python tool and answers the number it printed; `demonstrations(split, n, direct=share)` writes the
expert's conversations, a `direct` share of them answering at a glance instead (the bar named, then the true value,
no tool): a model trained on both has two ways to answer, and RL can learn which one pays.
"""

from __future__ import annotations

import io

import numpy as np

from nemo_jax.extras import require
from nemo_jax.rl.envs.code_tools import CodeEpisode, call
from nemo_jax.rl.envs.episode import Observation, Task, demonstrations, last_number, portable

COLORS = {"red": (220, 40, 40), "green": (40, 160, 60), "blue": (50, 80, 230)}
BASE, PX, TOP = 56, 4, 16  # bars style: row of value 0, pixels per unit, row of value 10


def render_bars(values: dict, size: int = 64):
    """The `bars` chart: {colour: value} left to right."""
    from PIL import Image, ImageDraw

    scale = size / 64
    img = Image.new("RGB", (size, size), (255, 255, 255))
    d = ImageDraw.Draw(img)
    base, top = round(BASE * scale), round(TOP * scale)
    for v in (5, 10):  # light gridlines at 5 and 10
        y = base - round(v * PX * scale)
        d.line([(6 * scale, y), (size - 2, y)], fill=(225, 225, 225))
    d.line([(5 * scale, top), (5 * scale, base)], fill=(128, 128, 128))
    d.line([(5 * scale, base), (size - 2, base)], fill=(128, 128, 128))
    slot = (size - 8 * scale) / 3
    for i, (name, v) in enumerate(values.items()):
        x0 = round(8 * scale + i * slot + slot * 0.2)
        x1 = round(8 * scale + (i + 1) * slot - slot * 0.2) - 1
        h = round(v * PX * scale)
        d.rectangle([x0, base - h, x1, base - 1], fill=COLORS[name])
    return img


def render_plot(values: dict, size: int):
    """The `plot` chart (matplotlib) -> (image, (row of value 0, rows per unit)) from the axis' transform."""
    matplotlib = require("matplotlib", "sandbox", "the chart environment's `plot` charts")

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from PIL import Image

    dpi = 100
    fig, ax = plt.subplots(figsize=(size / dpi, size / dpi), dpi=dpi)
    names = list(values)
    ax.bar(range(len(names)), [values[n] for n in names], color=[np.array(COLORS[n]) / 255 for n in names])
    ax.set_xticks(range(len(names)), names)
    ax.set_ylim(0, max(10.0, max(values.values()) * 1.15))
    ax.grid(axis="y", alpha=0.4)
    fig.tight_layout()
    fig.canvas.draw()
    img = Image.frombuffer("RGBA", fig.canvas.get_width_height(), fig.canvas.buffer_rgba()).convert("RGB")
    h = fig.canvas.get_width_height()[1]
    y0 = h - ax.transData.transform((0, 0))[1]
    y1 = h - ax.transData.transform((0, 1))[1]
    plt.close(fig)
    return img, (float(y0), float(y0 - y1))


def png(img) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


class ChartEpisode(CodeEpisode):
    def __init__(self, env: "ChartEnv"):
        super().__init__(env.spec, env.tools, env.max_calls)
        self.env = env

    def start(self, task: Task, rollout_id: str) -> Observation:
        self.task, self.rollout_id, self.turns = task, rollout_id, 0
        self.image = self.env.render(task)
        q = task.data["question"] + " Answer with a number."
        return Observation([{"role": "user", "content": [{"type": "image", "image": self.image},
                                                         {"type": "text", "text": "\n" + q}]}], tools=self.defs)

    def initial_files(self) -> dict:
        return {"chart.png": png(self.image)}

    def step(self, message: dict) -> Observation:
        self.turns += 1
        calls = self.calls(message)
        if calls:
            out = self.run_calls(calls)
            done = self.turns >= self.env.max_turns
            return Observation([] if done else out, 0.0, done, False, dict(self.stats, answered=0))
        reward, success, err = self.env.grade(self.task, message.get("content") or "")
        info = dict(self.stats, answered=1, used_python=int(self.session is not None))
        if err is not None:
            info["rel_error"] = round(err, 6)
        return Observation([], reward, True, success, info)

    # image tools: the env's own picture, enlarged to the chart's size
    def _show(self, box, what: str):
        w, h = self.image.size
        x0, y0, x1, y1 = (int(v) for v in box)
        x0, x1 = sorted((max(0, min(w, x0)), max(0, min(w, x1))))
        y0, y1 = sorted((max(0, min(h, y0)), max(0, min(h, y1))))
        if x1 - x0 < 1 or y1 - y0 < 1:
            return f"error: {what}: the box ({x0}, {y0}, {x1}, {y1}) holds no pixel of the {w}x{h} chart"
        from PIL import Image

        part = self.image.crop((x0, y0, x1, y1))
        k = min(w / part.width, h / part.height)
        part = part.resize((max(1, round(part.width * k)), max(1, round(part.height * k))), Image.NEAREST)
        return [{"type": "image", "image": part}, {"type": "text", "text": f"{what} ({x0}, {y0}, {x1}, {y1})"}]

    def tool_crop(self, x0=0, y0=0, x1=0, y1=0, **_):
        try:
            return self._show((x0, y0, x1, y1), "crop")
        except (TypeError, ValueError):
            return "error: crop needs integer x0, y0, x1, y1"

    def tool_zoom(self, x=0, y=0, factor=2, **_):
        try:
            f = max(2, min(8, int(factor)))
            w, h = self.image.size
            half_w, half_h = w / (2 * f), h / (2 * f)
            return self._show((int(x) - half_w, int(y) - half_h, int(x) + half_w, int(y) + half_h), f"zoom x{f}")
        except (TypeError, ValueError):
            return "error: zoom needs integer x, y and factor"


class ChartEnv:
    """Charts with known values (module docstring); `sandbox`: nemo_jax.sandbox.SandboxSpec's fields (the python
    tool's sandbox gets numpy, PIL and matplotlib unless `packages` says otherwise)."""
    name = "chart"

    def __init__(self, n_train: int = 256, n_eval: int = 64, seed: int = 0, style: str = "bars", size: int = 64,
                 n_bars=(1, 3), max_turns: int = 3, max_calls: int = 2, tolerance: float = 0.05,
                 falloff: float = 0.5, sandbox: dict | None = None, tools=("python", "crop", "zoom"),
                 timeout_s: float = 0.0):
        from nemo_jax.sandbox import SandboxSpec, check

        if style not in ("bars", "plot"):
            raise ValueError(f"chart env: style {style!r} (known: bars, plot)")
        if set(tools) - {"python", "crop", "zoom"} or not tools:
            raise ValueError(f"chart env: tools {list(tools)} (known: python, crop, zoom)")
        lo, hi = (n_bars, n_bars) if isinstance(n_bars, int) else tuple(n_bars)
        if not 1 <= lo <= hi <= len(COLORS) or size < 32 or not 0 < tolerance < falloff:
            raise ValueError(f"chart env: n_bars within 1..{len(COLORS)}, size >= 32, 0 < tolerance < falloff "
                             f"(got {n_bars!r}, {size}, {tolerance}, {falloff})")
        spec = dict(sandbox or {})
        spec.setdefault("packages", ["numpy", "pillow", "matplotlib"])
        spec.setdefault("limits", {"memory_mb": 1536})
        self.spec = SandboxSpec.from_dict(spec, "chart env: sandbox")
        self.backend = check(self.spec)  # one clear error now, not a failed episode later
        self.style, self.size, self.n_bars = style, int(size), (lo, hi)
        self.max_turns, self.max_calls, self.tools = int(max_turns), int(max_calls), tuple(tools)
        self.tolerance, self.falloff, self.timeout_s = float(tolerance), float(falloff), float(timeout_s)
        self._split = {s: [self._make(f"{s}-{i}", np.random.default_rng([seed, k, i])) for i in range(n)]
                       for k, (s, n) in enumerate((("train", n_train), ("eval", n_eval)))}
        self._images: dict = {}

    def _make(self, tid: str, rng) -> Task:
        lo, hi = self.n_bars
        n = lo if lo == hi else int(rng.integers(lo, hi + 1))
        names = [str(c) for c in rng.choice(list(COLORS), n, replace=False)]
        if self.style == "bars":
            vals = [float(rng.integers(1, 21)) / 2 for _ in names]
        else:
            vals = [float(rng.integers(5, 150)) / 10 for _ in names]
        values = dict(zip(names, vals))
        target = names[int(rng.integers(n))]
        return Task(tid, (), {"values": values, "target": target, "value": values[target],
                              "question": f"What is the value of the {target} bar?"}, f"bars{n}")

    def tasks(self, split: str) -> list[Task]:
        return self._split[split]

    def episode(self) -> ChartEpisode:
        return ChartEpisode(self)

    def render(self, task: Task):
        if self.style == "bars":
            return render_bars(task.data["values"], self.size)
        img, scale = render_plot(task.data["values"], self.size)
        task.data.setdefault("scale", scale)
        return img

    def grade(self, task: Task, text: str) -> tuple[float, bool, float | None]:
        """(reward, success, relative error) of an answer."""
        x = last_number(text)
        if x is None:
            return 0.0, False, None
        err = abs(x - task.data["value"]) / abs(task.data["value"])
        if err <= self.tolerance:
            return 1.0, True, err
        return max(0.0, 0.5 * (1 - err / self.falloff)), False, err

    # ------------------------------------------------------------------ demonstrations (SFT data)
    def expert_code(self, task: Task) -> str:
        """Python that finds the target bar's top row in chart.png and prints its value. It names the bar by the
        question's colour word (`bar='green'`) and looks the RGB up in a table it writes out: a word to copy, not a
        tuple to recall (the tiny model copies the word it has just written; it never learned which tuple a colour
        asked ~150 tokens back means)."""
        table = "{" + ",".join(f"'{k}':({r},{g},{b})" for k, (r, g, b) in COLORS.items()) + "}"
        head = f"bar='{task.data['target']}'\nc={table}[bar]\nfrom PIL import Image\n"
        if self.style == "bars":
            base, px = BASE * self.size / 64, PX * self.size / 64
            return (head + "im=Image.open('chart.png')\n"
                    f"print(({base:g}-min(y for y in range({self.size}) for x in range({self.size}) "
                    f"if im.getpixel((x,y))==c))/{px:g})")
        if "scale" not in task.data:
            self.render(task)
        base, px = task.data["scale"]
        return (head + "im=Image.open('chart.png').convert('RGB')\n"
                f"print(round(({base:g}-min(y for y in range(im.height) for x in range(im.width) "
                f"if im.getpixel((x,y))==c))/{px:g},1))")

    def expert(self, task: Task) -> list[str]:
        """Name the asked bar, measure it with python, then answer the number."""
        return [f"{self.named(task)}\n" + call("python", code=self.expert_code(task)), f"{task.data['value']:g}"]

    @staticmethod
    def named(task: Task) -> str:
        """How the expert's first turn opens, measuring or at a glance: the asked bar, copied from the question
        while it is near."""
        return f"The {task.data['target']} bar:"

    def demonstrations(self, split: str, n: int | None = None, direct: float = 0.0, seed: int = 0) -> list[dict]:
        """The expert's conversations on the first `n` tasks of `split` (tool results from real episodes; the chart
        a PNG data URL) -> SFT records {"messages", "tools"}; a `direct` share answer at a glance instead."""
        rng = np.random.default_rng(seed)
        return demonstrations(self, split, n, message=portable, turns_of=lambda task: (
            [f"{self.named(task)} {task.data['value']:g}"] if rng.random() < direct else self.expert(task)))


if __name__ == "__main__":  # (the demonstrations as SFT data: `nemo-jax demos --env chart`)
    from nemo_jax.rl.envs.demos import main

    main(env="chart")
