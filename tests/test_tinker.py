"""The Tinker API (nemo_jax.tinker) as the official `tinker` SDK (0.38.0) meets it: a real `nemo-jax serve
--tinker-root` process over the tiny model (its Mamba, attention and MoE layers, as an HF dir), driven by the SDK
(SL and RL loops, sampling, resume, two clients, a hostile client); and, without a server, each loss and its
gradient against numpy, AdamW against torch, the protobuf codec against the SDK's own converters, the futures,
the checkpoint paths."""

import asyncio
import json
import os
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

tinker = pytest.importorskip("tinker", reason="the Tinker API tests drive the official SDK (pip install "
                                               "'nemo_jax[tinker]')")
pytest.importorskip("fastapi", reason="nemo-jax serve needs fastapi + uvicorn")
import httpx  # noqa: E402
from tinker import types  # noqa: E402

from test_serve import Server as ServeProcess  # noqa: E402

from nemo_jax.config.model import NemotronHConfig  # noqa: E402
from nemo_jax.tinker import wire  # noqa: E402
from nemo_jax.tinker.losses import LOSSES, loss_config, refusal, token_losses  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KEY = "sekrit"  # the server's --api-key; the SDK sends tml-sekrit
BATCH = ["--tinker-batch-clients", "4"]  # clients ready at once run batched (the default runs each alone)
os.environ.setdefault("TINKER_TELEMETRY", "0")


def _tiny_cfg(kinds=("linear_attention", "full_attention", "moe")):
    with open(os.path.join(ROOT, "nemo_jax", "assets", "models", "tiny.json")) as f:
        hf = json.load(f)
    hf.update(layers_block_type=list(kinds), num_hidden_layers=len(kinds))
    return NemotronHConfig.from_hf_dict(hf)


# ============================================================================= without a server
def _np_losses(kind, lp, w, mu, adv, lo=0.8, hi=1.2):
    """numpy reference: per-token loss and its derivative by the learner's logprob."""
    if kind == "cross_entropy":
        return -lp * w, -w
    r = np.exp(lp - mu)
    if kind == "importance_sampling":
        return -r * adv, -r * adv
    c = np.clip(r, lo, hi)
    if kind == "ppo":
        unclipped = r * adv <= c * adv
        return -np.minimum(r * adv, c * adv), np.where(unclipped, -r * adv, 0.0)
    return -c * lp * adv, -c * adv  # cispo: the clipped ratio held constant


def test_losses_and_gradients_match_numpy():
    rng = np.random.default_rng(0)
    N, T = 3, 7
    lp = -rng.uniform(0.1, 3.0, (N, T))
    mu = lp + rng.choice([-0.6, -0.1, 0.05, 0.15, 0.5], (N, T))  # ratios inside and outside [0.8, 1.2]
    adv = rng.choice([-1.5, -0.3, 0.4, 2.0], (N, T))
    w = rng.uniform(-0.5, 1.0, (N, T))  # negative weights too (forward_backward_custom sends them)
    mask = np.ones((N, T))
    mask[1, 5:] = 0  # padding: contributes exactly nothing
    for kind in LOSSES:
        conf = loss_config(kind, {"clip_low_threshold": 0.9} if kind in ("ppo", "cispo") else {})
        inputs = {"weights": w, "logprobs": mu, "advantages": adv, "mask": mask}
        inputs = {k: jnp.asarray(v, jnp.float32) for k, v in inputs.items()}
        f = lambda x: jnp.sum(token_losses(kind, x, inputs, conf))  # noqa: E731
        val, grad = jax.value_and_grad(f)(jnp.asarray(lp, jnp.float32))
        want, dwant = _np_losses(kind, lp, w, mu, adv, lo=conf.get("clip_low_threshold", 0.8))
        np.testing.assert_allclose(float(val), np.sum(want * mask), rtol=1e-5, err_msg=kind)
        np.testing.assert_allclose(np.asarray(grad), dwant * mask, rtol=1e-5, atol=1e-6, err_msg=kind)
    assert "importance_sampling" in refusal("stable_reinforce") and refusal("cross_entropy") is None
    assert "custom" in refusal("custom") and "unknown loss_fn" in refusal("nope")
    with pytest.raises(ValueError, match="clip_low_threshold <= clip_high_threshold"):
        loss_config("ppo", {"clip_low_threshold": 1.5})
    with pytest.raises(ValueError, match="not one of"):
        loss_config("cross_entropy", {"clip_low_threshold": 0.5})


@pytest.mark.slow
def test_adamw_is_torch_adamw():
    torch = pytest.importorskip("torch")
    from nemo_jax.tinker.learner import adamw, zeros_like_trained

    rng = np.random.default_rng(1)
    params = {"x": {"lora_a": rng.normal(size=(3, 4)).astype(np.float32),
                    "lora_b": rng.normal(size=(4, 2)).astype(np.float32), "lora_scale": np.float32(4.0)}}
    tp = [torch.tensor(params["x"]["lora_a"], requires_grad=True), torch.tensor(params["x"]["lora_b"],
                                                                                 requires_grad=True)]
    opt = torch.optim.AdamW(tp, lr=1e-2, betas=(0.9, 0.95), eps=1e-12, weight_decay=0.1)
    p = jax.tree.map(jnp.asarray, params)
    m, v = zeros_like_trained(p), zeros_like_trained(p)
    for step, (lr, clip) in enumerate([(1e-2, 0.0), (5e-3, 0.5), (2e-2, 100.0)]):
        g = {"x": {"lora_a": rng.normal(size=(3, 4)).astype(np.float32),
                   "lora_b": rng.normal(size=(4, 2)).astype(np.float32), "lora_scale": np.float32(0)}}
        for t, k in zip(tp, ("lora_a", "lora_b")):
            t.grad = torch.tensor(g["x"][k])
        if clip:
            torch.nn.utils.clip_grad_norm_(tp, clip)
        for group in opt.param_groups:
            group["lr"] = lr
        opt.step()
        hp = {"learning_rate": lr, "beta1": 0.9, "beta2": 0.95, "eps": 1e-12, "weight_decay": 0.1,
              "grad_clip_norm": clip}
        p, m, v, _, finite = adamw(p, jax.tree.map(jnp.asarray, g), m, v, jnp.int32(step),
                                   {k: jnp.float32(x) for k, x in hp.items()})
        assert bool(finite)
        for t, k in zip(tp, ("lora_a", "lora_b")):
            np.testing.assert_allclose(np.asarray(p["x"][k]), t.detach().numpy(), rtol=1e-5, atol=1e-6)
        assert float(p["x"]["lora_scale"]) == 4.0  # a constant: never updated, never decayed
    bad = jax.tree.map(lambda x: jnp.full(jnp.shape(x), jnp.nan), p)
    p2, _, _, _, finite = adamw(p, bad, m, v, jnp.int32(3), {k: jnp.float32(x) for k, x in hp.items()})
    assert not bool(finite) and np.array_equal(np.asarray(p2["x"]["lora_a"]), np.asarray(p["x"]["lora_a"]))


def test_wire_matches_the_sdk_converters():
    from tinker.proto.request_conv import forward_backward_request_to_proto
    from tinker.proto.response_conv import deserialize_forward_backward_output, deserialize_sample_response

    torch = pytest.importorskip("torch")
    dense = types.Datum(model_input=types.ModelInput.from_ints([3, 4, 5]),
                        loss_fn_inputs={"target_tokens": [4, 5, 6], "weights": [0.0, 1.0, 0.5]})
    sparse_w = torch.zeros(3, 2)
    sparse_w[1, 0] = 2.0
    sparse = types.Datum(model_input=types.ModelInput.from_ints([7, 8, 9]),
                         loss_fn_inputs={"target_tokens": [8, 9, 10],
                                         "weights": types.TensorData.from_torch_sparse(sparse_w)})
    req = types.ForwardBackwardRequest(forward_backward_input=types.ForwardBackwardInput(
        data=[dense, sparse], loss_fn="ppo", loss_fn_config={"clip_low_threshold": 0.7, "tag": "x"}),
        model_id="abcd:train:0", seq_id=3)
    out = wire.decode_forward_backward(forward_backward_request_to_proto(req).SerializeToString())
    assert (out.model_id, out.seq_id, out.loss_fn, out.config) == ("abcd:train:0", 3, "ppo",
                                                                   {"clip_low_threshold": 0.7, "tag": "x"})
    assert [c.tolist() for c in out.data[0].chunks] == [[3, 4, 5]]
    assert out.data[0].inputs["target_tokens"].dtype == np.int64 and out.data[0].inputs["weights"].tolist() == \
        [0.0, 1.0, 0.5]
    np.testing.assert_array_equal(out.data[1].inputs["weights"], sparse_w.numpy())
    with pytest.raises(wire.UserError, match="not a protobuf"):
        wire.decode_forward_backward(b"\xff\xff\xff")
    # results, read back by the SDK's own converters
    lps = [np.asarray([-1.0, -2.5], np.float32), np.asarray([-0.5], np.float32)]
    fb = deserialize_forward_backward_output(wire.encode_forward_backward_output(
        [{"logprobs": x} for x in lps], {"loss:sum": 4.0}))
    assert fb.metrics == {"loss:sum": 4.0} and [o["logprobs"].tolist() for o in fb.loss_fn_outputs] == \
        [x.tolist() for x in lps]
    sr = deserialize_sample_response(wire.encode_sample_response(
        [wire.Sequence([1, 2, 3], [-0.1, -0.2, -0.3], True, [[(1, -0.1), (4, -2.0)]] * 3)],
        np.asarray([np.nan, -1.5, -0.5], np.float32), topk=2))
    assert sr.sequences[0].tokens == [1, 2, 3] and sr.sequences[0].stop_reason == "stop"
    assert sr.prompt_logprobs[0] is None and sr.prompt_logprobs[1:] == [-1.5, -0.5]
    assert sr.sequences[0].topk_logprobs[0] == [(1, pytest.approx(-0.1)), (4, -2.0)]
    with pytest.raises(wire.UserError, match="audio"):
        wire.model_input({"chunks": [{"type": "dmel", "dmel": ""}]})


def test_futures_long_poll_errors_and_other_runs():
    from nemo_jax.tinker.futures import FutureStore

    store = FutureStore()

    async def run():
        rec = store.create("optim_step")
        t0 = time.monotonic()
        assert (await store.retrieve(rec.id, hold=0.05))["type"] == "try_again"
        threading.Timer(0.1, store.complete, (rec.id, {"metrics": {}})).start()
        assert await store.retrieve(rec.id, hold=5.0) == {"metrics": {}}  # answered as it finished, not at 5 s
        assert time.monotonic() - t0 < 2.0
        bad = store.create("forward_backward")
        store.fail(bad.id, "datum 0: no", "user")
        assert await store.retrieve(bad.id) == {"error": "datum 0: no", "category": "user"}
        lost = await store.retrieve("0000beef-7")  # an id an earlier run of the server gave out
        assert lost["category"] == "server" and "restarted" in lost["error"]
        assert (await store.retrieve(f"{store.instance}-999999"))["category"] == "user"
    asyncio.run(run())


def test_lora_flags_and_checkpoint_paths(tmp_path):
    from nemo_jax.lora import LoraConfig, init_adapters
    from nemo_jax.tinker.registry import lora_targets
    from nemo_jax.tinker.store import Store, parse_path

    tiny = _tiny_cfg(("linear_attention", "full_attention", "moe", "mlp"))
    assert lora_targets(tiny, True, True, True) == ("attention", "mamba", "mlp", "experts", "lm_head")
    assert lora_targets(tiny, train_mlp=False, train_attn=True, train_unembed=False) == ("attention", "mamba")
    assert lora_targets(_tiny_cfg(("full_attention", "mlp")), True, False, False) == ("mlp",)
    for bad in ("tinker://a/weights/x", "tinker://abcd:train:0/weights/../x", "tinker://abcd:train:0/other/x",
                "file:///etc/passwd", "tinker://abcd:train:0/weights/.hidden", "tinker://ab/cd:train:0/weights/x"):
        with pytest.raises(wire.UserError):
            parse_path(bad)
    cfg = _tiny_cfg(("full_attention", "mlp"))
    lc = LoraConfig(("attention",), rank=2, alpha=32.0)
    ad = jax.tree.map(np.asarray, init_adapters(cfg, lc))
    m = jax.tree.map(lambda x: np.full(np.shape(x), 0.5, np.float32), ad)
    st = Store(str(tmp_path / "root"))
    path = st.save("abcd:train:0", "weights", "s1", cfg, lc, ad, meta={"step": 3}, optimizer=(m, m, 3))
    assert path == "tinker://abcd:train:0/weights/s1"
    assert os.path.isdir(tmp_path / "root" / "abcd_train_0" / "weights" / "s1")
    lc2, ad2, (m2, _, step), meta = st.load(path, cfg, optimizer=True)
    assert lc2 == lc and step == 3 and meta["step"] == 3
    jax.tree.map(np.testing.assert_array_equal, ad2, ad)
    with pytest.raises(wire.UserError, match="exists"):
        st.save("abcd:train:0", "weights", "s1", cfg, lc, ad, meta={})
    foreign = tmp_path / "root" / "abcd_train_0" / "weights" / "mine"
    foreign.mkdir()
    (foreign / "keep.txt").write_text("x")
    with pytest.raises(wire.UserError, match="not a checkpoint this server wrote"):
        st.delete("abcd:train:0", "weights", "mine")
    assert (foreign / "keep.txt").exists()
    st.delete("abcd:train:0", "weights", "s1")
    assert not os.path.exists(tmp_path / "root" / "abcd_train_0" / "weights" / "s1")


@pytest.mark.slow
def test_image_chunks_reach_the_vision_tower():
    """An image chunk becomes as many placeholders as the processor makes of it (expected_tokens checked), and its
    pixels reach the model: another picture changes the logprobs of the text after it."""
    import io

    from PIL import Image

    from nemo_jax.data.images import picture_tokens
    from nemo_jax.lora import LoraConfig, init_adapters
    from nemo_jax.model import init
    from nemo_jax.tinker.learner import Learner
    from nemo_jax.tinker.sampling import flatten

    with open(os.path.join(ROOT, "nemo_jax", "assets", "models", "tiny-vl.json")) as f:
        hf = json.load(f)
    hf["text_config"].update(layers_block_type=["full_attention"], num_hidden_layers=1)
    cfg = NemotronHConfig.from_hf_dict(hf)
    params = init(cfg, jax.random.key(0))

    def png(color):
        buf = io.BytesIO()
        Image.new("RGB", (40, 24), color).save(buf, "png")
        return buf.getvalue()
    n = picture_tokens(cfg.vision, Image.new("RGB", (40, 24)))
    chunks = lambda img, exp=None: [np.asarray([5, 6]), wire.Image(img, "png", exp), np.asarray([7, 8, 9])]  # noqa
    tokens, pics = flatten(cfg, chunks(png("red"), n), "datum 0")
    assert len(tokens) == 5 + n and int((tokens == cfg.vision.image_token_id).sum()) == n and len(pics) == 1
    with pytest.raises(wire.UserError, match=f"makes {n} tokens here, not expected_tokens={n + 1}"):
        flatten(cfg, chunks(png("red"), n + 1), "datum 0")
    with pytest.raises(wire.UserError, match="no vision tower"):
        flatten(_tiny_cfg(("mlp",)), chunks(png("red")), "datum 0")
    learner = Learner(cfg, params)
    ad = init_adapters(cfg, LoraConfig(("attention",), 4, 32.0))

    def logprobs(color):
        t, p = flatten(cfg, chunks(png(color)), "datum 0")
        row = {"tokens": t[:-1], "targets": t[1:], "weights": np.ones(len(t) - 1), "pics": [x for _, x in p]}
        lp, _, grads = learner.run(ad, [row], "cross_entropy", {}, backward=True)
        assert all(np.isfinite(np.asarray(g)).all() for g in jax.tree.leaves(grads))
        return lp[0]
    red, blue = logprobs("red"), logprobs("blue")
    np.testing.assert_allclose(red[:2], blue[:2], atol=1e-6)  # before the picture: the same
    assert np.abs(red[2 + n:] - blue[2 + n:]).max() > 1e-4  # after it: the pixels count


@pytest.mark.slow
def test_a_new_client_compiles_nothing():
    """Every client's adapters run through the same compiled programs (the learner's jits take them as an
    argument): a second adapter set of the same shape compiles nothing: its initialisation, forward, backward and
    AdamW."""
    from nemo_jax.lora import LoraConfig
    from nemo_jax.model import init
    from nemo_jax.tinker.learner import Learner, adamw, new_adapters, zeros_like_trained

    cfg = _tiny_cfg(("full_attention", "mlp"))
    learner = Learner(cfg, init(cfg, jax.random.key(0)))
    rows = [{"tokens": np.arange(3, 14), "targets": np.arange(4, 15), "weights": np.ones(11)} for _ in range(3)]
    hp = {k: jnp.float32(v) for k, v in dict(learning_rate=1e-3, beta1=0.9, beta2=0.95, eps=1e-12,
                                              weight_decay=0.0, grad_clip_norm=0.0).items()}
    compiles = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda name, secs, **kw: compiles.append(name) if name.endswith("backend_compile_duration") else None)

    def client(seed):
        ad = new_adapters(cfg, LoraConfig(("attention", "mlp"), 8, 32.0, init_seed=seed))
        lp, losses, grads = learner.run(ad, rows, "cross_entropy", {}, backward=True)
        learner.run(ad, rows, "cross_entropy", {}, backward=False)
        m = zeros_like_trained(ad)
        jax.block_until_ready(adamw(ad, grads, m, m, jnp.int32(0), hp))
        return lp
    client(1)
    before = len(compiles)
    client(2)
    assert len(compiles) == before, compiles[before:]


def test_the_sequencer_batches_models_only_in_their_own_order():
    """Forward_backward requests of several models with one merge key run as one group (the handler gets them
    all), each model's in its seq order: a model whose next queued request is something else (or another loss)
    stays out with all its later requests, at most `batch_models` models join, and the rest run after, in order."""
    from nemo_jax.tinker.futures import FutureStore
    from nemo_jax.tinker.sequencer import Item, Kind, Sequencer

    class Reg:
        lock = threading.Lock()
        models: dict = {}

        def touched(self, m): pass

        def expire(self): pass

    class M:
        def __init__(self, name):
            self.id, self.next_seq, self.pending, self.seen, self.blocked_since = name, 1, {}, {}, None
    ran, go = [], threading.Event()
    handlers = {k: (lambda items: ran.append([(it.model.id, it.seq, it.kind.name[:2]) for it in items])) for k in Kind}
    handlers[Kind.CREATE] = lambda items: go.wait(30)  # holds the worker while the queue fills
    futures = FutureStore()
    seq = Sequencer(futures, handlers, Reg(), batch_models=3)
    seq.enqueue(Item(Kind.CREATE, None))
    a, b, c, d, e, f = (M(x) for x in "abcdef")
    ce, ppo = ("cross_entropy", (), False), ("ppo", (), False)
    fb, op = Kind.FORWARD_BACKWARD, Kind.OPTIM
    seq.submit(a, 1, fb, {}, ce)
    seq.submit(b, 1, op, {})  # b's next is an optim step: its forward_backward after it may not join
    seq.submit(b, 2, fb, {}, ce)
    seq.submit(a, 2, fb, {}, ce)  # a's second chunk merges
    seq.submit(c, 1, fb, {}, ppo)  # another loss
    seq.submit(d, 1, fb, {}, ce)
    seq.submit(e, 1, fb, {}, ce)
    seq.submit(f, 1, fb, {}, ce)  # a fourth model: over batch_models, it leads the next batch
    seq.submit(d, 2, op, {})
    go.set()
    deadline = time.time() + 30
    while len(ran) < 5 and time.time() < deadline:
        time.sleep(0.01)
    seq.close()
    assert ran == [[("a", 1, "FO"), ("a", 2, "FO"), ("d", 1, "FO"), ("e", 1, "FO")], [("b", 1, "OP")],
                   [("b", 2, "FO"), ("f", 1, "FO")], [("c", 1, "FO")], [("d", 2, "OP")]], ran


@pytest.mark.slow
def test_batched_clients_equal_one_at_a_time():
    """`Learner.run_many`: several adapter sets' batches (rows of many lengths, more groups than one call holds,
    a policy loss with its config) in batched calls give each set's logprobs, loss sums and gradients as `run`
    alone does (1e-5), on Mamba, attention and MoE layers; a call holds at most max_tokens tokens."""
    from nemo_jax.lora import LoraConfig
    from nemo_jax.model import init
    from nemo_jax.model.model import unstack_layers
    from nemo_jax.tinker.learner import Learner, new_adapters

    cfg = _tiny_cfg(("linear_attention", "full_attention", "moe"))
    learner = Learner(cfg, jax.jit(unstack_layers)(init(cfg, jax.random.key(0))), max_tokens=512)
    rng = np.random.default_rng(0)
    lora = LoraConfig(("all", "lm_head"), 8, 32.0)
    ads = [jax.tree.map(lambda x: x + 0.02 * rng.standard_normal(x.shape).astype(x.dtype),
                        new_adapters(cfg, LoraConfig(lora.targets, 8, 32.0, init_seed=k))) for k in range(3)]

    def row(n):
        return {"tokens": rng.integers(3, 500, n), "targets": rng.integers(3, 500, n), "weights": rng.random(n),
                "logprobs": -rng.random(n), "advantages": rng.standard_normal(n)}
    jobs = [(ads[0], [row(n) for n in (12, 30, 7)]), (ads[1], [row(n) for n in (40, 5)]),
            (ads[2], [row(n) for n in (33, 31, 64, 9, 3, 17, 20, 28, 30, 29)])]
    parts = [(j, k, idx, N, T) for j, (_, rows) in enumerate(jobs)
             for k, (idx, N, T) in enumerate(learner.groups([len(r["tokens"]) for r in rows]))]
    calls = learner.calls(parts, [False] * len(parts), 8)
    assert max(len(c) for c in calls) >= 2 and len(calls) < len(parts)  # some calls batch several models
    assert all(max(p[3] for p in c) * c[0][4] * (1 << (len(c) - 1).bit_length()) <= 512 for c in calls if len(c) > 1)
    for loss_fn, conf, backward in (("cross_entropy", {}, True), ("ppo", loss_config("ppo", {}), True),
                                    ("importance_sampling", {}, False)):
        many = learner.run_many(jobs, loss_fn, conf, backward)
        for (ad, rows), got in zip(jobs, many):
            one = learner.run(ad, rows, loss_fn, conf, backward)
            for a, b in zip(one[0], got[0]):
                np.testing.assert_allclose(a, b, atol=1e-5, err_msg=loss_fn)
            np.testing.assert_allclose(one[1], got[1], rtol=1e-5, err_msg=loss_fn)
            assert (got[2] is None) == (not backward)
            for a, b in zip(jax.tree.leaves(one[2]), jax.tree.leaves(got[2])):
                np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, err_msg=loss_fn)
    # the accelerators' kernels (interpret mode): GPU's map over the clients alike; TPU's splash attention does not
    # (a tracer leaks under vmap), so there each client runs alone: the same results either way
    from nemo_jax.model.model import Options

    small = _tiny_cfg(("full_attention", "moe"))
    base = jax.jit(unstack_layers)(init(small, jax.random.key(1)))
    two = [(new_adapters(small, LoraConfig(("all",), 4, 32.0, init_seed=k)), [row(20), row(9)]) for k in range(2)]
    for platform in ("gpu", "tpu"):
        kl = Learner(small, base, opts=Options(kernels=platform, interpret_kernels=True))
        assert kl._mappable() == (platform == "gpu")
        for (ad, rows), got in zip(two, kl.run_many(two, "cross_entropy", {}, True)):
            one = kl.run(ad, rows, "cross_entropy", {}, True)
            for a, b in zip(jax.tree.leaves(one[2]), jax.tree.leaves(got[2])):
                np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, err_msg=platform)


# ============================================================================= a real server, the official SDK
class Server(ServeProcess):
    """`nemo-jax serve` with the Tinker API under `root` and the tests' key (test_serve's server process)."""

    def __init__(self, tmp, hf: str, root: str, extra=(), env: dict | None = None, launcher=()):
        super().__init__(tmp, ["--ckpt", hf, "--tinker-root", root, "--served-model-name", "tiny", "--max-model-len",
                               "128", "--max-num-seqs", "4", "--bucket", "32", "--max-request-mb", "1",
                               "--tinker-max-rank", "16", "--shutdown-timeout", "1", *extra], api_key=KEY, env=env,
                         launcher=launcher)

    def sdk(self):
        client = tinker.ServiceClient(base_url=self.url, api_key="tml-" + KEY)
        self.clients = getattr(self, "clients", []) + [client]
        return client

    def close(self):
        try:
            for client in getattr(self, "clients", []):  # (else their heartbeat threads warn once the server is gone)
                client.close("success").result(timeout=30)
        finally:
            super().close()


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """The tiny model cut to an attention and an MLP layer (`helpers.micro_model`'s shape: what is tested here does
    not depend on the layer kinds, and its learner compiles ~5x faster than with Mamba and MoE layers; those are
    exercised by tools/tiers/tinker_cookbook.py and bench/tinker.py on the whole tiny model), random fp32 weights, as an
    HF dir with its tokenizer; served with the Tinker API under ROOT."""
    from nemo_jax.data.chat import resolve
    from nemo_jax.hf.io import save_pretrained
    from nemo_jax.model import init

    tmp = tmp_path_factory.mktemp("tinker")
    cfg = _tiny_cfg(("full_attention", "mlp"))
    params = init(cfg, jax.random.key(0))
    hf = str(tmp / "tiny-hf")
    save_pretrained(cfg, params, hf, tokenizer_dir=resolve("builtin:tiny"))
    srv = Server(tmp, hf, str(tmp / "root"), extra=BATCH)
    srv.hf, srv.root, srv.cfg, srv.params, srv.tmp = hf, str(tmp / "root"), cfg, params, tmp
    try:
        yield srv
    finally:
        srv.close()


def _seqs(seed: int, n: int = 4, length: int = 12):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 500, size=length).tolist() for _ in range(n)]


def _datum(seq, **inputs):
    """A sequence -> Datum predicting seq[1:] from seq[:-1]; `inputs` over the targets (default weights 1)."""
    inputs = inputs or {"weights": [1.0] * (len(seq) - 1)}
    return types.Datum(model_input=types.ModelInput.from_ints(seq[:-1]),
                       loss_fn_inputs={"target_tokens": seq[1:], **inputs})


def _rl_datum(prompt, seq, advantage: float):
    """A sampled sequence -> Datum for the policy losses: the sampler's logprobs and `advantage` on its tokens."""
    full, n = prompt + seq.tokens, len(prompt) - 1
    return types.Datum(model_input=types.ModelInput.from_ints(full[:-1]),
                       loss_fn_inputs={"target_tokens": full[1:], "logprobs": [0.0] * n + list(seq.logprobs),
                                       "advantages": [0.0] * n + [float(advantage)] * len(seq.tokens)})


def _base_logprobs(srv, seq, adapters=None):
    from nemo_jax.lora import attach
    from nemo_jax.model import forward

    logits = forward(attach(srv.params, adapters), jnp.asarray([seq[:-1]]), srv.cfg)[0][0]
    lp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return np.asarray(jnp.take_along_axis(lp, jnp.asarray(seq[1:])[:, None], axis=-1)[:, 0])


def _train(tc, data, steps: int, lr: float = 1e-2, loss_fn="cross_entropy"):
    """`steps` pipelined forward_backward + optim_step on `data` -> the loss:sum of each."""
    out = []
    for _ in range(steps):
        fb = tc.forward_backward(data, loss_fn)
        op = tc.optim_step(types.AdamParams(learning_rate=lr))
        out.append(fb.result().metrics["loss:sum"])
        op.result()
    return out


@pytest.mark.slow
def test_sl_loop_loss_halves_and_logprobs_are_the_base(served):
    srv = served
    caps = tinker.RestClient(base_url=srv.url, api_key="tml-" + KEY).get_server_capabilities().result()
    assert [m.model_name for m in caps.supported_models] == ["tiny"]
    sc = srv.sdk()
    tc = sc.create_lora_training_client(base_model="tiny", rank=8, seed=1).result()
    info = tc.get_info()
    assert info.lora_rank == 8 and info.model_data.tokenizer_id == srv.hf
    assert tc.get_tokenizer().encode("hello") == tc.get_tokenizer().encode("hello")  # loads offline, from the dir
    seqs = _seqs(0)
    w = [1.0, 0.0, 0.5, -0.25, 2.0, 1.0, 1.0, 0.0, 1.0, 1.0, 1.0]
    data = [_datum(s, weights=w) for s in seqs]
    out = tc.forward(data, "cross_entropy").result()  # a fresh adapter set: the base model's logprobs
    lps = [np.asarray(o["logprobs"].data) for o in out.loss_fn_outputs]
    for s, lp in zip(seqs, lps):
        np.testing.assert_allclose(lp, _base_logprobs(srv, s), atol=1e-4)
    assert out.metrics["loss:sum"] == pytest.approx(-sum(float((lp * np.asarray(w)).sum()) for lp in lps),
                                                    rel=1e-5)
    losses = _train(tc, [_datum(s) for s in seqs], 6)
    assert losses[-1] <= losses[0] / 2, losses
    # a custom loss runs client-side over cross_entropy (weights = -dC/dlogprobs): here C = -sum(lp), plain CE
    custom = tc.forward_backward_custom([_datum(s) for s in seqs], lambda d, lps: (-sum(x.sum() for x in lps), {}))
    assert custom.result().metrics["loss:sum"] == pytest.approx(
        tc.forward([_datum(s) for s in seqs], "cross_entropy").result().metrics["loss:sum"], rel=1e-4)
    sc.close("success").result()


@pytest.mark.slow
def test_resume_matches_step_for_step_and_checkpoints_are_nemo_jax_adapters(served):
    from nemo_jax.cli import main
    from nemo_jax.sources import load_adapter_set

    srv = served
    data = [_datum(s) for s in _seqs(1)]
    sc = srv.sdk()
    tc = sc.create_lora_training_client("tiny", rank=8, seed=2).result()
    _train(tc, data, 2)
    path = tc.save_state("two").result().path
    ahead = _train(tc, data, 2)
    after = [np.asarray(o["logprobs"].data) for o in tc.forward(data, "cross_entropy").result().loss_fn_outputs]
    sc2 = srv.sdk()  # another session, as after a restart of the training script
    resumed = sc2.create_training_client_from_state_with_optimizer(path).result()
    assert resumed.get_info().lora_rank == 8
    assert _train(resumed, data, 2) == pytest.approx(ahead, rel=1e-5)
    again = [np.asarray(o["logprobs"].data) for o in resumed.forward(data, "cross_entropy").result().loss_fn_outputs]
    for a, b in zip(after, again):
        np.testing.assert_allclose(a, b, atol=1e-5)
    fresh_opt = sc2.create_training_client_from_state(path).result()  # weights only: Adam starts afresh
    other = _train(fresh_opt, data, 2)
    assert other[0] == pytest.approx(ahead[0], rel=1e-5) and other[1] != pytest.approx(ahead[1], rel=1e-4)
    # the checkpoint is an ordinary nemo-jax adapter checkpoint: read back, it is the trained model
    run = tc.model_id.replace(":", "_")
    ckpt = os.path.join(srv.root, run, "weights", "two")
    cfg, lc, ad = load_adapter_set(ckpt)
    assert lc.rank == 8 and lc.alpha == 32.0 and lc.targets == ("attention", "mlp", "lm_head")
    run_info = tinker.RestClient(base_url=srv.url, api_key="tml-" + KEY).get_training_run_by_tinker_path(path)
    assert run_info.result().lora_rank == 8
    main(["lora", "export", ckpt, str(srv.tmp / "peft"), "--format", "peft"])
    assert os.path.exists(srv.tmp / "peft" / "adapter_config.json")
    resumed2 = srv.sdk().create_training_client_from_state(path).result()
    lp2 = [np.asarray(o["logprobs"].data) for o in resumed2.forward(data[:1], "cross_entropy").result()
           .loss_fn_outputs]
    np.testing.assert_allclose(lp2[0], _base_logprobs(srv, _seqs(1)[0], jax.tree.map(jnp.asarray, ad)), atol=1e-4)
    rc = tinker.RestClient(base_url=srv.url, api_key="tml-" + KEY)
    assert [c.tinker_path for c in rc.list_checkpoints(tc.model_id).result().checkpoints] == [path]
    assert tc.model_id in [r.training_run_id for r in rc.list_training_runs(limit=100).result().training_runs]
    rc.delete_checkpoint_from_tinker_path(path).result()
    assert not os.path.exists(ckpt)


@pytest.mark.slow
def test_sampling_logprobs_stops_and_importance_sampling(served):
    srv = served
    sc = srv.sdk()
    tc = sc.create_lora_training_client("tiny", rank=8, seed=3).result()
    sampler = tc.save_weights_and_get_sampling_client().result()
    prompt = _seqs(2, n=1, length=10)[0]
    sp = types.SamplingParams(max_tokens=6, seed=11, temperature=1.0)
    res = sampler.sample(types.ModelInput.from_ints(prompt), 4, sp).result()
    again = sampler.sample(types.ModelInput.from_ints(prompt), 4, sp).result()
    assert [s.tokens for s in res.sequences] == [s.tokens for s in again.sequences]  # seeded
    assert len({tuple(s.tokens) for s in res.sequences}) > 1 and len({s.sequence_id for s in res.sequences}) == 4
    first = res.sequences[0]
    lps = sampler.compute_logprobs(types.ModelInput.from_ints(prompt + first.tokens)).result()
    assert lps[0] is None
    np.testing.assert_allclose(lps[len(prompt):], first.logprobs, atol=1e-3)
    # a stop token ends the sequence and is returned with it
    stop = first.tokens[2]
    cut = sampler.sample(types.ModelInput.from_ints(prompt), 1,
                         types.SamplingParams(max_tokens=6, seed=11, stop=[stop])).result().sequences[0]
    assert cut.tokens == first.tokens[:first.tokens.index(stop) + 1] and cut.stop_reason == "stop"
    tok = tc.get_tokenizer()
    text = tok.decode(first.tokens)
    word = text[len(tok.decode(first.tokens[:2])):][:2]  # text the third token or later spells
    if word:
        cut = sampler.sample(types.ModelInput.from_ints(prompt), 1,
                             types.SamplingParams(max_tokens=6, seed=11, stop=[word])).result().sequences[0]
        assert cut.stop_reason == "stop" and first.tokens[:len(cut.tokens)] == cut.tokens
        assert word in tok.decode(cut.tokens) and word not in tok.decode(cut.tokens[:-1])
    # named sampler weights, and a sampling client made from their path
    named = tc.save_weights_for_sampler("snap").result().path
    assert named.endswith("/sampler_weights/snap")
    from_path = sc.create_sampling_client(model_path=named).result()
    np.testing.assert_allclose(from_path.compute_logprobs(types.ModelInput.from_ints(prompt + first.tokens))
                               .result()[1:], lps[1:], atol=1e-4)
    inflight = tc.save_weights_and_get_sampling_client(kind="inflight").result()
    # importance sampling with positive advantages raises the sampled continuation's logprob
    data = [_rl_datum(prompt, q, 1.0) for q in res.sequences]
    fb = tc.forward_backward(data, "importance_sampling").result()
    assert fb.metrics["loss:sum"] == pytest.approx(-sum(len(s.tokens) for s in res.sequences), rel=1e-3)  # r = 1
    tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    later = tc.save_weights_and_get_sampling_client().result()
    new = later.compute_logprobs(types.ModelInput.from_ints(prompt + first.tokens)).result()
    assert sum(new[len(prompt):]) > sum(first.logprobs) + 0.5
    moved = inflight.compute_logprobs(types.ModelInput.from_ints(prompt + first.tokens)).result()
    np.testing.assert_allclose(moved[len(prompt):], new[len(prompt):], atol=1e-4)  # inflight: the newest weights
    # the earlier sampling client still samples from its snapshot
    old = sampler.compute_logprobs(types.ModelInput.from_ints(prompt + first.tokens)).result()
    np.testing.assert_allclose(old[len(prompt):], first.logprobs, atol=1e-3)
    sc.close("success").result()


@pytest.mark.slow
def test_rl_loop_reward_rises(served):
    """REINFORCE with group-centred advantages on a reward the model can learn: the share of sampled tokens from
    the lower half of the vocabulary."""
    srv = served
    sc = srv.sdk()
    tc = sc.create_lora_training_client("tiny", rank=8, seed=4).result()
    prompt = _seqs(3, n=1, length=8)[0]
    half = srv.cfg.vocab_size // 2

    def rollouts(sampler, seed, n=8):
        res = sampler.sample(types.ModelInput.from_ints(prompt), n,
                             types.SamplingParams(max_tokens=4, seed=seed, stop=[])).result()
        return res.sequences, np.asarray([np.mean(np.asarray(s.tokens) < half) for s in res.sequences])

    _, before = rollouts(tc.save_weights_and_get_sampling_client().result(), 999, 32)
    rewards = []
    for step in range(5):
        seqs, r = rollouts(tc.save_weights_and_get_sampling_client().result(), 100 + step)
        rewards.append(r.mean())
        tc.forward_backward([_rl_datum(prompt, q, a) for q, a in zip(seqs, r - r.mean())], "importance_sampling")
        tc.optim_step(types.AdamParams(learning_rate=5e-2)).result()
    _, after = rollouts(tc.save_weights_and_get_sampling_client().result(), 999, 32)  # the same draws as before
    assert after.mean() > before.mean() + 0.2, (before.mean(), rewards, after.mean())
    sc.close("success").result()


@pytest.mark.slow
def test_two_clients_at_once_and_a_new_client_starts_at_the_base(served):
    srv = served
    seqs = {0: _seqs(5), 1: _seqs(6)}
    out, errors = {}, []

    def client(k):
        try:
            sc = srv.sdk()
            base = "tiny" if k == 0 else srv.hf  # by its served name, and by the --ckpt path (as the cookbook)
            tc = sc.create_lora_training_client(base, rank=8, seed=10 + k).result()
            out[k] = (tc, _train(tc, [_datum(s) for s in seqs[k]], 3))
        except Exception as e:  # (re-raised below, in the test's thread)
            errors.append(e)
    threads = [threading.Thread(target=client, args=(k,)) for k in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for k in (0, 1):
        assert out[k][1][-1] < out[k][1][0], out[k][1]
    fresh = srv.sdk().create_lora_training_client("tiny", rank=8, seed=99).result()
    lp = np.asarray(fresh.forward([_datum(seqs[0][0])], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].data)
    np.testing.assert_allclose(lp, _base_logprobs(srv, seqs[0][0]), atol=1e-4)
    a = out[0][0].forward([_datum(seqs[0][0])], "cross_entropy").result().metrics["loss:sum"]
    b = out[1][0].forward([_datum(seqs[0][0])], "cross_entropy").result().metrics["loss:sum"]
    assert a < b  # each trained its own adapters


def _stats(srv) -> dict:
    return httpx.get(srv.url + "/api/v1/stats", headers={"X-API-Key": "tml-" + KEY}, timeout=30).json()


@pytest.mark.slow
def test_clients_at_once_run_batched_and_equal_one_at_a_time(served):
    """Four SDK clients stepping together (their forward_backward requests sent at once while the worker is busy,
    so they wait in the queue together and the server runs them as batched calls, which /api/v1/stats counts)
    train exactly as the same clients (seeds, data) one after another: each step's loss and the logprobs after
    1e-5."""
    srv = served
    data = {k: [_datum(s) for s in _seqs(20 + k, n=2 + k, length=10 + 7 * k)] for k in range(4)}

    def trajectory(k, barrier=None):
        tc = srv.sdk().create_lora_training_client("tiny", rank=8, seed=30 + k).result()
        losses = []
        for _ in range(3):
            if barrier is not None:
                barrier.wait(60)
            fb = tc.forward_backward(data[k], "cross_entropy")
            op = tc.optim_step(types.AdamParams(learning_rate=1e-2))
            losses.append(fb.result().metrics["loss:sum"])
            op.result()
        out = tc.forward(data[k], "cross_entropy").result().loss_fn_outputs
        return losses, [np.asarray(o["logprobs"].data) for o in out]
    before = _stats(srv)["batched"]["calls"]
    # each round starts with another client's large forward pass queued just before the four are let go: the worker
    # is busy with it while their requests arrive, so they wait in the queue together however loaded the machine
    blocker = srv.sdk().create_lora_training_client("tiny", rank=8, seed=99).result()
    big = [_datum(s) for s in _seqs(40, n=32, length=100)]
    together, errors = {}, []
    barrier = threading.Barrier(4, action=lambda: blocker.forward(big, "cross_entropy"))

    def client(k):
        try:
            together[k] = trajectory(k, barrier)
        except Exception as e:  # (re-raised below, in the test's thread)
            errors.append(e)
            barrier.abort()
    threads = [threading.Thread(target=client, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert _stats(srv)["batched"]["calls"] > before
    for k in range(4):
        alone = trajectory(k)
        assert together[k][0] == pytest.approx(alone[0], rel=1e-5), k
        assert together[k][0][-1] < together[k][0][0]
        for a, b in zip(together[k][1], alone[1]):
            np.testing.assert_allclose(a, b, atol=1e-5)


@pytest.mark.slow
def test_hostile_client_errors_and_the_server_lives_on(served):
    srv = served
    from tinker import RequestFailedError

    sc = srv.sdk()
    tc = sc.create_lora_training_client("tiny", rank=8, seed=7).result()
    ok = _datum(_seqs(7, n=1)[0])

    def refused(fut, *words):
        with pytest.raises((RequestFailedError, tinker.BadRequestError, tinker.NotFoundError)) as e:
            fut.result() if hasattr(fut, "result") else fut()
        for w in words:
            assert w in str(e.value), str(e.value)
        if isinstance(e.value, RequestFailedError):
            assert e.value.category == types.RequestErrorCategory.User
    mism = types.Datum(model_input=types.ModelInput.from_ints([5, 6, 7]),
                       loss_fn_inputs={"target_tokens": [6, 7], "weights": [1.0, 1.0]})
    refused(tc.forward_backward([mism], "cross_entropy"), "datum 0", "target_tokens", "shape")
    refused(tc.forward_backward([ok], "stable_reinforce"), "importance_sampling")
    refused(tc.forward_backward([ok], "foo"), "unknown loss_fn")
    nan = types.Datum(model_input=ok.model_input, loss_fn_inputs={
        "target_tokens": ok.loss_fn_inputs["target_tokens"], "logprobs": [0.0] * 11,
        "advantages": [float("nan")] + [0.0] * 10})
    refused(tc.forward_backward([nan], "importance_sampling"), "advantages", "not finite")
    oov = types.Datum(model_input=types.ModelInput.from_ints([5, 99999]),
                      loss_fn_inputs={"target_tokens": [6, 7], "weights": [1.0, 1.0]})
    refused(tc.forward_backward([oov], "cross_entropy"), "outside the vocabulary")
    refused(tc.forward_backward([ok], "ppo", {"clip_low_threshold": 2.0}), "clip_low_threshold")
    refused(tc.optim_step(types.AdamParams(learning_rate=float("inf"))), "learning_rate")
    refused(lambda: sc.create_lora_training_client("tiny", rank=64).result(), "rank", "16")
    refused(lambda: sc.create_lora_training_client("no-such-model", rank=4).result(), "unknown base model")
    refused(tc.save_state("../escape"), "checkpoint name")
    # after its failed requests the client goes on, in order
    assert np.isfinite(_train(tc, [ok], 1)[0])
    # raw HTTP: a wrong key, an oversized body, garbage protobuf, an unknown model
    h = {"X-API-Key": "tml-" + KEY, "Content-Type": wire.PROTO}
    assert httpx.post(srv.url + "/api/v1/client/config", json={}, headers={"X-API-Key": "tml-wrong"}).status_code == 401
    big = httpx.post(srv.url + "/api/v1/forward_backward", content=b"\0" * (2 << 20), headers=h)
    assert big.status_code == 413
    junk = httpx.post(srv.url + "/api/v1/forward_backward", content=b"\xff\x01garbage", headers=h)
    assert junk.status_code == 400 and "protobuf" in junk.text
    r = httpx.post(srv.url + "/api/v1/optim_step", headers={"X-API-Key": "tml-" + KEY},
                   json={"model_id": "ffff:train:9", "seq_id": 1, "adam_params": {"learning_rate": 1e-4}})
    assert r.status_code == 400 and "unknown model" in r.text
    r = httpx.post(srv.url + "/api/v1/retrieve_future", headers={"X-API-Key": "tml-" + KEY},
                   json={"request_id": "0000beef-1"})
    assert r.json()["category"] == "server" and "restarted" in r.json()["error"]
    # a client of another SDK version is told which one this server speaks
    r = httpx.post(srv.url + "/api/v1/create_session", headers={"X-API-Key": "tml-" + KEY},
                   json={"tags": [], "user_metadata": {}, "sdk_version": "0.20.0"})
    assert r.status_code == 200 and "tinker==0.38.0" in r.json()["warning_message"]
    old = httpx.post(srv.url + "/api/v1/forward_backward", headers={"X-API-Key": "tml-" + KEY, "x-sdk-version":
                                                                     "0.20.0"}, json={"model_id": tc.model_id})
    assert old.status_code == 400 and "pip install tinker==0.38.0" in old.text
    beat = httpx.post(srv.url + "/api/v1/session_heartbeat", headers={"X-API-Key": "tml-" + KEY},
                      json={"session_id": r.json()["session_id"]})
    assert beat.json() == {"type": "session_heartbeat"}
    assert httpx.post(srv.url + "/api/v1/session_heartbeat", headers={"X-API-Key": "tml-" + KEY},
                      json={"session_id": "nope"}).status_code == 404
    # the server and the client carry on
    assert httpx.get(srv.url + "/health").status_code == 200
    assert np.isfinite(_train(tc, [ok], 1)[0])
    sc.close("success").result()


@pytest.mark.slow
def test_seq_order_chunk_merging_and_retries_over_raw_http(served):
    """The protocol as the SDK drives it, by hand: a model's requests run in seq_id order whatever order they
    arrive in (optim_step before the chunks it follows; the chunks of one forward_backward last-first), the chunks
    run as one batch each answering its own datums, and a resubmitted seq_id gets the same future."""
    from tinker.proto.request_conv import forward_backward_request_to_proto
    from tinker.proto.response_conv import deserialize_forward_backward_output

    srv = served
    h = {"X-API-Key": "tml-" + KEY}

    def post(path, body, **kw):
        r = httpx.post(srv.url + "/api/v1/" + path, headers=dict(h, **kw.pop("headers", {})), json=body, **kw)
        assert r.status_code == 200, r.text
        return r.json()

    def result(rid):
        r = httpx.post(srv.url + "/api/v1/retrieve_future", headers=h, json={"request_id": rid}, timeout=60)
        return r.content if "protobuf" in r.headers["content-type"] else r.json()
    sid = post("create_session", {"tags": [], "user_metadata": {}, "sdk_version": tinker.__version__})["session_id"]
    made = post("create_model", {"session_id": sid, "model_seq_id": 0, "base_model": "tiny",
                                 "lora_config": {"rank": 8, "seed": 5}})
    mid = result(made["request_id"])["model_id"]
    seqs = _seqs(8)

    def chunk(seq_id, part):
        req = types.ForwardBackwardRequest(forward_backward_input=types.ForwardBackwardInput(
            data=[_datum(s) for s in part], loss_fn="cross_entropy"), model_id=mid, seq_id=seq_id)
        r = httpx.post(srv.url + "/api/v1/forward_backward", headers=dict(h, **{"Content-Type": wire.PROTO}),
                       content=forward_backward_request_to_proto(req).SerializeToString())
        assert r.status_code == 200, r.text
        return r.json()["request_id"]
    opt = post("optim_step", {"model_id": mid, "seq_id": 3, "adam_params": {"learning_rate": 1e-3}})["request_id"]
    b = chunk(2, seqs[2:])
    a = chunk(1, seqs[:2])
    assert chunk(1, seqs[:2]) == a  # a retried submission: the same future
    outs = [deserialize_forward_backward_output(result(x)) for x in (a, b)]
    lps = [np.asarray(o["logprobs"].data) for out in outs for o in out.loss_fn_outputs]
    for s, lp in zip(seqs, lps):
        np.testing.assert_allclose(lp, _base_logprobs(srv, s), atol=1e-4)
    assert result(opt)["metrics"]["grad_norm:mean"] > 0  # it ran after both chunks' gradients
    after = deserialize_forward_backward_output(result(chunk(4, seqs[:1])))
    assert not np.allclose(np.asarray(after.loss_fn_outputs[0]["logprobs"].data), lps[0], atol=1e-4)


# the SDK checks the sharded servers (tests/test_tinker_mesh.py, tests/test_tinker_processes.py) run too, against
# their own `served` fixture: `globals().update(shared_checks())` there
SDK_CHECKS = (test_sl_loop_loss_halves_and_logprobs_are_the_base, test_sampling_logprobs_stops_and_importance_sampling,
              test_two_clients_at_once_and_a_new_client_starts_at_the_base,
              test_clients_at_once_run_batched_and_equal_one_at_a_time)


def shared_checks() -> dict:
    return {f.__name__: f for f in SDK_CHECKS}
