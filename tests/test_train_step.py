"""Train-step units: gradient accumulation is exact, remat does not change values, MTP loss, non-finite guard."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from nemo_jax.config.train import OptimSection
from nemo_jax.model import Options, init
from nemo_jax.train.optimizer import make_optimizer
from nemo_jax.train.step import TrainState, make_train_step, token_loss

from helpers import tiny_cfg


def _batch(cfg, rows=4, T=24, seed=0):
    rng = np.random.default_rng(seed)
    toks = rng.integers(0, cfg.vocab_size, (rows, T + 1)).astype(np.int32)
    seg = np.ones((rows, T), np.int32)
    seg[:, T // 2:] = 2
    mask = rng.random((rows, T)) < 0.7
    return {"tokens": jnp.asarray(toks[:, :-1]), "targets": jnp.asarray(toks[:, 1:]),
            "loss_mask": jnp.asarray(mask), "segment_ids": jnp.asarray(seg)}


def _state(cfg, o, steps=10):
    params = init(cfg, jax.random.key(0))
    tx, sched = make_optimizer(o, params, steps)
    z = lambda: jnp.zeros((), jnp.int32)
    return TrainState(params, tx.init(params), z(), z(), z(), jax.random.key_data(jax.random.key(1))), tx, sched


@pytest.mark.slow
def test_gradient_accumulation_is_exact():
    """The token-mean loss is exact under micro-batching (the MoE balance loss is per micro-batch, so off here)."""
    cfg = tiny_cfg("ME*")
    o = OptimSection(warmup_steps=0, aux_loss_coef=0.0)
    batch = _batch(cfg)
    out = {}
    for accum in (1, 2):
        state, tx, sched = _state(cfg, o)
        step = jax.jit(make_train_step(cfg, Options(), tx, sched, o, accum))
        for _ in range(2):
            state, m = step(state, batch)
        out[accum] = (float(m["loss"]), jax.tree.leaves(state.params))
    for accum in (2,):
        np.testing.assert_allclose(out[accum][0], out[1][0], rtol=1e-5)
        for a, b in zip(out[accum][1], out[1][1]):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=2e-5)  # Adam amplifies summation-order noise


@pytest.mark.parametrize("remat", ["layer", "save_matmuls"])
def test_remat_policies_do_not_change_gradients(remat):
    cfg = tiny_cfg("M*E")
    params = init(cfg, jax.random.key(0))
    batch = _batch(cfg)
    g = lambda o: jax.jit(jax.grad(lambda p: token_loss(p, batch, cfg, o)[0]))(params)
    for a, b in zip(jax.tree.leaves(g(Options())), jax.tree.leaves(g(Options(remat=remat)))):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


@pytest.mark.slow
def test_mtp_loss_term():
    cfg = tiny_cfg("ME", num_nextn_predict_layers=1)
    params = init(cfg, jax.random.key(0))
    batch = _batch(cfg)
    loss = jax.jit(lambda p, c: token_loss(p, batch, cfg, Options(), c), static_argnums=1)
    base, _ = loss(params, 0.0)
    with_mtp, aux = loss(params, 0.5)
    assert np.isfinite(float(aux["mtp0_nll_sum"])) and float(aux["mtp0_nll_sum"]) > 0
    np.testing.assert_allclose(float(with_mtp), float(base) + 0.5 * float(aux["mtp0_nll_sum"]), rtol=1e-5)
    grads = jax.jit(jax.grad(lambda p: token_loss(p, batch, cfg, Options(), 0.5)[0]))(params)
    assert float(jnp.abs(grads["mtp"][0]["eh_proj"]["kernel"]).sum()) > 0


def test_nonfinite_update_is_skipped_and_counted():
    cfg = tiny_cfg("ME")
    o = OptimSection(warmup_steps=0)
    state, tx, sched = _state(cfg, o)
    step = jax.jit(make_train_step(cfg, Options(), tx, sched, o, 1))
    bad = jax.tree.map(lambda x: x, state.params)
    bad["norm_f"]["scale"] = bad["norm_f"]["scale"].at[0].set(jnp.nan)
    before = jax.tree.leaves(bad)
    new, m = step(state._replace(params=bad), _batch(cfg))
    assert not bool(m["finite"]) and int(new.skipped) == 1 and int(new.nonfinite_run) == 1
    for a, b in zip(before, jax.tree.leaves(new.params)):
        np.testing.assert_array_equal(a, b)
    new2, m2 = step(new._replace(params=state.params), _batch(cfg))
    assert bool(m2["finite"]) and int(new2.nonfinite_run) == 0 and int(new2.skipped) == 1


def test_eval_in_micro_batches_is_exact_and_smaller():
    """Eval runs the batch in training-sized micro-batches: the same sums, fewer temporaries."""
    from nemo_jax.train.step import make_eval_step

    cfg = tiny_cfg("ME*", vocab_size=4096)
    params = init(cfg, jax.random.key(0))
    batch = _batch(cfg, rows=8, T=64)
    out, temps = {}, {}
    for micro in (1, 4):
        f = jax.jit(make_eval_step(cfg, Options(), micro_batches=micro))
        out[micro] = [float(x) for x in f(params, batch)]
        temps[micro] = f.lower(params, batch).compile().memory_analysis().temp_size_in_bytes
    np.testing.assert_allclose(out[1], out[4], rtol=1e-5)
    assert temps[4] < 0.6 * temps[1], temps


@pytest.mark.parametrize("rows,T,chunk,row_shards,temp", [(4, 24, 16, 1, 1.0), (4, 24, 16, 4, 1.0), (3, 7, 1024, 1, 0.7),
                                                          (2, 9, 4, 2, 1.0)])
def test_chunked_cross_entropy_matches_full_logits(rows, T, chunk, row_shards, temp):
    """Chunks along the sequence (c = chunk / local rows, padded tail), with the hand-written softmax - onehot
    backward, give the full-logits NLL in values and gradients (the reference: autodiff of log_softmax over
    all logits at once)."""
    from nemo_jax.model.layers import chunked_cross_entropy, logits_from_hidden

    rng = np.random.default_rng(rows * T)
    h = jnp.asarray(rng.normal(size=(rows, T, 16)), jnp.float32)
    head = {"kernel": jnp.asarray(rng.normal(size=(16, 37)) * 0.3, jnp.float32)}
    tgt = jnp.asarray(rng.integers(0, 37, (rows, T)), jnp.int32)
    wts = jnp.asarray(rng.random((rows, T)), jnp.float32)

    def full(h, head):
        lp = jax.nn.log_softmax(logits_from_hidden(h, head) / temp, axis=-1)
        return -jnp.take_along_axis(lp, tgt[..., None], axis=-1)[..., 0]

    chunked = lambda h, head: chunked_cross_entropy(h, head, tgt, chunk=chunk, row_shards=row_shards,
                                                    temperature=temp)
    np.testing.assert_allclose(chunked(h, head), full(h, head), rtol=1e-5, atol=1e-5)
    g1 = jax.grad(lambda h, p: jnp.sum(chunked(h, p) * wts), argnums=(0, 1))(h, head)
    g2 = jax.grad(lambda h, p: jnp.sum(full(h, p) * wts), argnums=(0, 1))(h, head)
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g2)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("mesh_sizes", [None, {"fsdp": 2, "tensor": 2, "expert": 2}, {"fsdp": 4, "context": 2}])
def test_vocab_parallel_cross_entropy_matches_the_reference(mesh_sizes):
    """The per-device cross-entropy (`layers.cross_entropy`: the head gathered once, vocabulary split over
    `tensor`, hand-written chunked backward) equals the GSPMD reference `chunked_cross_entropy` in values and in
    the gradients of h and the head, at temperature 0.7, with chunks that do not divide the local tokens."""
    from nemo_jax.model.layers import chunked_cross_entropy, cross_entropy
    from nemo_jax.parallel.mesh import make_mesh

    rng = np.random.default_rng(0)
    B, T, D, V = 8, 12, 16, 64
    h = jnp.asarray(rng.normal(size=(B, T, D)), jnp.float32)
    head = {"kernel": jnp.asarray(rng.normal(size=(D, V)) * 0.3, jnp.float32)}
    tgt = jnp.asarray(rng.integers(0, V, (B, T)), jnp.int32)
    wts = jnp.asarray(rng.random((B, T)), jnp.float32)
    mesh = None if mesh_sizes is None else make_mesh(mesh_sizes)
    if mesh is not None:
        from nemo_jax.parallel.rules import Rules

        head = {"kernel": jax.device_put(head["kernel"], Rules().sharding(mesh, ("embed", "vocab"), (D, V)))}
        h = jax.device_put(h, Rules().sharding(mesh, ("batch", "seq", None), h.shape))
    fast = jax.jit(lambda h, p: cross_entropy(h, p, tgt, mesh=mesh, chunk=5, temperature=0.7))
    ref = jax.jit(lambda h, p: chunked_cross_entropy(h, p, tgt, chunk=5, temperature=0.7))
    np.testing.assert_allclose(fast(h, head), ref(h, head), rtol=1e-5, atol=1e-5)
    g1 = jax.jit(jax.grad(lambda h, p: jnp.sum(fast(h, p) * wts), argnums=(0, 1)))(h, head)
    g2 = jax.jit(jax.grad(lambda h, p: jnp.sum(ref(h, p) * wts), argnums=(0, 1)))(h, head)
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g2)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_compute_weights_cast_changes_nothing_but_the_bytes(monkeypatch):
    """Under bf16 the matmul weights are cast once up front (so FSDP gathers bf16): the loss and gradients of
    casting each at use (to bf16 rounding), and the router kernel stays fp32."""
    import nemo_jax.train.step as S

    cfg = tiny_cfg("MEM*E-")
    params = init(cfg, jax.random.key(0))
    batch = _batch(cfg)
    opts = Options(dtype=jnp.bfloat16)
    cast = S.compute_weights(params, jnp.bfloat16)
    assert cast["layers"]["moe"]["mixer"]["gate"]["kernel"].dtype == jnp.float32
    assert cast["layers"]["moe"]["mixer"]["experts"]["up_proj"].dtype == jnp.bfloat16
    assert cast["layers"]["mamba"]["mixer"]["A_log"].dtype == jnp.float32
    f = lambda p: S.token_loss(p, batch, cfg, opts)[0]  # noqa: E731
    l1, g1 = jax.jit(jax.value_and_grad(f))(params)
    monkeypatch.setattr(S, "compute_weights", lambda p, dtype: p)
    l2, g2 = jax.jit(jax.value_and_grad(f))(params)
    np.testing.assert_allclose(l1, l2, rtol=1e-4)  # bf16: XLA places the converts differently
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g2)):
        scale = float(jnp.max(jnp.abs(b))) + 1e-12
        np.testing.assert_allclose(a, b, rtol=0, atol=2e-2 * scale)
