"""Publishing a policy version does not lengthen the GRPO learner's step: the step (forward_backward + optim_step of
`TrainingClient`) timed without publishing, publishing every step from the background thread (what `nemo-jax
grpo` does), and publishing every step synchronously (waiting for the disk, as before), side by side.

    python bench/publish.py [--model tiny --rank 128 --rows 8 --seq 256 --steps 8 --rounds 3 --format vllm --dtype train]

The three modes run in interleaved blocks (medians over all blocks). Also prints the adapters' size, the seconds
the background thread spent per version (device-to-host copy and write) and how many versions it skipped because
a newer one was ready first (the disk slower than the learner).
Goal: background / none <= 1.05.
"""

import argparse
import os
import statistics
import tempfile
import time

import common  # noqa: F401  (process settings before jax)
import jax
import jax.numpy as jnp
import numpy as np

from nemo_jax.config.model import NemotronHConfig
from nemo_jax.config.train import OptimSection
from nemo_jax.lora import LoraConfig
from nemo_jax.model import init
from nemo_jax.rl.client import TrainingClient
from nemo_jax.rl.loss import group_advantages, loss_weights
from nemo_jax.train.sft import model_config_path


def batch(cfg, rows, T, seed=0):
    rng = np.random.default_rng(seed)
    toks = rng.integers(0, cfg.vocab_size, (rows, T + 1)).astype(np.int32)
    mask = np.zeros((rows, T), bool)
    mask[:, T // 4:] = True
    adv, _ = group_advantages(rng.random(rows), np.arange(rows) // 4)
    mu = np.where(mask, np.log(rng.uniform(0.001, 0.05, (rows, T))), 0.0).astype(np.float32)
    return {"tokens": toks[:, :-1], "targets": toks[:, 1:], "segment_ids": np.ones((rows, T), np.int32),
            "loss_mask": mask, "behaviour_logprobs": mu, "loss_weights": loss_weights(mask), "advantages": adv}


def run(client, b, steps, publish, run_dir):
    """-> (seconds of each learner step but the first two (warm-up: compiles, the publisher's first write), the
    publisher)."""
    ts = []
    for _ in range(steps):
        t0 = time.perf_counter()
        client.forward_backward(b)
        client.optim_step()
        if publish:
            client.publish(run_dir, **publish)
        jax.block_until_ready(client.adapters)
        ts.append(time.perf_counter() - t0)
    pub = client.publisher
    client.flush_publishing()
    return ts[2:], pub


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--rank", type=int, default=128)
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--steps", type=int, default=8, help="steps per block")
    ap.add_argument("--rounds", type=int, default=3, help="blocks of each mode, interleaved (a busy host's noise "
                    "hits all three alike)")
    ap.add_argument("--format", default="vllm", choices=("vllm", "peft"))
    ap.add_argument("--dtype", default="train", choices=("train", "bf16"))
    a = ap.parse_args()
    cfg = NemotronHConfig.from_file(model_config_path(a.model))
    lc = LoraConfig(targets=("all",) if a.format == "vllm" else ("attention", "experts", "mlp"), rank=a.rank)
    client = TrainingClient(cfg, init(cfg, jax.random.key(0)), lc, optim=OptimSection(lr=1e-4, warmup_steps=0))
    b = batch(cfg, a.rows, a.seq)
    size = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(client.adapters))
    dtype = None if a.dtype == "train" else jnp.bfloat16
    modes = {"none": None, "background (grpo)": dict(format=a.format, dtype=dtype, keep=2),
             "synchronous": dict(format=a.format, dtype=dtype, keep=2, wait=True)}
    times, written, write_s, skipped = {m: [] for m in modes}, 0, 0.0, 0
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(a.rounds):
            for m, publish in modes.items():
                ts, pub = run(client, b, a.steps, publish, os.path.join(tmp, f"{i}-{len(times[m])}"))
                times[m] += ts
                if m.startswith("background"):
                    written, write_s, skipped = written + len(pub.written), write_s + pub.write_s, skipped + pub.skipped
    none = statistics.median(times["none"])
    rows = [{"publishing": m, "step_s": f"{statistics.median(t):.4f}", "vs_none": f"{statistics.median(t) / none:.2f}"}
            for m, t in times.items()]
    print(f"{a.model}: LoRA rank {a.rank}, adapters {common.mib(size)} ({a.dtype} -> {a.format} format), "
          f"batch {a.rows} x {a.seq}, {jax.device_count()} device(s) {jax.devices()[0].platform}")
    common.table(rows)
    print(f"background thread: {write_s / max(written, 1):.4f} s per version written (device-to-host + write), "
          f"{written} written, {skipped} skipped (a newer one was ready)")
    client.close()


if __name__ == "__main__":
    main()
