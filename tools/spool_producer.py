"""An external rollout producer for `nemo-jax grpo` with `rollout.spool=true`: another process (here our own JAX
sampler; in production any engine that hot-loads LoRA, e.g. vLLM with the PEFT dirs) that loops:

  1. claims a group request, RUN/requests/<gid>.json (rename into requests/claimed/: one producer wins each),
  2. hot-loads the newest published policy, RUN/policy/<version>/ (PEFT; RUN/policy/LATEST names it),
  3. samples the request's group_size rollouts of its task and scores them with the environment,
  4. writes them to RUN/spool/<name>.jsonl (temp name + rename): token ids, loss mask, behaviour logprobs,
     reward, task id, group id, policy version.

    nemo-jax grpo --config configs/grpo/tiny-cpu.yaml rollout.spool=true rollout.producer=none &
    python tools/spool_producer.py --run runs/tiny-cpu-grpo --ckpt runs/tiny-cpu --env arithmetic
"""

import argparse
import json
import os
import time

import jax
import jax.numpy as jnp

from nemo_jax.data.chat import ChatTokenizer
from nemo_jax.generate import Engine, load_for_generation
from nemo_jax.lora.peft import load_peft
from nemo_jax.rl.envs import make_env
from nemo_jax.rl.producer import sample_rollouts
from nemo_jax.rl.rollout import ImageStore
from nemo_jax.rl.spool import claim_request, latest_policy, write_rollouts


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--run", required=True, help="the learner's run dir")
    ap.add_argument("--ckpt", required=True, help="the base model (the learner's model.init)")
    ap.add_argument("--env", default="arithmetic")
    ap.add_argument("--env-args", default="{}", help="JSON object: the environment's arguments (as the learner's)")
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--rows", type=int, default=16, help="decode rows")
    ap.add_argument("--max-len", type=int, default=512, help="positions per row (a whole conversation)")
    ap.add_argument("--files", type=int, default=0, help="stop after this many files (0: run until killed)")
    ap.add_argument("--name", default=f"producer-{os.getpid()}")
    a = ap.parse_args()

    cfg, base, tok_dir = load_for_generation(a.ckpt, dtype=jnp.float32)
    tok = ChatTokenizer.load(tok_dir)
    env = make_env(a.env, **json.loads(a.env_args))
    tasks = {t.id: t for t in env.tasks("train")}
    engine = Engine(base, cfg, batch=a.rows, max_len=a.max_len, key=jax.random.key(os.getpid()))
    images = ImageStore(os.path.join(a.run, "images")) if cfg.vision is not None else None
    loaded, n = None, 0
    while not a.files or n < a.files:
        latest, req = latest_policy(a.run), claim_request(a.run, a.name)
        if latest is None or req is None:
            time.sleep(0.2)
            continue
        if latest[0] != loaded:  # hot-load the newest adapters
            loaded = latest[0]
            engine.set_adapters(jax.tree.map(jnp.asarray, load_peft(latest[1], cfg)), loaded)
        rollouts = sample_rollouts(engine, tok, cfg, env, [(tasks[req["task_id"]], req["group_id"])],
                                   req["group_size"], a.max_new_tokens, a.temperature, images=images)
        write_rollouts(os.path.join(a.run, "spool"), rollouts, f"{a.name}-{n:06d}")
        n += 1
        print(f"{a.name}: group {req['group_id']}: {len(rollouts)} rollouts with policy {loaded}", flush=True)


if __name__ == "__main__":
    main()
