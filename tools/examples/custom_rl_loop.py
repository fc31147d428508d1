"""A user's own RL loop on `nemo_jax.rl.TrainingClient` (the primitives `nemo-jax grpo` is written on).

Synchronous REINFORCE-with-baseline on the built-in arithmetic environment, 50/50 mixed with a little
supervised cross-entropy on the correct answer, to show that losses can be combined per batch:

    python tools/examples/custom_rl_loop.py --ckpt runs/tiny-cpu --steps 20

(`runs/tiny-cpu` comes from `nemo-jax sft --config configs/sft/tiny-cpu.yaml`.)
"""

import argparse

import jax
import jax.numpy as jnp
import numpy as np

from nemo_jax.config.train import OptimSection, PolicyLossConfig
from nemo_jax.data.chat import ChatTokenizer
from nemo_jax.generate import load_for_generation
from nemo_jax.lora import LoraConfig
from nemo_jax.rl import TrainingClient
from nemo_jax.rl.envs import Arithmetic
from nemo_jax.rl.transport.producer import sample_rollouts
from nemo_jax.rl.rollout import Rollout, learner_batch


def supervised(task, tok, group) -> Rollout:
    """The correct answer as a rollout (loss on the answer tokens), for the cross-entropy term."""
    prompt = tok.tokenizer.encode(tok.render(list(task.messages), add_generation_prompt=True),
                                  add_special_tokens=False).ids
    answer = tok.tokenizer.encode(f"{task.data['answer']}.", add_special_tokens=False).ids + tok.eos_ids()
    return Rollout(prompt + answer, [0] * len(prompt) + [1] * len(answer), [0.0] * (len(prompt) + len(answer)),
                   1.0, task.id, group)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ckpt", required=True, help="SFT run dir or model dir")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--tasks-per-step", type=int, default=4)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--ce-weight", type=float, default=0.1)
    a = ap.parse_args()

    cfg, base, tok_dir = load_for_generation(a.ckpt, dtype=jnp.float32)
    tok = ChatTokenizer.load(tok_dir)
    env = Arithmetic()
    client = TrainingClient(cfg, base, LoraConfig(("all",), 8, 16.0),
                            optim=OptimSection(lr=2e-3, warmup_steps=0, decay="constant", weight_decay=0.0),
                            loss=PolicyLossConfig(kind="importance_sampling"))
    rng = np.random.default_rng(0)
    engine = client.engine(batch=a.tasks_per_step * a.group, max_len=128, key=jax.random.key(0))
    tasks = env.tasks("train")
    for step in range(a.steps):
        picked = [tasks[i] for i in rng.choice(len(tasks), a.tasks_per_step, replace=False)]
        engine.set_adapters(jax.tree.map(jnp.copy, client.adapters), client.version)  # the current policy
        rollouts = sample_rollouts(engine, tok, cfg, env, [(t, t.id) for t in picked], a.group, 16, 1.0)
        groups = [rollouts[i:i + a.group] for i in range(0, len(rollouts), a.group)]
        batch, counts = learner_batch(groups, seq_len=64)
        if counts["rollouts"]:
            rl = client.forward_backward(batch)  # the policy-gradient term (weights: mean per rollout)
        sup, _ = learner_batch([[supervised(t, tok, t.id)] for t in picked], seq_len=64, drop_zero_variance=False)
        sup["loss_weights"] *= a.ce_weight  # the weights scale a loss term: here 0.1 x mean answer NLL
        ce = client.forward_backward(sup, loss="cross_entropy")  # gradients add up until optim_step
        m = client.optim_step()
        print(f"step {step + 1}: reward {np.mean([r.reward for r in rollouts]):.3f}  "
              f"pg loss {rl['loss'] if counts['rollouts'] else float('nan'):.4f}  ce {ce['loss']:.4f}  "
              f"grad_norm {m['grad_norm']:.3f}  zero-variance groups {counts['zero_variance_groups']}")


if __name__ == "__main__":
    main()
