"""Attention kernels in the model's layouts: q [b, l, nkv, r, hd] (the r query heads of each KV head), k/v
[b, l, nkv, hd], outputs [b, l, nkv*r*hd], as `nemo_jax.model.attention` (the reference) computes them.

    causal(...)   training: causal over each row, inside packed documents (segment ids); cuDNN, Pallas flash
                  (Triton) or splash (TPU), run per device inside shard_map on a mesh (rows over the batch
                  axes, KV heads over `tensor` when they divide)
    cached(...)   a chunk over a KV cache as stored [b, S, nkv, hd] with per-slot validity and per-row positions,
                  merged with the chunk's own keys (decode); Pallas flash
    flash_rows    the Pallas flash kernel in these layouts with explicit positions / segment ids, returning the
                  log-sum-exp too: the context-parallel forms call it on their shards and `merge` partial results
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from nemo_jax.kernels.flash import NEG, flash_attention
from nemo_jax.parallel.mesh import BATCH_AXES, row_shards


def _rows(q):
    """[b, l, kv, r, hd] -> [b, kv, l*r, hd] (row t*r + j: position t, query head j of the KV head)."""
    b, l, kv, r, hd = q.shape
    return q.transpose(0, 2, 1, 3, 4).reshape(b, kv, l * r, hd)


def unrows(o, r: int):
    """[b, kv, l*r, hd] -> [b, l, kv*r*hd]."""
    b, kv, lr, hd = o.shape
    return o.reshape(b, kv, lr // r, r, hd).transpose(0, 2, 1, 3, 4).reshape(b, lr // r, -1)


def flash_rows(q, k, v, q_pos, kv_pos, q_seg, kv_seg, *, interpret: bool = False):
    """Pallas flash attention of q [b, l, kv, r, hd] at positions q_pos [b, l] (segments q_seg) over k/v
    [b, s, kv, hd] at kv_pos [b, s] (kv_seg): key s visible to query t iff kv_pos <= q_pos and the segments are
    equal (positions nondecreasing along each row). -> (o [b, kv, l*r, hd] in q's dtype, lse [b, kv, l*r] fp32),
    rows as `_rows`."""
    r, hd = q.shape[3], q.shape[4]
    rep = lambda a: jnp.repeat(a.astype(jnp.int32), r, axis=1)  # noqa: E731
    return flash_attention(_rows(q), k.astype(q.dtype), v.astype(q.dtype), rep(q_pos), kv_pos, rep(q_seg), kv_seg,
                           scale=hd ** -0.5, interpret=interpret)


def merge(a, b):
    """Two partial attentions (o [..., rows, hd], lse [..., rows]) of the same queries over disjoint key sets ->
    their attention over the union, o in fp32."""
    (oa, la), (ob, lb) = a, b
    lse = jnp.logaddexp(la, lb)
    o = oa.astype(jnp.float32) * jnp.exp(la - lse)[..., None] + ob.astype(jnp.float32) * jnp.exp(lb - lse)[..., None]
    return o, lse


def spec(mesh, b: int, nkv: int, dims) -> P:
    """The PartitionSpec of an array whose dims are named "rows" (over the batch axes, when b divides), "heads"
    (KV heads over `tensor`, when nkv divides), a mesh axis name, or None (whole): how a kernel's operands enter
    the shard_map it runs in per device (Mosaic and Triton calls are not partitioned by GSPMD)."""
    rows = tuple(a for a in BATCH_AXES if mesh.shape.get(a, 1) > 1) if row_shards(mesh, b) > 1 else ()
    tp = mesh.shape.get("tensor", 1)
    named = {"rows": rows or None, "heads": "tensor" if tp > 1 and nkv % tp == 0 else None}
    return P(*(named.get(d, d) for d in dims))


def _per_device(local, mesh, b: int, nkv: int, specs, out_spec):
    """local under shard_map over every mesh axis, its arguments and output as `spec` names them."""
    if mesh is None or mesh.size == 1:
        return local
    return jax.shard_map(local, mesh=mesh, in_specs=tuple(spec(mesh, b, nkv, s) for s in specs),
                         out_specs=spec(mesh, b, nkv, out_spec), check_vma=False)


def causal(q, k, v, segment_ids, dtype, impl: str, *, mesh=None, interpret: bool = False):
    """Causal GQA attention inside packed documents: q [b, l, kv, r, hd], k/v [b, l, kv, hd], segment_ids [b, l]
    or None (one document) -> [b, l, kv*r*hd] in `dtype`. impl: "cudnn" | "flash" | "splash"."""
    b, l, kv, r, hd = q.shape
    seg = jnp.zeros((b, l), jnp.int32) if segment_ids is None else segment_ids.astype(jnp.int32)
    fn = {"cudnn": _cudnn, "flash": _flash, "splash": _splash}[impl]
    local = functools.partial(fn, interpret=interpret)
    q5, kv4, ids = ("rows", None, "heads", None, None), ("rows", None, "heads", None), ("rows", None)
    out = _per_device(local, mesh, b, kv, (q5, kv4, kv4, ids), ("rows", None, "heads"))(q, k, v, seg)
    return out.astype(dtype)


def _flash(q, k, v, seg, interpret):
    b, l, kv, r, hd = q.shape
    pos = jnp.broadcast_to(jnp.arange(l, dtype=jnp.int32), (b, l))
    return unrows(flash_rows(q, k, v, pos, pos, seg, seg, interpret=interpret)[0], r)


def _cudnn(q, k, v, seg, interpret):
    """cuDNN flash attention (`jax.nn.dot_product_attention`): causal, GQA, no segment ids (seg unused)."""
    del seg, interpret
    b, l, kv, r, hd = q.shape
    out = jax.nn.dot_product_attention(q.reshape(b, l, kv * r, hd), k, v, is_causal=True, scale=hd ** -0.5,
                                       implementation="cudnn")
    return out.reshape(b, l, -1)


SPLASH_BLOCK = 128  # splash's tiles (its defaults); sequences are padded to a multiple


@functools.lru_cache(maxsize=32)
def _splash_kernel(length: int, heads: int, interpret: bool):
    from jax.experimental.pallas.ops.tpu import splash_attention as sa

    mask = sa.MultiHeadMask([sa.CausalMask((length, length))] * heads)
    blocks = sa.BlockSizes(*(SPLASH_BLOCK,) * 2, block_q_dkv=SPLASH_BLOCK, block_kv_dkv=SPLASH_BLOCK,
                           block_q_dq=SPLASH_BLOCK, block_kv_dq=SPLASH_BLOCK)
    return sa.make_splash_mqa_single_device(mask, block_sizes=blocks, interpret=interpret)


def _splash(q, k, v, seg, interpret):
    """Splash attention (TPU): per (row, KV head) the MQA form over its r query heads; the sequence padded to
    whole tiles with segment id -1 (a document of its own). Queries are scaled before the kernel (it takes
    them scaled)."""
    from jax.experimental.pallas.ops.tpu.splash_attention import SegmentIds

    b, l, kv, r, hd = q.shape
    L = -(-l // SPLASH_BLOCK) * SPLASH_BLOCK
    pad = lambda a, value=0: jnp.pad(a, ((0, 0), (0, L - l)) + ((0, 0),) * (a.ndim - 2),  # noqa: E731
                                     constant_values=value)
    qs = (q.astype(jnp.float32) * hd ** -0.5).astype(q.dtype)
    qh = pad(qs).transpose(0, 2, 3, 1, 4)  # [b, kv, r, L, hd]
    kh, vh = (pad(a).transpose(0, 2, 1, 3) for a in (k, v))  # [b, kv, L, hd]
    sg = pad(seg, -1)
    kern = _splash_kernel(L, r, bool(interpret))
    per_row = lambda q, k, v, s: jax.vmap(lambda q, k, v: kern(q, k, v, SegmentIds(s, s)))(q, k, v)  # noqa: E731
    o = jax.vmap(per_row)(qh, kh, vh, sg)  # [b, kv, r, L, hd]
    return o[:, :, :, :l].transpose(0, 3, 1, 2, 4).reshape(b, l, -1)


def cached(q, kc, vc, kv_seg, start, dtype, *, new=None, mesh=None, interpret: bool = False):
    """A chunk's attention over a KV cache, by the Pallas flash kernel: q [b, l, kv, r, hd], row i's queries at
    positions start[i] + [0, l); kc/vc [b, S, kv, hd] as stored (slot s holds position s), kv_seg [b, S] true
    where a slot may be read (causality by position applies too). With new = (k, v [b, l, kv, hd], valid
    [b, l]) the chunk's own keys are attended as well (causal, valid ones) and merged: the cache is then read
    as stored, without the chunk written in. -> [b, l, kv*r*hd] in `dtype`."""
    b, l, kv, r, hd = q.shape

    def local(q, kc, vc, kv_seg, start, *chunk):
        S = kc.shape[1]
        q_pos = start.astype(jnp.int32)[:, None] + jnp.arange(l, dtype=jnp.int32)
        ones = jnp.ones(q.shape[:2], jnp.int32)
        kv_pos = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), kv_seg.shape)
        part = flash_rows(q, kc, vc, q_pos, kv_pos, ones, kv_seg.astype(jnp.int32), interpret=interpret)
        if chunk:
            part = merge(part, _chunk(q, *chunk))
        return unrows(part[0].astype(dtype), r)

    q5, kv4, ids = ("rows", None, "heads", None, None), ("rows", None, "heads", None), ("rows", None)
    specs = (q5, kv4, kv4, ids, ("rows",)) + ((kv4, kv4, ids) if new is not None else ())
    return _per_device(local, mesh, b, kv, specs, ("rows", None, "heads"))(q, kc, vc, kv_seg, start,
                                                                           *(new or ()))


def _chunk(q, k, v, valid):
    """The chunk's queries over its own keys (causal, valid keys) in plain jnp: (o [b, kv, l*r, hd] fp32, lse)
    in `flash_rows`' layout (a decode chunk is a few tokens)."""
    b, l, kv, r, hd = q.shape
    s = jnp.einsum("bkqd,bskd->bkqs", _rows(q), k.astype(q.dtype), preferred_element_type=jnp.float32) * hd ** -0.5
    t = jnp.arange(l * r) // r
    mask = (t[:, None] >= jnp.arange(l)[None, :])[None, None] & valid[:, None, None, :]
    s = jnp.where(mask, s, NEG)
    lse = jax.nn.logsumexp(s, axis=-1)
    p = jnp.exp(s - lse[..., None])
    o = jnp.einsum("bkqs,bskd->bkqd", p.astype(q.dtype), v.astype(q.dtype), preferred_element_type=jnp.float32)
    return o, lse
