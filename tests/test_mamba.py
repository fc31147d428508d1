import jax
import jax.numpy as jnp
import numpy as np
import pytest

from nemo_jax.model import mamba2


def _inputs(b=2, l=20, h=4, p=3, g=2, n=5, seed=0):
    ks = jax.random.split(jax.random.key(seed), 5)
    x = jax.random.normal(ks[0], (b, l, h, p))
    dt = jax.nn.softplus(jax.random.normal(ks[1], (b, l, h)) - 1.0)
    A = -jnp.exp(jax.random.normal(ks[2], (h,)) * 0.5)
    B = jax.random.normal(ks[3], (b, l, g, n))
    C = jax.random.normal(ks[4], (b, l, g, n))
    return x, dt, A, B, C


def _segments(b, l):
    seg = np.ones((b, l), np.int32)
    seg[0, 7:] = 2
    seg[0, 13:] = 3
    seg[1, 1:] = 2
    seg[1, l - 2:] = 0
    return jnp.asarray(seg)


@pytest.mark.parametrize("l", [5, 8, 20])
@pytest.mark.parametrize("with_segments", [False, True])
def test_chunked_matches_sequential_values_and_grads(l, with_segments):
    x, dt, A, B, C = _inputs(l=l)
    seg = _segments(2, l) if with_segments else None
    init = jax.random.normal(jax.random.key(9), (2, 4, 3, 5)) * (0 if with_segments else 1)

    def run(fn, *args):
        y, final = fn(*args)
        return jnp.sum(jnp.sin(y)) + jnp.sum(final ** 2)

    chunk = lambda *a: mamba2.ssd_chunked(*a, chunk_size=8, segment_ids=seg, initial_state=init)
    seq = lambda *a: mamba2.ssd_sequential(*a, segment_ids=seg, initial_state=init)
    y1, f1 = jax.jit(chunk)(x, dt, A, B, C)
    y2, f2 = jax.jit(seq)(x, dt, A, B, C)
    np.testing.assert_allclose(y1, y2, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(f1, f2, rtol=1e-4, atol=1e-4)
    g1 = jax.jit(jax.grad(lambda *a: run(chunk, *a), argnums=(0, 1, 2, 3, 4)))(x, dt, A, B, C)
    g2 = jax.jit(jax.grad(lambda *a: run(seq, *a), argnums=(0, 1, 2, 3, 4)))(x, dt, A, B, C)
    for a, b in zip(g1, g2):
        np.testing.assert_allclose(a, b, rtol=2e-4, atol=2e-4)


def test_one_token_step_matches_the_scans_values_and_grads():
    """ssd_step (decode's one-token fast path) == ssd_chunked and ssd_sequential at l = 1, from a given state
    and from none, in values and gradients (inputs and the state)."""
    x, dt, A, B, C = _inputs(l=1, seed=3)
    init = jax.random.normal(jax.random.key(4), (2, 4, 3, 5))

    def loss(fn, x, dt, A, B, C, s):
        y, final = fn(x, dt, A, B, C, s)
        return jnp.sum(jnp.sin(y)) + jnp.sum(final ** 2)

    forms = {"step": lambda x, dt, A, B, C, s: mamba2.ssd_step(x, dt, A, B, C, initial_state=s),
             "chunked": lambda x, dt, A, B, C, s: mamba2.ssd_chunked(x, dt, A, B, C, chunk_size=8, initial_state=s),
             "sequential": lambda x, dt, A, B, C, s: mamba2.ssd_sequential(x, dt, A, B, C, initial_state=s)}
    for s in (init, None):
        out = {k: jax.jit(f)(x, dt, A, B, C, s) for k, f in forms.items()}
        for ref in ("chunked", "sequential"):
            for a, b in zip(out["step"], out[ref]):
                np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    grads = {k: jax.jit(jax.grad(lambda *a, f=f: loss(f, *a), argnums=(0, 1, 2, 3, 4, 5)))(x, dt, A, B, C, init)
             for k, f in forms.items()}
    for ref in ("chunked", "sequential"):
        for a, b in zip(grads["step"], grads[ref]):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def test_segments_reset_state():
    """A document packed after another gets the same outputs as alone."""
    x, dt, A, B, C = _inputs(b=1, l=16)
    seg = jnp.asarray([[1] * 6 + [2] * 10])
    y, _ = mamba2.ssd_chunked(x, dt, A, B, C, chunk_size=4, segment_ids=seg)
    y_alone, _ = mamba2.ssd_chunked(x[:, 6:], dt[:, 6:], A, B[:, 6:], C[:, 6:], chunk_size=4)
    np.testing.assert_allclose(y[:, 6:], y_alone, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("packed", [False, True])
def test_conv_fast_backward_matches_autodiff(packed):
    """The conv's hand-written backward equals plain autodiff of the same taps, in values and gradients (input,
    kernel, bias), with documents packed in a row (no lag crosses a document start) or not."""
    K, c = 4, 7
    x = jax.random.normal(jax.random.key(5), (2, 13, c))
    w, bias = jax.random.normal(jax.random.key(6), (K, c)), jax.random.normal(jax.random.key(7), (c,))
    seg = jnp.array([[1] * 5 + [2] * 2 + [3] * 6, [1] * 13]) if packed else None
    cot = jax.random.normal(jax.random.key(8), (2, 13, c))

    def loss(ref):
        return lambda x, w, b: jnp.sum(mamba2.causal_conv(x, w, b, seg, reference=ref) * cot)

    for got, want in zip(jax.value_and_grad(loss(False), argnums=(0, 1, 2))(x, w, bias),
                         jax.value_and_grad(loss(True), argnums=(0, 1, 2))(x, w, bias)):
        for a, e in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            np.testing.assert_allclose(a, e, rtol=1e-5, atol=1e-5)
    if packed:  # the third document alone
        np.testing.assert_allclose(mamba2.causal_conv(x, w, bias, seg)[0, 7:],
                                   mamba2.causal_conv(x[:1, 7:], w, bias)[0], rtol=1e-5, atol=1e-5)


def test_conv_cached_matches_full_conv():
    """Conv over a chunk with left padding and a carried window equals the plain conv on the valid stream."""
    key = jax.random.key(3)
    K, c = 4, 6
    w = jax.random.normal(key, (K, c))
    bias = jnp.arange(c, dtype=jnp.float32)
    stream = jax.random.normal(jax.random.key(4), (1, 11, c))
    full = mamba2.causal_conv(stream, w, bias)
    window = jnp.zeros((1, K - 1, c))
    out1, window = mamba2.causal_conv_cached(stream[:, :5], w, bias, window, jnp.array([0]))
    padded = jnp.concatenate([jnp.full((1, 2, c), 7.0), stream[:, 5:]], axis=1)
    out2, _ = mamba2.causal_conv_cached(padded, w, bias, window, jnp.array([2]))
    np.testing.assert_allclose(out1, full[:, :5], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(out2[:, 2:], full[:, 5:], rtol=1e-5, atol=1e-5)
