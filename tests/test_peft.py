"""PEFT / vLLM adapter directories: round trips, peft + transformers parity, merged HF export, CLI."""

import json
import os
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="PEFT tests need torch (pip install -e '.[test]')")
transformers = pytest.importorskip("transformers", reason="PEFT tests need transformers (pip install -e '.[test]')")
peft = pytest.importorskip("peft", reason="PEFT tests need peft (pip install -e '.[test]')")
from helpers import tiny_cfg  # noqa: E402
from safetensors.numpy import load_file, save_file  # noqa: E402
from test_hf import hf_logits, make_hf_model, tensors  # noqa: E402

from nemo_jax import model as M  # noqa: E402
from nemo_jax.hf.io import load_pretrained  # noqa: E402
from nemo_jax.lora import LoraConfig, adapter_specs, attach  # noqa: E402
from nemo_jax.lora.peft import PeftFormatError, load_peft, save_peft  # noqa: E402
from nemo_jax.model.spec import ParamSpec, flatten_with_paths  # noqa: E402

DENSE = ("attention", r"^layers/mamba/mixer/in_proj/kernel$", "mlp", r"^layers/moe/mixer/fc[12]_latent_proj/kernel$")
EXPERTS = (r"^layers/moe/mixer/experts/(up|down)_proj$",)


def random_adapters(cfg, targets, rank=4, alpha=8.0, seed=0, rslora=False):
    """Adapters (laid out by `adapter_specs`) with random A and B (B = 0 would hide any layout error), in numpy:
    no compile."""
    lc = LoraConfig(targets=targets, rank=rank, alpha=alpha, rslora=rslora)
    rng = np.random.RandomState(seed)
    return jax.tree_util.tree_map_with_path(
        lambda p, sp: np.full(sp.shape, lc.scale, np.float32) if p[-1].key == "lora_scale"
        else (0.3 * rng.randn(*sp.shape)).astype(np.float32), adapter_specs(cfg, lc), is_leaf=lambda x: isinstance(x, ParamSpec))


def flat(tree):
    return flatten_with_paths(tree)


def assert_bit_equal(a, b, skip=lambda k: False):
    fa, fb = {k: v for k, v in flat(a).items() if not skip(k)}, flat(b)
    assert fa.keys() == fb.keys(), (set(fa) ^ set(fb))
    for k in fa:
        x, y = np.asarray(fa[k]), np.asarray(fb[k])
        assert x.dtype == y.dtype and x.shape == y.shape and x.tobytes() == y.tobytes(), k


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory):
    """transformers' NemotronHForCausalLM (all layer kinds, latent MoE) saved, and ours loaded from it."""
    d = tmp_path_factory.mktemp("peft_hf")
    model = make_hf_model("all_kinds_latent_groups", seed=5)
    model.save_pretrained(d / "hf")
    cfg, params = load_pretrained(d / "hf", config_overrides={"clamp_dt": True})
    toks = np.random.RandomState(1).randint(0, cfg.vocab_size, (2, 13))
    return d, cfg, params, toks


def ours(params, adapters, toks, cfg):
    return np.asarray(M.forward(attach(params, adapters), jnp.asarray(toks), cfg)[0])


# --------------------------------------------------------------------------- round trips
@pytest.mark.parametrize("fmt", ["peft", "vllm"])
def test_export_import_bit_exact(tmp_path, fmt):
    """Every adaptable kind incl. lm_head and MTP, per-layer scales that differ (alpha_pattern), a bf16 leaf and
    rsLoRA: import reproduces every leaf bit for bit (vllm leaves MTP out, with a warning)."""
    cfg = tiny_cfg("MEM*E-", num_nextn_predict_layers=1, moe_latent_size=16)
    ad = random_adapters(cfg, ("all", "lm_head", r"^mtp/"), rank=4, alpha=6.0, rslora=True)
    ad["layers"]["moe"]["mixer"]["fc1_latent_proj"]["lora_scale"] = np.array([0.7, 1.3], np.float32)
    ad["layers"]["moe"]["mixer"]["experts"]["up_proj_lora"]["lora_scale"] = np.array([0.1, 2.0 / 3], np.float32)
    q = ad["layers"]["attention"]["mixer"]["q_proj"]
    q["lora_a"], q["lora_b"] = q["lora_a"].astype(jnp.bfloat16), q["lora_b"].astype(jnp.bfloat16)
    with pytest.warns(UserWarning) as record:
        save_peft(cfg, ad, tmp_path / "a", format=fmt, lora_config=LoraConfig(rank=4, alpha=6.0, rslora=True))
    messages = " ".join(str(w.message) for w in record)
    assert ("out_proj" in messages and "export-hf" in messages) == (fmt == "peft")  # vLLM reads out_proj
    assert ("left out" in messages) == (fmt == "vllm") and "MTP" in messages
    with open(tmp_path / "a" / "adapter_config.json") as f:
        conf = json.load(f)
    assert conf["r"] == 4 and conf["lora_alpha"] == 6.0 and conf["use_rslora"] is True
    assert conf["alpha_pattern"] and not conf["rank_pattern"]
    back = load_peft(tmp_path / "a", cfg)
    assert_bit_equal(ad, back, skip=(lambda k: k.startswith("mtp/")) if fmt == "vllm" else (lambda k: False))
    assert ("mtp" in back) == (fmt == "peft")
    # a second export of the import is byte-identical (the format is deterministic)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        save_peft(cfg, back, tmp_path / "b", format=fmt, lora_config=LoraConfig(rank=4, alpha=6.0, rslora=True))
    assert (tmp_path / "a" / "adapter_model.safetensors").read_bytes() == (tmp_path / "b" / "adapter_model.safetensors").read_bytes()


def test_key_names_and_layouts(tmp_path):
    """The names and layouts peft (fused 3D experts, nested ParamWrappers) and vLLM (per expert) read."""
    cfg = tiny_cfg("ME*E-", n_routed_experts=4)
    ad = random_adapters(cfg, ("attention", "experts"), rank=3)
    save_peft(cfg, ad, tmp_path / "p", format="peft")
    save_peft(cfg, ad, tmp_path / "v", format="vllm")
    p, v = load_file(str(tmp_path / "p" / "adapter_model.safetensors")), load_file(str(tmp_path / "v" / "adapter_model.safetensors"))
    up, down = ad["layers"]["moe"]["mixer"]["experts"]["up_proj_lora"], ad["layers"]["moe"]["mixer"]["experts"]["down_proj_lora"]
    q = ad["layers"]["attention"]["mixer"]["q_proj"]
    for t in (p, v):
        assert np.array_equal(t["base_model.model.backbone.layers.2.mixer.q_proj.lora_A.weight"], q["lora_a"][0].T)
        assert np.array_equal(t["base_model.model.backbone.layers.2.mixer.q_proj.lora_B.weight"], q["lora_b"][0].T)
    E, r, I, D = 4, 3, cfg.moe_intermediate_size, cfg.hidden_size
    # peft: up_proj is the inner wrapper (base_layer), down_proj the outer one; A [E*r, in], B [out, r*E]
    a_up, b_up = p["base_model.model.backbone.layers.1.mixer.experts.base_layer.lora_A.weight"], \
        p["base_model.model.backbone.layers.1.mixer.experts.base_layer.lora_B.weight"]
    assert a_up.shape == (E * r, D) and b_up.shape == (I, r * E)
    a_dn = p["base_model.model.backbone.layers.1.mixer.experts.lora_A.weight"]
    assert a_dn.shape == (E * r, I)
    for j in range(E):  # peft's ParamWrapper.get_delta_weight: einsum("o r e, e r i -> e o i")
        want = (up["lora_a"][0, j] @ up["lora_b"][0, j]).T
        got = np.einsum("ore,eri->eoi", b_up.reshape(I, r, E), a_up.reshape(E, r, D))[j]
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
        assert np.array_equal(v[f"base_model.model.backbone.layers.1.mixer.experts.{j}.up_proj.lora_A.weight"], up["lora_a"][0, j].T)
        assert np.array_equal(v[f"base_model.model.backbone.layers.3.mixer.experts.{j}.down_proj.lora_B.weight"], down["lora_b"][1, j].T)
    with open(tmp_path / "p" / "adapter_config.json") as f:
        assert json.load(f)["target_parameters"] == ["mixer.experts.up_proj", "mixer.experts.down_proj"]


# --------------------------------------------------------------------------- parity with peft + transformers
@pytest.mark.parametrize("targets", [DENSE, EXPERTS], ids=["qkvo_inproj_mlp_shared_latent", "routed_experts"])
def test_peft_loads_our_export(hf_model, tmp_path, targets):
    d, cfg, params, toks = hf_model
    ad = random_adapters(cfg, targets, seed=len(targets))
    save_peft(cfg, ad, tmp_path / "peft", base_model_name_or_path=str(d / "hf"))
    base = transformers.NemotronHForCausalLM.from_pretrained(d / "hf").eval()
    ref0 = hf_logits(base, toks)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # e.g. peft's "missing adapter keys": it adapted other modules
        pm = peft.PeftModel.from_pretrained(base, str(tmp_path / "peft")).eval()
    got = hf_logits(pm, toks)
    assert np.max(np.abs(got - ref0)) > 1e-2  # the adapters matter
    assert np.max(np.abs(got - ours(params, ad, toks, cfg))) <= 1e-4


def test_import_adapter_written_by_peft(hf_model, tmp_path):
    """peft's own file (transformers 5 spelling `model.layers`, fused experts nested by peft itself) loads into
    our layout: our unmerged forward equals peft's."""
    d, cfg, params, toks = hf_model
    torch.manual_seed(0)
    base = transformers.NemotronHForCausalLM.from_pretrained(d / "hf").eval()
    lc = peft.LoraConfig(r=4, lora_alpha=12, init_lora_weights=False, target_modules=["q_proj", "v_proj", "in_proj", "fc2_latent_proj"],
                         target_parameters=["mixer.experts.up_proj", "mixer.experts.down_proj"])
    pm = peft.get_peft_model(base, lc).eval()
    want = hf_logits(pm, toks)
    pm.save_pretrained(tmp_path / "native_peft")
    names = load_file(str(tmp_path / "native_peft" / "adapter_model.safetensors"))
    assert any(".model.layers." in k for k in names) and any("experts.base_layer.lora_A" in k for k in names)
    ad = load_peft(tmp_path / "native_peft", cfg)
    assert set(ad["layers"]["moe"]["mixer"]["experts"]) == {"up_proj_lora", "down_proj_lora"}
    assert np.max(np.abs(ours(params, ad, toks, cfg) - want)) <= 1e-4


# --------------------------------------------------------------------------- out_proj: served merged
def test_out_proj_warns_and_merged_export_matches(hf_model, tmp_path):
    from nemo_jax.checkpoint import save_model
    from nemo_jax.cli import main

    d, cfg, params, toks = hf_model
    ad = random_adapters(cfg, (r"^layers/mamba/mixer/(in|out)_proj/kernel$", "experts"), seed=7)
    with pytest.warns(UserWarning, match=r"out_proj.*peft refuses.*export-hf"):
        save_peft(cfg, ad, tmp_path / "peft")
    with pytest.raises(ValueError, match="out_proj"):  # the fact the warning is about
        peft.PeftModel.from_pretrained(transformers.NemotronHForCausalLM.from_pretrained(d / "hf"), str(tmp_path / "peft"))
    save_model(str(tmp_path / "native"), cfg, params)
    main(["export-hf", str(tmp_path / "native"), str(tmp_path / "plain")])
    a = str(tmp_path / "peft")
    main(["export-hf", str(tmp_path / "native"), str(tmp_path / "merged"), "--adapters", a + ":0.25", "--adapters", a + ":0.75"])
    plain, merged = tensors(tmp_path / "plain"), tensors(tmp_path / "merged")
    assert plain.keys() == merged.keys()
    changed = {k for k in plain if plain[k][0].tobytes() != merged[k][0].tobytes()}
    assert changed and all(re.search(r"\.(in_proj|out_proj|experts|fc[12]_latent_proj)\.", k) for k in changed), sorted(changed)
    assert all(merged[k][1] == plain[k][1] for k in plain)
    back = transformers.NemotronHForCausalLM.from_pretrained(tmp_path / "merged").eval()
    want = ours(params, ad, toks, cfg)
    assert np.max(np.abs(want - ours(params, None, toks, cfg))) > 1e-2
    assert np.max(np.abs(hf_logits(back, toks) - want)) <= 1e-4


# --------------------------------------------------------------------------- errors and CLI
def test_bad_adapter_files_name_the_tensor(tmp_path):
    cfg = tiny_cfg("M*-")
    ad = random_adapters(cfg, ("attention",))
    save_peft(cfg, ad, tmp_path / "a")
    w = tmp_path / "a" / "adapter_model.safetensors"
    t = load_file(str(w))
    key = "base_model.model.backbone.layers.1.mixer.q_proj.lora_A.weight"
    save_file({**t, key: t[key][:, :-1]}, str(w))
    with pytest.raises(PeftFormatError, match=r"adapter_model.safetensors: tensor '.*layers\.1\.mixer\.q_proj\.lora_A\.weight' has shape"):
        load_peft(tmp_path / "a", cfg)
    save_file({**t, "base_model.model.backbone.layers.7.mixer.q_proj.lora_A.weight": t[key]}, str(w))
    with pytest.raises(PeftFormatError, match=r"'base_model.model.backbone.layers.7.mixer.q_proj.lora_A.weight': no module"):
        load_peft(tmp_path / "a", cfg)
    save_file({k: v for k, v in t.items() if k != key}, str(w))
    with pytest.raises(PeftFormatError, match="has no matching lora_A"):
        load_peft(tmp_path / "a", cfg)
    with pytest.raises(PeftFormatError, match="adapts no kernel"):
        save_peft(cfg, {"layers": {"mamba": {"mixer": {"conv1d": ad["layers"]["attention"]["mixer"]["q_proj"]}}}}, tmp_path / "b")
    assert not (tmp_path / "b").exists()


def test_cli_lora_export_import(tmp_path):
    from nemo_jax.cli import main
    from nemo_jax.lora import load_adapter_checkpoint, save_adapter_checkpoint

    cfg = tiny_cfg("ME*-")
    lc = LoraConfig(targets=("attention", "experts"), rank=4, alpha=8.0)
    ad = random_adapters(cfg, lc.targets)
    save_adapter_checkpoint(str(tmp_path / "ck"), cfg, lc, ad)
    (tmp_path / "model").mkdir()
    with open(tmp_path / "model" / "config.json", "w") as f:
        json.dump(cfg.to_hf_dict(), f)
    for fmt in ("peft", "vllm"):
        main(["lora", "export", str(tmp_path / "ck"), str(tmp_path / fmt), "--format", fmt, "--base-model", str(tmp_path / "model")])
        main(["lora", "import", str(tmp_path / fmt), str(tmp_path / f"ck_{fmt}")])  # config from base_model_name_or_path
        cfg2, lc2, back = load_adapter_checkpoint(str(tmp_path / f"ck_{fmt}"))
        assert cfg2 == cfg and (lc2.rank, lc2.alpha, lc2.rslora) == (4, 8.0, False)
        assert_bit_equal(ad, back)
    # export-hf --adapters takes the adapter checkpoint or its PEFT export alike: the same merged bytes
    from nemo_jax.checkpoint import save_model

    save_model(str(tmp_path / "native"), cfg, M.init(cfg, jax.random.key(0)))
    for src in ("ck", "vllm"):
        main(["export-hf", str(tmp_path / "native"), str(tmp_path / f"merged_{src}"), "--adapters", str(tmp_path / src)])
    a, b = tensors(tmp_path / "merged_ck"), tensors(tmp_path / "merged_vllm")
    assert a.keys() == b.keys() and all(a[k][0].tobytes() == b[k][0].tobytes() for k in a)
    with open(tmp_path / "peft" / "adapter_config.json") as f:
        conf = json.load(f)
    conf["base_model_name_or_path"] = "nvidia/not-a-local-dir"
    with open(tmp_path / "peft" / "adapter_config.json", "w") as f:
        json.dump(conf, f)
    with pytest.raises(SystemExit):
        main(["lora", "import", str(tmp_path / "peft"), str(tmp_path / "nope")])
    assert not (tmp_path / "nope").exists()


# --------------------------------------------------------------------------- published policies (GRPO -> vLLM / peft)
def _vllm_nemotron_h_table(conf: dict, r: int) -> dict[str, tuple[tuple[int, int], tuple[int, int]]]:
    """The LoRA tensors vLLM's nemotron_h loader reads for adapters on every linear layer, from the HF config alone:
    {name in adapter_model.safetensors: (lora_A shape [r, in], lora_B shape [out, r])}. From vLLM's source:
    vllm/model_executor/models/nemotron_h.py (NemotronHForCausalLM: hf_to_vllm_mapper backbone -> model, mtp.* skipped
    (lora_skip_prefixes); packed_modules_mapping qkv_proj = q_proj + k_proj + v_proj; MambaMixer2 in_proj / out_proj,
    NemotronHMLP up_proj / down_proj (dense MLP and shared_experts), fc1/fc2_latent_proj; routed experts through
    get_expert_mapping: checkpoint names experts.{j}.up_proj / experts.{j}.down_proj) and vllm/lora/model_manager.py
    + vllm/lora/utils.py (process_packed_modules_mapping: packed "experts" = one module per expert and projection,
    each read as its own lora_A [r, in] / lora_B [out, r]; lora_model.py: names parsed after base_model.model.)."""
    H, heads, kv, hd = conf["hidden_size"], conf["num_attention_heads"], conf["num_key_value_heads"], conf["head_dim"]
    d_inner = conf["mamba_num_heads"] * conf["mamba_head_dim"]
    in_proj = 2 * d_inner + 2 * conf["n_groups"] * conf["ssm_state_size"] + conf["mamba_num_heads"]
    latent = conf.get("moe_latent_size")
    D, I = (latent or H), conf["moe_intermediate_size"]
    S = conf["moe_shared_expert_intermediate_size"] * conf.get("n_shared_experts", 1)
    kinds = {"linear_attention": {"in_proj": (H, in_proj), "out_proj": (d_inner, H)},
             "full_attention": {"q_proj": (H, heads * hd), "k_proj": (H, kv * hd), "v_proj": (H, kv * hd),
                                "o_proj": (heads * hd, H)},
             "mlp": {"up_proj": (H, conf["intermediate_size"]), "down_proj": (conf["intermediate_size"], H)},
             "moe": {"shared_experts.up_proj": (H, S), "shared_experts.down_proj": (S, H),
                     **({"fc1_latent_proj": (H, latent), "fc2_latent_proj": (latent, H)} if latent else {}),
                     **{f"experts.{j}.{p}": io for j in range(conf["n_routed_experts"])
                        for p, io in (("up_proj", (D, I)), ("down_proj", (I, D)))}}}
    out = {}
    for i, kind in enumerate(conf["layers_block_type"]):
        for module, (d_in, d_out) in kinds[kind].items():
            out[f"base_model.model.backbone.layers.{i}.mixer.{module}"] = ((r, d_in), (d_out, r))
    return out


def test_published_policies_vllm_layout_and_peft_logits(hf_model, tmp_path):
    """`TrainingClient.publish` (the GRPO learner's publishing, in a background thread): the vllm format's tensors
    are exactly the names and shapes vLLM's nemotron_h LoRA loader reads (a table from vLLM's source), in bf16 when
    asked; old versions are pruned; the peft format loads in peft with our logits; a format that cannot hold a
    target is refused before anything is written."""
    from safetensors import safe_open

    from nemo_jax.rl.client import TrainingClient
    from nemo_jax.rl.transport.policy import latest_policy, published_versions

    d, cfg, params, toks = hf_model
    with open(d / "hf" / "config.json") as f:
        conf = json.load(f)
    r = 4
    lc = LoraConfig(targets=("all",), rank=r, alpha=8.0)
    client = TrainingClient(cfg, params, lc)
    client.state = client.state._replace(params=jax.tree.map(jnp.asarray, random_adapters(cfg, lc.targets, rank=r)))
    run = tmp_path / "run"
    for v in range(4):  # versions 0..3, keep the newest 2 and every 3rd (wait: else a newer one may replace a pending)
        client.version = v
        client.publish(str(run), format="vllm", dtype=jnp.bfloat16, keep=2, keep_every=3, wait=True)
    assert published_versions(str(run)) == [0, 2, 3] and latest_policy(str(run))[0] == 3
    with safe_open(str(run / "policy" / "3" / "adapter_model.safetensors"), framework="np") as f:
        got = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
        dtypes = {f.get_slice(k).get_dtype() for k in f.keys()}
    want = _vllm_nemotron_h_table(conf, r)
    assert got == {f"{m}.lora_{ab}.weight": s for m, (a, b) in want.items() for ab, s in (("A", a), ("B", b))}
    assert dtypes == {"BF16"}
    with open(run / "policy" / "3" / "adapter_config.json") as f:
        ac = json.load(f)
    supported = {"q_proj", "k_proj", "v_proj", "o_proj", "in_proj", "out_proj", "up_proj", "down_proj",
                 "fc1_latent_proj", "fc2_latent_proj"}  # the linear layers of vLLM's nemotron_h (+ packed q/k/v)
    assert ac["r"] == r and ac["lora_alpha"] == 8.0 and set(ac["target_modules"]) <= supported
    assert not ac.get("target_parameters")
    # peft: every target but Mamba out_proj (peft refuses it: refused up front, nothing written)
    with pytest.raises(ValueError, match=r"peft cannot hold .*out_proj"):
        client.publish(str(tmp_path / "refused"), format="peft")
    assert not (tmp_path / "refused").exists()
    lc2 = LoraConfig(targets=("attention", r"^layers/mamba/mixer/in_proj/kernel$", "mlp", "experts"), rank=r, alpha=8.0)
    peft_client = TrainingClient(cfg, params, lc2)
    ad = jax.tree.map(jnp.asarray, random_adapters(cfg, lc2.targets, rank=r, seed=3))
    peft_client.state = peft_client.state._replace(params=ad)
    peft_client.publish(str(tmp_path / "run2"), format="peft", wait=True)
    base = transformers.NemotronHForCausalLM.from_pretrained(d / "hf").eval()
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        pm = peft.PeftModel.from_pretrained(base, str(tmp_path / "run2" / "policy" / "0")).eval()
    assert np.max(np.abs(hf_logits(pm, toks) - ours(params, ad, toks, cfg))) <= 1e-4
    client.close()
    peft_client.close()


def test_grpo_refuses_targets_the_publish_format_cannot_hold(tmp_path):
    from nemo_jax.rl.grpo import GRPORunner, load_grpo_config

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    c = load_grpo_config(os.path.join(root, "configs/grpo/tiny-cpu.yaml"), [
        f"run_dir={tmp_path / 'run'}", "model.init=random", "model.init_sft_config=null", "lora.init=null",
        "lora.targets=[mamba]",
        "rollout.publish_format=peft"])
    with pytest.raises(ValueError, match=r"rollout.publish_format=peft cannot hold the adapters on 1 target\(s\): "
                                         r"peft refuses LoRA on Mamba out_proj .*layers/mamba/mixer/out_proj/kernel.*"
                                         r"use rollout.publish_format=vllm"):
        GRPORunner(c, quiet=True)
    assert not (tmp_path / "run").exists()


def test_cli_warnings_are_one_line(tmp_path):
    """`nemo-jax lora export --format peft` of adapters on Mamba out_proj warns that peft refuses them: one line
    `nemo-jax lora export: warning: ...`, not the file, line and source line of the code that warned."""
    import subprocess
    import sys

    from nemo_jax.lora import save_adapter_checkpoint

    cfg = tiny_cfg("ME*-")
    lc = LoraConfig(targets=("mamba",), rank=4, alpha=8.0)
    save_adapter_checkpoint(str(tmp_path / "ck"), cfg, lc, random_adapters(cfg, lc.targets))
    out = subprocess.run([sys.executable, "-m", "nemo_jax.cli", "lora", "export", str(tmp_path / "ck"),
                          str(tmp_path / "peft"), "--format", "peft"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    lines = [x for x in out.stderr.splitlines() if x.strip()]
    said = [x for x in lines if "out_proj" in x]
    assert len(said) == 1 and said[0].startswith("nemo-jax lora export: warning: "), lines
    assert not any("warnings.warn" in x or ".py:" in x for x in lines), lines
