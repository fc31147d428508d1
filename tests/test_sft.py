"""SFT trainer: sharding equivalence, exact resume after SIGKILL, SIGTERM checkpoint, restore across meshes (the
end-to-end ones marked slow), damaged steps, decay mask, router bias, init from checkpoints."""

import json
import os
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from nemo_jax.config.load import load_config
from nemo_jax.config.train import SFTConfig
from nemo_jax.model import moe as moe_lib
from nemo_jax.model.spec import init as init_params
from nemo_jax.train.optimizer import decay_mask
from nemo_jax.train.sft import Trainer
from nemo_jax.train.step import _update_correction_bias

from helpers import FAST_COMPILE, micro_model, tiny_cfg


@pytest.fixture(scope="module")
def micro(tmp_path_factory):
    """`model.config=` the tiny model cut to attention + MLP, for what does not depend on the layer kinds
    (resume, signals, damaged steps, restoring onto another mesh): ~5x faster to compile."""
    return f"model.config={micro_model(tmp_path_factory.mktemp('model'))}"

BASE = ["data.seq_len=64", "data.batch_size=8", "log_every=1", "eval_every=0", "data.eval=null",
        "checkpoint.async_save=false", "optim.warmup_steps=2", "model.config=tiny"]


def cfg_for(tmp, *extra):
    return load_config(SFTConfig, None, BASE + [f"run_dir={tmp}", *extra])


def losses(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [r["loss"] for r in map(json.loads, f) if "loss" in r]


def flat(params):
    return [np.asarray(x) for x in jax.tree.leaves(params)]


@pytest.mark.slow
def test_one_device_and_eight_devices_agree(tmp_path):
    a = Trainer(cfg_for(tmp_path / "one", "steps=6"), quiet=True, devices=jax.devices()[:1])
    a.run()
    # expert=2 runs the all-to-all dispatch; capacity_factor 2.0 (= ep) lets every token reach every peer: no drops
    b = Trainer(cfg_for(tmp_path / "eight", "steps=6", "mesh.fsdp=2", "mesh.tensor=2", "mesh.expert=2",
                        "model.capacity_factor=2.0"), quiet=True)
    assert b.mesh.shape == {"data": 1, "fsdp": 2, "tensor": 2, "expert": 2, "context": 1}
    spec = b.state.params["layers"]["moe"]["mixer"]["experts"]["up_proj"].sharding.spec
    assert "expert" in str(spec) and "tensor" in str(spec)
    b.run()
    la, lb = losses(tmp_path / "one"), losses(tmp_path / "eight")
    assert len(la) == len(lb) == 6 and la[-1] < la[0]
    with open(tmp_path / "eight" / "metrics.jsonl") as f:
        frac = [r["moe_dropped_frac"] for r in map(json.loads, f) if "moe_dropped_frac" in r]
    assert len(frac) == 6 and max(frac) == 0.0
    np.testing.assert_allclose(la, lb, rtol=1e-4)


def _spawn(run_dir, steps, *extra):
    code = ("import sys; from nemo_jax.cli import main; main(sys.argv[1:])")
    args = [sys.executable, "-c", code, "sft", *BASE, f"run_dir={run_dir}", f"steps={steps}", *extra]
    env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count=1 {FAST_COMPILE}",
               PYTHONUNBUFFERED="1")
    return subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _wait_for(pred, proc, timeout=900):
    t0 = time.time()
    while not pred():
        if proc.poll() is not None or time.time() - t0 > timeout:
            out = proc.stdout.read() if proc.stdout else ""
            raise AssertionError(f"condition not reached (rc={proc.poll()}):\n{out[-3000:]}")
        time.sleep(0.2)


def _final_params(run_dir, step):
    from nemo_jax.checkpoint import restore_tree

    tree = restore_tree(os.path.join(run_dir, "checkpoints", str(step), "state"))
    return [np.asarray(x) for x in jax.tree.leaves(tree["params"] if isinstance(tree, dict) else tree[0])]


@pytest.mark.slow
def test_sigkill_then_resume_matches_uninterrupted(tmp_path, micro):
    """Both runs in identical subprocesses: one uninterrupted, one SIGKILLed mid-run and restarted."""
    steps = 10
    ref = _spawn(tmp_path / "ref", steps, micro)
    out, _ = ref.communicate(timeout=300)
    assert ref.returncode == 0, out[-2000:]
    run = tmp_path / "killed"
    proc = _spawn(run, steps, micro, "checkpoint.every=2")
    ck = run / "checkpoints"
    _wait_for(lambda: ck.exists() and any(p.name.isdigit() and int(p.name) >= 4 for p in ck.iterdir()), proc)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL
    killed_at = max(int(p.name) for p in ck.iterdir() if p.name.isdigit())
    assert killed_at < steps
    again = _spawn(run, steps, micro, "checkpoint.every=2")
    out, _ = again.communicate(timeout=300)
    assert again.returncode == 0 and "resumed from" in out, out[-2000:]
    # the killed run's write lock was left behind; the rerun reclaimed it, saying so
    assert f"reclaimed the write lock of nemo-jax sft (pid {proc.pid} " in out and "that process is gone" in out
    for a, b in zip(_final_params(tmp_path / "ref", steps), _final_params(run, steps)):
        np.testing.assert_array_equal(a, b)


@pytest.mark.slow
def test_sigterm_leaves_a_checkpoint(tmp_path, micro):
    """A running `sft` also holds its run dir: a second `sft` on it stops at once naming it, while a reader
    (`export-hf`) reads the newest good step without waiting; SIGTERM saves, and releases the lock."""
    from nemo_jax.checkpoint import latest_good_step
    from nemo_jax.runlock import LOCK_FILE

    run = tmp_path / "term"
    proc = _spawn(run, 100000, micro, "checkpoint.every=20", "checkpoint.keep=100")
    _wait_for(lambda: (run / "checkpoints").exists() and latest_good_step(str(run / "checkpoints")), proc)
    second = subprocess.run([sys.executable, "-m", "nemo_jax.cli", "sft", *BASE, micro, f"run_dir={run}", "steps=5"],
                            capture_output=True, text=True, timeout=300)
    assert second.returncode == 2 and f"is being written by nemo-jax sft (pid {proc.pid} " in second.stderr, \
        second.stderr
    reader = subprocess.run([sys.executable, "-m", "nemo_jax.cli", "export-hf", str(run), str(tmp_path / "hf")],
                            capture_output=True, text=True, timeout=300)
    assert reader.returncode == 0 and (tmp_path / "hf" / "model.safetensors").exists(), reader.stderr
    assert proc.poll() is None and json.loads((run / LOCK_FILE).read_text())["pid"] == proc.pid
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out[-2000:]
    steps = [int(p.name) for p in (run / "checkpoints").iterdir() if p.name.isdigit()]
    assert steps and 0 < max(steps) < 100000
    assert not (run / LOCK_FILE).exists()


@pytest.mark.slow
def test_restore_eight_device_checkpoint_onto_four(tmp_path, micro):
    run = tmp_path / "mesh"
    a = Trainer(cfg_for(run, "steps=2", "mesh.fsdp=8", micro), quiet=True)
    a.run()
    saved = flat(a.state.params)
    b = Trainer(cfg_for(run, "steps=3", "mesh.fsdp=2", "mesh.tensor=2", micro), quiet=True, devices=jax.devices()[:4])
    assert b.maybe_restore() and int(b.state.step) == 2
    leaf = b.state.params["layers"]["attention"]["mixer"]["q_proj"]["kernel"]
    assert len(leaf.sharding.device_set) == 4
    for x, y in zip(saved, flat(b.state.params)):
        np.testing.assert_array_equal(x, y)
    b.run()
    assert int(b.state.step) == 3


def test_damaged_latest_checkpoint_falls_back(tmp_path, micro):
    run = tmp_path / "damaged"
    a = Trainer(cfg_for(run, "steps=4", "checkpoint.every=2", micro), quiet=True, devices=jax.devices()[:1])
    a.run()
    latest = run / "checkpoints" / "4"
    for root, _, files in os.walk(latest / "state"):
        for f in files:
            with open(os.path.join(root, f), "wb") as fh:
                fh.write(b"garbage")
    b = Trainer(cfg_for(run, "steps=4", "checkpoint.every=2", micro), quiet=True, devices=jax.devices()[:1])
    assert b.maybe_restore() and int(b.state.step) == 2
    # healed: the damaged step is set aside (not deleted) and written again when training passes it
    assert sorted(os.listdir(run / "checkpoints")) == ["2", "4.damaged"]
    b.run()
    assert sorted(os.listdir(run / "checkpoints")) == ["2", "4", "4.damaged"]
    assert (run / "checkpoints" / "4" / "nemo_jax-manifest.json").exists()


def test_weight_decay_mask():
    params = init_params(tiny_cfg(), jax.random.key(0))
    mask = decay_mask(params)
    m = mask["layers"]["mamba"]["mixer"]
    assert not m["A_log"] and not m["D"] and not m["dt_bias"] and not m["norm"]["scale"] and not m["conv1d"]["bias"]
    assert m["in_proj"]["kernel"] and m["conv1d"]["kernel"]
    assert not mask["layers"]["moe"]["mixer"]["gate"]["correction_bias"] and not mask["norm_f"]["scale"]
    assert mask["layers"]["moe"]["mixer"]["experts"]["up_proj"] and mask["embeddings"]["embedding"]


def test_correction_bias_update_balances_router():
    cfg = tiny_cfg("E")
    params = init_params(cfg, jax.random.key(0))
    gate = params["layers"]["moe"]["mixer"]["gate"]
    gate["kernel"] = gate["kernel"].at[..., 0].add(0.1).at[..., 1].add(0.06)  # experts 0 and 1 hog the tokens
    x = jax.random.normal(jax.random.key(1), (512, cfg.hidden_size)) * 0.5 + 0.2  # positive mean

    def imbalance(p):
        g = jax.tree.map(lambda a: a[0], p["layers"]["moe"]["mixer"]["gate"])
        _, idx, _ = moe_lib.route(g, x, cfg)
        load = jnp.bincount(idx.reshape(-1), length=cfg.n_routed_experts).astype(jnp.float32)
        return load, float(jnp.max(load) / jnp.mean(load))

    load, before = imbalance(params)
    for _ in range(200):
        params = _update_correction_bias(params, load[None], 0.01)
        load, after = imbalance(params)
    assert before > 2.0 and after < 0.6 * before


def test_init_from_native_and_hf_checkpoints(tmp_path):
    from nemo_jax.checkpoint import save_model
    from nemo_jax.config.model import NemotronHConfig
    from nemo_jax.data.chat import ASSETS
    from nemo_jax.hf.io import save_pretrained

    cfg = NemotronHConfig.from_file(os.path.join(ASSETS, "models", "tiny.json"))
    params = init_params(cfg, jax.random.key(7))
    save_model(str(tmp_path / "native"), cfg, params)
    save_pretrained(cfg, params, str(tmp_path / "hf"))
    for src in ("native", "hf"):
        t = Trainer(cfg_for(tmp_path / f"run_{src}", "steps=1", f"model.init={tmp_path / src}", "mesh.fsdp=2"),
                    quiet=True, devices=jax.devices()[:2])
        for a, b in zip(flat(params), flat(t.state.params)):
            np.testing.assert_array_equal(a, b)
        assert len(t.state.params["lm_head"]["kernel"].sharding.device_set) == 2


@pytest.mark.slow
def test_a_finished_run_extended_by_raising_steps_resumes_and_rebuilds_the_schedule(tmp_path, micro, capsys):
    """`steps=2` run to the end, then rerun with `steps=3`: it resumes at step 2 (one line says how the schedule
    changes) and trains step 3 only, at the rate of the schedule rebuilt for 3 steps. With eval data and
    `eval_every=0` no eval runs (not even at step 0) and `done` reports no eval_loss."""
    from nemo_jax.train.optimizer import schedule
    from nemo_jax.train.sft import main

    args = BASE + [micro, f"run_dir={tmp_path}", "optim.decay=cosine", "optim.min_lr_ratio=0.0",
                   "data.eval=builtin:tiny_chat/eval.jsonl", "eval_every=0"]
    first = main(None, args + ["steps=2"])
    assert "eval_loss" not in first
    main(None, args + ["steps=3"])
    out = capsys.readouterr().out
    assert "sft: steps raised from 2 to 3: resuming" in out and "decay now ends at step 3" in out, out
    assert "eval at step 0" not in out and "eval_loss" not in out
    with open(tmp_path / "metrics.jsonl") as f:
        recs = [r for r in map(json.loads, f) if "loss" in r]
    assert [r["step"] for r in recs] == [1, 2, 3]
    c = cfg_for(tmp_path, "steps=3", "optim.decay=cosine", "optim.min_lr_ratio=0.0")
    assert recs[1]["lr"] == pytest.approx(float(schedule(load_config(SFTConfig, None, BASE + ["steps=2"]).optim,
                                                                  2)(1)))
    assert recs[2]["lr"] == pytest.approx(float(schedule(c.optim, 3)(2))) and recs[2]["lr"] > 0


@pytest.mark.slow
def test_a_signal_in_the_first_seconds_stops_the_command(tmp_path, micro):
    """SIGINT while the command starts (the model loading, its data being prepared), in a process that inherited
    SIGINT ignored as a script's background job does: the command stops with one line (exit 130), or, once its
    training loop has the signal, saves and stops. It used to be lost: the run went on to its last step."""
    run = tmp_path / "run"
    argv = [sys.executable, "-m", "nemo_jax.cli", "sft", *BASE, micro, f"run_dir={run}", "steps=100000"]
    # (the shell ignores SIGINT and execs the command, which inherits that: no fork of this multithreaded process)
    proc = subprocess.Popen(["sh", "-c", 'trap "" INT; exec "$@"', "sh", *argv], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    first = proc.stdout.readline()  # "sft: run ..." : the command has started
    assert first.startswith("sft: run"), first + proc.stderr.read()
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=180)
    if proc.returncode == 130:  # stopped before training
        assert err.strip().splitlines()[-1].startswith("nemo-jax sft: stopped by SIGINT before it finished"), err
    else:  # (the loop had taken the signal over already: a graceful stop)
        assert proc.returncode == 0 and '"stopped_early": true' in out, out[-2000:] + err[-2000:]
