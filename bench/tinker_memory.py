"""Resident memory of `nemo-jax serve --tinker-root` over plain `nemo-jax serve`, on a model large enough that its
weights dominate the process (the Tinker learner computes over the serving engine's own copy of the base: the
weights are held once).

    python bench/tinker_memory.py [--width 12 --layers 8 --runs 3]

The tiny model's config `--width` times as wide (hidden, heads, MLP, expert and Mamba widths) with `--layers`
layers (Mamba, attention, MoE, MLP in the tiny order; random fp32 weights) is saved as an HF dir; per run, both servers are started in turn (no warm-up, the
compilation cache off), and each one's resident set (VmRSS, and the peak VmHWM) is read once it answers /health,
then again after one sampling request and, on the Tinker server, after a LoRA client's first forward_backward +
optim_step through the official SDK (the learner's compiled step and its adapters now resident too). Printed side
by side with the ratio; the weights' own bytes beside them.
"""

import argparse
import json
import os
import sys
import tempfile

import common  # (sys.path, allocator settings)

# the SDK is imported from site-packages, never from bench/ (bench/tinker.py shares its name)
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != os.path.dirname(os.path.abspath(__file__))]
sys.modules.pop("tinker", None)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KEY = "bench"


def rss(pid: int) -> tuple[float, float]:
    """(VmRSS, VmHWM) of a process, MiB."""
    got = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            k, _, v = line.partition(":")
            if k in ("VmRSS", "VmHWM"):
                got[k] = int(v.split()[0]) / 1024
    return got["VmRSS"], got["VmHWM"]


def serve(hf: str, tmp: str, tinker_root: str | None):
    log = open(os.path.join(tmp, f"serve-{len(os.listdir(tmp))}.log"), "w+")
    extra = ["--tinker-root", tinker_root] if tinker_root else []
    proc, port = common.start_serve(["--ckpt", hf, "--max-model-len", "256", "--max-num-seqs", "4",
                                     "--served-model-name", "m", "--api-key", KEY, "--no-warmup",
                                     "--compilation-cache", "off", *extra], log)
    return proc, f"http://127.0.0.1:{port}"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--width", type=int, default=12)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--runs", type=int, default=3)
    a = ap.parse_args(argv)
    os.environ.setdefault("TINKER_TELEMETRY", "0")
    import httpx
    import jax
    import numpy as np
    import tinker
    from tinker import types

    from nemo_jax.config.model import NemotronHConfig
    from nemo_jax.data.chat import resolve
    from nemo_jax.hf.io import save_pretrained
    from nemo_jax.model import init

    tmp = tempfile.mkdtemp(prefix="bench-tinker-memory-")
    with open(os.path.join(ROOT, "nemo_jax", "assets", "models", "tiny.json")) as f:
        hfc = json.load(f)
    order = hfc["layers_block_type"]
    for k in ("hidden_size", "num_attention_heads", "num_key_value_heads", "intermediate_size", "mamba_num_heads",
              "moe_intermediate_size", "moe_shared_expert_intermediate_size"):
        hfc[k] *= a.width
    hfc.update(layers_block_type=[order[i % len(order)] for i in range(a.layers)], num_hidden_layers=a.layers)
    with open(os.path.join(tmp, "model.json"), "w") as f:
        json.dump(hfc, f)
    cfg = NemotronHConfig.from_file(os.path.join(tmp, "model.json"))
    params = init(cfg, jax.random.key(0))
    weights = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params)) / 2 ** 20
    hf = os.path.join(tmp, "hf")
    save_pretrained(cfg, params, hf, tokenizer_dir=resolve("builtin:tiny"))
    del params
    print(f"model: the tiny config x{a.width} wide (hidden {hfc['hidden_size']}), {a.layers} layers, weights "
          f"{weights:.0f} MiB fp32", flush=True)
    seq = np.random.default_rng(0).integers(3, cfg.vocab_size, 65).tolist()
    print(f"{'run':>3}  {'serve RSS':>10}  {'+tinker RSS':>11}  {'ratio':>6}  {'after a step':>12}  {'ratio':>6}  "
          f"{'peak':>7}  MiB", flush=True)
    for run in range(a.runs):
        plain, url = serve(hf, tmp, None)
        try:
            httpx.post(url + "/v1/completions", json={"model": "m", "prompt": seq[:8], "max_tokens": 4},
                       headers={"Authorization": f"Bearer {KEY}"}, timeout=600)
            base_rss, _ = rss(plain.pid)
        finally:
            plain.terminate()
            plain.wait()
        proc, url = serve(hf, tmp, os.path.join(tmp, f"root{run}"))
        try:
            httpx.post(url + "/v1/completions", json={"model": "m", "prompt": seq[:8], "max_tokens": 4},
                       headers={"Authorization": f"Bearer {KEY}"}, timeout=600)
            ready_rss, _ = rss(proc.pid)
            sc = tinker.ServiceClient(base_url=url, api_key="tml-" + KEY)
            tc = sc.create_lora_training_client("m", rank=8, seed=0).result()
            datum = types.Datum(model_input=types.ModelInput.from_ints(seq[:-1]),
                                loss_fn_inputs={"target_tokens": seq[1:], "weights": [1.0] * 64})
            tc.forward_backward([datum], "cross_entropy").result()
            tc.optim_step(types.AdamParams(learning_rate=1e-4)).result()
            step_rss, peak = rss(proc.pid)
            sc.close("success").result()
        finally:
            proc.terminate()
            proc.wait()
        print(f"{run:>3}  {base_rss:>10.0f}  {ready_rss:>11.0f}  {ready_rss / base_rss:>5.2f}x  {step_rss:>12.0f}  "
              f"{step_rss / base_rss:>5.2f}x  {peak:>7.0f}", flush=True)


if __name__ == "__main__":
    main()
