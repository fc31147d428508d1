import jax
import jax.numpy as jnp
import numpy as np
import pytest

from nemo_jax import model as M

from helpers import tiny_cfg

# inline units; a period scanned twice; irregular; runs of identical units as inner scans in a repeated period
PATTERNS = ["MEM*E-", "MEM*E-MEM*E-", "M-M*-MM-"]
RUNS = "MEMEM*EMEMEM*EME"  # with a body of 3: ("ME"x2 inner scan, "M*E") x2, "ME"


def _setup(pattern="MEM*E-", seed=0, **kw):
    cfg = tiny_cfg(pattern, **kw)
    params = M.init(cfg, jax.random.key(seed))
    return cfg, params


SLOW = pytest.mark.slow


# periodic: MEM*E-MEM*E- (two periods in one scan) covers MEM*E- alone, which the cond schedule runs; the fast
# tier keeps the cheapest (the cond scan of the irregular pattern)
@pytest.mark.parametrize("pattern,schedule", [pytest.param(p, "periodic", marks=SLOW) for p in PATTERNS[1:]]
                         + [pytest.param("MEM*E-", "cond", marks=SLOW), ("M-M*-MM-", "cond"),
                            pytest.param(RUNS, "runs", marks=SLOW)])
def test_scan_matches_unrolled_reference(pattern, schedule, monkeypatch):
    """Both scan schedules (repeated periods unrolled in the body; one scan with lax.cond for kinds present in
    only some units) agree with the unrolled reference in values and gradients."""
    monkeypatch.setattr(M.model, "INLINE_UNITS", 0)  # scan these small stacks too
    if schedule == "cond":
        monkeypatch.setattr(M.model, "MAX_BODY_UNITS", 0)
    if schedule == "runs":  # runs of identical units as inner scans
        monkeypatch.setattr(M.model, "MAX_BODY_UNITS", 3)
        segs = M.model.segments(M.model.units(tiny_cfg(pattern).layer_kinds))
        assert any(n > 1 for p, _ in segs for _, n in p) and sum(len(p) for p, _ in segs) <= 3
    cfg, params = _setup(pattern, n_group=2, topk_group=1)
    toks = jax.random.randint(jax.random.key(1), (2, 19), 0, cfg.vocab_size)
    fast = M.Options()
    ref = M.Options(scan=False, ssd="sequential", moe_dispatch="dense", attention="full")

    def loss(p, o):
        logits, aux = M.forward(p, toks, cfg, opts=o)
        return jnp.mean(jax.nn.log_softmax(logits)[..., 3]) + aux.get("aux_loss", 0.0), logits

    (l1, y1), g1 = jax.jit(jax.value_and_grad(loss, has_aux=True), static_argnums=1)(params, fast)
    (l2, y2), g2 = jax.jit(jax.value_and_grad(loss, has_aux=True), static_argnums=1)(params, ref)
    np.testing.assert_allclose(y1, y2, rtol=1e-4, atol=1e-5)
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g2)):
        np.testing.assert_allclose(a, b, rtol=1e-3, atol=1e-6)


def test_segments_cover_units_in_order():
    from nemo_jax.config.model import NemotronHConfig, parse_pattern
    import os

    models = os.path.join(os.path.dirname(M.__file__), "..", "assets", "models")
    cases = {name: NemotronHConfig.from_file(os.path.join(models, name + ".json")).layer_kinds
             for name in ("nano3-30b-a3b", "super-120b-a12b", "nemotron-h-8b")}
    cases["bench"] = parse_pattern("MEM*E-" * 2)
    for name, kinds in cases.items():
        us = M.model.units(kinds)
        segs = M.model.segments(us)
        flat = [tuple(u) for period, reps in segs for _ in range(reps) for u, n in period for _ in range(n)]
        assert flat == [tuple(u) for u in us], name
    # [(runs of (unit size, n), repeats)]: the body holds the runs, a run of n > 1 units is an inner scan
    shape = lambda kinds: [([(len(u), n) for u, n in p], r) for p, r in M.model.segments(M.model.units(kinds))]
    # the release order: ("ME"x3, "M*E") x3, ("ME"x4, "M*E") x4, "ME"x3, "M*E", "ME"x4 -> 7 runs, no lax.cond
    assert shape(cases["super-120b-a12b"]) == [([(2, 3), (3, 1)], 3), ([(2, 4), (3, 1)], 4), ([(2, 3)], 1),
                                               ([(3, 1)], 1), ([(2, 4)], 1)]
    assert sum(len(p) for p, _ in M.model.segments(M.model.units(cases["super-120b-a12b"]))) <= M.model.MAX_BODY_UNITS
    # units one by one when they fit the body (Nano: 6 units)
    assert shape(cases["nano3-30b-a3b"]) == [([(2, 1), (2, 1), (3, 1)], 5), ([(2, 1)], 3), ([(3, 1)], 1), ([(2, 1)], 4)]
    assert shape(cases["bench"]) == [([(2, 1), (3, 1), (1, 1)], 2)]


@pytest.mark.parametrize("length", [5, 16, 37])
def test_blocked_attention_matches_full(length):
    """Query blocks over key prefixes == the full masked form, in values and gradients, with packed
    segments and lengths that are not a multiple of the block."""
    from nemo_jax.model import attention as A

    cfg, params = _setup("*")
    p = jax.tree.map(lambda a: a[0], params["layers"]["attention"]["mixer"])
    u = jax.random.normal(jax.random.key(2), (2, length, cfg.hidden_size))
    seg = jnp.asarray(np.sort(np.random.RandomState(length).randint(0, 3, (2, length)), axis=1))

    def run(impl):
        f = lambda p, u: jnp.sum(jnp.sin(A.attention(p, u, cfg, jnp.float32, segment_ids=seg, impl=impl, block=8)[0]))
        return jax.jit(jax.value_and_grad(f, argnums=(0, 1)))(p, u)

    (v1, g1), (v2, g2) = run("blocked"), run("full")
    np.testing.assert_allclose(v1, v2, rtol=1e-5, atol=1e-5)
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g2)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("schedule,pattern", [("periodic", "MEM*E-MEM*E-"), ("cond", "MEM*E-MEM*E-"),
                                              pytest.param("runs", RUNS, marks=SLOW)])
def test_cached_chunks_match_forward_on_a_repeating_pattern(schedule, pattern, monkeypatch):
    """Prefill + one-token steps through the decode state (caches carried through the scanned period)
    give the full forward's logits."""
    from nemo_jax.model.cache import init_decode_state

    cfg, params = _setup(pattern)
    monkeypatch.setattr(M.model, "INLINE_UNITS", 0)
    assert M.model.segments(M.model.units(cfg.layer_kinds))[0][1] == 2  # one period, scanned twice
    if schedule == "cond":
        monkeypatch.setattr(M.model, "MAX_BODY_UNITS", 0)
    if schedule == "runs":
        monkeypatch.setattr(M.model, "MAX_BODY_UNITS", 3)
    toks = jax.random.randint(jax.random.key(3), (2, 11), 0, cfg.vocab_size)
    full, _ = M.forward(params, toks, cfg)
    state = init_decode_state(cfg, 2, 16)
    step = jax.jit(lambda t, s: M.forward_cached(params, t, jnp.ones(t.shape, bool), s, cfg))
    got, state = step(toks[:, :8], state)
    outs = [got]
    for i in range(8, 11):
        got, state = step(toks[:, i:i + 1], state)
        outs.append(got)
    np.testing.assert_allclose(jnp.concatenate(outs, axis=1), full, rtol=1e-4, atol=1e-4)


def test_causality():
    cfg, params = _setup()
    toks = jax.random.randint(jax.random.key(1), (1, 24), 0, cfg.vocab_size)
    f = jax.jit(lambda t: M.forward(params, t, cfg)[0])
    base = f(toks)
    for t in (0, 9, 17):
        changed = f(toks.at[0, t].set((toks[0, t] + 1) % cfg.vocab_size))
        np.testing.assert_allclose(changed[:, :t], base[:, :t], rtol=1e-6, atol=1e-6)
        assert not np.allclose(changed[:, t:], base[:, t:])


@pytest.mark.slow
def test_packing_equivalence():
    """Each document packed among others gets the logits it gets alone (every mixer)."""
    cfg, params = _setup(n_group=2, topk_group=1, chunk_size=4)
    lens = [5, 11, 7]
    docs = [jax.random.randint(jax.random.key(10 + i), (1, n), 0, cfg.vocab_size) for i, n in enumerate(lens)]
    packed = jnp.concatenate(docs + [jnp.zeros((1, 3), jnp.int32)], axis=1)
    seg = jnp.asarray([sum(([i + 1] * n for i, n in enumerate(lens)), []) + [0] * 3])
    logits, _ = jax.jit(lambda t, s: M.forward(params, t, cfg, s))(packed, seg)
    off = 0
    one = jax.jit(lambda t: M.forward(params, t, cfg))  # (a compile per length: cheaper than eager op by op)
    for d, n in zip(docs, lens):
        alone, _ = one(d)
        np.testing.assert_allclose(logits[:, off:off + n], alone, rtol=1e-4, atol=1e-5)
        off += n


@pytest.mark.slow
def test_jit_and_eager_agree():
    cfg, params = _setup()
    toks = jax.random.randint(jax.random.key(1), (2, 9), 0, cfg.vocab_size)
    with jax.disable_jit():
        eager, _ = M.forward(params, toks, cfg)
    jitted, _ = jax.jit(lambda p, t: M.forward(p, t, cfg))(params, toks)
    np.testing.assert_allclose(eager, jitted, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_bf16_close_to_fp32():
    cfg, params = _setup()
    toks = jax.random.randint(jax.random.key(1), (2, 33), 0, cfg.vocab_size)
    fwd = jax.jit(M.forward, static_argnums=2, static_argnames="opts")  # (cheaper than eager op by op)
    f32, _ = fwd(params, toks, cfg)
    b16, _ = fwd(params, toks, cfg, opts=M.Options(dtype=jnp.bfloat16))
    assert b16.dtype == jnp.float32
    p32, p16 = jax.nn.softmax(f32), jax.nn.softmax(b16)
    assert float(jnp.max(jnp.abs(p32 - p16))) < 2e-2
    assert float(jnp.mean(jnp.argmax(f32, -1) == jnp.argmax(b16, -1))) > 0.9


@pytest.mark.slow
def test_mtp_forward_shapes_and_dependence():
    cfg, params = _setup(num_nextn_predict_layers=2)
    toks = jax.random.randint(jax.random.key(1), (2, 10), 0, cfg.vocab_size)
    fwd = jax.jit(M.forward, static_argnums=2)  # (cheaper than eager op by op)
    logits, aux = fwd(params, toks, cfg)
    assert len(aux["mtp_logits"]) == 2 and aux["mtp_logits"][0].shape == logits.shape
    # depth 0 at position t reads token t+1: changing it moves position t's MTP logits but not t+1's main logits before
    changed = toks.at[:, 5].set((toks[:, 5] + 1) % cfg.vocab_size)
    _, aux2 = fwd(params, changed, cfg)
    assert not np.allclose(aux["mtp_logits"][0][:, 4], aux2["mtp_logits"][0][:, 4])
    np.testing.assert_allclose(aux["mtp_logits"][0][:, :4], aux2["mtp_logits"][0][:, :4], rtol=1e-6, atol=1e-6)


def test_abstract_params_match_init():
    cfg, params = _setup(moe_latent_size=8, num_nextn_predict_layers=1)
    abstract = M.abstract_params(cfg)
    assert jax.tree.structure(abstract) == jax.tree.structure(params)
    for a, p in zip(jax.tree.leaves(abstract), jax.tree.leaves(params)):
        assert a.shape == p.shape and a.dtype == p.dtype
    axes = M.logical_axes(cfg)
    assert axes["layers"]["moe"]["mixer"]["experts"]["up_proj"] == ("layers", "experts", "expert_in", "expert_mlp")
