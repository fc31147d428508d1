"""Accelerator kernels (nemo_jax.kernels) against the reference paths they replace, in values and gradients.

The Pallas kernels run in interpret mode on CPU (Options(kernels="gpu" | "tpu", interpret_kernels=True) or
`interpret=True`); blocks are shrunk so the short test sequences span several of them. The deviceless GPU / TPU
compiles (skipped without the plugins) check that a real target's program contains the kernels."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from nemo_jax import kernels as kernels_lib
from nemo_jax.kernels import Selection, flash
from nemo_jax.kernels import attention as kernel_attn
from nemo_jax.model import attention as attn_lib, model as M, moe as moe_lib
from nemo_jax.model.spec import init, mixer_specs

from helpers import tiny_cfg

GPU, TPU = Selection("gpu", interpret=True), Selection("tpu", interpret=True)


@pytest.fixture
def small_blocks(monkeypatch):
    """Flash blocks of 16 rows / keys (the Triton minimum), so a 37-token row spans 3 key blocks."""
    monkeypatch.setattr(flash, "BLOCK_Q", 16)
    monkeypatch.setattr(flash, "BLOCK_K", 16)


def _close(a, b, atol):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=0, atol=atol)


def _maxdiff(a, b):
    return max(float(jnp.max(jnp.abs(x - y))) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def _qkv(b, l, kv=2, r=2, hd=8, seed=0):
    ks = jax.random.split(jax.random.key(seed), 4)
    return (jax.random.normal(ks[0], (b, l, kv, r, hd)), jax.random.normal(ks[1], (b, l, kv, hd)),
            jax.random.normal(ks[2], (b, l, kv, hd)), jax.random.normal(ks[3], (b, l, kv * r * hd)))


def _segments(l):
    """Row 0: documents of 10, 20 and 7 tokens (boundaries inside key blocks of 16) ending in padding (0);
    row 1: all padding (segment 0 everywhere)."""
    row0 = np.concatenate([np.full(10, 1), np.full(20, 2), np.full(l - 33, 3), np.zeros(3, int)])
    return jnp.asarray(np.stack([row0, np.zeros(l, int)]), jnp.int32)


@pytest.mark.parametrize("impl,l", [("flash", 37), ("splash", 151)])
def test_causal_attention_kernels_match_reference(impl, l, small_blocks):
    """Packed causal GQA (r = 2) over an odd length: values and the gradients of q, k, v equal the blocked
    reference (fp32). flash: 74 query rows in 5 blocks over 3 key blocks; splash: 151 tokens in two tiles of
    128, the documents crossing tile and block boundaries, one row all padding."""
    q, k, v, ct = _qkv(2, l)
    seg = _segments(l)

    def loss(fn, q, k, v):
        out = fn(q, k, v)
        return jnp.sum(out * ct), out

    ref = lambda q, k, v: attn_lib._attend_blocked(q, k, v, seg, jnp.float32, 16)  # noqa: E731
    ker = lambda q, k, v: kernel_attn.causal(q, k, v, seg, jnp.float32, impl, interpret=True)  # noqa: E731
    run = lambda fn: jax.jit(jax.value_and_grad(lambda *a: loss(fn, *a), argnums=(0, 1, 2), has_aux=True))  # noqa: E731
    (_, o1), g1 = run(ref)(q, k, v)
    (_, o2), g2 = run(ker)(q, k, v)
    print(f"{impl}: max |out diff| {_maxdiff(o1, o2):.2e}, max |grad diff| {_maxdiff(g1, g2):.2e}")
    _close(o1, o2, 2e-5)
    _close(g1, g2, 1e-4)


def test_flash_kernel_lse_and_its_gradient(small_blocks):
    """The kernel's log-sum-exp and its cotangent (what ring attention and the cache merge use): equal to plain
    jnp over a mask of arbitrary row positions (an offset block of queries over keys that start later)."""
    b, lq, lk, kv, r, hd = 2, 21, 40, 2, 2, 8
    q, k, v, _ = _qkv(b, lq, kv, r, hd, seed=3)
    k, v = (jax.random.normal(jax.random.key(9 + i), (b, lk, kv, hd)) for i in range(2))
    q_pos = jnp.stack([jnp.arange(lq) + 19, jnp.arange(lq) + 5])
    kv_pos = jnp.broadcast_to(jnp.arange(lk), (b, lk))
    q_seg = jnp.ones((b, lq), jnp.int32)
    kv_seg = jnp.asarray(np.random.default_rng(0).integers(0, 2, (b, lk)) | (np.arange(lk) < 3), jnp.int32)

    def ref(q, k, v):
        rows = kernel_attn._rows(q)
        s = jnp.einsum("bkqd,bskd->bkqs", rows, k) * hd ** -0.5
        qp, qs = (jnp.repeat(a, r, axis=1) for a in (q_pos, q_seg))
        mask = (qp[:, None, :, None] >= kv_pos[:, None, None]) & (qs[:, None, :, None] == kv_seg[:, None, None])
        s = jnp.where(mask, s, flash.NEG)
        return jnp.einsum("bkqs,bskd->bkqd", jax.nn.softmax(s, -1), v), jax.nn.logsumexp(s, -1)

    ker = lambda q, k, v: kernel_attn.flash_rows(q, k, v, q_pos, kv_pos, q_seg, kv_seg, interpret=True)  # noqa: E731
    w = jnp.cos(jnp.arange(lq * r))
    loss = lambda f: lambda *a: jnp.sum(f(*a)[0] ** 2) + jnp.sum(f(*a)[1] * w)  # noqa: E731
    _close(ref(q, k, v), jax.jit(ker)(q, k, v), 2e-5)
    g1, g2 = (jax.jit(jax.grad(loss(f), argnums=(0, 1, 2)))(q, k, v) for f in (ref, ker))
    print(f"flash lse: max |grad diff| {_maxdiff(g1, g2):.2e}")
    _close(g1, g2, 1e-4)


def _attn_params(cfg, seed=0):
    specs = mixer_specs(cfg, "attention")
    leaves, tree = jax.tree.flatten(specs, is_leaf=lambda s: hasattr(s, "init"))
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    return jax.tree.unflatten(tree, [s.init(k, s.shape, s.dtype) for s, k in zip(leaves, keys)])


@pytest.mark.slow
def test_cached_attention_kernel_matches_reference(small_blocks):
    """Decode (a 3-token chunk over the cache as stored plus its own keys) and prefill (a 9-token chunk over
    the cache with the chunk written in) through `attention`: equal to the reference on every valid query, with
    left-padded rows, holes in the cache and per-row positions."""
    cfg = tiny_cfg("*")
    p = _attn_params(cfg)
    b, S, kv, hd = 2, 40, cfg.num_key_value_heads, cfg.head_dim
    ks = jax.random.split(jax.random.key(1), 3)
    cache = attn_lib.KVCache(*(jax.random.normal(k, (b, S, kv, hd)) for k in ks[:2]))
    pos = jnp.array([13, 21])
    before = jnp.asarray(np.stack([np.arange(S) < 13, (np.arange(S) >= 5) & (np.arange(S) < 21)]))
    for l, block in ((3, 4), (9, 4)):
        u = jax.random.normal(ks[2], (b, l, cfg.hidden_size))
        valid = jnp.asarray(np.stack([np.ones(l, bool), np.arange(l) >= 1]))
        chunk = jnp.zeros((b, S), bool).at[jnp.arange(b)[:, None], pos[:, None] + jnp.arange(l)].set(valid)
        def loss(p, u, sel, valid=valid, chunk=chunk, block=block):
            out = attn_lib.attention(p, u, cfg, jnp.float32, cache=cache, valid_cache=before | chunk, valid=valid,
                                     pos=pos, block=block, kernels=sel)[0]
            return jnp.sum(jnp.where(valid[..., None], out, 0) ** 2), out

        f = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True), static_argnums=2)
        (_, o1), g1 = f(p, u, kernels_lib.REFERENCE)
        (_, o2), g2 = f(p, u, GPU)
        print(f"cached l={l}: max |out diff| {_maxdiff(o1[valid], o2[valid]):.2e}, "
              f"max |grad diff| {_maxdiff(g1, g2):.2e}")
        _close(o1[valid], o2[valid], 2e-5)
        _close(g1, g2, 1e-4)


@pytest.mark.parametrize("impl", ["blocked", "ring"])
def test_context_parallel_kernels_match_reference(impl, small_blocks):
    """The context-parallel forms (sequence over context=2, rows over fsdp=2, KV heads over tensor=2) with the
    flash kernel per device: values and gradients (input and weights) equal the same form's reference."""
    from nemo_jax.parallel.mesh import make_mesh

    cfg = tiny_cfg("*")
    p = _attn_params(cfg)
    mesh = make_mesh(dict(fsdp=2, tensor=2, context=2))
    l = 36
    u = jax.random.normal(jax.random.key(4), (2, l, cfg.hidden_size))
    seg = jnp.asarray(np.stack([np.repeat([1, 2, 3], [11, 20, 5]), np.zeros(l, int)]), jnp.int32)

    def loss(p, u, sel):
        out = attn_lib.attention(p, u, cfg, jnp.float32, segment_ids=seg, impl=impl, mesh=mesh, kernels=sel)[0]
        return jnp.sum(jnp.sin(out)), out

    f = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True), static_argnums=2)
    (_, o1), g1 = f(p, u, kernels_lib.REFERENCE)
    (_, o2), g2 = f(p, u, GPU)
    print(f"context {impl}: max |out diff| {_maxdiff(o1, o2):.2e}, max |grad diff| {_maxdiff(g1, g2):.2e}")
    _close(o1, o2, 2e-5)
    _close(g1, g2, 1e-4)


def _moe_params(cfg, lora_rank=4):
    specs = mixer_specs(cfg, "moe")
    leaves, tree = jax.tree.flatten(specs, is_leaf=lambda s: hasattr(s, "init"))
    keys = jax.random.split(jax.random.key(0), len(leaves))
    pe = jax.tree.unflatten(tree, [s.init(k, s.shape, s.dtype) for s, k in zip(leaves, keys)])["experts"]
    E, D, I = cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size
    ks = jax.random.split(jax.random.key(1), 4)
    for i, (name, din, dout) in enumerate((("up_proj", D, I), ("down_proj", I, D))):
        pe[f"{name}_lora"] = {"lora_a": jax.random.normal(ks[2 * i], (E, din, lora_rank)) * 0.3,
                              "lora_b": jax.random.normal(ks[2 * i + 1], (E, lora_rank, dout)) * 0.3,
                              "lora_scale": jnp.float32(0.5)}
    return pe


@pytest.mark.parametrize("sel,path", [(GPU, "single"), (GPU, "all_to_all"), (GPU, "all_gather"),
                                      (TPU, "single"), (TPU, "all_to_all")])
def test_grouped_matmul_experts_match_sorted_reference(sel, path):
    """The sorted dispatch with its grouped-matmul kernel (GPU: Pallas/Triton, TPU: megablox) equals the sorted
    reference with per-expert LoRA adapters, on one device and under both expert-parallel paths (expert=2 x
    fsdp=2 x data=2): values, drops and the gradients of x, the router weights, expert weights and adapters."""
    from nemo_jax.parallel.mesh import make_mesh

    cfg = tiny_cfg("E", n_shared_experts=0)
    pe = _moe_params(cfg)
    mesh = None if path == "single" else make_mesh(dict(data=2, fsdp=2, expert=2))
    T = 48
    x = jax.random.normal(jax.random.key(5), (T, cfg.hidden_size))
    logits = jax.random.normal(jax.random.key(6), (T, cfg.n_routed_experts)).at[:, 3].add(1.5)  # skewed
    w, idx = jax.lax.top_k(jax.nn.softmax(logits), cfg.num_experts_per_tok)
    mode = "all_gather" if path == "all_gather" else "all_to_all"

    def loss(pe, x, w, sel):
        y, dropped = moe_lib.experts_forward(pe, x, w, idx, cfg, jnp.float32, "sorted", 2.0, mesh,
                                             expert_parallel=mode, kernels=sel)
        return jnp.sum(jnp.sin(y)), (y, dropped)

    f = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True), static_argnums=3)
    (_, (y1, d1)), g1 = f(pe, x, w, kernels_lib.REFERENCE)
    (_, (y2, d2)), g2 = f(pe, x, w, sel)
    print(f"experts {sel.impl('experts')} {path}: max |y diff| {_maxdiff(y1, y2):.2e}, "
          f"max |grad diff| {_maxdiff(g1, g2):.2e}")
    assert int(d1) == int(d2)
    _close(y1, y2, 2e-5)
    _close(g1, g2, 1e-4)


def _ssd_inputs(b=2, l=40, h=4, p=8, g=2, n=8, seed=0):
    """SSD operands (as the mixer hands them over: dt after softplus, A negative) and packed segments: row 0
    holds documents of 7, 16 and 15 tokens then 2 of padding (boundaries inside and on kernel chunks of 16),
    row 1 one token then one long document."""
    ks = jax.random.split(jax.random.key(seed), 6)
    x = jax.random.normal(ks[0], (b, l, h, p))
    dt = jax.nn.softplus(jax.random.normal(ks[1], (b, l, h)) - 1.0)
    A = -jnp.exp(jax.random.normal(ks[2], (h,)) * 0.5)
    B, C = (jax.random.normal(k, (b, l, g, n)) for k in ks[3:5])
    seg = np.ones((b, l), np.int32)
    seg[0, 7:], seg[0, 23:], seg[0, l - 2:] = 2, 3, 4
    seg[1, 1:] = 2
    return (x, dt, A, B, C), jnp.asarray(seg), jax.random.normal(ks[5], (b, h, p, n))


def _ssd_loss(scan):
    def f(x, dt, A, B, C, s):
        y, final = scan(x, dt, A, B, C, s)
        return jnp.sum(jnp.sin(y)) + jnp.sum(final ** 2), (y, final)
    return f


def test_ssd_kernel_forward_matches_reference():
    """The Pallas SSD kernel's forward (TPU form: a grid over chunks; interpret mode) over packed segments from an
    initial state: outputs and the final state equal the sequential recurrence's (the fast check; both forms'
    gradients below)."""
    from nemo_jax.kernels.ssd import ssd_scan
    from nemo_jax.model import mamba2

    args, seg, init = _ssd_inputs(l=24, h=2, g=1)
    y1, f1 = jax.jit(lambda *a: mamba2.ssd_sequential(*a, segment_ids=seg, initial_state=init))(*args)
    y2, f2 = jax.jit(lambda *a: ssd_scan(*a, seg, init, impl="mosaic", interpret=True, chunk=16))(*args)
    print(f"ssd forward: max |y diff| {_maxdiff(y1, y2):.2e}, max |state diff| {_maxdiff(f1, f2):.2e}")
    _close(y1, y2, 2e-5)
    _close(f1, f2, 2e-5)


@pytest.mark.slow
@pytest.mark.parametrize("impl", ["triton", "mosaic"])
def test_ssd_kernel_matches_reference_values_and_gradients(impl):
    """The SSD kernel (Triton's program-per-(row, head) loop, Mosaic's grid over chunks; interpret mode) against
    the sequential recurrence: 40 tokens in kernel chunks of 16 (the last padded), packed documents (a state
    reset inside a chunk and on a chunk boundary, padding at the end), an initial state; y, the final state and
    the gradients of x, dt, A, B, C and the initial state."""
    from nemo_jax.kernels.ssd import ssd_scan
    from nemo_jax.model import mamba2

    args, seg, init = _ssd_inputs()
    ref = _ssd_loss(lambda *a: mamba2.ssd_sequential(*a[:5], segment_ids=seg, initial_state=a[5]))
    ker = _ssd_loss(lambda *a: ssd_scan(*a[:5], seg, a[5], impl=impl, interpret=True, chunk=16))
    grad = lambda f: jax.jit(jax.value_and_grad(f, argnums=range(6), has_aux=True))(*args, init)  # noqa: E731
    (_, out1), g1 = grad(ref)
    (_, out2), g2 = grad(ker)
    print(f"ssd {impl}: max |out diff| {_maxdiff(out1, out2):.2e}, max |grad diff| {_maxdiff(g1, g2):.2e}")
    _close(out1, out2, 2e-5)
    for a, b in zip(g1, g2):  # the flash kernel's 1e-4, relative where a gradient is large (dt's reach ~260)
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-4)


@pytest.mark.slow
def test_mamba_layer_with_the_ssd_kernel_matches_reference(monkeypatch):
    """A Mamba layer through `apply_layer` with kernels forced (the SSD kernel, interpret mode) on a mesh of
    fsdp 2 x tensor 2 (per device in shard_map, heads and groups split over tensor): the packed forward's output
    and the gradients of the input and every weight equal the reference's; a cached prefill continued from a
    state too."""
    from nemo_jax.kernels import ssd
    from nemo_jax.model.mamba2 import MambaState, mamba_mixer
    from nemo_jax.parallel.mesh import make_mesh

    monkeypatch.setitem(ssd.CHUNK, "triton", 16)  # the 36 tokens span three kernel chunks
    cfg = tiny_cfg("M", mamba_head_dim=16, ssm_state_size=16, chunk_size=16)
    specs = mixer_specs(cfg, "mamba")
    leaves, tree = jax.tree.flatten(specs, is_leaf=lambda s: hasattr(s, "init"))
    p = jax.tree.unflatten(tree, [s.init(k, s.shape, s.dtype) for s, k in
                                  zip(leaves, jax.random.split(jax.random.key(2), len(leaves)))])
    mesh = make_mesh(dict(fsdp=2, tensor=2), jax.devices()[:4])
    l = 36
    u = jax.random.normal(jax.random.key(3), (2, l, cfg.hidden_size))
    seg = jnp.asarray(np.stack([np.repeat([1, 2, 3], [11, 20, 5]), np.repeat([1, 2], [30, 6])]), jnp.int32)

    def loss(p, u, sel):
        y, st = mamba_mixer(p, u, cfg, jnp.float32, segment_ids=seg, mesh=mesh, kernels=sel)
        return jnp.sum(jnp.sin(y)) + jnp.sum(st.ssm ** 2), y

    f = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True), static_argnums=2)
    sel = Selection("gpu", interpret=True)
    assert sel.impl("ssd") == "triton" and TPU.impl("ssd") == "mosaic"
    (_, y1), g1 = f(p, u, kernels_lib.REFERENCE)
    (_, y2), g2 = f(p, u, sel)
    print(f"mamba layer: max |y diff| {_maxdiff(y1, y2):.2e}, max |grad diff| {_maxdiff(g1, g2):.2e}")
    _close(y1, y2, 2e-5)
    _close(g1, g2, 1e-4)
    # a prefill chunk (left padding) continuing a cached state: the kernel takes the initial state
    state = MambaState(jax.random.normal(jax.random.key(4), (2, cfg.conv_kernel - 1, cfg.conv_dim)),
                       jax.random.normal(jax.random.key(5), (2, cfg.mamba_num_heads, cfg.mamba_head_dim,
                                                             cfg.ssm_state_size)))
    valid = jnp.asarray(np.stack([np.ones(20, bool), np.arange(20) >= 3]))
    run = jax.jit(lambda sel: mamba_mixer(p, u[:, :20], cfg, jnp.float32, state=state, valid=valid, kernels=sel),
                  static_argnums=0)
    (y1, s1), (y2, s2) = run(kernels_lib.REFERENCE), run(sel)
    _close(y1[valid], y2[valid], 2e-5)
    _close(s1, s2, 2e-5)


def test_auto_runs_the_reference_on_cpu_and_kernels_when_forced():
    """kernels: auto on CPU devices resolves to the reference (no Pallas call in the model's jaxpr); forcing a
    platform puts its kernels in (so the check can fail), with the reference's logits; the config key is
    validated."""
    from nemo_jax.config.train import ModelSection
    from nemo_jax.parallel.mesh import make_mesh
    from nemo_jax.train.sft import options_from

    cfg = tiny_cfg("*E")
    params = init(cfg, jax.random.key(0))
    tok = jax.random.randint(jax.random.key(1), (2, 16), 0, cfg.vocab_size)
    seg = jnp.ones((2, 16), jnp.int32)
    jaxpr = lambda opts: str(jax.make_jaxpr(lambda p: M.forward(p, tok, cfg, seg, opts=opts)[0])(params))  # noqa: E731
    assert kernels_lib.platform_of() == "cpu"
    assert M.Options().kernels == "auto" and kernels_lib.select("auto").platform == "reference"
    assert options_from(ModelSection(), make_mesh(dict(fsdp=2), jax.devices()[:2])).kernels == "reference"
    assert "pallas_call" not in jaxpr(M.Options())
    assert "pallas_call" not in jaxpr(M.Options(kernels="gpu", interpret_kernels=True, attention="full",
                                                moe_dispatch="capacity"))  # the plain reference forms
    forced = M.Options(kernels="gpu", interpret_kernels=True)
    assert len(re.findall("pallas_call", jaxpr(forced))) >= 3
    # and the model with them (attention and experts through the layer stack) gives the reference's logits
    logits = lambda opts: jax.jit(lambda p: M.forward(p, tok, cfg, seg, opts=opts)[0])(params)  # noqa: E731
    _close(logits(M.Options()), logits(forced), 1e-5)
    with pytest.raises(ValueError, match="model.kernels: 'triton'"):
        ModelSection(kernels="triton")
    with pytest.raises(ValueError, match="kernels: 'cuda'"):
        M.Options(kernels="cuda")


def _plugin(target):
    from nemo_jax.plan.targets import plugin_installed

    return plugin_installed(target)


@pytest.mark.parametrize("target,kind,names", [
    ("gpu", "h100", ("__gpu$xla.gpu.triton", "flash_fwd", "flash_bwd_dq", "flash_bwd_dkv", "gmm", "tgmm", "ssd_fwd",
                     "ssd_bwd")),
    ("tpu", "tpu-v5e", ("tpu_custom_call", "splash_mqa", "gmm", "tgmm", "ssd_fwd", "ssd_bwd")),
])
def test_deviceless_compiles_contain_the_kernels(target, kind, names):
    """The model's loss gradient (packed segments, bf16, Mamba, MoE) compiled for 2 (GPU) / 4 (TPU) compile-only devices
    with kernels: auto picks the target's kernels (the mesh's platform) and the compiled HLO holds them; on GPU a
    row without segment ids runs cuDNN's flash attention (forward and backward custom calls)."""
    if not _plugin(target):
        pytest.skip(f"no {target} plugin installed (nemo_jax[plan-{target}])")
    from nemo_jax.config.train import ModelSection
    from nemo_jax.model.spec import abstract_params, param_specs
    from nemo_jax.parallel.rules import Rules, param_shardings
    from nemo_jax.plan.targets import target_mesh
    from nemo_jax.train.sft import options_from
    from nemo_jax.train.step import token_loss

    n = 2 if target == "gpu" else 4
    mesh = target_mesh(target, kind, {"fsdp": n})
    opts = options_from(ModelSection(dtype="bfloat16"), mesh)
    assert opts.kernels == target
    cfg = tiny_cfg("M*E", head_dim=16)
    sh = param_shardings(param_specs(cfg), mesh, Rules())
    params = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), abstract_params(cfg), sh)
    rows = Rules().sharding(mesh, ("batch", None), (n, 64))
    ids = jax.ShapeDtypeStruct((n, 64), jnp.int32, sharding=rows)
    batch = {"tokens": ids, "targets": ids, "segment_ids": ids,
             "loss_mask": jax.ShapeDtypeStruct((n, 64), jnp.float32, sharding=rows)}
    # conftest makes HIGHEST the default matmul precision; Mosaic has no fp32-precision matmul of bf16 operands
    with jax.default_matmul_precision("default"):
        hlo = jax.jit(jax.grad(lambda p, b: token_loss(p, b, cfg, opts)[0])).lower(params, batch).compile().as_text()
    for name in names:
        assert name in hlo, name
    if target == "gpu":
        arg = lambda *shape: jax.ShapeDtypeStruct(  # noqa: E731
            shape, jnp.bfloat16, sharding=Rules().sharding(mesh, ("batch",) + (None,) * (len(shape) - 1), shape))
        q, k = arg(n, 64, 2, 2, 16), arg(n, 64, 2, 16)
        impl = kernels_lib.select(opts.kernels, mesh).impl("attention", dtype=jnp.bfloat16, segments=False,
                                                            head_dim=16)
        assert impl == "cudnn"
        f = lambda q, k, v: jnp.sum(  # noqa: E731
            kernel_attn.causal(q, k, v, None, jnp.bfloat16, impl, mesh=mesh).astype(jnp.float32))
        hlo = jax.jit(jax.grad(f, argnums=(0, 1, 2))).lower(q, k, k).compile().as_text()
        assert "__cudnn$fmhaSoftmax" in hlo and "__cudnn$fmhaSoftmaxBackward" in hlo
