"""`nemo-jax serve` under concurrent load, driven over loopback (127.0.0.1 only) by the official `openai` client.

    python bench/serve.py [--levels 1,8,32,64 --requests 64 --max-tokens 64 --runs 3 --rss-requests 1000]

A tiny random model (the shipped `tiny.json` config, builtin:tiny tokenizer) is saved to a temporary dir and served
in a subprocess with --max-num-seqs as large as the largest level. For each level of concurrency, `--requests`
streamed completions (random prompts of 16-48 tokens, exactly --max-tokens tokens each: ignore_eos) are sent by
that many concurrent clients; every level is bounded by --time-limit seconds. Per level, side by side:

* throughput: sampled tokens per second of wall time;
* p50 / p99 time to first token (request sent -> first streamed token) and per-token latency (a request's time
  from its first to its last token over its tokens after the first);
* the speed-up: the level's tokens/s over the sequential one (level 1). Goal: >= 4x at 32 concurrent;
* then the server's RSS before and after --rss-requests more requests (32 at a time, non-streamed, 8 tokens), and
  after as many again: no growth beyond noise.

--runs repeats the levels on the same (warm) server: each run is printed (this machine is noisy).

First, a cold start (skip with --no-cold): the server is started on an empty compilation cache (its warm-up
compiles everything before it says ready), and right after ready --burst concurrent streamed completions are sent,
then as many one at a time (goal: the burst >= 2x faster), then the first request of each common kind (sampling,
logprobs with top 5, tools, stop strings, penalties with n=2), each timed. The server is then restarted on the
cache its first start filled (the time to ready printed) and serves the levels.
"""

import argparse
import asyncio
import json
import os
import tempfile
import time

import common  # (sys.path, allocator settings)
import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def save_model(path: str) -> None:
    import jax

    from nemo_jax.checkpoint import save_model as save
    from nemo_jax.config.model import NemotronHConfig
    from nemo_jax.data.chat import resolve
    from nemo_jax.model import init

    with open(os.path.join(ROOT, "nemo_jax", "assets", "models", "tiny.json")) as f:
        cfg = NemotronHConfig.from_hf_dict(json.load(f))
    save(path, cfg, init(cfg, jax.random.key(0)), tokenizer_dir=resolve("builtin:tiny"))


def start_server(model: str, key: str, rows: int, log, cache: str | None = None):
    """The tiny model served with `rows` rows -> (the process, its port)."""
    return common.start_serve(["--ckpt", model, "--max-num-seqs", str(rows), "--max-model-len", "256", "--bucket",
                               "32", "--served-model-name", "tiny"] + (["--compilation-cache", cache] if cache else []),
                              log, env={"NEMO_JAX_API_KEY": key})


async def one(client, prompt: list[int], max_tokens: int) -> tuple[float, float, int]:
    """A streamed completion -> (time to first token, seconds from first to last token, tokens)."""
    t0 = time.perf_counter()
    first = last = None
    n = 0
    stream = await client.completions.create(model="tiny", prompt=prompt, max_tokens=max_tokens, temperature=1.0,
                                             stream=True, extra_body={"ignore_eos": True, "return_token_ids": True})
    async for chunk in stream:
        for c in chunk.choices:
            k = len((c.model_extra or {}).get("token_ids") or [])
            if k:
                now = time.perf_counter()
                first = now if first is None else first
                last = now
                n += k
    return first - t0, last - first, n


async def level(client, concurrency: int, requests: int, max_tokens: int, time_limit: float, rng) -> dict:
    """`requests` streamed completions, `concurrency` at a time (stopped after `time_limit` s) -> the figures."""
    prompts = [rng.integers(10, 480, rng.integers(16, 49)).tolist() for _ in range(max(requests, concurrency))]
    todo = iter(prompts)
    out = []
    deadline = time.perf_counter() + time_limit

    async def client_loop():
        for p in todo:
            if time.perf_counter() > deadline:
                return
            out.append(await one(client, p, max_tokens))
    t0 = time.perf_counter()
    await asyncio.gather(*(client_loop() for _ in range(concurrency)))
    wall = time.perf_counter() - t0
    ttft = np.array([x[0] for x in out])
    tpot = np.array([x[1] / max(x[2] - 1, 1) for x in out])
    tokens = sum(x[2] for x in out)
    return {"concurrency": concurrency, "requests": len(out), "tokens": tokens, "tok/s": tokens / wall,
            "ttft p50 ms": 1e3 * np.percentile(ttft, 50), "ttft p99 ms": 1e3 * np.percentile(ttft, 99),
            "per-token p50 ms": 1e3 * np.percentile(tpot, 50), "per-token p99 ms": 1e3 * np.percentile(tpot, 99)}


async def first_requests(port: int, key: str, burst: int, max_tokens: int, rng) -> list[dict]:
    """On a server that has just said ready: `burst` concurrent streamed completions, then as many one at a time
    (the same workload), then the first request of each common kind -> rows of seconds."""
    import openai

    client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=key, max_retries=0, timeout=600)
    prompts = [rng.integers(10, 480, int(rng.integers(16, 49))).tolist() for _ in range(burst)]
    t = time.perf_counter()
    await asyncio.gather(*(one(client, p, max_tokens) for p in prompts))
    t_burst = time.perf_counter() - t
    t = time.perf_counter()
    for p in prompts:
        await one(client, p, max_tokens)
    t_seq = time.perf_counter() - t
    rows = [{"what": f"first {burst} concurrent (after ready)", "s": t_burst},
            {"what": f"then {burst} one at a time", "s": t_seq, "speed-up": t_seq / t_burst}]
    msg = [{"role": "user", "content": "What is the capital of France?"}]
    tools = [{"type": "function", "function": {"name": "weather", "description": "the weather in a city", "parameters":
                                                {"type": "object", "properties": {"city": {"type": "string"}}}}}]
    kinds = {"sampling (chat)": dict(messages=msg), "logprobs (top 5)": dict(messages=msg, logprobs=True, top_logprobs=5),
             "tools": dict(messages=msg, tools=tools), "stop strings": dict(messages=msg, stop=["e.", "zz"]),
             "penalties, n=2": dict(messages=msg, presence_penalty=0.5, n=2)}
    for what, kw in kinds.items():
        t = time.perf_counter()
        await client.chat.completions.create(model="tiny", max_tokens=max_tokens, temperature=1.0, **kw)
        rows.append({"what": f"first request: {what}", "s": time.perf_counter() - t})
    await client.close()
    return rows


async def many(client, n: int, concurrency: int, rng) -> None:
    """n small non-streamed requests, `concurrency` at a time."""
    todo = iter(range(n))

    async def loop():
        for _ in todo:
            p = rng.integers(10, 480, int(rng.integers(16, 49))).tolist()
            await client.completions.create(model="tiny", prompt=p, max_tokens=8, temperature=1.0)
    await asyncio.gather(*(loop() for _ in range(concurrency)))


async def bench(a, port: int, key: str, pid: int) -> None:
    import openai

    client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=key, max_retries=0, timeout=600)
    rng = np.random.default_rng(0)
    levels = [int(x) for x in a.levels.split(",")]
    for _ in range(3):  # warm-up: the prefill widths and admitted-row counts each level meets, compiled
        for c in levels:
            await level(client, c, 2 * c, 8, a.time_limit, rng)
    for run in range(a.runs):
        rows = []
        for c in levels:
            rows.append(await level(client, c, max(a.requests, c), a.max_tokens, a.time_limit, rng))
        base = rows[0]["tok/s"] if levels[0] == 1 else float("nan")
        for r in rows:
            r["speed-up"] = f"{r['tok/s'] / base:.2f}x"
            for k, v in r.items():
                if isinstance(v, float):
                    r[k] = f"{v:,.1f}"
        print(f"\nrun {run + 1} of {a.runs}: {a.max_tokens} tokens per request, streamed")
        common.table(rows)
        at32 = next((float(r["speed-up"][:-1]) for r in rows if r["concurrency"] == 32), None)
        if at32 is not None:
            print(f"speed-up at 32 concurrent: {at32:.2f}x (goal >= 4x)")
    await many(client, 100, 32, rng)  # (its shapes compiled before the first reading)
    readings = [rss_mib(pid)]
    for _ in range(2):  # (a second round: growth that goes on, or what the first round settled)
        t0 = time.perf_counter()
        await many(client, a.rss_requests, 32, rng)
        readings.append(rss_mib(pid))
        print(f"server RSS after {a.rss_requests} more requests ({time.perf_counter() - t0:.1f} s): "
              f"{readings[-2]:,.1f} -> {readings[-1]:,.1f} MiB ({readings[-1] - readings[-2]:+,.1f} MiB, "
              f"{100 * (readings[-1] - readings[-2]) / readings[-2]:+.1f}%)")
    await client.close()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--levels", default="1,8,32,64", help="concurrent clients, comma-separated (1 first: the base)")
    ap.add_argument("--requests", type=int, default=64, help="requests per level (at least the level)")
    ap.add_argument("--max-tokens", type=int, default=64, help="tokens each request samples")
    ap.add_argument("--time-limit", type=float, default=300.0, help="seconds per level at most")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--rss-requests", type=int, default=1000)
    ap.add_argument("--burst", type=int, default=32, help="the cold start's first burst (and its sequential twin)")
    ap.add_argument("--no-cold", action="store_true", help="skip the cold start (empty compilation cache) phase")
    a = ap.parse_args()
    rows = max(int(x) for x in a.levels.split(","))
    with tempfile.TemporaryDirectory() as tmp:
        save_model(os.path.join(tmp, "model"))
        key = os.urandom(8).hex()
        cache = os.path.join(tmp, "xla")  # a fresh compilation cache: the first start is cold
        if not a.no_cold:
            with open(os.path.join(tmp, "cold.log"), "w+") as log:
                t = time.perf_counter()
                proc, port = start_server(os.path.join(tmp, "model"), key, rows, log, cache)
                ready = time.perf_counter() - t
                try:
                    got = asyncio.run(first_requests(port, key, a.burst, a.max_tokens, np.random.default_rng(1)))
                finally:
                    proc.terminate()
                    proc.wait(60)
                log.seek(0)
                said = [x for x in log.read().splitlines() if "warm-up done" in x]
            print(f"cold start (empty compilation cache): ready in {ready:.1f} s; {said[0] if said else ''}")
            common.table([{k: (f"{v:.2f}x" if k == "speed-up" else f"{v:.2f}" if isinstance(v, float) else v)
                           for k, v in r.items()} for r in got])
            print(f"first burst of {a.burst} concurrent vs {a.burst} one at a time: {got[1]['speed-up']:.2f}x (goal >= 2x)")
        with open(os.path.join(tmp, "serve.log"), "w+") as log:
            t = time.perf_counter()
            proc, port = start_server(os.path.join(tmp, "model"), key, rows, log, cache)
            print(f"{'restart on the filled compilation cache' if not a.no_cold else 'start'}: ready in "
                  f"{time.perf_counter() - t:.1f} s")
            try:
                print(f"nemo-jax serve on 127.0.0.1:{port}, {rows} rows (pid {proc.pid})")
                asyncio.run(bench(a, port, key, proc.pid))
            finally:
                proc.terminate()
                code = proc.wait(60)
                print(f"server stopped (SIGTERM): exit {code}")


if __name__ == "__main__":
    main()
