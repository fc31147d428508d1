"""NoPE grouped-query attention: no RoPE, no QK-norm, no biases, scale head_dim**-0.5, causal.

q head i reads kv head i // (nh / nkv). Logits and softmax in fp32.
Training: `segment_ids` mask attention across packed documents. Cached: a KV cache of fixed length
with a per-slot validity mask; all rows share the write position `pos` (prompts are left-padded).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from nemo_jax.model.layers import linear
from nemo_jax.parallel.mesh import all_gather_f32_grad, context_shards

_NEG = -1e30


class KVCache(NamedTuple):
    k: jax.Array  # [b, S, nkv, hd]
    v: jax.Array  # [b, S, nkv, hd]


def _attend(q, k, v, mask, dtype):
    """q [b, l, kv, r, hd], k/v [b, s, kv, hd], mask [b, l, s] -> [b, l, kv*r*hd]."""
    hd = q.shape[-1]
    logits = jnp.einsum("blkrh,bskh->bkrls", q, k, preferred_element_type=jnp.float32) * (hd ** -0.5)
    logits = jnp.where(mask[:, None, None], logits, _NEG)
    probs = jax.nn.softmax(logits, axis=-1)
    out = jnp.einsum("bkrls,bskh->blkrh", probs.astype(dtype), v, preferred_element_type=jnp.float32)
    b, l = q.shape[:2]
    return out.astype(dtype).reshape(b, l, -1)


def _attend_blocked(q, k, v, segment_ids, dtype, block: int):
    """Causal `_attend` in query blocks: block [s, e) reads only keys [0, e), so the upper triangle is never
    computed (about half the logits, softmax and FLOPs of the full [l, l] form)."""
    l = q.shape[1]
    block = max(block, -(-l // MAX_BLOCKS))
    pos = jnp.arange(l)
    outs = []
    for s in range(0, l, block):
        e = min(l, s + block)
        mask = (pos[s:e, None] >= pos[None, :e])[None]
        if segment_ids is not None:
            mask = mask & (segment_ids[:, s:e, None] == segment_ids[:, None, :e])
        outs.append(_attend(q[:, s:e], k[:, :e], v[:, :e], mask, dtype))
    return jnp.concatenate(outs, axis=1)


def _attend_context(q, k, v, segment_ids, dtype, block: int, mesh):
    """Causal `_attend` of a sequence split over the mesh's `context` axis (other axes left to GSPMD): each
    shard all-gathers K/V (cheap with few KV heads) and attends its own queries, in blocks of `block`, over the
    keys at or before them (global positions)."""
    from jax.sharding import PartitionSpec as P

    def local(q, k, v, seg):
        lc = q.shape[1]
        kg, vg = (all_gather_f32_grad(a, "context", 1) for a in (k, v))
        qpos = jax.lax.axis_index("context") * lc + jnp.arange(lc)
        kpos = jnp.arange(kg.shape[1])
        sg = None if seg is None else jax.lax.all_gather(seg, "context", axis=1, tiled=True)
        step = max(block, -(-lc // MAX_BLOCKS))
        outs = []
        for s in range(0, lc, step):
            e = min(lc, s + step)
            mask = (qpos[s:e, None] >= kpos[None, :])[None]
            if seg is not None:
                mask = mask & (seg[:, s:e, None] == sg[:, None, :])
            outs.append(_attend(q[:, s:e], kg, vg, mask, dtype))
        return jnp.concatenate(outs, axis=1)

    seq = P(None, "context")
    return jax.shard_map(local, mesh=mesh, in_specs=(seq, seq, seq, None if segment_ids is None else seq),
                         out_specs=seq, axis_names={"context"}, check_vma=False)(q, k, v, segment_ids)


def _zigzag_pairs(n: int, e):
    """Device e's work in the balanced causal split of 2n half-shards: its query half-shards a = e and
    b = 2n-1-e, and the 2n+1 (query slot, key half-shard) pairs they need (a: 0..e, b: 0..2n-1-e)."""
    p = jnp.arange(2 * n + 1)
    slot_b = p > e
    return slot_b, jnp.where(slot_b, p - (e + 1), p)


def _attend_context_balanced(q, k, v, segment_ids, dtype, mesh):
    """Causal attention of a sequence split over `context` with the work balanced (the 'zigzag' split): the
    sequence is cut into 2n half-shards; device e computes the queries of half-shards e and 2n-1-e (moved in
    and back with two collective permutes each) over the keys before them, 2n+1 blocks of [h, h] for every
    device (online softmax), against all-gathered K/V. FLOPs over all devices ~ (2n+1)/2n of one device's
    causal attention, where `_attend_context` (the reference) computes every query against every key."""
    from jax.sharding import PartitionSpec as P

    n = mesh.shape["context"]
    # half-shard j lives on device j // 2 and is computed on device j (j < n) or 2n-1-j: in a permute of
    # first halves (j even) and one of second halves (j odd), every device sends one and receives one
    dest = lambda j: j if j < n else 2 * n - 1 - j  # noqa: E731
    firsts = [(d, dest(2 * d)) for d in range(n)]
    seconds = [(d, dest(2 * d + 1)) for d in range(n)]

    def local(q, k, v, seg):
        b, lc = q.shape[:2]
        h = lc // 2
        e = jax.lax.axis_index("context")
        kg, vg = (all_gather_f32_grad(a, "context", 1) for a in (k, v))  # [b, 2nh, kv, hd]
        sg = None if seg is None else jax.lax.all_gather(seg, "context", axis=1, tiled=True)
        one = jax.lax.ppermute(q[:, :h], "context", firsts)
        two = jax.lax.ppermute(q[:, h:], "context", seconds)
        even = e % 2 == 0  # half-shard e arrives in the first permute when e is even
        qa, qb = jnp.where(even, one, two), jnp.where(even, two, one)  # queries of half-shards e, 2n-1-e
        start = jnp.stack([e * h, (2 * n - 1 - e) * h])  # their first positions
        slot_b, kblock = _zigzag_pairs(n, e)
        kv, r, hd = q.shape[2], q.shape[3], q.shape[4]
        init = (jnp.full((2, b, kv, r, h), _NEG, jnp.float32), jnp.zeros((2, b, kv, r, h), jnp.float32),
                jnp.zeros((2, b, h, kv, r, hd), jnp.float32))

        def step(carry, pair):
            m, s, acc = carry
            is_b, kb = pair
            qi = jnp.where(is_b, qb, qa)
            ks, vs = (jax.lax.dynamic_slice_in_dim(a, kb * h, h, axis=1) for a in (kg, vg))
            qpos = start[is_b.astype(jnp.int32)] + jnp.arange(h)
            kpos = kb * h + jnp.arange(h)
            mask = (qpos[:, None] >= kpos[None, :])[None]
            if sg is not None:
                qs = jax.lax.dynamic_slice_in_dim(sg, start[is_b.astype(jnp.int32)], h, axis=1)
                mask = mask & (qs[:, :, None] == jax.lax.dynamic_slice_in_dim(sg, kb * h, h, axis=1)[:, None, :])
            logits = jnp.einsum("blkrh,bskh->bkrls", qi, ks, preferred_element_type=jnp.float32) * (hd ** -0.5)
            logits = jnp.where(mask[:, None, None], logits, _NEG)
            j = is_b.astype(jnp.int32)
            m_new = jnp.maximum(m[j], logits.max(-1))
            scale = jnp.exp(m[j] - m_new)
            pr = jnp.exp(logits - m_new[..., None])
            s_new = s[j] * scale + pr.sum(-1)
            a_new = acc[j] * jnp.moveaxis(scale, 3, 1)[..., None] + jnp.einsum(
                "bkrls,bskh->blkrh", pr.astype(dtype), vs, preferred_element_type=jnp.float32)
            return (m.at[j].set(m_new), s.at[j].set(s_new), acc.at[j].set(a_new)), None

        # each block's logits are recomputed in the backward (only the running max / sum / output are saved)
        (m, s, acc), _ = jax.lax.scan(jax.checkpoint(step), init, (slot_b, kblock))
        out = (acc / jnp.moveaxis(s, 4, 2)[..., None]).astype(dtype)  # [2, b, h, kv, r, hd]
        oa, ob = out[0], out[1]
        # back: half-shard j's result returns from where it was computed to device j // 2 (inverse permutes)
        back_one = jax.lax.ppermute(jnp.where(even, oa, ob), "context", [(t, f) for f, t in firsts])
        back_two = jax.lax.ppermute(jnp.where(even, ob, oa), "context", [(t, f) for f, t in seconds])
        return jnp.concatenate([back_one, back_two], axis=1).reshape(b, lc, -1)

    seq = P(None, "context")
    return jax.shard_map(local, mesh=mesh, in_specs=(seq, seq, seq, None if segment_ids is None else seq),
                         out_specs=seq, axis_names={"context"}, check_vma=False)(q, k, v, segment_ids)


def _cached_mask(valid_cache, pos, start, l: int):
    """Mask [b, l, S] of chunk queries at positions pos + start + [0, l) over cache slots: causal and valid."""
    S = valid_cache.shape[1]
    causal = jnp.arange(S)[None, :] <= (pos + start + jnp.arange(l))[:, None]  # [l, S]
    return causal[None] & valid_cache[:, None, :]


def _attend_cached_blocked(q, kc, vc, valid_cache, pos, dtype, block: int):
    """Cached `_attend` in query blocks: q [b, l, kv, r, hd] over the whole cache kc/vc [b, S, kv, hd]; one
    block of `block` queries at a time (`lax.map`), so the logits held are [b, heads, block, S], not
    [b, heads, l, S]: prefill memory grows linearly in the prompt length. -> [b, l, kv*r*hd]."""
    b, l = q.shape[:2]
    if l <= block:
        return _attend(q, kc, vc, _cached_mask(valid_cache, pos, 0, l), dtype)
    n = -(-l // block)
    qp = jnp.pad(q, ((0, 0), (0, n * block - l)) + ((0, 0),) * (q.ndim - 2))
    qb = jnp.moveaxis(qp.reshape((b, n, block) + q.shape[2:]), 1, 0)  # [n, b, block, kv, r, hd]

    def one(args):
        qi, i = args
        return _attend(qi, kc, vc, _cached_mask(valid_cache, pos, i * block, block), dtype)

    out = jax.lax.map(one, (qb, jnp.arange(n, dtype=jnp.int32)))  # [n, b, block, kv*r*hd]
    return jnp.moveaxis(out, 0, 1).reshape(b, n * block, -1)[:, :l]


IMPLEMENTATIONS = ("blocked", "full")
BLOCK = 128  # query rows per block (1x1024 on CPU: fwd+bwd ~150 ms vs ~300 ms for the full form)
MAX_BLOCKS = 16  # longer sequences get larger blocks, so the unrolled blocks (and compile time) stay bounded


def attention(p: dict, u: jax.Array, cfg, dtype, *, segment_ids=None, cache: KVCache | None = None,
              valid_cache=None, pos=None, impl: str = "blocked", block: int = BLOCK, mesh=None):
    """u [b, l, D] -> (out [b, l, D], new KVCache or None).

    Training (no cache): `impl` "blocked" runs query blocks of `block` rows over their key prefixes; "full"
    is the plain [l, l] masked reference. With `cache`: "blocked" attends `block` queries at a time over the
    cache (`_attend_cached_blocked`), "full" the whole chunk at once (reference). The chunk's keys/values are written at
    [pos, pos+l); `valid_cache` [b, S] is the validity of every cache slot *after* the write (the caller owns
    it, shared by all layers). Training on a `mesh` with a `context` axis: the sequence split over it
    (`_attend_context`).
    """
    b, l, _ = u.shape
    nh, nkv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    q = linear(u, p["q_proj"], dtype).reshape(b, l, nkv, nh // nkv, hd)
    k = linear(u, p["k_proj"], dtype).reshape(b, l, nkv, hd)
    v = linear(u, p["v_proj"], dtype).reshape(b, l, nkv, hd)
    if cache is None and context_shards(mesh, l) > 1:
        if impl == "blocked" and (l // context_shards(mesh, l)) % 2 == 0:
            out = _attend_context_balanced(q, k, v, segment_ids, dtype, mesh)
        else:
            out = _attend_context(q, k, v, segment_ids, dtype, block if impl == "blocked" else l, mesh)
        new_cache = None
    elif cache is None:
        out = _attend_blocked(q, k, v, segment_ids, dtype, block if impl == "blocked" else l)
        new_cache = None
    else:
        kc = jax.lax.dynamic_update_slice(cache.k, k.astype(cache.k.dtype), (0, pos, 0, 0))
        vc = jax.lax.dynamic_update_slice(cache.v, v.astype(cache.v.dtype), (0, pos, 0, 0))
        if impl == "blocked":
            out = _attend_cached_blocked(q, kc.astype(dtype), vc.astype(dtype), valid_cache, pos, dtype, block)
        else:
            out = _attend(q, kc.astype(dtype), vc.astype(dtype), _cached_mask(valid_cache, pos, 0, l), dtype)
        new_cache = KVCache(kc, vc)
    return linear(out, p["o_proj"], dtype), new_cache

