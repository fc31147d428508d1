"""Checkpoint merging: tensor ops against numpy formulas, rule-driven streaming vs in-memory merges (bit for
bit), dtypes, QK-restore, LoRA-delta merge vs the unmerged forward, recipe errors that write nothing."""

import json
import os
import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from helpers import tiny_cfg
from safetensors import safe_open

from nemo_jax.checkpoint import save_model
from nemo_jax.cli import main
from nemo_jax.hf.io import save_pretrained
from nemo_jax.model.spec import unflatten_paths
from nemo_jax.hf.mapping import build_table, leaf_specs
from nemo_jax.merge import (RecipeError, linear, load_recipe, lora, merge_params, ops, parse_recipe, run_recipe, slerp,
                            task_arithmetic, ties, tree_dare, tree_linear, tree_slerp, tree_task_arithmetic, tree_ties)

BF16 = np.dtype(ml_dtypes.bfloat16)
CONFIGS = os.path.join(os.path.dirname(__file__), "..", "configs", "merge")


def rand_params(cfg, seed, dtype=BF16):
    """Random numpy params: `dtype` everywhere except the fp32 router correction bias (as real checkpoints)."""
    rng = np.random.default_rng(seed)
    flat = {p: (0.1 * rng.standard_normal(s.shape)).astype(np.float32 if p.endswith("correction_bias") else dtype)
            for p, s in leaf_specs(cfg).items()}
    return unflatten_paths(flat)


def hf_tensors(path):
    out = {}
    for f in os.listdir(path):
        if f.endswith(".safetensors"):
            with safe_open(os.path.join(path, f), "np") as h:
                out.update({k: h.get_tensor(k) for k in h.keys()})
    return out


def leaves_by_hf(cfg, params):
    from nemo_jax.hf.mapping import hf_rows_from_ours
    from nemo_jax.model.spec import flatten_with_paths

    flat = flatten_with_paths(params)
    host = {k: np.asarray(v) for k, v in flat.items()}
    return {e.hf_name: hf_rows_from_ours(e, lambda reg, x=host[e.path]: x[reg], host[e.path].shape[len(e.index):])
            for e in build_table(cfg)}


# --------------------------------------------------------------------------- ops vs numpy formulas
def test_fast_bf16_conversions_equal_ml_dtypes_casts():
    """ops.f32 / ops.round_to (bit-pattern widening and round-to-nearest-even) give ml_dtypes' casts bit for
    bit: normal values over the whole exponent range, ties, subnormals, overflow, infinities, NaNs."""
    rng = np.random.default_rng(7)
    x = (rng.standard_normal(50_000) * 10.0 ** rng.integers(-44, 39, 50_000)).astype(np.float32)
    ties_ = np.float32(1) + np.float32(2.0 ** -8) * np.arange(8, dtype=np.float32)  # exact halfway cases
    special = np.array([0x7F800000, 0xFF800000, 0x7FC00000, 0x7F800001, 0xFFFFFFFF, 0x00000001, 0x807FFFFF,
                        0x7F7FFFFF, 0x7F7F8000, 0x80000000], np.uint32).view(np.float32)
    x = np.concatenate([x, ties_, special, -ties_])
    with np.errstate(over="ignore", invalid="ignore"):
        want = x.astype(BF16)
    got = ops.round_to(x, BF16)
    assert got.dtype == BF16 and np.array_equal(got.view(np.uint16), want.view(np.uint16))
    assert np.array_equal(ops.f32(want).view(np.uint32), want.astype(np.float32).view(np.uint32))
    strided = want.reshape(2, -1)[:, ::3]  # any layout
    assert np.array_equal(ops.f32(strided).view(np.uint32), strided.astype(np.float32).view(np.uint32))
    with np.errstate(over="ignore"):
        assert ops.round_to(x, np.float16).dtype == np.float16 and ops.f32(x) is x  # other dtypes: plain casts
    y = ops.f32(want, copy=True)
    y += 1  # a fresh array: the input is untouched
    assert np.array_equal(ops.f32(want), want.astype(np.float32), equal_nan=True)


def test_ops_against_numpy_formulas():
    rng = np.random.default_rng(0)
    shapes = {"a": (5, 7), "b": {"c": (11,), "d": (3, 4, 6)}}
    mk = lambda: jax.tree.map(lambda s: rng.standard_normal(s).astype(np.float32), shapes, is_leaf=lambda x: isinstance(x, tuple))
    base, x1, x2 = mk(), mk(), mk()
    w = [0.7, -0.3]
    close = lambda got, want: jax.tree.map(lambda g, v: np.testing.assert_allclose(g, v, rtol=1e-5, atol=1e-6), got, want)
    close(tree_linear([x1, x2], w), jax.tree.map(lambda p, q: 0.7 * p - 0.3 * q, x1, x2))
    close(tree_task_arithmetic(base, [x1, x2], w), jax.tree.map(lambda b, p, q: b + 0.7 * (p - b) - 0.3 * (q - b), base, x1, x2))

    # TIES: top-k by magnitude (argsort), sign of the weighted sum, weighted mean of the agreeing entries
    def ties_ref(b, p, q, density=0.4):
        taus = []
        for x, wi in zip((p, q), w):
            t = (x - b).reshape(-1)
            keep = np.zeros(t.size, bool)
            keep[np.argsort(-np.abs(t))[: int(np.ceil(density * t.size))]] = True
            taus.append(wi * np.where(keep, t, 0).reshape(b.shape))
        s = np.sign(taus[0] + taus[1])
        agree = [(np.sign(t) == s) & (t != 0) for t in taus]
        num = sum(np.where(a, t, 0) for a, t in zip(agree, taus))
        den = sum(np.where(a, wi, 0) for a, wi in zip(agree, w))
        return b + np.where(den != 0, num / np.where(den != 0, den, 1), 0)

    close(tree_ties(base, [x1, x2], w, 0.4), jax.tree.map(ties_ref, base, x1, x2))
    np.testing.assert_allclose(ties(base["a"], [x1["a"]], [1.0], 1.0), x1["a"], rtol=1e-6, atol=1e-6)  # one model: itself

    # DARE: kept entries rescaled by 1/density, the mask seeded (same seed, same mask) and ~density dense
    d = tree_dare(base, [x1], [1.0], 0.3, seed=5)
    assert jax.tree.all(jax.tree.map(np.array_equal, d, tree_dare(base, [x1], [1.0], 0.3, seed=5)))
    big_b, big_x = np.zeros((400, 500), np.float32), rng.standard_normal((400, 500)).astype(np.float32)
    m = ops.dare_keep(1, "t", 0, big_b.shape, 0.3)
    np.testing.assert_allclose(ops.dare(big_b, [big_x], [2.0], 0.3, [m]), np.where(m, 2.0 * big_x / 0.3, 0), rtol=1e-6)
    assert abs(m.mean() - 0.3) < 0.01 and not np.array_equal(m, ops.dare_keep(2, "t", 0, big_b.shape, 0.3))
    assert np.array_equal(ops.dare_keep(1, "t", 100 * 500, (50, 500), 0.3), m[100:150])  # blocks agree with the whole
    kept = jax.tree.map(lambda dd, b, x: np.isclose(dd - b, (x - b) / 0.3, rtol=1e-5) | (dd == b), d, base, x1)
    assert all(np.all(k) for k in jax.tree.leaves(kept))

    # SLERP: sin-weighted by the angle between directions; lerp when parallel
    def slerp_ref(a, b, t=0.3):
        a64, b64 = a.astype(np.float64).ravel(), b.astype(np.float64).ravel()
        om = np.arccos(a64 @ b64 / np.linalg.norm(a64) / np.linalg.norm(b64))
        return (np.sin((1 - t) * om) * a + np.sin(t * om) * b) / np.sin(om)

    close(tree_slerp(x1, x2, 0.3), jax.tree.map(slerp_ref, x1, x2))
    np.testing.assert_allclose(slerp(x1["a"], 2 * x1["a"], 0.25), 1.25 * x1["a"], rtol=1e-6)

    # LoRA deltas: dense, fused in_proj (one wide kernel), per expert with one scale per expert stack
    for a_shape, b_shape, scale in (((6, 2), (2, 9), 2.0), ((6, 3), (3, 40), 0.5), ((4, 6, 2), (4, 2, 5), np.float32(1.5))):
        a, b = rng.standard_normal(a_shape).astype(np.float32), rng.standard_normal(b_shape).astype(np.float32)
        wt = rng.standard_normal(a_shape[:-1] + b_shape[-1:]).astype(np.float32)
        want = wt + 0.3 * scale * np.einsum("...ir,...ro->...io", a, b)
        np.testing.assert_allclose(lora(wt, a, b, scale, 0.3), want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(linear([x1["a"]], [2.0]), 2 * x1["a"])
    np.testing.assert_allclose(task_arithmetic(base["a"], [x1["a"]], [1.0]), x1["a"], rtol=1e-6, atol=1e-6)


def test_tree_ops_keep_dtype_and_sharding():
    """jax leaves come back as jax arrays in their sharding and dtype, rounded once from fp32."""
    x = jnp.asarray(np.random.default_rng(1).standard_normal((8, 4)), jnp.bfloat16)
    y = jnp.asarray(np.random.default_rng(2).standard_normal((8, 4)), jnp.bfloat16)
    out = tree_linear([{"w": x}, {"w": y}], [0.5, 0.5])["w"]
    assert isinstance(out, jax.Array) and out.dtype == jnp.bfloat16 and out.sharding == x.sharding
    want = (0.5 * np.asarray(x, np.float32) + 0.5 * np.asarray(y, np.float32)).astype(BF16)
    assert np.asarray(out).tobytes() == want.tobytes()


# --------------------------------------------------------------------------- streaming engine
@pytest.fixture(scope="module")
def three(tmp_path_factory):
    """base (HF, with a tokenizer file), sft (native), rl (HF): tiny models with an MTP layer."""
    d = tmp_path_factory.mktemp("merge")
    cfg = tiny_cfg("M*E-", num_nextn_predict_layers=1)
    params = {n: rand_params(cfg, s) for n, s in (("base", 0), ("sft", 1), ("rl", 2))}
    save_pretrained(cfg, params["base"], d / "base", max_shard_size="20KB")
    (d / "base" / "tokenizer.json").write_text('{"fake": true}')
    save_model(str(d / "sft"), cfg, jax.tree.map(jnp.asarray, params["sft"]))
    save_pretrained(cfg, params["rl"], d / "rl")
    return d, cfg, params


RULES = [
    {"match": r"\.mixer\.(q_proj|k_proj)\.weight$", "take": "base"},
    {"match": r"\.mixer\.v_proj\.", "slerp": {"a": "base", "b": "rl", "t": 0.3}},
    {"match": r"\.experts\.\d+\.up_proj", "ties": {"models": {"sft": 1.0, "rl": 0.5}, "density": 0.5}},
    {"match": r"\.experts\.\d+\.down_proj", "dare": {"models": {"sft": 0.8, "rl": 0.4}, "density": 0.6, "seed": 3}},
    {"match": r"^mtp\.", "task_arithmetic": {"sft": 0.7, "rl": 0.2}},
    {"match": ".*", "linear": {"base": 0.5, "sft": 0.25, "rl": 0.25}},
]


@pytest.mark.parametrize("chunk_bytes", [1 << 20, 100])
def test_streaming_equals_in_memory_bit_for_bit(three, tmp_path, monkeypatch, chunk_bytes):
    """100-byte chunks stream every elementwise rule (DARE included) in many row blocks per tensor."""
    import nemo_jax.tensorio

    monkeypatch.setattr(nemo_jax.tensorio, "CHUNK_BYTES", chunk_bytes)
    d, cfg, params = three
    recipe = parse_recipe({"output": str(tmp_path / "out"), "max_shard_size": "30KB", "rules": RULES,
                           "models": {"base": str(d / "base"), "sft": str(d / "sft"), "rl": str(d / "rl")}})
    src = run_recipe(recipe)
    got = hf_tensors(tmp_path / "out")
    mem, stats = merge_params(cfg, params, recipe.rules, base="base")
    want = leaves_by_hf(cfg, mem)
    base = leaves_by_hf(cfg, params["base"])
    assert got.keys() == want.keys() == {e.hf_name for e in build_table(cfg)}
    for k in want:  # bit-identical, and each tensor in the base's dtype (bf16; the correction bias fp32)
        assert got[k].dtype == want[k].dtype == base[k].dtype and got[k].tobytes() == want[k].tobytes(), k
    assert {str(got[k].dtype) for k in got} == {"bfloat16", "float32"}
    assert any(k.startswith("mtp.") for k in got)
    files = set(os.listdir(tmp_path / "out"))
    assert {"config.json", "model.safetensors.index.json", "tokenizer.json", "generation_config.json"} <= files
    assert json.load(open(tmp_path / "out" / "config.json")) == cfg.to_hf_dict()
    assert not [f for f in os.listdir(tmp_path) if ".tmp-" in f]
    # the report: every tensor once, its rule; q/k unchanged (norm 0); a linear mix changed and survived bf16
    assert {s.name for s in src.stats.values()} == set(got)
    s = {k: (v.kind, v.change, v.survived) for k, v in stats.items()}
    assert s["backbone.layers.1.mixer.q_proj.weight"] == ("take", 0.0, 1.0)
    kind, change, surv = s["backbone.embeddings.weight"]
    assert kind == "linear" and change > 0 and 0.95 < surv < 1.05
    assert src.stats["backbone.embeddings.weight"].change == pytest.approx(change, rel=1e-6)


def test_qk_restore_recipe_takes_exactly_attention_qk(three, tmp_path):
    """The shipped recipe through the CLI: q/k (main and MTP attention) bitwise from base; every other tensor
    the bf16 rounding of the fp32 mean."""
    d, cfg, params = three
    out = tmp_path / "merged"
    main(["merge", os.path.join(CONFIGS, "base-merge-qk-restore.yaml"), f"output={out}",
          f"models.base={d / 'base'}", f"models.sft={d / 'sft'}", "--report", str(tmp_path / "r.tsv")])
    got, base, sft = hf_tensors(out), leaves_by_hf(cfg, params["base"]), leaves_by_hf(cfg, params["sft"])
    qk = {k for k in got if re.search(r"mixer\.(q|k)_proj\.weight$", k)}
    assert any(k.startswith("mtp.") for k in qk) and any(k.startswith("backbone.") for k in qk)
    for k in got:
        if k in qk:
            assert got[k].tobytes() == base[k].tobytes(), k
        else:
            want = (0.5 * base[k].astype(np.float32) + 0.5 * sft[k].astype(np.float32)).astype(base[k].dtype)
            assert got[k].dtype == base[k].dtype and got[k].tobytes() == want.tobytes(), k
            assert got[k].tobytes() != base[k].tobytes(), k
    rows = open(tmp_path / "r.tsv").read().splitlines()
    assert len(rows) == 1 + len(got) and sum("\ttake\t" in r for r in rows) == len(qk)


@pytest.mark.slow
def test_lora_delta_merge_equals_unmerged_forward(tmp_path):
    """Two PEFT adapters (dense attention, fused Mamba in_proj, per-expert) added at weights 1.0 and 0.5 by the
    shipped add-experts recipe: the merged model's forward equals the unmerged forward with both adapters
    (concatenated along the rank, each B scaled by its weight) to 1e-5."""
    from nemo_jax import model as M
    from nemo_jax.hf.io import load_pretrained
    from nemo_jax.lora import LoraConfig, adapter_specs, attach, load_peft, save_peft
    from nemo_jax.model.spec import ParamSpec

    cfg = tiny_cfg("M*E")
    params = M.init(cfg, jax.random.key(0))
    save_pretrained(cfg, params, tmp_path / "base")
    lc = LoraConfig(targets=("attention", r"^layers/mamba/mixer/in_proj/kernel$", r"^layers/moe/mixer/experts/(up|down)_proj$"),
                    rank=2, alpha=4.0)
    peft_dirs = {}
    for name, seed in (("gui", 1), ("mcp", 2)):
        rng = np.random.RandomState(seed)
        ad = jax.tree_util.tree_map_with_path(
            lambda p, sp: np.full(sp.shape, lc.scale, np.float32) if p[-1].key == "lora_scale"
            else (0.3 * rng.randn(*sp.shape)).astype(np.float32), adapter_specs(cfg, lc), is_leaf=lambda x: isinstance(x, ParamSpec))
        save_peft(cfg, ad, tmp_path / name, lora_config=lc)
        peft_dirs[name] = str(tmp_path / name)
    main(["merge", os.path.join(CONFIGS, "add-experts.yaml"), f"output={tmp_path / 'out'}",
          f"models.base={tmp_path / 'base'}", f"adapters.gui={peft_dirs['gui']}", f"adapters.mcp={peft_dirs['mcp']}"])
    _, merged = load_pretrained(tmp_path / "out")
    g, m = load_peft(peft_dirs["gui"], cfg), load_peft(peft_dirs["mcp"], cfg)

    def both(x, y):  # one rank-4 adapter equal to gui * 1.0 + mcp * 0.5
        if "lora_a" not in x:
            return {k: both(x[k], y[k]) for k in x}
        s = lambda t: np.asarray(t["lora_scale"], np.float32)[..., None, None]
        return {"lora_a": np.concatenate([x["lora_a"], y["lora_a"]], -1),
                "lora_b": np.concatenate([s(x) * x["lora_b"], 0.5 * s(y) * y["lora_b"]], -2),
                "lora_scale": np.ones_like(np.asarray(x["lora_scale"]))}

    toks = jnp.asarray(np.random.RandomState(3).randint(0, cfg.vocab_size, (2, 9)))
    fwd = jax.jit(lambda p, t: M.forward(p, t, cfg)[0])  # two compiles: with and without adapter leaves
    want = np.asarray(fwd(attach(params, both(g, m)), toks))
    got = np.asarray(fwd(merged, toks))
    assert np.max(np.abs(want - np.asarray(fwd(params, toks)))) > 1e-2  # the adapters matter
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)


# --------------------------------------------------------------------------- errors write nothing
def _mismatched(tmp_path, **kw):
    cfg = tiny_cfg("M*E-", **{"num_nextn_predict_layers": 1, **kw})
    save_pretrained(cfg, rand_params(cfg, 9), tmp_path / "odd")
    return str(tmp_path / "odd")


@pytest.mark.parametrize("case, message", [
    ("shape", r"model 'sft'.*tensor '.*' has shape"),
    ("names", r"model 'sft'.*missing tensor 'mtp\."),
    ("native_names", r"model 'sft'.*lacks tensor 'mtp/0/"),
    ("unmatched", r"rules\[1\] \(match 'nothing_like_this'\) matches nothing \(no tensor name"),
    ("shadowed", r"rules\[1\].*matches nothing \(its tensors, e.g. '.*', are claimed by earlier rules"),
    ("unclaimed", r"tensor 'backbone\.embeddings\.weight' is claimed by no rule"),
    ("missing", r"model 'sft': .*/nowhere does not exist"),
    ("unknown_key", r"rules\[0\]: unknown key 'wieghts'"),
    ("unknown_top", r"unknown key 'outptu'"),
    ("unknown_model", r"rules\[0\].linear: unknown model 'rlx'"),
])
def test_errors_write_nothing(three, tmp_path, case, message):
    d, cfg, _ = three
    out = tmp_path / "out"
    rec = {"output": str(out), "models": {"base": str(d / "base"), "sft": str(d / "sft")},
           "rules": [{"match": ".*", "linear": {"base": 0.5, "sft": 0.5}}]}
    if case == "shape":
        rec["models"]["sft"] = _mismatched(tmp_path, intermediate_size=40)
    elif case == "names":
        rec["models"]["sft"] = _mismatched(tmp_path, num_nextn_predict_layers=0)
    elif case == "native_names":
        odd = tiny_cfg("M*E-")
        save_model(str(tmp_path / "odd"), odd, jax.tree.map(jnp.asarray, rand_params(odd, 9)))
        rec["models"]["sft"] = str(tmp_path / "odd")
    elif case == "unmatched":
        rec["rules"].append({"match": "nothing_like_this", "take": "base"})
    elif case == "shadowed":
        rec["rules"].append({"match": "q_proj", "take": "base"})
    elif case == "unclaimed":
        rec["rules"] = [{"match": "^(?!backbone.embeddings)", "take": "sft"}]
    elif case == "missing":
        rec["models"]["sft"] = str(tmp_path / "nowhere")
    elif case == "unknown_key":
        rec["rules"][0]["wieghts"] = 1
    elif case == "unknown_top":
        rec["outptu"] = "x"
    elif case == "unknown_model":
        rec["rules"][0]["linear"] = {"base": 0.5, "rlx": 0.5}
    with pytest.raises(RecipeError, match=message):
        run_recipe(parse_recipe(rec))
    assert not out.exists() and not [f for f in os.listdir(tmp_path) if f.startswith("out")]


def test_recipe_file_overrides_and_cli_error(three, tmp_path, capsys):
    d, _, _ = three
    r = load_recipe(os.path.join(CONFIGS, "base-merge-qk-restore.yaml"), ["rules.1.linear.sft=0.3", "output=x"])
    assert r.rules[1].weights == {"base": 0.5, "sft": 0.3} and r.output == "x" and r.base == "base"
    with pytest.raises(SystemExit):
        main(["merge", os.path.join(CONFIGS, "add-experts.yaml"), f"output={tmp_path / 'o'}",
              f"models.base={d / 'base'}", f"adapters.gui={tmp_path / 'none'}"])
    assert re.search(r"adapter 'gui': .*/none does not exist", capsys.readouterr().err)
    assert not (tmp_path / "o").exists()
