"""One writer per run dir (`nemo_jax.runlock`), with real processes: a second `sft` / `grpo` / `recipe` / `data
prepare` on a held folder stops at once naming the holder and touches nothing; a holder that died on this host,
or whose heartbeat stopped elsewhere, is reclaimed with a line saying so; racing reclaimers leave one winner; the
heartbeat moves and a holder whose lock was taken from it stops; a multi-process run takes the lock once, on
process 0, and every process learns a refusal; readers read a held run dir's newest good step. (A live `sft`
writer is in tests/test_sft.py.)"""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import pytest

from nemo_jax import runlock

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUN_SH = os.path.join(ROOT, "launch", "local", "run.sh")
DATA = os.path.join(ROOT, "nemo_jax", "assets", "tiny_chat", "eval.jsonl")

# holds the lock of argv[1] as argv[2] until stdin closes (printing "held" once it has it)
_HOLDER = """
import sys
from nemo_jax import runlock
with runlock.hold(sys.argv[1], sys.argv[2]):
    print("held", flush=True)
    sys.stdin.read()
"""


def _env(**extra):
    return {**{k: v for k, v in os.environ.items() if not k.startswith("NEMO_JAX_")}, "PYTHONUNBUFFERED": "1",
            **extra}


def _holder(folder, command="nemo-jax sft", **env):
    p = subprocess.Popen([sys.executable, "-c", _HOLDER, str(folder), command], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(**env))
    assert p.stdout.readline().strip() == "held", p.stderr.read()
    return p


def _cli(*argv, **env):
    t0 = time.time()
    r = subprocess.run([sys.executable, "-m", "nemo_jax.cli", *map(str, argv)], capture_output=True, text=True,
                       timeout=300, env=_env(**env))
    return r, time.time() - t0


def _lock(folder) -> dict:
    return json.loads((folder / runlock.LOCK_FILE).read_text())


WRITERS = {
    "sft": lambda run: ["sft", f"run_dir={run}", "steps=2"],
    "grpo": lambda run: ["grpo", "--config", os.path.join(ROOT, "configs", "grpo", "tiny-cpu.yaml"), f"run_dir={run}"],
    "recipe": lambda run: ["recipe", os.path.join(ROOT, "configs", "recipes", "tiny-cpu.yaml"), f"run_dir={run}"],
    "data prepare": lambda run: ["data", "prepare", DATA, "--tokenizer", "builtin:tiny", "--out", run],
}


def test_a_second_writer_of_each_command_stops_at_once_naming_the_holder(tmp_path):
    run = tmp_path / "run"
    holder = _holder(run)
    lock = _lock(run)
    assert lock["pid"] == holder.pid and lock["host"] == socket.gethostname() and lock["command"] == "nemo-jax sft"
    assert {"started", "started_unix", "boot_id", "pid_ns", "proc_start", "token"} <= set(lock)
    try:
        for verb, argv in WRITERS.items():
            r, took = _cli(*argv(run))
            err = [line for line in r.stderr.splitlines() if line.strip()]
            assert r.returncode == 2 and len(err) == 1, (verb, r.stdout, r.stderr)
            assert re.fullmatch(rf"nemo-jax {verb}: error: {re.escape(str(run))} is being written by nemo-jax sft "
                                rf"\(pid {holder.pid} on {re.escape(socket.gethostname())}, started "
                                rf"{re.escape(lock['started'])}, heartbeat \d+ s ago\): one writer at a time; .*",
                                err[0]), err[0]
            assert took < 60, (verb, took)  # seconds (interpreter and jax start-up on a loaded 2-core host)
            assert os.listdir(run) == [runlock.LOCK_FILE] and _lock(run) == lock, verb  # nothing touched
    finally:
        holder.stdin.close()
        holder.wait(timeout=30)
    assert holder.returncode == 0 and os.listdir(run) == []  # released on the way out


def test_a_held_run_dir_is_neither_judged_nor_moved_aside(tmp_path):
    """A writer's run dir that holds checkpoints: a second `sft` with other settings, or with --new-run, is
    refused naming the live holder, and nothing in the folder moves."""
    run = tmp_path / "run"
    (run / "checkpoints" / "5").mkdir(parents=True)
    (run / "config.yaml").write_text("name: other\nsteps: 5\n")
    holder = _holder(run)
    try:
        for extra in ([], ["--new-run"]):
            r, _ = _cli("sft", *extra, f"run_dir={run}", "steps=3")
            assert r.returncode == 2 and f"is being written by nemo-jax sft (pid {holder.pid} " in r.stderr, r.stderr
            assert sorted(os.listdir(tmp_path)) == ["run"] and (run / "checkpoints" / "5").is_dir()
    finally:
        holder.stdin.close()
        holder.wait(timeout=60)


def test_a_holder_that_died_on_this_host_is_reclaimed_with_a_line(tmp_path):
    run = tmp_path / "out"
    holder = _holder(run, "nemo-jax data prepare")
    dead = _lock(run)
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    assert _lock(run) == dead  # a killed holder leaves its lock behind
    r, _ = _cli(*WRITERS["data prepare"](run))
    assert r.returncode == 0, r.stderr
    assert (f"nemo-jax data prepare: {run}: reclaimed the write lock of nemo-jax data prepare (pid {dead['pid']} "
            f"on {socket.gethostname()}, started {dead['started']}") in r.stderr
    assert r.stderr.rstrip().endswith("that process is gone"), r.stderr
    assert (run / "manifest.json").exists() and runlock.LOCK_FILE not in os.listdir(run)
    # a pid that now belongs to another process (it started at another time) is as good as dead
    me = {**runlock._machine(), "pid": os.getpid(), "proc_start": runlock._process_start(os.getpid())}
    assert runlock.judge(me, 0.0) == "its pid is this process's now"
    other = {**me, "pid": holder.pid}
    assert runlock.judge(other, 0.0) == "that process is gone"
    live = {**me, "pid": os.getppid(), "proc_start": runlock._process_start(os.getppid())}
    assert runlock.judge(live, 10**6) is None  # alive on this machine: held, however old its heartbeat
    assert runlock.judge({**live, "proc_start": live["proc_start"] + 1}, 0.0) == "that process is gone"


def test_a_holder_elsewhere_is_gone_once_its_heartbeat_is_stale(tmp_path):
    run = tmp_path / "out"
    run.mkdir()
    far = {"command": "nemo-jax sft", "pid": 4242, "host": "gone-host", "boot_id": "b", "pid_ns": "n",
           "proc_start": 1, "started": "2030-01-01 00:00:00 +0000", "token": "f" * 16}
    (run / runlock.LOCK_FILE).write_text(json.dumps(far))
    r, _ = _cli(*WRITERS["data prepare"](run))  # a fresh heartbeat: held, whatever the pid
    assert r.returncode == 2 and "being written by nemo-jax sft (pid 4242 on gone-host" in r.stderr, r.stderr
    old = time.time() - 301
    os.utime(run / runlock.LOCK_FILE, (old, old))
    r, _ = _cli(*WRITERS["data prepare"](run))
    assert r.returncode == 0, r.stderr
    m = re.search(r"reclaimed the write lock of nemo-jax sft \(pid 4242 on gone-host, .*\): its heartbeat is "
                  r"(\d+) s old \(> 300 s; the holder runs on another host\)", r.stderr)
    assert m and int(m[1]) >= 301, r.stderr  # (the age grows with however long the process took to start)
    # the period is a setting; a lock file that is not a lock counts as stale only by its age
    (run / runlock.LOCK_FILE).write_text("{trunc")
    r, _ = _cli(*WRITERS["data prepare"](run), NEMO_JAX_LOCK_STALE_S="3600")
    assert r.returncode == 2 and "an unreadable lock file" in r.stderr, r.stderr
    old = time.time() - 301
    os.utime(run / runlock.LOCK_FILE, (old, old))
    r, _ = _cli(*WRITERS["data prepare"](run), NEMO_JAX_LOCK_STALE_S="200")
    m = re.search(r"the lock file is unreadable and (\d+) s old \(> 200 s\)", r.stderr)
    assert r.returncode == 0 and m and int(m[1]) >= 301, r.stderr


_CONTENDER = """
import sys, time
from nemo_jax import runlock
time.sleep(max(0.0, float(sys.argv[2]) - time.time()))  # all start together (late ones at once)
try:
    with runlock.hold(sys.argv[1], "contender"):
        print("won", flush=True)
        time.sleep(3)
except runlock.LockHeld as e:
    print("held", e, flush=True)
"""


def test_racing_reclaimers_leave_exactly_one_writer(tmp_path):
    run = tmp_path / "run"
    dead = _holder(run)
    dead.send_signal(signal.SIGKILL)
    dead.wait()
    start = time.time() + 2.0
    procs = [subprocess.Popen([sys.executable, "-c", _CONTENDER, str(run), str(start)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=_env()) for _ in range(4)]
    outs = [p.communicate(timeout=120) for p in procs]
    won = [i for i, (o, _) in enumerate(outs) if o.startswith("won")]
    assert len(won) == 1, outs
    winner = procs[won[0]].pid
    for i, (o, _) in enumerate(outs):
        if i != won[0]:
            assert o.startswith("held") and f"contender (pid {winner} " in o, outs
    assert sum("reclaimed the write lock" in e for _, e in outs) >= 1


def test_the_heartbeat_moves_and_a_holder_that_lost_its_lock_stops(tmp_path):
    run = tmp_path / "run"
    holder = _holder(run, NEMO_JAX_LOCK_HEARTBEAT_S="0.2")
    first = os.stat(run / runlock.LOCK_FILE).st_mtime
    t0 = time.time()
    while os.stat(run / runlock.LOCK_FILE).st_mtime == first:
        assert time.time() - t0 < 30
        time.sleep(0.05)
    # removed by hand: the holder takes it back
    os.remove(run / runlock.LOCK_FILE)
    t0 = time.time()
    while not (run / runlock.LOCK_FILE).exists():
        assert time.time() - t0 < 30
        time.sleep(0.05)
    assert _lock(run)["pid"] == holder.pid
    # replaced by another process's lock: the holder stops at once rather than write beside it
    (run / runlock.LOCK_FILE).write_text(json.dumps({**_lock(run), "pid": 1, "token": "0" * 16}))
    holder.wait(timeout=30)  # (stdin still open: it stops by itself)
    err = holder.stderr.read()
    assert holder.returncode == 5, err
    assert f"error: {run}: lost the write lock" in err and "stopping at once" in err
    assert _lock(run)["token"] == "0" * 16  # the other's lock is left alone


_TWO = """
import os, sys, threading
from nemo_jax.parallel import distributed
from nemo_jax import runlock
distributed.initialize()
me, n = distributed.process()
with distributed.failure_guard("test"):  # (leaves the runtime in order)
    try:
        with distributed.writer_lock(sys.argv[1], "nemo-jax sft") as h:
            lock = runlock.read(sys.argv[1])[0]
            print(f"process {me}: holder={h is not None} lock_pid_is_mine={lock['pid'] == os.getpid()}", flush=True)
            distributed.barrier("held", 60)
    except runlock.LockHeld as e:
        print(f"process {me}: refused: {e}", flush=True)
# the peer watchdog ended before the runtime did (one still in the coordination client's C++ call at exit aborts
# the process: exit 134)
assert not any(t.name == "nemo-jax-peer-watchdog" for t in threading.enumerate())
"""


def test_a_multi_process_run_takes_the_lock_once_on_process_0(tmp_path):
    run = tmp_path / "run"

    def two():
        r = subprocess.run([RUN_SH, "--processes", "2", "--grace", "5", "--", sys.executable, "-c", _TWO, str(run)],
                           capture_output=True, text=True, timeout=300, env=_env(JAX_PLATFORMS="cpu"))
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
        return sorted(line for line in r.stdout.splitlines() if "process" in line)

    assert two() == ["[0] process 0: holder=True lock_pid_is_mine=True",
                     "[1] process 1: holder=False lock_pid_is_mine=False"]
    assert not (run / runlock.LOCK_FILE).exists()
    holder = _holder(run)
    try:
        lines = two()
    finally:
        holder.stdin.close()
        holder.wait(timeout=30)
    assert len(lines) == 2 and all(f"refused: {run} is being written by nemo-jax sft (pid {holder.pid} " in x
                                   for x in lines), lines


def test_readers_need_no_lock_and_read_the_newest_good_step(tmp_path):
    """While a writer holds the run dir and has a newer step half-written, `export-hf` (a real process) reads
    the newest complete step and leaves the lock alone."""
    import dataclasses

    import numpy as np
    from helpers import tiny_cfg
    from safetensors import safe_open

    from nemo_jax.config.load import load_config
    from nemo_jax.config.train import SFTConfig
    from nemo_jax.hf.io import save_pretrained
    from nemo_jax.hf.mapping import leaf_specs
    from nemo_jax.model.spec import unflatten_paths
    from nemo_jax.train.checkpoint import RunCheckpointer

    cfg = tiny_cfg("M*E")
    rng = np.random.default_rng(0)
    params = unflatten_paths({p: rng.standard_normal(s.shape).astype(np.float32) for p, s in leaf_specs(cfg).items()})
    run = tmp_path / "run"
    c = load_config(SFTConfig, None, [f"run_dir={run}"])
    ck = RunCheckpointer(str(run / "checkpoints"), async_save=False)
    ck.save(2, {"params": params}, {}, {"config": dataclasses.asdict(c), "model_config": cfg.to_hf_dict()})
    ck.close()
    holder = _holder(run)
    lock = _lock(run)
    (run / "checkpoints" / "4.orbax-checkpoint-tmp-1").mkdir()  # the writer's next save, under way
    try:
        r, _ = _cli("export-hf", run, tmp_path / "hf")
        assert r.returncode == 0, r.stderr
        assert _lock(run) == lock and holder.poll() is None
    finally:
        holder.stdin.close()
        holder.wait(timeout=30)
    save_pretrained(cfg, params, str(tmp_path / "want"))
    with safe_open(str(tmp_path / "hf" / "model.safetensors"), "np") as got, \
            safe_open(str(tmp_path / "want" / "model.safetensors"), "np") as want:
        assert set(got.keys()) == set(want.keys())
        assert all(np.array_equal(got.get_tensor(k), want.get_tensor(k)) for k in want.keys())


def test_a_zombie_holder_is_judged_gone():
    """A holder that exited but whose parent has not reaped it yet (a zombie: it writes nothing more) does not
    block a rerun."""
    import subprocess
    import sys
    import time

    child = subprocess.Popen([sys.executable, "-c", "pass"])
    start = runlock._process_start(child.pid)
    t0 = time.monotonic()
    while runlock._stat_fields(child.pid)[0] != "Z" and time.monotonic() - t0 < 30:  # exited, not reaped
        time.sleep(0.01)
    holder = {**runlock._machine(), "pid": child.pid, "proc_start": start}
    try:
        assert runlock.judge(holder, 0.0) == "that process is gone"
    finally:
        child.wait()


def test_a_holder_elsewhere_is_judged_by_the_folders_clock(tmp_path, monkeypatch):
    """On NFS the heartbeat's mtime is the server's clock: a holder on another host is aged against a file
    touched in the folder now (here the folder's clock is moved 1000 s ahead of this host's), not this host's
    clock; a holder on this host by its pid."""
    import json
    import time

    (tmp_path / runlock.LOCK_FILE).write_text(json.dumps({"command": "nemo-jax sft", "pid": 1, "host": "node-7",
                                                          "boot_id": "x", "pid_ns": "y"}))
    real = runlock._fs_now
    assert abs(real(str(tmp_path)) - time.time()) < 5 and os.listdir(tmp_path) == [runlock.LOCK_FILE]
    monkeypatch.setattr(runlock, "_fs_now", lambda folder: real(folder) + 1000.0)
    holder, age = runlock.read(str(tmp_path))
    assert holder["host"] == "node-7" and 990 < age < 1010
