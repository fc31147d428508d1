"""Small building blocks: norms, linear maps, the relu^2 MLP, embeddings and a chunked cross-entropy."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np


# checkpoint name of a matmul's output whose weight gets no gradient (a LoRA base, a frozen part): the remat
# policy `save_frozen` keeps these for the backward instead of recomputing the frozen projections
FROZEN_PRODUCT = "frozen_product"


def frozen_product(mm, x, w, *operands):
    """mm(x, w, *operands), its output named FROZEN_PRODUCT when w is not differentiated (its tangent a symbolic
    zero: a closed-over frozen base, a stop_gradient); unchanged (and unnamed) when w is trained or nothing is.
    `operands` (integer group sizes, never differentiated) are passed as arguments, not closed over: a custom_jvp
    whose function closes over a traced array leaks that tracer into the jaxpr XLA:GPU lowers under a scan of
    checkpointed layers ("No constant handler for type: DynamicJaxprTracer")."""
    from jax.custom_derivatives import SymbolicZero

    @jax.custom_jvp
    def f(x, w, *operands):
        return mm(x, w, *operands)

    def jvp(primals, tangents):
        x, w, *operands = primals
        dx, dw = tangents[:2]
        at = lambda x, w: mm(x, w, *operands)  # noqa: E731
        if isinstance(dw, SymbolicZero):
            if isinstance(dx, SymbolicZero):
                y = at(x, w)
                return y, jnp.zeros_like(y)
            y, dy = jax.jvp(lambda x: at(x, w), (x,), (dx,))
            return jax.ad_checkpoint.checkpoint_name(y, FROZEN_PRODUCT), dy
        dx = jnp.zeros_like(x) if isinstance(dx, SymbolicZero) else dx
        return jax.jvp(at, (x, w), (dx, dw))

    f.defjvp(jvp, symbolic_zeros=True)
    return f(x, w, *operands)


def linear(x: jax.Array, p: dict, dtype) -> jax.Array:
    """x [..., in] @ kernel [in, out] -> [..., out] in `dtype` (fp32 accumulation on the device, the result
    rounded once to `dtype`).

    The product is asked for in `dtype`, not in fp32 then cast: its gradients are then `dtype` matmuls too. The
    transpose of an fp32-output product multiplies the fp32 cotangent with the `dtype` operand: under bf16 both
    backward matmuls ran in fp32 and every weight gradient was reduce-scattered in fp32.
    With LoRA leaves beside the kernel (see nemo_jax.lora): + lora_scale * (x @ lora_a) @ lora_b, unmerged (summed
    in fp32, rounded once).
    """
    lead, x2 = x.shape[:-1], x.reshape(-1, x.shape[-1]).astype(dtype)
    y = frozen_product(lambda a, w: jnp.einsum("ti,io->to", a, w, preferred_element_type=dtype), x2,
                       p["kernel"].astype(dtype))
    if "lora_a" in p:
        xa = jnp.einsum("ti,ir->tr", x2, p["lora_a"].astype(dtype), preferred_element_type=dtype)
        lora = jnp.einsum("tr,ro->to", xa, p["lora_b"].astype(dtype), preferred_element_type=jnp.float32)
        y = (y.astype(jnp.float32) + p["lora_scale"] * lora).astype(dtype)
    return y.reshape(*lead, y.shape[-1])


def _linear32(x: jax.Array, p: dict, dtype) -> jax.Array:
    """x [..., in] (in `dtype`) @ kernel (+ unmerged LoRA) -> fp32 [..., out].

    The lead axes are flattened into one token axis first: the kernel's gradient is then a dot with one
    contracting axis, not two ([B, T]), which XLA:CPU runs as a plain matmul (a [1, 1024, 512] x [512, 2048]
    linear fwd+bwd: 43 vs 57 ms)."""
    lead, x = x.shape[:-1], x.reshape(-1, x.shape[-1])
    y = frozen_product(lambda a, w: jnp.einsum("ti,io->to", a, w, preferred_element_type=jnp.float32), x,
                       p["kernel"].astype(dtype))
    if "lora_a" in p:
        xa = jnp.einsum("ti,ir->tr", x, p["lora_a"].astype(dtype), preferred_element_type=jnp.float32)
        y = y + p["lora_scale"] * jnp.einsum("tr,ro->to", xa.astype(dtype), p["lora_b"].astype(dtype),
                                             preferred_element_type=jnp.float32)
    return y.reshape(*lead, y.shape[-1])


def rms_norm(x: jax.Array, scale: jax.Array, eps: float) -> jax.Array:
    """RMSNorm in fp32, result in x's dtype: (scale * x / rms(x))."""
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (scale.astype(jnp.float32) * y).astype(x.dtype)


def gated_rms_norm(y: jax.Array, z: jax.Array, scale: jax.Array, groups: int, eps: float) -> jax.Array:
    """Mamba2 output norm: g = y * silu(z) first, then RMS-normalise in `groups` groups, then * scale.

    y, z: [..., Di]; scale: [Di]. Math in fp32, result fp32.
    """
    g = y.astype(jnp.float32) * jax.nn.silu(z.astype(jnp.float32))
    *lead, d = g.shape
    gg = g.reshape(*lead, groups, d // groups)
    gg = gg * jax.lax.rsqrt(jnp.mean(gg * gg, axis=-1, keepdims=True) + eps)
    return scale.astype(jnp.float32) * gg.reshape(*lead, d)


def relu2(x: jax.Array) -> jax.Array:
    r = jax.nn.relu(x)
    return r * r


def mlp(p: dict, x: jax.Array, dtype) -> jax.Array:
    """Non-gated relu^2 MLP: down(relu(up(x))**2). x [..., D] -> [..., D]."""
    return linear(relu2(linear(x, p["up_proj"], dtype)), p["down_proj"], dtype)


def embed(p: dict, tokens: jax.Array, dtype) -> jax.Array:
    """tokens [B, T] int -> [B, T, D]."""
    return jnp.take(p["embedding"], tokens, axis=0).astype(dtype)


def logits_from_hidden(h: jax.Array, lm_head: dict) -> jax.Array:
    """h [B, T, D] -> fp32 logits [B, T, V]."""
    return _linear32(h, lm_head, h.dtype)


@jax.custom_vjp
def nll_from_logits(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """logits [..., V] fp32, targets [...] int -> -log softmax(logits)[target] [...].

    The backward is one elementwise pass, softmax - onehot(target); autodiff's scatters the target's gradient
    into a zero [..., V] array and adds the softmax in further passes (lm_head + cross-entropy forward+backward
    at 1024 tokens x V = 16384 on CPU: 387 ms with autodiff's, 278 ms with this)."""
    return _nll_fwd(logits, targets)[0]


def _nll_fwd(logits, targets):
    lse = jax.nn.logsumexp(logits, axis=-1)
    return lse - jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0], (logits, lse, targets)


def _nll_bwd(res, g):
    logits, lse, targets = res
    onehot = jax.lax.broadcasted_iota(targets.dtype, logits.shape, logits.ndim - 1) == targets[..., None]
    return (jnp.exp(logits - lse[..., None]) - onehot) * g[..., None], None


nll_from_logits.defvjp(_nll_fwd, _nll_bwd)


def chunked_cross_entropy(h: jax.Array, lm_head: dict, targets: jax.Array, chunk: int = 1024,
                          row_shards: int = 1, temperature: float = 1.0, seq_shards: int = 1) -> jax.Array:
    """Per-token -log p(target) without materialising all fp32 logits at once (p = softmax(logits / temperature),
    the distribution a sampler at that temperature draws from).

    h [B, T, D], targets [B, T] -> nll [B, T] fp32. Chunks run along the sequence, all rows at once: c positions
    with c = chunk / (B / row_shards), so with the rows sharded over `row_shards` devices each device projects
    about `chunk` of its own tokens per chunk (chunks of the flattened global token axis would make every
    device compute every chunk). The vocabulary projection is recomputed per chunk in the backward pass
    (jax.checkpoint), so peak memory is one chunk of logits. With the sequence split `seq_shards` ways (context
    parallelism), each row's parts are taken as rows of their own ([B, T] -> [B * seq_shards, T / seq_shards],
    row-major: the same split), so every device again projects only its own tokens.
    """
    if seq_shards > 1 and h.shape[1] % seq_shards == 0:
        B, T, D = h.shape
        nll = chunked_cross_entropy(h.reshape(B * seq_shards, T // seq_shards, D), lm_head,
                                    targets.reshape(B * seq_shards, -1), chunk, row_shards * seq_shards, temperature)
        return nll.reshape(B, T)
    B, T, D = h.shape
    c = max(1, min(T, chunk // max(1, B // max(1, row_shards))))
    pad = (-T) % c
    hc = jnp.pad(h, ((0, 0), (0, pad), (0, 0))).reshape(B, -1, c, D)
    tc = jnp.pad(targets, ((0, 0), (0, pad))).reshape(B, -1, c)

    def one(hc, tc):  # [B, c, D], [B, c] -> [B, c]
        logits = _linear32(hc, lm_head, hc.dtype)
        if temperature != 1.0:
            logits = logits / temperature
        return nll_from_logits(logits, tc)

    if hc.shape[1] == 1:  # one chunk: nothing to save by recomputing
        nll = one(hc[:, 0], tc[:, 0])[:, None]
    else:
        nll = jax.lax.map(lambda a: jax.checkpoint(one)(*a), (hc.swapaxes(0, 1), tc.swapaxes(0, 1))).swapaxes(0, 1)
    return nll.reshape(B, -1)[:, :T]


# --------------------------------------------------------------------------- cross-entropy, the fast path
def cross_entropy(h: jax.Array, lm_head: dict, targets: jax.Array, *, mesh=None, chunk: int = 1024,
                  temperature: float = 1.0) -> jax.Array:
    """`chunked_cross_entropy` (the reference) per device: h [B, T, D] (compute dtype), targets [B, T] ->
    nll [B, T] fp32 = -log softmax(h @ lm_head / temperature)[target].

    On a mesh it runs inside `shard_map` on each device's own tokens (rows over the batch axes, the sequence
    over `context`): the lm_head enters in its stored sharding, is gathered once in the compute dtype over the
    axes that split its hidden dim, and keeps its vocabulary split over `tensor` (vocab-parallel: the softmax's
    max, sum and target logit are combined over `tensor`). The gradient of the gathered head is summed over the
    tokens of all chunks into one fp32 [D, V / tensor] buffer and leaves by the gather's transpose, a
    reduce-scatter in the compute dtype. Under GSPMD the head was gathered in fp32, every chunk produced its own
    fp32 [D, V] gradient (and a transposed copy) and the summed gradient was all-reduced in fp32. Falls back to
    the reference for a head with a LoRA adapter or rows that do not split over the mesh."""
    from jax.sharding import PartitionSpec as P

    from nemo_jax.parallel.mesh import BATCH_AXES, context_shards, gather_shards

    B, T, D = h.shape
    if "lora_a" in lm_head:
        return chunked_cross_entropy(h, lm_head, targets, chunk, _rows_split(mesh, B), temperature,
                                     context_shards(mesh, T))
    dtype = h.dtype
    if mesh is None or mesh.size == 1:
        return _vocab_ce(h.reshape(-1, D), lm_head["kernel"].astype(dtype), targets.reshape(-1), jnp.int32(0), None,
                         chunk, temperature).reshape(B, T)
    rows = tuple(a for a in BATCH_AXES if mesh.shape.get(a, 1) > 1)
    if B % _rows_split(mesh, B, rows):
        return chunked_cross_entropy(h, lm_head, targets, chunk, 1, temperature, context_shards(mesh, T))
    from nemo_jax.model.spec import LM_HEAD_AXES
    from nemo_jax.parallel.rules import Rules

    stored = Rules().spec(LM_HEAD_AXES, lm_head["kernel"].shape, mesh)
    vocab_axis = stored[1]
    if isinstance(vocab_axis, tuple):
        vocab_axis = vocab_axis[0] if len(vocab_axis) == 1 else None
    seq = "context" if context_shards(mesh, T) > 1 else None

    def local(h, w, t):
        w = gather_shards(w.astype(dtype), P(stored[0], None))  # [D, V / tensor]
        off = jnp.int32(0) if vocab_axis is None else jax.lax.axis_index(vocab_axis) * w.shape[1]
        b, l, d = h.shape
        return _vocab_ce(h.reshape(-1, d), w, t.reshape(-1), off, vocab_axis, chunk, temperature).reshape(b, l)

    tok = P(rows or None, seq)
    return jax.shard_map(local, mesh=mesh, in_specs=(P(rows or None, seq, None), stored, tok), out_specs=tok,
                         check_vma=False)(h, lm_head["kernel"], targets)


def _rows_split(mesh, rows: int, axes=None) -> int:
    if mesh is None:
        return 1
    import math

    from nemo_jax.parallel.mesh import BATCH_AXES

    n = math.prod(mesh.shape[a] for a in (axes if axes is not None else BATCH_AXES) if mesh.shape.get(a, 1) > 1)
    return n if rows % n == 0 else 1


def _ce_chunks(x, c: int):
    """[N, ...] -> [N / c, c, ...] (zero-padded rows)."""
    pad = (-x.shape[0]) % c
    return jnp.pad(x, ((0, pad),) + ((0, 0),) * (x.ndim - 1)).reshape(-1, c, *x.shape[1:])


def _ce_stats(hc, w, tc, offset, axis, temperature):
    """One chunk: hc [c, D], w [D, Vl] (the vocab slice from `offset`), tc [c] -> (logits [c, Vl] fp32, lse [c],
    target logit [c]), combined over the vocab split `axis` (None: whole)."""
    logits = jnp.einsum("cd,dv->cv", hc, w, preferred_element_type=jnp.float32) / temperature
    m = jax.lax.stop_gradient(logits.max(-1))
    if axis is not None:
        m = jax.lax.pmax(m, axis)
    s = jnp.exp(logits - m[:, None]).sum(-1)
    local = tc - offset
    hit = (local >= 0) & (local < w.shape[1])
    z = jnp.where(hit, jnp.take_along_axis(logits, jnp.clip(local, 0, w.shape[1] - 1)[:, None], axis=-1)[:, 0], 0.0)
    if axis is not None:
        s, z = jax.lax.psum(s, axis), jax.lax.psum(z, axis)
    return logits, m + jnp.log(s), z


@functools.partial(jax.custom_jvp, nondiff_argnums=(4, 5, 6))
def _vocab_ce(h, w, targets, offset, axis, chunk: int, temperature: float):
    """h [N, D], w [D, Vl] (vocab columns offset.. of the vocabulary, split over `axis`), targets [N] -> nll [N]
    fp32, `chunk` rows of logits at a time.

    Differentiated with a head that gets a gradient (`_trained_head_ce`): the logits are recomputed per chunk in
    the backward for dh and dw. With a frozen head (its tangent a symbolic zero: LoRA's base, a head passed
    through stop_gradient) and the vocabulary whole, nll's gradient in h is g * q with q = (softmax - onehot) /
    temperature @ w^T known in the forward (`_frozen_head_ce`): the forward computes q beside the logits and the
    backward is one multiply: two vocabulary projections instead of three."""
    return _trained_head_ce(h, w, targets, offset, axis, chunk, temperature)


@functools.partial(_vocab_ce.defjvp, symbolic_zeros=True)
def _vocab_ce_jvp(axis, chunk, temperature, primals, tangents):
    from jax.custom_derivatives import SymbolicZero

    h, w, targets, offset = primals
    dh, dw = tangents[:2]
    if isinstance(dw, SymbolicZero) and axis is None:
        nll, q = _frozen_head_ce(h, w, targets, offset, chunk, temperature)
        dnll = jnp.zeros_like(nll) if isinstance(dh, SymbolicZero) else jnp.sum(q * dh.astype(q.dtype), axis=-1)
        return nll, dnll
    real = lambda p, t: (np.zeros(np.shape(p), jax.dtypes.float0) if not jnp.issubdtype(p.dtype, jnp.inexact)  # noqa: E731
                         else jnp.zeros_like(p) if isinstance(t, SymbolicZero) else t)
    return jax.jvp(lambda h, w, t, o: _trained_head_ce(h, w, t, o, axis, chunk, temperature), primals,
                   tuple(real(p, t) for p, t in zip(primals, tangents)))


def _frozen_head_ce(h, w, targets, offset, chunk: int, temperature: float):
    """-> (nll [N], q [N, D] fp32): per chunk the logits, their log-sum-exp, and q = (softmax - onehot) /
    temperature @ w^T, the gradient of each token's nll in its h (the vocabulary whole on this device)."""
    N = h.shape[0]
    c = max(1, min(N, chunk))

    def one(a):
        hc, tc = a
        logits, lse, z = _ce_stats(hc, w, tc, offset, None, temperature)
        onehot = jax.lax.broadcasted_iota(jnp.int32, logits.shape, 1) == (tc - offset)[:, None]
        dlog = ((jnp.exp(logits - lse[:, None]) - onehot) / temperature).astype(w.dtype)
        return lse - z, jnp.einsum("cv,dv->cd", dlog, w, preferred_element_type=jnp.float32)

    nll, q = jax.lax.map(one, (_ce_chunks(h, c), _ce_chunks(targets, c)))
    return nll.reshape(-1)[:N], q.reshape(-1, h.shape[1])[:N]


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _trained_head_ce(h, w, targets, offset, axis, chunk: int, temperature: float):
    """`_vocab_ce` for a head that gets a gradient. Backward: per chunk, dlogits = (softmax - onehot) * g /
    temperature in w's dtype, dh = dlogits @ w^T (summed over `axis`), dw += h^T @ dlogits in one fp32 buffer."""
    return _vocab_ce_fwd(h, w, targets, offset, axis, chunk, temperature)[0]


def _vocab_ce_fwd(h, w, targets, offset, axis, chunk, temperature):
    N = h.shape[0]
    c = max(1, min(N, chunk))
    _, lse, z = jax.lax.map(lambda a: _ce_stats(a[0], w, a[1], offset, axis, temperature),
                            (_ce_chunks(h, c), _ce_chunks(targets, c)))
    return (lse - z).reshape(-1)[:N], (h, w, targets, offset, lse)


def _vocab_ce_bwd(axis, chunk, temperature, res, g):
    h, w, targets, offset, lse = res
    N, c = h.shape[0], lse.shape[1]
    if axis is not None:
        # inside shard_map (check_vma=False) the nll leaves replicated over `axis`, and its transpose hands every
        # peer cotangent / n; h entered replicated over `axis`, so the transpose sums the peers' dh (each from its
        # vocab slice): scale g back, and leave dh partial
        g = g * jax.lax.psum(1, axis)

    def one(dw, a):
        hc, tc, lc, gc = a
        logits = jnp.einsum("cd,dv->cv", hc, w, preferred_element_type=jnp.float32) / temperature
        onehot = jax.lax.broadcasted_iota(jnp.int32, logits.shape, 1) == (tc - offset)[:, None]
        dlog = ((jnp.exp(logits - lc[:, None]) - onehot) * (gc / temperature)[:, None]).astype(w.dtype)
        dh = jnp.einsum("cv,dv->cd", dlog, w, preferred_element_type=jnp.float32)
        return dw + jnp.einsum("cd,cv->dv", hc, dlog, preferred_element_type=jnp.float32), dh.astype(h.dtype)

    dw, dh = jax.lax.scan(one, jnp.zeros(w.shape, jnp.float32),
                          (_ce_chunks(h, c), _ce_chunks(targets, c), lse, _ce_chunks(g, c)))
    zero_int = lambda x: np.zeros(np.shape(x), jax.dtypes.float0)  # noqa: E731
    return dh.reshape(-1, h.shape[1])[:N], dw.astype(w.dtype), zero_int(targets), zero_int(offset)


_trained_head_ce.defvjp(_vocab_ce_fwd, _vocab_ce_bwd)
