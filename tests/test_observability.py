"""Metrics sink and plots: TensorBoard event files (read back with tensorboard's reader), a W&B offline run
(read back from its .wandb record log), `nemo-jax plot` PNGs for one run and two runs overlaid, clear errors
for a missing extra."""

import glob
import json
import math
import os
import struct
import sys
import time

import jax
import numpy as np
import pytest
from helpers import micro_model

from nemo_jax.cli import main as cli_main
from nemo_jax.config.load import load_config
from nemo_jax.config.train import LoggingSection, SFTConfig, WandbSection
from nemo_jax.extras import MissingDependency
from nemo_jax.plot import bar_chart, figures, plot_runs
from nemo_jax.train.metrics import MetricsLogger, check_logging
from nemo_jax.train.sft import Trainer

BASE = ["steps=4", "log_every=2", "eval_every=2", "data.batch_size=2", "data.seq_len=64", "checkpoint.every=0",
        "checkpoint.async_save=false", "optim.warmup_steps=2"]
# run b trains on a weighted mixture of the two shipped chat files
MIXTURE = ("data.sources=[{path: 'builtin:tiny_chat/train.jsonl', weight: 3}, "
           "{path: 'builtin:tiny_chat/eval.jsonl', weight: 1}]")
WANDB_ENV = {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_CONSOLE": "off", "WANDB_DISABLE_GIT": "true"}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Two finished tiny runs: `a` logs to TensorBoard and to an offline W&B run, `b` (other model and data
    seeds) to metrics.jsonl only."""
    root = tmp_path_factory.mktemp("obs")
    # the tiny model cut to an attention and a MoE layer: what is logged (expert load included), not the layer kinds
    model = f"model.config={micro_model(root, kinds=('full_attention', 'moe'))}"
    with pytest.MonkeyPatch.context() as mp:
        for k, v in {**WANDB_ENV, "WANDB_DIR": str(root / "wandb_home")}.items():
            mp.setenv(k, v)
        a = load_config(SFTConfig, None, BASE + [model, f"run_dir={root / 'a'}", "name=run-a",
                                                 "logging.wandb.project=nemo-jax-tests", "logging.wandb.mode=offline"])
        ta = Trainer(a, quiet=True, devices=jax.devices()[:1])
        ta.run()
        b = load_config(SFTConfig, None, BASE + [model, f"run_dir={root / 'b'}", "model.seed=1", "data.seed=1",
                                                 "logging.tensorboard=false", MIXTURE])
        tb = Trainer(b, quiet=True, devices=jax.devices()[:1])
        # same model, shapes, shardings and optimizer: reuse a's compiled steps (this file tests logging, and
        # compiling them again would double its time)
        tb.step_fn, tb.eval_fn = ta.step_fn, ta.eval_fn
        tb.run()
    return {"a": str(root / "a"), "b": str(root / "b"), "root": root}


def records(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def expected_scalars(recs) -> dict[str, dict[int, float]]:
    out = {}
    for r in recs:
        for k, v in r.items():
            if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool):
                out.setdefault(k, {})[r["step"]] = float(v)
    return out


# ----------------------------------------------------------------------------------------------- TensorBoard
@pytest.mark.slow
def test_tensorboard_events_hold_every_logged_scalar_and_expert_load(runs):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    recs = records(runs["a"])
    want = expected_scalars(recs)
    assert {"loss", "eval_loss", "grad_norm", "lr", "tokens_per_sec", "aux_loss"} <= set(want)
    assert sorted(want["loss"]) == [2, 4] and sorted(want["eval_loss"]) == [0, 2, 4]
    ea = EventAccumulator(os.path.join(runs["a"], "tensorboard"), size_guidance={"scalars": 0, "histograms": 0})
    ea.Reload()
    assert set(ea.Tags()["scalars"]) == set(want)
    for k, by_step in want.items():
        got = {e.step: e.value for e in ea.Scalars(k)}
        assert sorted(got) == sorted(by_step), k
        for s, v in by_step.items():
            assert math.isclose(got[s], v, rel_tol=1e-6, abs_tol=1e-9), (k, s, got[s], v)
    loads = {r["step"]: np.asarray(r["expert_load"]) for r in recs if "expert_load" in r}
    assert sorted(loads) == [2, 4] and loads[2].ndim == 2  # [n_moe, E]
    hist = {e.step: e.histogram_value for e in ea.Histograms("expert_load")}
    assert sorted(hist) == [2, 4]
    for s, load in loads.items():
        assert hist[s].num == load.size
        assert math.isclose(hist[s].sum, float(load.sum()), rel_tol=1e-6)
        assert math.isclose(hist[s].max, float(load.max()), rel_tol=1e-6)
    assert "config/text_summary" in ea.Tags()["tensors"]  # the resolved config, as text


def test_tensorboard_off_writes_no_event_files(runs):
    assert not os.path.exists(os.path.join(runs["b"], "tensorboard"))
    got = expected_scalars(records(runs["b"]))
    assert got["loss"].keys() == {2, 4}
    # the mixture run logs each source's tokens (cumulative) and the packing figures
    assert got["source_tokens/train"][4] > got["source_tokens/train"][2] > 0 and got["source_tokens/eval"][4] >= 0
    assert 0.5 < got["packing_efficiency"][4] <= 1.0 and "packing_efficiency" in expected_scalars(records(runs["a"]))


# ---------------------------------------------------------------------------------------------------- W&B
def wandb_records(path):
    """Records of a .wandb file: wandb's LevelDB-style log (7-byte file header ':W&B' + magic + version; 32 KiB
    blocks of chunks [crc32c u32, length u16, type u8]; type 1 full, 2 first, 3 middle, 4 last)."""
    from wandb.proto import wandb_internal_pb2 as pb

    with open(path, "rb") as f:
        data = f.read()
    assert data[:4] == b":W&B", data[:7]
    pos, parts = 7, []
    while pos + 7 <= len(data):
        left = 32768 - pos % 32768
        if left < 7:
            pos += left
            continue
        _crc, n, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if n == 0 and kind == 0:  # block padding
            pos += left
            continue
        parts.append(data[pos + 7:pos + 7 + n])
        pos += 7 + n
        if kind in (1, 4):
            rec = pb.Record()
            rec.ParseFromString(b"".join(parts))
            parts = []
            yield rec


def wandb_history(path) -> tuple[dict[int, dict], object]:
    """-> ({step: {key: value}}, the run record) of one offline run file."""
    rows, run = {}, None
    for r in wandb_records(path):
        kind = r.WhichOneof("record_type")
        if kind == "run":
            run = r.run
        elif kind == "history":
            items = {(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in r.history.item}
            rows.setdefault(int(items["_step"]), {}).update(items)
    return rows, run


def test_wandb_offline_run_holds_history_and_config(runs):
    files = glob.glob(os.path.join(runs["a"], "wandb", "offline-run-*", "run-*.wandb"))
    assert len(files) == 1, files
    rows, run = wandb_history(files[0])
    want = expected_scalars(records(runs["a"]))
    assert sorted(rows) == [0, 2, 4]
    for k, by_step in want.items():
        for s, v in by_step.items():
            assert math.isclose(rows[s][k], v, rel_tol=1e-9), (k, s)
    loads = {r["step"]: np.asarray(r["expert_load"]) for r in records(runs["a"]) if "expert_load" in r}
    assert sorted(loads) == [2, 4]
    for s, load in loads.items():
        assert rows[s]["expert_load/_type"] == "histogram"
        assert sum(rows[s]["expert_load/values"]) == load.size  # one count per (layer, expert)
        bins = rows[s]["expert_load/bins"]
        assert bins[0] <= load.min() and bins[-1] >= load.max()
    assert run.project == "nemo-jax-tests" and run.display_name == "run-a"
    cfg = {u.key: json.loads(u.value_json) for u in run.config.update}
    assert cfg["steps"] == 4 and cfg["logging"]["wandb"]["mode"] == "offline" and cfg["data"]["seq_len"] == 64
    with open(os.path.join(runs["a"], "wandb_run_id")) as f:
        assert run.run_id == f.read().strip()


def test_histogram_api_reaches_tensorboard_and_wandb(tmp_path, monkeypatch):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    for k, v in {**WANDB_ENV, "WANDB_DIR": str(tmp_path)}.items():
        monkeypatch.setenv(k, v)
    log = MetricsLogger(str(tmp_path / "r"), logging=LoggingSection(wandb=WandbSection(project="p", mode="offline")),
                        config={"name": "r"})
    rewards = np.array([0.0, 1.0, 1.0, 0.5, np.nan])  # non-finite values are left out of histograms
    log.histogram(3, "rewards", rewards)
    log.log({"step": 3, "reward_mean": 0.625})
    log.close()
    ea = EventAccumulator(str(tmp_path / "r" / "tensorboard"), size_guidance={"histograms": 0})
    ea.Reload()
    (h,) = ea.Histograms("rewards")
    assert h.step == 3 and h.histogram_value.num == 4 and h.histogram_value.sum == 2.5
    (f,) = glob.glob(str(tmp_path / "r" / "wandb" / "offline-run-*" / "run-*.wandb"))
    deadline = time.time() + 60  # (wandb's service process writes the offline file: on a busy host, after close)
    while 3 not in (rows := wandb_history(f)[0]) and time.time() < deadline:
        time.sleep(0.5)
    assert 3 in rows, rows
    assert rows[3]["rewards/_type"] == "histogram" and sum(rows[3]["rewards/values"]) == 4
    assert rows[3]["reward_mean"] == 0.625


def test_only_enabled_process_writes(tmp_path):
    log = MetricsLogger(str(tmp_path / "r"), enabled=False, logging=LoggingSection(wandb=WandbSection(project="p")))
    log.log({"step": 1, "loss": 1.0})
    log.histogram(1, "x", [1.0])
    log.close()
    assert not os.path.exists(tmp_path / "r")


def test_logging_section_errors_name_the_key(monkeypatch):
    with pytest.raises(ValueError, match="logging.wandb.mode"):
        check_logging(LoggingSection(wandb=WandbSection(project="p", mode="sometimes")))
    with pytest.raises(ValueError, match="logging.wandb.typo"):
        load_config(SFTConfig, None, ["logging.wandb.typo=1"])
    monkeypatch.setitem(sys.modules, "wandb", None)  # as if not installed
    check_logging(LoggingSection())  # W&B off: not needed
    with pytest.raises(MissingDependency, match=r"pip install 'nemo_jax\[wandb\]'"):
        check_logging(LoggingSection(wandb=WandbSection(project="p", mode="offline")))


# ------------------------------------------------------------------------------------------------------ plots
def png_ok(path, min_bytes=10_000):
    from PIL import Image

    assert os.path.getsize(path) > min_bytes, path
    with Image.open(path) as im:
        im.verify()
    with Image.open(path) as im:
        assert im.format == "PNG" and im.size[0] >= 600 and im.size[1] >= 200
        return np.asarray(im.convert("RGB"))


def orange_pixels(img) -> int:
    """Pixels of matplotlib's second colour (C1, #ff7f0e): the second run's curves."""
    return int(np.sum(np.all(np.abs(img.astype(int) - [255, 127, 14]) < 12, axis=-1)))


def test_plot_command_writes_pngs_for_a_finished_run(runs, capsys):
    cli_main(["plot", runs["a"]])
    printed = capsys.readouterr().out.split()
    names = {os.path.basename(p) for p in printed}
    assert names == {"loss.png", "optim.png", "throughput.png", "expert_load.png"}  # no MFU on CPU, no rewards
    for p in printed:
        assert os.path.dirname(p) == os.path.join(runs["a"], "plots")
        png_ok(p)
    assert orange_pixels(png_ok(os.path.join(runs["a"], "plots", "throughput.png"))) == 0  # one run, one colour


def test_plot_two_runs_overlaid_and_keys(runs, capsys):
    out = str(runs["root"] / "cmp")
    cli_main(["plot", runs["a"], runs["b"], "--out", out, "--keys", "loss,eval_loss", "--keys", "tokens_per_sec"])
    printed = capsys.readouterr().out.split()
    assert [os.path.basename(p) for p in printed] == ["loss.png", "throughput.png"]
    assert orange_pixels(png_ok(os.path.join(out, "throughput.png"))) > 50  # run b drawn over run a
    paths = plot_runs([runs["a"], runs["b"]], out, keys=["train_objective"])
    assert [os.path.basename(p) for p in paths] == ["other.png"]
    png_ok(paths[0])


def test_plot_draws_sparse_and_schedule_series_as_logged(tmp_path):
    """Eval points (sparse) and the learning rate (a schedule) are drawn raw: the eval curve ends at the real final
    eval loss, not at an EMA of seven points; dense series keep their smoothed curve; no MFU panel without MFU."""
    run = tmp_path / "run"
    run.mkdir()
    recs = [{"step": s, "loss": 6.0 * 0.97 ** s, "lr": 1e-3 * min(1.0, s / 20), "grad_norm": 1.0 + (s % 3),
             "tokens_per_sec": 1000.0 + s} for s in range(1, 301)]
    recs += [{"step": s, "eval_loss": v} for s, v in ((0, 6.26), (50, 2.0), (100, 0.9), (150, 0.5), (200, 0.3),
                                                      (250, 0.2), (300, 0.10))]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    figs = dict(figures([str(run)], smoothing=0.6))
    assert set(figs) == {"loss", "optim", "throughput"}
    assert figs["throughput"]._suptitle.get_text().startswith("Throughput  (")  # no "and MFU" without MFU
    lines = {ln.get_label(): ln for ln in figs["loss"].axes[0].get_lines() if not ln.get_label().startswith("_")}
    x, y = lines["eval_loss"].get_data()
    assert list(x) == [0, 50, 100, 150, 200, 250, 300] and y[-1] == 0.10 and lines["eval_loss"].get_marker() == "o"
    assert abs(lines["loss"].get_data()[1][-1] - 6.0 * 0.97 ** 300) > 1e-6  # the dense loss is smoothed (EMA)
    lr = {ln.get_label(): ln for ln in figs["optim"].axes[1].get_lines()}["lr"]
    assert list(lr.get_data()[1]) == [r["lr"] for r in recs if "lr" in r]  # the schedule as logged


def test_plot_errors_are_clear(runs, capsys, monkeypatch, tmp_path):
    with pytest.raises(SystemExit):
        cli_main(["plot", runs["a"], "--keys", "no_such_metric"])
    assert "no_such_metric" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli_main(["plot", str(tmp_path / "nowhere")])
    assert "metrics.jsonl: no such metrics file" in capsys.readouterr().err
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "loss"\n')
    with pytest.raises(ValueError, match=r"metrics.jsonl:2"):
        plot_runs([str(bad)], str(tmp_path / "o"))
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if not installed
    with pytest.raises(SystemExit) as e:
        cli_main(["plot", runs["a"], "--out", str(tmp_path / "never")])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "matplotlib" in err and "pip install 'nemo_jax[plot]'" in err
    assert not os.path.exists(tmp_path / "never")


def test_bar_chart_groups_stages_by_environment(tmp_path):
    table = {"sft": {"math": 0.41, "code": 0.22, "tools": 0.30}, "grpo": {"math": 0.55, "code": 0.31}}
    path = bar_chart(table, str(tmp_path / "report" / "report.png"), title="pass@1", ylabel="pass@1 (fraction)")
    img = png_ok(path, min_bytes=5_000)
    assert orange_pixels(img) > 100  # the second stage's bars
    with pytest.raises(ValueError, match="empty table"):
        bar_chart({}, str(tmp_path / "x.png"))
