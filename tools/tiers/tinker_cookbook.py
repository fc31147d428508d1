"""tinker-cookbook's recipes, unchanged, against `nemo-jax serve --tinker-root` on the tiny model, offline; then
every nemo-jax command that reads adapters, over the checkpoints the recipes wrote (docs/tinker.md).

    python tools/tiers/tinker_cookbook.py [--work DIR]

1. A virtual environment of its own (WORK/venv, --system-site-packages: it sees this Python's jax, torch,
   transformers and the pinned `tinker`) with tinker-cookbook 0.6.1 installed offline-friendly: the wheel with
   --no-deps (its `tml-renderers` dependency is not on the index, and only Inkling / Kimi models import it), then
   its other dependencies.
2. The tiny model (nemo_jax/assets/models/tiny.json: Mamba, attention, MoE and MLP layers; random weights) as an
   HF dir with its tokenizer: the cookbook's `model_name` (a local dir: its tokenizer loads without the Hub).
3. `nemo-jax serve --ckpt HF_DIR --tinker-root WORK/root --api-key ...`, and the recipes with TINKER_BASE_URL,
   TINKER_API_KEY=tml-..., HF_HUB_OFFLINE=1:
     recipes/chat_sl/train.py  dataset=<the cookbook's example conversations.jsonl> renderer_name=role_colon,
                               save_every=1: killed (and the server restarted) once it saved --sl-steps checkpoints;
                               the same command with behavior_if_log_dir_exists=resume resumes from its last
                               tinker:// checkpoint (create_training_client_from_state_with_optimizer) on the new
                               server and finishes the epoch (4 steps of 32 conversations);
     recipes/math_rl/train.py  env=arithmetic loss_fn=importance_sampling renderer_name=role_colon.
4. Over the checkpoints the recipes saved (ordinary nemo-jax adapter checkpoints under WORK/root):
   `nemo-jax lora export` (peft), `export-hf --adapters`, `merge` (add_adapters), `eval --adapters` and
   `serve --adapters` (one completion through the OpenAI route).

Prints a JSON summary (exit codes, wall times, the recipes' metrics) and writes it to WORK/summary.json; exits 1
if any step failed.
"""

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)

COOKBOOK = "tinker-cookbook==0.6.1"
COOKBOOK_DEPS = ["aiohttp", "blobfile", "chz", "cloudpickle>=3", "datasets", "pillow", "termcolor", "tiktoken",
                 "math-verify", "pylatexenc"]  # tinker-cookbook 0.6.1's dependencies but tml-renderers (+ math_rl's)
KEY = "cookbook"


def sh(cmd, log=None, env=None, check=True, timeout=3600):
    t0 = time.time()
    print("$", " ".join(cmd), flush=True)
    with open(log, "w") if log else open(os.devnull, "w") as out:
        rc = subprocess.run(cmd, stdout=out if log else None, stderr=subprocess.STDOUT if log else None, env=env,
                            timeout=timeout).returncode
    if check and rc:
        tail = open(log).read()[-3000:] if log else ""
        raise SystemExit(f"failed ({rc}): {' '.join(cmd)}\n{tail}")
    return rc, time.time() - t0


def venv(work: str) -> str:
    py = os.path.join(work, "venv", "bin", "python")
    if not os.path.exists(py):
        sh([sys.executable, "-m", "venv", "--system-site-packages", os.path.join(work, "venv")])
    probe = subprocess.run([py, "-c", "import tinker_cookbook, chz, math_verify"], capture_output=True)
    if probe.returncode:
        sh([py, "-m", "pip", "install", "-q", "--no-deps", COOKBOOK], os.path.join(work, "pip.log"))
        sh([py, "-m", "pip", "install", "-q", *COOKBOOK_DEPS], os.path.join(work, "pip-deps.log"))
    return py


def tiny_hf(path: str) -> str:
    if os.path.exists(os.path.join(path, "config.json")):
        return path
    import jax

    from nemo_jax.config.model import NemotronHConfig
    from nemo_jax.data.chat import resolve
    from nemo_jax.hf.io import save_pretrained
    from nemo_jax.model import init

    cfg = NemotronHConfig.from_file(os.path.join(REPO, "nemo_jax", "assets", "models", "tiny.json"))
    save_pretrained(cfg, init(cfg, jax.random.key(0)), path, tokenizer_dir=resolve("builtin:tiny"))
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, args: list[str], log: str, env: dict):
        import httpx

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(log, "a")
        self.proc = subprocess.Popen([sys.executable, "-m", "nemo_jax.cli", "serve", *args, "--port",
                                      str(self.port)], stdout=self.log, stderr=subprocess.STDOUT, env=env)
        t0 = time.time()
        while True:
            if self.proc.poll() is not None:
                raise SystemExit(f"the server exited ({self.proc.returncode}): see {log}")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.time() - t0 > 900:
                raise SystemExit(f"the server did not come up in 900 s: see {log}")
            time.sleep(0.5)
        self.started = time.time() - t0

    def stop(self):
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


def metrics(log_path: str, keys) -> list[dict]:
    out = []
    fp = os.path.join(log_path, "metrics.jsonl")
    for line in open(fp) if os.path.exists(fp) else ():
        d = json.loads(line)
        row = {k: v for k, v in d.items() if k == "step" or any(x in k for x in keys)}
        if len(row) > 1:
            out.append(row)
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", default=os.path.join(REPO, "runs", "tinker-cookbook"), help="working folder")
    ap.add_argument("--sl-steps", type=int, default=2, help="chat_sl steps before the server restarts")
    ap.add_argument("--rl-steps", type=int, default=2, help="math_rl steps")
    a = ap.parse_args(argv)
    work = os.path.abspath(a.work)
    os.makedirs(work, exist_ok=True)
    summary: dict = {"cookbook": COOKBOOK}
    py = venv(work)
    cb = subprocess.run([py, "-c", "import os, tinker_cookbook; print(os.path.dirname(tinker_cookbook.__file__))"],
                        capture_output=True, text=True, check=True).stdout.strip()
    hf = tiny_hf(os.path.join(work, "tiny-hf"))
    root = os.path.join(work, "root")
    env = dict(os.environ, PYTHONPATH=REPO, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TINKER_TELEMETRY="0",
               NEMO_JAX_API_KEY=KEY, TINKER_API_KEY="tml-" + KEY)
    serve_args = ["--ckpt", hf, "--tinker-root", root, "--max-model-len", "1024", "--max-num-seqs", "8",
                  "--bucket", "64", "--served-model-name", "tiny"]
    srv = Server(serve_args, os.path.join(work, "serve.log"), env)
    summary["server_start_s"] = round(srv.started, 1)
    env["TINKER_BASE_URL"] = srv.url
    sl_log = os.path.join(work, "chat_sl")
    sl = [py, "-m", "tinker_cookbook.recipes.chat_sl.train", f"model_name={hf}",
          f"dataset={os.path.join(cb, 'example_data', 'conversations.jsonl')}", "renderer_name=role_colon",
          f"log_path={sl_log}", "lora_rank=8", "batch_size=32", "max_length=1024", "save_every=1"]
    # the first run is killed once it has saved --sl-steps checkpoints, and the server with it: a crash of both
    t0 = time.time()
    saved = os.path.join(sl_log, "checkpoints.jsonl")
    if os.path.exists(saved):  # (an earlier tier run's, in a --work used again: the recipe deletes it only later)
        os.remove(saved)
    with open(os.path.join(work, "chat_sl-1.log"), "w") as out:
        first = subprocess.Popen(sl + ["behavior_if_log_dir_exists=delete"], stdout=out, stderr=subprocess.STDOUT,
                                 env=env)
        while first.poll() is None and not (os.path.exists(saved) and len(open(saved).readlines()) >= a.sl_steps):
            time.sleep(0.05)  # (a step of the tiny model can take under a second: a coarser poll saw the epoch end)
        first.kill()
        first.wait()
    summary["chat_sl"] = {"killed after checkpoints": len(open(saved).readlines()), "wall_s": round(time.time() - t0, 1)}
    srv.stop()  # a restart: the models in memory are gone, the tinker:// checkpoints stay
    srv = Server(serve_args, os.path.join(work, "serve.log"), env)
    env["TINKER_BASE_URL"] = srv.url
    rc, t = sh(sl + ["behavior_if_log_dir_exists=resume"], os.path.join(work, "chat_sl-2.log"), env)
    text = open(os.path.join(work, "chat_sl-2.log")).read()
    resumed = "Resumed training from" in text and "already complete" not in text
    summary["chat_sl_resumed_after_restart"] = {"exit": rc, "wall_s": round(t, 1), "resumed": resumed,
                                                "metrics": metrics(sl_log, ("train_mean_nll",))}
    rl_log = os.path.join(work, "math_rl")
    rc, t = sh([py, "-m", "tinker_cookbook.recipes.math_rl.train", "env=arithmetic", f"model_name={hf}",
                "renderer_name=role_colon", "loss_fn=importance_sampling", f"log_path={rl_log}", "lora_rank=8",
                "groups_per_batch=4", "group_size=4", f"max_steps={a.rl_steps}", "behavior_if_log_dir_exists=delete"],
               os.path.join(work, "math_rl.log"), env)
    summary["math_rl"] = {"exit": rc, "wall_s": round(t, 1), "metrics": metrics(rl_log, ("reward/total",))}
    srv.stop()

    # the checkpoints are nemo-jax's: every command that reads adapters reads them
    ckpts = sorted(os.path.join(r, k, n) for r in (os.path.join(root, d) for d in os.listdir(root))
                   for k in ("weights", "sampler_weights") if os.path.isdir(os.path.join(r, k))
                   for n in os.listdir(os.path.join(r, k)))
    final = next(c for c in ckpts if os.path.basename(os.path.dirname(c)) == "weights"
                 and os.path.basename(c) == "final")
    summary["checkpoints"] = [os.path.relpath(c, root) for c in ckpts]
    nj = [sys.executable, "-m", "nemo_jax.cli"]
    out = os.path.join(work, "out")
    cmds = {
        "lora export": nj + ["lora", "export", final, os.path.join(out, "peft"), "--format", "peft", "--overwrite"],
        "export-hf --adapters": nj + ["export-hf", hf, os.path.join(out, "merged-hf"), "--adapters", final,
                                      "--overwrite"],
        "eval --adapters": nj + ["eval", "--ckpt", hf, "--adapters", final, "--env", "arithmetic", "--attempts", "1",
                                 "--max-new-tokens", "8", "--rows", "4", "--max-len", "512"],
    }
    recipe = os.path.join(work, "merge.yaml")
    with open(recipe, "w") as f:
        json.dump({"output": os.path.join(out, "merge"), "models": {"base": hf}, "adapters": {"sl": final},
                   "rules": [{"match": ".*", "add_adapters": {"sl": 1.0}}]}, f)
    cmds["merge"] = nj + ["merge", recipe, "--overwrite"]
    for name, cmd in cmds.items():
        rc, t = sh(cmd, os.path.join(work, name.split()[0] + ".log"), env, check=False)
        summary[name] = {"exit": rc, "wall_s": round(t, 1)}
    import httpx

    srv = Server(["--ckpt", hf, "--adapters", f"sl={final}", "--max-model-len", "512", "--served-model-name",
                  "tiny"], os.path.join(work, "serve-adapters.log"), env)
    r = httpx.post(srv.url + "/v1/completions", json={"model": "sl", "prompt": "1 + 1 =", "max_tokens": 4},
                   headers={"Authorization": f"Bearer {KEY}"}, timeout=600)
    summary["serve --adapters"] = {"status": r.status_code, "text": r.json()["choices"][0]["text"]
                                   if r.status_code == 200 else r.text[:200]}
    srv.stop()
    ok = (summary["chat_sl_resumed_after_restart"]["exit"] == 0 and resumed
          and summary["math_rl"]["exit"] == 0 and all(summary[k]["exit"] == 0 for k in cmds)
          and summary["serve --adapters"]["status"] == 200)
    summary["ok"] = ok
    with open(os.path.join(work, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    print(json.dumps(summary, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
