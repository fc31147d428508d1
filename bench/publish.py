"""Publishing a policy version does not lengthen the GRPO learner's step: the step (forward_backward + optim_step of
`TrainingClient`) timed without publishing, publishing every step from the background thread (what `nemo-jax
grpo` does), and publishing every step synchronously (waiting for the disk, as before), side by side.

    python bench/publish.py [--model tiny --rank 128 --rows 8 --seq 256 --steps 16 --format vllm --dtype train]

Also prints the adapters' size, the seconds the background thread spent per version (device-to-host copy and
write) and how many versions it skipped because a newer one was ready first (the disk slower than the learner).
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
    """-> (median seconds per learner step (the first two are warm-up: compiles, the publisher's first write),
    the publisher)."""
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
    return statistics.median(ts[2:]), pub


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--rank", type=int, default=128)
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--format", default="vllm", choices=("vllm", "peft"))
    ap.add_argument("--dtype", default="train", choices=("train", "bf16"))
    a = ap.parse_args()
    cfg = NemotronHConfig.from_file(model_config_path(a.model))
    lc = LoraConfig(targets=("all",) if a.format == "vllm" else ("attention", "experts", "mlp"), rank=a.rank)
    client = TrainingClient(cfg, init(cfg, jax.random.key(0)), lc, optim=OptimSection(lr=1e-4, warmup_steps=0))
    b = batch(cfg, a.rows, a.seq)
    size = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(client.adapters))
    dtype = None if a.dtype == "train" else jnp.bfloat16
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        none, _ = run(client, b, a.steps, None, None)
        bg, pub = run(client, b, a.steps, dict(format=a.format, dtype=dtype, keep=2), os.path.join(tmp, "bg"))
        sync, _ = run(client, b, a.steps, dict(format=a.format, dtype=dtype, keep=2, wait=True),
                      os.path.join(tmp, "sync"))
    rows.append({"publishing": "none", "step_s": f"{none:.4f}", "vs_none": "1.00"})
    rows.append({"publishing": "background (grpo)", "step_s": f"{bg:.4f}", "vs_none": f"{bg / none:.2f}"})
    rows.append({"publishing": "synchronous", "step_s": f"{sync:.4f}", "vs_none": f"{sync / none:.2f}"})
    print(f"{a.model}: LoRA rank {a.rank}, adapters {common.mib(size)} ({a.dtype} -> {a.format} format), "
          f"batch {a.rows} x {a.seq}, {jax.device_count()} device(s) {jax.devices()[0].platform}")
    common.table(rows)
    print(f"background thread: {pub.write_s / max(len(pub.written), 1):.4f} s per version written "
          f"(device-to-host + write), {len(pub.written)} written, {pub.skipped} skipped (a newer one was ready)")
    client.close()


if __name__ == "__main__":
    main()
