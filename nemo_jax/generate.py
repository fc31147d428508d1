"""Generation for rollouts: prefill + cached decode for the hybrid model, with behaviour logprobs.

* `prefill` runs left-padded prompts of different lengths through an empty `DecodeState`; padding never
  touches a Mamba state (dt = 0, conv taps skip it) and is masked out of attention.
* `decode_step` appends one token per row (static shapes, jitted); finished rows append nothing.
* `sample_token` draws from softmax(logits / temperature) restricted to the top-k / top-p set and returns
  the logprob of the drawn token under exactly that (renormalised) distribution. Untruncated sampling at
  temperature T gives the learner's temperature-scaled logprob, the number importance weights compare to.
* `generate` ties them together and returns tokens, per-token logprobs and a finish reason per row; its
  state can be continued with `append` (tool results, the next user turn) without recomputing the prefix.
* `continuous_generate` serves many sequences through a fixed number of decode rows (continuous batching):
  a row whose turn ends either continues in place (the caller's next turn appended to it) or is emptied
  and refilled with the next prompt, prefilled into that row while the other rows keep decoding.
* LoRA adapters are applied unmerged: pass `adapters` (a tree mirroring the params; see nemo_jax.lora).
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import numpy as np

from nemo_jax.lora import attach
from nemo_jax.model import model as M
from nemo_jax.model.cache import DecodeState, init_decode_state, state_shardings
from nemo_jax.model.vision import check_images
from nemo_jax.model.mamba2 import MambaState


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 64
    temperature: float = 1.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    stop_token_ids: tuple[int, ...] = ()


@dataclass
class Generation:
    tokens: list[list[int]]  # new tokens per row (up to and including a stop token)
    logprobs: list[list[float]]  # logprob of each under the distribution it was drawn from
    finish_reason: list[str]  # "stop" | "length"
    state: DecodeState  # continue with `append`
    last_logits: jax.Array  # [b, V] logits after the last appended token


# --------------------------------------------------------------------------- sampling
def sampling_logprobs(logits: jax.Array, temperature: float, top_k: int = 0, top_p: float = 1.0) -> jax.Array:
    """[..., V] fp32 logits -> log-probabilities of the distribution sampled from (-inf outside the kept set)."""
    x = logits.astype(jnp.float32) / max(temperature, 1e-6)
    V = x.shape[-1]
    if top_k and top_k < V:
        kth = jax.lax.top_k(x, top_k)[0][..., -1:]
        x = jnp.where(x >= kth, x, -jnp.inf)
    if top_p < 1.0:
        order = jnp.argsort(-x, axis=-1)
        sorted_x = jnp.take_along_axis(x, order, axis=-1)
        p = jax.nn.softmax(sorted_x, axis=-1)
        before = jnp.cumsum(p, axis=-1) - p  # mass strictly before each token
        keep_sorted = before < top_p
        keep = jnp.take_along_axis(keep_sorted, jnp.argsort(order, axis=-1), axis=-1)
        x = jnp.where(keep, x, -jnp.inf)
    return jax.nn.log_softmax(x, axis=-1)


def sample_token(logits: jax.Array, key, sp: SamplingParams):
    """logits [b, V] -> (token [b] int32, logprob [b] fp32)."""
    if sp.temperature == 0.0:
        tok = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        lp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
        return tok, jnp.take_along_axis(lp, tok[:, None], axis=-1)[:, 0]
    lp = sampling_logprobs(logits, sp.temperature, sp.top_k, sp.top_p)
    tok = _inverse_cdf_draw(key, lp)
    return tok, jnp.take_along_axis(lp, tok[:, None], axis=-1)[:, 0]


def _inverse_cdf_draw(key, lp: jax.Array) -> jax.Array:
    """One draw per row from exp(lp) [b, V] by inverting its CDF with one uniform per row: the same
    distribution as `jax.random.categorical` (Gumbel-max), which draws b x V random numbers, a quarter of a
    decode step on CPU at V = 8k. Zero-probability tokens own empty CDF intervals and are never drawn."""
    p = jnp.exp(lp - jnp.max(lp, axis=-1, keepdims=True))
    cdf = jnp.cumsum(p, axis=-1)
    u = jax.random.uniform(key, (lp.shape[0], 1), jnp.float32) * cdf[:, -1:]
    last = lp.shape[-1] - 1 - jnp.argmax((p > 0)[:, ::-1], axis=-1)  # rounding never reaches past it
    return jnp.minimum(jnp.sum(cdf <= u, axis=-1), last).astype(jnp.int32)


# --------------------------------------------------------------------------- prefill / decode
def left_pad(rows: list[list[int]], pad_id: int = 0, length: int | None = None):
    n = max(1, max(len(r) for r in rows)) if length is None else length
    toks = np.full((len(rows), n), pad_id, np.int32)
    valid = np.zeros((len(rows), n), bool)
    for i, r in enumerate(rows):
        if len(r) > n:
            raise ValueError(f"row {i} has {len(r)} tokens, more than {n}")
        if len(r):
            toks[i, n - len(r):] = r
            valid[i, n - len(r):] = True
    return jnp.asarray(toks), jnp.asarray(valid)


def _mesh_of(tree):
    """The Mesh of the first NamedSharding leaf of `tree`, or None (unsharded / single device)."""
    for x in jax.tree.leaves(tree):
        sh = getattr(x, "sharding", None)
        if isinstance(sh, jax.sharding.NamedSharding) and sh.mesh.size > 1:
            return sh.mesh
    return None


def _keep_sharded(state: DecodeState, cfg, mesh) -> DecodeState:
    """Constrain a state (inside jit) to its `state_shardings`, so the donated buffers are reused in place."""
    if mesh is None:
        return state
    sh = state_shardings(cfg, state.valid.shape[0], state.valid.shape[1], mesh,
                         dtype=state.kv.k.dtype if state.kv is not None else jnp.float32)
    return jax.lax.with_sharding_constraint(state, sh)


def _rows_on(x, mesh):
    """Put a [b, ...] host array on `mesh` with its rows over the batch axes (or as is without a mesh)."""
    if mesh is None:
        return x
    from nemo_jax.parallel.rules import Rules

    return jax.device_put(x, Rules().sharding(mesh, ("batch",) + (None,) * (x.ndim - 1), x.shape))


@functools.partial(jax.jit, static_argnames=("cfg", "opts", "mesh"), donate_argnames=("state",))
def _append(params, tokens, valid, state, cfg, opts, mesh=None, images=None):
    """-> (logits [b, V] at the chunk's last position, new state). `state` is donated (updated in place).
    `images`: the chunk's per-row image batch (`nemo_jax.model.vision.pack_inputs`)."""
    logits, state = M.forward_cached(params, tokens, valid, state, cfg, opts=opts, positions="last", images=images)
    return logits[:, 0], _keep_sharded(state, cfg, mesh)


@functools.partial(jax.jit, static_argnames=("cfg", "opts", "mesh"), donate_argnames=("state",))
def _append_at(params, tokens, valid, state, positions, cfg, opts, mesh=None, images=None):
    """-> (logits [b, n, V] at chunk positions [b, n], new state). `state` is donated."""
    logits, state = M.forward_cached(params, tokens, valid, state, cfg, opts=opts, positions=positions,
                                     images=images)
    return logits, _keep_sharded(state, cfg, mesh)


def _padded_positions(rows: list[list[int]], width: int, positions) -> jax.Array:
    """positions[i] index row i's own tokens; -> [b, n] indices into the left-padded [b, width] chunk."""
    pos = np.asarray(positions, np.int32)
    if pos.ndim != 2 or pos.shape[0] != len(rows):
        raise ValueError(f"positions must be [{len(rows)}, n], got shape {pos.shape}")
    for i, r in enumerate(rows):
        if pos.shape[1] and (pos[i].min() < 0 or pos[i].max() >= len(r)):
            raise ValueError(f"positions of row {i} must lie in [0, {len(r)})")
    return jnp.asarray(pos + (width - np.asarray([len(r) for r in rows], np.int32))[:, None])


def _run_chunk(params, rows, state, cfg, opts, positions, pad_id, width=None, images=None):
    mesh = _mesh_of(params)
    toks, valid = left_pad(rows, pad_id, width)
    toks, valid = _rows_on(toks, mesh), _rows_on(valid, mesh)
    if images is not None:
        check_images(images, cfg)
        images = {k: _rows_on(jnp.asarray(v), mesh) for k, v in images.items()}
    if positions is None:
        return _append(params, toks, valid, state, cfg, opts, mesh, images)
    at = _rows_on(_padded_positions(rows, toks.shape[1], positions), mesh)
    return _append_at(params, toks, valid, state, at, cfg, opts, mesh, images)


def prefill(params, prompts: list[list[int]], cfg, max_len: int, *, opts: M.Options = M.Options(),
            adapters=None, pad_id: int = 0, positions=None, width: int | None = None, images: dict | None = None):
    """Left-pad prompts (to `width` tokens, default the longest prompt), run them through an empty state of
    capacity `max_len`.

    -> (last logits [b, V], state); with `positions` ([b, n], indices into each prompt's own tokens, e.g. to
    score a given continuation) -> (logits [b, n, V] there, state). The lm_head runs only at those positions.
    On sharded params the state is created in its `state_shardings` on their mesh.
    `images`: the prompts' images as a per-row image batch (`prompt_images`, or `vision.pack_inputs` of
    transformers-style pixel_values / image_grid_hw); decoding afterwards is unchanged.
    """
    if any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    n = max(len(p) for p in prompts) if width is None else width
    if n > max_len:
        raise ValueError(f"prompt length {n} exceeds max_len {max_len}")
    p = attach(params, adapters)
    state = init_decode_state(cfg, len(prompts), max_len, opts.dtype, mesh=_mesh_of(p))
    return _run_chunk(p, prompts, state, cfg, opts, positions, pad_id, n, images)


def prompt_images(tok, cfg, prompt: str, images: list[str], *, chat_template: bool = True):
    """A user prompt with pictures (paths or data URLs, shown before the text, as the data's image parts) ->
    (token ids with each picture's placeholder tokens, its per-row image batch [1, ...] for `prefill`)."""
    from nemo_jax.data.chat import Document, read_image_parts, content_text
    from nemo_jax.data.images import load_image, preprocess, widen_image_tokens
    from nemo_jax.model.vision import pack_inputs

    if cfg.vision is None:
        raise ValueError("--image: the model has no vision tower (not a nemotron_h_omni model)")
    refs: list[str] = []
    content = content_text([{"type": "image", "path": x} for x in images] + [{"type": "text", "text": prompt}],
                            "prompt", refs)
    text = tok.render([{"role": "user", "content": content}], add_generation_prompt=True) if chat_template else content
    ids = np.asarray(tok.tokenizer.encode(text, add_special_tokens=False).ids, np.int32)
    refs, hw = read_image_parts(refs, ids, tok, os.getcwd())
    v = cfg.vision
    doc = widen_image_tokens(v, Document(ids, np.zeros(len(ids), bool), 0, refs, hw))
    pix, grid = preprocess([load_image(r) for r in refs], v)
    return doc.ids.tolist(), pack_inputs(v, doc.ids[None], pix, grid)


def append(params, state: DecodeState, rows: list[list[int]], cfg, *, opts: M.Options = M.Options(), adapters=None,
           pad_id: int = 0, positions=None):
    """Continue a decode state with more tokens per row (rows may differ in length; empty rows add nothing).

    `state` is donated: it is updated in place and must not be used afterwards (use the returned one).
    -> (last logits [b, V], state), or with `positions` [b, n] (into each row's new tokens) logits [b, n, V]."""
    n = max(1, max(len(r) for r in rows))
    used = max((int(p) for p, r in zip(np.asarray(state.pos), rows) if r), default=0)
    if used + n > state.max_len:
        raise ValueError(f"state holds {state.max_len} positions per row; {used} used, {n} more asked")
    return _run_chunk(attach(params, adapters), rows, state, cfg, opts, positions, pad_id)


@functools.partial(jax.jit, static_argnames=("cfg", "opts", "sp", "mesh"), donate_argnames=("state",))
def _decode_and_sample(params, logits, state, done, key, cfg, opts, sp, mesh=None):
    tok, lp = sample_token(logits, key, sp)
    stop = jnp.isin(tok, jnp.asarray(sp.stop_token_ids, jnp.int32)) if sp.stop_token_ids else jnp.zeros_like(done)
    new_logits, state = M.forward_cached(params, tok[:, None], (~done)[:, None], state, cfg, opts=opts,
                                         positions="last")
    return tok, lp, stop, new_logits[:, 0], _keep_sharded(state, cfg, mesh)


def decode_step(params, token, state, cfg, *, opts: M.Options = M.Options(), active=None):
    """Append one token per row ([b]); rows with active=False append nothing. `state` is donated.
    -> (logits [b, V], state)."""
    active = jnp.ones(token.shape, bool) if active is None else active
    return _append(params, token[:, None], active[:, None], state, cfg, opts, _mesh_of(params))


def generate(params, prompts: list[list[int]], cfg, sp: SamplingParams = SamplingParams(), *, key=None,
             opts: M.Options = M.Options(), adapters=None, state: DecodeState | None = None, last_logits=None,
             max_len: int | None = None, on_token=None, bucket: int = 1, images: dict | None = None) -> Generation:
    """Sample continuations. With `state` (+ `last_logits`) continue it instead of prefilling `prompts`
    (the state is donated: use `Generation.state` afterwards). `bucket`: prompts are left-padded to a multiple
    of it, so batches of prompts of varied lengths reuse a few compiled shapes (a sampler serving many requests
    passes e.g. 32). On sharded params (a mesh) the decode state is
    sharded too (rows over the batch axes, KV heads over `tensor`) and every step updates it in place.

    on_token(step, tokens [b], done [b]) is called as tokens come (for streaming). `images`: the prompts'
    pictures (see `prefill`).
    """
    key = jax.random.key(0) if key is None else key
    p = attach(params, adapters)
    mesh = _mesh_of(p)
    if state is None:
        width = -(-max(len(x) for x in prompts) // bucket) * bucket
        max_len = max_len or (width + sp.max_new_tokens)
        last_logits, state = prefill(p, prompts, cfg, max_len, opts=opts, width=width, images=images)
    elif last_logits is None:
        raise ValueError("continuing a state needs its last_logits")
    b = last_logits.shape[0]
    used = int(np.max(np.asarray(state.pos)))
    if used + sp.max_new_tokens > state.max_len:
        raise ValueError(f"max_new_tokens={sp.max_new_tokens} does not fit the state ({state.max_len} positions per "
                         f"row, {used} used)")
    # derived from last_logits (not a fresh host array): placed as the step's own outputs are, so the loop's
    # first call and the later ones share one compiled program
    done = jnp.zeros_like(last_logits[:, 0], bool)
    toks, lps, stops = [], [], []
    for i in range(sp.max_new_tokens):
        key, sub = jax.random.split(key)
        tok, lp, stop, last_logits, state = _decode_and_sample(p, last_logits, state, done, sub, cfg, opts, sp, mesh)
        toks.append(tok)
        lps.append(lp)
        stops.append(stop & ~done)
        if on_token is not None:
            on_token(i, tok, done)
        done = done | stop
        if i % 8 == 7 and bool(jnp.all(done)):
            break
    T = np.asarray(jnp.stack(toks, 1))
    L = np.asarray(jnp.stack(lps, 1))
    S = np.asarray(jnp.stack(stops, 1))
    out_t, out_l, reasons = [], [], []
    for r in range(b):
        hit = np.nonzero(S[r])[0]
        n = int(hit[0]) + 1 if len(hit) else T.shape[1]
        out_t.append(T[r, :n].tolist())
        out_l.append(L[r, :n].tolist())
        reasons.append("stop" if len(hit) else "length")
    return Generation(out_t, out_l, reasons, state, last_logits)


# --------------------------------------------------------------------------- continuous batching
@dataclass
class Finished:
    """One sequence of `continuous_generate`: its prompt's index and each sampled turn."""
    index: int
    turns: list[tuple[list[int], list[float], str]] = field(default_factory=list)  # (tokens, logprobs, reason)


@functools.partial(jax.jit, static_argnames=("cfg", "opts", "sp", "mesh"), donate_argnames=("state",))
def _decode_rows(params, logits, state, done, budget, key, cfg, opts, sp, mesh=None):
    """One step over every row: sample, append for the rows still going; a row is done after a stop token or
    when its budget of new tokens is spent. -> (token, logprob, active [b], logits, state, done, budget)."""
    active = ~done
    tok, lp, stop, logits, state = _decode_and_sample(params, logits, state, done, key, cfg, opts, sp, mesh)
    budget = budget - active.astype(budget.dtype)
    return tok, lp, active, logits, state, done | stop | (budget <= 0), budget


@functools.partial(jax.jit, static_argnames=("cfg", "mesh"), donate_argnames=("state",))
def _empty_rows(state, rows, cfg, mesh=None):
    """Forget rows [b] (bool) of a state: zero Mamba conv/SSM state, no valid KV slot, position 0 (a new
    sequence starts there)."""
    keep = ~rows
    mamba = state.mamba
    if mamba is not None:
        mamba = MambaState(mamba.conv * keep[None, :, None, None].astype(mamba.conv.dtype),
                           mamba.ssm * keep[None, :, None, None, None].astype(mamba.ssm.dtype))
    return _keep_sharded(state._replace(mamba=mamba, valid=state.valid & keep[:, None],
                                        pos=jnp.where(rows, 0, state.pos)), cfg, mesh)


@functools.partial(jax.jit, static_argnames=("cfg", "opts", "mesh"), donate_argnames=("state",))
def _append_rows(params, tokens, valid, state, rows, cfg, opts, mesh=None):
    """Append a chunk [k, n] to rows `rows` [k] of a [b]-row state only: their state is gathered, run and
    scattered back, so refilling one row costs one row's prefill, not the batch's. -> (logits [k, V], state)."""
    # Mamba conv/SSM and KV leaves hold rows on axis 1 ([layers, b, ...]), `valid` on axis 0
    take = lambda x: jnp.take(x, rows, axis=1)  # noqa: E731
    sub = state._replace(mamba=jax.tree.map(take, state.mamba), kv=jax.tree.map(take, state.kv),
                         valid=jnp.take(state.valid, rows, axis=0), pos=jnp.take(state.pos, rows))
    logits, sub = M.forward_cached(params, tokens, valid, sub, cfg, opts=opts, positions="last")
    put = lambda x, y: x.at[:, rows].set(y)  # noqa: E731
    state = state._replace(mamba=jax.tree.map(put, state.mamba, sub.mamba), kv=jax.tree.map(put, state.kv, sub.kv),
                           valid=state.valid.at[rows].set(sub.valid), pos=state.pos.at[rows].set(sub.pos))
    return logits[:, 0], _keep_sharded(state, cfg, mesh)


@jax.jit
def _merge_fed(fed, new_logits, logits, done, budget, max_new):
    """Rows `fed` just had tokens appended: their logits are the new ones, they decode again with a full budget."""
    return (jnp.where(fed[:, None], new_logits, logits), done & ~fed,
            jnp.where(fed, max_new, budget).astype(budget.dtype))


def continuous_generate(params, prompts, cfg, sp: SamplingParams, *, batch: int, max_len: int, next_turn=None,
                        key=None, opts: M.Options = M.Options(), adapters=None, bucket: int = 32,
                        check_every: int = 4):
    """Sample every prompt of the iterable `prompts` through `batch` decode rows, yielding a `Finished` per
    sequence as it completes (not in input order).

    A row's turn ends at a stop token or after `sp.max_new_tokens`; then `next_turn(index, turns)` may return
    more tokens (tool results, the next user turn: they are appended to that row and it samples another turn)
    or None: the sequence is finished and the row is refilled with the next prompt (emptied and prefilled in
    place, while the other rows keep their state). Rows are checked every `check_every` steps (a finished row
    idles at most that long). Each row holds `max_len` positions of its own sequence (the KV cache size per
    row): a prompt or a continuation (left-padded to a multiple of `bucket`, the widest of those fed together)
    must leave room for `max_new_tokens` more; a continuation that does not fit is prefilled afresh with the
    whole conversation. Tokens and logprobs per turn are exactly those `generate` would give the same sequence
    on its own (up to the random draws).
    """
    key = jax.random.key(0) if key is None else key
    p = attach(params, adapters)
    mesh = _mesh_of(p)
    todo = iter(enumerate(prompts))
    item: list[Finished | None] = [None] * batch
    seq: list[list[int]] = [[] for _ in range(batch)]  # the tokens each row's state holds
    feed: dict[int, list[int]] = {}  # row -> a continuation to append before the next steps
    stop_ids = set(sp.stop_token_ids)
    rnd = lambda n: -(-n // bucket) * bucket
    fits = lambda used, width: used + width + sp.max_new_tokens <= max_len  # noqa: E731
    turn_t: list[list[int]] = [[] for _ in range(batch)]  # the turn each row is sampling
    turn_l: list[list[float]] = [[] for _ in range(batch)]
    used = np.zeros(batch, np.int64)  # positions each row holds (the state's `pos`, read back every check)
    state = init_decode_state(cfg, batch, max_len, opts.dtype, mesh=mesh)
    logits = _rows_on(jnp.zeros((batch, cfg.vocab_size), jnp.float32), mesh)
    done = _rows_on(jnp.ones((batch,), bool), mesh)
    budget = _rows_on(jnp.zeros((batch,), jnp.int32), mesh)
    while True:
        # ---- admit: new sequences into empty rows, continuations in place (or afresh when they do not fit)
        fresh: dict[int, list[int]] = {}  # row -> a whole sequence to prefill from position 0
        for r in range(batch):
            if item[r] is None:
                nxt = next(todo, None)
                if nxt is None:
                    break
                if not len(nxt[1]):
                    raise ValueError(f"prompt {nxt[0]} is empty")
                item[r], fresh[r] = Finished(nxt[0]), list(nxt[1])
                turn_t[r], turn_l[r] = [], []
        width = rnd(max(map(len, (*feed.values(), *fresh.values())), default=0))
        while moved := [r for r in feed if not fits(used[r], width)]:
            for r in moved:
                fresh[r] = seq[r] + feed.pop(r)
                width = max(width, rnd(len(fresh[r])))
        for r, toks in fresh.items():
            if not fits(0, rnd(len(toks))):
                what = f"prompt {item[r].index}" if not item[r].turns else f"conversation {item[r].index}"
                raise ValueError(f"{what}: {len(toks)} tokens + max_new_tokens={sp.max_new_tokens} do not fit "
                                 f"max_len={max_len}")
        if all(x is None for x in item):
            return
        chunk = {**feed, **fresh}
        if chunk:
            if fresh:
                state = _empty_rows(state, _rows_on(jnp.asarray(np.isin(np.arange(batch), list(fresh))), mesh), cfg,
                                    mesh)
            fed = _rows_on(jnp.asarray(np.isin(np.arange(batch), list(chunk))), mesh)
            k = min(batch, 1 << (len(chunk) - 1).bit_length())  # rows run: the fed ones, padded to a power of 2
            if k < batch:  # + rows appending nothing (their state comes back unchanged)
                rows = sorted(chunk) + [r for r in range(batch) if r not in chunk][:k - len(chunk)]
                toks, valid = left_pad([chunk.get(r, []) for r in rows], 0, width)
                sub_logits, state = _append_rows(p, _rows_on(toks, mesh), _rows_on(valid, mesh), state,
                                                 jnp.asarray(rows, jnp.int32), cfg, opts, mesh)
                new_logits = logits.at[jnp.asarray(rows, jnp.int32)].set(sub_logits)
            else:
                new_logits, state = _run_chunk(p, [chunk.get(r, []) for r in range(batch)], state, cfg, opts, None, 0,
                                               width)
            logits, done, budget = _merge_fed(fed, new_logits, logits, done, budget, sp.max_new_tokens)
            for r, toks in chunk.items():
                seq[r] = (seq[r] if r in feed else []) + toks
            feed = {}
        # ---- decode a few steps, then read which rows finished their turn (admission left each going row room
        # for a whole turn)
        steps = []
        for _ in range(check_every):
            key, sub = jax.random.split(key)
            tok, lp, act, logits, state, done, budget = _decode_rows(p, logits, state, done, budget, sub, cfg, opts,
                                                                     sp, mesh)
            steps.append((tok, lp, act))
        T, L, A = (np.asarray(jnp.stack(x, 0)) for x in zip(*steps))
        D, used = np.asarray(done), np.asarray(state.pos)
        for r in range(batch):
            if item[r] is None:
                continue
            got = A[:, r]
            turn_t[r] += T[got, r].tolist()
            turn_l[r] += L[got, r].tolist()
            if not D[r]:
                continue
            f, toks = item[r], turn_t[r]
            f.turns.append((toks, turn_l[r], "stop" if toks and toks[-1] in stop_ids else "length"))
            seq[r] = seq[r] + toks
            turn_t[r], turn_l[r] = [], []
            more = next_turn(f.index, f.turns) if next_turn is not None else None
            if more:
                feed[r] = list(more)
            else:
                item[r] = None
                yield f


# --------------------------------------------------------------------------- CLI
def cli_generate(a):
    import sys

    from nemo_jax.data.chat import ChatTokenizer

    mesh = None
    if getattr(a, "mesh", None):
        from nemo_jax.parallel.mesh import make_mesh, read_mesh_sizes

        sizes = read_mesh_sizes(a.mesh)
        mesh = make_mesh(sizes, devices_per_node=sizes.pop("devices_per_node", 0))
    cfg, params, tok_dir = load_for_generation(a.ckpt, mesh=mesh, dtype=jnp.float32)
    tok = ChatTokenizer.load(a.tokenizer or tok_dir)
    images = None
    if a.image:
        ids, images = prompt_images(tok, cfg, a.prompt, a.image, chat_template=not a.no_chat_template)
    else:
        text = a.prompt if a.no_chat_template else tok.render([{"role": "user", "content": a.prompt}],
                                                              add_generation_prompt=True)
        ids = tok.tokenizer.encode(text, add_special_tokens=False).ids
    eos = cfg.eos_token_id if isinstance(cfg.eos_token_id, list) else [cfg.eos_token_id]
    stop = tuple(sorted({*(x for x in eos if x is not None), *tok.eos_ids()}))
    sp = SamplingParams(max_new_tokens=a.max_new_tokens, temperature=a.temperature, top_k=a.top_k, top_p=a.top_p,
                        stop_token_ids=stop)
    printed: list[int] = []
    shown = [""]

    def on_token(i, t, done):
        if bool(done[0]):
            return
        printed.append(int(t[0]))
        s = tok.tokenizer.decode(printed, skip_special_tokens=True)
        sys.stdout.write(s[len(shown[0]):])
        sys.stdout.flush()
        shown[0] = s

    g = generate(params, [ids], cfg, sp, key=jax.random.key(a.seed), on_token=on_token, images=images)
    sys.stdout.write("\n")
    print(f"[{len(g.tokens[0])} tokens, finish: {g.finish_reason[0]}, "
          f"mean logprob {np.mean(g.logprobs[0]) if g.logprobs[0] else 0.0:.3f}]", file=sys.stderr)


# A model from any path (native, HF, run dir, RUN/checkpoints/N): one resolver for every command.
from nemo_jax.sources import load_for_generation, restore_run_params  # noqa: E402,F401
