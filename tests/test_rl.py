"""GRPO learner units: the policy loss (ratio, DPPO mask, reductions, extreme gaps), advantages, and the learner
step's exactness under micro-batching and on 8 devices."""

import json
import os
from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from nemo_jax.lora import LoraConfig, adapter_shardings, attach, init_adapters
from nemo_jax.model import Options, init
from nemo_jax.model.spec import param_specs
from nemo_jax.parallel.mesh import batch_sharding, make_mesh
from nemo_jax.parallel.rules import Rules, param_shardings
from nemo_jax.rl.learner import PolicyLossConfig, make_learner_step, token_logprobs
from nemo_jax.rl.loss import group_advantages, loss_weights, policy_loss
from nemo_jax.train.step import TrainState

from helpers import tiny_cfg


# ----------------------------------------------------------------------------- the loss on its own
def _arrays(seed=0, N=6, T=9):
    rng = np.random.default_rng(seed)
    lp = np.log(rng.uniform(0.05, 0.95, (N, T))).astype(np.float32)
    mu = np.log(rng.uniform(0.05, 0.95, (N, T))).astype(np.float32)
    mask = rng.random((N, T)) < 0.6
    mask[0] = False  # a rollout without loss tokens
    adv = rng.normal(size=N).astype(np.float32)
    return lp, mu, adv, mask


def test_on_policy_ratio_is_one_and_gradient_is_reinforce():
    lp0, _, adv, mask = _arrays()
    w = loss_weights(mask)

    def loss(lp):
        out, m = policy_loss(lp, jax.lax.stop_gradient(lp), adv, mask, weights=w)
        return out, m

    (val, m), g = jax.value_and_grad(loss, has_aux=True)(jnp.asarray(lp0))
    assert float(m["ratio_min"]) == 1.0 and float(m["ratio_max"]) == 1.0
    assert float(m["masked_frac_high"]) == 0.0 and float(m["masked_frac_low"]) == 0.0
    reinforce = -w * adv[:, None]  # d/dlp of -sum w A lp, unscaled advantages
    np.testing.assert_allclose(g, reinforce, rtol=1e-6, atol=1e-9)
    np.testing.assert_allclose(val, np.sum(reinforce), rtol=1e-6)


@pytest.mark.parametrize("a_sign", [1.0, -1.0])
def test_dppo_mask_truth_table(a_sign):
    """A token is dropped iff (A > 0 and p - p_mu > delta_high) or (A < 0 and p - p_mu < -delta_low)."""
    dh, dl = 0.1, 0.25
    gaps = np.array([-0.4, -0.26, -0.24, -0.11, -0.09, 0.0, 0.09, 0.11, 0.24, 0.26, 0.4])
    p_mu = np.full_like(gaps, 0.5)
    p = p_mu + gaps
    lp, mu = np.log(p)[None].astype(np.float32), np.log(p_mu)[None].astype(np.float32)
    adv = np.array([a_sign], np.float32)
    mask = np.ones_like(lp, bool)
    w = loss_weights(mask, "token")
    g = jax.grad(lambda x: policy_loss(x, mu, adv, mask, weights=w, delta_low=dl, delta_high=dh)[0])(jnp.asarray(lp))
    kept = np.asarray(g)[0] != 0
    expect = ~(((a_sign > 0) & (gaps > dh)) | ((a_sign < 0) & (gaps < -dl)))
    np.testing.assert_array_equal(kept, expect)
    _, m = policy_loss(lp, mu, adv, mask, weights=w, delta_low=dl, delta_high=dh)
    n = gaps.size
    assert float(m["masked_frac_high"]) == pytest.approx(np.sum((a_sign > 0) & (gaps > dh)) / n)
    assert float(m["masked_frac_low"]) == pytest.approx(np.sum((a_sign < 0) & (gaps < -dl)) / n)


def test_extreme_logprob_gaps_stay_finite():
    lp = np.array([[-0.01, -60.0, -0.5, -55.0]], np.float32)
    mu = np.array([[-60.0, -0.01, -55.5, -0.4]], np.float32)  # gaps ~ +-50 and beyond
    mask = np.ones_like(lp, bool)
    for a in (1.0, -1.0):
        for kind in ("dppo", "importance_sampling", "ppo", "tis", "icepop"):
            f = lambda x: policy_loss(x, mu, np.array([a], np.float32), mask, kind=kind, kl_coef=0.1,  # noqa: E731
                                      ref_logprobs=mu, ref_kl_coef=0.1)
            (val, m), g = jax.value_and_grad(f, has_aux=True)(jnp.asarray(lp))
            assert np.isfinite(float(val)) and np.all(np.isfinite(np.asarray(g))), (a, kind)
            assert all(np.isfinite(float(v)) for v in m.values())


@pytest.mark.parametrize("reduction", ["rollout", "token", "constant"])
def test_reductions_against_numpy(reduction):
    lp, mu, adv, mask = _arrays(1)
    dh = dl = 0.2
    N, T = lp.shape
    rho = np.exp(np.clip(lp.astype(np.float64) - mu, -20, 20))
    gap = np.exp(lp.astype(np.float64)) - np.exp(mu)
    drop = ((adv[:, None] > 0) & (gap > dh)) | ((adv[:, None] < 0) & (gap < -dl))
    per = -np.where(drop, 0.0, rho * adv[:, None]) + 0.05 * (lp - mu.astype(np.float64)) ** 2
    m = mask.astype(np.float64)
    if reduction == "rollout":
        rows = [np.sum(per[i] * m[i]) / m[i].sum() for i in range(N) if m[i].sum() > 0]
        expect = np.sum(rows) / N
    elif reduction == "token":
        expect = np.sum(per * m) / m.sum()
    else:
        expect = np.sum(per * m) / (N * 32)
    got, _ = policy_loss(lp, mu, adv, mask, reduction=reduction, kl_coef=0.05, max_len=32)
    np.testing.assert_allclose(float(got), expect, rtol=1e-5)


@pytest.mark.parametrize("kind", ["tis", "icepop"])
def test_importance_corrections_against_numpy(kind):
    """TIS: weight min(rho, C); IcePop / MIS: weight rho inside [lo, hi], 0 outside; both held constant, so the
    gradient is -w A d(lp) and the value -w A (weighted sums over the mask)."""
    lp, mu, adv, mask = _arrays(2, N=8, T=11)
    mu = (lp + np.random.default_rng(3).normal(0, 0.8, lp.shape)).astype(np.float32)  # ratios 0.1 .. 10
    cap, lo, hi = 1.5, 0.6, 1.8
    rho = np.exp(lp.astype(np.float64) - mu)
    w_is = np.minimum(rho, cap) if kind == "tis" else np.where((rho < lo) | (rho > hi), 0.0, rho)
    w = loss_weights(mask)
    f = lambda x: policy_loss(x, mu, adv, mask, weights=w, kind=kind, is_cap=cap, is_low=lo, is_high=hi)  # noqa
    (val, m), g = jax.value_and_grad(f, has_aux=True)(jnp.asarray(lp))
    expect_g = np.where(mask, -w * w_is * adv[:, None], 0.0)
    np.testing.assert_allclose(np.asarray(g), expect_g, rtol=1e-5, atol=1e-9)
    np.testing.assert_allclose(float(val), np.sum(expect_g), rtol=1e-5)
    n = mask.sum()
    if kind == "tis":
        assert float(m["is_truncated_frac"]) == pytest.approx(np.sum(mask & (rho > cap)) / n)
        assert 0 < float(m["is_truncated_frac"]) < 1
    else:
        assert float(m["is_masked_frac"]) == pytest.approx(np.sum(mask & ((rho < lo) | (rho > hi))) / n)
        assert 0 < float(m["is_masked_frac"]) < 1


@pytest.mark.parametrize("kind", ["dppo", "tis"])
def test_rollouts_beyond_the_mismatch_bound_are_dropped_and_counted(kind):
    lp, mu, adv, mask = _arrays(4, N=6, T=10)
    mask[0] = True
    shift = np.array([0.0, 0.05, -0.05, 0.5, -0.5, 0.2], np.float32)  # per-rollout sampler offsets
    mu = (lp - shift[:, None]).astype(np.float32)  # mean log-ratio of rollout i = shift[i]
    bound = 0.3
    w = loss_weights(mask)
    seq = np.array([np.mean((lp - mu)[i][mask[i]]) for i in range(6)])
    drop = np.abs(seq) > bound
    assert drop.tolist() == [False, False, False, True, True, False]
    f = lambda x, b: policy_loss(x, mu, adv, mask, weights=w, kind=kind, seq_mismatch_max=b)  # noqa: E731
    (val, m), g = jax.value_and_grad(f, has_aux=True)(jnp.asarray(lp), bound)
    (val0, _), g0 = jax.value_and_grad(f, has_aux=True)(jnp.asarray(lp), 0.0)  # off: every rollout trains
    np.testing.assert_array_equal(np.asarray(g)[drop], 0.0)
    np.testing.assert_allclose(np.asarray(g)[~drop], np.asarray(g0)[~drop], rtol=1e-6)
    assert np.abs(np.asarray(g0)[drop]).sum() > 0
    assert float(m["mismatch_dropped"]) == 2 and float(m["mismatch_dropped_frac"]) == pytest.approx(2 / 6)


def test_group_advantages():
    r = [1.0, 0.0, 1.0, 0.5, 0.5, 0.5, 2.0, 4.0]
    g = [7, 7, 7, 3, 3, 3, 9, 9]
    adv, zero = group_advantages(r, g)
    np.testing.assert_allclose(adv, [1 / 3, -2 / 3, 1 / 3, 0, 0, 0, -1, 1], rtol=1e-6)
    np.testing.assert_array_equal(zero, [0, 0, 0, 1, 1, 1, 0, 0])
    adv_std, _ = group_advantages(r, g, scale="std")
    np.testing.assert_allclose(adv_std[6:], [-1, 1], rtol=1e-5)
    with pytest.raises(ValueError, match="finite"):
        group_advantages([1.0, float("nan")], [0, 0])


# ----------------------------------------------------------------------------- the learner step
CFG = tiny_cfg("M*E")
LCFG = LoraConfig(targets=("all",), rank=4, alpha=8.0)


def _rl_batch(cfg, rows=8, T=16, seed=0):
    rng = np.random.default_rng(seed)
    toks = rng.integers(0, cfg.vocab_size, (rows, T + 1)).astype(np.int32)
    mask = np.zeros((rows, T), bool)
    for i in range(rows):  # a prompt, then a response of its own length
        start = rng.integers(2, T // 2)
        mask[i, start:start + rng.integers(1, T - start + 1)] = True
    rewards = rng.random(rows)
    adv, _ = group_advantages(rewards, np.arange(rows) // 4)
    mu = np.where(mask, np.log(rng.uniform(0.001, 0.05, (rows, T))), 0.0).astype(np.float32)
    return {"tokens": toks[:, :-1], "targets": toks[:, 1:], "segment_ids": np.ones((rows, T), np.int32),
            "loss_mask": mask, "behaviour_logprobs": mu, "loss_weights": loss_weights(mask), "advantages": adv}


def _run(mesh, accum, loss_cfg=PolicyLossConfig(), steps=2):
    """Two SGD steps (a plain optimiser keeps the gradient's exactness visible in the params)."""
    base = init(CFG, jax.random.key(0))
    ad_sh = None
    if mesh is not None:
        base = jax.device_put(base, param_shardings(param_specs(CFG), mesh, Rules()))
        ad_sh = adapter_shardings(CFG, LCFG, mesh)
    adapters = init_adapters(CFG, LCFG, jax.random.key(3), shardings=ad_sh)
    # B = 0 at init: give it values so the adapters change the logprobs from the first step
    adapters = jax.tree_util.tree_map_with_path(
        lambda p, x: x + 0.05 if getattr(p[-1], "key", "") == "lora_b" else x, adapters)
    tx = optax.sgd(0.5)
    z = lambda: jnp.zeros((), jnp.int32)  # noqa: E731
    state = TrainState(adapters, tx.init(adapters), z(), z(), z(), jax.random.key_data(jax.random.key(1)))
    opts = Options(mesh=mesh)
    step = jax.jit(make_learner_step(CFG, opts, tx, lambda s: 0.5, loss_cfg, accum,
                                     combine=lambda ad, b: attach(b, ad)))
    batch = _rl_batch(CFG)
    if mesh is not None:
        batch = {k: jax.device_put(v, batch_sharding(mesh, np.ndim(v))) for k, v in batch.items()}
    out = []
    for _ in range(steps):
        state, m = step(state, batch, base)
        out.append({k: float(v) for k, v in m.items()})
    return out, jax.tree.map(np.asarray, state.params)


@pytest.fixture(scope="module")
def reference():
    return _run(None, 1)


@pytest.mark.slow
def test_learner_micro_batches_and_devices_match_one_batch(reference):
    ref_m, ref_p = reference
    assert ref_m[0]["ratio_max"] > 1.0 or ref_m[0]["ratio_min"] < 1.0  # off-policy: the ratio is exercised
    assert ref_m[1]["loss"] != ref_m[0]["loss"]  # the step changed the policy
    # the mesh run also splits each row's sequence (context=2: LoRA + the learner under context parallelism)
    for mesh, accum in ((None, 2), (make_mesh({"data": 2, "fsdp": 2, "context": 2}), 1)):
        m, p = _run(mesh, accum)
        for a, b in zip(m, ref_m):
            for k in ("loss", "mismatch_kl", "ratio_max", "masked_frac_high", "grad_norm"):
                np.testing.assert_allclose(a[k], b[k], rtol=1e-5, atol=1e-7, err_msg=k)
        for a, b in zip(jax.tree.leaves(p), jax.tree.leaves(ref_p)):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_learner_logprobs_use_the_sampling_temperature():
    """token_logprobs at T equals log_softmax(logits / T) of the full forward."""
    from nemo_jax.model import forward

    params = init(CFG, jax.random.key(0))
    b = _rl_batch(CFG, rows=2)
    logits = jax.jit(lambda p, t, s: forward(p, t, CFG, s)[0])(params, jnp.asarray(b["tokens"]),
                                                              jnp.asarray(b["segment_ids"]))
    for t in (1.0, 0.7):
        want = jnp.take_along_axis(jax.nn.log_softmax(logits / t, -1), jnp.asarray(b["targets"])[..., None], -1)[..., 0]
        got = jax.jit(lambda p, bb: token_logprobs(p, bb, CFG, Options(), t))(params, b)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_reference_kl_runs_the_base_without_adapters():
    m, _ = _run(None, 1, PolicyLossConfig(ref_kl_coef=0.1), steps=1)
    assert m[0]["ref_kl"] > 0  # the adapters (B != 0) move the policy away from the base
    with pytest.raises(ValueError, match="frozen base"):
        make_learner_step(CFG, Options(), optax.sgd(0.1), lambda s: 0.1, PolicyLossConfig(ref_kl_coef=0.1))


# ----------------------------------------------------------------------------- host side: curriculum, pool, spool
def test_curriculum_samples_in_proportion_to_reward_variance():
    from nemo_jax.rl.curriculum import Curriculum

    c = Curriculum(["solved", "half", "rare", "new"], window=8, floor=0.02, prior=0.1, seed=0)
    c.update("solved", [1.0] * 8)  # var 0 -> floor
    c.update("half", [0.0, 1.0] * 4)  # var 0.25
    c.update("rare", [1.0] + [0.0] * 7)  # var 7/64
    p = c.probabilities()
    w = np.array([0.02, 0.25, 7 / 64, 0.1])
    np.testing.assert_allclose(p, w / w.sum())
    n = 20000
    counts = Counter(c.sample(n))
    obs = np.array([counts[t] for t in c.tasks])
    chi2 = np.sum((obs - n * p) ** 2 / (n * p))
    assert chi2 < 16.27  # 3 degrees of freedom, p = 0.001
    # the window forgets: after 8 more successes "rare" is at the floor
    c.update("rare", [1.0] * 8)
    assert c.weight("rare") == 0.02
    # state round trip: same draws after restore
    state = json.loads(json.dumps(c.state_dict()))
    a = c.sample(50)
    c2 = Curriculum(c.tasks, window=8, floor=0.02, prior=0.1, seed=123)
    c2.load_state_dict(state)
    assert c2.sample(50) == a and c2.weight("half") == c.weight("half")


def _rollout(group, task="t0", reward=1.0, version=0, n=6, **kw):
    from nemo_jax.rl.rollout import Rollout

    d = dict(tokens=list(range(1, n + 1)), loss_mask=[0, 0] + [1] * (n - 2), logprobs=[0.0, 0.0] + [-0.5] * (n - 2),
             reward=reward, task_id=task, group_id=group, policy_versions=[version])
    d.update(kw)
    return Rollout(**d)


def test_rollout_validation_rejects_each_malformed_kind():
    from nemo_jax.rl.rollout import validate

    good = _rollout("g0").to_json()
    assert validate(good, vocab_size=97).tokens == good["tokens"]
    bad = {
        "length_mismatch": dict(logprobs=[0.0, -1.0]),
        "bad_reward": dict(reward=float("nan")),
        "bad_logprob": dict(logprobs=[0.0, 0.0, 0.3, -0.1, -0.2, -0.1]),
        "bad_token": dict(tokens=[1, 2, 3, 97, 4, 5]),
        "no_loss_tokens": dict(loss_mask=[0] * 6),
        "too_long": dict(tokens=list(range(1, 41)), loss_mask=[0] + [1] * 39, logprobs=[-0.1] * 40),
    }
    for reason, change in bad.items():
        assert validate({**good, **change}, vocab_size=97, max_len=32) == reason, reason
    missing = dict(good)
    del missing["reward"]
    assert validate(missing, 97) == "bad_reward"
    assert validate({**good, "reward": None}, 97) == "bad_reward"
    assert validate({**good, "reward": "1"}, 97) == "bad_reward"
    del missing["group_id"]
    assert validate(missing, 97) == "malformed"


def test_pool_groups_become_ready_and_stale_groups_are_dropped():
    from nemo_jax.rl.pool import RolloutPool

    pool = RolloutPool(group_size=2, max_off_policy_steps=2)
    g_old, g_new, g_open = pool.open_group("t0"), pool.open_group("t1"), pool.open_group("t2")
    assert pool.add(_rollout(g_old, version=1)) is None
    assert pool.add(_rollout(g_old, version=3)) == g_old  # complete; its oldest token is from version 1
    pool.add(_rollout(g_new, "t1", version=3))
    assert pool.add(_rollout(g_new, "t1", version=4)) == g_new
    pool.add(_rollout(g_open, "t2", version=0))  # half a group sampled long ago
    assert pool.add(_rollout("nobody", version=5)) == "unknown_group"
    assert pool.add(_rollout(g_new, "t9")) == "unknown_group"  # finished group / wrong task
    got = pool.take(4, version=4)  # g_old is 3 versions behind (> 2): dropped, as is the in-flight g_open
    assert [rs[0].group_id for rs in got] == [g_new]
    assert pool.counts["groups_stale_dropped"] == 2 and not pool.in_flight
    assert pool.staleness == Counter({1: 1, 0: 1})
    state = json.loads(json.dumps(pool.state_dict()))
    p2 = RolloutPool(2, 2)
    p2.load_state_dict(state)
    assert p2.counts == pool.counts


@pytest.mark.parametrize("bound", [0, 1, 3])
def test_no_rollout_older_than_max_off_policy_steps_trains(bound):
    """Whatever mix of versions sampled a rollout's turns and however long its group waits in the pool, every
    rollout the learner takes at version v has its oldest token from v - max_off_policy_steps or later; groups at
    exactly the bound still train (the bound is inclusive), older ones are dropped and counted."""
    from nemo_jax.rl.pool import RolloutPool

    rng = np.random.default_rng(bound)
    pool = RolloutPool(group_size=3, max_off_policy_steps=bound)
    ages = Counter()
    for version in range(40):
        for i in range(3):
            g = pool.open_group(f"t{version}-{i}")
            for _ in range(3):
                oldest = max(0, version - int(rng.integers(0, bound + 3)))
                newer = rng.integers(oldest, version + 1, size=2).tolist()
                pool.add(_rollout(g, f"t{version}-{i}", policy_versions=sorted({oldest, *newer})))
        for rs in pool.take(int(rng.integers(1, 5)), version):
            for r in rs:
                ages[version - min(r.policy_versions)] += 1
    assert max(ages) == bound and sum(ages.values()) > 0
    assert pool.counts["groups_stale_dropped"] > 0


def test_spool_round_trip_and_rejections(tmp_path):
    from nemo_jax.rl.pool import RolloutPool
    from nemo_jax.rl.rollout import learner_batch
    from nemo_jax.rl.transport.rollouts import SpoolReader, write_rollouts

    pool = RolloutPool(group_size=2, max_off_policy_steps=4)
    g = pool.open_group("t0")
    g2 = pool.open_group("t1")
    spool = tmp_path / "spool"
    write_rollouts(str(spool), [_rollout(g, reward=1.0), _rollout(g, reward=0.0, n=8)], "producer-a-0")
    write_rollouts(str(spool), [_rollout(g2, "t1", reward=0.5), _rollout(g2, "t1", reward=0.5)], "producer-b-0")
    bad = _rollout(g, reward=1.0).to_json()
    with open(spool / "producer-c-0.jsonl", "w") as f:
        f.write(json.dumps({**bad, "logprobs": [0.0] * 5}) + "\n")  # length mismatch
        f.write("{not json\n")
        f.write(json.dumps({**bad, "group_id": "g999"}) + "\n")
    (spool / ".producer-d-0.jsonl.tmp-x").write_text("half a line")  # a writer still at work: ignored
    reader = SpoolReader(str(spool), vocab_size=97, max_len=16)
    finished = reader.poll(pool, version=0)
    assert sorted(finished) == sorted([g, g2]) and reader.accepted == 4
    assert reader.rejected == Counter({"length_mismatch": 1, "malformed": 1, "unknown_group": 1})
    assert sorted(os.listdir(spool / "consumed")) == ["producer-a-0.jsonl", "producer-b-0.jsonl"]
    assert "producer-c-0.jsonl" in os.listdir(spool / "rejected")  # with its .reason: one line per record
    assert reader.poll(pool, version=0) == []  # consumed files are not read again
    batch, counts = learner_batch(pool.take(8, version=0), seq_len=10, rows=4)
    assert counts["zero_variance_groups"] == 1 and counts["rollouts"] == 2  # g2's rewards are equal
    np.testing.assert_allclose(batch["advantages"], [0.5, -0.5, 0, 0])
    np.testing.assert_array_equal(batch["loss_mask"].sum(1), [4, 6, 0, 0])  # targets of sampled tokens
    np.testing.assert_allclose(batch["loss_weights"].sum(1), [0.5, 0.5, 0, 0])
    np.testing.assert_array_equal(batch["targets"][0, :5], [2, 3, 4, 5, 6])


def test_long_rollouts_are_truncated_not_dropped():
    """A rollout longer than the learner's row keeps its first seq_len + 1 tokens: the loss mask, targets and
    behaviour logprobs of the kept part, its group and advantage; counted."""
    from nemo_jax.rl.rollout import Rollout, learner_batch

    short = Rollout([1, 2, 3, 4, 5], [0, 0, 1, 1, 1], [0.0, 0.0, -0.5, -0.4, -0.3], 1.0, "t", "g")
    mask = [0] * 4 + [1] * 6 + [0] * 3 + [1] * 7
    long = Rollout(list(range(1, 21)), mask, [-0.1 * m * (i + 1) for i, m in enumerate(mask)], 0.0, "t", "g")
    batch, counts = learner_batch([[short, long]], seq_len=12)
    assert counts["rollouts"] == 2 and counts["truncated"] == 1 and counts["truncated_tokens"] == 20 - 13
    np.testing.assert_array_equal(batch["advantages"], [0.5, -0.5])
    np.testing.assert_array_equal(batch["tokens"][1], long.tokens[:12])
    np.testing.assert_array_equal(batch["targets"][1], long.tokens[1:13])
    np.testing.assert_array_equal(batch["loss_mask"][1], np.asarray(mask[1:13], bool))
    np.testing.assert_allclose(batch["behaviour_logprobs"][1], np.asarray(long.logprobs[1:13]) * np.asarray(mask[1:13]))
    np.testing.assert_allclose(batch["loss_weights"][1].sum(), 0.5)  # mean over its kept loss tokens, / N
    np.testing.assert_array_equal(batch["loss_mask"][0, :4], [0, 1, 1, 1])


# ----------------------------------------------------------------------------- per-turn credit
def test_turn_spans_and_credits():
    """A rollout's turns are the runs of its loss mask; a turn's credit is the reward earned from it on
    (discounted by gamma per turn); missing turn rewards, and the last turn, take the rollout's reward."""
    from nemo_jax.rl.rollout import Rollout, turn_credits, turn_spans

    mask = [0, 0, 1, 1, 0, 0, 1, 1, 1, 0, 1]
    assert turn_spans(mask) == [(2, 4), (6, 9), (10, 11)]
    r = Rollout(list(range(11)), mask, [0.0] * 11, 0.75, "t", "g", turn_rewards=[0.25, 0.25, 0.9])
    np.testing.assert_allclose(turn_credits(r), [0.75, 0.5, 0.5])  # (the last turn: the rollout's 0.75)
    np.testing.assert_allclose(turn_credits(r, gamma=0.5), [0.25 + 0.5 * 0.0 + 0.25 * 0.5, 0.0 + 0.5 * 0.5, 0.5])
    bare = Rollout(list(range(11)), mask, [0.0] * 11, 1.0, "t", "g")  # no turn rewards recorded
    np.testing.assert_allclose(turn_credits(bare), [1.0, 1.0, 1.0])


def test_turn_credit_advantages_per_token():
    """Under turn credit a token of turn t of rollout i gets A_i + beta (c_t - mean c); the learner batch then
    holds [rows, seq_len] advantages of the targets; off, one advantage a row, as before."""
    from nemo_jax.rl.rollout import Rollout, learner_batch

    mask = [0, 1, 1, 0, 1, 1]
    good = Rollout([1, 2, 3, 4, 5, 6], mask, [0.0, -1, -1, 0, -1, -1], 1.0, "t", "g", turn_rewards=[0.5, 1.0])
    half = Rollout([1, 2, 3, 4, 5, 6], mask, [0.0, -1, -1, 0, -1, -1], 0.5, "t", "g", turn_rewards=[0.5, 0.5])
    plain, _ = learner_batch([[good, half]], seq_len=8)
    np.testing.assert_allclose(plain["advantages"], [0.25, -0.25])
    batch, _ = learner_batch([[good, half]], seq_len=8, turn_credit=0.5)
    # credits: good [1.0, 0.5], half [0.5, 0.0]; mean 0.5
    np.testing.assert_allclose(batch["advantages"][0, :5], [0.25 + 0.25, 0.25 + 0.25, 0.25, 0.25, 0.25])
    np.testing.assert_allclose(batch["advantages"][1, :5], [-0.25, -0.25, -0.25, -0.25 - 0.25, -0.25 - 0.25])
    assert batch["advantages"].shape == (2, 8)


def test_per_token_advantages_equal_per_rollout_ones_when_constant():
    """policy_terms with [N, T] advantages that repeat each row's value: the same loss and gradient as [N]."""
    lp, mu, adv, mask = _arrays(3)
    w = loss_weights(mask)
    f = lambda a, x: policy_loss(x, mu, a, mask, weights=w)[0]  # noqa: E731
    per_row = jax.value_and_grad(lambda x: f(adv, x))(lp)
    per_token = jax.value_and_grad(lambda x: f(np.repeat(adv[:, None], lp.shape[1], 1), x))(lp)
    np.testing.assert_allclose(per_row[0], per_token[0], rtol=1e-6)
    np.testing.assert_allclose(per_row[1], per_token[1], rtol=1e-6)


def test_turn_rewards_round_trip_and_are_checked():
    from nemo_jax.rl.rollout import validate

    r = _rollout("g0", n=8, loss_mask=[0, 1, 1, 0, 0, 1, 1, 1], turn_rewards=[0.5, 1.0])
    d = r.to_json()
    assert d["turn_rewards"] == [0.5, 1.0] and validate(d, 100).turn_rewards == [0.5, 1.0]
    assert validate(dict(d, turn_rewards=[0.5, 1.0, 1.0]), 100) == "bad_reward"  # more rewards than turns
    assert validate(dict(d, turn_rewards=["1"]), 100) == "bad_reward"
    assert "turn_rewards" not in _rollout("g1").to_json()  # (none recorded: not written)


# ----------------------------------------------------------------------------- branches (one row, many segments)
def test_a_rollouts_branches_are_segments_of_its_row():
    """A rollout of two branches (a rewritten conversation): one learner row, each branch a segment (ids 1, 2)
    shifted on its own (a branch's first token is never a target), one advantage; the row's length is the
    branches' tokens but their last ones; a row too short cuts the later branch, counted."""
    from nemo_jax.rl.rollout import Rollout, learner_batch, segments

    mask = [0, 0, 1, 1, 0, 0, 0, 1, 1, 1]
    lps = [-0.1 * (i + 1) * m for i, m in enumerate(mask)]
    two = Rollout(list(range(10, 20)), mask, lps, 1.0, "t", "g", branches=[4])
    one = Rollout([1, 2, 3, 4], [0, 1, 1, 1], [0.0, -1, -1, -1], 0.0, "t", "g")
    assert segments(two) == [(0, 4), (4, 10)] and two.row_tokens == 8
    batch, counts = learner_batch([[two, one]], seq_len=9)
    np.testing.assert_array_equal(batch["tokens"][0], [10, 11, 12, 14, 15, 16, 17, 18, 0])
    np.testing.assert_array_equal(batch["targets"][0], [11, 12, 13, 15, 16, 17, 18, 19, 0])
    np.testing.assert_array_equal(batch["segment_ids"][0], [1, 1, 1, 2, 2, 2, 2, 2, 0])
    np.testing.assert_array_equal(batch["loss_mask"][0], [0, 1, 1, 0, 0, 1, 1, 1, 0])
    np.testing.assert_allclose(batch["behaviour_logprobs"][0], [0, lps[2], lps[3], 0, 0, lps[7], lps[8], lps[9], 0])
    np.testing.assert_allclose(batch["advantages"], [0.5, -0.5])
    np.testing.assert_allclose(batch["loss_weights"][0].sum(), 0.5)  # (one rollout's weight, whatever its branches)
    assert counts["truncated"] == 0 and counts["rollouts"] == 2
    cut, counts = learner_batch([[two, one]], seq_len=5)
    np.testing.assert_array_equal(cut["segment_ids"][0], [1, 1, 1, 2, 2])
    assert counts["truncated"] == 1 and counts["truncated_tokens"] == 3
    credit, _ = learner_batch([[two, one]], seq_len=9, turn_credit=0.5)  # (per-turn credit over the segments)
    assert credit["advantages"].shape == (2, 9) and np.all(credit["advantages"][0, batch["loss_mask"][0]] != 0)


def test_branches_round_trip_and_are_checked():
    from nemo_jax.rl.rollout import validate

    r = _rollout("g0", n=8, loss_mask=[0, 1, 1, 0, 0, 1, 1, 1], branches=[3])
    d = r.to_json()
    assert d["branches"] == [3] and validate(d, 100).branches == [3]
    assert "branches" not in _rollout("g1").to_json()
    assert validate(dict(d, branches=[2]), 100) == "no_loss_tokens"  # (a branch opens on a prompt token)
    assert validate(dict(d, branches=[3, 3]), 100) == "length_mismatch"
    assert validate(dict(d, branches=[7]), 100) == "length_mismatch"  # (a branch of one token)
    assert validate(dict(d, branches=["3"]), 100) == "malformed"
    assert validate(d, 100, max_len=5) == "too_long" and validate(d, 100, max_len=6).branches == [3]


def test_a_packed_rows_logprobs_equal_each_branch_alone():
    """Segments of one row are separate conversations to the model: attention and the Mamba state do not cross
    them, so each branch's logprobs (and their gradients) equal those of the branch in a row of its own."""
    from nemo_jax.rl.rollout import Rollout, learner_batch

    cfg = tiny_cfg("M*M-")
    params = init(cfg, jax.random.key(1))
    rng = np.random.default_rng(0)
    a, b = rng.integers(0, cfg.vocab_size, 9).tolist(), rng.integers(0, cfg.vocab_size, 7).tolist()
    ma, mb = [0, 0, 0] + [1] * 6, [0, 0] + [1] * 5
    z = lambda n: [-1.0] * n  # noqa: E731
    both = Rollout(a + b, ma + mb, z(16), 1.0, "t", "g", branches=[9])
    alone = [Rollout(a, ma, z(9), 1.0, "t", "g"), Rollout(b, mb, z(7), 1.0, "t", "g")]
    packed, _ = learner_batch([[both]], seq_len=16, drop_zero_variance=False)
    single, _ = learner_batch([alone], seq_len=16, drop_zero_variance=False)
    keys = ("tokens", "targets", "segment_ids", "loss_mask")

    def total(p, batch):  # the sum of the sampled tokens' logprobs
        lp = token_logprobs(p, {k: jnp.asarray(batch[k]) for k in keys}, cfg, Options())
        return jnp.sum(jnp.where(jnp.asarray(batch["loss_mask"]), lp, 0.0)), lp

    (sp, lp_p), gp = jax.value_and_grad(total, has_aux=True)(params, packed)
    (ss, lp_s), gs = jax.value_and_grad(total, has_aux=True)(params, single)
    np.testing.assert_allclose(np.asarray(lp_p)[0, :8], np.asarray(lp_s)[0, :8], atol=1e-5)
    np.testing.assert_allclose(np.asarray(lp_p)[0, 8:14], np.asarray(lp_s)[1, :6], atol=1e-5)
    np.testing.assert_allclose(sp, ss, rtol=1e-5)
    for x, y in zip(jax.tree.leaves(gp), jax.tree.leaves(gs)):
        np.testing.assert_allclose(x, y, rtol=1e-4, atol=1e-5)
