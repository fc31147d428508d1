"""`nemo-jax grpo`: the asynchronous GRPO learner for LoRA experts, written on `TrainingClient`.

Producers (an in-process sampler thread, and/or external engines through RUN/spool) keep a pool of in-flight
groups sampled with the newest published adapters; the learner takes `groups_per_step` finished groups as soon as
they are ready (never waiting for the slowest rollout of a batch), drops groups older than
`max_off_policy_steps` policy versions, computes Dr. GRPO advantages, and takes one forward_backward +
optim_step on the DPPO loss. Tasks are drawn by the reward-variance curriculum.

Run dir (runs/<name>): metrics.jsonl (reward_mean every step), tensorboard/, checkpoints/ (adapters, optimiser,
counters, RNG, policy version, pool and curriculum state: a killed run continues from the last one),
policy/<version>/ (PEFT), spool/ (external rollouts), adapters/ (the final adapters, `nemo-jax lora export`).
"""

from __future__ import annotations

import dataclasses
import math
import os
import shutil
import signal
import threading
import time
from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np

from nemo_jax.config.train import GRPOConfig, load_grpo_config  # noqa: F401 (load_grpo_config: re-exported)
from nemo_jax.data.chat import ChatTokenizer
from nemo_jax.lora import LoraConfig, save_adapter_checkpoint
from nemo_jax.parallel.mesh import batch_shards, make_mesh
from nemo_jax.parallel.rules import Rules
from nemo_jax.rl.client import TrainingClient
from nemo_jax.rl.curriculum import Curriculum
from nemo_jax.rl.envs import make_env
from nemo_jax.rl.pool import RolloutPool
from nemo_jax.rl.producer import ThreadProducer, sample_rollouts
from nemo_jax.rl.rollout import learner_batch
from nemo_jax.rl.spool import SpoolReader, post_request
from nemo_jax.train.metrics import MetricsLogger, check_logging
from nemo_jax.train.sft import DTYPES, initial_params, options_from


MAX_DRAWS = 4  # groups drawn per step, at most, as a multiple of groups_per_step (zero-variance ones are skipped)


class GRPORunner:
    def __init__(self, c: GRPOConfig, *, quiet: bool = False, devices=None):
        check_logging(c.logging)
        self.c, self.quiet = c, quiet
        self.run_dir = os.path.abspath(c.run_dir or os.path.join("runs", c.name))
        self.mesh = make_mesh(c.mesh.sizes(), devices, c.mesh.devices_per_node)
        cfg, params = initial_params(c, self.mesh, Rules())
        dt = DTYPES[c.lora.base_dtype]
        base = jax.tree.map(lambda x: x.astype(dt), params)
        self.cfg = cfg
        self.tok = ChatTokenizer.load(c.tokenizer)
        self.env = make_env(c.rollout.env, **c.rollout.env_args)
        self.tasks = {t.id: t for t in self.env.tasks("train")}
        lcfg = LoraConfig(tuple(c.lora.targets), c.lora.rank, c.lora.alpha, c.lora.rslora, c.lora.init_seed)
        self.client = TrainingClient(cfg, base, lcfg, self.mesh, optim=c.optim, loss=c.loss, total_steps=c.steps,
                                     grad_accum=c.optim.grad_accum, seed=c.seed, opts=options_from(c.model, self.mesh))
        self.pool = RolloutPool(c.rollout.group_size, c.rollout.max_off_policy_steps)
        cu = c.curriculum
        self.curriculum = Curriculum(list(self.tasks), cu.window, cu.floor, cu.prior, seed=c.seed)
        self.lock = threading.Lock()
        self.spool = (SpoolReader(os.path.join(self.run_dir, "spool"), cfg.vocab_size, c.rollout.seq_len)
                      if c.rollout.spool else None)
        unit = batch_shards(self.mesh) * c.optim.grad_accum  # rows split into micro-batches, each over the shards
        self.rows = math.ceil(c.rollout.groups_per_step * c.rollout.group_size / unit) * unit
        longest = max(len(self.tok.tokenizer.encode(self.tok.render(list(t.messages), add_generation_prompt=True),
                                                    add_special_tokens=False).ids) for t in self.tasks.values())
        if longest + c.rollout.max_new_tokens > c.rollout.seq_len + 1:
            raise ValueError(f"rollout.seq_len={c.rollout.seq_len} is too short: the longest {c.rollout.env} prompt "
                             f"has {longest} tokens and rollout.max_new_tokens={c.rollout.max_new_tokens} "
                             f"(set rollout.seq_len >= {longest + c.rollout.max_new_tokens - 1})")
        self.too_long = 0  # groups dropped because a rollout outgrew rollout.seq_len
        self.requested = set()  # groups asked of external producers, not finished yet
        self.stop_requested = False
        self.step = 0
        self.saved_step = None

    # ------------------------------------------------------------------ state
    def _extra(self, producer) -> dict:
        with self.lock:
            return {"pool": self.pool.state_dict(), "curriculum": self.curriculum.state_dict(),
                    "producer_key": np.asarray(jax.random.key_data(producer.key)).tolist() if producer else None}

    def save(self, producer):
        if self.step != self.saved_step:  # (the last periodic checkpoint may already be this step's)
            self.client.save_state(os.path.join(self.run_dir, "checkpoints"), self.step, self._extra(producer),
                                   meta={"config": dataclasses.asdict(self.c)}, verify=self.c.checkpoint.verify)
            self.saved_step = self.step

    def restore(self, producer) -> bool:
        out = self.client.load_state(os.path.join(self.run_dir, "checkpoints"), verify=self.c.checkpoint.verify)
        if out is None:
            return False
        self.step, extra = out
        self.saved_step = self.step
        self.pool.load_state_dict(extra["pool"])
        self.curriculum.load_state_dict(extra["curriculum"])
        if producer is not None and extra.get("producer_key") is not None:
            producer.key = jax.random.wrap_key_data(jnp.asarray(extra["producer_key"], jnp.uint32))
        return True

    # ------------------------------------------------------------------ loop
    def _wait_for_groups(self, producer, need: int) -> float:
        """Block until `need` groups are ready (or a stop is requested) -> seconds waited."""
        t0 = time.perf_counter()
        while True:
            if self.spool is not None:
                self._request_groups()
                with self.lock:
                    for gid in self.spool.poll(self.pool):
                        self.curriculum.update(self.pool.ready[gid][0].task_id,
                                               [r.reward for r in self.pool.ready[gid]])
            with self.lock:
                self.pool.drop_stale(self.client.version)
                if len(self.pool.ready) >= need:
                    return time.perf_counter() - t0
            if self.stop_requested:
                return time.perf_counter() - t0
            if producer is None:
                time.sleep(0.05)
            elif self.c.rollout.producer == "inline":
                producer.produce_once()
            else:
                producer.check()
                time.sleep(0.005)

    def _request_groups(self):
        """Keep `in_flight_groups` groups requested from external producers (RUN/requests)."""
        with self.lock:
            self.requested &= set(self.pool.in_flight)
            want = self.c.rollout.in_flight_groups - len(self.requested)
            if want <= 0:
                return
            for t in self.curriculum.sample(want):
                gid = self.pool.open_group(t, f"s{self.step}-{self.pool.counts['groups_opened']}")
                post_request(self.run_dir, gid, self.tasks[t], self.c.rollout.group_size, self.client.version)
                self.requested.add(gid)

    def _install_signals(self):
        def handler(signum, frame):
            self.stop_requested = True
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, handler)
            signal.signal(signal.SIGINT, handler)

    def run(self) -> dict:
        c, r = self.c, self.c.rollout
        os.makedirs(self.run_dir, exist_ok=True)
        producer = None
        if r.producer != "none":
            producer = ThreadProducer(self.client, self.tok, self.env, self.pool, self.curriculum, r,
                                      c.loss.temperature, c.seed, self.lock)
        resumed = self.restore(producer)
        if self.spool is not None:  # requests of an earlier process name groups this one never opened
            shutil.rmtree(os.path.join(self.run_dir, "requests"), ignore_errors=True)
        if producer is not None:
            producer.set_policy(self.client.version, self.client.adapters)
        if r.publish_every:
            self.client.publish(self.run_dir)
        self._install_signals()
        logger = MetricsLogger(self.run_dir, enabled=jax.process_index() == 0, logging=c.logging,
                               config=dataclasses.asdict(c), name=c.name)
        if not self.quiet:
            print(f"grpo {c.name}: {len(self.tasks)} {getattr(self.env, 'name', 'env')} tasks, "
                  f"{r.groups_per_step} groups x {r.group_size} rollouts per step, run dir {self.run_dir}"
                  + (f" (resumed at step {self.step})" if resumed else ""))
        if producer is not None and r.producer == "thread":
            producer.start()
        last = {}
        try:
            while self.step < c.steps and not self.stop_requested:
                last = self._one_step(producer, logger) or last
                if c.eval_every and self.step % c.eval_every == 0:
                    ev = evaluate_env(self.client.sample, self.tok, self.cfg, self.env, c.eval_attempts,
                                      r.max_new_tokens, c.loss.temperature, jax.random.key(c.seed + self.step))
                    logger.log({"step": self.step, **{f"eval_{k}": v for k, v in ev.items()}})
                if c.checkpoint.every and self.step % c.checkpoint.every == 0:
                    self.save(producer)
        finally:
            if producer is not None:
                producer.close()
            logger.close()
        self.save(producer)
        self.client.close()
        save_adapter_checkpoint(os.path.join(self.run_dir, "adapters"), self.cfg, self.client.lora_cfg,
                                self.client.adapters, overwrite=True)
        last["step"] = self.step
        last["stopped_early"] = self.stop_requested
        return last

    def _one_step(self, producer, logger) -> dict:
        c, r = self.c, self.c.rollout
        t0 = time.perf_counter()
        busy0 = producer.busy_s if producer is not None else 0.0
        version = self.client.version
        groups, seen, waited = [], [], 0.0
        # groups whose rewards are all equal carry no signal: counted, skipped and replaced by more groups, up to
        # MAX_DRAWS x groups_per_step drawn per step (a solved or hopeless task set must not stall the run)
        while (len(groups) < r.groups_per_step and len(seen) < MAX_DRAWS * r.groups_per_step
               and not self.stop_requested):
            waited += self._wait_for_groups(producer, r.groups_per_step - len(groups))
            with self.lock:
                got = self.pool.take(r.groups_per_step - len(groups), version)
            seen += got
            fits = [g for g in got if max(len(x.tokens) for x in g) <= r.seq_len + 1]
            self.too_long += len(got) - len(fits)  # (multi-turn conversations can outgrow rollout.seq_len)
            groups += [g for g in fits if len({x.reward for x in g}) > 1]
        if not seen:
            return {}
        stale = self.pool.counts["groups_stale_dropped"]
        rollouts = [x for g in seen for x in g]
        batch, counts = learner_batch(groups, r.seq_len, rows=self.rows, scale=c.loss.advantage_scale,
                                      reduction=c.loss.reduction, max_len=r.max_new_tokens)
        counts["zero_variance_frac"] = sum(len({x.reward for x in g}) == 1 for g in seen) / len(seen)
        t1 = time.perf_counter()
        rec = {"step": self.step + 1}
        if groups:
            fb = self.client.forward_backward(batch)
            rec.update(self.client.optim_step())
            rec["learner_loss"] = fb["loss"]
        else:  # nothing to learn from in MAX_DRAWS x groups_per_step groups: the step takes no update
            rec["skipped_no_signal"] = 1
        self.step += 1
        if producer is not None:
            producer.set_policy(self.client.version, self.client.adapters)
        if r.publish_every and self.step % r.publish_every == 0:
            self.client.publish(self.run_dir)
        dt = time.perf_counter() - t0
        rewards = np.array([x.reward for x in rollouts])
        lengths = np.array([sum(x.loss_mask) for x in rollouts])
        staleness = np.array([version - x.version for x in rollouts])
        fam = Counter()
        fam_sum = Counter()
        for x in rollouts:
            f = self.tasks[x.task_id].family if x.task_id in self.tasks else "external"
            fam[f] += 1
            fam_sum[f] += x.reward
        rec.update({"reward_mean": float(rewards.mean()) if rewards.size else float("nan"),
                    "success_rate": float(np.mean([x.success for x in rollouts])) if rollouts else float("nan"),
                    **{f"reward_mean/{f}": fam_sum[f] / n for f, n in fam.items()},
                    "zero_variance_frac": counts["zero_variance_frac"], "groups_stale_dropped": stale,
                    "groups_too_long": self.too_long,
                    "response_len_mean": float(lengths.mean()) if lengths.size else 0.0,
                    "response_len_max": int(lengths.max()) if lengths.size else 0,
                    "staleness_mean": float(staleness.mean()) if staleness.size else 0.0,
                    "staleness_max": int(staleness.max()) if staleness.size else 0,
                    "learner_s": time.perf_counter() - t1, "wait_s": waited, "wait_frac": waited / max(dt, 1e-9),
                    "tokens_per_sec": float(batch["segment_ids"].sum()) / max(time.perf_counter() - t1, 1e-9),
                    "policy_version": self.client.version})
        if producer is not None:
            rec["producer_busy_s"] = producer.busy_s - busy0
        if self.spool is not None:
            rec.update({f"spool_rejected/{k}": v for k, v in self.spool.rejected.items()})
        logger.log(rec)
        logger.histogram(rec["step"], "staleness", staleness)
        logger.histogram(rec["step"], "rewards", rewards)
        if not self.quiet and (rec["step"] % c.log_every == 0):
            print(f"step {rec['step']}: reward_mean {rec['reward_mean']:.3f}  wait {waited:.1f}s  "
                  f"learner {rec['learner_s']:.1f}s  masked {rec.get('masked_frac_high', 0):.3f}/"
                  f"{rec.get('masked_frac_low', 0):.3f}  version {self.client.version}", flush=True)
        return rec


# ----------------------------------------------------------------------------- eval
def evaluate_env(sample, tok, cfg, env, attempts: int, max_new_tokens: int, temperature: float, key,
                 split: str = "eval", batch_tasks: int = 16) -> dict:
    """Every `split` task attempted `attempts` times -> mean reward, full-success rate, pass@1 (the mean success
    of single attempts), pass@k (solved at least once) and consistency (solved in all k attempts)."""
    tasks = env.tasks(split)
    succ = np.zeros((len(tasks), attempts), bool)
    rew = np.zeros((len(tasks), attempts))
    for s in range(0, len(tasks), batch_tasks):
        chunk = tasks[s:s + batch_tasks]
        chunk = chunk + [chunk[-1]] * (batch_tasks - len(chunk)) if len(tasks) > batch_tasks else chunk  # one shape
        key, sub = jax.random.split(key)
        # the group size is the attempt count: every attempt of a task is one row of the same batch
        got = sample_rollouts(sample, tok, cfg, env, [(t, str(i)) for i, t in enumerate(chunk)], attempts,
                              max_new_tokens, temperature, sub, (0,))
        for j, x in enumerate(got):
            i, a = divmod(j, attempts)
            if s + i < len(tasks):
                rew[s + i, a], succ[s + i, a] = x.reward, x.success
    return {"tasks": len(tasks), "attempts": attempts, "reward_mean": float(rew.mean()),
            "success_rate": float(succ.mean()), "pass@1": float(succ.mean()), f"pass@{attempts}": float(
                succ.any(axis=1).mean()), "consistency": float(succ.all(axis=1).mean())}


def cli_eval(a) -> dict:
    import json

    from nemo_jax.generate import generate
    from nemo_jax.sources import load_for_generation

    cfg, params, tok_dir = load_for_generation(a.ckpt, dtype=jnp.float32)
    adapters = None
    if a.adapters:
        from nemo_jax.sources import load_adapters

        adapters = jax.tree.map(jnp.asarray, load_adapters(a.adapters, cfg))
    tok = ChatTokenizer.load(a.tokenizer or tok_dir)
    env = make_env(a.env, **(json.loads(a.env_args) if a.env_args else {}))
    sample = lambda prompts, sp, key: generate(params, prompts, cfg, sp, key=key, adapters=adapters)  # noqa: E731
    out = evaluate_env(sample, tok, cfg, env, a.attempts, a.max_new_tokens, a.temperature, jax.random.key(a.seed),
                       split=a.split)
    out.update(env=a.env, ckpt=a.ckpt, adapters=a.adapters)
    width = max(len(k) for k in out)
    for k, v in out.items():
        print(f"{k:<{width}}  {v:.4f}" if isinstance(v, float) else f"{k:<{width}}  {v}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    return out


def main(path: str | None = None, overrides=(), *, config: GRPOConfig | None = None) -> dict:
    """`nemo-jax grpo`: the config (`config`, or loaded from `path` + `overrides`) is validated before any work."""
    return GRPORunner(config or load_grpo_config(path, overrides)).run()
