"""`nemo-jax grpo`: the asynchronous GRPO learner for LoRA experts, written on `TrainingClient`.

Producers (an in-process sampler thread, and/or external engines through RUN/spool) keep a pool of in-flight
groups sampled with the newest published adapters; the learner takes `groups_per_step` finished groups as soon as
they are ready (never waiting for the slowest rollout of a batch), drops groups older than
`max_off_policy_steps` policy versions, computes Dr. GRPO advantages, and takes one forward_backward +
optim_step on the DPPO loss. Tasks are drawn by the reward-variance curriculum.

Rollouts longer than `rollout.seq_len` are truncated (the loss covers the kept part; counted), never dropped.
Every `eval_every` steps (and before the first) the policy attempts a fixed held-out task set
(`eval_tasks` of the environment's "eval" split, `eval_attempts` times each): eval_reward_mean,
eval_success_rate, eval_pass@1, eval_pass@k, eval_consistency.

Run dir (runs/<name>): config.yaml (the resolved config), model/ (the model's config.json, for rollout workers),
metrics.jsonl (every step), tensorboard/,
checkpoints/ (adapters, optimiser, counters, RNG, policy version, pool and curriculum state: a killed run continues
from the last one), policy/<version>/ (adapter dirs in rollout.publish_format), requests/ and spool/ (external
samplers: docs/serving.md), images/ (the pictures of rollouts, by
content hash), adapters/ (the final adapters, `nemo-jax lora export`).
"""

from __future__ import annotations

import dataclasses
import math
import os
import shutil
import threading
import time
from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np

from nemo_jax.config.load import dump_yaml
from nemo_jax.config.train import (GRPOConfig, load_grpo_config,  # noqa: F401 (load_grpo_config: re-exported)
                                   resolve_mesh_sizes)
from nemo_jax.data.chat import ChatTokenizer
from nemo_jax.lora import LoraConfig, save_adapter_checkpoint
from nemo_jax.lora.peft import check_servable
from nemo_jax.parallel import distributed
from nemo_jax.parallel.mesh import batch_shards, make_mesh
from nemo_jax.parallel.rules import Rules
from nemo_jax.rl.client import TrainingClient
from nemo_jax.rl.curriculum import Curriculum
from nemo_jax.rl.ablation import ablate
from nemo_jax.rl.envs import make_env
from nemo_jax.rl.pool import RolloutPool
from nemo_jax.rl.transport.producer import ThreadProducer, as_text, sample_rollouts
from nemo_jax.rl.rollout import RolloutImages, info_means, learner_batch
from nemo_jax.rl.transport.board import RequestBoard
from nemo_jax.rl.transport.rollouts import SpoolReader
from nemo_jax.train.checkpoint import catch_stop_signals
from nemo_jax.train.metrics import MetricsLogger, check_logging
from nemo_jax.train.sft import DTYPES, initial_adapters, initial_params, options_from, start_run


MAX_DRAWS = 4  # groups drawn per step, at most, as a multiple of groups_per_step (zero-variance ones are skipped)
PUBLISH_DTYPES = {"train": None, "bf16": jnp.bfloat16}


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
        # (rows that cannot hold an episode are refused before anything is trained or sampled)
        longest = max((len(self.tok.tokenizer.encode(self.tok.render(as_text(list(t.messages))[0],
                                                                     add_generation_prompt=True),
                                                     add_special_tokens=False).ids)
                       for t in self.tasks.values() if t.messages), default=0)
        if longest >= c.rollout.seq_len:
            raise ValueError(f"rollout.seq_len={c.rollout.seq_len} is too short: the longest {c.rollout.env} prompt "
                             f"has {longest} tokens and leaves no room for an answer")
        need = demonstration_tokens(self.env, self.tok, cfg)
        if need > c.rollout.seq_len + 1:  # (a learner row holds seq_len + 1 tokens)
            raise ValueError(f"rollout.seq_len={c.rollout.seq_len} is too short: the {c.rollout.env} expert's "
                             f"demonstrations need {need} tokens (rollout.seq_len >= {need - 1}); the learner would "
                             "train on the first part of each episode only, never on what earns its reward")
        lcfg = LoraConfig(tuple(c.lora.targets), c.lora.rank, c.lora.alpha, c.lora.rslora, c.lora.init_seed)
        warm = None
        if c.lora.init is not None:  # a warm start (trained first with lora.init_sft_config when missing)
            from nemo_jax.rl.warmstart import make_source

            warm = initial_adapters(c, cfg, lcfg, tokenizer=c.tokenizer, make_source=make_source)
        self.client = TrainingClient(cfg, base, lcfg, self.mesh, optim=c.optim, loss=c.loss, total_steps=c.steps,
                                     grad_accum=c.optim.grad_accum, seed=c.seed, opts=options_from(c.model, self.mesh),
                                     adapters=warm)
        self.pool = RolloutPool(c.rollout.group_size, c.rollout.max_off_policy_steps,
                                c.rollout.max_failed_episodes or None)
        if c.rollout.publish_every:  # before any work: a format that cannot hold the targets is refused now
            check_servable(cfg, lcfg, c.rollout.publish_format)
        cu = c.curriculum
        self.curriculum = Curriculum(list(self.tasks), cu.window, cu.floor, cu.prior, seed=c.seed)
        self.draw_p: dict[str, float] = {}  # group id -> the probability its task was drawn with
        self.lock = threading.Lock()
        v = cfg.vision
        self.image_dir = os.path.join(self.run_dir, "images") if v is not None else None
        self.images = None
        if v is not None:
            self.images = RolloutImages(v, self.image_dir, c.rollout.max_image_patches or c.rollout.seq_len * v.merge ** 2,
                                        c.rollout.max_images)
        r = c.rollout
        self.spool = self.board = None
        if r.spool:  # (rollouts longer than a learner row are truncated there, not rejected here)
            self.spool = SpoolReader(os.path.join(self.run_dir, "spool"), cfg.vocab_size, None, vision=v,
                                     image_root=self.image_dir, max_file_bytes=int(r.spool_max_file_mb * 2**20),
                                     min_logprob=r.min_logprob, temperature=c.loss.temperature,
                                     reward_range=tuple(r.reward_range) if r.reward_range else None)
            self.board = RequestBoard(self.run_dir, r.lease_s)
        self.sampling = {"temperature": c.loss.temperature, "top_p": r.top_p, "top_k": r.top_k,
                         "max_tokens": r.max_new_tokens, "stop": list(r.stop)}
        unit = batch_shards(self.mesh) * c.optim.grad_accum  # rows split into micro-batches, each over the shards
        self.rows = math.ceil(c.rollout.groups_per_step * c.rollout.group_size / unit) * unit
        eval_tasks = self.env.tasks("eval")
        self.eval_tasks = eval_tasks[:c.eval_tasks] if c.eval_tasks else eval_tasks
        self._eval_engine = None
        self.truncated = 0  # rollouts truncated to rollout.seq_len so far
        self.truncated_steps = 0  # steps that truncated any
        self.no_signal_steps = 0  # steps whose every group had equal rewards (no update)
        self.evals: list[tuple[int, float]] = []  # (step, held-out pass@1) of this process's evals
        self.mismatch_dropped = 0  # rollouts dropped by loss.seq_mismatch_max so far (this process)
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
                    on_board = self.board.on_board()  # (before reading: see RequestBoard.orphans)
                    self._read_spool()
                    self._leases()
                    self._repost(self.board.orphans(self.pool, on_board))
            with self.lock:
                self.pool.drop_stale(self.client.version)
                if self.board is not None:
                    for gid, why in self.pool.drain_dropped():
                        self.board.cancel(gid, why)
                inline = producer is not None and self.c.rollout.producer == "inline"
                if len(self.pool.ready) >= need and not (inline and producer.pending()):
                    # (inline: every group in flight is finished first, so no group is part-sampled when the
                    # policy changes: the run repeats exactly, docs/grpo.md#reproducibility)
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

    def _read_spool(self):
        """The rollouts (and failure reports) workers wrote; a group they completed needs its request no more.
        (Called under the lock.)"""
        for gid in self.spool.poll(self.pool, self.client.version):
            self.board.done(gid)
            self.curriculum.update(self.pool.ready[gid][0].task_id, [r.reward for r in self.pool.ready[gid]])

    def _request_groups(self):
        """Keep `in_flight_groups` groups requested from external producers (RUN/requests)."""
        with self.lock:
            want = self.c.rollout.in_flight_groups - sum(g["external"] for g in self.pool.in_flight.values())
            if want <= 0:
                return
            for t, p in self.curriculum.sample_with_p(want):
                gid = self.pool.open_group(t, self.board.group_id(self.step), external=True)
                self.draw_p[gid] = p
                self.board.post(gid, self.tasks[t], self.c.rollout.group_size, self.client.version, self.sampling)

    def _leases(self):
        """Expired leases count as failed episodes (a group past rollout.max_failed_episodes is cancelled) and are
        posted again for the rollouts their group still needs. (Called under the lock.)"""
        self._repost([gid for gid in self.board.expired() if self.pool.fail(gid) == "counted"])

    def _repost(self, gids):
        """Post in-flight groups again for the rollouts they still need. (Called under the lock.)"""
        for gid in gids:
            g = self.pool.in_flight[gid]
            self.board.post(gid, self.tasks[g["task_id"]], self.c.rollout.group_size, self.client.version,
                            self.sampling, rollouts=self.pool.missing(gid))

    def _resume_requests(self):
        """After a (re)start: keep the requests and claims of the in-flight groups the pool restored, cancel those
        of groups it does not know, post again what a restored group lost (after reading what workers wrote
        meanwhile: a group they completed is not posted again)."""
        with self.lock:
            self._read_spool()
            _, lost = self.board.reconcile(self.pool)
            for gid in lost:
                if self.pool.in_flight[gid]["task_id"] not in self.tasks:  # the task set changed under the run
                    del self.pool.in_flight[gid]
                    self.board.cancel(gid, "unknown")
            self._repost([gid for gid in lost if gid in self.pool.in_flight])

    def _publish(self):
        r = self.c.rollout
        self.client.publish(self.run_dir, format=r.publish_format, dtype=PUBLISH_DTYPES[r.publish_dtype],
                            keep=r.publish_keep, keep_every=r.publish_keep_every)

    def _on_signal(self, signum):
        self.stop_requested = True

    def evaluate(self) -> dict:
        """The current policy on the fixed held-out tasks (see `evaluate_env`)."""
        c, r = self.c, self.c.rollout
        if self._eval_engine is None:
            self._eval_engine = self.client.engine(
                batch=c.eval_rows or r.sampler_rows or r.groups_per_step * r.group_size,
                max_len=r.sampler_positions or 2 * (r.seq_len + r.max_new_tokens), key=jax.random.key(c.seed + 7))
        else:
            self._eval_engine.set_adapters(jax.tree.map(jnp.copy, self.client.adapters), self.client.version)
        return evaluate_env(self._eval_engine, self.tok, self.cfg, self.env, c.eval_attempts, r.max_new_tokens,
                            c.loss.temperature, tasks=self.eval_tasks, timeout_s=r.episode_timeout_s, seed=c.seed)

    def _log_eval(self, logger, bar) -> dict:
        ev = self.evaluate()
        rec = {"step": self.step, **{f"eval_{k}": v for k, v in ev.items()
                                     if k not in ("tasks", "attempts", "task_rewards")}}
        logger.log(rec)
        k = self.c.eval_attempts
        bar.write(f"step {self.step}: held-out eval on {ev['tasks']} tasks x {k}: reward {ev['reward_mean']:.3f} (se {ev['reward_se']:.3f})  "
                  f"pass@1 {ev['pass@1']:.3f}  pass@{k} {ev[f'pass@{k}']:.3f}  consistency {ev['consistency']:.3f}")
        if not self.evals and self.step == 0:
            for line in start_gate(ev, k, self.c.eval_min_headroom):
                bar.write(line)
        self.evals.append((self.step, ev["pass@1"]))
        return rec

    def run(self) -> dict:
        from tqdm import tqdm

        c, r = self.c, self.c.rollout
        os.makedirs(self.run_dir, exist_ok=True)
        if jax.process_index() == 0:  # what rollout workers need of the model (stop tokens, the vision tower)
            from nemo_jax.config.model import write_config
            from nemo_jax.fsutil import atomic_dir

            with atomic_dir(os.path.join(self.run_dir, "model"), "model config", overwrite=True,
                            own_files=("config.json", "preprocessor_config.json")) as tmp:
                write_config(self.cfg, tmp)
        producer = None
        if r.producer != "none":
            producer = ThreadProducer(self.client, self.tok, self.env, self.pool, self.curriculum, r,
                                      c.loss.temperature, c.seed, self.lock, image_dir=self.image_dir,
                                      draw_p=self.draw_p)
        resumed = self.restore(producer)
        first_step = self.step
        if self.board is not None:  # requests and in-flight groups are part of the run's state
            self._resume_requests()
        if producer is not None:
            producer.set_policy(self.client.version, self.client.adapters)
        if r.publish_every:
            self._publish()
        restore_signals = catch_stop_signals(self._on_signal)
        logger = MetricsLogger(self.run_dir, enabled=jax.process_index() == 0, logging=c.logging,
                               config=dataclasses.asdict(c), name=c.name)
        if not self.quiet:
            print(f"grpo {c.name}: {len(self.tasks)} {getattr(self.env, 'name', 'env')} tasks, "
                  f"{r.groups_per_step} groups x {r.group_size} rollouts per step, run dir {self.run_dir}"
                  + (f" (resumed at step {self.step})" if resumed else ""), flush=True)
        if producer is not None and r.producer == "thread":
            producer.start()
        bar = tqdm(total=c.steps, initial=self.step, desc="grpo", disable=self.quiet or jax.process_index() != 0,
                   dynamic_ncols=True)
        last = {}
        try:
            if c.eval_every and self.step == 0:
                last.update(self._log_eval(logger, bar))
            first = True
            while self.step < c.steps and not self.stop_requested:
                last.update(self._one_step(producer, logger, bar) or {})
                bar.update(1)
                if first:  # rate and ETA from here on (the first step compiled the learner and sampler)
                    rate_from_here(bar)
                    first = False
                if c.eval_every and self.step % c.eval_every == 0:
                    last.update(self._log_eval(logger, bar))
                if c.checkpoint.every and self.step % c.checkpoint.every == 0:
                    self.save(producer)
        finally:
            bar.close()
            if producer is not None:
                producer.close()
            logger.close()
        self.save(producer)
        restore_signals()
        done = self.step >= c.steps
        if self.board is not None and done:  # finished: workers stop (a stopped run's rerun goes on with them)
            self.board.close(self.step)
        self.client.close()
        if done:  # the final adapters: a stopped run has none yet (a rerun continues it; its checkpoints hold them)
            save_adapter_checkpoint(os.path.join(self.run_dir, "adapters"), self.cfg, self.client.lora_cfg,
                                    self.client.adapters, overwrite=True)
        last["step"] = self.step
        last["stopped_early"] = not done
        if not self.quiet and jax.process_index() == 0:
            for line in verdict(self.evals, self.no_signal_steps, self.step - first_step):
                print(f"grpo {c.name}: {line}", flush=True)
        if not self.quiet and done:
            print(f"grpo {c.name}: done at step {self.step}; outputs in {self.run_dir}: adapters/ (final LoRA "
                  f"adapters), metrics.jsonl, config.yaml, checkpoints/" + (", policy/" if r.publish_every else ""),
                  flush=True)
        elif not self.quiet:
            print(f"grpo {c.name}: stopped at step {self.step} of {c.steps}; rerun the same command to continue "
                  f"(adapters/ is written when the run completes; the checkpoints hold the adapters so far: "
                  f"nemo-jax lora export {self.run_dir} OUT)", flush=True)
        return last

    def _one_step(self, producer, logger, bar) -> dict:
        c, r = self.c, self.c.rollout
        t0 = time.perf_counter()
        busy0 = producer.busy_s if producer is not None else 0.0
        env0 = producer.driver.calls.busy_s if producer is not None and producer.driver else 0.0
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
            groups += [g for g in got if len({x.reward for x in g}) > 1]
        if not seen:
            return {}
        stale = self.pool.counts["groups_stale_dropped"]
        rollouts = [x for g in seen for x in g]
        batch, counts = learner_batch(groups, r.seq_len, rows=self.rows, scale=c.loss.advantage_scale,
                                      reduction=c.loss.reduction, max_len=r.max_new_tokens, images=self.images,
                                      turn_credit=c.loss.turn_credit, turn_gamma=c.loss.turn_gamma)
        self.truncated += counts["truncated"]
        if counts["truncated"]:
            self.truncated_steps += 1
            if self.truncated_steps in (1, 10, 100) or self.truncated_steps % 1000 == 0:
                bar.write(f"grpo: warning: step {self.step + 1}: {counts['truncated']} of {counts['rollouts']} rollouts "
                          f"longer than a learner row (rollout.seq_len={r.seq_len} + 1 tokens) were cut "
                          f"({self.truncated_steps} steps so far): the learner misses their ends; raise rollout.seq_len")
        counts["zero_variance_frac"] = sum(len({x.reward for x in g}) == 1 for g in seen) / len(seen)
        t1 = time.perf_counter()
        rec = {"step": self.step + 1}
        if groups:
            fb = self.client.forward_backward(batch)
            rec.update(self.client.optim_step())
            rec["learner_loss"] = fb["loss"]
            self.mismatch_dropped += int(rec.get("mismatch_dropped", 0))
            rec["rollouts_mismatch_dropped"] = self.mismatch_dropped
        else:  # nothing to learn from in MAX_DRAWS x groups_per_step groups: the step takes no update
            rec["skipped_no_signal"] = 1
            self.no_signal_steps += 1
        self.step += 1
        if producer is not None:
            producer.set_policy(self.client.version, self.client.adapters)
        if r.publish_every and self.step % r.publish_every == 0:
            self._publish()
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
        with self.lock:  # importance weights 1 / p(task drawn): each task counts as if drawn uniformly
            w = np.array([1.0 / max(self.draw_p.pop(g[0].group_id, 0.0) or 1.0 / len(self.tasks), 1e-12)
                          for g in seen for _ in g])
        timed_out = producer.driver.counts["timed_out"] if producer is not None and producer.driver else 0
        rec.update({"reward_mean": float(rewards.mean()) if rewards.size else float("nan"),
                    "reward_mean_uniform": float(np.sum(w * rewards) / np.sum(w)) if rewards.size else float("nan"),
                    "success_rate": float(np.mean([x.success for x in rollouts])) if rollouts else float("nan"),
                    **{f"reward_mean/{f}": fam_sum[f] / n for f, n in fam.items()}, **info_means(rollouts),
                    "zero_variance_frac": counts["zero_variance_frac"], "groups_stale_dropped": stale,
                    "rollouts_truncated": self.truncated, "truncated_frac": counts["truncated"] / max(len(rollouts), 1),
                    "episodes_timed_out": timed_out,
                    "response_len_mean": float(lengths.mean()) if lengths.size else 0.0,
                    "response_len_max": int(lengths.max()) if lengths.size else 0,
                    "staleness_mean": float(staleness.mean()) if staleness.size else 0.0,
                    "staleness_max": int(staleness.max()) if staleness.size else 0,
                    "versions_per_rollout": float(np.mean([len(x.policy_versions) for x in rollouts])),
                    "learner_s": time.perf_counter() - t1, "wait_s": waited, "wait_frac": waited / max(dt, 1e-9),
                    "tokens_per_sec": float(batch["segment_ids"].sum()) / max(time.perf_counter() - t1, 1e-9),
                    "policy_version": self.client.version})
        if producer is not None:
            rec["producer_busy_s"] = producer.busy_s - busy0
            if producer.driver is not None:  # the environment's calls (sandboxes, tools, judges) during the step
                rec["env_s"] = producer.driver.calls.busy_s - env0
                rec["env_frac"] = rec["env_s"] / max(dt, 1e-9)
        if self.spool is not None:
            rec.update({f"spool_rejected/{k}": v for k, v in self.spool.rejected.items()})
            rec.update({k: v for k, v in self.board.counts.items() if k != "requests_posted"})
            rec["episodes_failed"] = self.pool.counts["episodes_failed"]
        if self.client.publisher is not None:
            rec["publish_skipped"] = self.client.publisher.skipped
        logger.log(rec)
        logger.histogram(rec["step"], "staleness", staleness)
        logger.histogram(rec["step"], "rewards", rewards)
        bar.set_postfix(reward=f"{rec['reward_mean']:.3f}", uniform=f"{rec['reward_mean_uniform']:.3f}",
                        stale=f"{rec['staleness_mean']:.2f}", refresh=False)
        if not self.quiet and bar.disable and rec["step"] % c.log_every == 0:
            print(f"step {rec['step']}: reward_mean {rec['reward_mean']:.3f}  wait {waited:.1f}s  "
                  f"learner {rec['learner_s']:.1f}s  version {self.client.version}", flush=True)
        return rec


def demonstration_tokens(env, tok, cfg, n: int = 4) -> int:
    """The longest of the environment expert's first `n` train demonstrations (0 without an expert), in tokens
    as a learner row holds them: the chat template with the tool definitions, each picture's tokens."""
    if not callable(getattr(env, "demonstrations", None)) or not callable(getattr(env, "expert", None)):
        return 0
    from nemo_jax.data.chat import IMAGE_TOKEN, parse_record

    image_id = tok.tokenizer.token_to_id(IMAGE_TOKEN)
    longest = 0
    for rec in env.demonstrations("train", n):
        doc = parse_record(rec, tok, cfg.vocab_size)
        n_tok = len(doc.ids)
        if doc.images and cfg.vision is not None:
            from nemo_jax.data.images import load_image, picture_tokens

            n_tok += sum(picture_tokens(cfg.vision, load_image(ref)) for ref in doc.images)
            n_tok -= int(sum(t == image_id for t in doc.ids))
        longest = max(longest, n_tok)
    return longest


def start_gate(ev: dict, k: int, min_headroom: float) -> list[str]:
    """What the step-0 eval says of the start: its pass@1 and pass@k, and a warning when pass@k - pass@1 (how
    often the start succeeds where it usually fails: what RL can sharpen) is below `min_headroom`; when that is
    because pass@1 is already within `min_headroom` of 1, the warning says the start has solved the task."""
    p1, pk = ev["pass@1"], ev[f"pass@{k}"]
    lines = [f"grpo: start: held-out pass@1 {p1:.3f}, pass@{k} {pk:.3f}"]
    if k < 2:
        lines[0] += " (eval_attempts 1: the headroom pass@k - pass@1 is not measured)"
    elif 1 - p1 < min_headroom:
        lines.append(f"grpo: warning: the start already succeeds in {p1:.3f} of held-out attempts: RL can add at "
                     f"most {1 - p1:.3f} (below eval_min_headroom {min_headroom:g}); the held-out tasks are solved")
    elif pk - p1 < min_headroom:
        lines.append(f"grpo: warning: pass@{k} - pass@1 = {pk - p1:.3f} < eval_min_headroom {min_headroom:g}: the "
                     "start rarely succeeds where it usually fails, so RL has little to sharpen; warm-start the "
                     "expert first (lora.init_sft_config: demonstrations or rejection sampling, docs/grpo.md)")
    return lines


def verdict(evals: list[tuple[int, float]], no_signal: int, steps: int) -> list[str]:
    """What the run says at its end: held-out pass@1 from its first eval to its last, and a warning when it did not
    rise or when most steps had no signal (every group's rewards equal: no update)."""
    lines = []
    if len(evals) >= 2:
        (s0, first), (s1, last) = evals[0], evals[-1]
        lines.append(f"held-out pass@1 {first:.3f} at step {s0} -> {last:.3f} at step {s1}")
        if last <= first:
            lines.append(f"warning: held-out pass@1 did not rise ({first:.3f} -> {last:.3f}): the adapters learned "
                         "nothing that carries over to unseen tasks")
    if steps and no_signal > steps / 2:
        lines.append(f"warning: {no_signal} of {steps} steps had no signal (every group's rewards were equal: no "
                     "update): the tasks are too hard or too easy for this start")
    return lines


def rate_from_here(bar) -> None:
    """A tqdm bar's rate and ETA count from now on: its start time, last print and smoothed rate are reset at its
    current count (after the step that compiled: its minutes must not enter the steps' rate)."""
    n = bar.n
    bar.reset(total=bar.total)  # (clears the exponential moving averages of tqdm's rate, and the start time)
    bar.n = bar.last_print_n = bar.initial = n
    bar.refresh()


# ----------------------------------------------------------------------------- eval
def evaluate_env(engine, tok, cfg, env, attempts: int, max_new_tokens: int, temperature: float, *,
                 split: str = "eval", tasks=None, timeout_s: float = 0.0, progress: bool = False,
                 seed: int | None = None) -> dict:
    """Every `split` task (or the given `tasks`) attempted `attempts` times through `engine` (its adapters) ->
    tasks, attempts, reward_mean (each task weighted equally), success_rate, pass@1 (the mean success of single
    attempts), pass@k (solved at least once in k = attempts), consistency (solved in all k attempts).
    `progress`: a progress bar of finished attempts on stderr (its first update waits for the sampler's compile).
    `seed`: every attempt's draws from (seed, task, attempt) alone: the same figures on a rerun."""
    from tqdm import tqdm

    tasks = list(env.tasks(split) if tasks is None else tasks)
    if not tasks:
        raise ValueError(f"{getattr(env, 'name', 'environment')}: no {split!r} tasks to evaluate")
    bar = tqdm(total=len(tasks) * attempts, desc="eval", unit="attempt", dynamic_ncols=True, disable=not progress)
    try:
        got = sample_rollouts(engine, tok, cfg, env, [(t, f"eval{i}") for i, t in enumerate(tasks)], attempts,
                              max_new_tokens, temperature, timeout_s=timeout_s, progress=bar.update, seed=seed)
    finally:
        bar.close()
    rew = np.array([x.reward for x in got]).reshape(len(tasks), attempts)
    succ = np.array([x.success for x in got]).reshape(len(tasks), attempts)
    return {"tasks": len(tasks), "attempts": attempts, "reward_mean": float(rew.mean()),
            "reward_se": standard_error(rew), "success_rate": float(succ.mean()), "success_se": standard_error(succ),
            "pass@1": float(succ.mean()), f"pass@{attempts}": float(succ.any(axis=1).mean()),
            "consistency": float(succ.all(axis=1).mean()), "task_rewards": rew.mean(axis=1).round(6).tolist(),
            **info_means(got)}


def standard_error(x) -> float:
    """The standard error of the mean of a [tasks, attempts] table, tasks as the unit (each task's mean over its
    attempts, then their spread / sqrt(tasks)): it covers both the draw of the held-out tasks and the sampling
    noise of the attempts. 0 for a single task."""
    per_task = np.asarray(x, np.float64).mean(axis=1)
    return float(per_task.std(ddof=1) / np.sqrt(len(per_task))) if len(per_task) > 1 else 0.0


def eval_engine(params, cfg, adapters=None, *, rows: int = 32, max_len: int = 1024, seed: int = 0):
    """An `Engine` for evals over `params` (+ `adapters`)."""
    from nemo_jax.generate import Engine

    return Engine(params, cfg, batch=rows, max_len=max_len, adapters=adapters, key=jax.random.key(seed))


def cli_eval(a, env=None) -> dict:
    """`nemo-jax eval` on parsed arguments; `env`: the environment, already built from --env / --env-args (the CLI
    builds it before JAX loads, so a bad one fails at once)."""
    import json
    import sys

    from nemo_jax.sources import load_for_generation

    say = lambda text: print(f"eval: {text}", file=sys.stderr, flush=True)  # noqa: E731 (stdout: the figures)
    say(f"loading {a.ckpt}" + (f" and the adapters {a.adapters}" if a.adapters else ""))
    cfg, params, tok_dir = load_for_generation(a.ckpt, dtype=jnp.float32)
    adapters = None
    if a.adapters:
        from nemo_jax.sources import load_adapters

        adapters = jax.tree.map(jnp.asarray, load_adapters(a.adapters, cfg))
    tok = ChatTokenizer.load(a.tokenizer or tok_dir)
    if env is None:
        env = make_env(a.env, **(json.loads(a.env_args) if a.env_args else {}))
    env = ablate(env, a.images, a.seed)
    engine = eval_engine(params, cfg, adapters, rows=a.rows, max_len=a.max_len, seed=a.seed)
    say(f"{a.env}: {len(env.tasks(a.split))} {a.split} tasks x {a.attempts} attempts on {a.rows} sampler rows "
        "(the first attempts finish after the sampler compiles)")
    out = evaluate_env(engine, tok, cfg, env, a.attempts, a.max_new_tokens, a.temperature, split=a.split,
                       progress=True, seed=a.seed)
    from nemo_jax.rl.ablation import ablation_note

    if ablation_note(env):
        say(ablation_note(env))
    out.update(env=a.env, images=a.images, ckpt=a.ckpt, adapters=a.adapters)
    width = max(len(k) for k in out)
    for k, v in out.items():
        if k != "task_rewards":  # (per task: in --json only)
            print(f"{k:<{width}}  {v:.4f}" if isinstance(v, float) else f"{k:<{width}}  {v}")
    if a.json:
        from nemo_jax.fsutil import atomic_write_text

        atomic_write_text(a.json, json.dumps(out, indent=1))
    return out


def main(path: str | None = None, overrides=(), *, config: GRPOConfig | None = None, new_run: bool = False) -> dict:
    """`nemo-jax grpo`: the config (`config`, or loaded from `path` + `overrides`) is validated before any work;
    the resolved config is written to RUN/config.yaml (what rollout workers read). A run dir holding checkpoints
    of a run with other settings is refused, or with `new_run` moved aside first (`nemo_jax.train.sft.start_run`)."""
    c = config or load_grpo_config(path, overrides)
    resolve_mesh_sizes(c.mesh.sizes(), jax.device_count())  # the mesh fits the devices, before any work
    run_dir = os.path.abspath(c.run_dir or os.path.join("runs", c.name))
    start_run(run_dir, c, "grpo", new_run)
    new_dir = not os.path.exists(run_dir)
    with distributed.writer_lock(run_dir, "nemo-jax grpo") as lock:  # one writer per run dir
        try:
            runner = GRPORunner(c)
        except Exception:  # a run dir this call made holds nothing of value yet
            if new_dir and jax.process_index() == 0 and os.path.isdir(run_dir):
                lock.release()
                shutil.rmtree(run_dir, ignore_errors=True)
            raise
        if jax.process_index() == 0:
            from nemo_jax.fsutil import atomic_write_text

            atomic_write_text(os.path.join(run_dir, "config.yaml"), dump_yaml(c))
        return runner.run()
