import jax
import jax.numpy as jnp
import numpy as np
import pytest

from nemo_jax import model as M
from nemo_jax.generate import (SamplingParams, append, continuous_generate, generate, prefill, sample_token,
                               sampling_logprobs)
from nemo_jax.lora import attach

from helpers import tiny_cfg

PROMPTS = [[5, 17, 3, 44, 9, 1, 2], [8, 2], [60, 61, 62, 63, 64]]


@pytest.fixture(scope="module")
def setup():
    cfg = tiny_cfg("M*E-", n_group=2, topk_group=1, chunk_size=4)  # every layer kind once
    params = M.init(cfg, jax.random.key(0))
    return cfg, params


_forward = jax.jit(lambda params, toks, cfg: M.forward(params, toks, cfg)[0], static_argnums=2)


def full_logprobs(params, cfg, seq, temperature=1.0, width=32):
    """Log-probs of one causal forward over seq (right-padded to `width`: one compile for every call)."""
    toks = np.zeros((1, width), np.int32)
    toks[0, :len(seq)] = seq
    logits = _forward(params, jnp.asarray(toks), cfg)[0, :len(seq)]
    return np.asarray(jax.nn.log_softmax(logits / temperature, axis=-1))


@pytest.mark.slow
def test_greedy_matches_full_reforward_argmax(setup):
    cfg, params = setup
    g = generate(params, PROMPTS, cfg, SamplingParams(max_new_tokens=6, temperature=0.0))
    for prompt, toks in zip(PROMPTS, g.tokens):  # one causal forward of the whole sequence re-derives each step
        lp = full_logprobs(params, cfg, list(prompt) + list(toks))
        assert list(toks) == [int(np.argmax(lp[len(prompt) - 1 + i])) for i in range(len(toks))]


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_equal_full_forward(setup, temperature):
    cfg, params = setup
    g = generate(params, PROMPTS, cfg, SamplingParams(max_new_tokens=7, temperature=temperature),
                 key=jax.random.key(3))
    for prompt, toks, lps in zip(PROMPTS, g.tokens, g.logprobs):
        lp = full_logprobs(params, cfg, prompt + toks, temperature)
        want = [lp[len(prompt) - 1 + i, t] for i, t in enumerate(toks)]
        np.testing.assert_allclose(lps, want, atol=1e-4)


@pytest.mark.slow
def test_padded_batch_rows_equal_alone(setup):
    cfg, params = setup
    sp = SamplingParams(max_new_tokens=5, temperature=0.0)
    batch = generate(params, PROMPTS, cfg, sp)
    for i, p in enumerate(PROMPTS):
        alone = generate(params, [p], cfg, sp)
        assert alone.tokens[0] == batch.tokens[i]
        np.testing.assert_allclose(alone.logprobs[0], batch.logprobs[i], atol=1e-5)


def test_stop_tokens_and_finish_reason(setup):
    cfg, params = setup
    g0 = generate(params, PROMPTS[:1], cfg, SamplingParams(max_new_tokens=6, temperature=0.0))
    stop = g0.tokens[0][2]
    g = generate(params, PROMPTS[:1], cfg, SamplingParams(max_new_tokens=6, temperature=0.0, stop_token_ids=(stop,)))
    first = g0.tokens[0].index(stop)
    assert g.tokens[0] == g0.tokens[0][:first + 1] and g.finish_reason[0] == "stop"
    assert g0.finish_reason[0] == "length"


def test_one_decode_program_serves_every_budget(setup):
    """The decode step depends on the sampling settings, not on max_new_tokens: a second budget on the same
    state shape compiles nothing new."""
    from nemo_jax.generate import decode as G

    cfg, params = setup
    greedy = SamplingParams(max_new_tokens=2, temperature=0.0)
    short = generate(params, PROMPTS, cfg, greedy, max_len=16)
    compiled = G._decode_and_sample._cache_size()
    longer = generate(params, PROMPTS, cfg, SamplingParams(max_new_tokens=5, temperature=0.0), max_len=16)
    assert G._decode_and_sample._cache_size() == compiled
    assert [t[:2] for t in longer.tokens] == short.tokens


@pytest.mark.slow
def test_continuing_state_equals_prefilling_concatenation(setup):
    cfg, params = setup
    g = generate(params, PROMPTS, cfg, SamplingParams(max_new_tokens=4, temperature=0.0), max_len=40)
    more = [[7, 7, 7], [9], []]
    logits, _ = append(params, g.state, more, cfg)
    for i, p in enumerate(PROMPTS):
        if not more[i]:
            continue
        seq = p + g.tokens[i] + more[i]
        fresh, _ = prefill(params, [seq], cfg, 40)
        np.testing.assert_allclose(logits[i], fresh[0], rtol=1e-4, atol=1e-4)


def test_sampled_frequencies_match_softmax():
    V, n = 6, 20000
    logits = jnp.asarray([[1.0, 0.5, -0.3, 2.0, 0.0, -1.0]])
    keys = jax.random.split(jax.random.key(1234), n)
    draw = jax.jit(jax.vmap(lambda k: sample_token(logits, k, SamplingParams(temperature=0.8))[0][0]))
    counts = np.bincount(np.asarray(draw(keys)), minlength=V)
    p = np.asarray(jax.nn.softmax(logits[0] / 0.8))
    chi2 = float(np.sum((counts - n * p) ** 2 / (n * p)))
    assert chi2 < 20.5  # chi-square, 5 degrees of freedom, p = 0.001
    # top-k renormalises over the kept tokens: the dropped ones never appear
    draw_k = jax.jit(jax.vmap(lambda k: sample_token(logits, k, SamplingParams(top_k=2))[0][0]))
    ck = np.bincount(np.asarray(draw_k(keys)), minlength=V)
    assert set(np.nonzero(ck)[0]) == {0, 3}
    lp = sampling_logprobs(logits[0], 1.0, top_k=2)
    np.testing.assert_allclose(np.exp(np.asarray(lp)[[0, 3]]), jax.nn.softmax(np.asarray(logits)[0, [0, 3]]), rtol=1e-6)


def test_top_p_keeps_the_smallest_nucleus():
    logits = jnp.log(jnp.asarray([0.5, 0.3, 0.15, 0.05]))
    lp = sampling_logprobs(logits, 1.0, top_p=0.75)
    kept = np.isfinite(np.asarray(lp))
    assert kept.tolist() == [True, True, False, False]
    np.testing.assert_allclose(np.exp(lp[:2]), [0.625, 0.375], rtol=1e-5)


def test_min_p_cuts_below_its_share_of_the_top_token_after_temperature():
    """vLLM's min-p: after the temperature, tokens less likely than min_p x the top token's probability are cut,
    the rest renormalised; then top-k / top-p on what is left."""
    logits = jnp.log(jnp.asarray([0.5, 0.3, 0.15, 0.05]))
    lp = np.asarray(sampling_logprobs(logits, 1.0, min_p=0.35))  # threshold 0.175: keeps 0.5, 0.3
    assert np.isfinite(lp).tolist() == [True, True, False, False]
    np.testing.assert_allclose(np.exp(lp[:2]), [0.625, 0.375], rtol=1e-5)
    hot = np.asarray(sampling_logprobs(logits, 2.0, min_p=0.35))  # tempered: 0.15 is now above 0.35 x the top
    assert np.isfinite(hot).tolist() == [True, True, True, False]
    assert np.isfinite(np.asarray(sampling_logprobs(logits, 1.0, min_p=0.0))).all()
    both = np.asarray(sampling_logprobs(logits, 2.0, top_k=1, min_p=0.35))
    assert np.isfinite(both).tolist() == [True, False, False, False]


@pytest.mark.slow
def test_unmerged_lora_equals_merged_weights(setup):
    cfg, params = setup
    q = params["layers"]["attention"]["mixer"]["q_proj"]["kernel"]  # [n, in, out]
    r = 2
    A = jax.random.normal(jax.random.key(5), (q.shape[0], q.shape[1], r)) * 0.1
    B = jax.random.normal(jax.random.key(6), (q.shape[0], r, q.shape[2])) * 0.1
    adapters = {"layers": {"attention": {"mixer": {"q_proj": {"lora_a": A, "lora_b": B,
                                                              "lora_scale": jnp.full((q.shape[0],), 4.0)}}}}}
    merged = jax.tree.map(lambda x: x, params)
    merged["layers"]["attention"]["mixer"]["q_proj"]["kernel"] = q + 4.0 * jnp.einsum("nir,nro->nio", A, B)
    toks = jnp.asarray([PROMPTS[0]])
    fwd = jax.jit(M.forward, static_argnums=2)  # (compiled once per tree: cheaper than eager op by op)
    a, _ = fwd(attach(params, adapters), toks, cfg)
    b, _ = fwd(merged, toks, cfg)
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    g1 = generate(params, PROMPTS, cfg, SamplingParams(max_new_tokens=3, temperature=0.0), adapters=adapters)
    g2 = generate(merged, PROMPTS, cfg, SamplingParams(max_new_tokens=3, temperature=0.0))
    assert g1.tokens == g2.tokens
    with pytest.raises(ValueError, match="does not exist"):
        attach(params, {"layers": {"attention": {"mixer": {"qq_proj": {"lora_a": A}}}}})


@pytest.mark.slow
def test_generation_on_a_mesh(setup):
    from nemo_jax.model.spec import param_specs
    from nemo_jax.parallel.mesh import make_mesh
    from nemo_jax.parallel.rules import param_shardings

    cfg, params = setup
    mesh = make_mesh({"fsdp": 2, "tensor": 2, "expert": 2})
    sharded = jax.device_put(params, param_shardings(param_specs(cfg), mesh))
    sp = SamplingParams(max_new_tokens=4, temperature=0.0)
    assert generate(sharded, PROMPTS, cfg, sp).tokens == generate(params, PROMPTS, cfg, sp).tokens


@pytest.mark.slow
def test_generate_cli_streams_tokens(tmp_path, capsys):
    import os

    from nemo_jax.checkpoint import save_model
    from nemo_jax.cli import main
    from nemo_jax.config.model import NemotronHConfig
    from nemo_jax.data.chat import ASSETS

    cfg = NemotronHConfig.from_file(os.path.join(ASSETS, "models", "tiny.json"))
    save_model(str(tmp_path / "m"), cfg, M.init(cfg, jax.random.key(0)), tokenizer_dir=os.path.join(ASSETS, "tiny"))
    main(["generate", "--ckpt", str(tmp_path / "m"), "--prompt", "What is 2 plus 2?", "--max-new-tokens", "5",
          "--temperature", "0"])
    err = capsys.readouterr().err
    import re

    m = re.search(r"\[(\d+) tokens, finish: (stop|length)", err)
    assert m and 1 <= int(m.group(1)) <= 5, err
    # on a mesh (the options carry it: kernels run per device) and with the kernels forced to the reference
    main(["generate", "--ckpt", str(tmp_path / "m"), "--prompt", "What is 2 plus 2?", "--max-new-tokens", "5",
          "--temperature", "0", "--mesh", "fsdp=-1", "--kernels", "reference"])
    m = re.search(r"\[(\d+) tokens, finish: (stop|length)", capsys.readouterr().err)
    assert m and 1 <= int(m.group(1)) <= 5


CB_PROMPTS = [[5, 17, 3, 44, 9, 1, 2], [8, 2], [60, 61, 62, 63, 64], [11] * 12, [3, 4], [70, 71, 72]]
MORE = [7, 7, 9]  # what the "environment" answers after a first turn, for the even-numbered prompts


def _two_turns(i, turns):
    return MORE if i % 2 == 0 and len(turns) == 1 else None


@pytest.mark.slow
def test_continuous_batching_equals_each_sequence_alone(setup, max_len=26):  # 26 positions per row: a first
    # turn that stops early (4 tokens) is continued in place, one of 6 tokens is re-prefilled whole
    """2 decode rows serving 6 two-turn or one-turn sequences (finished rows refilled in place, turns continued
    in place or re-prefilled) give, greedy, exactly the tokens of each conversation generated on its own."""
    cfg, params = setup
    g0 = generate(params, CB_PROMPTS[:1], cfg, SamplingParams(max_new_tokens=6, temperature=0.0))
    sp = SamplingParams(max_new_tokens=6, temperature=0.0, stop_token_ids=(g0.tokens[0][3],))
    out = list(continuous_generate(params, CB_PROMPTS, cfg, sp, batch=2, max_len=max_len, next_turn=_two_turns,
                                   bucket=8, check_every=3))
    assert sorted(f.index for f in out) == list(range(len(CB_PROMPTS)))
    reasons = set()
    for f in out:
        seq = list(CB_PROMPTS[f.index])
        assert len(f.turns) == (2 if f.index % 2 == 0 else 1)
        for k, (toks, lps, why) in enumerate(f.turns):
            alone = generate(params, [seq], cfg, sp, bucket=8, max_len=64)
            assert toks == alone.tokens[0] and why == alone.finish_reason[0], (f.index, k)
            np.testing.assert_allclose(lps, alone.logprobs[0], atol=1e-4)
            seq += toks + MORE
            reasons.add(why)
    assert reasons == {"stop", "length"}  # rows finished at different times


@pytest.mark.slow
def test_continuous_batching_sampled_logprobs_equal_full_forward(setup):
    cfg, params = setup
    sp = SamplingParams(max_new_tokens=5, temperature=0.8)
    fwd = jax.jit(lambda p, t: M.forward(p, t, cfg)[0])  # causal: right padding to one length changes nothing before it
    for f in continuous_generate(params, CB_PROMPTS, cfg, sp, batch=4, max_len=64, next_turn=_two_turns, bucket=8,
                                 key=jax.random.key(5)):
        seq = list(CB_PROMPTS[f.index])
        for toks, lps, _ in f.turns:
            lp = np.asarray(jax.nn.log_softmax(fwd(params, jnp.asarray([seq + toks + [0] * (40 - len(seq + toks))]))[0]
                                               / 0.8, axis=-1))
            np.testing.assert_allclose(lps, [lp[len(seq) - 1 + i, t] for i, t in enumerate(toks)], atol=1e-4)
            seq += toks + MORE
    with pytest.raises(ValueError, match="do not fit max_len"):
        list(continuous_generate(params, [[1] * 30], cfg, sp, batch=2, max_len=32, bucket=8))


# --------------------------------------------------------------------------- the engine
def test_per_row_sampling_equals_the_static_reference():
    """`row_sampling_logprobs` with one row's parameters is `sampling_logprobs` with them, row by row (greedy rows:
    the untempered distribution)."""
    from nemo_jax.generate import row_sampling_logprobs

    logits = jax.random.normal(jax.random.key(0), (6, 97)) * 3
    rows = [(0.0, 0, 1.0, 0.0), (0.7, 0, 1.0, 0.0), (1.0, 3, 1.0, 0.0), (0.9, 0, 0.6, 0.05), (1.3, 5, 0.8, 0.1),
            (1.0, 0, 1.0, 0.02)]
    t, k, p, m = (jnp.asarray(x) for x in zip(*rows))
    got = row_sampling_logprobs(logits, t, k.astype(jnp.int32), p, k_max=8, nucleus=True, min_p=m)
    for i, (ti, ki, pi, mi) in enumerate(rows):
        want = sampling_logprobs(logits[i], ti if ti > 0 else 1.0, ki, pi, mi)
        np.testing.assert_allclose(got[i], want, rtol=1e-6, atol=1e-6)
    assert np.isinf(np.asarray(got[5])).sum() > 0  # (min-p alone cuts)
    plain = row_sampling_logprobs(logits[:2], t[:2], k[:2].astype(jnp.int32), p[:2])  # no truncation compiled
    np.testing.assert_allclose(plain, got[:2], rtol=1e-6, atol=1e-6)


@pytest.mark.slow
def test_engine_rows_with_their_own_sampling_parameters(setup):
    """One engine batch serves sequences with different temperatures, top-k, top-p, budgets and stop ids: each
    turn's logprobs are those of its own distribution (a full forward), greedy rows equal `generate`, and a
    seeded sequence draws the same tokens whatever shares its batch."""
    from nemo_jax.generate import Engine

    cfg, params = setup
    g0 = generate(params, PROMPTS[:1], cfg, SamplingParams(max_new_tokens=6, temperature=0.0))
    sps = [SamplingParams(max_new_tokens=6, temperature=0.0, stop_token_ids=(g0.tokens[0][2],)),
           SamplingParams(max_new_tokens=6, temperature=0.7, seed=11),
           SamplingParams(max_new_tokens=4, temperature=1.0, top_k=3),
           SamplingParams(max_new_tokens=5, temperature=0.9, top_p=0.6)]
    prompts = PROMPTS + [[4, 5, 6]]
    eng = Engine(params, cfg, batch=3, max_len=40, bucket=8, check_every=2, key=jax.random.key(1))
    ids = [eng.submit(p, sp, tag=i) for i, (p, sp) in enumerate(zip(prompts, sps))]  # 4 sequences, 3 rows
    assert eng.queued == 4 and eng.busy == 0
    ends = {}
    while len(ends) < 4:
        for e in eng.step():
            ends[e.tag] = e
            eng.release(e.seq_id)
    assert [ends[i].seq_id for i in range(4)] == ids and eng.busy == eng.parked == eng.queued == 0
    assert ends[0].finish_reason == "stop" and ends[0].tokens == g0.tokens[0][:3]
    for i, (p, sp) in enumerate(zip(prompts, sps)):
        e = ends[i]
        assert 1 <= len(e.tokens) <= sp.max_new_tokens and e.version == 0
        seq = list(p) + e.tokens
        toks = np.zeros((1, 32), np.int32)
        toks[0, :len(seq)] = seq
        logits = _forward(params, jnp.asarray(toks), cfg)[0, len(p) - 1:len(seq) - 1]
        lp = sampling_logprobs(logits, sp.temperature or 1.0, sp.top_k, sp.top_p)
        np.testing.assert_allclose(e.logprobs, [lp[j, t] for j, t in enumerate(e.tokens)], atol=1e-4)
        assert np.all(np.isfinite(e.logprobs))  # never a token outside the kept set
    alone = Engine(params, cfg, batch=1, max_len=40, bucket=8, key=jax.random.key(99))
    alone.submit(prompts[1], sps[1])
    got = []
    while not got:
        got = alone.step()
    assert got[0].tokens == ends[1].tokens
    with pytest.raises(ValueError, match="do not fit max_len"):
        eng.submit([1] * 36, SamplingParams(max_new_tokens=8))


@pytest.mark.slow
def test_engine_refills_most_rows_while_one_decodes(setup):
    """Sequences admitted into most rows at once (the chunk runs every row) while an earlier one is mid-turn in a
    row before them: each is prefilled into its own row (the mid-turn one is untouched), so every turn's logprobs
    are those of a full forward of its sequence."""
    from nemo_jax.generate import Engine

    cfg, params = setup
    sp = SamplingParams(max_new_tokens=6, temperature=1.0)
    eng = Engine(params, cfg, batch=4, max_len=40, bucket=8, check_every=2, key=jax.random.key(5))
    prompts = [PROMPTS[0], PROMPTS[1], [4, 5, 6], [7, 3, 2, 9, 1, 1, 8, 2, 6]]
    eng.submit(prompts[0], sp, tag=0)
    assert eng.step() == []  # row 0 mid-turn
    for i in (1, 2, 3):
        eng.submit(prompts[i], sp, tag=i)
    ends = {}
    while len(ends) < 4:
        for e in eng.step():
            ends[e.tag] = e
            eng.release(e.seq_id)
    for i, p in enumerate(prompts):
        seq = list(p) + ends[i].tokens
        toks = np.zeros((1, 32), np.int32)
        toks[0, :len(seq)] = seq
        lp = sampling_logprobs(_forward(params, jnp.asarray(toks), cfg)[0, len(p) - 1:len(seq) - 1], 1.0, 0, 1.0)
        np.testing.assert_allclose(ends[i].logprobs, [lp[j, t] for j, t in enumerate(ends[i].tokens)], atol=1e-4)


@pytest.mark.slow
def test_a_turn_records_the_version_of_its_prefill(setup):
    """The first token of a turn is sampled from the prefill's logits: adapters swapped between the prefill and
    the first decode step (the learner publishing meanwhile) leave the turn with both versions, the oldest first,
    so staleness counts from the version that really sampled its first token."""
    from nemo_jax.generate import Engine
    from nemo_jax.lora import LoraConfig, init_adapters

    cfg, params = setup
    eng = Engine(params, cfg, batch=1, max_len=32, bucket=8, check_every=4)
    ad = init_adapters(cfg, LoraConfig(("attention",), 2, 4.0), jax.random.key(3))
    eng.set_adapters(ad, 3)
    admit = eng._admit

    def admit_then_publish():  # the prefill runs with version 3; version 4 lands before the first decode step
        admit()
        eng.set_adapters(ad, 4)
    eng._admit = admit_then_publish
    eng.submit(PROMPTS[0], SamplingParams(max_new_tokens=3, temperature=0.0))
    ends = eng.step()
    assert len(ends) == 1 and ends[0].versions == (3, 4) and ends[0].version == 3


@pytest.mark.slow
def test_engine_parks_finished_turns_and_swaps_adapters(setup):
    """A parked sequence decodes nothing while the other row keeps decoding; fed, it continues in place with the
    adapters set meanwhile (its turn records their version) and equals `generate` on the whole conversation;
    released mid-turn, a row stops at once and takes the next sequence."""
    from nemo_jax.generate import Engine
    from nemo_jax.lora import LoraConfig, init_adapters

    cfg, params = setup
    greedy = lambda n: SamplingParams(max_new_tokens=n, temperature=0.0)  # noqa: E731
    eng = Engine(params, cfg, batch=2, max_len=48, bucket=8, check_every=2)
    a = eng.submit(PROMPTS[0], greedy(2))
    b = eng.submit(PROMPTS[1], greedy(12))
    first = eng.step()  # both prefilled, two steps: a's turn is over
    assert [e.seq_id for e in first] == [a] and eng.parked == 1 and eng.busy == 1
    steps = eng.decode_steps
    while True:
        ends = eng.step()
        if ends:
            break
    assert [e.seq_id for e in ends] == [b] and eng.decode_steps == steps + 10 and eng.parked == 2
    assert ends[0].tokens == generate(params, [PROMPTS[1]], cfg, greedy(12)).tokens[0]
    ad = init_adapters(cfg, LoraConfig(("attention",), 2, 4.0), jax.random.key(3))
    ad = jax.tree.map(lambda x: x + 0.3 * jax.random.normal(jax.random.key(4), x.shape, x.dtype), ad)
    eng.set_adapters(ad, 7)
    eng.feed(a, [9, 9, 9])
    with pytest.raises(ValueError, match="not parked"):
        eng.feed(a, [1])
    nxt = []
    while not nxt:
        nxt = eng.step()
    whole = PROMPTS[0] + first[0].tokens + [9, 9, 9]
    assert nxt[0].seq_id == a and nxt[0].version == 7 and nxt[0].versions == (7,)
    assert nxt[0].tokens == generate(params, [whole], cfg, greedy(2), adapters=ad).tokens[0]
    eng.feed(b, [3])
    eng.step()
    eng.release(b)  # mid-turn
    c = eng.submit([6, 6], greedy(2))
    ends = []
    while not ends:
        ends = eng.step()
    assert [e.seq_id for e in ends] == [c] and eng.rows.count(None) == 0  # a parked, c in b's old row
    assert ends[0].tokens == generate(params, [[6, 6]], cfg, greedy(2), adapters=ad).tokens[0]
    # rows with their own budgets: a short prompt with a long turn cannot share a chunk as wide as a long prompt's
    # (32 + 20 > 48 positions): it waits for the next step instead of overrunning its row
    eng.release(a)
    eng.release(c)
    long_id, short_id = eng.submit([5] * 30, greedy(4)), eng.submit([6, 6], greedy(20))
    got = {}
    while len(got) < 2:
        got.update({e.seq_id: e.tokens for e in eng.step()})
    assert got[long_id] == generate(params, [[5] * 30], cfg, greedy(4), adapters=ad).tokens[0]
    assert got[short_id] == generate(params, [[6, 6]], cfg, greedy(20), adapters=ad).tokens[0]
    with pytest.raises(ValueError, match="no vision tower"):
        eng.submit([1, 2], greedy(2), images=[np.zeros((8, 8, 3), np.uint8)])


# --------------------------------------------------------------------------- sampling inside the decode step
def _np_processed(logits, sp, prompt, turn):
    """vLLM's order on one row's fixed logits, in numpy: logit_bias, min_tokens (stop ids at -inf), repetition
    (prompt or turn tokens), frequency and presence penalties."""
    x = np.array(logits, np.float64)
    for t, b in sp.logit_bias:
        x[t] += b
    if len(turn) < sp.min_tokens:
        x[list(sp.stop_token_ids)] = -np.inf
    counts = np.bincount(np.asarray(turn, np.int64), minlength=len(x))
    rep = np.where(np.isin(np.arange(len(x)), prompt) | (counts > 0), sp.repetition_penalty, 1.0)
    x = np.where(x > 0, x / rep, x * rep)
    return x - sp.frequency_penalty * counts - sp.presence_penalty * (counts > 0)


def _np_logprobs(x, sp):
    """log softmax(x / T) over the top-k / top-p set (greedy: untempered, untruncated), numpy."""
    x = np.array(x, np.float64)
    if sp.temperature > 0:
        x = x / sp.temperature
        if sp.top_k:
            x[x < np.sort(x)[-sp.top_k]] = -np.inf
        if sp.top_p < 1:
            order = np.argsort(-x, kind="stable")
            p = np.exp(x[order] - x[order].max())
            p /= p.sum()
            drop = order[(np.cumsum(p) - p) >= sp.top_p]
            x[drop] = -np.inf
    m = x[np.isfinite(x)].max()
    return x - (m + np.log(np.exp(x[np.isfinite(x)] - m).sum()))


def _rows_for(sps, prompts, turns, V):
    """`Engine._upload_rows`'s per-row arrays and running arrays for rows with these parameters, in numpy."""
    from nemo_jax.generate import RowSampling

    b = len(sps)
    S = max(1, max(len(sp.stop_token_ids) for sp in sps))
    B = max(1, max(len(sp.logit_bias) for sp in sps))
    rows = dict(temperature=np.asarray([sp.temperature for sp in sps], np.float32),
                top_k=np.asarray([sp.top_k if sp.temperature > 0 else 0 for sp in sps], np.int32),
                top_p=np.asarray([sp.top_p if sp.temperature > 0 else 1.0 for sp in sps], np.float32),
                stops=np.full((b, S), -1, np.int32), count=np.asarray([10 + len(t) for t in turns], np.int32),
                turn0=np.full(b, 10, np.int32), min_tokens=np.asarray([sp.min_tokens for sp in sps], np.int32),
                bias_ids=np.full((b, B), V, np.int32), bias=np.zeros((b, B), np.float32),
                presence=np.asarray([sp.presence_penalty for sp in sps], np.float32),
                frequency=np.asarray([sp.frequency_penalty for sp in sps], np.float32),
                repetition=np.asarray([sp.repetition_penalty for sp in sps], np.float32))
    counts, seen = np.zeros((b, V), np.int32), np.zeros((b, V), bool)
    for i, sp in enumerate(sps):
        rows["stops"][i, :len(sp.stop_token_ids)] = sp.stop_token_ids
        for j, (t, x) in enumerate(sp.logit_bias):
            rows["bias_ids"][i, j], rows["bias"][i, j] = t, x
        np.add.at(counts[i], turns[i], 1)
        seen[i, prompts[i]] = True
    k = max(int(rows["top_k"].max()), 0)
    how = RowSampling(k_max=k, nucleus=bool((rows["top_p"] < 1).any()), adjust=True, top_n=8)
    return {n: jnp.asarray(x) for n, x in rows.items()}, {"counts": jnp.asarray(counts), "seen": jnp.asarray(seen)}, how


def test_penalties_bias_min_tokens_and_top_logprobs_equal_numpy_on_fixed_logits():
    """`sample_step` on fixed logits: the processed logits (logit_bias, min_tokens, repetition / frequency /
    presence penalties, in vLLM's order), the drawn token's logprob and the top alternatives equal a numpy
    reference row by row; greedy rows take the processed argmax; the turn's counts grow by the sampled token."""
    from nemo_jax.generate import process_logits, sample_step

    V = 40
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(5, V)).astype(np.float32) * 3
    sps = [SamplingParams(temperature=0.0, repetition_penalty=1.7, stop_token_ids=(3, 5), min_tokens=4),
           SamplingParams(temperature=0.8, frequency_penalty=0.9, presence_penalty=0.4, logit_bias=((7, 5.0),)),
           SamplingParams(temperature=1.2, top_k=6, repetition_penalty=0.6, logit_bias=((1, -100.0), (2, 3.0))),
           SamplingParams(temperature=0.9, top_p=0.7, presence_penalty=-1.0, stop_token_ids=(9,), min_tokens=1),
           SamplingParams(temperature=0.0)]  # (no extras: untouched logits)
    prompts = [[1, 2, 3, 30], [5, 6], [7, 8, 9, 10, 11], [0], [4]]
    turns = [[4, 4, 30], [7, 7, 7, 12], [2, 19], [8], [5, 5]]
    rows, hist, how = _rows_for(sps, prompts, turns, V)
    x = np.asarray(process_logits(jnp.asarray(logits), {**rows, **hist}, how))
    for i, sp in enumerate(sps):
        np.testing.assert_allclose(x[i], _np_processed(logits[i], sp, prompts[i], turns[i]), rtol=1e-5, atol=1e-5)
    assert np.isneginf(x[0, [3, 5]]).all() and np.isfinite(x[3, 9])  # (row 3 has its one token already)
    u = jnp.asarray(rng.uniform(size=5).astype(np.float32))
    active = jnp.asarray([True, True, True, True, False])
    tok, lp, hit, new, (ids, vals) = jax.jit(sample_step, static_argnames="how")(
        jnp.asarray(logits), u, rows, hist, {}, active, how=how)
    tok, lp, ids, vals = (np.asarray(a) for a in (tok, lp, ids, vals))
    for i, sp in enumerate(sps):
        want = _np_logprobs(x[i], sp)
        if sp.temperature == 0:
            assert tok[i] == np.argmax(x[i])
        assert np.isfinite(want[tok[i]]) and lp[i] == pytest.approx(want[tok[i]], abs=1e-4)
        order = np.argsort(-want, kind="stable")[:8]
        np.testing.assert_allclose(vals[i], want[order], atol=1e-4)
        assert set(ids[i][np.isfinite(vals[i])]) == set(order[np.isfinite(want[order])])
    counts = np.asarray(new["counts"])
    for i in range(5):
        grew = np.asarray(hist["counts"][i]).copy()
        grew[tok[i]] += i < 4  # (inactive rows count nothing)
        np.testing.assert_array_equal(counts[i], grew)
    assert not np.asarray(hit).any()


def test_stop_strings_match_across_token_boundaries_like_a_text_search():
    """`stop_string_hits` step by step over random token sequences (tokens of 0 to 5 bytes, multi-byte UTF-8
    split across tokens) equals a plain search of the decoded bytes: a row is hit at the first token whose bytes
    complete any of its stop strings, wherever the string starts."""
    from nemo_jax.generate import stop_string_hits, token_table

    rng = np.random.default_rng(1)
    alphabet = list(b"ab \n") + list("é".encode())
    vocab = [bytes(rng.choice(alphabet, size=rng.integers(0, 6)).tolist()) for _ in range(60)] + [b"\xc3", b"\xa9"]
    tb, tl = token_table(vocab, len(vocab))
    b, steps, W = 16, 12, 8
    stops = [[bytes(rng.choice(alphabet, size=rng.integers(1, 5)).tolist()) for _ in range(rng.integers(0, 3))]
             for _ in range(b)]
    stops[0] = ["é".encode(), b"b\n"]  # (a two-byte character, which tokens 60 and 61 spell one byte each)
    sb, sl = np.full((b, 2, W), -1, np.int32), np.zeros((b, 2), np.int32)
    for r, xs in enumerate(stops):
        for j, x in enumerate(xs):
            sb[r, j, W - len(x):] = np.frombuffer(x, np.uint8)
            sl[r, j] = len(x)
    toks = rng.integers(0, len(vocab), size=(steps, b))
    toks[3:5, 0] = [60, 61]
    tail = jnp.full((b, 16), -1, jnp.int32)
    fn = jax.jit(stop_string_hits)
    text = [b""] * b
    for i in range(steps):
        t = jnp.asarray(toks[i])
        hit, tail = fn(tail, jnp.asarray(tb)[t], jnp.asarray(tl)[t], jnp.asarray(sb), jnp.asarray(sl))
        for r in range(b):
            before, text[r] = text[r], text[r] + vocab[toks[i, r]]
            want = any(text[r].find(x, max(0, len(before) - len(x) + 1)) >= 0 for x in stops[r])
            assert bool(hit[r]) == want, (i, r, text[r], stops[r])
        np.testing.assert_array_equal(np.asarray(tail[:, -1])[[r for r in range(b) if text[r]]],
                                      [text[r][-1] for r in range(b) if text[r]])
    assert bool(np.asarray(fn(jnp.full((1, 16), -1, jnp.int32), jnp.asarray(tb)[jnp.asarray([60])],
                                 jnp.asarray(tl)[jnp.asarray([60])], jnp.asarray(sb[:1]), jnp.asarray(sl[:1]))[0])[0]) \
        is False  # half of é is not é


def test_engine_samples_penalties_stop_strings_min_tokens_and_top_logprobs_in_its_step(setup):
    """The Engine with the extras on, rows of different kinds in one batch: greedy rows with penalties and a
    logit bias equal a greedy re-derivation from full forwards with the numpy processing; a stop string spanning
    two tokens ends its turn at the token that completes it (finish "stop", `TurnEnd.stop`); min_tokens holds off
    a stop id; top_logprobs are the distribution's most likely tokens (a full forward); a plain row in the same
    batch samples what it samples alone."""
    from nemo_jax.generate import Engine

    cfg, params = setup
    vocab = [b"%d " % i for i in range(cfg.vocab_size)]
    greedy = lambda **kw: SamplingParams(max_new_tokens=8, temperature=0.0, **kw)  # noqa: E731
    plain = generate(params, [PROMPTS[1]], cfg, greedy()).tokens[0]
    text = b"".join(vocab[t] for t in plain).decode()
    cut = len(str(plain[0])) + 2  # from the last digit of the first token into the second: "4 1" of "44 17 "
    stop = text[cut - 2:cut + 1]
    first = next(j for j in range(len(plain)) if stop in "".join(f"{t} " for t in plain[:j + 1]))
    sps = [greedy(repetition_penalty=1.8, frequency_penalty=0.5, presence_penalty=0.3, logit_bias=((7, 2.0),)),
           greedy(stop=(stop, "never")),
           greedy(stop_token_ids=(plain[0],), min_tokens=3),
           SamplingParams(max_new_tokens=8, temperature=0.9, top_k=10, seed=4, top_logprobs=3),
           greedy()]
    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[1], PROMPTS[2], PROMPTS[2]]
    eng = Engine(params, cfg, batch=5, max_len=40, bucket=8, check_every=3, token_bytes=vocab)
    ids = [eng.submit(p, sp, tag=i) for i, (p, sp) in enumerate(zip(prompts, sps))]
    ends = {}
    while len(ends) < 5:
        for e in eng.step():
            ends[e.tag] = e
            eng.release(e.seq_id)
    assert [ends[i].seq_id for i in range(5)] == ids

    def full(seq):
        toks = np.zeros((1, 32), np.int32)
        toks[0, :len(seq)] = seq
        return np.asarray(_forward(params, jnp.asarray(toks), cfg)[0, len(seq) - 1])
    def greedy_ref(prompt, sp):  # greedy on the numpy-processed logits of a full forward, to a stop id or the budget
        seq, turn = list(prompt), []
        while len(turn) < sp.max_new_tokens and not (turn and turn[-1] in sp.stop_token_ids):
            t = int(np.argmax(_np_processed(full(seq), sp, prompt, turn)))
            seq.append(t)
            turn.append(t)
        return turn
    assert ends[0].tokens == greedy_ref(prompts[0], sps[0])
    assert ends[1].tokens == plain[:first + 1] and ends[1].finish_reason == "stop" and ends[1].stop == stop
    assert ends[2].tokens == greedy_ref(prompts[2], sps[2]) and plain[0] not in ends[2].tokens[:3]
    e = ends[3]
    assert len(e.top) == len(e.tokens)
    for j, t in enumerate(e.tokens):
        want = _np_logprobs(full(list(prompts[3]) + e.tokens[:j]), sps[3])
        got = e.top[j]
        assert [a for a, _ in got] == list(np.argsort(-want, kind="stable")[:3])
        np.testing.assert_allclose([v for _, v in got], np.sort(want)[::-1][:3], atol=1e-4)
        assert e.logprobs[j] == pytest.approx(want[t], abs=1e-4)
    assert ends[4].tokens == generate(params, [PROMPTS[2]], cfg, greedy()).tokens[0]
    with pytest.raises(ValueError, match="token_bytes"):
        Engine(params, cfg, batch=1, max_len=40).submit([1], greedy(stop=("x",)))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        eng.submit([1], greedy(logit_bias=((cfg.vocab_size, 1.0),)))
    with pytest.raises(ValueError, match="sampled by the Engine"):
        generate(params, [[1]], cfg, greedy(min_tokens=1))


@pytest.mark.slow
def test_fused_decode_steps_equal_one_dispatch_per_step(setup):
    """The Engine's fast path (check_every decode steps in one program, stops on the device, early exit) samples
    exactly what its reference (a dispatch per step) samples: the same tokens, finish reasons and alternatives,
    logprobs to float rounding; seeded sampling, greedy, a stop id, top-k / top-p with top logprobs, and a
    budget that ends mid-dispatch, in one batch refilled as rows finish. Its program aliases the whole state."""
    from nemo_jax.generate import Engine

    cfg, params = setup
    sps = [SamplingParams(max_new_tokens=7, temperature=0.0),
           SamplingParams(max_new_tokens=9, temperature=0.9, seed=3),
           SamplingParams(max_new_tokens=6, temperature=1.1, top_k=5, top_p=0.8, seed=7, top_logprobs=2),
           SamplingParams(max_new_tokens=8, temperature=1.0, seed=11, stop_token_ids=(5, 9))]
    prompts = PROMPTS + [[3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5]]
    got = []
    for fused in (True, False):
        eng = Engine(params, cfg, batch=3, max_len=48, bucket=8, check_every=4, fused=fused)
        ends = {}
        for i, (p, sp) in enumerate(zip(prompts, sps)):
            eng.submit(p, sp, tag=i)
        while len(ends) < len(sps):
            for e in eng.step():
                ends[e.tag] = e
                eng.release(e.seq_id)
        got.append(ends)
    for i in range(len(sps)):
        a, b = got[0][i], got[1][i]
        assert a.tokens == b.tokens and a.finish_reason == b.finish_reason, i
        np.testing.assert_allclose(a.logprobs, b.logprobs, rtol=1e-5, atol=1e-5)
        if sps[i].top_logprobs:
            assert [[t for t, _ in x] for x in a.top] == [[t for t, _ in x] for x in b.top]
            np.testing.assert_allclose([[v for _, v in x] for x in a.top], [[v for _, v in x] for x in b.top],
                                       rtol=1e-5, atol=1e-5)
    # the fast path's program updates the whole decode state in place (held one layer at a time: no stack copied)
    from nemo_jax.generate import decode_program

    lowered, sizes = decode_program(params, cfg, rows=3, max_len=48, steps=4)
    assert lowered.compile().memory_analysis().alias_size_in_bytes >= sizes["state"]
