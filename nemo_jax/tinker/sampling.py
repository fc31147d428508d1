"""Sampling for the Tinker API: sampling sessions (a model's snapshot, saved sampler weights, or the base) and
`asample`, through serve's continuous-batching `Scheduler` (the engine holds one adapter set at a time and switches
between them), with prompt logprobs through the learner when asked. The SDK's sampling parameters become nemo_jax's
as every server's requests do (`nemo_jax.generate.sampling.request_sampling`)."""

from __future__ import annotations

import base64
import threading
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from nemo_jax.fields import Fields
from nemo_jax.generate.sampling import request_sampling
from nemo_jax.serve.openai import Prompt
from nemo_jax.serve.scheduler import Adapter, Job
from nemo_jax.tinker import wire
from nemo_jax.tinker.registry import MAX_SNAPSHOTS, SamplingSession
from nemo_jax.tinker.sequencer import Item, Kind
from nemo_jax.tinker.store import parse_path
from nemo_jax.tinker.wire import UserError

MAX_SAMPLES = 128  # num_samples of one request


def flatten(cfg, chunks: list, what: str) -> tuple[np.ndarray, list]:
    """Chunks -> (token ids, pictures [(PIL image, (patches, grid))]): an image chunk becomes the vision model's
    placeholder tokens, as many as its processor makes of the image alone (the client's expected_tokens must
    agree); token ids are checked against the vocabulary."""
    toks, pics = [], []
    V, v = cfg.vocab_size, cfg.vision
    for j, c in enumerate(chunks):
        if isinstance(c, wire.Image):
            if v is None:
                raise UserError(f"{what}: chunk {j} is an image, but this model has no vision tower")
            from nemo_jax.data.images import ImageError, load_image, picture

            if c.format not in ("png", "jpeg"):
                raise UserError(f"{what}: chunk {j}: image format {c.format[:20]!r} (png or jpeg)")
            try:
                img = load_image(f"data:image/{c.format};base64," + base64.b64encode(c.data).decode())
                pix, grid = picture(v, img)
            except (ImageError, ValueError, OSError) as e:
                raise UserError(f"{what}: chunk {j}: not a readable image ({e})"[:400]) from None
            n = grid[0] * grid[1] // v.merge ** 2
            if c.expected_tokens is not None and c.expected_tokens != n:
                raise UserError(f"{what}: chunk {j}: the image makes {n} tokens here, not expected_tokens="
                                f"{c.expected_tokens}")
            toks.append(np.full(n, v.image_token_id, np.int64))
            pics.append((img, (pix, grid)))
        else:
            bad = np.flatnonzero((c < 0) | (c >= V))
            if len(bad):
                raise UserError(f"{what}: chunk {j}: token id {c[bad[0]]} is outside the vocabulary [0, {V})")
            if v is not None and np.any(c == v.image_token_id):
                raise UserError(f"{what}: chunk {j}: token id {v.image_token_id} is the image placeholder: send "
                                "pictures as image chunks")
            toks.append(c)
    return (np.concatenate(toks) if toks else np.zeros(0, np.int64)), pics


def _user_error(message: str, key: str) -> UserError:
    return UserError(message)


class Sampling:
    """`state`: serve's ServerState (its scheduler, adapter versions, stop ids, max_len); `learner` computes prompt
    logprobs; `store` reads saved sampler weights."""

    def __init__(self, state, registry, sequencer, futures, store, learner):
        self.s, self.registry, self.sequencer, self.futures = state, registry, sequencer, futures
        self.store, self.learner, self.cfg = store, learner, state.cfg
        self._loaded: dict[str, tuple] = {}  # tinker path -> (Adapter, base model) of sessions made from it
        self._lock = threading.Lock()

    def adapter(self, name: str, tree) -> Adapter:
        """Adapters to sample with, under a version of serve's (the scheduler tells adapter sets apart by it)."""
        return self.s.adapters.make(name, name, tree)

    def forget_path(self, path: str) -> None:
        """Saved weights at `path` changed or went: a session made from it later reads it anew."""
        with self._lock:
            self._loaded.pop(path, None)

    def create_session(self, body: dict) -> dict:
        s = self.registry.session(body.get("session_id"))
        seq = body.get("sampling_session_seq_id")
        if not isinstance(seq, int) or isinstance(seq, bool) or seq < 0:
            raise UserError("sampling_session_seq_id must be a non-negative integer")
        path, base = body.get("model_path"), body.get("base_model")
        sid = f"{s.id}:sample:{seq}"
        with self.registry.lock:
            if sid in self.registry.samplers:
                return {"type": "create_sampling_session", "sampling_session_id": sid}
        if path is not None:
            parse_path(path)
            with self._lock:
                got = self._loaded.get(path)
            if got is None:
                _, adapters, _, meta = self.store.load(path, self.cfg, optimizer=False)
                got = (self.adapter(path, jax.tree.map(jnp.asarray, adapters)),
                       meta.get("base_model") or self.s.model_name)
                with self._lock:
                    self._loaded[path] = got
                    while len(self._loaded) > 4 * MAX_SNAPSHOTS:
                        self._loaded.pop(next(iter(self._loaded)))
            sampler = SamplingSession(sid, base or got[1], path, got[0])
        else:
            sampler = SamplingSession(sid, self.registry.check_base(base), None, None)
        self.registry.add_sampler(sampler, owner=s)
        return {"type": "create_sampling_session", "sampling_session_id": sid}

    def sampling_params(self, p: dict, prompt_len: int, n: int, topk: int = 0):
        """The SDK's SamplingParams -> (nemo_jax SamplingParams of each of the n samples, stop strings)."""
        room = self.s.max_len - -(-prompt_len // self.s.bucket) * self.s.bucket
        if room < 1:
            raise UserError(f"the prompt has {prompt_len} tokens: no room to sample within --max-model-len "
                            f"{self.s.max_len}")
        f = Fields(p, _user_error, "sampling_params.")
        return request_sampling(f, vocab=self.cfg.vocab_size, stop_ids=self.s.prompts.stop_ids,
                                context=(self.s.max_len, prompt_len), room=room, n=n, top_logprobs=topk,
                                ids_in_stop=True)

    def sample(self, body: dict) -> dict:
        """asample: the prompt's samples through serve's scheduler (and, asked, its logprobs through the learner)
        -> {request_id, sample_sequence_ids}. The scheduler's APIError (429 when full) is raised as it is."""
        sp = self.registry.sampler(body.get("sampling_session_id"))
        for key, why in (("topk_prompt_logprobs", "top-k prompt logprobs"),
                         ("prompt_alt_tokens_k", "prompt alternative tokens")):
            if body.get(key):
                raise UserError(f"{key}: {why} are not supported by nemo-jax serve")
        if body.get("target_prompt_logprobs") is not None:
            raise UserError("target_prompt_logprobs is not supported by nemo-jax serve (use prompt_logprobs)")
        tokens, pics = flatten(self.cfg, wire.model_input(body.get("prompt")), "prompt")
        if not len(tokens):
            raise UserError("the prompt is empty")
        f = Fields(body, _user_error)
        n = f.integer("num_samples", 1, 1, MAX_SAMPLES)
        topk = f.integer("topk_sample_logprobs", 0, 0, 20)
        samples, stops = self.sampling_params(body.get("sampling_params") or {}, len(tokens), n, topk)
        want_lp = bool(body.get("prompt_logprobs"))
        last_n = f.integer("prompt_logprobs_last_n", None, 1, len(tokens) - 1) if len(tokens) > 1 else None
        if last_n is None and body.get("prompt_logprobs_last_n") is not None:
            raise UserError("prompt_logprobs_last_n needs a prompt of at least 2 tokens")
        rec = self.futures.create("sample")
        parts: dict = {}
        lock = threading.Lock()

        def finish(key, value):  # (the engine thread, the worker): the response once every part is in
            with lock:
                parts[key] = value
                if len(parts) < (2 if want_lp else 1):
                    return
            got, plp = parts["samples"], parts.get("prompt")
            if isinstance(got, BaseException):
                code = getattr(got, "status", 500)
                self.futures.fail(rec.id, str(got), "user" if 400 <= code < 500 else "server")
            elif isinstance(plp, BaseException):
                self.futures.fail(rec.id, f"prompt logprobs: {type(plp).__name__}: {plp}", "server")
            else:
                if plp is not None and last_n is not None:
                    plp = np.where(np.arange(len(plp)) < len(plp) - last_n, np.nan, plp)
                seqs = [wire.Sequence(x.tokens, x.logprobs, x.finish_reason == "stop", x.top) for x in got]
                self.futures.complete(rec.id, wire.encode_sample_response(seqs, plp, topk))

        job = Job(Prompt([int(t) for t in tokens], [img for img, _ in pics], samples, stops), sp.adapter,
                  lambda r: finish("samples", r))
        try:
            self.s.scheduler.submit(job)
        except BaseException as e:
            self.futures.fail(rec.id, str(e), "user")
            raise
        if want_lp:
            self.sequencer.enqueue(Item(Kind.PROMPT_LOGPROBS, None, args=dict(
                adapter=sp.adapter, tokens=tokens, pics=[p for _, p in pics], done=lambda x: finish("prompt", x))))
        return {"request_id": rec.id, "sample_sequence_ids": [f"{rec.id}:{i}" for i in range(n)]}

    def prompt_logprobs(self, items: list[Item]) -> None:
        """The worker's handler of Kind.PROMPT_LOGPROBS: answered through the sample's future."""
        it = items[0]
        try:
            ad = it.args["adapter"]
            it.args["done"](self.learner.prompt_logprobs(None if ad is None else ad.tree, it.args["tokens"],
                                                         it.args["pics"]))
        except Exception as e:  # a server fault in the learner: the sample's future fails with it, the worker goes on
            traceback.print_exc()
            it.args["done"](e)
