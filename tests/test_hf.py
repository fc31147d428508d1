"""Parity and round trips against transformers' NemotronHForCausalLM (the pinned oracle)."""

import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="parity tests need torch (pip install -e '.[test]')")
transformers = pytest.importorskip("transformers", reason="parity tests need transformers (pip install -e '.[test]')")
from safetensors import safe_open  # noqa: E402
from safetensors.numpy import save_file  # noqa: E402

from nemo_jax import model as M  # noqa: E402
from nemo_jax.hf.io import CheckpointError, load_pretrained, save_pretrained  # noqa: E402
from nemo_jax.hf.mapping import build_table  # noqa: E402

HF_CONFIGS = {
    "all_kinds_latent_groups": dict(
        layers_block_type=["linear_attention", "moe", "full_attention", "mlp", "linear_attention", "moe"],
        num_attention_heads=4, num_key_value_heads=2, n_groups=2, n_group=2, topk_group=1, moe_latent_size=24,
        n_routed_experts=8, num_experts_per_tok=2),
    "mha_single_group": dict(
        layers_block_type=["linear_attention", "full_attention", "mlp", "linear_attention"],
        num_attention_heads=4, num_key_value_heads=4, n_groups=1),
    "nano_like": dict(
        layers_block_type=["linear_attention", "moe", "linear_attention", "moe", "linear_attention", "full_attention", "moe"],
        num_attention_heads=8, num_key_value_heads=2, n_groups=4, n_routed_experts=16, num_experts_per_tok=4,
        n_group=4, topk_group=2, routed_scaling_factor=2.5),
}


def make_hf_model(kind: str, seed: int = 0):
    torch.manual_seed(seed)
    kw = dict(vocab_size=101, hidden_size=48, head_dim=12, intermediate_size=72, mamba_num_heads=8,
              mamba_head_dim=6, ssm_state_size=8, chunk_size=8, moe_intermediate_size=20,
              moe_shared_expert_intermediate_size=28, n_routed_experts=8, num_experts_per_tok=2)
    kw.update(HF_CONFIGS[kind])
    model = transformers.NemotronHForCausalLM(transformers.NemotronHConfig(**kw)).eval()
    with torch.no_grad():  # move the parameters HF initialises to constants off their defaults
        for name, p in model.named_parameters():
            if name.endswith(("A_log", ".D", "dt_bias")) or "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
        for mod in model.modules():
            if hasattr(mod, "e_score_correction_bias"):
                mod.e_score_correction_bias.copy_(0.05 * torch.randn_like(mod.e_score_correction_bias))
    return model


def hf_logits(model, toks):
    with torch.no_grad():
        return model(torch.tensor(np.asarray(toks))).logits.float().numpy()


def tensors(path):
    out = {}
    for f in sorted(os.listdir(path)):
        if f.endswith(".safetensors"):
            with safe_open(os.path.join(path, f), framework="np") as st:
                for k in st.keys():
                    out[k] = (st.get_tensor(k), st.get_slice(k).get_dtype())
    return out


@pytest.fixture(scope="module", params=sorted(HF_CONFIGS))
def hf_dir(request, tmp_path_factory):
    d = tmp_path_factory.mktemp(request.param)
    model = make_hf_model(request.param)
    model.save_pretrained(d / "hf")
    return d, model


def test_logit_parity_and_round_trip(hf_dir):
    d, model = hf_dir
    cfg, params = load_pretrained(d / "hf", config_overrides={"clamp_dt": True})
    toks = np.random.RandomState(0).randint(0, cfg.vocab_size, (2, 21))  # 21: not a multiple of chunk 8
    ref = hf_logits(model, toks)
    ours, _ = jax.jit(lambda p, t: M.forward(p, t, cfg))(params, jnp.asarray(toks))
    assert np.max(np.abs(np.asarray(ours) - ref)) <= 1e-4
    save_pretrained(cfg, params, d / "out")
    original, exported = tensors(d / "hf"), tensors(d / "out")
    assert original.keys() == exported.keys()
    for k, (a, dt) in original.items():
        assert exported[k][1] == dt, k
        assert a.tobytes() == exported[k][0].tobytes(), k
    back = transformers.NemotronHForCausalLM.from_pretrained(d / "out").eval()
    assert np.max(np.abs(hf_logits(back, toks) - ref)) == 0.0
    with open(d / "out" / "config.json") as f:
        assert json.load(f)["model_type"] == "nemotron_h"
    assert os.path.exists(d / "out" / "generation_config.json")


def test_multi_shard_and_mixed_dtypes(tmp_path):
    model = make_hf_model("all_kinds_latent_groups", seed=1)
    model = model.to(torch.bfloat16)
    model.save_pretrained(tmp_path / "hf", max_shard_size="40KB")
    assert os.path.exists(tmp_path / "hf" / "model.safetensors.index.json")
    original = tensors(tmp_path / "hf")
    assert {dt for _, dt in original.values()} >= {"BF16"}
    cfg, params = load_pretrained(tmp_path / "hf")
    save_pretrained(cfg, params, tmp_path / "out", max_shard_size="30KB")
    with open(tmp_path / "out" / "model.safetensors.index.json") as f:
        index = json.load(f)
    exported = tensors(tmp_path / "out")
    assert index["metadata"]["total_size"] == sum(a.nbytes for a, _ in exported.values())
    assert len(set(index["weight_map"].values())) > 1
    for k, (a, dt) in original.items():
        assert exported[k][1] == dt and a.tobytes() == exported[k][0].tobytes(), k
    with safe_open(os.path.join(tmp_path / "out", sorted(set(index["weight_map"].values()))[0]), "np") as st:
        assert st.metadata() == {"format": "pt"}


def test_mtp_tensors_are_carried(tmp_path):
    model = make_hf_model("nano_like", seed=2)
    model.save_pretrained(tmp_path / "hf")
    with open(tmp_path / "hf" / "config.json") as f:
        conf = json.load(f)
    conf["num_nextn_predict_layers"] = 1
    conf["mtp_layers_block_type"] = ["full_attention", "moe"]
    with open(tmp_path / "hf" / "config.json", "w") as f:
        json.dump(conf, f)
    from nemo_jax.config.model import NemotronHConfig

    cfg = NemotronHConfig.from_hf_dict(conf)
    rng = np.random.RandomState(0)
    mtp = {e.hf_name: rng.randn(*e.hf_shape).astype(np.float32) for e in build_table(cfg) if e.hf_name.startswith("mtp.")}
    assert "mtp.layers.0.eh_proj.weight" in mtp and "mtp.layers.1.final_layernorm.weight" in mtp
    save_file(mtp, str(tmp_path / "hf" / "mtp.safetensors"), metadata={"format": "pt"})
    shutil.move(tmp_path / "hf" / "model.safetensors", tmp_path / "hf" / "main.safetensors")
    names = {k: "main.safetensors" for k in tensors(tmp_path / "hf") if not k.startswith("mtp.")}
    names.update({k: "mtp.safetensors" for k in mtp})
    with open(tmp_path / "hf" / "model.safetensors.index.json", "w") as f:
        json.dump({"metadata": {}, "weight_map": names}, f)
    cfg, params = load_pretrained(tmp_path / "hf", config_overrides={"clamp_dt": True})
    assert len(params["mtp"]) == 1
    toks = np.random.RandomState(0).randint(0, cfg.vocab_size, (1, 12))
    logits, aux = M.forward(params, jnp.asarray(toks), cfg)
    assert aux["mtp_logits"][0].shape == logits.shape
    # transformers drops mtp.*; the main logits still agree
    back = transformers.NemotronHForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert np.max(np.abs(hf_logits(back, toks) - np.asarray(logits))) <= 1e-4
    save_pretrained(cfg, params, tmp_path / "out")
    exported = tensors(tmp_path / "out")
    for k, a in mtp.items():
        assert exported[k][0].tobytes() == a.tobytes()
    # and through the streaming native path
    from nemo_jax.cli import main

    main(["import-hf", str(tmp_path / "hf"), str(tmp_path / "native")])
    main(["export-hf", str(tmp_path / "native"), str(tmp_path / "back")])
    original, back = tensors(tmp_path / "hf"), tensors(tmp_path / "back")
    assert original.keys() == back.keys() and all(back[k][0].tobytes() == a.tobytes() for k, (a, _) in original.items())


# --------------------------------------------------------------------------- bad input
@pytest.fixture()
def good(tmp_path):
    model = make_hf_model("mha_single_group", seed=3)
    model.save_pretrained(tmp_path / "hf", max_shard_size="30KB")
    return tmp_path / "hf"


def _rewrite(path, fn):
    """Rewrite every shard through fn(dict of tensors) -> dict."""
    for f in os.listdir(path):
        if f.endswith(".safetensors"):
            with safe_open(os.path.join(path, f), "np") as st:
                d = {k: st.get_tensor(k) for k in st.keys()}
            save_file(fn(d), os.path.join(path, f), metadata={"format": "pt"})


def test_missing_tensor(good):
    _rewrite(good, lambda d: {k: v for k, v in d.items() if k != "backbone.layers.1.mixer.q_proj.weight"})
    with open(good / "model.safetensors.index.json") as f:
        idx = json.load(f)
    idx["weight_map"].pop("backbone.layers.1.mixer.q_proj.weight")
    with open(good / "model.safetensors.index.json", "w") as f:
        json.dump(idx, f)
    with pytest.raises(CheckpointError, match="missing tensor 'backbone.layers.1.mixer.q_proj.weight'"):
        load_pretrained(good)


def test_unexpected_tensor(good, tmp_path):
    _rewrite(good, lambda d: {**d, "backbone.extra.weight": np.zeros(3, np.float32)} if "backbone.embeddings.weight" in d else d)
    with open(good / "model.safetensors.index.json") as f:
        idx = json.load(f)
    holder = [k for k, v in idx["weight_map"].items() if k == "backbone.embeddings.weight"][0]
    idx["weight_map"]["backbone.extra.weight"] = idx["weight_map"][holder]
    with open(good / "model.safetensors.index.json", "w") as f:
        json.dump(idx, f)
    with pytest.raises(CheckpointError, match="unexpected tensor 'backbone.extra.weight'"):
        load_pretrained(good)
    cfg, params = load_pretrained(good, ignore_unexpected=True)
    assert params["lm_head"]["kernel"].shape == (cfg.hidden_size, cfg.vocab_size)


def test_wrong_shape_and_dtype(good):
    _rewrite(good, lambda d: {k: (v[:, :-1] if k == "lm_head.weight" else v) for k, v in d.items()})
    with pytest.raises(CheckpointError, match=r"'lm_head.weight' has shape \[101, 47\]"):
        load_pretrained(good)
    _rewrite(good, lambda d: {k: (np.zeros((101, 48), np.int32) if k == "lm_head.weight" else v) for k, v in d.items()})
    with pytest.raises(CheckpointError, match="'lm_head.weight' has dtype I32"):
        load_pretrained(good)


def test_truncated_shard_and_missing_file(good):
    shard = sorted(f for f in os.listdir(good) if f.endswith(".safetensors"))[-1]
    size = os.path.getsize(good / shard)
    with open(good / shard, "r+b") as f:
        f.truncate(size - 10)
    with pytest.raises(CheckpointError, match=f"{shard}.*truncated"):
        load_pretrained(good)
    os.remove(good / shard)
    with pytest.raises(CheckpointError, match=f"missing file '{shard}'"):
        load_pretrained(good)


def test_config_mismatch_and_pickle_refused(good, tmp_path):
    with open(good / "config.json") as f:
        conf = json.load(f)
    conf["hidden_size"] = 64
    with open(good / "config.json", "w") as f:
        json.dump(conf, f)
    with pytest.raises(CheckpointError, match="config.json implies"):
        load_pretrained(good)
    legacy = tmp_path / "legacy"
    legacy.mkdir()
    shutil.copy(good / "config.json", legacy / "config.json")
    (legacy / "pytorch_model.bin").write_bytes(b"\x80\x02")
    with pytest.raises(CheckpointError, match="pickled checkpoints are refused"):
        load_pretrained(legacy)


def test_cli_import_export_and_failed_import_writes_nothing(good, tmp_path):
    from nemo_jax.cli import main

    main(["import-hf", str(good), str(tmp_path / "native")])
    main(["export-hf", str(tmp_path / "native"), str(tmp_path / "back"), "--like", str(good)])
    original, back = tensors(good), tensors(tmp_path / "back")
    for k, (a, dt) in original.items():
        assert back[k][0].tobytes() == a.tobytes()
    os.remove(good / sorted(f for f in os.listdir(good) if f.endswith(".safetensors"))[0])
    with pytest.raises(SystemExit):
        main(["import-hf", str(good), str(tmp_path / "native2")])
    assert not any(p.name.startswith("native2") for p in tmp_path.iterdir())


def test_compare_logits_tool(hf_dir, tmp_path):
    import importlib.util

    d, _ = hf_dir
    from nemo_jax.checkpoint import save_model

    cfg, params = load_pretrained(d / "hf")
    save_model(str(tmp_path / "native"), cfg, params)
    spec = importlib.util.spec_from_file_location(
        "compare_logits", os.path.join(os.path.dirname(os.path.dirname(__file__)), "tools", "probes", "compare_logits.py"))
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    out = tool.main([str(d / "hf"), str(tmp_path / "native"), "--ids", "3,14,15,92,65,35,8,9,7,93"])
    assert out["reference"] == "transformers" and out["max_abs_diff"] <= 1e-4 and out["top1_agreement"] == 1.0


@pytest.mark.parametrize("chunk_bytes", [700, 1 << 20])
def test_streaming_import_export_by_chunks(tmp_path, monkeypatch, chunk_bytes):
    """import-hf writes every leaf region by region (small chunks force many blocks per tensor and per
    stacked leaf); what orbax restores equals the in-memory load, and exports from it (and from an orbax
    `save_model` checkpoint) reproduce the original bytes and dtypes."""
    import nemo_jax.checkpoint as C
    import nemo_jax.tensorio as T
    from nemo_jax.hf.io import import_pretrained

    monkeypatch.setattr(T, "CHUNK_BYTES", chunk_bytes)
    model = make_hf_model("nano_like", seed=4).to(torch.bfloat16)
    model.save_pretrained(tmp_path / "hf", max_shard_size="40KB")
    original = tensors(tmp_path / "hf")
    cfg = import_pretrained(tmp_path / "hf", tmp_path / "native")
    _, ref = load_pretrained(tmp_path / "hf")
    _, got = C.load_model(str(tmp_path / "native"))
    assert jax.tree.structure(ref) == jax.tree.structure(got)
    for a, b in zip(jax.tree.leaves(ref), jax.tree.leaves(got)):
        assert a.dtype == b.dtype and np.array_equal(np.asarray(a), np.asarray(b))
    from nemo_jax.parallel.mesh import make_mesh

    _, sharded = C.load_model(str(tmp_path / "native"), mesh=make_mesh({"fsdp": 2, "tensor": 2, "expert": 2}))
    up = sharded["layers"]["moe"]["mixer"]["experts"]["up_proj"]
    assert len(up.sharding.device_set) == 8 and up.addressable_shards[0].data.shape != up.shape
    for a, b in zip(jax.tree.leaves(ref), jax.tree.leaves(sharded)):
        assert np.array_equal(np.asarray(a), np.asarray(b))
    _, reader = C.lazy_model(str(tmp_path / "native"))
    up = "layers/moe/mixer/experts/up_proj"
    chunks = reader.chunks(up)
    assert chunks[:2] == (1, 1)
    if chunk_bytes < 1000:
        assert chunks[-1] < reader[up].shape[-1]  # blocks of HF rows, not whole tensors
    C.save_model(str(tmp_path / "orbax"), cfg, got)
    for src in ("native", "orbax"):
        main_args = [src_dir := str(tmp_path / src), str(tmp_path / f"back_{src}")]
        from nemo_jax.cli import main

        main(["export-hf", *main_args, "--max-shard-size", "30KB"])
        back = tensors(tmp_path / f"back_{src}")
        assert back.keys() == original.keys(), src_dir
        for k, (a, dt) in original.items():
            assert back[k][1] == dt and back[k][0].tobytes() == a.tobytes(), (src, k)


def test_native_models_record_their_parameter_layout(tmp_path):
    """A native model records its parameter layout; one written before the record (Mamba in_proj and conv in
    HF's part-major order) is refused, naming it, rather than loaded permuted; a model without Mamba layers
    loads either way."""
    import nemo_jax.checkpoint as C
    from nemo_jax.model.spec import PARAM_LAYOUT
    from nemo_jax.fsutil import CONTENT_MANIFEST
    from nemo_jax.tensorio import LAYOUT_FILE, read_layout

    from helpers import tiny_cfg

    for i, (pattern, refused) in enumerate((("M*", True), ("*-", False))):
        cfg = tiny_cfg(pattern)
        d = str(tmp_path / f"m{i}")
        C.save_model(d, cfg, M.init(cfg, jax.random.PRNGKey(0)))
        assert read_layout(d) == PARAM_LAYOUT
        C.load_model(d)
        os.remove(os.path.join(d, LAYOUT_FILE))
        os.remove(os.path.join(d, CONTENT_MANIFEST))  # a dir written before both records existed
        if not refused:
            C.load_model(d)
            continue
        for load in (C.load_model, C.lazy_model):
            with pytest.raises(ValueError, match=f"{d}: written with parameter layout 1"):
                load(d)


def test_pipelined_keeps_order_and_hints_ahead(tmp_path):
    """`_pipelined` yields fn(job) in job order; each hint comes `depth` jobs before its job is submitted
    (the streaming merge uses it to ask for reads ahead); HFReader.prefetch accepts any row block."""
    import threading

    from nemo_jax.hf.io import HFReader, _pipelined

    events, lock = [], threading.Lock()

    def fn(j):
        with lock:
            events.append(("run", j))
        return j * j

    jobs = list(range(7))
    assert list(_pipelined(fn, jobs, depth=2, hint=lambda j: events.append(("hint", j)))) == [j * j for j in jobs]
    hints = [j for k, j in events if k == "hint"]
    assert hints == jobs[2:]
    for j in hints:
        assert events.index(("hint", j)) < events.index(("run", j))
    save_file({"w": np.arange(12, dtype=np.float32).reshape(4, 3)}, str(tmp_path / "model.safetensors"))
    r = HFReader(str(tmp_path))
    r.prefetch("w", (slice(1, 3),))
    r.prefetch("w", (slice(2, 2),))
    np.testing.assert_array_equal(r.read("w", (slice(1, 3),)), np.arange(3, 9, dtype=np.float32).reshape(2, 3))
