"""Off-policy corrections measured against a real engine: GRPO on the tiny constraints task
(configs/grpo/tiny-cpu.yaml, from the tiny SFT model) fed only by `nemo-jax rollout-worker` on vLLM CPU
(tools/tiers/vllm_cpu.py), one run per variant and seed, side by side: `mismatch_kl`, staleness, the corrections'
own figures and the held-out pass@1 curve (docs/grpo.md, "Off-policy corrections against vLLM").

    python bench/grpo_vllm.py [--venv DIR] [--sft RUN] [--steps 60] [--seeds 0] [--variants a,b,...] [--json OUT]

Variants (each a list of `nemo-jax grpo` overrides; the worker's --concurrency in brackets):
  in-process    the reference: the learner's own sampler thread (the config's settings: max_off_policy_steps 2)
  on-policy     max_off_policy_steps 0, 4 groups in flight [4]: every rollout from the current policy
  dppo          max_off_policy_steps 2, 8 groups in flight [8]: the worker samples ahead, rollouts 0-2 versions old
  tis           the same, loss.kind tis (ratios truncated at is_cap 2)
  icepop        the same, loss.kind icepop (tokens with ratio outside [0.5, 5] masked)
  seq-mismatch  the same as dppo, loss.seq_mismatch_max 0.05 (rollouts whose mean log-ratio exceeds it dropped)
The runs take turns (one at a time) on one vLLM server; each prints its line as it finishes. On a 2-core host a
60-step run takes ~8-12 minutes.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_spec = importlib.util.spec_from_file_location("vllm_cpu_tool", os.path.join(ROOT, "tools", "tiers", "vllm_cpu.py"))
tool = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(tool)

OFF = ["rollout.max_off_policy_steps=2", "rollout.in_flight_groups=8"]
VARIANTS = {  # name -> (overrides, worker --concurrency; 0: no worker, the learner samples in process)
    "in-process": (["rollout.producer=thread", "rollout.spool=false"], 0),
    "on-policy": (["rollout.max_off_policy_steps=0", "rollout.in_flight_groups=4"], 4),
    "dppo": (OFF, 8),
    "tis": (OFF + ["loss.kind=tis"], 8),
    "icepop": (OFF + ["loss.kind=icepop"], 8),
    "seq-mismatch": (OFF + ["loss.seq_mismatch_max=0.05"], 8),
}


def _env() -> dict:
    return dict(os.environ, PYTHONPATH=ROOT + (os.pathsep + os.environ["PYTHONPATH"] if os.environ.get("PYTHONPATH")
                                               else ""), JAX_PLATFORMS="cpu")


def _nemo(*args) -> None:
    subprocess.run([sys.executable, "-m", "nemo_jax.cli", *args], env=_env(), check=True)


def start_vllm(venv: str, hf: str, log: str):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd, env = tool.serve_command(venv, hf, port=port, max_lora_rank=8)
    proc = subprocess.Popen(["nice", "-n", "5", *cmd], env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT,
                            start_new_session=True)
    import httpx

    url = f"http://127.0.0.1:{port}"
    t0 = time.time()
    while time.time() - t0 < 900:
        if proc.poll() is not None:
            raise SystemExit(f"vLLM died at start (log: {log})")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(1.0)
    raise SystemExit(f"vLLM did not come up in 900 s (log: {log})")


def run_variant(name: str, seed: int, sft: str, url: str, steps: int, work: str) -> dict:
    overrides, concurrency = VARIANTS[name]
    run = os.path.join(work, f"{name}-s{seed}")
    external = ["rollout.spool=true", "rollout.producer=none", "rollout.publish_format=vllm"] if concurrency else []
    learner_cmd = [sys.executable, "-m", "nemo_jax.cli", "grpo", "--config", "configs/grpo/tiny-cpu.yaml",
                   f"run_dir={run}", f"steps={steps}", f"seed={seed}", f"model.init={sft}", *external, "eval_every=10",
                   "log_every=1", "logging.tensorboard=false", "checkpoint.every=0", *overrides]
    worker_cmd = [sys.executable, "-m", "nemo_jax.cli", "rollout-worker", "--run", run, "--server", url,
                  "--concurrency", str(concurrency), "--worker-id", f"bench-{name}-{seed}"]
    t0 = time.time()
    with open(run + ".learner.log", "w") as ll, open(run + ".worker.log", "w") as wl:
        learner = subprocess.Popen(learner_cmd, cwd=ROOT, env=_env(), stdout=ll, stderr=subprocess.STDOUT)
        worker = subprocess.Popen(worker_cmd, cwd=ROOT, env=_env(), stdout=wl, stderr=subprocess.STDOUT) \
            if concurrency else None
        try:
            rc = learner.wait()
            if worker is not None:
                worker.wait(120)
        finally:
            for p in (learner, worker):
                if p is not None and p.poll() is None:
                    p.send_signal(signal.SIGTERM)
                    p.wait(60)
    if rc != 0:
        raise SystemExit(f"{name} seed {seed}: the learner failed (log: {run}.learner.log)")
    return {"variant": name, "seed": seed, "overrides": overrides, "worker_concurrency": concurrency,
            "wall_s": round(time.time() - t0, 1), **summarize(run)}


def summarize(run: str) -> dict:
    """A GRPO run's figures from its metrics.jsonl."""
    with open(os.path.join(run, "metrics.jsonl")) as f:
        recs = [json.loads(x) for x in f if x.strip()]
    st = [r for r in recs if "mismatch_kl" in r]
    ev = [(r["step"], r["eval_pass@1"]) for r in recs if "eval_pass@1" in r]

    def mean(k, rows=st):
        xs = [r[k] for r in rows if k in r]
        return sum(xs) / len(xs) if xs else None
    fresh = [r for r in st if r.get("staleness_max", 0) == 0]
    return {"steps": max(r["step"] for r in recs), "updates": len(st),
            "mismatch_kl_mean": mean("mismatch_kl"), "mismatch_kl_max": max(abs(r["mismatch_kl"]) for r in st),
            "mismatch_kl_max_at_staleness_0": max((abs(r["mismatch_kl"]) for r in fresh), default=None),
            "staleness_mean": mean("staleness_mean"), "staleness_max": max(r["staleness_max"] for r in st),
            "groups_stale_dropped": st[-1].get("groups_stale_dropped", 0),
            "is_truncated_frac_mean": mean("is_truncated_frac"), "is_masked_frac_mean": mean("is_masked_frac"),
            "mismatch_dropped_frac_mean": mean("mismatch_dropped_frac"),
            "masked_frac_mean": (mean("masked_frac_high") or 0) + (mean("masked_frac_low") or 0),
            "reward_mean_last10": mean("reward_mean", st[-10:]), "eval_pass_at_1": ev,
            "eval_last3_mean": sum(e for _, e in ev[-3:]) / len(ev[-3:]) if ev else None,
            "wait_frac_mean": mean("wait_frac")}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--venv", default=None, help="a vLLM CPU venv (default: $NEMO_JAX_VLLM_VENV or tools/tiers/vllm_cpu.py's)")
    p.add_argument("--sft", default=None, help="a finished tiny SFT run (default: trained first, ~3 minutes)")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--seeds", default="0")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--work", default=None, help="scratch dir for the runs (default: a new temp dir)")
    p.add_argument("--json", default=None, help="write every run's figures here")
    a = p.parse_args(argv)
    venv = tool.venv_dir(a.venv)
    versions = tool.venv_ready(venv)
    if versions is None:
        raise SystemExit(f"no vLLM CPU venv at {venv}: python tools/tiers/vllm_cpu.py venv --venv {venv}")
    names = a.variants.split(",")
    bad = [n for n in names if n not in VARIANTS]
    if bad:
        raise SystemExit(f"--variants: unknown {bad}; choose from {list(VARIANTS)}")
    work = a.work or tempfile.mkdtemp(prefix="grpo-vllm-")
    os.makedirs(work, exist_ok=True)
    sft = a.sft
    if sft is None:
        sft = os.path.join(work, "sft")
        _nemo("sft", "--config", os.path.join(ROOT, "configs/sft/tiny-cpu.yaml"), f"run_dir={sft}", "eval_every=0",
              "logging.tensorboard=false")
    hf = os.path.join(work, "hf")
    if not os.path.exists(os.path.join(hf, "config.json")):
        _nemo("export-hf", sft, hf)
    proc, url = start_vllm(venv, hf, os.path.join(work, "vllm.log"))
    out = []
    try:
        for seed in [int(s) for s in a.seeds.split(",")]:
            for name in names:
                r = run_variant(name, seed, sft, url, a.steps, work)
                out.append(r)
                print(f"{name:13s} seed {seed}: mismatch_kl mean {r['mismatch_kl_mean']:.2e} max {r['mismatch_kl_max']:.2e}"
                      f", staleness mean {r['staleness_mean']:.2f} max {r['staleness_max']}, eval pass@1 "
                      + " ".join(f"{e:.3f}" for _, e in r["eval_pass_at_1"]) + f"  ({r['wall_s']:.0f} s)", flush=True)
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(60)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                       "commit": tool.git_commit(), "vllm": versions, "steps": a.steps, "runs": out}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
