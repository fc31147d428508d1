"""Continuous batching: the `Engine` serves many sequences through a fixed number of decode rows. A row whose
turn ends either continues in place (the caller's next turn fed to it) or is emptied and refilled with the next
sequence, prefilled into that row while the other rows keep decoding; per-row sampling parameters, seeds,
pictures and adapters. `continuous_generate` drives one over an iterable of prompts.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import numpy as np

from nemo_jax.lora import attach
from nemo_jax.model import model as M
from nemo_jax.model.cache import (init_decode_state, unstack_state)
from nemo_jax.model.vision import check_images
from nemo_jax.parallel.mesh import fetch
from nemo_jax.generate.decode import _append, _committed, _keep_sharded, _mesh_of, _rows_on, _whole_on
from nemo_jax.generate.sampler import TurnEnd
from nemo_jax.generate.sampling import _pow2, MAX_STOP_BYTES, MIN_WIDTHS, RowSampling, sample_step, SamplingParams, token_table, TOP_LOGPROBS


@dataclass
class _Sequence:
    id: int
    sp: SamplingParams
    tag: object
    key: np.ndarray  # its own PRNG key data: token n of the sequence is drawn with fold_in(key, n)
    held: list[int] = field(default_factory=list)  # tokens its row's state holds
    pics: list = field(default_factory=list)  # (pixels, grid) of every picture in `held`, in order
    new: list[int] | None = None  # tokens to append before it samples (the prompt, or a fed continuation)
    new_pics: list = field(default_factory=list)
    row: int | None = None
    sampled: int = 0  # tokens drawn so far (every turn)
    turn_t: list[int] = field(default_factory=list)
    turn_l: list[float] = field(default_factory=list)
    turn_v: set = field(default_factory=set)  # policy versions of this turn: the prefill's (first token) and each decode step's
    turn_top: list = field(default_factory=list)
    turn_stop: bool = False  # the turn ended at a stop token or stop string


def chunk_rows(n: int, batch: int) -> int:
    """The rows an Engine prefill chunk of n sequences runs: the next power of 4 (at most `batch`). Few row counts,
    so few compiled prefills; a chunk is `bucket` tokens wide, so its padding rows cost little."""
    k = 1
    while k < n:
        k *= 4
    return min(k, batch)


def chunk_images(v, rows_pics: list[list]) -> dict | None:
    """The pictures [(pixels [n, C*p*p], (h, w)), ...] of each row of a chunk -> its per-row image batch (patch and
    image budgets rounded up to powers of two: few compiled shapes), or None when no row has any."""
    if not any(rows_pics):
        return None
    from nemo_jax.data.images import RowImages

    patches = max(sum(len(p) for p, _ in r) for r in rows_pics)
    ri = RowImages(v, _pow2(max(patches, v.merge ** 2)), _pow2(max(len(r) for r in rows_pics)))
    rows = [ri.row([(np.concatenate([p for p, _ in r]) if r else np.zeros((0, v.patch_dim), np.float32),
                     [g for _, g in r])]) for r in rows_pics]
    return {k: np.stack([x[k] for x in rows]) for k in rows[0]}


def _decode_one(params, logits, state, done, budget, rows, hist, tables, cfg, opts, how, mesh=None):
    """One step over every row with per-row sampling parameters `rows` (temperature, top_k, top_p [b], stops [b, S]
    (-1 pads), key [b, 2] key data, count [b] tokens the row's sequence has drawn, and what `how` asks for: see
    `sample_step`): sample, append for the rows still going; a row is done after a stop token or stop string, or
    when its budget of new tokens is spent.
    -> (token, logprob, active, stopped [b], logits, state, done, budget, count, hist, top or None)."""
    active = ~done
    u = jax.vmap(lambda k, n: jax.random.uniform(jax.random.fold_in(jax.random.wrap_key_data(k), n), (),
                                                 jnp.float32))(rows["key"], rows["count"])
    tok, lp, hit, hist, top = sample_step(logits, u, rows, hist, tables, active, how)
    stop = jnp.any(tok[:, None] == rows["stops"], axis=1) | hit
    new_logits, state = M.forward_cached(params, tok[:, None], active[:, None], state, cfg, opts=opts,
                                         positions="last")
    budget = budget - active.astype(budget.dtype)
    count = rows["count"] + active.astype(jnp.int32)
    return (tok, lp, active, stop & active, new_logits[:, 0], _keep_sharded(state, cfg, mesh), done | stop | (budget <= 0),
            budget, count, hist, top)


# the reference: one decode step per dispatch (the Engine's `fused=False`)
_decode_rows = jax.jit(_decode_one, static_argnames=("cfg", "opts", "how", "mesh"), donate_argnames=("state", "hist"))


@functools.partial(jax.jit, static_argnames=("cfg", "opts", "how", "mesh", "steps"), donate_argnames=("state", "hist"))
def _decode_steps(params, logits, state, done, budget, rows, hist, tables, cfg, opts, how, mesh=None, steps=1):
    """Up to `steps` steps of `_decode_one` in one dispatch (a device loop; stops, budgets and the rows' counts
    stay on the device), ending early once every row is done. -> (stacked per step: token, logprob, active,
    stopped [steps, b] and top (ids, logprobs) [steps, b, top_n] or None; steps past the end are inactive;
    logits, state, done, budget, count, hist as after the last step)."""
    b = done.shape[0]
    outs = (jnp.zeros((steps, b), jnp.int32), jnp.zeros((steps, b), jnp.float32), jnp.zeros((steps, b), bool),
            jnp.zeros((steps, b), bool))
    if how.top_n:
        outs += (jnp.zeros((steps, b, how.top_n), jnp.int32), jnp.zeros((steps, b, how.top_n), jnp.float32))

    def step(i, c):
        logits, state, done, budget, count, hist, outs = c
        tok, lp, act, hit, logits, state, done, budget, count, hist, top = _decode_one(
            params, logits, state, done, budget, dict(rows, count=count), hist, tables, cfg, opts, how, mesh)
        outs = tuple(o.at[i].set(x) for o, x in zip(outs, (tok, lp, act, hit) + (tuple(top) if top else ())))
        return logits, state, done, budget, count, hist, outs

    def body(c):
        i, *rest = c
        return (i + 1,) + step(i, rest)

    c = (jnp.zeros((), jnp.int32), logits, state, done, budget, rows["count"], hist, outs)
    _, logits, state, done, budget, count, hist, outs = jax.lax.while_loop(
        lambda c: (c[0] < steps) & jnp.any(~c[3]), body, c)
    top = (outs[4], outs[5]) if how.top_n else None
    return outs[:4] + (top,), logits, state, done, budget, count, hist


def decode_program(params, cfg, *, rows: int, max_len: int, steps: int, opts: M.Options = M.Options(),
                   place=lambda tree: tree):
    """The Engine's decode dispatch as it runs in a server or sampler: `steps` decode steps in one program
    (`_decode_steps`, plain sampling) over `rows` rows of `max_len` positions, the layers' weights and the state held
    one layer at a time, lowered for abstract inputs: `params` a tree of arrays or ShapeDtypeStructs (stacked, as
    `init` makes them; cast them first for another dtype), `place` puts each abstract input where it runs (e.g. onto
    a deviceless target's device). Nothing is allocated. -> (the lowered program, {"params": bytes of the
    weights, "state": bytes of the decode state}) for plans and device benches (compiled memory, traffic per step)."""
    sds = lambda t: jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), t)  # noqa: E731
    p = place(sds(jax.eval_shape(M.unstack_layers, sds(params))))
    state = place(sds(jax.eval_shape(lambda: unstack_state(init_decode_state(cfg, rows, max_len, opts.dtype)))))
    f32, i32, SD = jnp.float32, jnp.int32, jax.ShapeDtypeStruct
    rowp = place({"temperature": SD((rows,), f32), "top_k": SD((rows,), i32), "top_p": SD((rows,), f32),
                  "stops": SD((rows, MIN_WIDTHS["stops"]), i32), "key": SD((rows, 2), jnp.uint32),
                  "count": SD((rows,), i32)})
    logits, done, budget = place((SD((rows, cfg.vocab_size), f32), SD((rows,), bool), SD((rows,), i32)))
    lowered = _decode_steps.lower(p, logits, state, done, budget, rowp, {}, {}, cfg, opts, RowSampling(), None, steps)
    size = lambda t: sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(t))  # noqa: E731
    return lowered, {"params": size(p), "state": size(state)}


@functools.partial(jax.jit, donate_argnames=("hist",))
def _reset_hist(hist, reset, prompt):
    """Rows `reset` [b] start a turn: no tokens sampled (`counts`), their prompt `prompt` [b, P] (ids >= V pad) is
    `seen`, no text (`tail`)."""
    out = dict(hist)
    if "counts" in hist:
        b, V = hist["counts"].shape
        out["counts"] = jnp.where(reset[:, None], 0, hist["counts"])
        seen = hist["seen"] & ~reset[:, None]
        out["seen"] = seen.at[jnp.arange(b)[:, None], jnp.where(reset[:, None], prompt, V)].set(True, mode="drop")
    if "tail" in hist:
        out["tail"] = jnp.where(reset[:, None], -1, hist["tail"])
    return out


@functools.partial(jax.jit, static_argnames=("cfg", "mesh"), donate_argnames=("state",))
def _empty_rows(state, rows, cfg, mesh=None):
    """Forget rows [b] (bool) of a state: zero Mamba conv/SSM state, no valid KV slot, position 0 (a new
    sequence starts there)."""
    ax = state.row_axis
    mask = lambda x: x * (~rows).reshape((1,) * ax + (-1,) + (1,) * (x.ndim - ax - 1)).astype(x.dtype)  # noqa: E731
    mamba = None if state.mamba is None else jax.tree.map(mask, state.mamba)
    return _keep_sharded(state._replace(mamba=mamba, valid=state.valid & ~rows[:, None],
                                        pos=jnp.where(rows, 0, state.pos)), cfg, mesh)


@functools.partial(jax.jit, static_argnames=("cfg", "opts", "mesh"), donate_argnames=("state",))
def _append_rows(params, tokens, valid, state, rows, cfg, opts, mesh=None, images=None):
    """Append a chunk [k, n] (with its per-row `images`, or None) to rows `rows` [k] of a [b]-row state only: their
    state is gathered, run and scattered back, so refilling one row costs one row's prefill, not the batch's.
    -> (logits [k, V], state)."""
    # Mamba conv/SSM and KV leaves hold rows on axis 1 ([layers, b, ...]; held per layer: axis 0), `valid` on 0
    ax = state.row_axis
    take = lambda x: jnp.take(x, rows, axis=ax)  # noqa: E731
    sub = state._replace(mamba=jax.tree.map(take, state.mamba), kv=jax.tree.map(take, state.kv),
                         valid=jnp.take(state.valid, rows, axis=0), pos=jnp.take(state.pos, rows))
    logits, sub = M.forward_cached(params, tokens, valid, sub, cfg, opts=opts, positions="last", images=images)
    put = lambda x, y: x.at[(slice(None),) * ax + (rows,)].set(y)  # noqa: E731
    state = state._replace(mamba=jax.tree.map(put, state.mamba, sub.mamba), kv=jax.tree.map(put, state.kv, sub.kv),
                           valid=state.valid.at[rows].set(sub.valid), pos=state.pos.at[rows].set(sub.pos))
    return logits[:, 0], _keep_sharded(state, cfg, mesh)


_unstack = jax.jit(M.unstack_layers)  # (one compiled program per tree structure, not one per layer and leaf)


def _unstacked(adapters):
    """An adapter tree with its layers held one by one, as the Engine holds the params (`unstack_layers`)."""
    return _unstack(adapters) if adapters and "layers" in adapters else adapters


@jax.jit
def _set_rows(logits, rows, sub):
    """logits [b, V] with rows `rows` [k] set to sub [k, V]."""
    return logits.at[rows].set(sub)


def _left_pad_host(rows: list[list[int]], n: int) -> tuple[np.ndarray, np.ndarray]:
    """`left_pad` on the host (numpy: slicing its pieces compiles nothing)."""
    toks, valid = np.zeros((len(rows), n), np.int32), np.zeros((len(rows), n), bool)
    for i, r in enumerate(rows):
        if r:
            toks[i, n - len(r):], valid[i, n - len(r):] = r, True
    return toks, valid


@jax.jit
def _merge_fed(fed, new_logits, logits, done, budget, max_new, stopped):
    """Rows `fed` just had tokens appended: their logits are the new ones, they decode again with a budget of
    `max_new` [b]; rows `stopped` (released mid-turn) decode nothing."""
    return (jnp.where(fed[:, None], new_logits, logits), (done & ~fed) | stopped,
            jnp.where(fed, max_new, budget).astype(budget.dtype))


class Engine:
    """Continuous batching: `batch` decode rows serve any number of sequences, each with its own sampling
    parameters (temperature, top-k, top-p, max_new_tokens, stop ids, seed), pictures and turns.

        eng = Engine(params, cfg, batch=8, max_len=1024)
        sid = eng.submit(prompt_ids, SamplingParams(max_new_tokens=64, stop_token_ids=(eos,)))
        while ...:
            for end in eng.step():              # TurnEnd: tokens, logprobs, finish_reason, version, tag
                eng.feed(end.seq_id, more_ids)  # or eng.release(end.seq_id)

    A submitted sequence waits in a queue for a free row, is prefilled into it (the other rows keep their state)
    and samples a turn: up to `sp.max_new_tokens` tokens or a stop token. Then it is PARKED: it keeps its row
    and decode state and samples nothing until the caller `feed`s it (tool results, the next user turn: they
    are appended and it samples another turn) or `release`s it (its row takes the next queued sequence).
    Parked rows never hold the others up: `step` decodes the rows that have a turn to sample.

    Each row holds `max_len` positions (the KV cache per row). Chunks fed together are left-padded to a
    multiple of `bucket` and prefilled `bucket` tokens at a time, in chunks of 1, 4, 16, ... rows (`chunk_rows`:
    few compiled shapes, whatever the prompts); a continuation that does not fit its row's remaining positions
    is prefilled afresh with the whole conversation. `step` runs `check_every` decode steps in one dispatch (a
    device loop checking stops and budgets, ending once every row is done; `fused=False`: a dispatch per step,
    the reference), then looks at which rows finished (a finished row idles at most that long). The layers'
    weights and the decode state are held one layer at a time (a copy of the weights at start): each step reads
    and updates every layer's buffers in place. Tokens and logprobs are exactly those
    `generate` gives the same sequence alone (up to the random draws: a sequence's draws depend on its own
    seed and position only, never on the batch around it).

    Pictures: `images` (PIL images, paths or data URLs, in the order of their placeholders) go with the tokens
    that hold their widened image tokens (`widen_images`); the prefill runs the vision tower. `submit`, `feed`
    and `release` may be called from other threads than the one calling `step`.

    In the decode step itself, per row (`sample_step`; rows asking for none sample as before, in the same compiled
    step): presence / frequency / repetition penalties, `logit_bias`, `min_tokens`, the `top_logprobs` most likely
    tokens of every step, and stop strings matched on the text's bytes across token boundaries (the turn ends at
    the token completing one; `token_bytes`: each token id's text as bytes, needed for stop strings). The penalties'
    prompt is what the row held before the turn, their output the turn's tokens.
    """

    def __init__(self, params, cfg, *, batch: int, max_len: int, opts: M.Options = M.Options(), adapters=None,
                 bucket: int = 32, check_every: int = 4, key=None, token_bytes=None, fused: bool = True):
        import threading
        from collections import deque

        if batch < 1 or max_len < 2 or bucket < 1 or check_every < 1:
            raise ValueError(f"engine: batch >= 1, max_len >= 2, bucket >= 1, check_every >= 1 (got {batch}, "
                             f"{max_len}, {bucket}, {check_every})")
        self.cfg, self.opts = cfg, opts
        self.batch, self.max_len, self.bucket, self.check_every = batch, max_len, bucket, check_every
        self.fused = fused  # check_every decode steps per dispatch (False: one per dispatch, the reference)
        # the layers' weights held one by one, and the decode state too (`unstack_layers`, `unstack_state`): the
        # steps read and update each layer's buffers as they are, never a slice of a stack (a copy)
        self.params = _unstack(params)
        self.mesh = _mesh_of(self.params)
        if self.mesh is None:
            self.params = _committed(self.params)
        self._p = attach(self.params, _unstacked(adapters))
        self.version = 0
        key = jax.random.key(0) if key is None else key
        self._rng = np.random.default_rng(np.asarray(jax.random.key_data(key)).ravel().tolist())
        self._lock = threading.RLock()
        self._seqs: dict[int, _Sequence] = {}
        self._queue: deque[int] = deque()
        self._fed: list[int] = []  # parked sequences with a continuation to append
        self._stopped: set[int] = set()  # rows released mid-turn
        self._next_id = 0
        self.rows: list[int | None] = [None] * batch  # row -> sequence id
        self._decoding: set[int] = set()  # rows sampling a turn
        self._pos = np.zeros(batch, np.int64)  # positions each row's state holds
        self.decode_steps = 0
        self.tokens_sampled = 0  # tokens drawn by every row, in all
        self.state = jax.jit(unstack_state)(init_decode_state(cfg, batch, max_len, opts.dtype, mesh=self.mesh))
        if self.mesh is None:
            self.state = _committed(self.state)
        self._logits = _rows_on(jnp.zeros((batch, cfg.vocab_size), jnp.float32), self.mesh)
        self._done = _rows_on(jnp.ones((batch,), bool), self.mesh)
        self._budget = _rows_on(jnp.zeros((batch,), jnp.int32), self.mesh)
        self._rowp = None  # per-row sampling arrays on device (rebuilt when rows change)
        self._static = RowSampling()
        self._hist: dict = {}  # running per-row arrays (penalties, stop strings), made when a row first needs them
        self._token_bytes = None if token_bytes is None else [bytes(x) for x in token_bytes]
        self._tables: dict = {}  # the token byte table on the device (stop strings)
        self.progress: list[int] = []  # sequences that sampled tokens in the last `step` (see `turn_so_far`)

    # ------------------------------------------------------------------ counts
    @property
    def queued(self) -> int:
        """Sequences waiting for a row."""
        return len(self._queue)

    @property
    def busy(self) -> int:
        """Rows sampling a turn or about to (a fed continuation)."""
        return len(self._decoding) + len(self._fed)

    @property
    def parked(self) -> int:
        """Rows whose sequence waits for `feed` or `release`."""
        return sum(s is not None for s in self.rows) - self.busy

    # ------------------------------------------------------------------ the caller's side
    def _room(self, n: int, sp: SamplingParams) -> bool:
        return -(-n // self.bucket) * self.bucket + sp.max_new_tokens <= self.max_len

    def submit(self, tokens: list[int], sp: SamplingParams = SamplingParams(), *, images=None, tag=None) -> int:
        """Queue a sequence (its prompt's token ids, with the widened placeholders of `images`) -> its id."""
        tokens = [int(t) for t in tokens]
        if not tokens:
            raise ValueError("engine: an empty prompt")
        if not self._room(len(tokens), sp):
            raise ValueError(f"prompt: {len(tokens)} tokens + max_new_tokens={sp.max_new_tokens} do not fit "
                             f"max_len={self.max_len}")
        bad = [t for t in tokens if not 0 <= t < self.cfg.vocab_size]
        if bad:
            raise ValueError(f"prompt: token id {bad[0]} outside the vocabulary ({self.cfg.vocab_size})")
        self._check_sampling(sp)
        pics = self._pictures(tokens, images, "prompt")
        with self._lock:
            sid = self._next_id
            self._next_id += 1
            seed = sp.seed if sp.seed is not None else int(self._rng.integers(2 ** 32))
            key = np.asarray(jax.random.key_data(jax.random.key(seed & 0xFFFFFFFF)))
            self._seqs[sid] = _Sequence(sid, sp, tag, key, new=tokens, new_pics=pics)
            self._queue.append(sid)
        return sid

    def _check_sampling(self, sp: SamplingParams) -> None:
        V = self.cfg.vocab_size
        bad = [t for t in (*sp.stop_token_ids, *(t for t, _ in sp.logit_bias)) if t >= V]
        if bad:
            raise ValueError(f"sampling: token id {bad[0]} (a stop token id or logit_bias key) outside the vocabulary "
                             f"({V})")
        if sp.stop and self._token_bytes is None:
            raise ValueError("sampling: stop strings need the Engine's token_bytes (each token's text)")
        if sp.top_logprobs > V:
            raise ValueError(f"sampling: top_logprobs={sp.top_logprobs} is more than the vocabulary ({V})")

    def turn_so_far(self, seq_id: int) -> tuple[list[int], list[float], list | None]:
        """The tokens, logprobs (and top alternatives) a sequence has sampled of its current turn (streaming:
        `progress` names the sequences that sampled more in the last `step`). The lists grow in place."""
        s = self._seqs.get(seq_id)
        if s is None:
            return [], [], None
        return s.turn_t, s.turn_l, s.turn_top if s.sp.top_logprobs else None

    def feed(self, seq_id: int, tokens: list[int], *, images=None) -> None:
        """Continue a parked sequence with more tokens (and their pictures): it samples another turn. A
        continuation that does not fit its row's remaining positions re-prefills the whole conversation."""
        tokens = [int(t) for t in tokens]
        with self._lock:
            s = self._seqs.get(seq_id)
            if s is None or s.row is None or s.row in self._decoding or s.new is not None:
                raise ValueError(f"engine: sequence {seq_id} is not parked (feed it after its turn ended)")
            if not tokens:
                raise ValueError(f"engine: feeding sequence {seq_id} no tokens")
            if not self._room(len(s.held) + len(tokens), s.sp):
                raise ValueError(f"conversation {seq_id}: {len(s.held) + len(tokens)} tokens + max_new_tokens="
                                 f"{s.sp.max_new_tokens} do not fit max_len={self.max_len}")
        pics = self._pictures(tokens, images, f"conversation {seq_id}")
        with self._lock:
            s.new, s.new_pics = tokens, pics
            self._fed.append(seq_id)

    def room(self, seq_id: int) -> int:
        """Tokens a parked sequence can still be fed (its whole conversation re-prefilled if need be) and sample
        a whole turn after."""
        s = self._seqs[seq_id]
        return (self.max_len - s.sp.max_new_tokens) // self.bucket * self.bucket - len(s.held)

    def release(self, seq_id: int) -> None:
        """The sequence is done (or abandoned, even mid-turn): its row takes the next queued sequence."""
        with self._lock:
            s = self._seqs.pop(seq_id, None)
            if s is None:
                return
            if seq_id in self._queue:
                self._queue.remove(seq_id)
            if seq_id in self._fed:
                self._fed.remove(seq_id)
            if s.row is not None:
                self.rows[s.row] = None
                if s.row in self._decoding:
                    self._decoding.discard(s.row)
                    self._stopped.add(s.row)

    def set_adapters(self, adapters, version: int) -> None:
        """Sample with these LoRA adapters (None: the base alone) from the next decode step on; turns record
        `version`. The layers' adapters are copied one layer at a time; others (e.g. the lm_head's) are kept by
        reference: pass a copy when the caller's buffers will be donated."""
        with self._lock:
            extra = _unstacked(adapters)
            self._p = attach(self.params, _whole_on(extra, self.mesh) if extra else extra)
            if self.mesh is None:
                self._p = _committed(self._p)
            self.version = int(version)

    def _pictures(self, tokens: list[int], images, what: str) -> list:
        v = self.cfg.vision
        if v is None:
            if images:
                raise ValueError(f"{what}: images given but the model has no vision tower (not a nemotron_h_omni "
                                 "model)")
            return []
        from nemo_jax.data.images import picture
        from nemo_jax.model.vision import tokens_per_image

        pics = [picture(v, im) for im in (images or [])]
        need = sum(t == v.image_token_id for t in tokens)
        got = sum(tokens_per_image(v, [g for _, g in pics])) if pics else 0
        if need != got:
            raise ValueError(f"{what}: {need} image placeholder tokens (id {v.image_token_id}) but its {len(pics)} "
                             f"images make {got} (widen each picture's placeholder with widen_images)")
        return pics

    # ------------------------------------------------------------------ the loop
    def _admit(self) -> None:
        """New sequences into free rows, continuations in place (or afresh when they do not fit), one chunk.
        Under the lock: a `release` from another thread waits until the rows are consistent again."""
        with self._lock:
            self._admit_locked()

    def _admit_locked(self) -> None:
        stopped, self._stopped = self._stopped, set()
        fresh, feed, width = self._choose_rows()
        stopped -= set(fresh) | set(feed)  # (a row refilled now decodes its new sequence)
        if fresh or feed or stopped:
            self._prefill_chunk(fresh, feed, width, stopped)

    def _choose_rows(self) -> tuple[dict, dict, int]:
        """The sequences this step's chunk prefills -> (fresh {row: sequence} prefilled from position 0: new ones in
        free rows and continuations that no longer fit their row; fed {row: sequence} continued in place; the
        chunk's width in tokens). Sequences that do not fit wait: a new one back at the head of the queue, a
        continuation pending in its row."""
        b, rnd = self.batch, lambda n: -(-n // self.bucket) * self.bucket
        plan: dict[int, tuple[_Sequence, bool]] = {}  # row -> (sequence, whole: prefilled from position 0)
        for r in range(b):
            if self.rows[r] is None and self._queue:
                s = self._seqs[self._queue.popleft()]
                s.row, self.rows[r] = r, s.id
                plan[r] = (s, True)
        for i in self._fed:
            plan[self._seqs[i].row] = (self._seqs[i], False)
        self._fed = []
        # one chunk width for all (left padding): a continuation that no longer fits its row at that width is
        # prefilled whole; a row that cannot take the width with room for its turn waits for the next step (the
        # widest row always fits: its length was checked by submit / feed)
        length = lambda s, whole: len(s.held) + len(s.new) if whole else len(s.new)  # noqa: E731
        while True:
            width = rnd(max((length(s, w) for s, w in plan.values()), default=0))
            bad = [r for r, (s, w) in plan.items()
                   if (0 if w else self._pos[r]) + width + s.sp.max_new_tokens > self.max_len]
            if not bad:
                break
            for r in bad:
                s, whole = plan.pop(r)
                if not whole:
                    plan[r] = (s, True)
                elif s.held:  # a continuation: it stays pending in its row
                    self._fed.append(s.id)
                else:  # a new sequence: back to the head of the queue, its row free again
                    s.row, self.rows[r] = None, None
                    self._queue.appendleft(s.id)
        fresh = {r: s for r, (s, w) in plan.items() if w}
        feed = {r: s for r, (s, w) in plan.items() if not w}
        for s in fresh.values():
            s.new, s.new_pics, s.held, s.pics = s.held + s.new, s.pics + s.new_pics, [], []
        return fresh, feed, width

    def _prefill_chunk(self, fresh: dict, feed: dict, width: int, stopped: set) -> None:
        """Prefill the chosen rows' tokens (`_choose_rows`) as one chunk of `width` tokens, left-padded, `bucket`
        tokens at a time (fresh rows emptied first); they then decode. Rows `stopped` (released mid-turn) stop."""
        b, rnd = self.batch, lambda n: -(-n // self.bucket) * self.bucket
        chunk = {**feed, **fresh}
        mesh, p, version = self.mesh, self._p, self.version
        onb = lambda rows: _rows_on(jnp.asarray(np.isin(np.arange(b), list(rows))), mesh)  # noqa: E731
        new_logits = self._logits
        if fresh:
            self.state = _empty_rows(self.state, onb(fresh), self.cfg, mesh)
            self._pos[list(fresh)] = 0
        if chunk:
            k = chunk_rows(len(chunk), b)  # rows run: the fed ones, padded
            rows = sorted(chunk) + [r for r in range(b) if r not in chunk][:k - len(chunk)]
            if k == b:  # every row runs, in the state's order (the chunk's row i is the state's row i)
                rows = list(range(b))
            toks = [chunk[r].new if r in chunk else [] for r in rows]
            v = self.cfg.vision
            images = None if v is None else chunk_images(v, [chunk[r].new_pics if r in chunk else [] for r in rows])
            # prefilled `bucket` tokens at a time (one compiled prefill per row count, whatever the prompts'
            # lengths; a row whose tokens start in a later piece appends nothing before it); pictures in one piece
            t, valid = _left_pad_host(toks, width)
            step = width if images is not None else self.bucket
            if images is not None:
                check_images(images, self.cfg)
                images = {n: _rows_on(jnp.asarray(x), mesh) for n, x in images.items()}
            on = lambda x: _rows_on(jnp.asarray(x), mesh)  # noqa: E731
            if k < b:  # + rows appending nothing (their state comes back unchanged)
                ridx = jnp.asarray(rows, jnp.int32)
                ridx = ridx if mesh is not None else _committed(ridx)
                for j in range(0, width, step):
                    sub, self.state = _append_rows(p, on(t[:, j:j + step]), on(valid[:, j:j + step]), self.state,
                                                   ridx, self.cfg, self.opts, mesh, images)
                new_logits = _set_rows(self._logits, ridx, sub)
            else:
                for j in range(0, width, step):
                    new_logits, self.state = _append(p, on(t[:, j:j + step]), on(valid[:, j:j + step]), self.state,
                                                     self.cfg, self.opts, mesh, images)
            for r, s in chunk.items():
                self._pos[r] += width if images is not None else rnd(len(s.new))  # (the pieces it had tokens in)
                s.held, s.pics = s.held + s.new, s.pics + s.new_pics
                s.new, s.new_pics = None, []
                s.turn_t, s.turn_l, s.turn_v, s.turn_top, s.turn_stop = [], [], {version}, [], False
                self._decoding.add(r)
        max_new = np.zeros(b, np.int32)
        for r, s in chunk.items():
            max_new[r] = s.sp.max_new_tokens
        self._logits, self._done, self._budget = _merge_fed(onb(chunk), new_logits, self._logits, self._done,
                                                            self._budget, _rows_on(jnp.asarray(max_new), mesh),
                                                            onb(stopped))
        self._upload_rows(set(chunk))

    def _seqs_row(self, r: int) -> _Sequence:
        return self._seqs[self.rows[r]]

    def _upload_rows(self, started: set[int]) -> None:
        """The per-row sampling arrays of the rows now sampling (the others' entries are unused); rows `started`
        (a turn begins) get fresh running arrays (`sample_step`'s hist)."""
        b, V = self.batch, self.cfg.vocab_size
        live = {r: self._seqs_row(r) for r in sorted(self._decoding)}
        sps = [s.sp for s in live.values()]
        S = _pow2(max([len(sp.stop_token_ids) for sp in sps] + [MIN_WIDTHS["stops"]]))
        temp, top_k, top_p = np.zeros(b, np.float32), np.zeros(b, np.int32), np.ones(b, np.float32)
        min_p = np.zeros(b, np.float32)
        stops, count = np.full((b, S), -1, np.int32), np.zeros(b, np.int32)
        key = np.zeros((b,) + next(iter(live.values())).key.shape if live else (b, 2), np.uint32)
        for r, s in live.items():
            sp = s.sp
            if sp.temperature > 0:  # greedy rows keep the untruncated distribution (their logprobs)
                temp[r], top_k[r], top_p[r], min_p[r] = sp.temperature, sp.top_k, sp.top_p, sp.min_p
            stops[r, :len(sp.stop_token_ids)] = sp.stop_token_ids
            key[r], count[r] = s.key, s.sampled
        how = self.row_sampling(sps)
        rows = dict(temperature=temp, top_k=top_k, top_p=top_p, stops=stops, key=key, count=count)
        if how.nucleus:  # (the step of every extra: min-p with the truncations)
            rows["min_p"] = min_p
        if how.adjust:
            B = _pow2(max([len(sp.logit_bias) for sp in sps] + [MIN_WIDTHS["bias"]]))
            ids, bias = np.full((b, B), V, np.int32), np.zeros((b, B), np.float32)
            for r, s in live.items():
                for j, (t, x) in enumerate(s.sp.logit_bias):
                    ids[r, j], bias[r, j] = t, x
            rows.update(bias_ids=ids, bias=bias)
            rows["min_tokens"] = np.asarray([live[r].sp.min_tokens if r in live else 0 for r in range(b)], np.int32)
            rows["turn0"] = np.asarray([live[r].sampled - len(live[r].turn_t) if r in live else 0 for r in range(b)],
                                       np.int32)
            for name in ("presence", "frequency", "repetition"):
                rows[name] = np.asarray([getattr(live[r].sp, f"{name}_penalty") if r in live else float(name ==
                                         "repetition") for r in range(b)], np.float32)
        if how.stop_strings:
            enc = {r: [x.encode() for x in s.sp.stop] for r, s in live.items()}
            n = _pow2(max([len(x) for x in enc.values()] + [MIN_WIDTHS["stop_strings"]]))
            W = _pow2(max([len(y) for x in enc.values() for y in x] + [MIN_WIDTHS["stop_bytes"]]))
            sb, sl = np.full((b, n, W), -1, np.int32), np.zeros((b, n), np.int32)
            for r, xs in enc.items():
                for j, x in enumerate(xs):
                    sb[r, j, W - len(x):] = np.frombuffer(x, np.uint8)
                    sl[r, j] = len(x)
            rows.update(stop_bytes=sb, stop_lens=sl)
            if not self._tables:
                tb, tl = token_table(self._token_bytes, V)
                self._tables = _whole_on({"bytes": jnp.asarray(tb), "lens": jnp.asarray(tl)}, self.mesh)
        self._static = how
        self._rowp = {n: _rows_on(jnp.asarray(x), self.mesh) for n, x in rows.items()}
        # running arrays: made the first time a row needs them, reset for the rows whose turn starts now
        if how.adjust and "counts" not in self._hist:
            self._hist.update(counts=_rows_on(jnp.zeros((b, V), jnp.int32), self.mesh),
                              seen=_rows_on(jnp.zeros((b, V), bool), self.mesh))
        if how.stop_strings and "tail" not in self._hist:
            self._hist["tail"] = _rows_on(jnp.full((b, MAX_STOP_BYTES), -1, jnp.int32), self.mesh)
        started = [r for r in started if r in live]
        if self._hist and started:
            pen = [r for r in started if live[r].sp.presence_penalty or live[r].sp.frequency_penalty
                   or live[r].sp.repetition_penalty != 1.0]
            P = _pow2(max([len(live[r].held) for r in pen] + [MIN_WIDTHS["prompt"]]))
            prompt = np.full((b, P), V, np.int32)
            for r in pen:
                prompt[r, :len(live[r].held)] = live[r].held
            reset = np.isin(np.arange(b), started)
            self._hist = _reset_hist(self._hist, _rows_on(jnp.asarray(reset), self.mesh),
                                     _rows_on(jnp.asarray(prompt), self.mesh))

    def row_sampling(self, sps) -> RowSampling:
        """The decode step's static variant for rows sampling with `sps`: the plain step when every row samples
        with temperature (or greedily) alone, else one step that serves every extra for any row (top-k and top-p
        from one sort, min-p, penalties, logit_bias, min_tokens, stop strings, TOP_LOGPROBS alternatives), so that a
        server compiles two decode steps, not one per combination of what its requests ask for."""
        sps = list(sps)
        if not any(sp.processed or (sp.temperature > 0 and (sp.top_k or sp.top_p < 1 or sp.min_p > 0)) for sp in sps):
            return RowSampling()
        V = self.cfg.vocab_size
        top = max([sp.top_logprobs for sp in sps] + [TOP_LOGPROBS])
        return RowSampling(k_max=V, nucleus=True, adjust=True, top_n=min(_pow2(top), V),
                           stop_strings=self._token_bytes is not None)

    def _stop_string(self, s: _Sequence) -> str | None:
        """The stop string a turn that ended on a stop-string hit ends with (the one completed earliest)."""
        text = b"".join(self._token_bytes[t] if t < len(self._token_bytes) else b"" for t in s.turn_t)
        last = len(self._token_bytes[s.turn_t[-1]]) if s.turn_t and s.turn_t[-1] < len(self._token_bytes) else 0
        ends = []
        for x in s.sp.stop:
            e = x.encode()
            at = text.find(e, max(0, len(text) - last - len(e) + 1))
            if at >= 0:
                ends.append((at + len(e), x))
        return min(ends)[1] if ends else None

    def step(self) -> list[TurnEnd]:
        """Admit queued sequences and fed continuations, decode up to `check_every` steps over the rows with a
        turn to sample -> the turns that ended (their sequences parked)."""
        self.progress = []
        self._admit()
        if not self._decoding:
            return []
        with self._lock:
            p, version = self._p, self.version
        how = self._static
        # the running arrays and byte table go in only where the variant reads them (one program per variant)
        extras = how.adjust or how.stop_strings
        hist, tables = (self._hist, self._tables) if extras else ({}, {})
        if self.fused:  # check_every steps in one dispatch, stops checked on the device
            (T, L, A, H, top), self._logits, self.state, self._done, self._budget, count, hist = \
                _decode_steps(p, self._logits, self.state, self._done, self._budget, self._rowp, hist, tables,
                              self.cfg, self.opts, how, self.mesh, self.check_every)
            self._rowp = dict(self._rowp, count=count)
            T, L, A, H, top = fetch((T, L, A, H, top))
            self.decode_steps += int(A.any(axis=1).sum())
        else:  # the reference: a dispatch per step
            steps, tops = [], []
            for _ in range(self.check_every):
                tok, lp, act, hit, self._logits, self.state, self._done, self._budget, count, hist, top = \
                    _decode_rows(p, self._logits, self.state, self._done, self._budget, self._rowp, hist, tables,
                                 self.cfg, self.opts, how, self.mesh)
                self._rowp = dict(self._rowp, count=count)
                steps.append((tok, lp, act, hit))
                tops.append(top)
                self.decode_steps += 1
            T, L, A, H = (fetch(jnp.stack(x, 0)) for x in zip(*steps))
            top = tuple(fetch(jnp.stack(x, 0)) for x in zip(*tops)) if how.top_n else None
        if extras:
            self._hist = hist
        if how.top_n:
            TI, TV = top
        D = fetch(self._done)
        self._pos += A.sum(0)
        self.tokens_sampled += int(A.sum())
        out = []
        with self._lock:
            for r in sorted(self._decoding):
                s = self._seqs_row(r)
                got = A[:, r]
                s.turn_t += T[got, r].tolist()
                s.turn_l += L[got, r].tolist()
                if s.sp.top_logprobs:
                    k = s.sp.top_logprobs
                    s.turn_top += [list(zip(TI[i, r, :k].tolist(), TV[i, r, :k].tolist())) for i in np.flatnonzero(got)]
                s.turn_stop |= bool(H[:, r].any())
                s.sampled += int(got.sum())
                if got.any():
                    s.turn_v.add(version)
                    self.progress.append(s.id)
                if not D[r]:
                    continue
                self._decoding.discard(r)
                toks = s.turn_t
                stop = None
                if s.turn_stop and s.sp.stop and not (toks and toks[-1] in s.sp.stop_token_ids):
                    stop = self._stop_string(s)
                s.held = s.held + toks
                vs = tuple(sorted(s.turn_v))
                out.append(TurnEnd(s.id, toks, s.turn_l, "stop" if s.turn_stop else "length",
                                   vs[0] if vs else version, s.tag, vs, s.turn_top if s.sp.top_logprobs else None,
                                   stop))
        return out


def widen_images(cfg, ids: list[int], images) -> tuple[list[int], list]:
    """Token ids holding one `<image>` token per picture (as the chat template renders image parts) -> the ids
    with each widened to its picture's token count (as SFT data is), and the pictures loaded (PIL images) for
    `Engine.submit` / `feed`."""
    if not images:
        return list(ids), []
    v = cfg.vision
    if v is None:
        raise ValueError("images given but the model has no vision tower (not a nemotron_h_omni model)")
    from nemo_jax.data.images import load_image, picture_tokens

    pics = [load_image(im) if isinstance(im, str) else im for im in images]
    ids = np.asarray(ids, np.int64)
    at = np.flatnonzero(ids == v.image_token_id)
    if len(at) != len(pics):
        raise ValueError(f"{len(pics)} images but {len(at)} image tokens (id {v.image_token_id}) in the text")
    reps = np.ones(len(ids), np.int64)
    reps[at] = [picture_tokens(v, p) for p in pics]
    return np.repeat(ids, reps).tolist(), pics


@dataclass
class Finished:
    """One sequence of `continuous_generate`: its prompt's index and each sampled turn."""
    index: int
    turns: list[tuple[list[int], list[float], str]] = field(default_factory=list)  # (tokens, logprobs, reason)


def continuous_generate(params, prompts, cfg, sp: SamplingParams, *, batch: int, max_len: int, next_turn=None,
                        key=None, opts: M.Options = M.Options(), adapters=None, bucket: int = 32,
                        check_every: int = 4):
    """Sample every prompt of the iterable `prompts` through an `Engine` of `batch` decode rows, yielding a
    `Finished` per sequence as it completes (not in input order).

    After each turn `next_turn(index, turns)` may return more tokens (tool results, the next user turn: the
    sequence continues in its row) or None: the sequence is finished and its row takes the next prompt.
    """
    eng = Engine(params, cfg, batch=batch, max_len=max_len, opts=opts, adapters=adapters, bucket=bucket,
                 check_every=check_every, key=key)
    todo = iter(enumerate(prompts))
    live: dict[int, Finished] = {}
    exhausted = False
    while True:
        while not exhausted and len(live) <= batch:  # one waiting beyond the rows: a freed row never idles
            nxt = next(todo, None)
            if nxt is None:
                exhausted = True
                break
            if not len(nxt[1]):
                raise ValueError(f"prompt {nxt[0]} is empty")
            live[eng.submit(list(nxt[1]), sp)] = Finished(nxt[0])
        if not live:
            return
        for end in eng.step():
            f = live[end.seq_id]
            f.turns.append((end.tokens, end.logprobs, end.finish_reason))
            more = next_turn(f.index, f.turns) if next_turn is not None else None
            if more:
                eng.feed(end.seq_id, list(more))
            else:
                eng.release(end.seq_id)
                del live[end.seq_id]
                yield f
