"""The in-process rollout producer: episodes (nemo_jax.rl.envs) driven through the continuous-batching `Engine`.

A rollout's token sequence is the whole conversation: the opening messages and every environment turn (loss mask
0, rendered by the chat template: the text the template adds after the assistant's end-of-turn token, tokenised,
pictures widened to their tokens as SFT does) and the sampled turns (loss mask 1, exactly as sampled, with their
behaviour logprobs and the adapter version that sampled them).

`EpisodeDriver` keeps many episodes going at once. Environment calls (`start`, `step`, `close`) run on a worker
pool (plain methods on threads, `async def` ones on one event-loop thread) while the engine keeps decoding the
other rollouts; a rollout waiting for its environment is parked in its decode row (its state kept; a
continuation that no longer fits the row is re-prefilled whole). Each rollout comes out as soon as it finishes.
Adapters swapped in with `Engine.set_adapters` apply from the next decode step, so a rollout may span policy
versions (each turn records its own; staleness counts from the oldest).

`ThreadProducer` runs a driver in a background thread beside the learner: it keeps `in_flight_groups` groups of
curriculum-drawn tasks going and adds each finished rollout to the pool at once. `sample_rollouts` runs a set of
groups to completion (evals, tools); `sample_rollouts_plain` is the plain reference (each turn one batched
`generate` over the rollouts still going, the whole conversation re-prefilled) the tests compare it with.
"""

from __future__ import annotations

import asyncio
import inspect
import queue
import tempfile
import threading
import time
import zlib
from concurrent.futures import Future
from dataclasses import dataclass, field, replace

import jax
import jax.numpy as jnp

from nemo_jax.data.chat import content_text
from nemo_jax.fields import Fields
from nemo_jax.generate import Engine, Sampler, SamplingParams, chunk_images, widen_images
from nemo_jax.generate.sampling import request_sampling
from nemo_jax.rl.envs.episode import EnvironmentFailed, Observation, Task, as_environment, environment_failed
from nemo_jax.rl.rollout import ImageStore, Rollout, numbers
from nemo_jax.threads import DaemonPool


def stop_ids(cfg, tok) -> tuple[int, ...]:
    return tuple(sorted({*cfg.eos_ids, *tok.eos_ids()}))


def _encode(tok, text: str) -> list[int]:
    return tok.tokenizer.encode(text, add_special_tokens=False).ids


def as_text(messages: list[dict], where: str = "observation") -> tuple[list[dict], list]:
    """Messages whose content may hold image parts -> (the messages with text content, each picture an
    `<img><image></img>` marker as SFT data renders it; the pictures in order)."""
    pics: list = []
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ValueError(f"{where}: message {i} is not a chat dict with a role: {m!r:.80}")
        out.append(dict(m, content=content_text(m.get("content", ""), f"{where}.messages[{i}]", pics)))
    return out, pics


def _turn_delta(tok, history: list[dict], follow: list[dict], tools=None) -> str:
    """The text the chat template puts after the last assistant turn's end-of-turn token: the environment's
    messages and the next generation prompt."""
    before = tok.render(history, tools)
    after = tok.render(history + follow, tools, add_generation_prompt=True)
    eos = tok.eos_token or ""
    cut = before.rfind(eos) + len(eos) if eos and eos in before else len(before)
    if not after.startswith(before[:cut]):
        raise ValueError("chat template re-renders earlier turns differently; multi-turn rollouts need a template "
                         "whose rendering of a conversation extends the rendering of its prefix")
    return after[cut:]


@dataclass(eq=False)
class _Live:
    """One rollout in progress: its episode, its conversation (as text for the template) and its token record."""
    task: Task
    group_id: str
    rollout_id: str
    episode: object
    deadline: float = 0.0  # time.monotonic() past which it times out (0: never)
    text: list = field(default_factory=list)  # the conversation, image parts as markers
    convo: list = field(default_factory=list)  # the conversation as the episode gave it (its pictures kept)
    tools: list | None = None
    tokens: list = field(default_factory=list)
    mask: list = field(default_factory=list)
    lps: list = field(default_factory=list)
    images: list = field(default_factory=list)  # image store records, in token order
    versions: set = field(default_factory=set)
    turns: int = 0
    cut: bool = False  # its last turn hit max_new_tokens
    seq: int | None = None  # its engine sequence
    pending: Future | None = None
    pending_what: str = ""  # the episode method `pending` runs
    obs: Observation | None = None
    turn_rewards: list = field(default_factory=list)  # the conversation's reward after each assistant turn
    branches: list = field(default_factory=list)  # where each later branch starts in `tokens`
    timed_out: bool = False
    ended: bool = False
    sp: SamplingParams | None = None  # its own sampling parameters (None: the driver's)


class Conversation:
    """Turns an episode's observations into tokens and pictures (and the sampled tokens back into messages)."""

    def __init__(self, tok, cfg, store: ImageStore | None):
        self.tok, self.cfg, self.store = tok, cfg, store

    def _ids(self, text: str, pics: list, r: _Live) -> tuple[list[int], list]:
        ids, pics = widen_images(self.cfg, _encode(self.tok, text), pics)
        if pics:
            if self.store is None:
                raise ValueError("an observation holds images but the sampler has no image store")
            r.images += [self.store.put(p) for p in pics]
        return ids, pics

    def _begin(self, r: _Live, obs: Observation, what: str) -> tuple[list[int], list]:
        """A conversation from its first messages: the prompt's tokens and pictures (appended to the record)."""
        r.text, pics = as_text(list(obs.messages), f"episode {r.rollout_id}: {what}")
        r.convo = list(obs.messages)
        if not r.text:
            raise ValueError(f"episode {r.rollout_id}: {what}() gave no messages" +
                             (" for its new branch (restart)" if what == "step" else ""))
        ids, pics = self._ids(self.tok.render(r.text, r.tools, add_generation_prompt=True), pics, r)
        r.tokens += ids
        r.mask += [0] * len(ids)
        r.lps += [0.0] * len(ids)
        return ids, pics

    def opening(self, r: _Live, obs: Observation) -> tuple[list[int], list]:
        r.obs, r.tools = obs, obs.tools
        r.tokens, r.mask, r.lps = [], [], []
        return self._begin(r, obs, "start")

    def branch(self, r: _Live, obs: Observation) -> tuple[list[int], list]:
        """A restart (`Observation.restart`): the record goes on with a new branch, the observation's messages its
        prompt (`messages` of the finished rollout: the last branch's conversation)."""
        r.branches.append(len(r.tokens))
        if obs.tools is not None:
            r.tools = obs.tools
        return self._begin(r, obs, "step")

    def prompt(self, r: _Live) -> list[int]:
        """The tokens of the conversation being sampled: its branch's."""
        return r.tokens[r.branches[-1] if r.branches else 0:]

    def sampled(self, r: _Live, tokens: list[int], logprobs: list[float], reason: str, versions) -> dict:
        r.tokens += tokens
        r.mask += [1] * len(tokens)
        r.lps += logprobs
        r.versions.update(versions)
        r.turns += 1
        r.cut = reason != "stop"
        msg = {"role": "assistant", "content": self.tok.tokenizer.decode(tokens, skip_special_tokens=True)}
        r.text.append(msg)
        r.convo.append(msg)
        return msg

    def following(self, r: _Live, obs: Observation) -> tuple[list[int], list]:
        follow, pics = as_text(list(obs.messages), f"episode {r.rollout_id}: step")
        ids, pics = self._ids(_turn_delta(self.tok, r.text, follow, r.tools), pics, r)
        r.text += follow
        r.convo += list(obs.messages)
        r.tokens += ids
        r.mask += [0] * len(ids)
        r.lps += [0.0] * len(ids)
        return ids, pics

    @staticmethod
    def rollout(r: _Live, version: int, temperature: float | None = None) -> Rollout:
        """The finished rollout (policy `version` when no turn was sampled; the sampling temperature)."""
        obs = r.obs or Observation()
        reward, success = (0.0, False) if r.timed_out else (float(obs.reward), bool(obs.success))
        return Rollout(r.tokens, r.mask, r.lps, reward, r.task.id, r.group_id, sorted(r.versions) or [version],
                       success, list(r.images), r.rollout_id, r.timed_out, temperature,
                       turn_rewards=[] if r.timed_out else list(r.turn_rewards), messages=list(r.convo), tools=r.tools,
                       branches=list(r.branches), info={} if r.timed_out else numbers(obs.info))


class EnvCalls:
    """Runs episode methods off the decode loop: plain ones on worker threads, coroutines on one event-loop thread.
    Each finished call is put on `done` as (token, future).

    `workers` daemon threads (nemo_jax.threads.DaemonPool: they never keep a finished process alive) serve the
    plain calls. A call its episode's time limit abandoned while it still runs (a `start()` that hangs) keeps its
    thread, so `abandon` adds a thread in its place: a hung episode costs one thread, never the pool, up to
    `workers * ABANDONED_PER_WORKER` replacements (each said in one line, the bound too); past the bound, later
    calls wait for a free thread."""

    ABANDONED_PER_WORKER = 4

    def __init__(self, workers: int, name: str = "environment"):
        self.name = name
        self.pool = DaemonPool(workers, "episode")
        self.bound = self.pool.limit * self.ABANDONED_PER_WORKER
        self.done: queue.Queue = queue.Queue()
        self.replaced = 0  # threads added in place of abandoned ones
        self._said_bound = False
        self._loop = None
        self._lock = threading.Lock()
        self.busy_s = 0.0  # seconds spent inside environment calls, summed over calls (the `env_s` metric)

    def _spent(self, t0: float):
        with self._lock:
            self.busy_s += time.perf_counter() - t0

    def loop(self) -> asyncio.AbstractEventLoop:
        with self._lock:
            if self._loop is None:
                self._loop = asyncio.new_event_loop()
                threading.Thread(target=self._loop.run_forever, name="episode-loop", daemon=True).start()
            return self._loop

    def _sync(self, fn, args):
        t0 = time.perf_counter()
        try:
            out = fn(*args)
            if inspect.isawaitable(out):  # a plain function that returned a coroutine
                out = asyncio.run_coroutine_threadsafe(_awaited(out), self.loop()).result()
            return out
        finally:
            self._spent(t0)

    async def _timed(self, coro):
        t0 = time.perf_counter()
        try:
            return await coro
        finally:
            self._spent(t0)

    def call(self, token, fn, *args) -> Future:
        if inspect.iscoroutinefunction(fn):
            fut = asyncio.run_coroutine_threadsafe(self._timed(fn(*args)), self.loop())
        else:
            fut = self.pool.submit(self._sync, fn, args)
        fut.add_done_callback(lambda f: self.done.put((token, f)))
        return fut

    def abandon(self, fut: Future, what: str) -> None:
        """`fut`'s call outlived its episode (timed out): cancelled if it has not started (a coroutine's: on its
        loop), else its thread is left to it and a new one takes its place (up to the bound)."""
        if fut.cancel() or fut.done():
            return
        with self._lock:
            n = None
            if self.replaced < self.bound:
                self.replaced += 1
                n = self.replaced
            said, self._said_bound = self._said_bound, self._said_bound or n is None
        if n is not None:
            self.pool.add_thread()
            print(f"{self.name}: {what} is still running past the episode's time limit (rollout.episode_timeout_s); "
                  f"its worker thread is left to it and a new one takes its place ({n} replaced so far, at most "
                  f"{self.bound})", flush=True)
        elif not said:
            print(f"{self.name}: {self.bound} worker threads were replaced after hung calls (the bound): calls "
                  "that hang from now on hold a worker each, and the others wait for a free one", flush=True)

    def close(self):
        self.pool.shutdown()
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)


async def _awaited(x):
    return await x


class EpisodeDriver:
    """Runs episodes through a sampler: `add` rollouts, call `pump` repeatedly; each call returns the rollouts
    that finished. Environment calls never block decoding; an episode past `timeout_s` (0: none) is scored 0,
    closed, and counted (`counts["timed_out"]`).

    The sampler is a `nemo_jax.generate.Sampler`: the in-process `Engine`, or the rollout worker's `ServerSampler`
    (nemo_jax.rl.transport.worker), which drives an OpenAI-compatible server through the same loop. An environment error ends the driver (`report_failures=False`,
    the in-process producer) or only its episode (`report_failures=True`: closed, nothing returned, and
    (group id, rollout id, reason) appended to `failures` for the caller to report); `fail` ends an episode the
    caller saw fail (e.g. the sampler could not sample its turn) the same way, and `abandon` ends a group's
    episodes without a word (its request was cancelled)."""

    def __init__(self, engine: Sampler, tok, cfg, env, sp: SamplingParams, *, images: ImageStore | None = None,
                 timeout_s: float = 0.0, workers: int = 16, report_failures: bool = False):
        self.engine, self.env, self.sp = engine, as_environment(env), sp
        env = self.env
        self.conv = Conversation(tok, cfg, images)
        self.max_turns = max(1, int(getattr(env, "max_turns", 1)))
        self.timeout_s = float(timeout_s or getattr(env, "timeout_s", 0) or 0)
        self.calls = EnvCalls(workers, f"environment {getattr(env, 'name', type(env).__name__)}")
        self.live: dict[str, _Live] = {}
        self.closing: set = set()  # close() calls not finished yet
        self.report_failures = report_failures
        self.failures: list[tuple[str, str, str]] = []  # (group id, rollout id, reason) not yet taken
        # an environment that scores a group together (`score_group`): a group's finished episodes are held until
        # none of it runs, then scored together, then closed
        self.group_scored = callable(getattr(env, "score_group", None))
        self.held: dict[str, list[_Live]] = {}  # group id -> its finished episodes waiting for the rest
        self.scoring: dict[str, list[_Live]] = {}  # group id -> its episodes in score_group() now
        self.dropped: set = set()  # groups abandoned while in score_group(): their answer is not wanted
        self.counts = {"timed_out": 0, "context_full": 0, "cut": 0, "finished": 0, "failed": 0, "abandoned": 0}

    def add(self, task: Task, group_id: str, rollout_id: str, sp: SamplingParams | None = None) -> None:
        """Start an episode of `task` (its `start` runs on the pool), sampled with `sp` (default: the driver's)."""
        if rollout_id in self.live:
            raise ValueError(f"rollout {rollout_id!r} is already running")
        ep = self.env.episode()
        r = _Live(task, group_id, rollout_id, ep, time.monotonic() + self.timeout_s if self.timeout_s else 0.0, sp=sp)
        self.live[rollout_id] = r
        r.pending, r.pending_what = self.calls.call((r, "start"), ep.start, task, rollout_id), "start"

    @property
    def running(self) -> int:
        """Episodes not yet out: running, or (group-scored environments) waiting for their group's score."""
        return len(self.live) + sum(map(len, self.held.values())) + sum(map(len, self.scoring.values()))

    def fail(self, rollout_id: str, reason: str) -> None:
        """End a running episode as failed: closed, nothing returned, (group, rollout, reason) in `failures`."""
        r = self.live.get(rollout_id)
        if r is not None:
            self._end(r, reason)

    def abandon(self, group_id: str) -> int:
        """End every running episode of a group (closed, nothing returned) -> how many."""
        gone = [r for r in self.live.values() if r.group_id == group_id]
        for r in gone:
            self._stop(r)
            self.counts["abandoned"] += 1
        for r in self.held.pop(group_id, []):
            self._close(r)
            self.counts["abandoned"] += 1
        if group_id in self.scoring:  # (dropped when score_group() answers, then closed)
            self.dropped.add(group_id)
            self.counts["abandoned"] += len(self.scoring[group_id])
        return len(gone)

    # ------------------------------------------------------------------ the loop
    def pump(self, wait_s: float = 0.05) -> list[Rollout]:
        """Handle finished environment calls, time-outs and one engine step (or, with nothing to decode, wait up to
        `wait_s` for the environment) -> the rollouts that finished."""
        out: list[Rollout] = []
        while True:
            try:
                self._handle(*self.calls.done.get_nowait(), out)
            except queue.Empty:
                break
        now = time.monotonic()
        for r in [r for r in self.live.values() if r.deadline and now > r.deadline]:
            r.timed_out = True
            self.counts["timed_out"] += 1
            if r.pending is not None:  # a hung call costs its own thread, not the pool's
                self.calls.abandon(r.pending, f"episode {r.rollout_id}: {r.pending_what}()")
            self._finish(r, out)  # (its pending call: an async one is cancelled, a thread's result ignored)
        if self.engine.busy or self.engine.queued:
            for end in self.engine.step():
                r = end.tag
                if r.ended:  # (ended while its turn was sampled)
                    continue
                msg = self.conv.sampled(r, end.tokens, end.logprobs, end.finish_reason, end.versions)
                r.pending, r.pending_what = self.calls.call((r, "step"), r.episode.step, msg), "step"
        elif self.live or self.closing:
            try:
                self._handle(*self.calls.done.get(timeout=wait_s), out)
            except queue.Empty:
                pass
        return out

    def _handle(self, token, fut: Future, out: list) -> None:
        r, what = token
        if what == "score_group":
            return self._scored(r, fut, out)
        if what == "close":
            self.closing.discard(token)
            if not fut.cancelled() and fut.exception() is not None:
                e = fut.exception()
                msg = f"environment {getattr(self.env, 'name', '?')}: episode {r.rollout_id}: close() failed: {e}"
                if not self.report_failures:
                    raise RuntimeError(msg) from e
                print(msg, flush=True)  # (its rollout is already out: nothing to report it against)
            return
        if r.ended:  # timed out meanwhile: its late result is dropped
            return
        r.pending = None
        e = fut.exception()
        if e is not None:
            err = environment_failed(getattr(self.env, "name", "?"), r.rollout_id, what, e)
            if not self.report_failures:
                raise err from e
            return self._end(r, str(err))
        obs = fut.result()
        if not isinstance(obs, Observation):
            msg = (f"environment {getattr(self.env, 'name', '?')}: {what}() returned {type(obs).__name__}, not an "
                   "Observation")
            if not self.report_failures:
                raise TypeError(msg)
            return self._end(r, msg)
        if what == "start":
            try:
                ids, pics = self.conv.opening(r, obs)
            except ValueError as e:
                if not self.report_failures:
                    raise
                return self._end(r, f"episode {r.rollout_id}: {e}")
            if obs.done:
                return self._finish(r, out)
            r.seq = self.engine.submit(ids, r.sp or self.sp, images=pics, tag=r)
            return
        r.obs = obs
        r.turn_rewards.append(float(obs.reward))
        if obs.done or r.cut or r.turns >= self.max_turns:
            self.counts["cut"] += r.cut and not obs.done
            return self._finish(r, out)
        n_before, n_branches, n_images = len(r.tokens), len(r.branches), len(r.images)
        if obs.restart:  # a new branch: sampled from its own prompt in a sequence of its own
            try:
                ids, pics = self.conv.branch(r, obs)
            except ValueError as e:  # (no messages)
                if not self.report_failures:
                    raise
                return self._end(r, str(e))
            self.engine.release(r.seq)
            r.seq = None
            try:
                r.seq = self.engine.submit(ids, r.sp or self.sp, images=pics, tag=r)
                return
            except ValueError:  # (its prompt does not fit the sampler's positions)
                pass
        else:
            room = self.engine.room(r.seq)
            ids, pics = self.conv.following(r, obs)
            if len(ids) <= room:
                return self.engine.feed(r.seq, ids, images=pics)
        # the conversation outgrew the sampler's positions: it ends here, without what did not fit
        del r.tokens[n_before:], r.mask[n_before:], r.lps[n_before:], r.branches[n_branches:], r.images[n_images:]
        self.counts["context_full"] += 1
        return self._finish(r, out)

    def _stop(self, r: _Live, close: bool = True) -> None:
        """Take a rollout out: its sampler sequence released, its episode closed (on the pool) unless not `close`."""
        r.ended = True
        del self.live[r.rollout_id]
        if r.pending is not None:
            r.pending.cancel()
        if r.seq is not None:
            self.engine.release(r.seq)
        if close:
            self._close(r)

    def _close(self, r: _Live) -> None:
        token = (r, "close")
        self.closing.add(token)
        self.calls.call(token, r.episode.close)

    def _end(self, r: _Live, reason: str) -> None:
        self._stop(r)
        self.counts["failed"] += 1
        self.failures.append((r.group_id, r.rollout_id, reason))
        self._score_group(r.group_id)

    def _finish(self, r: _Live, out: list) -> None:
        hold = self.group_scored and not r.timed_out  # (a timed-out episode scores 0, alone)
        self._stop(r, close=not hold)
        self.counts["finished"] += 1
        if hold:
            self.held.setdefault(r.group_id, []).append(r)
        else:
            out.append(self.conv.rollout(r, self.engine.version, (r.sp or self.sp).temperature))
        self._score_group(r.group_id)

    def _score_group(self, gid: str) -> None:
        """Once no episode of group `gid` runs: its held episodes scored together (`score_group`, on the pool)."""
        if gid not in self.held or any(x.group_id == gid for x in self.live.values()):
            return
        self.scoring[gid] = lives = self.held.pop(gid)
        self.calls.call((gid, "score_group"), self.env.score_group, [x.episode for x in lives])

    def _scored(self, gid: str, fut: Future, out: list) -> None:
        """A group's score came back: each answer's reward, success and info are its rollout's; the episodes
        are closed. A group abandoned meanwhile is dropped."""
        lives = self.scoring.pop(gid, [])
        if gid in self.dropped:
            self.dropped.discard(gid)
            for x in lives:
                self._close(x)
            return
        e = fut.exception() if not fut.cancelled() else None
        answers = fut.result() if e is None and not fut.cancelled() else None
        if e is None and (not isinstance(answers, (list, tuple)) or len(answers) != len(lives)
                          or not all(isinstance(a, Observation) for a in answers)):
            e = TypeError(f"score_group() of {len(lives)} episodes returned {type(answers).__name__}, not "
                          f"{len(lives)} Observations")
        if e is not None:
            err = environment_failed(getattr(self.env, "name", "?"), gid, "score_group", e)
            if not self.report_failures:
                raise err from e
            self.failures += [(x.group_id, x.rollout_id, str(err)) for x in lives]
            self.counts["failed"] += len(lives)
        for x, a in zip(lives, answers if e is None else [None] * len(lives)):
            if a is not None:
                x.obs = replace(x.obs or Observation(), reward=float(a.reward), success=bool(a.success),
                                info={**(x.obs.info if x.obs else {}), **a.info})
                out.append(self.conv.rollout(x, self.engine.version, (x.sp or self.sp).temperature))
            self._close(x)

    def close(self, wait_s: float = 30.0) -> None:
        """End every running episode (closed, nothing returned) and wait up to `wait_s` for the closes."""
        for r in list(self.live.values()):
            self._stop(r)
        for gid in list(self.held):
            for r in self.held.pop(gid):
                self._close(r)
        self.dropped |= set(self.scoring)
        t = time.monotonic() + wait_s
        while (self.closing or self.scoring) and time.monotonic() < t:
            try:
                self._handle(*self.calls.done.get(timeout=0.05), [])
            except queue.Empty:
                pass
        if self.closing:
            ids = sorted(r.rollout_id for r, _ in self.closing)
            print(f"{self.calls.name}: gave up waiting {wait_s:g} s for close() of {len(ids)} episode(s) "
                  f"({', '.join(ids[:5])}{', ...' if len(ids) > 5 else ''}); they are left to finish on their own",
                  flush=True)
        self.calls.close()


def sampling_params(cfg, tok, max_new_tokens: int, temperature: float, top_p: float = 1.0,
                    top_k: int = 0) -> SamplingParams:
    """The in-process sampler's parameters, translated as a rollout request's sampling is (`request_sampling`)."""
    f = Fields({"max_tokens": max_new_tokens, "temperature": temperature, "top_p": top_p, "top_k": top_k},
               lambda message, key: ValueError(message), "rollout.")
    return request_sampling(f, vocab=cfg.vocab_size, stop_ids=stop_ids(cfg, tok))[0][0]


def sample_rollouts(engine: Engine, tok, cfg, env, tasks: list[tuple[Task, str]], group_size: int,
                    max_new_tokens: int, temperature: float, *, images: ImageStore | None = None,
                    timeout_s: float = 0.0, workers: int = 16, top_p: float = 1.0, top_k: int = 0,
                    progress=None, seed: int | None = None) -> list[Rollout]:
    """tasks: (task, group id) pairs -> group_size scored rollouts per task (task-major order), sampled through
    `engine` (continuous batching over its rows; its adapters and version). Pictures go to `images` (default: a
    temporary store, removed afterwards: the rollouts' image records then point nowhere). `progress(n)` is
    called as n more rollouts finish (e.g. a progress bar's update). `seed`: each rollout's draws come from
    (seed, its rollout id) alone, so a rerun samples the same tokens whatever order episodes finish in
    (default: the engine's generator, in submission order)."""
    sp = sampling_params(cfg, tok, max_new_tokens, temperature, top_p, top_k)
    tmp = None
    if images is None and cfg.vision is not None:
        tmp = tempfile.TemporaryDirectory(prefix="nemo_jax_images-")
        images = ImageStore(tmp.name)
    d = EpisodeDriver(engine, tok, cfg, env, sp, images=images, timeout_s=timeout_s, workers=workers)
    got: dict[str, Rollout] = {}
    todo = [(task, gid, f"{gid}/{j}") for task, gid in tasks for j in range(group_size)]
    try:
        for task, gid, rid in todo:
            d.add(task, gid, rid, None if seed is None else replace(sp, seed=zlib.crc32(f"{seed}/{rid}".encode())))
        while d.running:
            done = d.pump()
            for x in done:
                got[x.rollout_id] = x
            if progress is not None and done:
                progress(len(done))
    finally:
        d.close()
        if tmp is not None:
            tmp.cleanup()
    return [got[rid] for _, _, rid in todo]


def _call(fn, *args):
    out = fn(*args)
    return asyncio.run(_awaited(out)) if inspect.isawaitable(out) else out


def sample_rollouts_plain(sample, tok, cfg, env, tasks: list[tuple[Task, str]], group_size: int,
                          max_new_tokens: int, temperature: float, key, version: int = 0) -> list[Rollout]:
    """The plain reference of `sample_rollouts`: episodes called in turn on this thread, each turn one batched
    `sample(prompts, sp, key, images)` -> Generation (e.g. `generate`) over the whole conversations of the rollouts
    still going; a row that stops early waits for the batch."""
    sp = sampling_params(cfg, tok, max_new_tokens, temperature)
    env = as_environment(env)
    conv = Conversation(tok, cfg, None)
    lives, pics = [], {}
    for task, gid in tasks:
        for j in range(group_size):
            r = _Live(task, gid, f"{gid}/{j}", env.episode())
            lives.append(r)
            pics[r.rollout_id] = list(conv.opening(r, _call(r.episode.start, task, r.rollout_id))[1])
    going = [r for r in lives if not r.obs.done]
    for _ in range(max(1, getattr(env, "max_turns", 1))):
        if not going:
            break
        key, sub = jax.random.split(key)
        batch = None if cfg.vision is None else chunk_images(cfg.vision, [
            [p for p in map(_picture(cfg), pics[r.rollout_id])] for r in going])
        g = sample([conv.prompt(r) for r in going], sp, sub, batch)
        nxt = []
        for r, toks, lps, why in zip(going, g.tokens, g.logprobs, g.finish_reason):
            r.obs = _call(r.episode.step, conv.sampled(r, toks, lps, why, [version]))
            r.turn_rewards.append(float(r.obs.reward))
            if not (r.obs.done or r.cut or r.turns >= getattr(env, "max_turns", 1)):
                if r.obs.restart:
                    pics[r.rollout_id] = list(conv.branch(r, r.obs)[1])
                else:
                    pics[r.rollout_id] += conv.following(r, r.obs)[1]
                nxt.append(r)
        going = nxt
    for r in lives:
        _call(r.episode.close)
    return [conv.rollout(r, version, temperature) for r in lives]


def _picture(cfg):
    from nemo_jax.data.images import picture

    return lambda img: picture(cfg.vision, img)


class ThreadProducer:
    """Samples rollouts in a background thread with the newest adapters while the learner trains: keeps
    `in_flight_groups` groups of curriculum-drawn tasks going through one engine (`sampler_rows` decode rows) and
    adds each rollout to the pool as it finishes. The pool and the curriculum are shared under `lock`; adapters
    the learner publishes with `set_policy` are swapped into the engine at its next step."""

    def __init__(self, client, tok, env, pool, curriculum, rcfg, temperature: float, seed: int, lock, *,
                 image_dir: str | None = None, draw_p: dict | None = None):
        self.client, self.tok, self.env, self.pool, self.cur = client, tok, env, pool, curriculum
        self.r, self.temperature, self.lock = rcfg, temperature, lock
        self.by_id = {t.id: t for t in env.tasks("train")}
        self.key, self.seed = jax.random.key(seed), seed
        self.images = ImageStore(image_dir) if image_dir else None
        self.draw_p = draw_p if draw_p is not None else {}  # group id -> the curriculum's probability of its task
        self.mine: set = set()  # ids of the groups this producer opened
        self.driver = None
        self._policy = None
        self.set_policy(client.version, client.adapters)
        self.stop = threading.Event()
        self.error = None
        self.busy_s = 0.0
        self.thread = threading.Thread(target=self._run, name="rollout-producer", daemon=True)

    def set_policy(self, version: int, adapters):
        """Sample with these adapters from now on (copied: the learner's step donates its own buffers)."""
        snap = (version, jax.tree.map(jnp.copy, adapters))
        with self.lock:
            self._policy = snap

    def _ensure_driver(self):
        if self.driver is None:
            r = self.r
            rows = r.sampler_rows or r.groups_per_step * r.group_size
            positions = r.sampler_positions or 2 * (r.seq_len + r.max_new_tokens)
            engine = self.client.engine(batch=rows, max_len=positions, key=self.key)
            sp = sampling_params(self.client.cfg, self.tok, r.max_new_tokens, self.temperature, r.top_p, r.top_k)
            self.driver = EpisodeDriver(engine, self.tok, self.client.cfg, self.env, sp, images=self.images,
                                        timeout_s=r.episode_timeout_s, workers=r.env_workers)
        return self.driver

    def produce_once(self) -> int:
        """Open groups up to the in-flight target, swap in new adapters, one driver step -> rollouts added."""
        d = self._ensure_driver()
        with self.lock:
            policy, self._policy = self._policy, None
            self.mine &= set(self.pool.in_flight) | set(self.pool.ready)  # its groups not trained on yet
            opened = []
            while len(self.mine) < self.r.in_flight_groups:
                (t, p), = self.cur.sample_with_p(1)
                gid = self.pool.open_group(t)
                self.draw_p[gid] = p
                self.mine.add(gid)
                opened.append((self.by_id[t], gid))
        if policy is not None:
            d.engine.set_adapters(policy[1], policy[0])
        for task, gid in opened:  # each rollout's draws from (seed, its id) alone: not from the order rollouts
            for j in range(self.r.group_size):  # reach the sampler (environment threads), so runs can repeat
                rid = f"{gid}/{j}"
                d.add(task, gid, rid, replace(d.sp, seed=zlib.crc32(f"{self.seed}/{rid}".encode())))
        t0 = time.perf_counter()
        rollouts = d.pump()
        self.busy_s += time.perf_counter() - t0
        if rollouts:
            with self.lock:
                for x in rollouts:
                    if self.pool.add(x) not in (None, "unknown_group"):  # a finished group: curriculum statistics
                        self.cur.update(x.task_id, [y.reward for y in self.pool.ready[x.group_id]])
        return len(rollouts)

    def pending(self) -> bool:
        """Whether groups this producer opened are still being sampled (call under `lock`)."""
        return bool(self.mine & set(self.pool.in_flight)) or (self.driver is not None and self.driver.running > 0)

    def _run(self):
        try:
            while not self.stop.is_set():
                self.produce_once()
        except BaseException as e:  # surfaced to the learner by `check`
            self.error = e

    def start(self):
        self.thread.start()

    def check(self):
        if isinstance(self.error, EnvironmentFailed):  # (already names the environment and its author's line)
            raise self.error
        if self.error is not None:
            raise RuntimeError(f"rollout producer failed: {type(self.error).__name__}: {self.error}") from self.error

    def close(self):
        self.stop.set()
        if self.thread.is_alive():
            self.thread.join()
        if self.driver is not None:
            self.driver.close()
