"""The in-process rollout producer: render each task's conversation with the chat template, sample G rollouts per
task with the JAX sampler (behaviour logprobs of every sampled token), let the environment answer each assistant
turn (tool results, the next user turn) until it is done, score, and hand the rollouts to the pool.

A rollout's token sequence is the whole conversation: prompt and environment turns (loss mask 0, rendered by the
chat template: the text the template adds after the assistant's end-of-turn token, tokenised) and the sampled
tokens (loss mask 1, exactly as sampled, with their logprobs).

Two samplers: `stream` (continuous batching, what the producer uses: a fixed number of decode rows, each
conversation continuing in its row as the environment answers, a finished rollout's row refilled with the next
at once) and the plain `sample` (each turn one batched `generate` over the rows still going: a row that stops
early waits for the batch), which the tests compare it with.
"""

from __future__ import annotations

import threading
import time

import jax
import jax.numpy as jnp

from nemo_jax.generate import SamplingParams
from nemo_jax.rl.envs import Environment, Task
from nemo_jax.rl.rollout import Rollout


def stop_ids(cfg, tok) -> tuple[int, ...]:
    eos = cfg.eos_token_id if isinstance(cfg.eos_token_id, list) else [cfg.eos_token_id]
    return tuple(sorted({*(x for x in eos if x is not None), *tok.eos_ids()}))


def _encode(tok, text: str) -> list[int]:
    return tok.tokenizer.encode(text, add_special_tokens=False).ids


def _turn_delta(tok, history: list[dict], follow: list[dict]) -> str:
    """The text the chat template puts after the last assistant turn's end-of-turn token: the environment's
    messages and the next generation prompt."""
    before = tok.render(history)
    after = tok.render(history + follow, add_generation_prompt=True)
    eos = tok.eos_token or ""
    cut = before.rfind(eos) + len(eos) if eos and eos in before else len(before)
    if not after.startswith(before[:cut]):
        raise ValueError("chat template re-renders earlier turns differently; multi-turn rollouts need a template "
                         "whose rendering of a conversation extends the rendering of its prefix")
    return after[cut:]


def _take_turn(tok, env, r: dict, turn: int, new: list[int], lps: list[float], why: str) -> list[int] | None:
    """Record a sampled assistant turn of rollout row `r`; the environment answers -> the tokens that continue
    the conversation (its messages and the next generation prompt), or None when the rollout is done."""
    r["tokens"] += new
    r["mask"] += [1] * len(new)
    r["lps"] += lps
    r["history"].append({"role": "assistant", "content": tok.tokenizer.decode(new, skip_special_tokens=True)})
    follow = None if why != "stop" else env.respond(r["task"], r["history"])
    if not follow or turn + 1 == getattr(env, "max_turns", 1):
        r["done"] = True
        return None
    extra = _encode(tok, _turn_delta(tok, r["history"], follow))
    r["history"] += follow
    r["tokens"] += extra
    r["mask"] += [0] * len(extra)
    r["lps"] += [0.0] * len(extra)
    return extra


def sample_rollouts(sample, tok, cfg, env: Environment, tasks: list[tuple[Task, str]], group_size: int,
                    max_new_tokens: int, temperature: float, key, versions: tuple[int, ...], stream=None,
                    top_p: float = 1.0, top_k: int = 0) -> list[Rollout]:
    """tasks: (task, group id) pairs -> group_size scored rollouts per task. versions: the policy version(s)
    sampling. With `stream(prompts, sp, key, next_turn)` (e.g. TrainingClient.sample_stream with an adapter
    snapshot and its rows) the rollouts go through continuous batching; else each turn is one
    `sample(prompts, sp, key)` -> Generation over the rollouts still going."""
    sp = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                        stop_token_ids=stop_ids(cfg, tok))
    rows = []
    for task, gid in tasks:
        ids = _encode(tok, tok.render(list(task.messages), add_generation_prompt=True))
        for _ in range(group_size):
            rows.append({"task": task, "gid": gid, "history": list(task.messages), "tokens": list(ids),
                         "mask": [0] * len(ids), "lps": [0.0] * len(ids), "done": False})
    if stream is not None:
        def next_turn(i, turns):
            new, lps, why = turns[-1]
            return _take_turn(tok, env, rows[i], len(turns) - 1, new, lps, why)

        for _ in stream([list(r["tokens"]) for r in rows], sp, key, next_turn):
            pass
    for turn in range(max(1, getattr(env, "max_turns", 1)) if stream is None else 0):
        live = [r for r in rows if not r["done"]]
        if not live:
            break
        key, sub = jax.random.split(key)
        g = sample([r["tokens"] for r in live], sp, sub)
        for r, new, lps, why in zip(live, g.tokens, g.logprobs, g.finish_reason):
            _take_turn(tok, env, r, turn, new, lps, why)
    out = []
    for r in rows:
        s = env.score(r["task"], r["history"])
        out.append(Rollout(r["tokens"], r["mask"], r["lps"], float(s.reward), r["task"].id, r["gid"], list(versions),
                           bool(s.success), temperature=temperature))
    return out


class ThreadProducer:
    """Samples groups in a background thread with the newest published adapters while the learner trains: keeps
    `in_flight` groups requested (tasks from the curriculum), adds finished rollouts to the pool. The pool, the
    curriculum and the adapter snapshot are shared under `lock`."""

    def __init__(self, client, tok, env, pool, curriculum, rcfg, temperature: float, seed: int, lock):
        self.client, self.tok, self.env, self.pool, self.cur = client, tok, env, pool, curriculum
        self.r, self.temperature, self.lock = rcfg, temperature, lock
        self.by_id = {t.id: t for t in env.tasks("train")}
        self.key = jax.random.key(seed)
        self.snapshot = None
        self.mine = set()  # ids of the groups this producer opened
        self.set_policy(client.version, client.adapters)
        self.stop = threading.Event()
        self.error = None
        self.busy_s = 0.0
        self.thread = threading.Thread(target=self._run, name="rollout-producer", daemon=True)

    def set_policy(self, version: int, adapters):
        """Sample with these adapters from now on (copied: the learner's step donates its own buffers)."""
        snap = (version, jax.tree.map(jnp.copy, adapters))
        with self.lock:
            self.snapshot = snap

    def produce_once(self) -> int:
        """Open and sample `groups_per_step` groups (always that many: one compiled batch shape) when the pool has
        room under the in-flight target -> rollouts added."""
        with self.lock:
            want = self.r.groups_per_step
            self.mine &= set(self.pool.in_flight) | set(self.pool.ready)  # its groups not yet trained on
            if len(self.mine) + want > max(self.r.in_flight_groups, want):
                return 0
            tasks = [(self.by_id[t], self.pool.open_group(t)) for t in self.cur.sample(want)]
            self.mine |= {g for _, g in tasks}
            version, adapters = self.snapshot
        self.key, sub = jax.random.split(self.key)
        t0 = time.perf_counter()
        rows = self.r.sampler_rows or want * self.r.group_size
        positions = self.r.sampler_positions or 2 * (self.r.seq_len + self.r.max_new_tokens)

        def stream(prompts, sp, key, next_turn):  # continuous batching over `rows` decode rows
            return self.client.sample_stream(prompts, sp, key, adapters=adapters, batch=rows, max_len=positions,
                                             next_turn=next_turn)

        rollouts = sample_rollouts(None, self.tok, self.client.cfg, self.env, tasks, self.r.group_size,
                                   self.r.max_new_tokens, self.temperature, sub, (version,), stream=stream,
                                   top_p=self.r.top_p, top_k=self.r.top_k)
        self.busy_s += time.perf_counter() - t0
        with self.lock:
            for x in rollouts:
                if self.pool.add(x) not in (None, "unknown_group"):  # a finished group: curriculum statistics
                    self.cur.update(x.task_id, [y.reward for y in self.pool.ready[x.group_id]])
        return len(rollouts)

    def _run(self):
        try:
            while not self.stop.is_set():
                if self.produce_once() == 0:
                    time.sleep(0.01)
        except BaseException as e:  # surfaced to the learner by `check`
            self.error = e

    def start(self):
        self.thread.start()

    def check(self):
        if self.error is not None:
            raise RuntimeError(f"rollout producer failed: {type(self.error).__name__}: {self.error}") from self.error

    def close(self):
        self.stop.set()
        if self.thread.is_alive():
            self.thread.join()
