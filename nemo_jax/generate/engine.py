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
from dataclasses import dataclass, field, replace

import jax
import jax.numpy as jnp
import numpy as np

from nemo_jax.lora import attach
from nemo_jax.model import model as M
from nemo_jax.model.cache import (DecodeState, init_decode_state, state_shardings, unstack_shardings,
                                  unstack_state)
from nemo_jax.model.vision import check_images
from nemo_jax.model.mamba2 import MambaState


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 64
    temperature: float = 1.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None  # the Engine: a sequence's draws depend only on it (and the tokens), not on its batch
    # the Engine only (`generate` refuses them), as vLLM applies them, in this order: logit_bias and min_tokens,
    # then the penalties, then temperature / top-k / top-p (`process_logits`)
    presence_penalty: float = 0.0  # minus this on every token the turn has sampled
    frequency_penalty: float = 0.0  # minus this times the times the turn has sampled the token
    repetition_penalty: float = 1.0  # tokens of the prompt or the turn: logits > 0 divided by it, < 0 multiplied
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit) pairs
    min_tokens: int = 0  # stop ids (and stop strings) are held off until the turn has this many tokens
    stop: tuple[str, ...] = ()  # stop strings: the turn ends at the token completing one (the Engine's token_bytes)
    top_logprobs: int = 0  # the Engine returns this many most likely tokens at each step (TurnEnd.top)

    def __post_init__(self):
        if not 1 <= self.max_new_tokens < _I32:
            raise ValueError(f"max_new_tokens must be >= 1 (got {self.max_new_tokens})")
        if not (0 <= self.temperature < float("inf") and 0 < self.top_p <= 1 and 0 <= self.top_k < _I32):
            raise ValueError(f"sampling: temperature >= 0, 0 < top_p <= 1, 0 <= top_k < 2^31 (got {self.temperature}, "
                             f"{self.top_p}, {self.top_k})")
        bad = [t for t in self.stop_token_ids if not 0 <= t < _I32]
        if bad:
            raise ValueError(f"sampling: stop token id {bad[0]} is not in [0, 2^31)")
        pen = (self.presence_penalty, self.frequency_penalty, self.repetition_penalty)
        if not all(abs(x) < float("inf") for x in pen) or not self.repetition_penalty > 0:
            raise ValueError(f"sampling: finite presence / frequency penalties and a repetition penalty > 0 (got {pen})")
        if any(not 0 <= t < _I32 or not abs(b) < float("inf") for t, b in self.logit_bias):
            raise ValueError("sampling: logit_bias takes token ids in [0, 2^31) and finite biases")
        if not 0 <= self.min_tokens <= self.max_new_tokens:
            raise ValueError(f"sampling: 0 <= min_tokens <= max_new_tokens (got {self.min_tokens}, "
                             f"{self.max_new_tokens})")
        if not 0 <= self.top_logprobs <= 1024:
            raise ValueError(f"sampling: 0 <= top_logprobs <= 1024 (got {self.top_logprobs})")
        if any(not isinstance(x, str) or not 0 < len(x.encode()) <= MAX_STOP_BYTES for x in self.stop):
            raise ValueError(f"sampling: stop strings of 1 to {MAX_STOP_BYTES} UTF-8 bytes (got {self.stop!r:.200})")

    @property
    def processed(self) -> bool:
        """Does it ask for more than temperature / top-k / top-p (what only the Engine samples)?"""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.logit_bias or self.min_tokens or self.stop or self.top_logprobs)


_I32 = 2 ** 31
MAX_STOP_BYTES = 256  # the longest stop string the Engine matches in its decode step
TOP_LOGPROBS = 20  # the Engine's step with extras returns this many alternatives (more when a row asks for more)
# the least widths of the Engine's per-row arrays (rounded up to powers of two beyond): few compiled shapes
MIN_WIDTHS = {"stops": 8, "bias": 16, "stop_strings": 4, "stop_bytes": 32, "prompt": 256}


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
    return _draw(jax.random.uniform(key, (lp.shape[0], 1), jnp.float32), lp)


def _draw(u: jax.Array, lp: jax.Array) -> jax.Array:
    """`_inverse_cdf_draw` with the uniforms u [b, 1] in [0, 1) given."""
    p = jnp.exp(lp - jnp.max(lp, axis=-1, keepdims=True))
    cdf = jnp.cumsum(p, axis=-1)
    u = u * cdf[:, -1:]
    last = lp.shape[-1] - 1 - jnp.argmax((p > 0)[:, ::-1], axis=-1)  # rounding never reaches past it
    return jnp.minimum(jnp.sum(cdf <= u, axis=-1), last).astype(jnp.int32)


def row_sampling_logprobs(logits: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array, *,
                          k_max: int = 0, nucleus: bool = False) -> jax.Array:
    """`sampling_logprobs` with per-row parameters: logits [b, V], temperature / top_k / top_p [b] (a row with
    temperature 0 is greedy: its distribution is the untempered one, as `sample_token` gives). Static `k_max` >=
    every row's top_k (0: no row truncates to its top k; >= V: any top k, read off the sort the nucleus uses) and
    `nucleus` (some row has top_p < 1) leave the truncations out of the compiled step when no row asks for them."""
    t = jnp.where(temperature > 0, temperature, 1.0).astype(jnp.float32)
    x = logits.astype(jnp.float32) / t[:, None]
    V = x.shape[-1]
    order = sorted_x = None
    if nucleus or k_max >= V:  # one sort serves both truncations (k_max >= V: any row's top k, read off it)
        order = jnp.argsort(-x, axis=-1)
        sorted_x = jnp.take_along_axis(x, order, axis=-1)
    if k_max:
        top = sorted_x if k_max >= V else jax.lax.top_k(x, k_max)[0]
        kth = jnp.take_along_axis(top, jnp.clip(top_k - 1, 0, min(k_max, V) - 1)[:, None], axis=-1)
        cut = (top_k[:, None] > 0)
        x = jnp.where(cut & (x < kth), -jnp.inf, x)
        if sorted_x is not None:  # (the same order: the cut entries are the sorted tail)
            sorted_x = jnp.where(cut & (sorted_x < kth), -jnp.inf, sorted_x)
    if nucleus:
        p = jax.nn.softmax(sorted_x, axis=-1)
        before = jnp.cumsum(p, axis=-1) - p  # mass strictly before each token
        keep_sorted = (before < top_p[:, None]) | (top_p[:, None] >= 1.0)
        keep = jnp.take_along_axis(keep_sorted, jnp.argsort(order, axis=-1), axis=-1)
        x = jnp.where(keep, x, -jnp.inf)
    return jax.nn.log_softmax(x, axis=-1)


def sample_rows(logits: jax.Array, u: jax.Array, temperature, top_k, top_p, *, k_max: int = 0,
                nucleus: bool = False):
    """One token per row with per-row parameters (`row_sampling_logprobs`) and per-row uniforms u [b] ->
    (token [b] int32, its logprob [b] under the distribution drawn from; greedy rows: argmax)."""
    lp = row_sampling_logprobs(logits, temperature, top_k, top_p, k_max=k_max, nucleus=nucleus)
    tok = jnp.where(temperature > 0, _draw(u[:, None], lp), jnp.argmax(logits, axis=-1).astype(jnp.int32))
    return tok, jnp.take_along_axis(lp, tok[:, None], axis=-1)[:, 0]


# --------------------------------------------------------------------------- the Engine's sampling in the loop
@dataclass(frozen=True)
class RowSampling:
    """What the rows sampling now ask for: the static shape of the Engine's decode step (each combination compiles
    once; rows asking for none of the extras sample exactly as `sample_rows`)."""
    k_max: int = 0  # >= every row's top_k (0: no row truncates to its top k)
    nucleus: bool = False  # some row has top_p < 1
    adjust: bool = False  # some row has penalties, a logit_bias or min_tokens (one variant for the three: few
    # compiled steps; rows without them carry neutral values)
    top_n: int = 0  # alternatives returned per row and step (>= every row's top_logprobs)
    stop_strings: bool = False  # some row has stop strings


def process_logits(logits: jax.Array, rows: dict, how: RowSampling) -> jax.Array:
    """logits [b, V] -> the logits each row samples from before temperature, top-k and top-p, built as vLLM's
    sampler builds them: `bias` [b, B] added at `bias_ids` [b, B] (ids >= V pad); the row's stop ids `stops` [b, S]
    (-1 pads) at -inf while its turn has fewer than `min_tokens` [b] tokens (`count` - `turn0`); then the
    repetition penalty on tokens of the prompt (`seen` [b, V]) or of the turn (`counts` [b, V] > 0): logits > 0
    divided by it, the others multiplied; then minus `frequency` x counts and `presence` x (counts > 0).
    Unless `how.adjust` the logits come back untouched."""
    if not how.adjust:
        return logits
    x = logits.astype(jnp.float32)
    b, V = x.shape
    r = jnp.arange(b)[:, None]
    x = x.at[r, rows["bias_ids"]].add(rows["bias"], mode="drop")
    held = (rows["count"] - rows["turn0"] < rows["min_tokens"])[:, None] & (rows["stops"] >= 0)
    x = x.at[r, jnp.where(held, rows["stops"], V)].set(-jnp.inf, mode="drop")
    counts = rows["counts"]
    out = counts > 0
    rep = jnp.where(rows["seen"] | out, rows["repetition"][:, None], 1.0)
    x = jnp.where(x > 0, x / rep, x * rep)
    return x - rows["frequency"][:, None] * counts - rows["presence"][:, None] * out


def stop_string_hits(tail: jax.Array, new: jax.Array, n: jax.Array, stop_bytes: jax.Array, stop_lens: jax.Array):
    """Stop strings matched on the bytes of each row's turn text, across token boundaries.

    tail [b, T]: the last T bytes of the text so far (-1 where there is none); new [b, L]: the sampled token's
    bytes, the first n [b] of them valid; stop_bytes [b, S, W] (W <= T): each stop string's UTF-8 bytes
    right-aligned, stop_lens [b, S] their lengths (0: no string). -> (hit [b]: a stop string ends inside the new
    bytes, the new tail [b, T]). Stop strings that ended earlier were seen then: only matches ending in the new
    bytes count."""
    b, T = tail.shape
    L, W = new.shape[1], stop_bytes.shape[-1]
    at = jnp.arange(L)
    new = jnp.where(at[None] < n[:, None], new.astype(jnp.int32), -1)
    cat = jnp.concatenate([tail, new], axis=1)  # [b, T + L]: the tail, the n new bytes, padding
    src = jnp.arange(T + L)[None] - (L - n)[:, None]  # right-aligned: the last new byte at T + L - 1
    out = jnp.where(src >= 0, jnp.take_along_axis(cat, jnp.maximum(src, 0), axis=1), -1)
    ends = T + L - at  # [L] the match ending after the k-th last byte (valid for k < n)
    win = out[:, ends[:, None] - W + jnp.arange(W)[None, :]]  # [b, L, W]
    mine = jnp.arange(W)[None, None] >= W - stop_lens[..., None]  # [b, S, W] the string's own bytes
    eq = (win[:, None] == stop_bytes[:, :, None, :]) | ~mine[:, :, None, :]  # [b, S, L, W]
    ok = jnp.all(eq, axis=-1) & (stop_lens[..., None] > 0) & (at[None, None] < n[:, None, None])
    return jnp.any(ok, axis=(1, 2)), out[:, L:]


def token_table(token_bytes, vocab_size: int, width: int = 128) -> tuple[np.ndarray, np.ndarray]:
    """Each token's text as bytes (ids beyond the list: none) -> (bytes [V, L] uint8, lengths [V] int32), L the
    longest token's length rounded up to a power of 2 (at most `width`: a longer token keeps its last L bytes)."""
    longest = max((len(x) for x in token_bytes), default=1)
    L = min(_pow2(max(longest, 1)), width)
    tb, tl = np.zeros((vocab_size, L), np.uint8), np.zeros(vocab_size, np.int32)
    for i, x in enumerate(token_bytes[:vocab_size]):
        x = x[-L:]
        tb[i, :len(x)] = np.frombuffer(x, np.uint8)
        tl[i] = len(x)
    return tb, tl


def sample_step(logits: jax.Array, u: jax.Array, rows: dict, hist: dict, tables: dict, active: jax.Array,
                how: RowSampling):
    """The Engine's sampling of one decode step: `process_logits`, then one token per row from its
    temperature / top-k / top-p distribution (`sample_rows`; greedy rows: the argmax of the processed logits).
    `hist`: the rows' running arrays (`counts` [b, V] of the turn's tokens and `seen` [b, V] prompt tokens for the
    penalties, `tail` [b, T] for stop strings); `tables`: the token byte table (`token_table`) for stop strings.
    -> (token [b], its logprob [b], stop-string hit [b], updated hist, top (ids, logprobs) [b, top_n] or None)."""
    b = logits.shape[0]
    rows = {**rows, **hist}
    x = process_logits(logits, rows, how)
    lp = row_sampling_logprobs(x, rows["temperature"], rows["top_k"], rows["top_p"], k_max=how.k_max,
                               nucleus=how.nucleus)
    tok = jnp.where(rows["temperature"] > 0, _draw(u[:, None], lp), jnp.argmax(x, axis=-1).astype(jnp.int32))
    hist = dict(hist)
    if how.adjust:
        hist["counts"] = hist["counts"].at[jnp.arange(b), tok].add(active.astype(jnp.int32))
    hit = jnp.zeros((b,), bool)
    if how.stop_strings:
        new, n = tables["bytes"][tok], tables["lens"][tok]
        hit, tail = stop_string_hits(hist["tail"], new, n, rows["stop_bytes"], rows["stop_lens"])
        if how.adjust:  # (vLLM: stop strings count once the turn has more than min_tokens tokens)
            hit = hit & (rows["count"] - rows["turn0"] + 1 > rows["min_tokens"])
        hist["tail"] = jnp.where(active[:, None], tail, hist["tail"])
    top = None
    if how.top_n:
        vals, ids = jax.lax.top_k(lp, how.top_n)
        top = (ids, vals)
    return tok, jnp.take_along_axis(lp, tok[:, None], axis=-1)[:, 0], hit & active, hist, top


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
    """Constrain a state (inside jit) to its `state_shardings` (held per layer: `unstack_shardings`), so the donated
    buffers are reused in place."""
    if mesh is None:
        return state
    per_layer = state.row_axis == 0
    kv = state.kv[0] if per_layer and state.kv else state.kv
    sh = state_shardings(cfg, state.valid.shape[0], state.valid.shape[1], mesh,
                         dtype=kv.k.dtype if kv is not None else jnp.float32)
    return jax.lax.with_sharding_constraint(state, unstack_shardings(sh, cfg) if per_layer else sh)


def _committed(tree):
    """`tree`'s arrays committed to the default device. A jitted function's outputs are committed and its compiled
    programs are keyed by their arguments' placement: the Engine commits what it makes too, so that a first call
    (made arrays) and the later ones (outputs) share one compiled program."""
    return jax.device_put(tree, jax.config.jax_default_device or jax.devices()[0])


def _rows_on(x, mesh):
    """Put a [b, ...] host array on `mesh` with its rows over the batch axes (without a mesh: committed to the
    default device, see `_committed`)."""
    if mesh is None:
        return _committed(x)
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
    if sp.processed:
        raise ValueError("generate: penalties, logit_bias, min_tokens, stop strings and top_logprobs are sampled by "
                         "the Engine (continuous_generate, nemo-jax serve)")
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
    step_sp = replace(sp, max_new_tokens=1, seed=None)  # what the step reads: one program for every budget
    toks, lps, stops = [], [], []
    for i in range(sp.max_new_tokens):
        key, sub = jax.random.split(key)
        tok, lp, stop, last_logits, state = _decode_and_sample(p, last_logits, state, done, sub, cfg, opts, step_sp,
                                                               mesh)
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


# --------------------------------------------------------------------------- continuous batching: the engine
@dataclass
class TurnEnd:
    """A sampled turn of an `Engine` sequence. The sequence is parked after it: `feed` or `release` it."""
    seq_id: int
    tokens: list[int]
    logprobs: list[float]  # of each token under the distribution it was drawn from
    finish_reason: str  # "stop" (a stop token, the last of `tokens`, or a stop string) | "length" (max_new_tokens)
    version: int  # the adapter version that sampled it (the oldest, when `set_adapters` came mid-turn)
    tag: object = None  # what `submit` was given
    versions: tuple[int, ...] = ()  # every adapter version that sampled a token of the turn
    top: list | None = None  # sp.top_logprobs > 0: per token [(id, logprob), ...], the most likely first
    stop: str | None = None  # the stop string that ended the turn (finish_reason "stop"), if one did


@dataclass
class _Seq:
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


def _pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


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
        self._seqs: dict[int, _Seq] = {}
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
            self._seqs[sid] = _Seq(sid, sp, tag, key, new=tokens, new_pics=pics)
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
            self._p = attach(self.params, _unstacked(adapters))
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
        b, rnd = self.batch, lambda n: -(-n // self.bucket) * self.bucket
        stopped, self._stopped = self._stopped, set()
        plan: dict[int, tuple[_Seq, bool]] = {}  # row -> (sequence, whole: prefilled from position 0)
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
        stopped -= set(plan)  # (a row refilled now decodes its new sequence)
        fresh = {r: s for r, (s, w) in plan.items() if w}
        feed = {r: s for r, (s, w) in plan.items() if not w}
        for s in fresh.values():
            s.new, s.new_pics, s.held, s.pics = s.held + s.new, s.pics + s.new_pics, [], []
        chunk = {**feed, **fresh}
        if not chunk and not stopped:
            return
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

    def _seqs_row(self, r: int) -> _Seq:
        return self._seqs[self.rows[r]]

    def _upload_rows(self, started: set[int]) -> None:
        """The per-row sampling arrays of the rows now sampling (the others' entries are unused); rows `started`
        (a turn begins) get fresh running arrays (`sample_step`'s hist)."""
        b, V = self.batch, self.cfg.vocab_size
        live = {r: self._seqs_row(r) for r in sorted(self._decoding)}
        sps = [s.sp for s in live.values()]
        S = _pow2(max([len(sp.stop_token_ids) for sp in sps] + [MIN_WIDTHS["stops"]]))
        temp, top_k, top_p = np.zeros(b, np.float32), np.zeros(b, np.int32), np.ones(b, np.float32)
        stops, count = np.full((b, S), -1, np.int32), np.zeros(b, np.int32)
        key = np.zeros((b,) + next(iter(live.values())).key.shape if live else (b, 2), np.uint32)
        for r, s in live.items():
            sp = s.sp
            if sp.temperature > 0:  # greedy rows keep the untruncated distribution (their logprobs)
                temp[r], top_k[r], top_p[r] = sp.temperature, sp.top_k, sp.top_p
            stops[r, :len(sp.stop_token_ids)] = sp.stop_token_ids
            key[r], count[r] = s.key, s.sampled
        how = self.row_sampling(sps)
        rows = dict(temperature=temp, top_k=top_k, top_p=top_p, stops=stops, key=key, count=count)
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
                self._tables = _committed({"bytes": jnp.asarray(tb), "lens": jnp.asarray(tl)})
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
        from one sort, penalties, logit_bias, min_tokens, stop strings, TOP_LOGPROBS alternatives), so that a
        server compiles two decode steps, not one per combination of what its requests ask for."""
        sps = list(sps)
        if not any(sp.processed or (sp.temperature > 0 and (sp.top_k or sp.top_p < 1)) for sp in sps):
            return RowSampling()
        V = self.cfg.vocab_size
        top = max([sp.top_logprobs for sp in sps] + [TOP_LOGPROBS])
        return RowSampling(k_max=V, nucleus=True, adjust=True, top_n=min(_pow2(top), V),
                           stop_strings=self._token_bytes is not None)

    def _stop_string(self, s: _Seq) -> str | None:
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
            T, L, A, H, top = jax.device_get((T, L, A, H, top))
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
            T, L, A, H = (np.asarray(jnp.stack(x, 0)) for x in zip(*steps))
            top = tuple(np.asarray(jnp.stack(x, 0)) for x in zip(*tops)) if how.top_n else None
        if extras:
            self._hist = hist
        if how.top_n:
            TI, TV = top
        D = np.asarray(self._done)
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
    stop = tuple(sorted({*cfg.eos_ids, *tok.eos_ids()}))
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

    # the mesh in the options too: the kernels run per device inside shard_map (GSPMD does not partition them)
    opts = M.Options(kernels=getattr(a, "kernels", "auto"), mesh=mesh if mesh is not None and mesh.size > 1 else None)
    g = generate(params, [ids], cfg, sp, key=jax.random.key(a.seed), opts=opts, on_token=on_token, images=images)
    sys.stdout.write("\n")
    print(f"[{len(g.tokens[0])} tokens, finish: {g.finish_reason[0]}, "
          f"mean logprob {np.mean(g.logprobs[0]) if g.logprobs[0] else 0.0:.3f}]", file=sys.stderr)


# A model from any path (native, HF, run dir, RUN/checkpoints/N): one resolver for every command.
from nemo_jax.sources import load_for_generation, restore_run_params  # noqa: E402,F401
