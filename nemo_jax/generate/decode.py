"""Prefill and cached decode for the hybrid model, with behaviour logprobs.

* `prefill` runs left-padded prompts of different lengths through an empty `DecodeState`; padding never
  touches a Mamba state (dt = 0, conv taps skip it) and is masked out of attention.
* `decode_step` appends one token per row (static shapes, jitted); finished rows append nothing.
* `generate` ties them together and returns tokens, per-token logprobs and a finish reason per row; its
  state can be continued with `append` (tool results, the next user turn) without recomputing the prefix.
* LoRA adapters are applied unmerged: pass `adapters` (a tree mirroring the params; see nemo_jax.lora).
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, replace

import jax
import jax.numpy as jnp
import numpy as np

from nemo_jax.lora import attach
from nemo_jax.model import model as M
from nemo_jax.model.cache import (DecodeState, init_decode_state, state_shardings, unstack_shardings)
from nemo_jax.model.vision import check_images
from nemo_jax.generate.sampling import sample_token, SamplingParams


@dataclass
class Generation:
    tokens: list[list[int]]  # new tokens per row (up to and including a stop token)
    logprobs: list[list[float]]  # logprob of each under the distribution it was drawn from
    finish_reason: list[str]  # "stop" | "length"
    state: DecodeState  # continue with `append`
    last_logits: jax.Array  # [b, V] logits after the last appended token


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


def _whole_on(tree, mesh):
    """Put `tree` (tables, adapters: small next to the weights) whole on every device of `mesh` (without a mesh:
    committed to the default device, see `_committed`), so a jitted call mixing it with the sharded weights sees one
    device set."""
    if mesh is None:
        return _committed(tree)
    return jax.device_put(tree, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))


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
