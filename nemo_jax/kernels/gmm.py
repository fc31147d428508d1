"""Grouped matmul (grouped GEMM) over rows sorted by group: the routed experts' matmuls of the sorted MoE
dispatch, one call per projection instead of a loop over experts or row windows.

    grouped_matmul(x [m, k], w [G, k, n], group_sizes [G], impl) -> y [m, n] fp32
        y[i] = x[i] @ w[g] for the rows i of group g (group g's rows follow group g-1's from row 0); rows past
        sum(group_sizes) are zero.

Implementations (`nemo_jax.kernels.Selection.impl` picks one per platform):
  "ragged_dot"  `jax.lax.ragged_dot`: XLA's own (the TPU compiler's native grouped matmul; XLA:GPU in jax 0.10.2
                expands it to a dense matmul over every group, G x the work, so it is not picked for GPUs)
  "triton"      the Pallas kernels below (GPU): output tiles visited once per group they hold rows of
                (megablox's tile schedule, `make_group_metadata`), the weight gradient per group over its rows
  "megablox"    `jax.experimental.pallas.ops.tpu.megablox.gmm` (TPU, Mosaic), with its own backward
All accumulate in fp32. On CPU the Pallas ones run in interpret mode (`interpret=True`, tests).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

IMPLEMENTATIONS = ("ragged_dot", "triton", "megablox")


def _pow2(n: int, least: int = 16, most: int = 128) -> int:
    return min(most, max(least, 1 << (max(1, n) - 1).bit_length()))


def _offsets(group_sizes):
    return jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(group_sizes.astype(jnp.int32))])


def _tile_schedule(group_sizes, m: int, tm: int):
    """(group of each visited row tile [T], row tile [T], tiles used [1]) with T = m/tm + G - 1 (a tile holding
    rows of several groups is visited once for each): megablox's tile schedule (`make_group_metadata`, all groups,
    empty ones skipped), computed with comparisons against cumulative counts instead of its `jnp.repeat`, which
    XLA:GPU runs as a loop of searchsorted steps (three kernels per step, ~30 launches per call; LoRA's expert
    adapters triple the calls)."""
    sizes = group_sizes.astype(jnp.int32)
    G, tiles_m = sizes.shape[0], m // tm
    T = tiles_m + G - 1
    ends = jnp.cumsum(sizes)
    starts = ends - sizes
    group_tiles = jnp.where(sizes == 0, 0, -(-ends // tm) - starts // tm)
    visit = jnp.arange(T, dtype=jnp.int32)
    group_ids = jnp.minimum(jnp.sum(jnp.cumsum(group_tiles)[None, :] <= visit[:, None], axis=1), G - 1)
    # a row tile is visited once, plus once more for each non-empty group starting inside it (not at its edge)
    mid = (sizes > 0) & (starts % tm != 0)
    extra = jnp.sum(mid[None, :] & (starts[None, :] // tm == jnp.arange(tiles_m)[:, None]), axis=1)
    tile_ids = jnp.minimum(jnp.sum(jnp.cumsum(1 + extra)[None, :] <= visit[:, None], axis=1), tiles_m - 1)
    return group_ids.astype(jnp.int32), tile_ids.astype(jnp.int32), jnp.sum(group_tiles).reshape(1).astype(jnp.int32)


def _gmm_kernel(ids_ref, tiles_ref, n_ref, off_ref, x_ref, w_ref, y_ref, *, tm, tc, to, trans):
    """One (row tile, group) x output-column tile: y[rows of the group in the tile, cols] = x[rows] @ w[g][:, cols]
    (w[g] [c, o]; `trans`: w stored [o, c])."""
    jo, t = pl.program_id(0), pl.program_id(1)
    m, c = x_ref.shape
    o = y_ref.shape[1]
    g = ids_ref[t]
    rows = tiles_ref[t] * tm + jnp.arange(tm)
    used = t < n_ref[0]
    rmask = used & (rows >= off_ref[g]) & (rows < off_ref[g + 1])
    cols = jo * to + jnp.arange(to)

    def body(kc, acc):
        ks = kc * tc + jnp.arange(tc)
        x = plgpu.load(x_ref.at[pl.ds(tiles_ref[t] * tm, tm), pl.ds(kc * tc, tc)],
                       mask=rmask[:, None] & (ks < c)[None, :], other=0)
        if trans:
            w = plgpu.load(w_ref.at[g, pl.ds(jo * to, to), pl.ds(kc * tc, tc)],
                           mask=(cols < o)[:, None] & (ks < c)[None, :], other=0)
            return acc + plgpu.dot(x, w.astype(x.dtype), trans_b=True)
        w = plgpu.load(w_ref.at[g, pl.ds(kc * tc, tc), pl.ds(jo * to, to)],
                       mask=(ks < c)[:, None] & (cols < o)[None, :], other=0)
        return acc + plgpu.dot(x, w.astype(x.dtype))

    acc = jax.lax.fori_loop(0, used.astype(jnp.int32) * pl.cdiv(c, tc), body, jnp.zeros((tm, to), jnp.float32))
    plgpu.store(y_ref.at[pl.ds(tiles_ref[t] * tm, tm), pl.ds(jo * to, to)], acc.astype(y_ref.dtype),
                mask=rmask[:, None] & (cols < o)[None, :])


def _tgmm_kernel(off_ref, x_ref, dy_ref, dw_ref, *, tm, tk, tn):
    """dw[g][k tile, n tile] = x[rows of g]^T @ dy[rows of g]."""
    jk, jn, g = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    m, k = x_ref.shape
    n = dy_ref.shape[1]
    lo, hi = off_ref[g], off_ref[g + 1]
    ks, ns = jk * tk + jnp.arange(tk), jn * tn + jnp.arange(tn)

    def body(mt, acc):
        rows = mt * tm + jnp.arange(tm)
        r = (rows >= lo) & (rows < hi)
        x = plgpu.load(x_ref.at[pl.ds(mt * tm, tm), pl.ds(jk * tk, tk)], mask=r[:, None] & (ks < k)[None, :], other=0)
        dy = plgpu.load(dy_ref.at[pl.ds(mt * tm, tm), pl.ds(jn * tn, tn)], mask=r[:, None] & (ns < n)[None, :],
                        other=0)
        return acc + plgpu.dot(x, dy.astype(x.dtype), trans_a=True)

    first = lo // tm
    last = jnp.where(hi > lo, pl.cdiv(hi, tm), first)
    acc = jax.lax.fori_loop(first, last, body, jnp.zeros((tk, tn), jnp.float32))
    plgpu.store(dw_ref.at[g, pl.ds(jk * tk, tk), pl.ds(jn * tn, tn)], acc.astype(dw_ref.dtype),
                mask=(ks < k)[:, None] & (ns < n)[None, :])


def _full(shape):
    return pl.BlockSpec(shape, lambda *_: (0,) * len(shape))


def _gmm_call(x, w, group_sizes, out_dtype, trans: bool, interpret: bool):
    """y [m, o] = x [m, c] @ w[g] per row group (w [G, c, o], or [G, o, c] with `trans`)."""
    m, c = x.shape
    o = w.shape[1] if trans else w.shape[2]
    tm, tc, to = _pow2(m, most=64), _pow2(c, most=64), _pow2(o)
    ids, tiles, n = _tile_schedule(group_sizes, -(-m // tm) * tm, tm)
    off = _offsets(group_sizes)
    y = pl.pallas_call(
        functools.partial(_gmm_kernel, tm=tm, tc=tc, to=to, trans=trans),
        grid=(pl.cdiv(o, to), ids.shape[0]),
        in_specs=[_full(ids.shape), _full(tiles.shape), _full((1,)), _full(off.shape), _full(x.shape),
                  _full(w.shape)],
        out_specs=_full((m, o)), out_shape=jax.ShapeDtypeStruct((m, o), out_dtype),
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=2), interpret=interpret, name="gmm",
    )(ids, tiles, n, off, x, w)
    return _zero_tail(y, off[-1])


def _tgmm_call(x, dy, group_sizes, out_dtype, interpret: bool):
    m, k = x.shape
    n = dy.shape[1]
    G = group_sizes.shape[0]
    tm, tk, tn = _pow2(m, most=64), _pow2(k, most=64), _pow2(n, most=64)
    off = _offsets(group_sizes)
    return pl.pallas_call(
        functools.partial(_tgmm_kernel, tm=tm, tk=tk, tn=tn),
        grid=(pl.cdiv(k, tk), pl.cdiv(n, tn), G),
        in_specs=[_full(off.shape), _full(x.shape), _full(dy.shape)],
        out_specs=_full((G, k, n)), out_shape=jax.ShapeDtypeStruct((G, k, n), out_dtype),
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=2), interpret=interpret, name="tgmm",
    )(off, x, dy)


def _zero_tail(y, total):
    """Rows at or past `total` (in no group; never written by the kernels) -> 0."""
    return jnp.where((jnp.arange(y.shape[0]) < total)[:, None], y, 0).astype(y.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _gmm_triton(x, w, group_sizes, interpret: bool, out_dtype):
    return _gmm_call(x, w, group_sizes, out_dtype, False, interpret)


def _gmm_triton_fwd(x, w, group_sizes, interpret, out_dtype):
    return _gmm_triton(x, w, group_sizes, interpret, out_dtype), (x, w, group_sizes)


def _gmm_triton_bwd(interpret, out_dtype, res, dy):
    x, w, group_sizes = res
    dy = dy.astype(x.dtype)  # the matmul's backward in the compute dtype, accumulating in fp32
    dx = _gmm_call(dy, w, group_sizes, x.dtype, True, interpret)
    dw = _tgmm_call(x, dy, group_sizes, w.dtype, interpret)
    return dx, dw, None


_gmm_triton.defvjp(_gmm_triton_fwd, _gmm_triton_bwd)


def _megablox(x, w, group_sizes, interpret: bool, out_dtype=jnp.float32):
    """megablox gmm on rows padded to its row tile. Its backward reuses the forward's (k, n) tiles with the two
    dims' roles swapped, so one tile must suit both: 128 (or 256, 512 when both divide), with dims under 128 (a
    LoRA rank) zero-padded to 128 (Mosaic blocks are multiples of (8, 128) or whole dims)."""
    from jax.experimental.pallas.ops.tpu.megablox import gmm

    m, k = x.shape
    n = w.shape[2]
    tm = 128 if m >= 128 else -(-m // 8) * 8
    kp, np_ = max(k, 128), max(n, 128)
    t = next(t for t in (512, 256, 128) if (kp % t == 0 and np_ % t == 0) or t == 128)
    # rows in no group are neither written by the forward nor by megablox's backward (its dx there is whatever
    # memory held): both are selected away, so neither reaches the result or x's gradient
    total = jnp.sum(group_sizes)
    xp = jnp.pad(_zero_tail(x, total), ((0, -(-m // tm) * tm - m), (0, kp - k)))
    wp = jnp.pad(w.astype(x.dtype), ((0, 0), (0, kp - k), (0, np_ - n)))
    y = gmm(xp, wp, group_sizes.astype(jnp.int32), preferred_element_type=out_dtype, tiling=(tm, t, t),
            interpret=interpret)[:m, :n]
    return _zero_tail(y, total)


def grouped_matmul(x, w, group_sizes, impl: str, *, interpret: bool = False, out_dtype=jnp.float32):
    """x [m, k] (rows sorted by group), w [G, k, n], group_sizes [G] int (sum <= m) -> [m, n] in `out_dtype`
    (accumulated in fp32; rows past the groups zero). Differentiable in x and w. An `out_dtype` of the compute
    dtype halves the output buffer of a projection whose result is rounded to it anyway (the experts' up
    projection)."""
    if impl == "ragged_dot":
        return jax.lax.ragged_dot(x, w.astype(x.dtype), group_sizes.astype(jnp.int32),
                                  preferred_element_type=out_dtype)
    if impl == "triton":
        return _gmm_triton(x, w.astype(x.dtype), group_sizes.astype(jnp.int32), bool(interpret), jnp.dtype(out_dtype))
    if impl == "megablox":
        return _megablox(x, w, group_sizes, interpret, out_dtype)
    raise ValueError(f"grouped_matmul: unknown implementation {impl!r}; expected one of {IMPLEMENTATIONS}")
