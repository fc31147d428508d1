"""An external rollout producer for `nemo-jax grpo` with `rollout.spool=true`: another process (here our own JAX
sampler; in production any engine that hot-loads LoRA, e.g. vLLM with the PEFT dirs) that loops:

  1. claims a group request, RUN/requests/<gid>.json (rename into requests/claimed/: one producer wins each;
     the claim is a lease, see nemo_jax.rl.spool and docs/serving.md),
  2. hot-loads the newest published policy, RUN/policy/<version>/ (RUN/policy/LATEST names it),
  3. samples the rollouts the request still needs with its sampling parameters and scores them,
  4. writes them to RUN/spool/<name>.jsonl (temp name + rename): token ids, loss mask, behaviour logprobs,
     reward, task id, group id, policy versions, temperature, rollout id; then ends the lease (or drops them
     when the lease was lost: reposted or cancelled).

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
from nemo_jax.rl.spool import claim_request, complete, latest_policy, renew, write_rollouts


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--run", required=True, help="the learner's run dir")
    ap.add_argument("--ckpt", required=True, help="the base model (the learner's model.init)")
    ap.add_argument("--env", default="arithmetic")
    ap.add_argument("--env-args", default="{}", help="JSON object: the environment's arguments (as the learner's)")
    ap.add_argument("--max-new-tokens", type=int, default=16)
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
        latest = latest_policy(a.run)
        lease = claim_request(a.run, a.name) if latest is not None else None
        if lease is None:
            time.sleep(0.2)
            continue
        req, sp = lease.request, lease.request.get("sampling", {})
        if latest[0] != loaded:  # hot-load the newest adapters
            loaded = latest[0]
            engine.set_adapters(jax.tree.map(jnp.asarray, load_peft(latest[1], cfg)), loaded)
        rollouts = sample_rollouts(engine, tok, cfg, env, [(tasks[req["task_id"]], req["group_id"])],
                                   req.get("rollouts", req["group_size"]), sp.get("max_tokens", a.max_new_tokens),
                                   sp.get("temperature", 1.0), images=images, top_p=sp.get("top_p", 1.0),
                                   top_k=sp.get("top_k", 0))
        if not renew(lease):  # expired (reposted) or cancelled meanwhile: the learner no longer wants these
            print(f"{a.name}: group {req['group_id']}: lease lost, {len(rollouts)} rollouts dropped", flush=True)
            continue
        for x in rollouts:  # unique in the group, also beside rollouts an earlier (dead) worker delivered
            x.rollout_id = f"{x.rollout_id}@{a.name}-{n}"
        write_rollouts(os.path.join(a.run, "spool"), rollouts, f"{a.name}-{n:06d}")
        complete(lease)
        n += 1
        print(f"{a.name}: group {req['group_id']}: {len(rollouts)} rollouts with policy {loaded}", flush=True)


if __name__ == "__main__":
    main()
