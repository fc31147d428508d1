"""Mamba-2's chunked SSD scan as Pallas kernels (Triton on GPU, Mosaic on TPU), forward and backward, with packed
segments and the initial / final states the decode cache needs.

    ssd_scan(x [b, l, h, p], dt [b, l, h], A [h], B/C [b, l, g, n], segment_ids [b, l] | None,
             initial_state [b, h, p, n] | None, impl="triton" | "mosaic")
        -> (y [b, l, h, p] fp32 without the D skip, final state [b, h, p, n] fp32)

The I/O and the math of `nemo_jax.model.mamba2.ssd_chunked` (the reference; every SSM quantity in fp32). One
kernel program owns one (row, head) and walks its chunks in order, the state [p, n] carried from chunk to chunk:
on GPU a loop inside the program (grid (b, h)), on TPU the grid's innermost, sequential axis with the state in
VMEM scratch (grid (b, h, chunks)). Per chunk of `cs` tokens (i, j in the chunk; a = the chunk's cumulative
dt * A):

    y[i]   = sum_{j <= i, same segment} (C[i] . B[j]) exp(a[i] - a[j]) dt[j] x[j]  +  into[i] (C[i] . s)
    s_next = into[-1] s  +  sum_j outof[j] dt[j] x[j] (x) B[j]

with into[i] = exp(a[i]) when token i continues the segment of the state entering the chunk (else 0) and
outof[j] = exp(a[-1] - a[j]) when token j's segment is the one at the chunk's end: neither the [cs, cs] decay
matrix nor C B^T ever leaves the chip, where the reference's einsums materialise them for every chunk and head.
The backward walks the chunks in reverse carrying the state's cotangent; it reads the entering state of each
chunk, which the forward stores when differentiated (`custom_vjp`). B / C gradients are produced per head and
summed over a group's heads outside the kernel.

The cumulative sums, the segment masks and the decays (into / outof) are computed outside the kernel by plain
jnp on [b, l, h] arrays, so their gradients are XLA's; the kernel returns the cotangents of its inputs (x, dt,
a in its two layouts, into, outof, B, C, the initial state). Documents are contiguous runs of one segment id (the
state resets where the id changes, as `ssd_sequential`). Chunk length, head dim and state size are padded to
powers of two >= 16 for Triton (zeros: exact); the kernel's chunk (`CHUNK`) is its own, not the model's
`chunk_size` (the result is the same up to rounding).

On CPU the kernels run in Pallas interpret mode (`interpret=True`, tests).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

IMPLEMENTATIONS = ("triton", "mosaic")
# tokens per kernel chunk: Triton holds the [cs, cs] decay tile and the [p, n] state in registers (64 x 64 tiles
# keep the 8-warp program from spilling); Mosaic's MXU works in 128-wide tiles
CHUNK = {"triton": 64, "mosaic": 128}
COLS = ("dt", "a", "into", "outof")  # per-token columns [.., L, 1]


def _pow2(n: int, least: int = 16) -> int:
    return max(least, 1 << (max(1, n) - 1).bit_length())


# ----------------------------------------------------------------------------- one chunk's math (both backends)
def _iota(shape, dim):
    return jax.lax.broadcasted_iota(jnp.int32, shape, dim)


def _decay_matrix(a, a_row, seg, seg_row):
    """[cs, cs]: exp(a[i] - a[j]) where j <= i in the same segment, else 0 (a [cs, 1], a_row [1, cs])."""
    cs = a.shape[0]
    keep = (_iota((cs, cs), 1) <= _iota((cs, cs), 0)) & (seg == seg_row)
    return jnp.where(keep, jnp.exp(jnp.where(keep, a - a_row, 0.0)), 0.0)


def _dot(a, b, trans_a: bool = False, trans_b: bool = False):
    """a @ b of 2-D blocks (either transposed) accumulated in fp32: a dot_general both Triton and Mosaic lower."""
    dims = (((0 if trans_a else 1,), (1 if trans_b else 0,)), ((), ()))
    return jax.lax.dot_general(a, b, dims, preferred_element_type=jnp.float32)


def _last(col):
    """[cs, 1] -> [1, 1]: its last element."""
    return jnp.sum(jnp.where(_iota(col.shape, 0) == col.shape[0] - 1, col, 0.0), axis=0, keepdims=True)


def _chunk_fwd(blk, s):
    """blk: the chunk's x [cs, p], dt, a, into, outof [cs, 1], a_row [1, cs], B, C [cs, n], seg [cs, 1],
    seg_row [1, cs]; s [p, n] the entering state -> (y [cs, p], leaving state [p, n])."""
    xdt = blk["x"] * blk["dt"]
    M = _dot(blk["C"], blk["B"], trans_b=True) * _decay_matrix(blk["a"], blk["a_row"], blk["seg"], blk["seg_row"])
    y = _dot(M, xdt) + blk["into"] * _dot(blk["C"], s, trans_b=True)
    s_next = _last(blk["into"]) * s + _dot(xdt * blk["outof"], blk["B"], trans_a=True)
    return y, s_next


def _chunk_bwd(blk, s, dy, ds_next):
    """Cotangents of one chunk from those of its outputs (dy [cs, p], ds_next [p, n]) -> dict of the inputs'
    (x, dt, a, a_row, into, outof, B, C per head) and the entering state's ds [p, n]."""
    x, dt, B, C, into, outof = blk["x"], blk["dt"], blk["B"], blk["C"], blk["into"], blk["outof"]
    xdt = x * dt
    L = _decay_matrix(blk["a"], blk["a_row"], blk["seg"], blk["seg_row"])
    CB = _dot(C, B, trans_b=True)
    M = CB * L
    dM = _dot(dy, xdt, trans_b=True)  # [cs, cs]
    BdS = _dot(B, ds_next, trans_b=True)  # [cs, p]
    dxdt = _dot(M, dy, trans_a=True) + outof * BdS
    G = dM * M  # the cotangent of a[i] - a[j] through exp
    dCB = dM * L
    Cs = _dot(C, s, trans_b=True)  # [cs, p]
    d_into = jnp.sum(dy * Cs, axis=1, keepdims=True)
    d_last = jnp.sum(jnp.sum(ds_next * s, axis=1, keepdims=True), axis=0, keepdims=True)  # [1, 1]
    d_into = d_into + jnp.where(_iota(d_into.shape, 0) == d_into.shape[0] - 1, d_last, 0.0)
    return {
        "x": dxdt * dt, "dt": jnp.sum(dxdt * x, axis=1, keepdims=True),
        "a": jnp.sum(G, axis=1, keepdims=True), "a_row": -jnp.sum(G, axis=0, keepdims=True),
        "into": d_into, "outof": jnp.sum(xdt * BdS, axis=1, keepdims=True),
        "B": _dot(dCB, C, trans_a=True) + _dot(xdt * outof, ds_next),
        "C": _dot(dCB, B) + into * _dot(dy, s),
        "s": _last(into) * ds_next + _dot(dy * into, C, trans_a=True),
    }


# ----------------------------------------------------------------------------- kernels
# inputs, in order, and how each is blocked: "row" [.., L, p] (x) and per-token columns are per (row, head); "bc"
# per (row, group); "seg" per row; "a_row" / "seg_row" the chunk-major copies [.., chunks, 1, cs]
IN = ("x", "dt", "a", "a_row", "into", "outof", "B", "C", "seg", "seg_row")
GRADS = ("x", "dt", "a", "a_row", "into", "outof", "B", "C")


def _chunk_of(refs: dict, c, cs: int, whole: bool) -> dict:
    """The blocks of chunk c: sliced from whole-row refs (GPU: rows [c*cs, c*cs + cs), chunk-major refs at c), or
    the refs as they are (TPU: the grid already selected the chunk)."""
    if not whole:
        return {k: r[...] for k, r in refs.items()}
    rows = pl.ds(pl.multiple_of(c * cs, cs), cs)
    return {k: (r[c] if k.endswith("_row") else r[rows, :]) for k, r in refs.items()}


def _store(ref, c, cs: int, whole: bool, value, chunk_major: bool = False):
    if not whole:
        ref[...] = value
    elif chunk_major:
        ref[c] = value
    else:
        ref[pl.ds(pl.multiple_of(c * cs, cs), cs), :] = value


def _fwd_kernel(*refs, cs: int, whole: bool, keep_states: bool):
    n_in = len(IN)
    ins = dict(zip(IN, refs[:n_in]))
    init_ref, y_ref, fin_ref = refs[n_in:n_in + 3]
    rest = refs[n_in + 3:]
    st_ref = rest[0] if keep_states else None
    if whole:  # GPU: this program walks every chunk of its (row, head)
        def body(c, s):
            y, s_next = _chunk_fwd(_chunk_of(ins, c, cs, True), s)
            _store(y_ref, c, cs, True, y)
            if keep_states:
                _store(st_ref, c, cs, True, s, chunk_major=True)
            return s_next

        fin_ref[...] = jax.lax.fori_loop(0, ins["a_row"].shape[0], body, init_ref[...])
        return
    scratch = rest[-1]  # TPU: one chunk per program, the state carried in VMEM across the sequential chunk axis
    c = pl.program_id(2)

    @pl.when(c == 0)
    def _():
        scratch[...] = init_ref[...]

    s = scratch[...]
    y, s_next = _chunk_fwd(_chunk_of(ins, c, cs, False), s)
    y_ref[...] = y
    if keep_states:
        st_ref[...] = s
    scratch[...] = s_next

    @pl.when(c == pl.num_programs(2) - 1)
    def _():
        fin_ref[...] = s_next


def _bwd_kernel(*refs, cs: int, whole: bool):
    n_in = len(IN)
    ins = dict(zip(IN, refs[:n_in]))
    st_ref, dy_ref, dfin_ref = refs[n_in:n_in + 3]
    outs = dict(zip(GRADS + ("s",), refs[n_in + 3:n_in + 3 + len(GRADS) + 1]))

    def one(c, ds_next, blk, s, dy):
        g = _chunk_bwd(blk, s, dy, ds_next)
        for k in GRADS:
            _store(outs[k], c, cs, whole, g[k], chunk_major=k == "a_row")
        return g["s"]

    if whole:
        nc = ins["a_row"].shape[0]

        def body(k, ds_next):
            c = nc - 1 - k
            rows = pl.ds(pl.multiple_of(c * cs, cs), cs)
            return one(c, ds_next, _chunk_of(ins, c, cs, True), st_ref[c], dy_ref[rows, :])

        outs["s"][...] = jax.lax.fori_loop(0, nc, body, dfin_ref[...])
        return
    scratch = refs[-1]
    k = pl.program_id(2)  # chunks in reverse: the index maps read chunk nc - 1 - k

    @pl.when(k == 0)
    def _():
        scratch[...] = dfin_ref[...]

    ds = one(None, scratch[...], _chunk_of(ins, None, cs, False), st_ref[...], dy_ref[...])
    scratch[...] = ds

    @pl.when(k == pl.num_programs(2) - 1)
    def _():
        outs["s"][...] = ds


def _specs(kind: str, dims: dict, whole: bool, reverse: bool = False):
    """BlockSpec of an operand kind. dims: b, h, hg (heads per group), L, nc, cs, P, N. GPU (`whole`): grid (b, h),
    whole rows; TPU: grid (b, h, chunks), one chunk (chunk nc - 1 - k at step k when `reverse`)."""
    cs, nc, L, P, N, hg = (dims[k] for k in ("cs", "nc", "L", "P", "N", "hg"))
    if whole:
        shapes = {"row": ((None, None, L, P), lambda b, h: (b, h, 0, 0)),
                  "col": ((None, None, L, 1), lambda b, h: (b, h, 0, 0)),
                  "col_row": ((None, None, nc, 1, cs), lambda b, h: (b, h, 0, 0, 0)),
                  "bc": ((None, None, L, N), lambda b, h: (b, jax.lax.div(h, hg), 0, 0)),
                  "seg": ((None, L, 1), lambda b, h: (b, 0, 0)),
                  "seg_row": ((None, nc, 1, cs), lambda b, h: (b, 0, 0, 0)),
                  "state": ((None, None, P, N), lambda b, h: (b, h, 0, 0)),
                  "states": ((None, None, nc, P, N), lambda b, h: (b, h, 0, 0, 0)),
                  "bc_head": ((None, None, L, N), lambda b, h: (b, h, 0, 0))}
    else:
        ch = (lambda k: nc - 1 - k) if reverse else (lambda k: k)
        shapes = {"row": ((None, None, cs, P), lambda b, h, k: (b, h, ch(k), 0)),
                  "col": ((None, None, cs, 1), lambda b, h, k: (b, h, ch(k), 0)),
                  "col_row": ((None, None, None, 1, cs), lambda b, h, k: (b, h, ch(k), 0, 0)),
                  "bc": ((None, None, cs, N), lambda b, h, k: (b, jax.lax.div(h, hg), ch(k), 0)),
                  "seg": ((None, cs, 1), lambda b, h, k: (b, ch(k), 0)),
                  "seg_row": ((None, None, 1, cs), lambda b, h, k: (b, ch(k), 0, 0)),
                  "state": ((None, None, P, N), lambda b, h, k: (b, h, 0, 0)),
                  "states": ((None, None, None, P, N), lambda b, h, k: (b, h, ch(k), 0, 0)),
                  "bc_head": ((None, None, cs, N), lambda b, h, k: (b, h, ch(k), 0))}
    shape, index = shapes[kind]
    return pl.BlockSpec(shape, index)


KIND = {"x": "row", "dt": "col", "a": "col", "a_row": "col_row", "into": "col", "outof": "col", "B": "bc", "C": "bc",
        "seg": "seg", "seg_row": "seg_row"}


def _params(impl: str, whole: bool, P: int):
    if impl == "triton":
        from jax.experimental.pallas import triton as plgpu

        return plgpu.CompilerParams(num_warps=8 if P >= 64 else 4, num_stages=1)
    from jax.experimental.pallas import tpu as pltpu

    return pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary"))


def _scratch(impl: str, P: int, N: int):
    if impl == "triton":
        return ()
    from jax.experimental.pallas import tpu as pltpu

    return (pltpu.VMEM((P, N), jnp.float32),)


def _dims(ins: dict, h: int) -> dict:
    b, _, L, P = ins["x"].shape
    g, N = ins["B"].shape[1], ins["B"].shape[3]
    nc, cs = ins["a_row"].shape[2], ins["a_row"].shape[4]
    return {"b": b, "h": h, "hg": h // g, "L": L, "nc": nc, "cs": cs, "P": P, "N": N}


def _grid(d: dict, whole: bool):
    return (d["b"], d["h"]) if whole else (d["b"], d["h"], d["nc"])


def _fwd_call(ins: dict, init, impl: str, interpret: bool, keep_states: bool):
    whole = impl == "triton"
    d = _dims(ins, init.shape[1])
    f32 = jnp.float32
    b, h, L, P, N, nc = d["b"], d["h"], d["L"], d["P"], d["N"], d["nc"]
    out_shape = [jax.ShapeDtypeStruct((b, h, L, P), f32), jax.ShapeDtypeStruct((b, h, P, N), f32)]
    out_specs = [_specs("row", d, whole), _specs("state", d, whole)]
    if keep_states:
        out_shape.append(jax.ShapeDtypeStruct((b, h, nc, P, N), f32))
        out_specs.append(_specs("states", d, whole))
    return pl.pallas_call(
        functools.partial(_fwd_kernel, cs=d["cs"], whole=whole, keep_states=keep_states),
        grid=_grid(d, whole), in_specs=[_specs(KIND[k], d, whole) for k in IN] + [_specs("state", d, whole)],
        out_specs=out_specs, out_shape=out_shape, scratch_shapes=_scratch(impl, P, N),
        compiler_params=_params(impl, whole, P), interpret=interpret, name="ssd_fwd",
    )(*[ins[k] for k in IN], init)


def _bwd_call(ins: dict, states, dy, dfin, impl: str, interpret: bool):
    whole = impl == "triton"
    d = _dims(ins, states.shape[1])
    f32 = jnp.float32
    b, h, L, P, N, nc, cs = d["b"], d["h"], d["L"], d["P"], d["N"], d["nc"], d["cs"]
    sp = lambda kind: _specs(kind, d, whole, reverse=True)  # noqa: E731
    shapes = {"x": (b, h, L, P), "dt": (b, h, L, 1), "a": (b, h, L, 1), "a_row": (b, h, nc, 1, cs),
              "into": (b, h, L, 1), "outof": (b, h, L, 1), "B": (b, h, L, N), "C": (b, h, L, N), "s": (b, h, P, N)}
    kinds = dict(KIND, B="bc_head", C="bc_head", s="state")
    return pl.pallas_call(
        functools.partial(_bwd_kernel, cs=cs, whole=whole),
        grid=_grid(d, whole),
        in_specs=[sp(KIND[k]) for k in IN] + [sp("states"), sp("row"), sp("state")],
        out_specs=[sp(kinds[k]) for k in GRADS + ("s",)],
        out_shape=[jax.ShapeDtypeStruct(shapes[k], f32) for k in GRADS + ("s",)],
        scratch_shapes=_scratch(impl, P, N), compiler_params=_params(impl, whole, P), interpret=interpret,
        name="ssd_bwd",
    )(*[ins[k] for k in IN], states, dy, dfin)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _scan(ins: dict, init, impl: str, interpret: bool):
    y, fin = _fwd_call(ins, init, impl, interpret, keep_states=False)
    return y, fin


def _scan_fwd(ins, init, impl, interpret):
    y, fin, states = _fwd_call(ins, init, impl, interpret, keep_states=True)
    return (y, fin), (ins, states)


def _scan_bwd(impl, interpret, res, cts):
    ins, states = res
    dy, dfin = cts
    g = dict(zip(GRADS + ("s",), _bwd_call(ins, states, dy, dfin, impl, interpret)))
    h, g_ = states.shape[1], ins["B"].shape[1]
    b, _, L, N = g["B"].shape
    sum_heads = lambda t: t.reshape(b, g_, h // g_, L, N).sum(axis=2)  # noqa: E731  (a group's heads share B / C)
    d_ins = {k: g[k] for k in GRADS}
    d_ins["B"], d_ins["C"] = sum_heads(g["B"]), sum_heads(g["C"])
    d_ins["seg"] = d_ins["seg_row"] = None
    return d_ins, g["s"]


_scan.defvjp(_scan_fwd, _scan_bwd)


# ----------------------------------------------------------------------------- the model's entry point
def _inputs(x, dt, A, B, C, segment_ids, cs: int, P: int, N: int):
    """The kernel's operands (heads-major, padded to whole chunks and to P / N) and what undoes the layout."""
    f32 = jnp.float32
    b, l, h, p = x.shape
    g, n = B.shape[2], B.shape[3]
    L = -(-l // cs) * cs
    nc = L // cs
    pad_l = ((0, 0), (0, L - l))
    x = jnp.pad(x.astype(f32), pad_l + ((0, 0), (0, P - p)))
    dt = jnp.pad(dt.astype(f32), pad_l + ((0, 0),))  # dt 0 on padding: the state passes through it unchanged
    B, C = (jnp.pad(t.astype(f32), pad_l + ((0, 0), (0, N - n))) for t in (B, C))
    seg = jnp.zeros((b, l), jnp.int32) if segment_ids is None else segment_ids.astype(jnp.int32)
    seg = jnp.pad(seg, pad_l, mode="edge")
    a = jnp.cumsum((dt * A.astype(f32)).reshape(b, nc, cs, h), axis=2)  # [b, c, s, h]
    sc = seg.reshape(b, nc, cs)
    seg_in = jnp.concatenate([sc[:, :1, 0], sc[:, :-1, -1]], axis=1)  # the segment of the state entering a chunk
    into = jnp.exp(a) * (sc == seg_in[..., None])[..., None]
    outof = jnp.exp(a[:, :, -1:] - a) * (sc == sc[:, :, -1:])[..., None]
    col = lambda t: t.reshape(b, L, h).transpose(0, 2, 1)[..., None]  # noqa: E731  [b, h, L, 1]
    ins = {"x": x.transpose(0, 2, 1, 3), "dt": col(dt), "a": col(a), "a_row": a.transpose(0, 3, 1, 2)[:, :, :, None],
           "into": col(into), "outof": col(outof), "B": B.transpose(0, 2, 1, 3), "C": C.transpose(0, 2, 1, 3),
           "seg": seg[..., None], "seg_row": sc[:, :, None]}
    return ins


def ssd_scan(x, dt, A, B, C, segment_ids=None, initial_state=None, *, impl: str, interpret: bool = False,
             chunk: int | None = None):
    """The chunked SSD scan by the Pallas kernels: x [b, l, h, p], dt [b, l, h] (after softplus / clamping), A [h]
    (negative), B/C [b, l, g, n], segment_ids [b, l] (contiguous documents) or None, initial_state [b, h, p, n]
    or None -> (y [b, l, h, p], final state [b, h, p, n]), fp32, as `mamba2.ssd_chunked`. Differentiable in x,
    dt, A, B, C and the initial state. `chunk`: tokens per kernel chunk (default CHUNK[impl])."""
    if impl not in IMPLEMENTATIONS:
        raise ValueError(f"ssd_scan: unknown implementation {impl!r}; expected one of {IMPLEMENTATIONS}")
    b, l, h, p = x.shape
    n = B.shape[3]
    cs = min(_pow2(chunk or CHUNK[impl]), _pow2(l))
    P, N = (_pow2(p), _pow2(n)) if impl == "triton" else (p, n)  # Triton's tiles are powers of two
    ins = _inputs(x, dt, A, B, C, segment_ids, cs, P, N)
    init = jnp.zeros((b, h, p, n), jnp.float32) if initial_state is None else initial_state.astype(jnp.float32)
    init = jnp.pad(init, ((0, 0), (0, 0), (0, P - p), (0, N - n)))
    y, final = _scan(ins, init, impl, bool(interpret))
    return y.transpose(0, 2, 1, 3)[:, :l, :, :p], final[:, :, :p, :n]


def ssd_scan_sharded(x, dt, A, B, C, segment_ids=None, initial_state=None, *, impl: str, mesh=None,
                     interpret: bool = False):
    """`ssd_scan` per device inside shard_map on a mesh (rows over the batch axes, heads and their B/C groups over
    `tensor` when it divides the groups): GSPMD does not partition Pallas calls."""
    from nemo_jax.kernels.attention import spec

    b, g = x.shape[0], B.shape[2]
    seg = jnp.zeros(x.shape[:2], jnp.int32) if segment_ids is None else segment_ids
    init = (jnp.zeros((*x.shape[:1], x.shape[2], x.shape[3], B.shape[3]), jnp.float32) if initial_state is None
            else initial_state)
    local = functools.partial(ssd_scan, impl=impl, interpret=interpret)
    if mesh is None or mesh.size == 1:
        return local(x, dt, A, B, C, seg, init)
    dims = {"x": ("rows", None, "heads", None), "dt": ("rows", None, "heads"), "A": ("heads",),
            "B": ("rows", None, "heads", None), "seg": ("rows", None), "init": ("rows", "heads", None, None)}
    s = lambda k: spec(mesh, b, g, dims[k])  # noqa: E731
    return jax.shard_map(lambda x, dt, A, B, C, seg, init: local(x, dt, A, B, C, seg, init), mesh=mesh,
                         in_specs=(s("x"), s("dt"), s("A"), s("B"), s("B"), s("seg"), s("init")),
                         out_specs=(s("x"), s("init")), check_vma=False)(x, dt, A, B, C, seg, init)
