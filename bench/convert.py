"""HF conversion speed and memory: import (HF safetensors -> native orbax) and export (native -> HF) of a
synthetic multi-shard checkpoint of random bf16 tensors shaped like a scaled-down Nano 3 (>= 4 GB), as a
ratio to `cp -r` of the same bytes, and peak RSS as a ratio to the largest single tensor.

    python bench/convert.py [--dir /tmp/convert_bench] [--keep]
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

import common  # noqa: F401
import ml_dtypes
import numpy as np

from nemo_jax.config.model import NemotronHConfig, parse_pattern
from nemo_jax.hf.mapping import build_table

CHILD = r"""
import sys, time, json
t0 = time.perf_counter()
mode, src, dst = sys.argv[1:4]
from nemo_jax.cli import main
main([mode, src, dst])
# VmHWM is this process's own peak (getrusage's ru_maxrss carries the parent's peak across fork+exec)
hwm = [int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmHWM")][0]
print(json.dumps({"seconds": time.perf_counter() - t0, "peak_rss": hwm}))
"""


def synth_config() -> NemotronHConfig:
    return NemotronHConfig(vocab_size=131072, hidden_size=2688, layer_kinds=parse_pattern("MEMEM*EME"),
                           num_attention_heads=32, num_key_value_heads=2, head_dim=128, intermediate_size=1856,
                           mamba_num_heads=64, mamba_head_dim=64, ssm_state_size=128, n_groups=8,
                           n_routed_experts=32, num_experts_per_tok=6, moe_intermediate_size=1856,
                           moe_shared_expert_intermediate_size=3712, routed_scaling_factor=2.5)


def write_checkpoint(cfg, path, shard_bytes=1 << 30, seed: int = 0) -> tuple[int, int]:
    """Random finite bf16 tensors (the fp32 correction bias as fp32), sharded with an index.
    -> (bytes on disk, bytes of the largest tensor)."""
    from safetensors.numpy import save_file

    os.makedirs(path, exist_ok=True)
    rng = np.random.default_rng(seed)
    shards, cur, size, weight_map = [], {}, 0, {}
    table = build_table(cfg)

    def flush():
        nonlocal cur, size
        if cur:
            name = f"model-{len(shards) + 1:05d}.safetensors"
            save_file(cur, os.path.join(path, name), metadata={"format": "pt"})
            shards.append(name)
            weight_map.update({k: name for k in cur})
            cur, size = {}, 0

    for e in table:
        n = int(np.prod(e.hf_shape))
        bits = rng.integers(0, 1 << 16, n, dtype=np.uint16) & np.uint16(0xBFFF)  # finite bf16 values
        arr = bits.view(ml_dtypes.bfloat16).reshape(e.hf_shape)
        if "correction_bias" in e.hf_name:
            arr = arr.astype(np.float32)
        if size + arr.nbytes > shard_bytes:
            flush()
        cur[e.hf_name] = arr
        size += arr.nbytes
    flush()
    total = sum(os.path.getsize(os.path.join(path, s)) for s in shards)
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg.to_hf_dict(), f)
    largest = max(int(np.prod(e.hf_shape)) * 2 for e in table)
    return total, largest


def run_child(mode, src, dst):
    out = subprocess.run([sys.executable, "-c", CHILD, mode, src, dst], capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(out.stderr[-3000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def timed_cp(src, dst) -> float:
    """`cp -r` of the checkpoint plus `sync` (coreutils copies in the kernel with copy_file_range)."""
    subprocess.run(["sync"])
    t0 = time.perf_counter()
    subprocess.run(["cp", "-r", src, dst], check=True)
    subprocess.run(["sync"])
    dt = time.perf_counter() - t0
    shutil.rmtree(dst)
    subprocess.run(["sync"])
    return dt


def timed_write(path, nbytes) -> float:
    """Writing `nbytes` from user space (64 MiB buffers) plus fsync: the floor for any converter that
    changes the bytes (a transpose can't go through copy_file_range)."""
    buf = memoryview(np.ones(64 << 20, np.uint8))
    subprocess.run(["sync"])
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        for _ in range(0, nbytes, len(buf)):
            f.write(buf)
        f.flush()
        os.fsync(f.fileno())
    dt = time.perf_counter() - t0
    os.remove(path)
    return dt


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", default="/tmp/convert_bench")
    ap.add_argument("--keep", action="store_true")
    a = ap.parse_args()
    shutil.rmtree(a.dir, ignore_errors=True)
    cfg = synth_config()
    src = os.path.join(a.dir, "hf")
    total, largest = write_checkpoint(cfg, src)
    rows = []
    for name, s, d in (("import-hf", src, "native"), ("export-hf", os.path.join(a.dir, "native"), "back")):
        t_cp = timed_cp(src, os.path.join(a.dir, "copy"))
        t_w = timed_write(os.path.join(a.dir, "write.bin"), total)
        subprocess.run(["sync"])
        r = run_child(name, s, os.path.join(a.dir, d))
        rows.append({"step": name, "seconds": f"{r['seconds']:.1f}", "cp -r": f"{t_cp:.1f}",
                     "time / cp -r": f"{r['seconds'] / t_cp:.2f}x", "time / write": f"{r['seconds'] / t_w:.2f}x",
                     "peak RSS": f"{r['peak_rss'] / 2**30:.2f} GiB",
                     "RSS / largest tensor": f"{r['peak_rss'] / largest:.2f}x",
                     "goal RSS": f"<= {(2 * largest + 2**30) / 2**30:.2f} GiB"})
    print(f"checkpoint: {total / 1e9:.2f} GB in {len(os.listdir(src)) - 2} shards, largest tensor "
          f"{largest / 2**20:.0f} MiB; `time / write`: against writing the same bytes from Python + fsync")
    common.table(rows)
    if not a.keep:
        shutil.rmtree(a.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
