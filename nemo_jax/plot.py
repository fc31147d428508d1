"""Figures of runs' metrics.jsonl with matplotlib (the `plot` extra): `nemo-jax plot RUN_DIR [RUN_DIR ...]`.

One figure per group of metrics (loss, optimizer, throughput, expert load, rewards), one panel per unit; several run
directories are overlaid. Dense series (logged at most steps: loss, grad norm, throughput, rewards) are drawn raw
and faint with an exponential moving average solid on top; sparse series (eval metrics, logged every few hundred
steps) are drawn raw with markers, so each point is a real value and the curve ends at the last one; schedules
(the learning rate) are never smoothed. A figure shows only the panels with data (no MFU panel without a known
device peak).
A GRPO run's `loss` is its policy loss, not a cross-entropy: it is drawn as `policy_loss` on a panel of its own,
never on the SFT loss axis. In a panel of several metrics each metric has its colour (and, with several runs,
each run its line style); a panel of one metric gives each run its colour.
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
    title: str  # what the panel shows (the figure's title joins those of the panels drawn)
    ylabel: str  # with the unit
    patterns: tuple[str, ...]  # metric names (fnmatch patterns) drawn on this panel
    scale: float = 1.0  # multiply values by this (e.g. fraction -> percent)
    smooth: bool = True  # False: a schedule or setting, drawn as logged


@dataclass(frozen=True)
class Group:
    name: str  # file name: <out>/<name>.png
    panels: tuple[Panel, ...]


GROUPS = (
    Group("loss", (Panel("Loss", "cross-entropy (nats/token)", ("loss", "eval_loss")),)),
    Group("optim", (
        Panel("Gradient norm", "gradient norm (global L2, before clipping)", ("grad_norm",)),
        Panel("learning rate", "learning rate (per step)", ("lr",), smooth=False))),
    Group("throughput", (
        Panel("Throughput", "throughput (tokens/s)", ("tokens_per_sec",)),
        Panel("MFU", "MFU (% of dense bf16 peak)", ("mfu",), 100.0))),
    Group("expert_load", (
        Panel("MoE expert load", "tokens per expert / mean (ratio)",
              ("expert_load_max_over_mean", "expert_load_min_over_mean")),
        Panel("balance loss", "balance loss (dimensionless)", ("aux_loss",)))),
    Group("reward", (
        Panel("Rewards", "reward (per rollout)", ("reward*", "*_reward", "*/reward*", "eval_reward*", "eval_pass*",
                                                  "eval_success*", "eval_consistency")),
        Panel("response length", "response length (tokens)", ("response_len*", "*/response_len*")))),
    Group("policy_loss", (Panel("Policy loss", "policy loss (the run's loss.kind objective)", ("policy_loss",)),)),
)
RL_MARKER = "reward_mean"  # a run that logs it is an RL run: its `loss` is a policy loss

SPARSE = 0.25  # a series logged at fewer than this share of the steps of the run's densest series is sparse


def have_matplotlib() -> bool:
    """Whether the `plot` extra is installed (asked before a long run that ends in a figure)."""
    import importlib.util

    try:
        return importlib.util.find_spec("matplotlib") is not None
    except (ImportError, ValueError):
        return False


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


def as_plotted(records: list[dict]) -> list[dict]:
    """An RL run's records with its `loss` named `policy_loss` (an SFT run's as they are)."""
    if not any(RL_MARKER in r for r in records):
        return records
    return [{("policy_loss" if k == "loss" else k): v for k, v in r.items()} for r in records]


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


def is_sparse(records: list[dict], key: str) -> bool:
    """Whether `key` is logged at few of the run's logged steps (eval metrics): drawn raw, never smoothed."""
    counts = {}
    for r in records:
        for k, v in r.items():
            if k != "step" and _number(v):
                counts[k] = counts.get(k, 0) + 1
    dense = max(counts.values(), default=0)
    return counts.get(key, 0) < max(2, SPARSE * dense)


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
            plan.append((Group("other", ()), [(Panel(k, k, (k,)), [k]) for k in rest]))
    return plan


def _save(fig, canvas_cls, path: str):
    canvas_cls(fig)
    tmp = path + ".tmp"
    fig.savefig(tmp, format="png", dpi=100)
    os.replace(tmp, path)


def _draw_panel(ax, panel: Panel, keys: list[str], runs: list[tuple[str, list[dict]]], smoothing: float,
                colors) -> bool:
    """Several metrics: a colour per metric, and with several runs a line style per run. One metric: a colour per
    run. (Only metrics and runs with data in the panel count.) -> whether any curve was smoothed."""
    from matplotlib.ticker import MaxNLocator  # present: plot_runs checked with _matplotlib()

    styles = ["-", "--", ":", "-."]
    smoothed = False
    drawn = [k for k in keys if any(series(r, k)[0] for _, r in runs)]
    with_data = [ri for ri, (_, r) in enumerate(runs) if any(series(r, k)[0] for k in drawn)]
    for ri, (label, records) in enumerate(runs):
        for ki, key in enumerate(drawn):
            color = colors[(ki if len(drawn) > 1 else with_data.index(ri) if ri in with_data else ri) % len(colors)]
            style = styles[with_data.index(ri) % len(styles)] if len(drawn) > 1 and len(with_data) > 1 else "-"
            steps, values = series(records, key, panel.scale)
            if not steps:
                continue
            name = key if len(runs) == 1 else f"{label}: {key}"
            if not panel.smooth or not smoothing or is_sparse(records, key):  # every point a real value
                ax.plot(steps, values, color=color, linewidth=1.5, linestyle=style,
                        marker="o" if is_sparse(records, key) or len(steps) < 8 else None, markersize=4, label=name)
                continue
            ax.plot(steps, values, color=color, alpha=0.3, linewidth=1, linestyle=style)
            ax.plot(steps, ema(values, smoothing), color=color, linewidth=2, linestyle=style, label=name)
            smoothed = True
    ax.set_ylabel(panel.ylabel)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize="small")
    return smoothed


def figure_title(panels: list[Panel]) -> str:
    """The titles of the panels drawn: "Throughput" alone, "Throughput and MFU" when MFU was logged."""
    names = [p.title for p in panels]
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]


def figures(run_dirs: list[str], keys: list[str] | None = None, smoothing: float = 0.6) -> list[tuple[str, object]]:
    """(name, matplotlib Figure) per metric group for the runs in `run_dirs` (overlaid); `keys` restricts the
    figures to these metric names."""
    if not run_dirs:
        raise ValueError("plot: give at least one run directory")
    if not 0.0 <= smoothing < 1.0:
        raise ValueError(f"plot: smoothing {smoothing} must be in [0, 1)")
    Figure, _ = _matplotlib()
    runs = list(zip(run_labels(run_dirs), [as_plotted(read_metrics(d)) for d in run_dirs]))
    present = set().union(*(scalar_keys(r) for _, r in runs))
    if keys is not None:
        missing = [k for k in keys if k not in present]
        if missing:
            raise ValueError(f"plot: --keys {', '.join(missing)} not in {', '.join(map(metrics_path, run_dirs))} "
                             f"(present: {', '.join(sorted(present)) or 'none'})")
    plan = plan_figures(present, keys)
    if not plan:
        raise ValueError(f"plot: no metrics to draw in {', '.join(map(metrics_path, run_dirs))}")
    colors = [f"C{i}" for i in range(10)]
    out = []
    for group, panels in plan:
        fig = Figure(figsize=(8, 3.2 * len(panels)), layout="constrained")
        axes = fig.subplots(len(panels), 1, sharex=True, squeeze=False)[:, 0]
        smoothed = [_draw_panel(ax, panel, ks, runs, smoothing, colors) for ax, (panel, ks) in zip(axes, panels)]
        axes[-1].set_xlabel(X_LABEL)
        title = figure_title([p for p, _ in panels]) if group.name != "other" else "Other metrics"
        fig.suptitle(title + (f"  (faint: raw, solid: EMA {smoothing:g})" if any(smoothed) else ""))
        out.append((group.name, fig))
    return out


def plot_runs(run_dirs: list[str], out_dir: str | None = None, keys: list[str] | None = None,
              smoothing: float = 0.6) -> list[str]:
    """One PNG per metric group (`figures`) -> the paths written, in `out_dir` (default: RUN_DIR/plots of the
    first run)."""
    figs = figures(run_dirs, keys, smoothing)
    _, Canvas = _matplotlib()
    out_dir = out_dir or os.path.join(run_dirs[0], "plots")
    os.makedirs(out_dir, exist_ok=True)
    paths = []
    for name, fig in figs:
        path = os.path.join(out_dir, f"{name}.png")
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
