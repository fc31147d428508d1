"""The engine thread: requests in, continuous batching on one `generate.Engine`, finished samples out.

HTTP handlers `submit` a `Job` (a prompt's n samples, the adapter they use, callbacks) from any thread; one
background thread admits jobs into the engine and steps it. After every step it hands each streaming job the
tokens its samples drew (`Job.progress`), and calls `Job.callback` once when the job's last sample is done (a list
of `Sample`s, or the APIError that failed it). `cancel` (a client that went away, a timeout) frees the job's rows
at once.

Bounded: at most `max_waiting` sequences wait beyond the engine's rows; a job that does not fit is refused with a
429 and a `Retry-After` (never an unbounded backlog). One request's bad input fails that request alone (400); an
exception out of the engine's step leaves the engine in an unknown state: every job fails with a 503, `alive`
turns False and `on_fatal` is called (the server exits so that a supervisor restarts it).

Adapters: the engine holds one adapter set at a time (its rows share one LoRA). Jobs are admitted in arrival
order; a job whose adapter differs from the engine's waits until every sequence of the current adapter has
finished (the rows drain), then the engine switches. A rollout worker uses one adapter at a time, so this costs
nothing there; a server shared by clients of many adapters serves them one adapter after another.
"""

from __future__ import annotations

import math
import threading
import time
import traceback
from collections import deque
from dataclasses import dataclass, field

from nemo_jax.generate import Engine
from nemo_jax.serve.metrics import Metrics
from nemo_jax.serve.openai import APIError, Prompt, Sample


@dataclass(frozen=True)
class Adapter:
    """LoRA adapters loaded by name: `tree` on the device, `version` unique per load (the engine's version)."""
    name: str
    path: str
    tree: object
    version: int


@dataclass(eq=False)
class Job:
    prompt: Prompt
    adapter: Adapter | None
    callback: object  # (list[Sample] | APIError) -> None, called once, from the engine thread (or `cancel`'s)
    progress: object = None  # (sample index, new tokens, their logprobs, their top alternatives | None) -> None
    samples: list = field(default_factory=list)
    left: int = 0
    sent: list = field(default_factory=list)  # tokens handed to `progress`, per sample
    t0: float = field(default_factory=time.monotonic)
    first: float | None = None  # when its first token came
    done: bool = False  # called back (or cancelled): nothing more happens to it

    @property
    def n(self) -> int:
        return len(self.prompt.samples)


class Scheduler:
    def __init__(self, engine: Engine, *, max_waiting: int = 256, metrics: Metrics | None = None, on_fatal=None):
        self.engine, self.max_waiting = engine, max_waiting
        self.metrics = metrics or Metrics()
        self.on_fatal = on_fatal  # (exception) -> None, from the engine thread, once
        self._pending: deque[Job] = deque()
        self._live: dict[int, tuple[Job, int]] = {}  # engine sequence id -> (job, sample index)
        self._active = 0  # the version of the adapters the engine samples with (0: the base alone)
        self._cv = threading.Condition()
        self._closed = False
        self.draining = False  # shutting down: new jobs are refused (503)
        self.error: BaseException | None = None  # the engine thread died of it
        self._latency = 10.0  # seconds per sequence, a moving average (Retry-After)
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ the handlers' side
    def submit(self, *jobs: Job) -> None:
        """Queue jobs (a request's prompts), all or none: APIError 429 (with Retry-After) when they do not fit
        the rows and the waiting queue, 503 while shutting down or after the engine failed."""
        for job in jobs:
            job.samples, job.left, job.sent = [None] * job.n, job.n, [0] * job.n
        n = sum(job.n for job in jobs)
        with self._cv:
            if self.error is not None:
                self.metrics.events["rejected/engine_dead"] += 1
                raise APIError(f"the engine failed: {self.error}", status=503)
            if self.draining or self._closed:
                self.metrics.events["rejected/draining"] += 1
                raise APIError("the server is shutting down", status=503, headers={"Retry-After": "5"})
            cap = self.engine.batch + self.max_waiting
            if n > cap:
                raise APIError(f"{n} samples are more than the server holds at once ({self.engine.batch} rows + "
                               f"{self.max_waiting} waiting)", param="n")
            inside = sum(j.n for j in self._pending) + len(self._live)  # (_live: in the engine, in a row or queued)
            if inside + n > cap:
                self.metrics.events["rejected/queue_full"] += 1
                waiting = max(inside - self.engine.batch, 0) + n
                after = max(1, min(60, math.ceil(waiting * self._latency / self.engine.batch)))
                raise APIError(f"the server is at capacity ({self.engine.batch} sequences running and "
                               f"{self.max_waiting} waiting, --max-waiting-queue-length): retry after {after} s",
                               status=429, headers={"Retry-After": str(after)})
            self._pending.extend(jobs)
            self._cv.notify_all()

    def cancel(self, job: Job) -> bool:
        """Forget a job (its client went away, or it timed out): out of the queue, its rows freed now. -> whether it
        was still running (no callback comes after this)."""
        with self._cv:
            if job.done:
                return False
            job.done = True
            if job in self._pending:
                self._pending.remove(job)
            for sid in [sid for sid, (j, _) in self._live.items() if j is job]:
                del self._live[sid]
                self.engine.release(sid)  # (thread-safe: the row stops at once, its slot takes the next sequence)
            self._cv.notify_all()
        return True

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    def _waiting_locked(self) -> int:
        return sum(j.n for j in self._pending) + self.engine.queued

    def counts(self) -> dict:
        """Sequences in decode rows (sampling or about to) and waiting (for a row, or for an adapter switch)."""
        with self._cv:
            return {"running": sum(r is not None for r in self.engine.rows), "waiting": self._waiting_locked()}

    def close(self) -> None:
        """Stop the engine thread; jobs still waiting or running fail with a 503."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        self._thread.join()

    # ------------------------------------------------------------------ the engine thread
    def _finish(self, job: Job, result) -> None:
        """Call a job back once (under the lock)."""
        if job.done:
            return
        job.done = True
        if not isinstance(result, BaseException):
            now = time.monotonic()
            self._latency = 0.9 * self._latency + 0.1 * (now - job.t0)
            self.metrics.hist["e2e_request_latency_seconds"].observe(now - job.t0)
            out = sum(len(s.tokens) for s in result)
            if job.first is not None and out > job.n:
                self.metrics.hist["time_per_output_token_seconds"].observe((now - job.first) / (out - job.n) * job.n)
        job.callback(result)

    def _admit(self) -> None:
        """Jobs into the engine in arrival order; a job with other adapters waits for the rows to drain."""
        while self._pending:
            job = self._pending[0]
            version = job.adapter.version if job.adapter is not None else 0
            if version != self._active:
                if self._live:
                    return
                self.engine.set_adapters(job.adapter.tree if job.adapter is not None else None, version)
                self._active = version
                self.metrics.events["adapter_switches"] += 1
            self._pending.popleft()
            ids = []
            try:
                for i, sp in enumerate(job.prompt.samples):
                    ids.append(self.engine.submit(job.prompt.tokens, sp, images=job.prompt.images or None, tag=i))
            except (ValueError, TypeError, OverflowError) as e:  # this request's input: it fails alone
                for sid in ids:
                    self.engine.release(sid)
                self._finish(job, APIError(str(e)))
                continue
            self.metrics.tokens["prompt"] += len(job.prompt.tokens) * job.n
            for i, sid in enumerate(ids):
                self._live[sid] = (job, i)

    def _run(self) -> None:
        try:
            while True:
                with self._cv:
                    while not self._closed and not self._pending and not self._live:
                        self._cv.wait()
                    if self._closed:
                        break
                    self._admit()
                self._step()
        except BaseException as e:  # the engine's state is unknown: every request fails, the server must restart
            self.error = e
            traceback.print_exc()
        with self._cv:
            jobs = list(self._pending) + list({id(j): j for j, _ in self._live.values()}.values())
            self._pending.clear()
            self._live.clear()
            why = f"the engine failed: {type(self.error).__name__}: {self.error}" if self.error else \
                "the server is shutting down"
            for job in jobs:
                self._finish(job, APIError(why, status=503))
        if self.error is not None and self.on_fatal is not None:
            self.on_fatal(self.error)

    def _step(self) -> None:
        t0, steps0, sampled0 = time.monotonic(), self.engine.decode_steps, self.engine.tokens_sampled
        ends = self.engine.step()
        now = time.monotonic()
        self.metrics.events["decode_steps"] += self.engine.decode_steps - steps0
        with self._cv:
            for sid in self.engine.progress:  # tokens drawn this step, to streaming jobs; first-token times
                got = self._live.get(sid)
                if got is None:
                    continue
                job, i = got
                if job.first is None:
                    job.first = now
                    self.metrics.hist["time_to_first_token_seconds"].observe(now - job.t0)
                    self.metrics.hist["queue_time_seconds"].observe(max(t0 - job.t0, 0.0))
                if job.progress is not None:
                    toks, lps, top = self.engine.turn_so_far(sid)
                    k = job.sent[i]
                    if len(toks) > k:
                        job.sent[i] = len(toks)
                        job.progress(i, toks[k:], lps[k:], top[k:] if top is not None else None)
            for end in ends:
                self.engine.release(end.seq_id)
                got = self._live.pop(end.seq_id, None)
                if got is None:  # (cancelled meanwhile)
                    continue
                job, i = got
                job.samples[i] = Sample(end.tokens, end.logprobs, end.finish_reason, end.top, end.stop)
                job.left -= 1
                if not job.left:
                    self._finish(job, job.samples)
        sampled = self.engine.tokens_sampled - sampled0
        self.metrics.tokens["generation"] += sampled
        self.metrics.rate.add(sampled, now)
