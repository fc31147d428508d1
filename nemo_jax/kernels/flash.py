"""Flash attention in Pallas for GPU (Triton), forward and backward, with the masks of every attention path of
the model: row positions and segment ids.

    flash_attention(q [B, H, Lq, D], k/v [B, Lk, H, D], q_pos/q_seg [B, Lq], kv_pos/kv_seg [B, Lk])
        -> (o [B, H, Lq, D] in q.dtype, lse [B, H, Lq] fp32)

Query row t of head h reads key s of the same head iff q_pos[t] >= kv_pos[s] and q_seg[t] == kv_seg[s]. The
rows of a head may be several query heads of one KV head interleaved (GQA: the caller folds the r query heads
of a KV head into rows t*r + j, so K/V are read once for all r and dK/dV sum over them in the kernel), K/V are
read in the layout the model stores them ([B, L, nkv, hd], the KV cache as it is), and the positions make
causal masks of any offset (a context-parallel shard's global positions, a cached chunk's per-row positions).
Positions must not decrease along a row: the kernel visits only the key blocks whose first position is at or
before the query block's last one (`_bounds`), so the causal upper triangle costs nothing.

Numerics follow the reference (`nemo_jax.model.attention`): logits q.k * scale in fp32, masked to -1e30
(not -inf: a fully masked row averages the values it visits, as the reference's does over all keys), online
softmax in fp32, probabilities cast to v's dtype for the second matmul with fp32 accumulation. `lse`
(log-sum-exp of each row's logits) lets callers merge attention over key sets (ring attention, a cache plus
a chunk); its cotangent is folded into the backward (dS = P * (dP - rowsum(dO * O) + dLSE)).

On CPU (tests) the same kernels run in Pallas interpret mode (`interpret=True`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

NEG = -1e30  # masked logit (model.attention._NEG)
BLOCK_Q, BLOCK_K = 128, 64  # query rows / keys per block (powers of two >= 16: Triton's dot); on an H200, causal
# GQA fwd+bwd at 4 x 4096, 16 heads of 128 (bench/kernels.py): 128 x 64 4.67 ms, 64 x 64 8.74, 128 x 128 8.72, 64 x 128 11.1
_FAR = 2 ** 30  # position of padding keys: after every query, so never visited


def _pow2(n: int, least: int = 16) -> int:
    return max(least, 1 << (max(1, n) - 1).bit_length())


def _bounds(q_pos, kv_pos, bq: int, bk: int):
    """hi [B, nqb]: key blocks [0, hi) hold a key at or before some query of query block i (positions
    nondecreasing); lo [B, nkb]: the first query block that reads key block j."""
    B, Lq = q_pos.shape
    nqb, nkb = -(-Lq // bq), -(-kv_pos.shape[1] // bk)
    last_q = jnp.pad(q_pos, ((0, 0), (0, nqb * bq - Lq)), mode="edge")[:, bq - 1::bq]  # [B, nqb]
    first_k = kv_pos[:, ::bk]  # [B, nkb]
    hi = jnp.sum(first_k[:, None, :] <= last_q[:, :, None], axis=2).astype(jnp.int32)
    lo = jnp.sum(hi[:, :, None] <= jnp.arange(nkb)[None, None], axis=1).astype(jnp.int32)
    return hi, lo


def _rows(ref, start, n: int, length: int, dmask=None, other=0):
    """Rows [start, start + n) of a [length, ...] ref, rows past the end (and columns outside dmask) read
    as `other`."""
    valid = (start + jnp.arange(n)) < length
    mask = valid if dmask is None else valid[:, None] & dmask
    return plgpu.load(ref.at[pl.ds(start, n)], mask=mask, other=other)


def _query_block(q_ref, qp_ref, qs_ref, i, bq: int, dmask):
    """Query block i: rows [bq, Dp], their positions and segments (rows past the end: segment -1)."""
    Lq = q_ref.shape[0]
    return (_rows(q_ref, i * bq, bq, Lq, dmask), _rows(qp_ref, i * bq, bq, Lq),
            _rows(qs_ref, i * bq, bq, Lq, other=-1))


def _key_block(k_ref, v_ref, kp_ref, ks_ref, j, bk: int, dmask):
    """Key block j: keys and values [bk, Dp], their positions and segments (keys past the end: after every
    query, segment -2)."""
    Lk = k_ref.shape[0]
    return (_rows(k_ref, j * bk, bk, Lk, dmask), _rows(v_ref, j * bk, bk, Lk, dmask),
            _rows(kp_ref, j * bk, bk, Lk, other=_FAR), _rows(ks_ref, j * bk, bk, Lk, other=-2))


def _logits(q, qp, qs, k, kp, ks, scale):
    """Masked fp32 logits [bq, bk] of a query block over a key block."""
    s = plgpu.dot(q, k, trans_b=True) * scale
    return jnp.where((qp[:, None] >= kp[None, :]) & (qs[:, None] == ks[None, :]), s, NEG)


def _head_mask(ref, d: int):
    """[1, Dp]: the real head-dim columns of a block padded to Dp."""
    return (jnp.arange(ref.shape[-1]) < d)[None, :]


def _fwd_kernel(hi_ref, q_ref, k_ref, v_ref, qp_ref, qs_ref, kp_ref, ks_ref, o_ref, lse_ref, *, scale, bq, bk, d):
    i = pl.program_id(0)
    Lq, Dp = q_ref.shape
    dmask = _head_mask(q_ref, d)
    q, qp, qs = _query_block(q_ref, qp_ref, qs_ref, i, bq, dmask)

    def body(j, carry):
        acc, m, l = carry
        k, v, kp, ks = _key_block(k_ref, v_ref, kp_ref, ks_ref, j, bk, dmask)
        s = _logits(q, qp, qs, k, kp, ks, scale)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        corr = jnp.exp(m - m_new)
        p = jnp.exp(s - m_new[:, None])
        return acc * corr[:, None] + plgpu.dot(p.astype(v.dtype), v), m_new, l * corr + jnp.sum(p, axis=1)

    init = (jnp.zeros((bq, Dp), jnp.float32), jnp.full((bq,), NEG, jnp.float32), jnp.zeros((bq,), jnp.float32))
    acc, m, l = jax.lax.fori_loop(0, hi_ref[i], body, init)
    empty = l == 0  # a block with no key at or before its queries
    l = jnp.where(empty, 1.0, l)
    rows = i * bq + jnp.arange(bq)
    plgpu.store(o_ref.at[pl.ds(i * bq, bq)], (acc / l[:, None]).astype(o_ref.dtype),
                mask=(rows < Lq)[:, None] & dmask)
    plgpu.store(lse_ref.at[pl.ds(i * bq, bq)], jnp.where(empty, NEG, m + jnp.log(l)), mask=rows < Lq)


def _dq_kernel(hi_ref, q_ref, k_ref, v_ref, qp_ref, qs_ref, kp_ref, ks_ref, do_ref, lse_ref, dl_ref, dq_ref, *,
               scale, bq, bk, d):
    i = pl.program_id(0)
    Lq, Dp = q_ref.shape
    dmask = _head_mask(q_ref, d)
    q, qp, qs = _query_block(q_ref, qp_ref, qs_ref, i, bq, dmask)
    do = _rows(do_ref, i * bq, bq, Lq, dmask)
    lse = _rows(lse_ref, i * bq, bq, Lq)
    dl = _rows(dl_ref, i * bq, bq, Lq)

    def body(j, dq):
        k, v, kp, ks = _key_block(k_ref, v_ref, kp_ref, ks_ref, j, bk, dmask)
        p = jnp.exp(_logits(q, qp, qs, k, kp, ks, scale) - lse[:, None])
        ds = p * (plgpu.dot(do, v, trans_b=True) - dl[:, None])
        return dq + plgpu.dot(ds.astype(k.dtype), k)

    dq = jax.lax.fori_loop(0, hi_ref[i], body, jnp.zeros((bq, Dp), jnp.float32))
    rows = i * bq + jnp.arange(bq)
    plgpu.store(dq_ref.at[pl.ds(i * bq, bq)], (dq * scale).astype(dq_ref.dtype), mask=(rows < Lq)[:, None] & dmask)


def _dkv_kernel(lo_ref, q_ref, k_ref, v_ref, qp_ref, qs_ref, kp_ref, ks_ref, do_ref, lse_ref, dl_ref, dk_ref, dv_ref,
                *, scale, bq, bk, d):
    j = pl.program_id(0)
    Lq = q_ref.shape[0]
    Lk, Dp = k_ref.shape[0], q_ref.shape[1]
    dmask = _head_mask(q_ref, d)
    k, v, kp, ks = _key_block(k_ref, v_ref, kp_ref, ks_ref, j, bk, dmask)

    def body(i, carry):
        dk, dv = carry
        q, qp, qs = _query_block(q_ref, qp_ref, qs_ref, i, bq, dmask)
        do = _rows(do_ref, i * bq, bq, Lq, dmask)
        p = jnp.exp(_logits(q, qp, qs, k, kp, ks, scale) - _rows(lse_ref, i * bq, bq, Lq)[:, None])
        dv = dv + plgpu.dot(p.astype(do.dtype), do, trans_a=True)
        ds = p * (plgpu.dot(do, v, trans_b=True) - _rows(dl_ref, i * bq, bq, Lq)[:, None])
        return dk + plgpu.dot(ds.astype(q.dtype), q, trans_a=True), dv

    zero = jnp.zeros((bk, Dp), jnp.float32)
    dk, dv = jax.lax.fori_loop(lo_ref[j], -(-Lq // bq), body, (zero, zero))
    rows = (j * bk + jnp.arange(bk) < Lk)[:, None] & dmask
    plgpu.store(dk_ref.at[pl.ds(j * bk, bk)], (dk * scale).astype(dk_ref.dtype), mask=rows)
    plgpu.store(dv_ref.at[pl.ds(j * bk, bk)], dv.astype(dv_ref.dtype), mask=rows)


def _specs(B: int, H: int, Lq: int, Lk: int, Dp: int):
    """BlockSpecs of one (batch row, head) program: whole rows of q [B, H, Lq, D], k/v [B, Lk, H, D] (D padded to
    Dp by the block, read under a mask), positions / segments [B, L]."""
    return dict(rows=pl.BlockSpec((None, None, Lq, Dp), lambda i, b, h: (b, h, 0, 0)),
                kv=pl.BlockSpec((None, Lk, None, Dp), lambda i, b, h: (b, 0, h, 0)),
                q_ids=pl.BlockSpec((None, Lq), lambda i, b, h: (b, 0)),
                kv_ids=pl.BlockSpec((None, Lk), lambda i, b, h: (b, 0)),
                lse=pl.BlockSpec((None, None, Lq), lambda i, b, h: (b, h, 0)))


def _call(kernel, grid_n: int, bound, q, k, extra, out_shape, out_kinds, *, scale, bq, bk, interpret, name):
    """pallas_call of `kernel` over grid (grid_n, B, H); inputs (bound, q, k, v, q_pos, q_seg, kv_pos, kv_seg,
    *extra), `extra` and the outputs named by their BlockSpec kinds (`_specs`)."""
    B, H, Lq, D = q.shape
    Lk = k.shape[1]
    Dp = _pow2(D)
    sp = _specs(B, H, Lq, Lk, Dp)
    nb = bound.shape[1]
    in_specs = ([pl.BlockSpec((None, nb), lambda i, b, h: (b, 0)), sp["rows"], sp["kv"], sp["kv"], sp["q_ids"],
                 sp["q_ids"], sp["kv_ids"], sp["kv_ids"]] + [sp[x] for x in extra])
    return pl.pallas_call(
        functools.partial(kernel, scale=scale, bq=bq, bk=bk, d=D),
        grid=(grid_n, B, H), in_specs=in_specs, out_specs=[sp[x] for x in out_kinds], out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=4 if Dp <= 64 else 8, num_stages=2),
        interpret=interpret, name=name)


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8, 9, 10))
def _flash(q, k, v, q_pos, q_seg, kv_pos, kv_seg, scale, bq, bk, interpret):
    return _flash_fwd(q, k, v, q_pos, q_seg, kv_pos, kv_seg, scale, bq, bk, interpret)[0]


def _flash_fwd(q, k, v, q_pos, q_seg, kv_pos, kv_seg, scale, bq, bk, interpret):
    B, H, Lq, D = q.shape
    hi, lo = _bounds(q_pos, kv_pos, bq, bk)
    o, lse = _call(_fwd_kernel, -(-Lq // bq), hi, q, k, [],
                   [jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((B, H, Lq), jnp.float32)],
                   ["rows", "lse"], scale=scale, bq=bq, bk=bk, interpret=interpret, name="flash_fwd")(
        hi, q, k, v, q_pos, q_seg, kv_pos, kv_seg)
    return (o, lse), (q, k, v, q_pos, q_seg, kv_pos, kv_seg, o, lse, hi, lo)


def _flash_bwd(scale, bq, bk, interpret, res, cts):
    q, k, v, q_pos, q_seg, kv_pos, kv_seg, o, lse, hi, lo = res
    do, dlse = cts
    do = do.astype(q.dtype)
    # rowsum(dO * O) - dLSE: the softmax backward's per-row term, with the log-sum-exp's cotangent folded in
    dl = jnp.sum(do.astype(jnp.float32) * o.astype(jnp.float32), axis=-1) - dlse.astype(jnp.float32)
    args = (q, k, v, q_pos, q_seg, kv_pos, kv_seg, do, lse, dl)
    dq = _call(_dq_kernel, -(-q.shape[2] // bq), hi, q, k, ["rows", "lse", "lse"],
               [jax.ShapeDtypeStruct(q.shape, q.dtype)], ["rows"], scale=scale, bq=bq, bk=bk,
               interpret=interpret, name="flash_bwd_dq")(hi, *args)[0]
    dk, dv = _call(_dkv_kernel, -(-k.shape[1] // bk), lo, q, k, ["rows", "lse", "lse"],
                   [jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)], ["kv", "kv"],
                   scale=scale, bq=bq, bk=bk, interpret=interpret, name="flash_bwd_dkv")(lo, *args)
    return dq, dk, dv, None, None, None, None


_flash.defvjp(_flash_fwd, _flash_bwd)


def flash_attention(q, k, v, q_pos, kv_pos, q_seg, kv_seg, *, scale: float, block_q: int | None = None,
                    block_k: int | None = None, interpret: bool = False):
    """q [B, H, Lq, D] (rows), k/v [B, Lk, H, D] (as stored), q_pos/q_seg [B, Lq], kv_pos/kv_seg [B, Lk] int32
    (positions nondecreasing) -> (o [B, H, Lq, D] in q.dtype, lse [B, H, Lq] fp32). Differentiable in q, k, v
    (both outputs). Blocks (default BLOCK_Q / BLOCK_K) are powers of two >= 16, at most the padded lengths."""
    bq = min(_pow2(block_q or BLOCK_Q), _pow2(q.shape[2]))
    bk = min(_pow2(block_k or BLOCK_K), _pow2(k.shape[1]))
    i32 = lambda a: a.astype(jnp.int32)  # noqa: E731
    return _flash(q, k, v, i32(q_pos), i32(q_seg), i32(kv_pos), i32(kv_seg), float(scale), bq, bk, bool(interpret))
