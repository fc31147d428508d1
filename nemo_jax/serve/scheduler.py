"""The engine thread: requests in, continuous batching on one `generate.Engine`, finished samples out.

HTTP handlers `submit` a `Job` (a prompt's n samples, the adapter they use, a callback) from any thread; one
background thread admits jobs into the engine and steps it, and calls each job's callback when its last sample
is done (a list of `Sample`s, or the exception that failed it).

Adapters: the engine holds one adapter set at a time (its rows share one LoRA). Jobs are admitted in arrival
order; a job whose adapter differs from the engine's waits until every sequence of the current adapter has
finished (the rows drain), then the engine switches. A rollout worker uses one adapter at a time, so this costs
nothing there; a server shared by clients of many adapters serves them one adapter after another.
"""

from __future__ import annotations

import threading
import time
import traceback
from collections import Counter, deque
from dataclasses import dataclass, field

import jax
import numpy as np

from nemo_jax.generate import Engine, sampling_logprobs
from nemo_jax.serve.openai import APIError, Prompt, Sample


@dataclass(frozen=True)
class Adapter:
    """LoRA adapters loaded by name: `tree` on the device, `version` unique per load (the engine's version)."""
    name: str
    path: str
    tree: object
    version: int


@dataclass
class Job:
    prompt: Prompt
    adapter: Adapter | None
    callback: object  # (list[Sample] | BaseException) -> None, called from the engine thread
    samples: list = field(default_factory=list)
    left: int = 0
    t0: float = field(default_factory=time.perf_counter)


class Scheduler:
    def __init__(self, engine: Engine, params, cfg, *, bucket: int = 32):
        self.engine, self.params, self.cfg, self.bucket = engine, params, cfg, bucket
        self.metrics = Counter()  # generation_tokens, adapter_switches, engine_errors
        self._pending: deque[Job] = deque()
        self._live: dict[int, tuple[Job, int]] = {}  # engine sequence id -> (job, sample index)
        self._active = 0  # the version of the adapters the engine samples with (0: the base alone)
        self._cv = threading.Condition()
        self._closed = False
        self.error: BaseException | None = None  # the engine thread died of it
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ the handlers' side
    def submit(self, job: Job) -> None:
        job.samples, job.left = [None] * len(job.prompt.samples), len(job.prompt.samples)
        with self._cv:
            if self.error is not None:
                raise APIError(f"the engine failed: {self.error}", status=503)
            self._pending.append(job)
            self._cv.notify_all()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    def counts(self) -> dict:
        """Sequences in decode rows (sampling or about to) and waiting (for a row, or for an adapter switch)."""
        with self._cv:
            waiting = sum(len(j.prompt.samples) for j in self._pending)
        e = self.engine
        return {"running": sum(r is not None for r in e.rows), "waiting": waiting + e.queued,
                "decode_steps": e.decode_steps}

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        self._thread.join()

    # ------------------------------------------------------------------ the engine thread
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
                self.metrics["adapter_switches"] += 1
            self._pending.popleft()
            ids = []
            try:
                for i, sp in enumerate(job.prompt.samples):
                    ids.append(self.engine.submit(job.prompt.tokens, sp, images=job.prompt.images or None,
                                                  tag=i))
            except ValueError as e:
                for sid in ids:
                    self.engine.release(sid)
                job.callback(APIError(str(e)))
                continue
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
        except BaseException as e:  # the thread is dead: every waiting request learns why
            self.error = e
            traceback.print_exc()
        with self._cv:
            jobs = list(self._pending) + list({id(j): j for j, _ in self._live.values()}.values())
            self._pending.clear()
            self._live.clear()
        for job in jobs:
            job.callback(APIError(f"the server is shutting down{f': {self.error}' if self.error else ''}",
                                  status=503))

    def _step(self) -> None:
        ends = self.engine.step()
        for end in ends:
            self.engine.release(end.seq_id)
            job, i = self._live.pop(end.seq_id)
            job.samples[i] = Sample(end.tokens, end.logprobs, end.finish_reason)
            job.left -= 1
            self.metrics["generation_tokens"] += len(end.tokens)
            if job.left:
                continue
            try:
                if job.prompt.top_logprobs:
                    self._score(job)
            except (ValueError, RuntimeError) as e:  # (e.g. an XLA error): this request fails, the server runs on
                job.callback(APIError(f"top_logprobs failed: {e}", status=500))
                continue
            job.callback(job.samples)

    def _score(self, job: Job) -> None:
        """Top-k alternatives of every sampled token: the sequence scored again (one prefill, teacher-forced)
        under the distribution each token was drawn from."""
        from nemo_jax.generate import chunk_images, prefill
        from nemo_jax.lora import attach

        k, p = job.prompt.top_logprobs, attach(self.params, job.adapter.tree if job.adapter is not None else None)
        images = None
        if job.prompt.images:
            from nemo_jax.data.images import picture

            images = chunk_images(self.cfg.vision, [[picture(self.cfg.vision, im) for im in job.prompt.images]])
        for s, sp in zip(job.samples, job.prompt.samples):
            if not s.tokens:
                s.top = []
                continue
            seq = job.prompt.tokens + s.tokens[:-1]
            n = len(s.tokens)
            pos = list(range(len(job.prompt.tokens) - 1, len(seq)))
            pos += [pos[-1]] * ((1 << (n - 1).bit_length()) - n)  # padded to a power of 2: few compiled shapes
            width = -(-len(seq) // self.bucket) * self.bucket
            logits, _ = prefill(p, [seq], self.cfg, width, opts=self.engine.opts, positions=[pos], width=width,
                                images=images)
            x = logits[0, :n]
            lp = (sampling_logprobs(x, sp.temperature, sp.top_k, sp.top_p) if sp.temperature > 0
                  else jax.nn.log_softmax(x.astype(np.float32), axis=-1))
            vals, ids = jax.lax.top_k(lp, min(k, lp.shape[-1]))
            vals, ids = np.asarray(vals), np.asarray(ids)
            s.top = [[(int(a), float(b)) for a, b in zip(ids[i], vals[i])] for i in range(n)]
