"""Mamba2 mixer: causal depthwise conv, chunked SSD scan (segment-aware), sequential reference.

Shapes: b batch, l length, h SSM heads, p head dim, g B/C groups, n state size, c conv channels,
K conv kernel. Head `i` reads B/C group `i // (h // g)`.

All SSM math (dt, A*dt, cumulative sums, segment sums, exp, the state) is fp32.

Two ways of feeding a sequence:
* training / packed: `segment_ids` [b, l]; conv window and SSM state reset where the id changes
  (documents must be contiguous). Each document gets exactly the result it would get alone.
* cached (prefill / decode / continuation): a `MambaState` holding the last K-1 conv inputs and the
  SSM state, plus `valid` [b, l] where padding is only at the left of each row's new chunk. Padding
  never enters the state: its dt is 0 (the state passes through unchanged) and the conv taps skip it.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from nemo_jax.kernels import REFERENCE, Selection
from nemo_jax.model.layers import gated_rms_norm, linear
from nemo_jax.parallel.mesh import context_shards


class MambaState(NamedTuple):
    conv: jax.Array  # [b, K-1, c] last conv inputs (compute dtype)
    ssm: jax.Array  # [b, h, p, n] fp32


# --------------------------------------------------------------------------- conv
def _same_document(segment_ids: jax.Array, m: int) -> jax.Array:
    """[b, l] bool: positions t and t - m hold the same document (False for t < m)."""
    l = segment_ids.shape[1]
    return jnp.pad(segment_ids, ((0, 0), (m, 0)), constant_values=-1)[:, :l] == segment_ids


def _delay(x: jax.Array, m: int) -> jax.Array:
    """x [b, l, c] delayed by m positions along l (zeros enter at the start)."""
    return jnp.pad(x, ((0, 0), (m, 0), (0, 0)))[:, :x.shape[1]] if m else x


def _advance(x: jax.Array, m: int) -> jax.Array:
    """x [b, l, c] advanced by m positions along l (zeros enter at the end): the transpose of `_delay`."""
    return jnp.pad(x, ((0, 0), (0, m), (0, 0)))[:, m:] if m else x


def _conv_taps(x, kernel, segment_ids):
    """sum over lags m of kernel[K-1-m] * x[t - m] (x, kernel fp32; a lag across a document start is 0)."""
    K = kernel.shape[0]
    out = x * kernel[K - 1]
    for m in range(1, K):
        lag = _delay(x, m)
        if segment_ids is not None:
            lag = lag * _same_document(segment_ids, m)[..., None]
        out = out + lag * kernel[K - 1 - m]
    return out


@jax.custom_vjp
def _conv_fast(x, kernel, segment_ids):
    return _conv_taps(x, kernel, segment_ids)


def _conv_fast_fwd(x, kernel, segment_ids):
    return _conv_taps(x, kernel, segment_ids), (x, kernel, segment_ids)


def _conv_fast_bwd(res, g):
    """dx[s] = sum_m g[s + m] w[K-1-m] (masked at the output), dw[K-1-m] = sum_{b,t} g[t] x[t - m]: elementwise
    passes and one column sum per tap (XLA's autodiff of the padded shifts ran ~20x slower on CPU)."""
    x, kernel, segment_ids = res
    K = kernel.shape[0]
    dx = g * kernel[K - 1]
    dw = [None] * K
    dw[K - 1] = jnp.sum(g * x, axis=(0, 1))
    for m in range(1, K):
        gm = g if segment_ids is None else g * _same_document(segment_ids, m)[..., None]
        dx = dx + _advance(gm, m) * kernel[K - 1 - m]
        dw[K - 1 - m] = jnp.sum(gm * _delay(x, m), axis=(0, 1))
    return dx, jnp.stack(dw), None


_conv_fast.defvjp(_conv_fast_fwd, _conv_fast_bwd)


def causal_conv(xbc: jax.Array, kernel: jax.Array, bias, segment_ids=None, reference: bool = False) -> jax.Array:
    """Depthwise causal conv. xbc [b, l, c], kernel [K, c] (tap K-1 is the current token) -> [b, l, c] fp32.

    The taps are elementwise multiply-adds over shifted copies, with a hand-written backward (elementwise
    passes plus one column sum per tap); `reference=True` is the same forward under plain autodiff.
    """
    x, w = xbc.astype(jnp.float32), kernel.astype(jnp.float32)
    out = _conv_taps(x, w, segment_ids) if reference else _conv_fast(x, w, segment_ids)
    if bias is not None:
        out = out + bias.astype(jnp.float32)
    return out


def causal_conv_cached(xbc, kernel, bias, window, n_pad):
    """Conv over [window | chunk] where the first n_pad[b] chunk positions are padding to skip.

    xbc [b, l, c]; window [b, K-1, c]; n_pad [b] int. Returns (out [b, l, c] fp32, new window [b, K-1, c]).
    """
    K = kernel.shape[0]
    b, l, c = xbc.shape
    seq = jnp.concatenate([window.astype(xbc.dtype), xbc], axis=1)  # [b, K-1+l, c]
    j = jnp.arange(l + 1)[None, :, None]  # chunk positions, plus one past the end for the new window
    m = jnp.arange(K)[None, None, :]  # lag
    v = j - m
    npad = n_pad[:, None, None]
    idx = jnp.where(v >= npad, (K - 1) + v, (K - 1) - npad + v)
    idx = jnp.clip(idx, 0, K - 2 + l)  # [b, l+1, K]
    taps = jnp.take_along_axis(seq[:, :, None, :], idx.reshape(b, -1)[:, :, None, None], axis=1)
    taps = taps.reshape(b, l + 1, K, c)
    w = kernel.astype(jnp.float32)[::-1]  # lag m uses kernel[K-1-m]
    out = jnp.einsum("bjmc,mc->bjc", taps[:, :l].astype(jnp.float32), w)
    if bias is not None:
        out = out + bias.astype(jnp.float32)
    new_window = taps[:, l, 1:][:, ::-1]  # lags K-1..1 of the virtual next token, oldest first
    return out, new_window.astype(window.dtype)


# --------------------------------------------------------------------------- SSD
def _segsum(x: jax.Array) -> jax.Array:
    """Stable segment sum: x [..., T] -> [..., T, T] with out[i, j] = sum_{j<k<=i} x[k], -inf above diagonal."""
    T = x.shape[-1]
    xx = jnp.broadcast_to(x[..., :, None], (*x.shape, T))  # [..., k, j]
    lower = jnp.tril(jnp.ones((T, T), bool), -1)
    xx = jnp.where(lower, xx, 0.0)
    # cumulative sum over k as a matmul with a lower-triangular ones matrix (XLA lowers cumsum to an
    # O(T^2) reduce-window; the masked terms are exact zeros, so this is the same stable sum)
    ss = jnp.einsum("ik,...kj->...ij", jnp.tril(jnp.ones((T, T), x.dtype)), xx,
                    precision=jax.lax.Precision.HIGHEST)
    return jnp.where(jnp.tril(jnp.ones((T, T), bool)), ss, -jnp.inf)


def ssd_chunked(x, dt, A, B, C, chunk_size: int, segment_ids=None, initial_state=None):
    """Chunked SSD scan.

    x [b, l, h, p], dt [b, l, h] (already softplus'd/clamped), A [h] (negative), B/C [b, l, g, n].
    Returns y [b, l, h, p] (without the D skip) and the final state [b, h, p, n], fp32.
    """
    f32 = jnp.float32
    b, l, h, p = x.shape
    g, n = B.shape[2], B.shape[3]
    hg = h // g
    cs = min(chunk_size, l)
    pad = (-l) % cs
    x, dt, B, C = (t.astype(f32) for t in (x, dt, B, C))
    if pad:
        x, dt, B, C = (jnp.pad(t, [(0, 0), (0, pad)] + [(0, 0)] * (t.ndim - 2)) for t in (x, dt, B, C))
    seg = None
    if segment_ids is not None:
        seg = jnp.pad(segment_ids, ((0, 0), (0, pad)), mode="edge") if pad else segment_ids
    L = l + pad
    nc = L // cs
    # heads-major inside each chunk ([b, c, h, s, p]: one transpose in, one out): every einsum below is then a
    # batched matmul over (b, c, h) or (b, c, g) with no transposes of 6-D operands, and the backward's sums over
    # a group's heads run over a major axis (token-major, the bench Mamba layer's SSD took 25% longer)
    x = x.reshape(b, nc, cs, h, p).transpose(0, 1, 3, 2, 4)
    dt = dt.reshape(b, nc, cs, h).transpose(0, 1, 3, 2)  # [b, c, h, s]
    B = B.reshape(b, nc, cs, g, n).transpose(0, 1, 3, 2, 4)  # [b, c, g, s, n]
    C = C.reshape(b, nc, cs, g, n).transpose(0, 1, 3, 2, 4)
    dA = dt * A.astype(f32)[:, None]  # [b, c, h, s]
    dA_cs = jnp.cumsum(dA, axis=-1)
    xdt = x * dt[..., None]  # [b, c, h, s, p]

    # 1. within each chunk (quadratic form)
    Lmat = jnp.exp(_segsum(dA))  # [b, c, h, i, j]
    if seg is not None:
        sc = seg.reshape(b, nc, cs)
        Lmat = Lmat * (sc[:, :, :, None] == sc[:, :, None, :])[:, :, None]
    CB = jnp.einsum("bcgin,bcgjn->bcgij", C, B)
    M = (CB[:, :, :, None] * Lmat.reshape(b, nc, g, hg, cs, cs)).reshape(b, nc, h, cs, cs)
    y_diag = jnp.einsum("bchij,bchjp->bchip", M, xdt)

    # 2. state of each chunk from its own tokens
    decay_states = jnp.exp(dA_cs[..., -1:] - dA_cs)  # [b, c, h, s]
    if seg is not None:
        decay_states = decay_states * (sc == sc[:, :, -1:])[:, :, None, :]
    states = jnp.einsum("bcgjn,bcgkjp->bcgkpn", B, (xdt * decay_states[..., None]).reshape(b, nc, g, hg, cs, p))
    states = states.reshape(b, nc, h, p, n)

    # 3. pass states between chunks
    init = jnp.zeros((b, h, p, n), f32) if initial_state is None else initial_state.astype(f32)
    states = jnp.concatenate([init[:, None], states], axis=1)  # [b, c+1, h, p, n]
    totals = jnp.pad(dA_cs[..., -1], ((0, 0), (1, 0), (0, 0)))  # [b, c+1, h]
    decay_chunk = jnp.exp(_segsum(jnp.moveaxis(totals, 2, 1)))  # [b, h, z, c]
    if seg is not None:
        owner = jnp.concatenate([seg[:, :1], sc[:, :, -1]], axis=1)  # segment each state belongs to
        decay_chunk = decay_chunk * (owner[:, :, None] == owner[:, None, :])[:, None]
    new_states = jnp.einsum("bhzc,bchpn->bzhpn", decay_chunk, states)
    prev_states, final_state = new_states[:, :-1], new_states[:, -1]

    # 4. contribution of the incoming state to each token
    out_decay = jnp.exp(dA_cs)  # [b, c, h, s]
    if seg is not None:
        out_decay = out_decay * (sc == owner[:, :-1, None])[:, :, None, :]
    y_off = jnp.einsum("bcgin,bcgkpn->bcgkip", C, prev_states.reshape(b, nc, g, hg, p, n)).reshape(b, nc, h, cs, p)
    y = y_diag + y_off * out_decay[..., None]  # [b, c, h, s, p]
    return y.transpose(0, 1, 3, 2, 4).reshape(b, L, h, p)[:, :l], final_state


def ssd_sequential(x, dt, A, B, C, segment_ids=None, initial_state=None):
    """Reference: the per-token recurrence h_t = exp(dt A) h_{t-1} + dt x_t B_t, y_t = C_t h_t. Same I/O as ssd_chunked."""
    f32 = jnp.float32
    b, l, h, p = x.shape
    g = B.shape[2]
    rep = h // g
    Bh = jnp.repeat(B.astype(f32), rep, axis=2)  # [b, l, h, n]
    Ch = jnp.repeat(C.astype(f32), rep, axis=2)
    state = jnp.zeros((b, h, p, B.shape[3]), f32) if initial_state is None else initial_state.astype(f32)
    seg = jnp.zeros((b, l), jnp.int32) if segment_ids is None else segment_ids
    prev = jnp.concatenate([seg[:, :1], seg[:, :-1]], axis=1)

    def step(s, inp):
        xt, dtt, bt, ct, reset = inp
        s = jnp.where(reset[:, None, None, None], 0.0, s)
        s = s * jnp.exp(dtt * A.astype(f32))[:, :, None, None] + (dtt[:, :, None] * xt)[..., None] * bt[:, :, None, :]
        return s, jnp.einsum("bhpn,bhn->bhp", s, ct)

    xs = (jnp.moveaxis(x.astype(f32), 1, 0), jnp.moveaxis(dt.astype(f32), 1, 0), jnp.moveaxis(Bh, 1, 0),
          jnp.moveaxis(Ch, 1, 0), jnp.moveaxis(seg != prev, 1, 0))
    final, ys = jax.lax.scan(step, state, xs)
    return jnp.moveaxis(ys, 0, 1), final


def ssd_step(x, dt, A, B, C, initial_state=None):
    """One token (decode): h = exp(dt A) h0 + dt x B, y = C h, in a handful of ops (the chunked form's
    machinery dominates a one-token step). Same I/O as ssd_chunked with l = 1 and no segments."""
    f32 = jnp.float32
    b, l, h, p = x.shape
    assert l == 1, l
    g, n = B.shape[2], B.shape[3]
    x, dt, B, C = x[:, 0].astype(f32), dt[:, 0].astype(f32), B[:, 0].astype(f32), C[:, 0].astype(f32)
    s0 = jnp.zeros((b, h, p, n), f32) if initial_state is None else initial_state.astype(f32)
    s0 = s0.reshape(b, g, h // g, p, n)
    decay = jnp.exp(dt * A.astype(f32)).reshape(b, g, h // g)
    xdt = (x * dt[..., None]).reshape(b, g, h // g, p)
    s = s0 * decay[..., None, None] + jnp.einsum("bgkp,bgn->bgkpn", xdt, B)
    y = jnp.einsum("bgkpn,bgn->bgkp", s, C)
    return y.reshape(b, 1, h, p), s.reshape(b, h, p, n)


# --------------------------------------------------------------------------- context parallelism
def _from_previous(a: jax.Array, n: int, axis: str, fill=0) -> jax.Array:
    """Inside shard_map over `axis`: the last n positions (dim 1) of the previous shard's `a`; `fill` on the
    first shard."""
    size = jax.lax.axis_size(axis)
    got = jax.lax.ppermute(a[:, -n:], axis, [(j, j + 1) for j in range(size - 1)])
    return got if fill == 0 else jnp.where(jax.lax.axis_index(axis) == 0, jnp.asarray(fill, a.dtype), got)


def causal_conv_context(xbc, kernel, bias, segment_ids, axis: str):
    """`causal_conv` of a sequence split over `axis` (inside shard_map; xbc [b, l_local, c]): each shard takes
    its K-1 previous inputs (and their segment ids) from the previous shard."""
    K = kernel.shape[0]
    if K == 1:
        return causal_conv(xbc, kernel, bias, segment_ids)
    if xbc.shape[1] < K - 1:
        raise ValueError(f"context parallelism: {xbc.shape[1]} tokens per shard, fewer than the conv's {K - 1} lags")
    seg = None
    if segment_ids is not None:
        seg = jnp.concatenate([_from_previous(segment_ids, K - 1, axis, fill=-1), segment_ids], axis=1)
    out = causal_conv(jnp.concatenate([_from_previous(xbc, K - 1, axis), xbc], axis=1), kernel, bias, seg)
    return out[:, K - 1:]


def ssd_context(x, dt, A, B, C, chunk_size: int, segment_ids, axis: str, scan: str = "chunked"):
    """The SSD of a sequence split over `axis` (inside shard_map; shapes as `ssd_chunked`, l = the shard's part).

    Each shard scans its own tokens from a zero state; the shards' final states and total decays are
    all-gathered and combined in order (state entering shard j = state leaving shard j-1 when the segment
    continues across the boundary; leaving = own final state + entering one decayed through the shard, unless a
    segment starts inside it); each shard then adds the entering state's contribution to its tokens up to its
    first segment start. Returns (y, the state after this shard)."""
    f32 = jnp.float32
    y, last = SCANS[scan](x, dt, A, B, C, chunk_size=chunk_size, segment_ids=segment_ids)
    b, l, h, _ = x.shape
    dA_cs = jnp.cumsum(dt.astype(f32) * A.astype(f32), axis=1)  # [b, l, h]
    if segment_ids is None:
        head = jnp.ones((b, l), bool)  # tokens the entering state reaches
        first = final_seg = jnp.zeros((b,), jnp.int32)
    else:
        head = segment_ids == segment_ids[:, :1]
        first, final_seg = segment_ids[:, 0], segment_ids[:, -1]
    decay = jnp.exp(dA_cs[:, -1]) * jnp.all(head, axis=1)[:, None]  # [b, h]; 0 if a segment starts inside
    lasts, decays, firsts, finals = (jax.lax.all_gather(a, axis) for a in (last, decay, first, final_seg))
    carry, entering, leaving = jnp.zeros_like(last), [], []
    for j in range(lasts.shape[0]):
        cont = firsts[j] == finals[j - 1] if j else jnp.zeros_like(first, bool)
        enter = carry * cont[:, None, None, None]
        carry = lasts[j] + enter * decays[j][:, :, None, None]
        entering.append(enter)
        leaving.append(carry)
    i = jax.lax.axis_index(axis)
    h_in = jnp.stack(entering)[i]  # [b, h, p, n]
    Ch = jnp.repeat(C.astype(f32), h // C.shape[2], axis=2)  # [b, l, h, n]
    y_in = jnp.einsum("blhn,bhpn->blhp", Ch, h_in) * (jnp.exp(dA_cs) * head[..., None])[..., None]
    return y + y_in, jnp.stack(leaving)[i]


SCANS = {"chunked": ssd_chunked, "sequential": lambda x, dt, A, B, C, chunk_size, **kw: ssd_sequential(x, dt, A, B, C, **kw)}


# --------------------------------------------------------------------------- mixer
def group_widths(cfg) -> dict[str, int]:
    """Per-group widths of the group-major in_proj / conv parts: z/x a group's heads x head dim, B/C the state
    size, dt one per head, xBC the conv's input x|B|C."""
    N, Hg, P = cfg.ssm_state_size, cfg.mamba_num_heads // cfg.n_groups, cfg.mamba_head_dim
    return {"z": Hg * P, "x": Hg * P, "B": N, "C": N, "dt": Hg, "xBC": Hg * P + 2 * N}


def split_groups(t: jax.Array, cfg, parts: tuple[str, ...]) -> tuple[jax.Array, ...]:
    """Split a group-major `[b, l, G * sum(widths)]` activation (our in_proj / conv layout: for each B/C group,
    its heads' z and x, B_g, C_g, its heads' dt; `nemo_jax.hf.mapping.mamba_group_runs`) into its parts, each
    `[b, l, G, width]`: z/x `[.., G, Hg*P]`, B/C `[.., G, N]`, dt `[.., G, Hg]` (xBC: the conv's input x|B|C).
    A shard of whole groups (tensor parallelism with `tensor` dividing `n_groups`) splits locally."""
    width = group_widths(cfg)
    cuts = np.cumsum([width[p] for p in parts])[:-1].tolist()
    return tuple(jnp.split(t.reshape(*t.shape[:-1], cfg.n_groups, -1), cuts, axis=-1))


def _scan(xbc_c, dt, A, D, cfg, segment_ids, scan: str, init=None, axis: str | None = None,
          kernels: Selection = REFERENCE, mesh=None):
    """Conv output (after silu) [b, l, conv_dim] (group-major x|B|C) -> (y [b, l, h, p] fp32 with the D skip,
    final state); over a sequence split along `axis` (inside shard_map) with `ssd_context`. `kernels`: the
    chunked scan's Pallas kernel (`nemo_jax.kernels.ssd`, per device on `mesh`) where the selection has one."""
    b, l, _ = xbc_c.shape
    H, P = cfg.mamba_num_heads, cfg.mamba_head_dim
    x, Bm, Cm = split_groups(xbc_c, cfg, ("x", "B", "C"))
    xh = x.reshape(b, l, H, P)
    impl = kernels.impl("ssd") if scan == "chunked" else "reference"
    if axis is None and l == 1 and segment_ids is None and scan == "chunked":  # decode: one token
        y, final = ssd_step(xh, dt, A, Bm, Cm, initial_state=init)
    elif axis is None and impl != "reference":
        from nemo_jax.kernels.ssd import ssd_scan_sharded

        y, final = ssd_scan_sharded(xh, dt, A, Bm, Cm, segment_ids, init, impl=impl, mesh=mesh,
                                    interpret=kernels.interpret)
    elif axis is None:
        y, final = SCANS[scan](xh, dt, A, Bm, Cm, chunk_size=cfg.chunk_size, segment_ids=segment_ids,
                               initial_state=init)
    else:
        y, final = ssd_context(xh, dt, A, Bm, Cm, cfg.chunk_size, segment_ids, axis, scan)
    return y + D.astype(jnp.float32)[:, None] * xh, final


def _conv_scan(p, xbc, dt, A, cfg, segment_ids, scan: str, mesh=None, kernels: Selection = REFERENCE):
    """Training path, the whole sequence on each device: xbc [b, l, c] -> (y [b, l, h, p], final state)."""
    xbc_c = causal_conv(xbc, p["conv1d"]["kernel"], p["conv1d"].get("bias"), segment_ids)
    return _scan(jax.nn.silu(xbc_c), dt, A, p["D"], cfg, segment_ids, scan, kernels=kernels, mesh=mesh)


def _conv_scan_context(p, xbc, dt, A, cfg, segment_ids, scan: str, mesh, kernels: Selection = REFERENCE):
    """`_conv_scan` with the sequence split over the mesh's `context` axis (other axes left to GSPMD): the conv
    window and the SSM state cross shard boundaries (`causal_conv_context`, `ssd_context`)."""
    from jax.sharding import PartitionSpec as P

    weights = {"kernel": p["conv1d"]["kernel"], "D": p["D"], "A": A}
    if p["conv1d"].get("bias") is not None:
        weights["bias"] = p["conv1d"]["bias"]
    seq = P(None, "context")
    # the weights enter in fp32, cast back inside: their cotangents leave by a psum over `context`, which in bf16
    # crashed XLA's CPU all-reduce promotion (and would sum the shards' gradients in bf16)
    dtypes = jax.tree.map(lambda a: a.dtype, weights)
    weights = jax.tree.map(lambda a: a.astype(jnp.float32), weights)

    def local(w, xbc, dt, seg):
        w = jax.tree.map(lambda a, d: a.astype(d), w, dtypes)
        xbc_c = causal_conv_context(xbc, w["kernel"], w.get("bias"), seg, "context")
        y, final = _scan(jax.nn.silu(xbc_c), dt, w["A"], w["D"], cfg, seg, scan, axis="context")
        return y, final[None]

    y, final = jax.shard_map(local, mesh=mesh, in_specs=(P(), seq, seq, None if segment_ids is None else seq),
                             out_specs=(seq, P("context")), axis_names={"context"}, check_vma=False)(
        weights, xbc, dt, segment_ids)
    return y, final[-1]


def mamba_mixer(p: dict, u: jax.Array, cfg, dtype, *, segment_ids=None, state: MambaState | None = None,
                valid=None, scan: str = "chunked", mesh=None, kernels: Selection = REFERENCE):
    """u [b, l, D] -> (y [b, l, D], new MambaState).

    Without `state`: packed training forward (segment_ids optional); the returned state is the one
    after the last token (meaningful when the row holds one document). A `mesh` with a `context` axis splits
    the sequence over it (the chunked scan then runs the reference on each shard). With `state`: continue it,
    `valid` [b, l] marking real tokens (padding only at the left). `kernels` (`nemo_jax.kernels.select`): the
    chunked scan's kernel where the platform has one.
    """
    b, l, _ = u.shape
    G, Di = cfg.n_groups, cfg.d_inner
    zxbcdt = linear(u, p["in_proj"], dtype)  # group-major: per group z_g | x_g B_g C_g | dt_g
    z, xbc, dt_raw = (t.reshape(b, l, -1) for t in split_groups(zxbcdt, cfg, ("z", "xBC", "dt")))
    bias = p["conv1d"].get("bias")
    dt = jax.nn.softplus(dt_raw.astype(jnp.float32) + p["dt_bias"].astype(jnp.float32))
    lo, hi = cfg.time_step_limit
    if cfg.clamp_dt:
        lo = max(lo, cfg.time_step_min)
    if lo > 0.0 or hi != float("inf"):
        dt = jnp.clip(dt, lo, hi)
    if valid is not None:
        dt = dt * valid[..., None]
    A = -jnp.exp(p["A_log"].astype(jnp.float32))
    K = cfg.conv_kernel
    if state is None:
        window = jnp.pad(xbc, ((0, 0), (max(K - 1 - l, 0), 0), (0, 0)))[:, -(K - 1):] if K > 1 else xbc[:, :0]
        split = context_shards(mesh, l) > 1
        y, final = (_conv_scan_context if split else _conv_scan)(p, xbc, dt, A, cfg, segment_ids, scan, mesh,
                                                                 kernels=kernels)
    else:
        n_pad = l - jnp.sum(valid, axis=1).astype(jnp.int32)
        xbc_c, window = causal_conv_cached(xbc, p["conv1d"]["kernel"], bias, state.conv, n_pad)
        y, final = _scan(jax.nn.silu(xbc_c), dt, A, p["D"], cfg, None, scan, init=state.ssm, kernels=kernels,
                         mesh=mesh)
    y = gated_rms_norm(y.reshape(b, l, Di), z, p["norm"]["scale"], G, cfg.layer_norm_epsilon)
    out = linear(y.astype(dtype), p["out_proj"], dtype)
    return out, MambaState(window.astype(dtype), final)

