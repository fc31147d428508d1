"""The vision tower against transformers' `nemotron_h_omni` (the pinned oracle): logits with images, the
checkpoint round trip, and the host-side layout."""

import functools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="parity tests need torch (pip install -e '.[test]')")
transformers = pytest.importorskip("transformers", reason="parity tests need transformers (pip install -e '.[test]')")
from safetensors import safe_open  # noqa: E402
from safetensors.numpy import save_file  # noqa: E402

from nemo_jax import model as M  # noqa: E402
from nemo_jax.config.model import NemotronHConfig  # noqa: E402
from nemo_jax.hf.io import load_pretrained, save_pretrained  # noqa: E402
from nemo_jax.hf.mapping import build_table  # noqa: E402
from nemo_jax.model import vision  # noqa: E402

from helpers import micro_model  # noqa: E402

IMAGE_TOKEN = 90
TEXT = dict(vocab_size=97, hidden_size=32, layers_block_type=["mamba", "moe", "attention", "moe"],
            num_attention_heads=4, num_key_value_heads=2, head_dim=8, intermediate_size=48, mamba_num_heads=4,
            mamba_head_dim=8, ssm_state_size=8, n_groups=2, chunk_size=8, n_routed_experts=8, num_experts_per_tok=2,
            moe_intermediate_size=16, moe_shared_expert_intermediate_size=24)
VISION = dict(hidden_size=24, num_hidden_layers=2, num_attention_heads=2, patch_size=4, max_img_size=64,
              num_cls_tokens=2, num_registers=1, video_temporal_patch_size=2)


@functools.partial(jax.jit, static_argnames=("cfg",))
def logits_of(params, tokens, cfg, segment_ids=None, images=None):
    return M.forward(params, tokens, cfg, segment_ids, images=images, mtp=False)[0]


def tensors(path):
    out = {}
    for f in sorted(os.listdir(path)):
        if f.endswith(".safetensors"):
            with safe_open(os.path.join(path, f), framework="np") as st:
                out.update({k: st.get_tensor(k) for k in st.keys()})
    return out


def make_omni(path, mtp: int, seed: int = 0, **vision_kw):
    """A tiny random transformers omni model saved at `path` (with MTP tensors added when mtp > 0:
    transformers drops them, our loader wants them)."""
    from transformers.models.nemotron_h_omni import NemotronH_Omni_Reasoning_V3, NemotronH_Omni_Reasoning_V3_Config

    torch.manual_seed(seed)
    conf = NemotronH_Omni_Reasoning_V3_Config(text_config=dict(TEXT, num_nextn_predict_layers=mtp),
                                              vision_config=dict(VISION, **vision_kw), projector_hidden_size=40,
                                              vision_hidden_size=vision_kw.get("hidden_size", 24),
                                              image_token_id=IMAGE_TOKEN)
    model = NemotronH_Omni_Reasoning_V3(conf).eval()
    with torch.no_grad():  # biases, norms and layer scales off their constant initial values
        for name, p in model.named_parameters():
            if not name.startswith("language_model") or name.endswith(("A_log", ".D", "dt_bias")) or "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(path)
    if mtp:
        cfg = NemotronHConfig.from_file(path)
        rng = np.random.RandomState(seed)
        extra = {e.hf_name: rng.randn(*e.hf_shape).astype(np.float32) for e in build_table(cfg)
                 if e.hf_name.startswith("language_model.mtp.")}
        save_file({**tensors(path), **extra}, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    return model


@pytest.fixture(scope="module", params=[0, 1], ids=["no_mtp", "mtp"])
def omni(request, tmp_path_factory):
    path = str(tmp_path_factory.mktemp(f"omni{request.param}"))
    model = make_omni(path, request.param)
    cfg, params = load_pretrained(path, config_overrides={"clamp_dt": True})
    return path, model, cfg, params


def prompt(rng, grids, merge=2, text=5):
    """Token ids: text, then per image <img> placeholders </img> text."""
    ids = list(rng.randint(3, 80, text))
    for h, w in grids:
        ids += [81] + [IMAGE_TOKEN] * (h * w // merge ** 2) + [82] + list(rng.randint(3, 80, 3))
    return np.asarray(ids)[None]


@pytest.mark.parametrize("grids", [[], [(4, 6)], [(6, 10), (4, 4), (2, 8)]], ids=["text", "one", "three"])
def test_logits_match_transformers(omni, grids):
    path, model, cfg, params = omni
    assert cfg.vision is not None and ("final_layernorm" in params["vision"]) == bool(cfg.num_nextn_predict_layers)
    rng = np.random.RandomState(len(grids))
    toks = prompt(rng, grids)
    kw = {}
    if grids:
        grid = np.asarray(grids)
        pix = rng.randn(int(grid.prod(-1).sum()), cfg.vision.patch_dim).astype(np.float32)
        kw = dict(pixel_values=pix, image_grid_hw=grid)
    with torch.no_grad():
        want = model(input_ids=torch.tensor(toks), **{k: torch.tensor(v) for k, v in kw.items()}).logits.numpy()
    images = vision.pack_inputs(cfg.vision, toks, kw["pixel_values"], kw["image_grid_hw"]) if grids else None
    got = logits_of(params, jnp.asarray(toks), cfg, images=images)
    assert np.max(np.abs(np.asarray(got) - want)) <= 1e-4


def test_other_tower_variants_match_transformers(tmp_path):
    """SwiGLU MLP, no q/k/v bias, no registers, a wider tower with more heads, quick GELU never seen above."""
    model = make_omni(str(tmp_path / "hf"), 0, seed=3, use_swiglu_ffn=True, qkv_bias=False, num_registers=0,
                      num_cls_tokens=1, hidden_size=32, num_attention_heads=4, hidden_act="quick_gelu",
                      summary_idxs=[0])
    cfg, params = load_pretrained(str(tmp_path / "hf"), config_overrides={"clamp_dt": True})
    assert cfg.vision.use_swiglu_ffn and not cfg.vision.qkv_bias and cfg.vision.n_prefix == 1
    rng = np.random.RandomState(5)
    grid = np.asarray([(6, 4), (2, 10)])
    toks = prompt(rng, grid.tolist())
    pix = rng.randn(int(grid.prod(-1).sum()), cfg.vision.patch_dim).astype(np.float32)
    with torch.no_grad():
        want = model(input_ids=torch.tensor(toks), pixel_values=torch.tensor(pix),
                     image_grid_hw=torch.tensor(grid)).logits.numpy()
    got = logits_of(params, jnp.asarray(toks), cfg, images=vision.pack_inputs(cfg.vision, toks, pix, grid))
    assert np.max(np.abs(np.asarray(got) - want)) <= 1e-4
    save_pretrained(cfg, params, tmp_path / "out")
    original, back = tensors(tmp_path / "hf"), tensors(tmp_path / "out")
    assert original.keys() == back.keys() and all(back[k].tobytes() == a.tobytes() for k, a in original.items())


def test_round_trip_bit_exact_and_reloads_in_transformers(omni, tmp_path):
    path, model, cfg, params = omni
    save_pretrained(cfg, params, tmp_path / "out")
    original, back = tensors(path), tensors(tmp_path / "out")
    assert original.keys() == back.keys()
    assert all(back[k].tobytes() == a.tobytes() and back[k].dtype == a.dtype for k, a in original.items())
    with open(tmp_path / "out" / "config.json") as f:
        assert NemotronHConfig.from_hf_dict(json.load(f)) == NemotronHConfig.from_file(path)
    from transformers.models.nemotron_h_omni import NemotronH_Omni_Reasoning_V3

    again = NemotronH_Omni_Reasoning_V3.from_pretrained(tmp_path / "out").eval()
    want = model.state_dict()
    for k, v in again.state_dict().items():
        assert torch.equal(v, want[k]), k
    # and through the native streaming path (import-hf / export-hf)
    from nemo_jax.cli import main

    main(["import-hf", path, str(tmp_path / "native")])
    main(["export-hf", str(tmp_path / "native"), str(tmp_path / "back")])
    back = tensors(tmp_path / "back")
    assert all(back[k].tobytes() == a.tobytes() for k, a in original.items())


def test_layout_pixel_shuffle_and_positions():
    """The layout's merge order is transformers' pixel_shuffle, its taps torch's bilinear resize + crop."""
    cfg = NemotronHConfig.from_hf_dict({"model_type": "nemotron_h_omni", "text_config": dict(TEXT),
                                        "vision_config": VISION, "image_token_id": IMAGE_TOKEN})
    v = cfg.vision
    from transformers.models.nemotron_h_omni.modeling_nemotron_h_omni import NemotronH_Omni_Reasoning_V3

    h, w, C = 6, 10, 3
    lay = vision.layout(v, [(h, w)], max_patches=80, max_images=2)
    feats = np.arange(h * w * C, dtype=np.float32).reshape(h, w, C)
    seq = np.zeros((lay["kind"].shape[0], C), np.float32)
    seq[lay["kind"] == 2] = feats.reshape(-1, C)
    ours = seq[lay["shuffle"][lay["token_valid"]]].reshape(-1, 4 * C)
    shuffled = NemotronH_Omni_Reasoning_V3.pixel_shuffle(None, torch.tensor(feats)[None])
    want = shuffled.reshape(-1, 4 * C).numpy()
    np.testing.assert_array_equal(ours, want)
    table = np.random.RandomState(0).randn(v.max_grid, v.max_grid, 5).astype(np.float32)
    t = torch.tensor(table).permute(2, 0, 1)[None]
    for h, w in ((6, 10), (4, 2 * v.max_grid + 2)):  # the table shrunk, and grown past its own size
        side = max(h, w)
        ref = torch.nn.functional.interpolate(t, size=(side, side), mode="bilinear", align_corners=False)
        idx, wt = vision.position_taps(v, h, w)
        got = (table.reshape(-1, 5)[idx] * wt[..., None]).sum(1)
        np.testing.assert_allclose(got, ref[0, :, :h, :w].permute(1, 2, 0).reshape(-1, 5).numpy(), atol=1e-5)


def test_bad_image_inputs_are_named():
    cfg = NemotronHConfig.from_hf_dict({"model_type": "nemotron_h_omni", "text_config": dict(TEXT),
                                        "vision_config": VISION, "image_token_id": IMAGE_TOKEN})
    v = cfg.vision
    toks = prompt(np.random.RandomState(0), [(4, 4)])
    with pytest.raises(ValueError, match="placeholder"):
        vision.pack_inputs(v, toks, np.zeros((32, v.patch_dim)), [[4, 8]])
    with pytest.raises(ValueError, match="pixel_values"):
        vision.pack_inputs(v, toks, np.zeros((16, 7)), [[4, 4]])
    with pytest.raises(ValueError, match="multiple of the pixel-shuffle"):
        vision.layout(v, [(3, 4)], 64, 1)
    with pytest.raises(ValueError, match="budget"):
        vision.layout(v, [(4, 4), (4, 4)], 64, 1)


def _hf_image_processing():
    """transformers' nemotron_h_omni image-processing module. Its processor class needs torchvision, which has
    no build for the pinned CPU torch; without it the module's pure functions (grid choice, patch cutting)
    are imported past a stub, and the resize is the call torchvision makes for float images
    (`F.interpolate(mode="bicubic", antialias=True)`)."""
    import importlib
    import sys
    import types

    name = "transformers.models.nemotron_h_omni.image_processing_nemotron_h_omni"
    try:
        import torchvision  # noqa: F401
        return importlib.import_module(name), True
    except ImportError:
        pass
    stubs = {m: types.ModuleType(m) for m in ("torchvision", "torchvision.transforms", "torchvision.transforms.v2")}
    stubs["torchvision.transforms.v2"].functional = types.ModuleType("torchvision.transforms.v2.functional")
    saved = {m: sys.modules.get(m) for m in stubs}
    sys.modules.update(stubs)
    try:
        return importlib.import_module(name), False
    finally:
        for m, mod in saved.items():
            if mod is None:
                sys.modules.pop(m, None)
            else:
                sys.modules[m] = mod


@pytest.mark.parametrize("hw", [(50, 80), (33, 120), (200, 64), (64, 64), (17, 300)])
def test_preprocess_matches_transformers(hw):
    from PIL import Image

    from nemo_jax.config.vision import VisionConfig
    from nemo_jax.data.images import patch_budget, preprocess

    v = VisionConfig(patch_size=16, min_num_patches=16, max_num_patches=64)
    img = np.random.RandomState(hw[0]).randint(0, 256, (*hw, 3)).astype(np.uint8)
    pix, grid = preprocess([Image.fromarray(img)], v)
    hf, real = _hf_image_processing()
    if real:
        proc = hf.NemotronH_Omni_Reasoning_V3ImageProcessor(patch_size=16, min_num_patches=16, max_num_patches=64)
        out = proc(images=[Image.fromarray(img)], return_tensors="np")
        want, want_grid = out["pixel_values"], out["image_grid_hw"]
    else:
        gh, gw = hf.get_patch_grid_size(*hw, 16, 2, 16, patch_budget(v, 1))
        t = torch.tensor(img).permute(2, 0, 1)[None].float()
        if (gh * 16, gw * 16) != hw:
            t = torch.nn.functional.interpolate(t, size=(gh * 16, gw * 16), mode="bicubic", align_corners=False,
                                                antialias=True)
        mean = torch.tensor(v.norm_mean).view(1, 3, 1, 1) * 255
        std = torch.tensor(v.norm_std).view(1, 3, 1, 1) * 255
        want = hf.convert_image_to_patches((t - mean) / std, 16)[0].numpy()
        want_grid = np.array([[gh, gw]])
    np.testing.assert_array_equal(grid, want_grid)
    np.testing.assert_allclose(pix, want, atol=2e-4)


# --------------------------------------------------------------------------- data: image parts, packing, loader
VL_TOKENIZER = "builtin:tiny_vl"


@pytest.fixture(scope="module")
def vl():
    """The shipped tiny vision-language model config, random params and its tokenizer."""
    from nemo_jax.data.chat import ChatTokenizer
    from nemo_jax.model.spec import init
    from nemo_jax.train.sft import model_config_path

    cfg = NemotronHConfig.from_file(model_config_path("tiny-vl"))
    return cfg, jax.jit(init, static_argnums=0)(cfg, jax.random.key(0)), ChatTokenizer.load(VL_TOKENIZER)


def _pictures(tmp_path, sizes):
    from PIL import Image

    rng = np.random.RandomState(0)
    paths = []
    for i, (h, w) in enumerate(sizes):
        p = tmp_path / f"p{i}.png"
        Image.fromarray(rng.randint(0, 256, (h, w, 3)).astype(np.uint8)).save(p)
        paths.append(str(p))
    return paths


def _conv(images, q="What is it?", a="A red square."):
    parts = [{"type": "image", "path": p} for p in images]
    return {"messages": [{"role": "user", "content": parts + [{"type": "text", "text": q}]},
                         {"role": "assistant", "content": a}]}


def test_image_parts_parse_and_bad_images_are_named(vl, tmp_path):
    import base64

    from nemo_jax.data.chat import DataError, parse_record, read_chat_jsonl

    cfg, _, tok = vl
    pics = _pictures(tmp_path, [(40, 64), (64, 64)])
    data_url = "data:image/png;base64," + base64.b64encode(open(pics[1], "rb").read()).decode()
    rec = {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": data_url}}, {"type": "text", "text": "and"},
        {"type": "image", "path": os.path.basename(pics[0])}]}, {"role": "assistant", "content": "Two."}]}
    doc = parse_record(json.dumps(rec), tok, cfg.vocab_size, base_dir=str(tmp_path))
    assert doc.images == [data_url, pics[0]] and doc.image_hw == [[64, 64], [40, 64]]
    assert int(np.sum(doc.ids == cfg.vision.image_token_id)) == 2 and not doc.mask[doc.ids == 502].any()
    (tmp_path / "corrupt.png").write_bytes(b"\x89PNG not really")
    lines = [json.dumps(_conv([pics[0]])), json.dumps(_conv(["missing.png"])), json.dumps(_conv(["corrupt.png"])),
             json.dumps({"messages": [{"role": "user", "content": [{"type": "audio", "path": "a.wav"}]},
                                      {"role": "assistant", "content": "x"}]})]
    (tmp_path / "d.jsonl").write_text("\n".join(lines) + "\n")
    with pytest.raises(DataError, match=r"d.jsonl:2: .*missing.png"):
        read_chat_jsonl(str(tmp_path / "d.jsonl"), tok, cfg.vocab_size)
    docs, skipped = read_chat_jsonl(str(tmp_path / "d.jsonl"), tok, cfg.vocab_size, on_error="skip")
    assert len(docs) == 1 and skipped == 3
    (tmp_path / "e.jsonl").write_text(lines[2] + "\n")
    with pytest.raises(DataError, match=r"e.jsonl:1: .*corrupt.png: cannot read image"):
        read_chat_jsonl(str(tmp_path / "e.jsonl"), tok, cfg.vocab_size)
    (tmp_path / "f.jsonl").write_text(lines[3] + "\n")
    with pytest.raises(DataError, match=r"f.jsonl:1: .*audio parts are not supported"):
        read_chat_jsonl(str(tmp_path / "f.jsonl"), tok, cfg.vocab_size)
    from nemo_jax.data.chat import ChatTokenizer

    with pytest.raises(DataError, match="no <image> token"):
        parse_record(json.dumps(_conv([pics[0]])), ChatTokenizer.load("builtin:tiny"), cfg.vocab_size)


def test_packed_image_document_matches_alone(vl, tmp_path):
    """Rows of the data loader: an image document packed among others gets the logits it gets alone."""
    from nemo_jax.data.chat import pack, parse_record
    from nemo_jax.data.images import RowImages

    cfg, params, tok = vl
    pics = _pictures(tmp_path, [(48, 64), (64, 40), (64, 64)])
    docs = [parse_record(json.dumps(c), tok, cfg.vocab_size) for c in (
        {"messages": [{"role": "user", "content": "Hi there."}, {"role": "assistant", "content": "Hello."}]},
        _conv(pics[:2], "Compare them."), _conv(pics[2:], "And this one?"))]
    ri = RowImages(cfg.vision, max_patches=256, max_images=4)
    docs = [ri.expand(d) for d in docs]

    def run(ds):
        row = pack(ds, 200)
        row.update(ri.row([ri.load(d) for d in ds if d.image_hw]))
        b = jax.tree.map(lambda x: jnp.asarray(x)[None], row)
        images = {k: b[k] for k in ("pixel_values",) + vision.LAYOUT_KEYS}
        return np.asarray(logits_of(params, b["tokens"], cfg, b["segment_ids"], images)[0])

    packed, off = run(docs), len(docs[0].ids)
    for d in docs[1:]:
        alone = run([d])
        n = len(d.ids)
        np.testing.assert_allclose(packed[off:off + n], alone[:n], atol=2e-5)
        off += n


def test_loader_rows_hold_their_documents_images_within_budget(vl, tmp_path):
    from nemo_jax.data.chat import parse_record
    from nemo_jax.data.images import RowImages
    from nemo_jax.data.loader import PackedIterator

    cfg, _, tok = vl
    pics = _pictures(tmp_path, [(48, 64), (64, 40), (64, 64), (80, 80)])
    convs = [_conv(pics[i % 4: i % 4 + 1 + i % 2]) for i in range(24)]
    convs += [{"messages": [{"role": "user", "content": "Text only."}, {"role": "assistant", "content": "Yes."}]}] * 8
    docs = [parse_record(json.dumps(c), tok, cfg.vocab_size) for c in convs]
    ri = RowImages(cfg.vision, max_patches=160, max_images=3)
    it = PackedIterator(docs, 128, 4, seed=0, images=ri, repeat=False)
    v, n_rows = cfg.vision, 0
    for b in it:
        assert b["pixel_values"].shape == (4, 160, v.patch_dim) and b["kind"].shape == (4, 160 + 3 * v.n_prefix)
        for r in range(4):
            placeholders = int(np.sum(b["tokens"][r] == v.image_token_id))
            assert placeholders == int(b["token_valid"][r].sum())  # every placeholder has its image token
            assert int(np.sum(b["kind"][r] == 2)) <= 160 and len(set(b["segment"][r]) - {0}) <= 3
            n_rows += bool(b["segment_ids"][r].any())
    assert n_rows >= 4 and it.dropped == 0


@pytest.mark.slow
def test_generate_with_images_prefill_matches_forward(vl, tmp_path):
    from nemo_jax.generate import SamplingParams, generate, prefill, prompt_images

    cfg, params, tok = vl
    pics = _pictures(tmp_path, [(48, 64), (64, 64)])
    ids, images = prompt_images(tok, cfg, "What are these?", pics)
    assert ids.count(cfg.vision.image_token_id) == int(images["token_valid"].sum())
    logits = logits_of(params, jnp.asarray([ids]), cfg, images=images)
    last, _ = prefill(params, [ids], cfg, len(ids) + 4, images=images)
    np.testing.assert_allclose(np.asarray(last[0]), np.asarray(logits[0, -1]), atol=2e-5)
    g = generate(params, [ids], cfg, SamplingParams(max_new_tokens=4, temperature=0.0), images=images)
    assert len(g.tokens[0]) == 4 and all(lp <= 0 for lp in g.logprobs[0])


# --------------------------------------------------------------------------- SFT with images on a mesh
VL_SFT = ["model.config=tiny-vl", "data.train=builtin:tiny_vl_chat/train.jsonl", "data.eval=null",
          f"data.tokenizer={VL_TOKENIZER}", "data.seq_len=128", "data.batch_size=8", "data.max_image_patches=192",
          "data.max_images=3", "log_every=1", "eval_every=0", "checkpoint.async_save=false", "optim.warmup_steps=2"]


def _trainer(run_dir, *extra, devices=None):
    from nemo_jax.config.load import load_config
    from nemo_jax.config.train import SFTConfig
    from nemo_jax.train.sft import Trainer

    return Trainer(load_config(SFTConfig, None, VL_SFT + [f"run_dir={run_dir}", *extra]), quiet=True, devices=devices)


def _losses(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [r["loss"] for r in map(json.loads, f) if "loss" in r]


@pytest.mark.slow
def test_vl_sft_one_and_eight_devices_agree_and_the_tower_shards(tmp_path):
    # the tower and projector in full; the language model cut to attention + MLP (its layer kinds are tested
    # sharded in test_sft): 3x faster to compile
    micro = f"model.config={micro_model(tmp_path, 'tiny-vl')}"
    a = _trainer(tmp_path / "one", "steps=3", micro, devices=jax.devices()[:1])
    a.run()
    b = _trainer(tmp_path / "eight", "steps=3", micro, "mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2")
    fc1 = b.state.params["vision"]["layers"]["mlp"]["fc1"]["kernel"]
    assert fc1.sharding.spec[1:] == ("fsdp", "tensor")
    assert fc1.addressable_shards[0].data.size * 4 == fc1.size  # split 4 ways (fsdp x tensor), like its Adam moments
    mu = b.state.opt_state[1][0].mu["vision"]["layers"]["mlp"]["fc1"]["kernel"]
    assert mu.sharding.spec == fc1.sharding.spec
    b.run()
    la, lb = _losses(tmp_path / "one"), _losses(tmp_path / "eight")
    assert len(la) == 3 and la[-1] < la[0]
    np.testing.assert_allclose(la, lb, rtol=1e-4)


@pytest.mark.slow
def test_vl_sft_freeze_vision_then_generate_with_an_image(tmp_path, capsys):
    micro = f"model.config={micro_model(tmp_path, 'tiny-vl')}"  # the language model cut to attention + MLP
    t = _trainer(tmp_path / "frozen", "steps=2", "model.freeze_vision=true", micro, devices=jax.devices()[:1])
    before = jax.tree.map(np.asarray, t.state.params)
    assert not any("vision" in jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(t.state.opt_state)[0])
    t.run()
    after = jax.tree.map(np.asarray, t.state.params)
    for x, y in zip(jax.tree.leaves(before["vision"]), jax.tree.leaves(after["vision"])):
        np.testing.assert_array_equal(x, y)
    assert not np.array_equal(before["projector"]["linear_1"]["kernel"], after["projector"]["linear_1"]["kernel"])
    # `nemo-jax generate --image` on the run
    from nemo_jax.cli import main

    pic = os.path.join(os.path.dirname(vision.__file__), "..", "assets", "tiny_vl_chat", "images", "img00001.png")
    main(["generate", "--ckpt", str(tmp_path / "frozen"), "--image", pic, "--prompt", "What shape is it?",
          "--max-new-tokens", "3", "--temperature", "0"])
    with pytest.raises(SystemExit):
        main(["generate", "--ckpt", str(tmp_path / "frozen"), "--image", str(tmp_path / "nope.png"), "--prompt", "x"])
    assert "nope.png: cannot read image" in capsys.readouterr().err


def test_blocked_vit_attention_matches_the_plain_one_in_values_and_gradients():
    rng = np.random.RandomState(0)
    B, S, H, hd = 2, 37, 2, 4
    q, k, v = (jnp.asarray(rng.randn(B, S, H, hd), jnp.float32) for _ in range(3))
    seg = jnp.asarray(np.stack([np.repeat([1, 2, 3, 0], [10, 12, 9, 6]), np.repeat([1, 2], [30, 7])]), jnp.int32)
    w = jnp.asarray(rng.randn(B, S, H, hd), jnp.float32)

    def loss(q, k, v, block):
        return jnp.sum(vision.attention(q, k, v, seg, jnp.float32, block) * w)

    for block in (5, 16):
        np.testing.assert_allclose(vision.attention(q, k, v, seg, jnp.float32, block),
                                   vision.attention(q, k, v, seg, jnp.float32, S), atol=1e-6)
        ga = jax.grad(loss, argnums=(0, 1, 2))(q, k, v, block)
        gb = jax.grad(loss, argnums=(0, 1, 2))(q, k, v, S)
        for x, y in zip(ga, gb):
            np.testing.assert_allclose(x, y, atol=1e-5)


# --------------------------------------------------------------------------- RL with pictures
class Pictures:
    """An image environment in the episode form: the first observation holds a picture, the answer to the first
    turn is a tool result with a second picture (a zoom), then the episode ends."""
    name, max_turns = "pictures", 2

    def tasks(self, split):
        from nemo_jax.rl.envs import Task

        return [Task(c, ()) for c in ("red", "blue")]

    def episode(self):
        from PIL import Image

        from nemo_jax.rl.envs import Observation

        class Ep:
            def start(self, task, rollout_id):
                self.task, self.n = task, 0
                img = Image.new("RGB", (48, 32), task.id)
                return Observation([{"role": "user", "content": [{"type": "image", "image": img},
                                                                 {"type": "text", "text": "What colour?"}]}])

            def step(self, message):
                self.n += 1
                if self.n == 1:
                    zoom = Image.new("RGB", (24, 40), "green" if self.task.id == "red" else "white")
                    return Observation([{"role": "tool", "content": [{"type": "text", "text": "zoom:"},
                                                                     {"type": "image", "image": zoom}]}])
                return Observation([], float(len(message["content"]) % 2), True)

            def close(self):
                pass

        return Ep()


@pytest.mark.slow
def test_rl_rollouts_with_images_train_on_the_pictures_they_were_sampled_with(vl, tmp_path, monkeypatch):
    """Pictures in an episode's observations (the opening message and a tool result) go through the engine's
    prefill and continuation, into the rollouts as content-hashed files under the run dir, through validation,
    and into the learner batch: the learner's logprobs equal the sampler's behaviour logprobs, and they depend
    on the pictures."""
    import nemo_jax.rl.transport.producer as producer
    from nemo_jax.lora import LoraConfig
    from nemo_jax.rl.client import TrainingClient
    from nemo_jax.rl.rollout import ImageStore, RolloutImages, learner_batch, validate

    cfg, params, tok = vl
    monkeypatch.setattr(producer, "stop_ids", lambda cfg, tok: tuple(range(0, 500)))  # most turns stop at once
    client = TrainingClient(cfg, params, LoraConfig(("attention",), 2, 4.0))
    store = ImageStore(str(tmp_path / "run" / "images"))
    env = Pictures()
    rs = producer.sample_rollouts(client.engine(batch=2, max_len=256), tok, cfg, env,
                                  [(t, t.id) for t in env.tasks("train")], 2, 3, 1.0, images=store)
    assert all(len(r.images) == 2 for r in rs if sum(r.loss_mask) > 1)  # both turns: both pictures
    assert any(len(r.images) == 2 for r in rs)
    v = cfg.vision
    for r in rs:
        d = json.loads(json.dumps(r.to_json()))  # a spool record
        assert all(os.path.exists(store.path(x)) and not x["path"].startswith("/") for x in d["images"])
        ok = validate(d, cfg.vocab_size, vision=v, image_root=store.root)
        assert not isinstance(ok, str) and ok.images == r.images
        assert validate(d, cfg.vocab_size) == "bad_images"  # a text model is given pictures
        bad = dict(d, images=[dict(d["images"][0], sha256="0" * 64)] + d["images"][1:])
        assert validate(bad, cfg.vocab_size, vision=v, image_root=store.root) == "bad_images"
    for r in rs:
        r.reward = float(r.rollout_id.endswith("0"))  # (a signal in each group)
    seq = max(len(r.tokens) for r in rs)
    batch, _ = learner_batch([rs[:2], rs[2:]], seq, images=RolloutImages(v, store.root, 256, 4))
    assert batch["pixel_values"].shape == (4, 256, v.patch_dim)
    lp = client.compute_logprobs(batch)
    m = batch["loss_mask"]
    np.testing.assert_allclose(lp[m], batch["behaviour_logprobs"][m], atol=1e-5)
    blind = client.compute_logprobs(dict(batch, pixel_values=np.zeros_like(batch["pixel_values"])))
    assert np.abs(blind[m] - lp[m]).max() > 1e-3  # the learner sees the pictures
