"""Streaming merge speed and memory: `nemo-jax merge` of three synthetic HF checkpoints (random bf16 tensors
shaped like a scaled-down Nano 3, >= 4 GB each) with the QK-restore recipe plus a task vector, as a ratio to
reading all three inputs and writing the output once with plain file copies, and peak RSS as a ratio to the
largest single tensor. Goal: time <= 1.5x, RSS <= 2x the largest tensor + 1 GB.

Both sides run from the same page-cache state, set before each timing: `cold` (the inputs flushed and
dropped from the page cache with posix_fadvise(DONTNEED), so they are read from disk: the condition of a
real merge of 3 x 247 GB, which no page cache holds) and `warm` (the inputs read once beforehand, so only
the CPU and the writes count).

    python bench/merge.py [--dir /tmp/merge_bench] [--cache cold|warm|both] [--keep] [--reuse]
        (--reuse: the inputs a --keep run left in --dir)
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

import common
import numpy as np
from convert import synth_config, write_checkpoint

from nemo_jax.hf.mapping import build_table

CHILD = r"""
import sys, time, json
t0 = time.perf_counter()
from nemo_jax.cli import main
main(["merge"] + sys.argv[1:])
hwm = [int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmHWM")][0]
print(json.dumps({"seconds": time.perf_counter() - t0, "peak_rss": hwm}))
"""

RECIPE = """\
output: {out}
models: {{base: {d}/base, sft: {d}/sft, rl: {d}/rl}}
rules:
  - match: '\\.mixer\\.(q_proj|k_proj)\\.weight$'   # QK-restore
    take: base
  - match: '.*'                                      # SFT and RL task vectors on the base
    task_arithmetic: {{sft: 0.5, rl: 0.3}}
"""


MODELS = ("base", "sft", "rl")


def set_cache(d: str, state: str):
    """Flush dirty pages, then drop the inputs from the page cache (`cold`) or read them once (`warm`)."""
    os.sync()
    for m in MODELS:
        for f in os.listdir(os.path.join(d, m)):
            fp = os.path.join(d, m, f)
            if state == "cold":
                fd = os.open(fp, os.O_RDONLY)
                try:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                finally:
                    os.close(fd)
            else:
                with open(fp, "rb", buffering=0) as fh:
                    while fh.read(1 << 24):
                        pass


def timed_copies(d: str) -> float:
    """Read every input once and write one output's bytes: `cp -r base` (+ sync) and `cat` of the others."""
    t0 = time.perf_counter()
    subprocess.run(["cp", "-r", os.path.join(d, "base"), os.path.join(d, "copy")], check=True)
    for m in ("sft", "rl"):
        subprocess.run(f"cat {os.path.join(d, m)}/*.safetensors > /dev/null", shell=True, check=True)
    subprocess.run(["sync"])
    dt = time.perf_counter() - t0
    shutil.rmtree(os.path.join(d, "copy"))
    subprocess.run(["sync"])
    return dt


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", default="/tmp/merge_bench")
    ap.add_argument("--keep", action="store_true")
    ap.add_argument("--reuse", action="store_true", help="reuse the inputs a --keep run left in --dir")
    ap.add_argument("--cache", choices=("cold", "warm", "both"), default="both")
    a = ap.parse_args()
    cfg = synth_config()
    if not a.reuse:
        shutil.rmtree(a.dir, ignore_errors=True)
    shutil.rmtree(os.path.join(a.dir, "merged"), ignore_errors=True)
    try:
        if a.reuse:
            base = os.path.join(a.dir, "base")
            total = sum(os.path.getsize(os.path.join(base, f)) for f in os.listdir(base) if f.endswith(".safetensors"))
            largest = max(int(np.prod(e.hf_shape)) * 2 for e in build_table(cfg))
        else:
            sizes = [write_checkpoint(cfg, os.path.join(a.dir, m), seed=seed) for seed, m in enumerate(MODELS)]
            total, largest = sizes[0]
        recipe = os.path.join(a.dir, "recipe.yaml")
        with open(recipe, "w") as f:
            f.write(RECIPE.format(out=os.path.join(a.dir, "merged"), d=a.dir))
        rows, report = [], ""
        for state in (("cold", "warm") if a.cache == "both" else (a.cache,)):
            set_cache(a.dir, state)
            t_copy = timed_copies(a.dir)
            shutil.rmtree(os.path.join(a.dir, "merged"), ignore_errors=True)
            set_cache(a.dir, state)
            out = subprocess.run([sys.executable, "-c", CHILD, recipe], capture_output=True, text=True)
            if out.returncode:
                raise SystemExit(out.stderr[-3000:])
            os.sync()
            r = json.loads(out.stdout.strip().splitlines()[-1])
            report = "\n".join(out.stdout.strip().splitlines()[:-1][-12:])
            rows.append({"inputs": state, "merge s": f"{r['seconds']:.1f}", "copies s": f"{t_copy:.1f}",
                         "time / copies": f"{r['seconds'] / t_copy:.2f}x", "goal time": "<= 1.50x",
                         "peak RSS": f"{r['peak_rss'] / 2**30:.2f} GiB",
                         "RSS / largest tensor": f"{r['peak_rss'] / largest:.2f}x",
                         "goal RSS": f"<= {(2 * largest + 2**30) / 2**30:.2f} GiB"})
        print(f"inputs: 3 x {total / 1e9:.2f} GB, largest tensor {largest / 2**20:.0f} MiB; recipe: QK-restore + "
              "task vectors (base + 0.5 (sft - base) + 0.3 (rl - base)), fp32 math, bf16 out")
        common.table(rows)
        print(report)
    finally:
        if not a.keep:
            shutil.rmtree(a.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
