"""NoPE grouped-query attention: no RoPE, no QK-norm, no biases, scale head_dim**-0.5, causal.

q head i reads kv head i // (nh / nkv). Logits and softmax in fp32.
Training: `segment_ids` mask attention across packed documents. Cached: a KV cache of fixed length
with a per-slot validity mask; each row has its own write position `pos[i]` (chunks are left-padded).
The functions here are the reference; `attention(kernels=...)` runs the accelerator kernels of
`nemo_jax.kernels` in their place (same masks, values and gradients).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from nemo_jax.kernels import REFERENCE, Selection, platform_of
from nemo_jax.kernels import attention as kernel_attn
from nemo_jax.model.layers import linear
from nemo_jax.parallel.mesh import all_gather_f32_grad, context_shards

_NEG = -1e30


class KVCache(NamedTuple):
    k: jax.Array  # [b, S, nkv, hd]
    v: jax.Array  # [b, S, nkv, hd]


def _attend(q, k, v, mask, dtype):
    """q [b, l, kv, r, hd], k/v [b, s, kv, hd], mask [b, l, s] -> [b, l, kv*r*hd]."""
    b, l = q.shape[:2]
    out = _attend_heads(q.transpose(0, 2, 3, 1, 4), k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3), mask, dtype)
    return out.transpose(0, 3, 1, 2, 4).reshape(b, l, -1)


def _attend_heads(q, k, v, mask, dtype):
    """Heads-major `_attend`: q [b, kv, r, l, hd], k/v [b, kv, s, hd], mask [b, l, s] -> [b, kv, r, l, hd] in
    `dtype`. Both einsums are batched matmuls over (b, kv) with the r query heads of a KV head as rows."""
    hd = q.shape[-1]
    logits = jnp.einsum("bkrlh,bksh->bkrls", q, k, preferred_element_type=jnp.float32) * (hd ** -0.5)
    logits = jnp.where(mask[:, None, None], logits, _NEG)
    probs = jax.nn.softmax(logits, axis=-1)
    return jnp.einsum("bkrls,bksh->bkrlh", probs.astype(dtype), v, preferred_element_type=jnp.float32).astype(dtype)


def _attend_blocked(q, k, v, segment_ids, dtype, block: int, checkpoint_blocks: bool = False):
    """Causal `_attend` in query blocks: block [s, e) reads only keys [0, e), so the upper triangle is never
    computed (about half the logits, softmax and FLOPs of the full [l, l] form). Heads-major throughout (one
    transpose in and one out, not one per block and einsum). `checkpoint_blocks`: each block is checkpointed,
    so the backward recomputes one block's fp32 logits at a time instead of keeping every block's
    probabilities ([b, heads, block, e] fp32 each: 16.8 GiB at Super's 8k rows on H100) alive for the whole
    layer's backward. XLA:GPU schedules the recomputations one by one (a 4k-row layer's attention backward:
    582 MiB of temporaries instead of 1951); XLA:CPU hoists them all to the front, where it only adds work, so
    `attention` asks for it off the CPU."""
    b, l = q.shape[:2]
    block = max(block, -(-l // MAX_BLOCKS))
    pos = jnp.arange(l)
    qh, kh, vh = q.transpose(0, 2, 3, 1, 4), k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
    attend = jax.checkpoint(_attend_heads, static_argnums=(4,)) if checkpoint_blocks and l > block else _attend_heads
    outs = []
    for s in range(0, l, block):
        e = min(l, s + block)
        mask = (pos[s:e, None] >= pos[None, :e])[None]
        if segment_ids is not None:
            mask = mask & (segment_ids[:, s:e, None] == segment_ids[:, None, :e])
        outs.append(attend(qh[:, :, :, s:e], kh[:, :, :e], vh[:, :, :e], mask, dtype))
    return jnp.concatenate(outs, axis=3).transpose(0, 3, 1, 2, 4).reshape(b, l, -1)


def _attend_context(q, k, v, segment_ids, dtype, block: int, mesh):
    """Causal `_attend` of a sequence split over the mesh's `context` axis (other axes left to GSPMD): each
    shard all-gathers K/V (cheap with few KV heads) and attends its own queries, in blocks of `block`, over the
    keys at or before them (global positions)."""

    def local(q, k, v, seg):
        lc = q.shape[1]
        kg, vg = (all_gather_f32_grad(a, "context", 1) for a in (k, v))
        sg = jax.lax.all_gather(seg, "context", axis=1, tiled=True)
        qpos = jax.lax.axis_index("context") * lc + jnp.arange(lc)
        step = max(block, -(-lc // MAX_BLOCKS))
        outs = []
        for s in range(0, lc, step):
            e = min(lc, s + step)
            mask = _block_mask(qpos[s:e], jnp.arange(kg.shape[1]), seg[:, s:e], sg)
            outs.append(_attend(q[:, s:e], kg, vg, mask, dtype))
        return jnp.concatenate(outs, axis=1)

    return _context_attention(local, q, k, v, segment_ids, mesh)


def _zigzag_pairs(n: int, e):
    """Device e's work in the balanced causal split of 2n half-shards: its query half-shards a = e and
    b = 2n-1-e, and the 2n+1 (query slot, key half-shard) pairs they need (a: 0..e, b: 0..2n-1-e)."""
    p = jnp.arange(2 * n + 1)
    slot_b = p > e
    return slot_b, jnp.where(slot_b, p - (e + 1), p)


def _zigzag_moves(n: int):
    """The two collective permutes that take each device's two halves to the zigzag layout, in which device e
    holds half-shards e and 2n-1-e: half-shard j lives on device j // 2 and goes to device j (j < n) or
    2n-1-j; in one permute of first halves (j even) and one of second halves (j odd) every device sends one
    and receives one. -> (firsts, seconds) as (source, destination) pairs."""
    dest = lambda j: j if j < n else 2 * n - 1 - j  # noqa: E731
    return [(d, dest(2 * d)) for d in range(n)], [(d, dest(2 * d + 1)) for d in range(n)]


def _to_zigzag(x, n: int, h: int):
    """Inside shard_map: x [b, 2h, ...] (this device's contiguous shard) -> [b, 2h, ...] holding half-shards
    e and 2n-1-e, in that order."""
    firsts, seconds = _zigzag_moves(n)
    one = jax.lax.ppermute(x[:, :h], "context", firsts)
    two = jax.lax.ppermute(x[:, h:], "context", seconds)
    even = jax.lax.axis_index("context") % 2 == 0  # half-shard e arrives in the first permute when e is even
    return jnp.concatenate([jnp.where(even, one, two), jnp.where(even, two, one)], axis=1)


def _from_zigzag(x, n: int, h: int):
    """The inverse of `_to_zigzag`: each half-shard returns to device j // 2."""
    firsts, seconds = _zigzag_moves(n)
    even = jax.lax.axis_index("context") % 2 == 0
    xa, xb = x[:, :h], x[:, h:]
    one = jax.lax.ppermute(jnp.where(even, xa, xb), "context", [(t, f) for f, t in firsts])
    two = jax.lax.ppermute(jnp.where(even, xb, xa), "context", [(t, f) for f, t in seconds])
    return jnp.concatenate([one, two], axis=1)


def _online_init(b: int, l: int, kv: int, r: int, hd: int):
    """Online-softmax state of l queries: running max, sum [b, kv, r, l] and output [b, l, kv, r, hd], fp32."""
    return (jnp.full((b, kv, r, l), _NEG, jnp.float32), jnp.zeros((b, kv, r, l), jnp.float32),
            jnp.zeros((b, l, kv, r, hd), jnp.float32))


def _online_step(state, q, k, v, mask, dtype):
    """One key block into the online softmax: q [b, l, kv, r, hd], k/v [b, s, kv, hd], mask [b, l, s]."""
    m, s, acc = state
    logits = jnp.einsum("blkrh,bskh->bkrls", q, k, preferred_element_type=jnp.float32) * (q.shape[-1] ** -0.5)
    logits = jnp.where(mask[:, None, None], logits, _NEG)
    m_new = jnp.maximum(m, logits.max(-1))
    scale = jnp.exp(m - m_new)
    pr = jnp.exp(logits - m_new[..., None])
    acc = acc * jnp.moveaxis(scale, 3, 1)[..., None] + jnp.einsum(
        "bkrls,bskh->blkrh", pr.astype(dtype), v, preferred_element_type=jnp.float32)
    return m_new, s * scale + pr.sum(-1), acc


def _online_out(state, dtype):
    m, s, acc = state
    return (acc / jnp.moveaxis(s, 3, 1)[..., None]).astype(dtype)  # [b, l, kv, r, hd]


def _fold(states, j, q, k, v, mask, dtype):
    """`_online_step` into slot j of stacked online-softmax states [2, ...] (a query half-shard's)."""
    new = _online_step(jax.tree.map(lambda a: a[j], states), q, k, v, mask, dtype)
    return jax.tree.map(lambda a, x: a.at[j].set(x), states, new)


def _half(x, i, h: int):
    """x[:, i*h : (i+1)*h] for a traced i."""
    return jax.lax.dynamic_slice_in_dim(x, i * h, h, axis=1)


def _block_mask(qpos, kpos, qseg, kseg):
    """[b, lq, lk]: causal by global positions, inside one packed document."""
    return (qpos[:, None] >= kpos[None, :])[None] & (qseg[:, :, None] == kseg[:, None, :])


def _context_attention(local, q, k, v, segment_ids, mesh, kernel: bool = False):
    """Run local(q, k, v, seg) -> [b, l/n, kv*r*hd] over the `context` axis (other axes left to GSPMD; with a
    `kernel`, which GSPMD cannot partition, every axis is manual: rows over the batch axes, KV heads over
    `tensor`); segment ids default to one document per row."""
    from jax.sharding import PartitionSpec as P

    seg = jnp.ones(q.shape[:2], jnp.int32) if segment_ids is None else segment_ids
    if kernel:
        sp = lambda *dims: kernel_attn.spec(mesh, q.shape[0], q.shape[2], dims)  # noqa: E731
        kv = sp("rows", "context", "heads", None)
        return jax.shard_map(local, mesh=mesh, in_specs=(sp("rows", "context", "heads", None, None), kv, kv,
                                                         sp("rows", "context")),
                             out_specs=sp("rows", "context", "heads"), check_vma=False)(q, k, v, seg)
    seq = P(None, "context")
    return jax.shard_map(local, mesh=mesh, in_specs=(seq, seq, seq, seq), out_specs=seq, axis_names={"context"},
                         check_vma=False)(q, k, v, seg)


def _zigzag_positions(n: int, h: int, e):
    """Global positions [2h] of device e's two half-shards in the zigzag layout (e and 2n-1-e)."""
    return jnp.concatenate([e * h + jnp.arange(h), (2 * n - 1 - e) * h + jnp.arange(h)])


def _flash_zigzag(qz, k, v, q_pos, kv_pos, sq, skv, interpret: bool):
    """The Pallas flash kernel (`nemo_jax.kernels.attention.flash_rows`) of zigzag queries qz [b, 2h, kv, r, hd]
    at positions q_pos [2h] over keys at kv_pos -> (o, lse) in its rows layout."""
    b = qz.shape[0]
    row = lambda p: jnp.broadcast_to(p.astype(jnp.int32), (b, p.shape[0]))  # noqa: E731
    return kernel_attn.flash_rows(qz, k, v, row(q_pos), row(kv_pos), sq, skv, interpret=interpret)


def _attend_context_balanced(q, k, v, segment_ids, dtype, mesh, kernel: str = "reference", interpret: bool = False):
    """Causal attention of a sequence split over `context` with the work balanced (the 'zigzag' split): the
    sequence is cut into 2n half-shards; device e computes the queries of half-shards e and 2n-1-e
    (`_to_zigzag`, two collective permutes in and two back) over the keys before them, 2n+1 blocks of [h, h]
    for every device (online softmax), against all-gathered K/V. FLOPs over all devices ~ (2n+1)/2n of one
    device's causal attention, where `_attend_context` (the reference) computes every query against every key.
    `kernel` "flash": both query halves in one Pallas flash call over the gathered K/V, masked by global
    positions (the blocks after each half are skipped)."""
    n = mesh.shape["context"]

    def local(q, k, v, seg):
        b, lc, kv, r, hd = q.shape
        h = lc // 2
        e = jax.lax.axis_index("context")
        kg, vg = (all_gather_f32_grad(a, "context", 1) for a in (k, v))  # [b, 2nh, kv, hd]
        sg = jax.lax.all_gather(seg, "context", axis=1, tiled=True)
        qz, sz = _to_zigzag(q, n, h), _to_zigzag(seg, n, h)
        if kernel == "flash":
            o, _ = _flash_zigzag(qz, kg, vg, _zigzag_positions(n, h, e), jnp.arange(2 * n * h), sz, sg, interpret)
            return _from_zigzag(kernel_attn.unrows(o, r).astype(dtype), n, h)
        start = jnp.stack([e * h, (2 * n - 1 - e) * h])  # first positions of query half-shards e, 2n-1-e
        slot_b, kblock = _zigzag_pairs(n, e)

        def step(states, pair):
            is_b, kb = pair
            j = is_b.astype(jnp.int32)
            qi, qs = (_half(a, j, h) for a in (qz, sz))
            ks, vs, kss = (_half(a, kb, h) for a in (kg, vg, sg))
            return _fold(states, j, qi, ks, vs, _block_mask(start[j] + jnp.arange(h), kb * h + jnp.arange(h), qs, kss),
                         dtype), None

        init = jax.tree.map(lambda a: jnp.stack([a, a]), _online_init(b, h, kv, r, hd))
        # each block's logits are recomputed in the backward (only the running max / sum / output are saved)
        states, _ = jax.lax.scan(jax.checkpoint(step), init, (slot_b, kblock))
        out = jnp.concatenate([_online_out(jax.tree.map(lambda a: a[i], states), dtype) for i in (0, 1)], axis=1)
        return _from_zigzag(out, n, h).reshape(b, lc, -1)

    return _context_attention(local, q, k, v, segment_ids, mesh, kernel != "reference")


def _attend_context_ring(q, k, v, segment_ids, dtype, mesh, kernel: str = "reference", interpret: bool = False):
    """Ring attention over `context` in the zigzag layout (`_to_zigzag`): each device keeps its queries and
    passes its K/V (and segment ids) to the next device n-1 times (`ppermute`), folding the [h, h] blocks the
    causal mask needs into an online softmax. Device e holds query half-shards a = e and b = 2n-1-e and meets
    device j's key half-shards j and 2n-1-j: its own (j = e) give 3 blocks (a|j, b|j, b|2n-1-j), j < e the
    2 blocks a|j and b|j, j > e the 2 blocks b|j and b|2n-1-j; 2n+1 blocks on every device, as in
    `_attend_context_balanced`. K/V move by n-1 permutes of 1/n of the sequence (which a GPU can overlap with
    the blocks) instead of one all-gather; the backward keeps every block it received, like the gather.
    `kernel` "flash": each step's K/V (both halves) in one Pallas flash call, merged by log-sum-exp."""
    n = mesh.shape["context"]
    ring = [(i, (i + 1) % n) for i in range(n)]

    def local(q, k, v, seg):
        b, lc, kv, r, hd = q.shape
        h = lc // 2
        e = jax.lax.axis_index("context")
        qz, kz, vz, sz = (_to_zigzag(a, n, h) for a in (q, k, v, seg))
        pos = lambda d: _zigzag_positions(n, h, d)  # noqa: E731
        qpos = pos(e)
        if kernel == "flash":
            o, lse = _flash_zigzag(qz, kz, vz, qpos, qpos, sz, sz, interpret)

            def visit(carry, i):
                part, (kc, vc, sc) = carry
                kc, vc, sc = (jax.lax.ppermute(a, "context", ring) for a in (kc, vc, sc))
                other = _flash_zigzag(qz, kc, vc, qpos, pos((e - i) % n), sz, sc, interpret)
                return (kernel_attn.merge(part, other), (kc, vc, sc)), None

            ((o, _), _), _ = jax.lax.scan(visit, ((o.astype(jnp.float32), lse), (kz, vz, sz)), jnp.arange(1, n))
            return _from_zigzag(kernel_attn.unrows(o.astype(dtype), r), n, h)

        def blocks(states, pairs, kc, vc, kp, sc):
            """Fold (query half, key half) pairs [m, 2] of the held K/V kc/vc [b, 2h, ..] (positions kp, segment
            ids sc) one after another: a scan, so the backward holds one block's logits at a time."""

            @jax.checkpoint  # each block's logits are recomputed in the backward
            def one(states, pair):
                qi, ki = pair[0], pair[1]
                mask = _block_mask(_half(qpos[None], qi, h)[0], _half(kp[None], ki, h)[0], _half(sz, qi, h),
                                   _half(sc, ki, h))
                return _fold(states, qi, _half(qz, qi, h), _half(kc, ki, h), _half(vc, ki, h), mask, dtype), None

            return jax.lax.scan(one, states, pairs)[0]

        states = jax.tree.map(lambda a: jnp.stack([a, a]), _online_init(b, h, kv, r, hd))
        states = blocks(states, jnp.array([[0, 0], [1, 0], [1, 1]]), kz, vz, qpos, sz)  # own diagonal: a|a, b|a, b|b

        def step(carry, i):
            states, (kc, vc, sc) = carry
            kc, vc, sc = (jax.lax.ppermute(a, "context", ring) for a in (kc, vc, sc))
            j = (e - i) % n
            later = (j > e).astype(jnp.int32)  # j < e: a|j then b|j; j > e: b|j then b|2n-1-j
            pairs = jnp.asarray([[later, 0], [1, later]])
            return (blocks(states, pairs, kc, vc, pos(j), sc), (kc, vc, sc)), None

        (states, _), _ = jax.lax.scan(step, (states, (kz, vz, sz)), jnp.arange(1, n))
        out = jnp.concatenate([_online_out(jax.tree.map(lambda a: a[i], states), dtype) for i in (0, 1)], axis=1)
        return _from_zigzag(out, n, h).reshape(b, lc, -1)

    return _context_attention(local, q, k, v, segment_ids, mesh, kernel != "reference")


def write_rows(c, x, pos, axis: int = 0):
    """c [..., b, S, ...] (rows at `axis`, slots next) with x [..., b, l, ...] written at slots pos[i] + [0, l) of
    row i (pos [b]). Slots at or past S are dropped, never clamped onto earlier ones: a row given pos >= S
    (one appending nothing) keeps its slots as they were."""
    b, l = x.shape[axis], x.shape[axis + 1]
    idx = (slice(None),) * axis + (jnp.arange(b)[:, None], pos[:, None] + jnp.arange(l)[None])
    return c.at[idx].set(x.astype(c.dtype), mode="drop")


def _cached_mask(valid_cache, pos, start, l: int):
    """Mask [b, l, S] of chunk queries at row positions pos [b] + start + [0, l) over cache slots: causal and
    valid."""
    S = valid_cache.shape[1]
    causal = jnp.arange(S)[None, None] <= (pos[:, None] + start + jnp.arange(l))[..., None]  # [b, l, S]
    return causal & valid_cache[:, None, :]


def _attend_cached_blocked(q, kc, vc, valid_cache, pos, dtype, block: int):
    """Cached `_attend` in query blocks: q [b, l, kv, r, hd] over the whole cache kc/vc [b, S, kv, hd] (the chunk
    written in); one block of `block` queries at a time (`lax.map`), so the logits held are [b, heads, block, S],
    not [b, heads, l, S]: prefill memory grows linearly in the prompt length. -> [b, l, kv*r*hd]."""
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


KEY_BLOCK = 128  # cache slots per step of a decode chunk's loop over the cache


def _attend_cached_split(q, cache: KVCache, new: KVCache, valid_cache, valid, pos, dtype, block: int = KEY_BLOCK):
    """Cached attention of a short chunk (decode): q [b, l, kv, r, hd] over the cache's valid slots before each
    row's position pos [b] (cache.k/v [b, S, kv, hd], read as stored, never copied with the chunk written in) and
    the chunk's own keys/values new.k/v [b, l, kv, hd] (causal, `valid` [b, l]), by one online softmax over the
    two. The cache is read `block` slots at a time up to the furthest row's position only (a loop whose trip count
    is known at run time): a decode step's work grows with the context used, not with the cache's capacity.
    Equal to `_attend` over the cache with the chunk written in. -> [b, l, kv*r*hd]."""
    b, l, kv, r, hd = q.shape
    S = cache.k.shape[1]
    before = valid_cache & (jnp.arange(S)[None] < pos[:, None])  # [b, S]
    st = _online_init(b, l, kv, r, hd)
    if S <= block:
        st = _online_step(st, q, cache.k.astype(dtype), cache.v.astype(dtype),
                          jnp.broadcast_to(before[:, None], (b, l, S)), dtype)
    else:
        def one(j, st):
            start = jnp.minimum(j * block, S - block)  # (the last block overlaps the one before: its slots masked)
            take = lambda x: jax.lax.dynamic_slice_in_dim(x, start, block, axis=1)  # noqa: E731
            mine = take(before) & (start + jnp.arange(block) >= j * block)[None]
            return _online_step(st, q, take(cache.k).astype(dtype), take(cache.v).astype(dtype),
                                jnp.broadcast_to(mine[:, None], (b, l, block)), dtype)

        used = (jnp.max(pos) + block - 1) // block  # the blocks holding any row's slots before its position
        st = jax.lax.fori_loop(0, jnp.minimum(used, -(-S // block)).astype(jnp.int32), one, st)
    causal = jnp.arange(l)[:, None] >= jnp.arange(l)[None]  # [l, l]
    st = _online_step(st, q, new.k.astype(dtype), new.v.astype(dtype), causal[None] & valid[:, None], dtype)
    return _online_out(st, dtype).reshape(b, l, -1)


IMPLEMENTATIONS = ("blocked", "ring", "full")  # "ring" differs from "blocked" only on a context mesh
# the balanced forms over a split sequence (whose shards halve): K/V all-gathered (chosen by measurement, see
# bench/context.py) or passed around the ring
CONTEXT_FORMS = {"blocked": _attend_context_balanced, "ring": _attend_context_ring}
BLOCK = 128  # query rows per block (1x1024 on CPU: fwd+bwd ~150 ms vs ~300 ms for the full form)
MAX_BLOCKS = 16  # longer sequences get larger blocks, so the unrolled blocks (and compile time) stay bounded


def attention(p: dict, u: jax.Array, cfg, dtype, *, segment_ids=None, cache: KVCache | None = None,
              valid_cache=None, valid=None, pos=None, impl: str = "blocked", block: int = BLOCK, mesh=None,
              kernels: Selection = REFERENCE):
    """u [b, l, D] -> (out [b, l, D], the chunk's KV entries or None).

    Training (no cache): `impl` "blocked" (or "ring") runs query blocks of `block` rows over their key prefixes; "full"
    is the plain [l, l] masked reference. With `cache` (row i's chunk at positions pos[i] + [0, l), `valid` [b, l]
    its real tokens, `valid_cache` [b, S] the validity of every slot *after* the chunk is written; the caller
    owns both, shared by all layers): "blocked" attends a chunk of up to `block` tokens (decode) over the cache
    as stored and the chunk's own keys (`_attend_cached_split`), a longer one `block` queries at a time over a
    copy of the cache with the chunk written in (`_attend_cached_blocked`); "full" the whole chunk at once over
    that copy (reference). Each returns the chunk's entries KVCache([b, l, nkv, hd]), which the caller writes
    into its (donated) cache stack in place (`write_rows`). Training on a `mesh` with a `context` axis: the
    sequence split over it, "blocked" against all-gathered K/V (`_attend_context_balanced`), "ring" with K/V passed around the ring
    (`_attend_context_ring`), "full" the all-gathered plain form (`_attend_context`).
    `kernels` (`nemo_jax.kernels.select`): the accelerator kernels that replace "blocked" / "ring" where the
    platform has one (cuDNN / Pallas flash / splash); "full" always runs the plain reference.
    """
    b, l, _ = u.shape
    nh, nkv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    q = linear(u, p["q_proj"], dtype).reshape(b, l, nkv, nh // nkv, hd)
    k = linear(u, p["k_proj"], dtype).reshape(b, l, nkv, hd)
    v = linear(u, p["v_proj"], dtype).reshape(b, l, nkv, hd)
    kernel = lambda op, **facts: "reference" if impl == "full" else kernels.impl(op, **facts)  # noqa: E731
    if cache is None and context_shards(mesh, l) > 1:
        if impl in CONTEXT_FORMS and (l // context_shards(mesh, l)) % 2 == 0:
            out = CONTEXT_FORMS[impl](q, k, v, segment_ids, dtype, mesh, kernel("context_attention"),
                                      kernels.interpret)
        else:
            out = _attend_context(q, k, v, segment_ids, dtype, l if impl == "full" else block, mesh)
        new_cache = None
    elif cache is None:
        kern = kernel("attention", dtype=dtype, segments=segment_ids is not None, head_dim=hd)
        if kern != "reference":
            out = kernel_attn.causal(q, k, v, segment_ids, dtype, kern, mesh=mesh, interpret=kernels.interpret)
        else:
            out = _attend_blocked(q, k, v, segment_ids, dtype, l if impl == "full" else block,
                                  checkpoint_blocks=platform_of(mesh) != "cpu")
        new_cache = None
    else:
        new_cache = KVCache(k.astype(cache.k.dtype), v.astype(cache.v.dtype))
        kern = kernel("cached_attention")
        if impl != "full" and l <= block and kern != "reference":  # the cache as stored (before pos) + the chunk
            before = valid_cache & (jnp.arange(cache.k.shape[1])[None] < pos[:, None])
            out = kernel_attn.cached(q, cache.k.astype(dtype), cache.v.astype(dtype), before, pos, dtype,
                                     new=(k, v, valid), mesh=mesh, interpret=kernels.interpret)
        elif impl != "full" and l <= block:
            out = _attend_cached_split(q, cache, new_cache, valid_cache, valid, pos, dtype)
        else:
            kc, vc = (write_rows(c, x, pos).astype(dtype) for c, x in zip(cache, new_cache))
            if kern != "reference":
                out = kernel_attn.cached(q, kc, vc, valid_cache, pos, dtype, mesh=mesh, interpret=kernels.interpret)
            else:
                out = _attend_cached_blocked(q, kc, vc, valid_cache, pos, dtype, l if impl == "full" else block)
    return linear(out, p["o_proj"], dtype), new_cache

