"""The Tinker API's overhead: the official SDK through `nemo-jax serve --tinker-root` against nemo_jax in-process,
on the same model and batch, over loopback.

    python bench/tinker.py [--rows 8 --len 128 --steps 10 --runs 3 --samples 16 --max-tokens 32]

The tiny model (`tiny.json`: Mamba, attention, MoE, MLP; random weights) is saved as an HF dir and served in a
subprocess. Side by side, per run:

* train step: one `forward_backward` (cross_entropy, `--rows` datums of `--len` tokens) + `optim_step` through the
  SDK (pipelined, both awaited), against the in-process `nemo_jax.rl.client.TrainingClient` (`forward_backward` +
  `optim_step`) over the same params, LoRA targets, rank and batch, the two taking turns step by step: median
  seconds per step and the ratio (goal: <= 1.2x); beside it the server's own mean seconds per step (its
  `GET /api/v1/stats`), which the SDK's step exceeds by the API's cost alone (HTTP, protobuf, futures): the two
  processes share this machine's cores with whatever else runs, so the ratio of two processes' times moves more
  than that difference;
* sampling: `--samples` prompts (24 tokens), `--max-tokens` new tokens each, all submitted at once: the SDK's
  `sample` (one request each, num_samples=1) of the base model against serve's OpenAI route `/v1/completions`
  (token-id prompts,
  ignore_eos, the same concurrency): sampled tokens per second (median of three rounds), the ratio of the
  OpenAI route's rate to the SDK's, and the CPU seconds the client process spends per round (the SDK's own
  work: two requests per sample, the submission and the long poll).

--runs repeats both on the same warm server and client (this machine is noisy: each run is printed).

    python bench/tinker.py --clients 1,4,8 [--rank 32 --rows 8 --len 128 --steps 10 --runs 3]

instead measures many clients at once: K SDK training clients (LoRA rank `--rank`), each sending its
`forward_backward` + `optim_step` of its own batch at the same moment, round after round: the median seconds of a
round (every client's step done) for each K, on a server that batches the clients' forward / backward passes into
one call (`--tinker-batch-clients` the largest K) and, side by side, on one that runs each client's alone (the
default, `--tinker-batch-clients 1`); the ratio of K clients' round to one client's step on each (goal: 8 clients
< 3x).
"""

import argparse
import concurrent.futures as cf
import json
import os
import sys
import tempfile
import time

import common  # (sys.path, allocator settings)
import numpy as np

# this file's name is the SDK's: the SDK must be imported from site-packages, not from bench/
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != os.path.dirname(os.path.abspath(__file__))]
sys.modules.pop("tinker", None)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KEY = "bench"


def median_steps(fns, steps: int) -> list[float]:
    """Median seconds per call of each of `fns`, called in turn (ABAB...: the machine's load drifts alike for all)."""
    ts = [[] for _ in fns]
    for _ in range(steps):
        for fn, t in zip(fns, ts):
            t0 = time.perf_counter()
            fn()
            t.append(time.perf_counter() - t0)
    return [float(np.median(t)) for t in ts]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--len", type=int, default=128)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--samples", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--clients", default=None, metavar="K,K,...", help="measure K clients at once instead")
    ap.add_argument("--rank", type=int, default=32, help="the LoRA rank of --clients' clients")
    a = ap.parse_args(argv)
    os.environ.setdefault("TINKER_TELEMETRY", "0")
    if a.clients:
        return many_clients(a, sorted({1, *(int(k) for k in a.clients.split(","))}))
    import httpx
    import jax
    import openai
    import tinker
    from tinker import types

    from nemo_jax.hf.io import load_pretrained
    from nemo_jax.lora import LoraConfig
    from nemo_jax.rl.client import TrainingClient
    from nemo_jax.tinker.registry import LORA_ALPHA, lora_targets

    tmp, cfg, hf = tiny_model()
    log = open(os.path.join(tmp, "serve.log"), "w")
    proc, port = common.start_serve(["--ckpt", hf, "--tinker-root", os.path.join(tmp, "root"), "--max-model-len",
                                     "256", "--max-num-seqs", str(a.samples), "--served-model-name", "tiny",
                                     "--api-key", KEY], log)
    url = f"http://127.0.0.1:{port}"
    try:
        rng = np.random.default_rng(0)
        seqs = [rng.integers(3, cfg.vocab_size, a.len + 1).tolist() for _ in range(a.rows)]
        # ---- the SDK through the server
        sc = tinker.ServiceClient(base_url=url, api_key="tml-" + KEY)
        tc = sc.create_lora_training_client("tiny", rank=8, seed=0).result()
        data = [types.Datum(model_input=types.ModelInput.from_ints(s[:-1]),
                            loss_fn_inputs={"target_tokens": s[1:], "weights": [1.0] * a.len}) for s in seqs]

        def sdk_step():
            fb = tc.forward_backward(data, "cross_entropy")
            op = tc.optim_step(types.AdamParams(learning_rate=1e-4))
            fb.result()
            op.result()

        def worker_seconds() -> tuple[int, float]:  # the server's own time on forward_backward + optim_step
            w = httpx.get(url + "/api/v1/stats", headers={"X-API-Key": "tml-" + KEY}).json()["worker"]
            zero = {"requests": 0, "seconds": 0.0}
            return w.get("optim", zero)["requests"], sum(w.get(k, zero)["seconds"] for k in ("fwdbwd", "optim"))
        # ---- in-process: the same params, LoRA, batch
        _, params = load_pretrained(hf)
        lc = LoraConfig(lora_targets(cfg, True, True, True), 8, LORA_ALPHA)
        client = TrainingClient(cfg, params, lc)
        s = np.asarray(seqs)
        batch = {"tokens": s[:, :-1].astype(np.int32), "targets": s[:, 1:].astype(np.int32),
                 "segment_ids": np.ones((a.rows, a.len), np.int32), "loss_mask": np.ones((a.rows, a.len), bool),
                 "behaviour_logprobs": np.zeros((a.rows, a.len), np.float32),
                 "loss_weights": np.ones((a.rows, a.len), np.float32), "advantages": np.zeros(a.rows, np.float32)}

        def local_step():
            client.forward_backward(batch, loss="cross_entropy")
            client.optim_step()
            jax.block_until_ready(client.adapters)
        # ---- sampling: the SDK's sample vs the OpenAI route
        sampler = sc.create_sampling_client(base_model="tiny").result()  # the base, as the OpenAI route samples
        prompts = [rng.integers(3, cfg.vocab_size, 24).tolist() for _ in range(a.samples)]

        def sdk_sample() -> int:
            sp = types.SamplingParams(max_tokens=a.max_tokens, stop=[], seed=1)
            futs = [sampler.sample(types.ModelInput.from_ints(p), 1, sp) for p in prompts]
            return sum(len(f.result().sequences[0].tokens) for f in futs)
        oai = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=600)

        def oai_sample() -> int:
            def one(p):
                r = oai.completions.create(model="tiny", prompt=p, max_tokens=a.max_tokens, seed=1,
                                           extra_body={"ignore_eos": True})
                return r.usage.completion_tokens
            with cf.ThreadPoolExecutor(a.samples) as ex:
                return sum(ex.map(one, prompts))

        def rate(fn, reps: int = 3) -> tuple[float, float]:
            """-> (median tokens per second, median CPU seconds this (client) process spent per round)."""
            fn(), fn()  # warm-up (the engine compiles a shape per count of rows it prefills at once)
            rates, cpu = [], []
            for _ in range(reps):
                t0, c0 = time.perf_counter(), time.process_time()
                n = fn()
                rates.append(n / (time.perf_counter() - t0))
                cpu.append(time.process_time() - c0)
            return float(np.median(rates)), float(np.median(cpu))
        print(f"tiny model, LoRA rank 8 on {list(lc.targets)}; train batch {a.rows} x {a.len} tokens; sampling "
              f"{a.samples} x {a.max_tokens} tokens")
        # warm-up: one untimed pass of everything measured below (the first steps and sampling rounds compile; a
        # single call of each left compiles inside the first measured run)
        median_steps([sdk_step, local_step], 2)
        rate(sdk_sample, reps=1), rate(oai_sample, reps=1)
        rows = []
        for run in range(a.runs):
            n0, w0 = worker_seconds()
            sdk, local = median_steps([sdk_step, local_step], a.steps)
            n1, w1 = worker_seconds()
            server = (w1 - w0) / max(n1 - n0, 1)  # mean seconds the server's learner spent per step
            (s_rate, s_cpu), (o_rate, o_cpu) = rate(sdk_sample), rate(oai_sample)
            rows.append((sdk, local, s_rate, o_rate))
            print(f"run {run + 1}: train step SDK {sdk * 1e3:7.1f} ms (server's learner {server * 1e3:6.1f} ms)  "
                  f"in-process {local * 1e3:7.1f} ms  ratio {sdk / local:5.2f}x | sampling SDK {s_rate:7.1f} tok/s  OpenAI route {o_rate:7.1f} tok/s  "
                  f"ratio {o_rate / s_rate:5.2f}x (client CPU per round {s_cpu:.3f} / {o_cpu:.3f} s)", flush=True)
        print(json.dumps({"train_ratio": [round(r[0] / r[1], 3) for r in rows],
                          "sample_ratio": [round(r[3] / r[2], 3) for r in rows]}))
        sc.close("success").result()
    finally:
        proc.terminate()
        proc.wait(60)


def tiny_model():
    """-> (a temporary folder, the tiny model's config, its HF dir there: random weights, the builtin tokenizer)."""
    import jax

    from nemo_jax.config.model import NemotronHConfig
    from nemo_jax.data.chat import resolve
    from nemo_jax.hf.io import save_pretrained
    from nemo_jax.model import init

    tmp = tempfile.mkdtemp(prefix="bench-tinker-")
    cfg = NemotronHConfig.from_file(os.path.join(ROOT, "nemo_jax", "assets", "models", "tiny.json"))
    hf = os.path.join(tmp, "tiny-hf")
    save_pretrained(cfg, init(cfg, jax.random.key(0)), hf, tokenizer_dir=resolve("builtin:tiny"))
    return tmp, cfg, hf


def many_clients(a, counts: list[int]):
    """K clients stepping at once, on a batching server and on one that runs each client alone (module
    docstring)."""
    import tinker
    from tinker import types

    tmp, cfg, hf = tiny_model()
    rng = np.random.default_rng(0)
    top = max(counts)
    data = [[types.Datum(model_input=types.ModelInput.from_ints(s[:-1]),
                         loss_fn_inputs={"target_tokens": s[1:], "weights": [1.0] * a.len})
             for s in rng.integers(3, cfg.vocab_size, (a.rows, a.len + 1)).tolist()] for _ in range(top)]
    servers = {}
    try:
        for name, batch in (("batched", top), ("one by one", 1)):
            log = open(os.path.join(tmp, f"serve-{batch}.log"), "w")
            servers[name] = common.start_serve(
                ["--ckpt", hf, "--tinker-root", os.path.join(tmp, f"root-{batch}"), "--max-model-len", "256",
                 "--served-model-name", "tiny", "--api-key", KEY, "--tinker-max-rank", str(a.rank),
                 "--tinker-batch-clients", str(batch), "--no-warmup"], log)
        clients = {name: [tinker.ServiceClient(base_url=f"http://127.0.0.1:{port}", api_key="tml-" + KEY)
                          .create_lora_training_client("tiny", rank=a.rank, seed=k).result() for k in range(top)]
                   for name, (_, port) in servers.items()}

        def round_of(name: str, k: int):
            def go():
                tcs = clients[name][:k]
                fbs = [tc.forward_backward(d, "cross_entropy") for tc, d in zip(tcs, data)]
                ops = [tc.optim_step(types.AdamParams(learning_rate=1e-4)) for tc in tcs]
                for f in fbs + ops:
                    f.result()
            return go
        fns = [round_of(name, k) for name in clients for k in counts]
        print(f"tiny model, {top} clients of LoRA rank {a.rank}; each client's batch {a.rows} x {a.len} tokens; "
              f"median seconds of a round (every client's forward_backward + optim_step), {a.steps} rounds")
        median_steps(fns, 2)  # warm-up: every shape compiles
        out = []
        for run in range(a.runs):
            t = dict(zip([(name, k) for name in clients for k in counts], median_steps(fns, a.steps)))
            cells = [f"{name}: " + "  ".join(f"{k} clients {t[name, k] * 1e3:7.1f} ms ({t[name, k] / t[name, 1]:.2f}x)"
                                             for k in counts) for name in clients]
            print(f"run {run + 1}: " + " | ".join(cells), flush=True)
            out.append({f"{name} {k}": round(t[name, k] / t[name, 1], 3) for name in clients for k in counts})
        print(json.dumps({"ratio_to_one_client": out}))
    finally:
        for proc, _ in servers.values():
            proc.terminate()
            proc.wait(60)


if __name__ == "__main__":
    main()
