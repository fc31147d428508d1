"""Generation and loading at scale: prefill memory (lm_head at the last position, cached attention in query
blocks), a donated and batch-sharded decode state, params-only restore from run dirs, HF loading onto a mesh
that reads each byte about once."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from nemo_jax import model as M
from nemo_jax.generate import (SamplingParams, append, continuous_generate, generate, load_for_generation,
                               prefill)
from nemo_jax.generate.decode import _append, _decode_and_sample
from nemo_jax.model.attention import BLOCK
from nemo_jax.model.cache import init_decode_state, state_shapes
from nemo_jax.model.spec import param_specs
from nemo_jax.parallel.mesh import make_mesh
from nemo_jax.parallel.rules import param_shardings

from helpers import tiny_cfg

PROMPTS = [[5, 17, 3, 44, 9, 1, 2], [8, 2], [60, 61, 62, 63, 64], [3], [9, 9, 9, 9], [1, 2, 3], [40, 41], [7]]


@pytest.fixture(scope="module")
def small():
    cfg = tiny_cfg("M*E", n_group=2, topk_group=1, chunk_size=4)
    return cfg, M.init(cfg, jax.random.key(0))


def _nbytes(tree) -> int:
    return sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


# --------------------------------------------------------------------------- prefill memory
def _prefill_temp(cfg, params, L: int, positions, impl: str) -> int:
    """Bytes of temporaries and returned logits of a prefill of L tokens on an empty state."""
    opts = M.Options(attention=impl)
    state = state_shapes(cfg, 1, L)
    toks = jax.ShapeDtypeStruct((1, L), jnp.int32)
    valid = jax.ShapeDtypeStruct((1, L), jnp.bool_)
    f = lambda p, t, v, s: M.forward_cached(p, t, v, s, cfg, opts=opts, positions=positions)
    m = jax.jit(f).lower(params, toks, valid, state).compile().memory_analysis()
    return m.temp_size_in_bytes + m.output_size_in_bytes - _nbytes(state)  # temporaries + the logits returned


def test_prefill_temporaries_linear_and_bounded():
    cfg = tiny_cfg("M*-", vocab_size=65536, num_attention_heads=4, num_key_value_heads=2)
    params = jax.eval_shape(lambda: M.init(cfg, jax.random.key(0)))
    nh = cfg.num_attention_heads
    widest = max(cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads * cfg.head_dim,
                 2 * cfg.mamba_num_heads * cfg.mamba_head_dim + 2 * cfg.n_groups * cfg.ssm_state_size
                 + cfg.mamba_num_heads)
    temps = {}
    for L in (512, 2048):
        temps[L] = _prefill_temp(cfg, params, L, "last", "blocked")
        budget = cfg.vocab_size * 4 + nh * BLOCK * L * 4 + 4 * L * widest * 4  # last logits + 1 block + acts
        assert temps[L] < 2 * budget, (L, temps[L], budget)
    assert temps[2048] <= 4.4 * temps[512], temps  # at most linear in L
    ref = _prefill_temp(cfg, params, 2048, None, "full")  # the reference path returns [L, V], holds [L, L]
    assert ref > 8 * temps[2048], (ref, temps[2048])


@pytest.mark.slow
def test_blocked_last_and_positions_equal_reference():
    cfg = tiny_cfg("M*", chunk_size=16)
    params = M.init(cfg, jax.random.key(1))
    L = BLOCK + 77  # two query blocks, the second partial
    rows = [list(np.random.default_rng(0).integers(1, cfg.vocab_size, L)), [4, 5, 6]]
    from nemo_jax.generate import left_pad

    toks, valid = left_pad(rows)
    full, _ = M.forward_cached(params, toks, valid, init_decode_state(cfg, 2, L + 4), cfg,
                               opts=M.Options(attention="full"))
    last, _ = M.forward_cached(params, toks, valid, init_decode_state(cfg, 2, L + 4), cfg, positions="last")
    np.testing.assert_allclose(last[:, 0], full[:, -1], rtol=2e-5, atol=2e-5)
    at = jnp.asarray([[0, 100, L - 1], [L - 3, L - 2, L - 1]])
    some, _ = M.forward_cached(params, toks, valid, init_decode_state(cfg, 2, L + 4), cfg, positions=at)
    np.testing.assert_allclose(some, jnp.take_along_axis(full, at[..., None], axis=1), rtol=2e-5, atol=2e-5)
    # the public API takes positions within each row's own tokens: score a given continuation
    lg, _ = prefill(params, rows, cfg, L + 4, positions=[[L - 2, L - 1], [1, 2]])
    np.testing.assert_allclose(lg[1], full[1, [L - 2, L - 1]], rtol=2e-5, atol=2e-5)


# --------------------------------------------------------------------------- donated, sharded state
def test_decode_step_writes_the_cache_in_place(small):
    """A decode step reads the KV cache as stored and writes its new entries into the donated stack: no copy of
    a cache-sized buffer, no dynamic-update-slice rebuilding it (the earlier form copied it 3 times per step)."""
    cfg, params = small
    state = init_decode_state(cfg, 4, 96)
    c = _decode_and_sample.lower(params, jnp.zeros((4, cfg.vocab_size)), state, jnp.zeros((4,), bool),
                                 jax.random.key(0), cfg, M.Options(), SamplingParams(temperature=0.0)).compile()
    shape = ",".join(map(str, state.kv.k.shape[1:]))  # [b, S, nkv, hd] of one layer, or the whole stack
    hits = [ln for ln in c.as_text().splitlines() if shape in ln.split("=")[-1].split("(")[0]
            and any(op in ln for op in (" copy(", " dynamic-update-slice("))]
    assert not hits, hits[:4]


@pytest.mark.slow
def test_rows_keep_their_own_positions(small):
    """Rows append at their own positions: a row given nothing keeps its position and slots, a row refilled
    from position 0 beside others gives the logits of that row alone."""
    cfg, params = small
    lg, st = prefill(params, [[5, 17, 3], [8, 2, 9, 9, 1]], cfg, 16)
    assert st.pos.tolist() == [5, 5]  # one left-padded chunk of 5
    lg2, st = append(params, st, [[], [4, 4]], cfg)
    assert st.pos.tolist() == [5, 7]
    alone, _ = prefill(params, [[8, 2, 9, 9, 1, 4, 4]], cfg, 16)
    np.testing.assert_allclose(lg2[1], alone[0], rtol=2e-5, atol=2e-5)
    lg3, st = append(params, st, [[6], [7]], cfg)
    alone0, _ = prefill(params, [[5, 17, 3, 6]], cfg, 16)
    alone1, _ = prefill(params, [[8, 2, 9, 9, 1, 4, 4, 7]], cfg, 16)
    np.testing.assert_allclose(lg3, jnp.concatenate([alone0, alone1]), rtol=2e-5, atol=2e-5)
    assert st.pos.tolist() == [6, 8]


def test_decode_steps_alias_the_whole_state(small):
    cfg, params = small
    state = init_decode_state(cfg, 4, 32)
    logits = jnp.zeros((4, cfg.vocab_size))
    done = jnp.zeros((4,), bool)
    sp = SamplingParams(temperature=0.0)
    c = _decode_and_sample.lower(params, logits, state, done, jax.random.key(0), cfg, M.Options(), sp).compile()
    assert c.memory_analysis().alias_size_in_bytes == _nbytes(state)
    t = jnp.zeros((4, 3), jnp.int32)
    c2 = _append.lower(params, t, jnp.ones((4, 3), bool), state, cfg, M.Options()).compile()
    assert c2.memory_analysis().alias_size_in_bytes == _nbytes(state)
    # and the buffers are really consumed: the caller's state is gone after append
    _, new = append(params, state, [[1], [2], [3], [4]], cfg)
    assert state.valid.is_deleted() and new.pos.tolist() == [1, 1, 1, 1]


@pytest.fixture(scope="module")
def fsdp8(small):
    cfg, params = small
    mesh = make_mesh({"fsdp": 8})
    return mesh, jax.device_put(params, param_shardings(param_specs(cfg), mesh))


def test_state_sharded_per_device_and_flops_split(small, fsdp8):
    cfg, params = small
    mesh, sharded = fsdp8
    state = init_decode_state(cfg, 8, 64, mesh=mesh)
    dev0 = jax.devices()[0]
    on0 = sum(s.data.nbytes for x in jax.tree.leaves(state) for s in x.addressable_shards if s.device == dev0)
    total = _nbytes(state)
    assert on0 == total // 8  # every leaf split 8 ways (`pos` too: one position per row)
    toks, valid = jnp.zeros((8, 1), jnp.int32), jnp.ones((8, 1), bool)
    one = _append.lower(params, toks, valid, init_decode_state(cfg, 8, 64), cfg, M.Options()).compile()
    par = _append.lower(sharded, toks, valid, state, cfg, M.Options(), mesh).compile()
    f1 = one.cost_analysis()["flops"]
    f8 = par.cost_analysis()["flops"]  # per device
    assert 8 * f8 <= 1.2 * f1, (f8, f1)
    assert par.memory_analysis().alias_size_in_bytes == on0
    _, out = _append(sharded, toks, valid, state, cfg, M.Options(), mesh)
    for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(init_decode_state(cfg, 8, 64, mesh=mesh))):
        assert a.sharding.is_equivalent_to(b.sharding, a.ndim)


@pytest.mark.slow
def test_generation_parity_on_a_mesh(small, fsdp8):
    cfg, params = small
    _, sharded = fsdp8
    sp = SamplingParams(max_new_tokens=4, temperature=0.7)
    g1 = generate(params, PROMPTS, cfg, sp, key=jax.random.key(2), max_len=24)
    g8 = generate(sharded, PROMPTS, cfg, sp, key=jax.random.key(2), max_len=24)
    assert g1.tokens == g8.tokens
    np.testing.assert_allclose(np.asarray(g1.logprobs), np.asarray(g8.logprobs), atol=1e-5)
    assert g8.state.kv.k.sharding.spec[1] == "fsdp"
    more = [[7, 7], [9], [], [1], [2], [3], [4], [5]]
    a1, _ = append(params, g1.state, more, cfg)
    a8, s8 = append(sharded, g8.state, more, cfg)
    np.testing.assert_allclose(a1, a8, rtol=1e-4, atol=1e-4)
    assert s8.valid.sharding.spec[0] == "fsdp"


@pytest.mark.slow
def test_continuous_batching_on_a_mesh(small, fsdp8):
    """Continuous batching on sharded params (the state's rows and positions over `fsdp`; refills and
    continuations gathered, run and scattered back in place) gives the single-device turns."""
    cfg, params = small
    _, sharded = fsdp8
    sp = SamplingParams(max_new_tokens=3, temperature=0.0)
    prompts = PROMPTS + [[2, 3, 4], [6]]  # 10 sequences through 8 rows: two refills
    more = lambda i, turns: [7, 7] if i % 3 == 0 and len(turns) == 1 else None  # noqa: E731
    # max_len 16: a 2-token prompt's continuation fits its row, a 7-token one's is re-prefilled whole
    run = lambda p: sorted((f.index, f.turns) for f in continuous_generate(  # noqa: E731
        p, prompts, cfg, sp, batch=8, max_len=16, next_turn=more, bucket=4))
    one, eight = run(params), run(sharded)
    assert [(i, [(t, r) for t, _, r in x]) for i, x in one] == [(i, [(t, r) for t, _, r in x]) for i, x in eight]
    assert [len(x) for _, x in one] == [2 if i % 3 == 0 else 1 for i in range(len(prompts))]
    for (_, x1), (_, x8) in zip(one, eight):
        for a, b in zip(x1, x8):
            np.testing.assert_allclose(a[1], b[1], atol=1e-5)


# --------------------------------------------------------------------------- loading
def test_run_dir_restores_params_only(tmp_path, small, monkeypatch):
    import orbax.checkpoint as ocp

    from nemo_jax.train.checkpoint import RunCheckpointer

    cfg, params = small
    opt = {"mu": jax.tree.map(jnp.ones_like, params), "nu": jax.tree.map(jnp.ones_like, params)}
    state = {"params": params, "opt_state": opt, "step": jnp.int32(3), "rng": jnp.zeros((2,), jnp.uint32)}
    ck = RunCheckpointer(str(tmp_path / "run" / "checkpoints"), async_save=False)
    ck.save(3, state, {"it": 0}, {"model_config": cfg.to_hf_dict(),
                                  "config": {"data": {"tokenizer": "tiny"}, "lora": {"targets": []}}})
    ck.close()
    names = []
    orig = ocp.type_handlers.ArrayHandler.deserialize

    async def spy(self, infos, args=None):
        names.extend(str(i.name) for i in infos)
        return await orig(self, infos, args)

    monkeypatch.setattr(ocp.type_handlers.ArrayHandler, "deserialize", spy)
    mesh = make_mesh({"fsdp": 8})
    got_cfg, got, _ = load_for_generation(str(tmp_path / "run"), mesh=mesh, dtype=jnp.bfloat16)
    assert names and not [n for n in names if "opt_state" in n or "mu" in n.split(".")], names[:5]
    assert got_cfg == cfg
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(params)):
        assert a.dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b.astype(jnp.bfloat16)))
    k = got["layers"]["attention"]["mixer"]["q_proj"]["kernel"]
    assert k.sharding.mesh.shape["fsdp"] == 8 and "fsdp" in str(k.sharding.spec)


def test_hf_load_onto_fsdp8_reads_each_byte_once(tmp_path, small, monkeypatch):
    from nemo_jax.hf import io as hf_io

    cfg, params = small
    hf_io.save_pretrained(cfg, params, str(tmp_path / "hf"))
    total = sum(int(np.prod(shape)) * hf_io.ST_DTYPES[dt].itemsize  # the checkpoint's tensor bytes
                for _, shape, dt in hf_io.HFReader(str(tmp_path / "hf")).tensors.values())
    _, one = hf_io.load_pretrained(str(tmp_path / "hf"))
    read = [0]
    orig = hf_io.HFReader.read

    def counting(self, name, slices=()):
        _, shape, dt = self.tensors[name]
        rows = len(range(*slices[0].indices(shape[0]))) if shape and slices else (shape[0] if shape else 1)
        read[0] += rows * int(np.prod(shape[1:])) * hf_io.ST_DTYPES[dt].itemsize
        return orig(self, name, slices)

    monkeypatch.setattr(hf_io.HFReader, "read", counting)
    mesh = make_mesh({"fsdp": 8})
    _, eight = hf_io.load_pretrained(str(tmp_path / "hf"), mesh=mesh)
    assert total <= read[0] <= 1.2 * total, (read[0], total)
    q = eight["layers"]["attention"]["mixer"]["q_proj"]["kernel"]
    assert "fsdp" in str(q.sharding.spec)
    for a, b in zip(jax.tree.leaves(one), jax.tree.leaves(eight)):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_lora_run_dir_loads_base_and_merges_adapters(tmp_path, small):
    from nemo_jax.checkpoint import save_model
    from nemo_jax.lora import LoraConfig, adapter_specs, merge_adapters, save_adapter_checkpoint
    from nemo_jax.model.spec import ParamSpec

    cfg, params = small
    save_model(str(tmp_path / "base"), cfg, params)
    lc = LoraConfig(targets=("attention",), rank=2)
    specs = adapter_specs(cfg, lc)
    rng = np.random.default_rng(0)
    adapters = jax.tree.map(lambda s: jnp.asarray(rng.normal(size=s.shape).astype(np.float32) * 0.1), specs,
                            is_leaf=lambda x: isinstance(x, ParamSpec))
    run = tmp_path / "run"
    save_adapter_checkpoint(str(run / "adapters"), cfg, lc, adapters)
    os.makedirs(run / "checkpoints" / "5" / "meta")
    meta = {"model_config": cfg.to_hf_dict(), "config": {"data": {"tokenizer": "tiny"},
                                                         "model": {"init": str(tmp_path / "base")},
                                                         "lora": {"targets": ["attention"]}}}
    with open(run / "checkpoints" / "5" / "meta" / "metadata", "w") as f:
        json.dump(meta, f)
    _, got, _ = load_for_generation(str(run))
    want = merge_adapters(params, adapters)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-6)
    q = "layers", "attention", "mixer", "q_proj", "kernel"
    assert not np.allclose(got[q[0]][q[1]][q[2]][q[3]][q[4]], params[q[0]][q[1]][q[2]][q[3]][q[4]])
    meta["config"]["model"]["init"] = "random"
    with open(run / "checkpoints" / "5" / "meta" / "metadata", "w") as f:
        json.dump(meta, f)
    with pytest.raises(FileNotFoundError, match="adapters only"):
        load_for_generation(str(run))
