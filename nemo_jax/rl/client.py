"""`TrainingClient`: the primitives a user's own RL loop is written on (the ones Tinker offers), in-process and
JAX-native, over LoRA adapters on a frozen base, on a mesh.

    client = TrainingClient(cfg, base_params, LoraConfig(("all",), 16, 32), mesh)
    gen = client.sample(prompts, SamplingParams(max_new_tokens=64, stop_token_ids=(eos,)))   # tokens + logprobs
    m = client.forward_backward(batch, loss="dppo")   # gradients accumulate until optim_step
    client.optim_step()                               # AdamW on the accumulated gradients
    lp = client.compute_logprobs(batch)               # [N, T] logprobs of the targets
    client.publish(run_dir)                           # adapter dir RUN/policy/<version> for external samplers
                                                      # (the version counts optim_steps; written in the background)
    client.save_state(path); client.load_state(path)  # adapters, optimiser, version, and your own JSON state

`batch` is a learner batch (nemo_jax.rl.learner; `nemo_jax.rl.rollout.learner_batch` makes one from rollouts).
"""

from __future__ import annotations

import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np

from nemo_jax.config.train import OptimSection, PolicyLossConfig
from nemo_jax.lora import CONSTANT_LEAVES, LoraConfig, adapter_shardings, attach, init_adapters
from nemo_jax.model.model import Options
from nemo_jax.parallel.mesh import batch_sharding
from nemo_jax.rl.learner import make_learner_grads, token_logprobs
from nemo_jax.rl.loss import summarise
from nemo_jax.train.optimizer import make_optimizer
from nemo_jax.train.step import TrainState, apply_update, combine_stat, train_state_shardings


class TrainingClient:
    def __init__(self, cfg, base, lora_cfg: LoraConfig, mesh=None, *, optim: OptimSection = OptimSection(),
                 loss: PolicyLossConfig = PolicyLossConfig(), grad_accum: int = 1, total_steps: int = 1000,
                 seed: int = 0, opts: Options | None = None, rules=None, adapters=None):
        """base: the frozen model params (kept as given: place them on `mesh` and in the dtype you want);
        adapters: the adapters to start from (a warm start, of `lora_cfg`'s layout; default: fresh ones)."""
        self.cfg, self.base, self.lora_cfg, self.mesh, self.loss_cfg = cfg, base, lora_cfg, mesh, loss
        self.grad_accum = grad_accum
        multi = mesh is not None and mesh.size > 1
        self.opts = opts or Options(mesh=mesh if multi else None)
        ad_sh = adapter_shardings(cfg, lora_cfg, mesh, rules) if multi else None
        if adapters is None:
            adapters = init_adapters(cfg, lora_cfg, jax.random.key(seed), shardings=ad_sh)
        elif ad_sh is not None:
            adapters = jax.device_put(adapters, ad_sh)
        self.tx, self.sched = make_optimizer(optim, adapters, total_steps, frozen=CONSTANT_LEAVES)  # scale: constant
        z = lambda: jnp.zeros((), jnp.int32)  # noqa: E731
        rng = jax.random.key_data(jax.random.key(seed + 1))
        sh = None
        if multi:  # the optimiser state sharded like the adapters, and kept so by every update
            sh = train_state_shardings(self.tx, adapters, ad_sh, mesh)
            opt = jax.jit(self.tx.init, out_shardings=sh.opt_state)(adapters)
            self.state = jax.device_put(TrainState(adapters, opt, z(), z(), z(), rng), sh)
        else:
            self.state = TrainState(adapters, self.tx.init(adapters), z(), z(), z(), rng)
        self.version = 0  # policy version: optimiser steps taken
        self._grads = None  # accumulated gradients (None: nothing pending)
        self._stats = None
        self._grad_fns = {}
        self._combine = lambda ad, b: attach(b, ad)  # noqa: E731
        self._update = jax.jit(lambda s, g, loss: apply_update(s, g, loss, self.tx), donate_argnums=0,
                               out_shardings=None if sh is None else (sh, None, None))
        self._logprobs = jax.jit(lambda ad, b, batch: token_logprobs(
            attach(b, ad), batch, cfg, self.opts, self.loss_cfg.temperature))

    # ------------------------------------------------------------------ learning
    @property
    def adapters(self):
        return self.state.params

    def _put(self, batch: dict) -> dict:
        if self.mesh is None or self.mesh.size == 1:
            return {k: jnp.asarray(v) for k, v in batch.items()}
        return {k: jax.device_put(v, batch_sharding(self.mesh, np.ndim(v))) for k, v in batch.items()}

    def _grad_fn(self, kind: str):
        if kind not in self._grad_fns:
            lc = dataclasses.replace(self.loss_cfg, kind=kind)
            self._grad_fns[kind] = jax.jit(make_learner_grads(self.cfg, self.opts, lc, self.grad_accum,
                                                              self._combine))
        return self._grad_fns[kind]

    def forward_backward(self, batch: dict, loss: str | None = None) -> dict:
        """Gradients of the batch's loss (kind `loss`, default the configured one) added to the pending ones.
        The batch's `loss_weights` define the reduction: weights made over several batches' global counts make
        several forward_backward calls add up to one big batch. -> this batch's metrics (floats)."""
        if not len(batch["tokens"]):
            raise ValueError("forward_backward: the batch has no rows (every group had equal rewards?)")
        (val, stats), grads = self._grad_fn(loss or self.loss_cfg.kind)(self.state.params, self.base, self._put(batch))
        if self._grads is None:
            self._grads, self._stats, self._loss = grads, stats, val
        else:
            self._grads = jax.tree.map(jnp.add, self._grads, grads)
            self._stats = {k: combine_stat(k)(self._stats[k], v) for k, v in stats.items()}
            self._loss = self._loss + val
        return {"loss": float(val), **{k: float(v) for k, v in summarise(stats).items()}}

    def optim_step(self) -> dict:
        """One AdamW update (the configured schedule) from the pending gradients, which are then cleared. A
        non-finite loss or gradient skips the update (counted). -> metrics of everything accumulated."""
        if self._grads is None:
            raise RuntimeError("optim_step: no gradients pending (call forward_backward first)")
        lr = float(self.sched(self.state.step))
        self.state, grad_norm, finite = self._update(self.state, self._grads, self._loss)
        out = {"loss": float(self._loss), "grad_norm": float(grad_norm), "finite": bool(finite), "lr": lr,
               "skipped_updates": int(self.state.skipped), **{k: float(v) for k, v in summarise(self._stats).items()}}
        self._grads = self._stats = None
        self.version += 1
        return out

    def compute_logprobs(self, batch: dict) -> np.ndarray:
        """[N, T] logprobs of the batch's targets under the current policy (at the loss temperature)."""
        return np.asarray(self._logprobs(self.state.params, self.base, self._put(batch)))

    # ------------------------------------------------------------------ sampling and publishing
    def sample(self, prompts: list[list[int]], sp, key=None, adapters=None, bucket: int = 32):
        """Sample continuations of token-id prompts with the current adapters (or `adapters`, e.g. a snapshot
        a producer thread holds) -> nemo_jax.generate.Generation (tokens, behaviour logprobs, finish reasons).
        Prompts are left-padded to a multiple of `bucket` tokens (few compiled shapes)."""
        from nemo_jax.generate import generate

        return generate(self.base, prompts, self.cfg, sp, key=key, opts=self.opts, bucket=bucket,
                        adapters=self.state.params if adapters is None else adapters)

    def sample_stream(self, prompts, sp, key=None, adapters=None, *, batch: int, max_len: int, next_turn=None,
                      bucket: int = 32):
        """Continuous batching (`nemo_jax.generate.continuous_generate`) with the current adapters (or `adapters`):
        `batch` decode rows serve the iterable `prompts`, a finished row refilled with the next one; yields a
        `Finished` (index, turns) per sequence; `next_turn(index, turns)` continues a conversation in place."""
        from nemo_jax.generate import continuous_generate

        return continuous_generate(self.base, prompts, self.cfg, sp, batch=batch, max_len=max_len,
                                   next_turn=next_turn, key=key, opts=self.opts, bucket=bucket,
                                   adapters=self.state.params if adapters is None else adapters)

    def engine(self, *, batch: int, max_len: int, bucket: int = 32, check_every: int = 4, key=None):
        """A continuous-batching `nemo_jax.generate.Engine` over the frozen base, sampling with a copy of the current
        adapters (its version: `self.version`); swap newer ones in with `Engine.set_adapters`."""
        from nemo_jax.generate import Engine

        eng = Engine(self.base, self.cfg, batch=batch, max_len=max_len, opts=self.opts, bucket=bucket,
                     check_every=check_every, key=key)
        eng.set_adapters(jax.tree.map(jnp.copy, self.state.params), self.version)
        return eng

    def publish(self, run_dir: str, *, format: str = "vllm", dtype=None, keep: int = 0, keep_every: int = 0,
                wait: bool = False) -> int:
        """Publish the adapters as RUN/policy/<version> (an adapter dir in `format`, peft or vllm; the version
        counts optimiser steps) -> the version. A device copy (A and B cast to `dtype`, e.g. jnp.bfloat16; None:
        the training dtype) is taken now; a background thread copies it to the host and writes it, so this
        returns at once (`wait`: block until written). Keeps the newest `keep` versions (0: all) and every
        `keep_every`-th. Targets the format cannot hold are refused on the first call."""
        from nemo_jax.lora.peft import check_servable
        from nemo_jax.rl.transport.policy import PolicyPublisher

        key = (os.path.abspath(run_dir), format, keep, keep_every)
        if getattr(self, "_publisher_key", None) != key:
            check_servable(self.cfg, self.lora_cfg, format, what="publish format")
            self.flush_publishing()
            self._publisher = PolicyPublisher(key[0], self.cfg, format=format, keep=keep, keep_every=keep_every,
                                              lora_config=self.lora_cfg)
            self._publisher_key = key
        cast = lambda path, x: (x.astype(dtype) if dtype is not None and x.dtype != dtype  # noqa: E731
                                and getattr(path[-1], "key", None) in ("lora_a", "lora_b") else jnp.copy(x))
        self._publisher.submit(self.version, jax.tree_util.tree_map_with_path(cast, self.state.params))
        if wait:
            self._publisher.flush()
        return self.version

    @property
    def publisher(self):
        """The background `PolicyPublisher` of the last `publish` run dir (its `skipped`, `written`), or None."""
        return getattr(self, "_publisher", None)

    def flush_publishing(self) -> None:
        """Wait until every published version is written (raises a failed write)."""
        if getattr(self, "_publisher", None) is not None:
            self._publisher.close()
            self._publisher, self._publisher_key = None, None

    # ------------------------------------------------------------------ state
    def save_state(self, path: str, step: int, extra: dict | None = None, force: bool = True, *,
                   meta: dict | None = None, verify: bool = True):
        """Checkpoint adapters, optimiser state, counters and RNG (orbax, under `path`, as step `step`, sealed with
        a content manifest) with the policy version and `extra` (the caller's JSON state: pool, curriculum, ...);
        `meta`: more JSON recorded with it (e.g. the run's config, which `nemo_jax.sources` reads)."""
        from nemo_jax.train.checkpoint import RunCheckpointer

        if not hasattr(self, "_ckpt") or self._ckpt.directory != os.path.abspath(path):
            self._ckpt = RunCheckpointer(path, keep=2, async_save=False, verify=verify)
        self._ckpt.save(step, self.state, {"version": self.version, "extra": extra or {}},
                        {**(meta or {}), "lora": dataclasses.asdict(self.lora_cfg),
                         "model_config": self.cfg.to_hf_dict()}, force=force)
        self._ckpt.wait()

    def load_state(self, path: str, *, verify: bool = True):
        """Restore the newest good checkpoint under `path` (a damaged one is moved aside, see
        `nemo_jax.train.checkpoint`) -> (step, extra) or None when there is none."""
        from nemo_jax.train.checkpoint import RunCheckpointer, abstract_like

        ck = RunCheckpointer(path, keep=2, async_save=False, verify=verify)
        target = abstract_like(self.state, jax.tree.map(lambda x: x.sharding, self.state))
        out = ck.restore_latest(target)
        ck.close()
        if out is None:
            return None
        step, self.state, data, _ = out
        self.version = int(data["version"])
        self._grads = None
        return step, data["extra"]

    def close(self):
        self.flush_publishing()
        if hasattr(self, "_ckpt"):
            self._ckpt.close()
