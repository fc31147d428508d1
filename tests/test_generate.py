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
    from nemo_jax import generate as G

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
    a, _ = M.forward(attach(params, adapters), toks, cfg)
    b, _ = M.forward(merged, toks, cfg)
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

    logits = jax.random.normal(jax.random.key(0), (5, 97)) * 3
    rows = [(0.0, 0, 1.0), (0.7, 0, 1.0), (1.0, 3, 1.0), (0.9, 0, 0.6), (1.3, 5, 0.8)]
    t, k, p = (jnp.asarray(x) for x in zip(*rows))
    got = row_sampling_logprobs(logits, t, k.astype(jnp.int32), p, k_max=8, nucleus=True)
    for i, (ti, ki, pi) in enumerate(rows):
        want = sampling_logprobs(logits[i], ti if ti > 0 else 1.0, ki, pi)
        np.testing.assert_allclose(got[i], want, rtol=1e-6, atol=1e-6)
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
