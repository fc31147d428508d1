"""Figures of runs' metrics.jsonl with matplotlib (the `plot` extra): `nemo-jax plot RUN_DIR [RUN_DIR ...]`.

One figure per group of metrics (loss, optimizer, throughput, expert load, rewards), one panel per unit, each
run's raw values faint and an exponential moving average solid; several run directories are overlaid.
`bar_chart` draws grouped bars (e.g. a recipe's stages x environments).
"""

from __future__ import annotations

import fnmatch
import json
import math
import os
from dataclasses import dataclass

from nemo_jax.extras import require

X_LABEL = "optimizer step"


@dataclass(frozen=True)
class Panel:
    ylabel: str  # with the unit
    patterns: tuple[str, ...]  # metric names (fnmatch patterns) drawn on this panel
    scale: float = 1.0  # multiply values by this (e.g. fraction -> percent)


@dataclass(frozen=True)
class Group:
    name: str  # file name: <out>/<name>.png
    title: str
    panels: tuple[Panel, ...]


GROUPS = (
    Group("loss", "Loss", (Panel("cross-entropy (nats/token)", ("loss", "eval_loss")),)),
    Group("optim", "Gradient norm and learning rate", (
        Panel("gradient norm (global L2, before clipping)", ("grad_norm",)),
        Panel("learning rate (per step)", ("lr",)))),
    Group("throughput", "Throughput and MFU", (
        Panel("throughput (tokens/s)", ("tokens_per_sec",)),
        Panel("MFU (% of dense bf16 peak)", ("mfu",), 100.0))),
    Group("expert_load", "MoE expert load", (
        Panel("tokens per expert / mean (ratio)", ("expert_load_max_over_mean", "expert_load_min_over_mean")),
        Panel("balance loss (dimensionless)", ("aux_loss",)))),
    Group("reward", "Rewards", (
        Panel("reward (per rollout)", ("reward*", "*_reward", "*/reward*")),
        Panel("response length (tokens)", ("response_len*", "*/response_len*")))),
)


def _matplotlib():
    """-> (Figure class, FigureCanvasAgg class); a clear install hint when matplotlib is missing."""
    figure = require("matplotlib.figure", "plot", "nemo-jax plot")
    agg = require("matplotlib.backends.backend_agg", "plot", "nemo-jax plot")
    return figure.Figure, agg.FigureCanvasAgg


def metrics_path(run_dir: str) -> str:
    path = run_dir if run_dir.endswith(".jsonl") else os.path.join(run_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: no such metrics file (is {run_dir!r} a run directory?)")
    return path


def read_metrics(run_dir: str) -> list[dict]:
    """The records of RUN_DIR/metrics.jsonl (or of a .jsonl path), in file order."""
    path = metrics_path(run_dir)
    out = []
    with open(path) as f:
        for i, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{i}: not a JSON record ({e})") from None
            if not isinstance(rec, dict) or not isinstance(rec.get("step"), int):
                raise ValueError(f"{path}:{i}: expected an object with an integer 'step'")
            out.append(rec)
    return out


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def scalar_keys(records: list[dict]) -> set[str]:
    return {k for r in records for k, v in r.items() if k != "step" and _number(v)}


def series(records: list[dict], key: str, scale: float = 1.0) -> tuple[list[int], list[float]]:
    """(steps, values) of one metric, sorted by step; a step logged twice (a resumed run) keeps its last value."""
    by_step = {r["step"]: r[key] * scale for r in records if _number(r.get(key))}
    steps = sorted(by_step)
    return steps, [by_step[s] for s in steps]


def ema(values: list[float], weight: float) -> list[float]:
    """Debiased exponential moving average (TensorBoard's smoothing); weight 0 returns the values."""
    out, acc = [], 0.0
    for i, v in enumerate(values, 1):
        acc = weight * acc + (1 - weight) * v
        out.append(acc / (1 - weight ** i) if weight else v)
    return out


def run_labels(run_dirs: list[str]) -> list[str]:
    """Legend names: the directory names, or the paths where two names collide."""
    names = [os.path.basename(os.path.normpath(d)) or d for d in run_dirs]
    return names if len(set(names)) == len(names) else [os.path.normpath(d) for d in run_dirs]


def _matches(key: str, patterns) -> bool:
    return any(fnmatch.fnmatchcase(key, p) for p in patterns)


def _rank(key: str, patterns) -> tuple[int, str]:
    """Keys in the order of the patterns they match (loss before eval_loss), then by name."""
    return next(i for i, p in enumerate(patterns) if fnmatch.fnmatchcase(key, p)), key


def plan_figures(present: set[str], keys: list[str] | None = None) -> list[tuple[Group, list[tuple[Panel, list[str]]]]]:
    """Which groups, panels and metric names to draw: every known group with data, or only `keys` (a key in
    no group gets its own panel in an `other` figure)."""
    wanted = present if keys is None else set(keys)
    plan, placed = [], set()
    for g in GROUPS:
        panels = []
        for p in g.panels:
            ks = sorted((k for k in wanted & present if _matches(k, p.patterns)), key=lambda k: _rank(k, p.patterns))
            if ks:
                panels.append((p, ks))
                placed.update(ks)
        if panels:
            plan.append((g, panels))
    if keys is not None:
        rest = [k for k in keys if k not in placed]
        if rest:
            plan.append((Group("other", "Other metrics", ()), [(Panel(k, (k,)), [k]) for k in rest]))
    return plan


def _save(fig, canvas_cls, path: str):
    canvas_cls(fig)
    tmp = path + ".tmp"
    fig.savefig(tmp, format="png", dpi=100)
    os.replace(tmp, path)


def _draw_panel(ax, panel: Panel, keys: list[str], runs: list[tuple[str, list[dict]]], smoothing: float, colors):
    """One run: a colour per metric. Several runs: a colour per run and a line style per metric."""
    from matplotlib.ticker import MaxNLocator  # present: plot_runs checked with _matplotlib()

    styles = ["-", "--", ":", "-."]
    for ri, (label, records) in enumerate(runs):
        for ki, key in enumerate(keys):
            color = colors[(ri if len(runs) > 1 else ki) % len(colors)]
            steps, values = series(records, key, panel.scale)
            if not steps:
                continue
            name = key if len(runs) == 1 else f"{label}: {key}"
            marker = "o" if len(steps) < 8 else None
            ax.plot(steps, values, color=color, alpha=0.3, linewidth=1, linestyle=styles[ki % len(styles)])
            ax.plot(steps, ema(values, smoothing), color=color, linewidth=2, linestyle=styles[ki % len(styles)],
                    marker=marker, markersize=4, label=name)
    ax.set_ylabel(panel.ylabel)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize="small")


def plot_runs(run_dirs: list[str], out_dir: str | None = None, keys: list[str] | None = None,
              smoothing: float = 0.6) -> list[str]:
    """One PNG per metric group for the runs in `run_dirs` (overlaid) -> the paths written, in `out_dir`
    (default: RUN_DIR/plots of the first run). `keys` restricts the figures to these metric names."""
    if not run_dirs:
        raise ValueError("plot: give at least one run directory")
    if not 0.0 <= smoothing < 1.0:
        raise ValueError(f"plot: smoothing {smoothing} must be in [0, 1)")
    Figure, Canvas = _matplotlib()
    runs = list(zip(run_labels(run_dirs), [read_metrics(d) for d in run_dirs]))
    present = set().union(*(scalar_keys(r) for _, r in runs))
    if keys is not None:
        missing = [k for k in keys if k not in present]
        if missing:
            raise ValueError(f"plot: --keys {', '.join(missing)} not in {', '.join(map(metrics_path, run_dirs))} "
                             f"(present: {', '.join(sorted(present)) or 'none'})")
    plan = plan_figures(present, keys)
    if not plan:
        raise ValueError(f"plot: no metrics to draw in {', '.join(map(metrics_path, run_dirs))}")
    out_dir = out_dir or os.path.join(run_dirs[0], "plots")
    os.makedirs(out_dir, exist_ok=True)
    colors = [f"C{i}" for i in range(10)]
    paths = []
    for group, panels in plan:
        fig = Figure(figsize=(8, 3.2 * len(panels)), layout="constrained")
        axes = fig.subplots(len(panels), 1, sharex=True, squeeze=False)[:, 0]
        for ax, (panel, ks) in zip(axes, panels):
            _draw_panel(ax, panel, ks, runs, smoothing, colors)
        axes[-1].set_xlabel(X_LABEL)
        fig.suptitle(f"{group.title}  (faint: raw, solid: EMA {smoothing:g})")
        path = os.path.join(out_dir, f"{group.name}.png")
        _save(fig, Canvas, path)
        paths.append(path)
    return paths


def bar_chart(table: dict[str, dict[str, float]], path: str, *, title: str = "", ylabel: str = "",
              value_format: str = "{:.3g}") -> str:
    """Grouped bars: `table[series][category] -> value` (e.g. stages x environments: one group of bars per
    environment, one bar per stage); a missing value leaves a gap. -> `path` (PNG)."""
    if not table:
        raise ValueError(f"bar_chart {path}: empty table")
    Figure, Canvas = _matplotlib()
    series_names = list(table)
    categories = list(dict.fromkeys(c for row in table.values() for c in row))
    width = 0.8 / len(series_names)
    fig = Figure(figsize=(max(6.0, 1.2 * len(categories) * max(1, len(series_names)) / 2 + 2), 4),
                 layout="constrained")
    ax = fig.subplots()
    for si, s in enumerate(series_names):
        xs = [ci + (si - (len(series_names) - 1) / 2) * width for ci, c in enumerate(categories) if c in table[s]]
        vs = [float(table[s][c]) for c in categories if c in table[s]]
        bars = ax.bar(xs, vs, width, label=s, color=f"C{si % 10}")
        ax.bar_label(bars, labels=[value_format.format(v) for v in vs], fontsize="x-small")
    ax.set_xticks(range(len(categories)), categories)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize="small")
    d = os.path.dirname(path)
    if d:
        os.makedirs(d, exist_ok=True)
    _save(fig, Canvas, path)
    return path
