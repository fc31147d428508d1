"""LoRA adapters: targets, init, unmerged == merged for every kind and MoE dispatch (1 and 8 devices),
gradients only into adapters, rsLoRA scaling, errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from nemo_jax import lora
from nemo_jax.model import model as M
from nemo_jax.model.spec import init as init_params, param_specs
from nemo_jax.parallel.mesh import make_mesh
from nemo_jax.parallel.rules import Rules, param_shardings

from helpers import tiny_cfg

# every layer kind, a shared expert, latent MoE projections and one MTP block
CFG = tiny_cfg("MEM*E-", moe_latent_size=16, num_nextn_predict_layers=1)
ALL = lora.LoraConfig(targets=("all", "lm_head"), rank=4, alpha=8.0)


def _randomised(adapters, seed=3):
    """B != 0 so the adapters change the model (a fresh adapter has B = 0)."""
    leaves, tree = jax.tree.flatten(adapters)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(adapters)[0]]
    return jax.tree.unflatten(tree, [0.05 * jax.random.normal(k, x.shape) if "lora_b" in p else x
                                     for p, x, k in zip(paths, leaves, keys)])


@pytest.fixture(scope="module")
def setup():
    params = init_params(CFG, jax.random.key(0))
    toks = jax.random.randint(jax.random.key(1), (2, 24), 0, CFG.vocab_size)
    return params, toks


def test_presets_cover_every_kind_and_table():
    paths = lora.selected_paths(CFG, ALL)
    for want in ["layers/attention/mixer/q_proj/kernel", "layers/attention/mixer/o_proj/kernel",
                 "layers/mamba/mixer/in_proj/kernel", "layers/mamba/mixer/out_proj/kernel",
                 "layers/mlp/mixer/up_proj/kernel", "layers/moe/mixer/shared_experts/down_proj/kernel",
                 "layers/moe/mixer/fc1_latent_proj/kernel", "layers/moe/mixer/fc2_latent_proj/kernel",
                 "layers/moe/mixer/experts/up_proj", "layers/moe/mixer/experts/down_proj", "lm_head/kernel"]:
        assert want in paths, want
    assert not any("gate" in p or "conv1d" in p for p in paths)
    assert not any(p.startswith("mtp") for p in paths)  # presets leave MTP alone
    table = lora.summary_table(CFG, ALL)
    assert "layers/moe/mixer/experts/up_proj" in table and "total" in table
    a = lora.init_adapters(CFG, ALL)
    n = sum(x.size for p, x in jax.tree_util.tree_flatten_with_path(a)[0] if "lora_scale" not in jax.tree_util.keystr(p))
    assert f"{n:,}" in table
    up = a["layers"]["moe"]["mixer"]["experts"]["up_proj_lora"]
    E, Din, I = CFG.n_routed_experts, CFG.moe_input_size, CFG.moe_intermediate_size
    assert up["lora_a"].shape == (2, E, Din, 4) and up["lora_b"].shape == (2, E, 4, I)
    assert float(jnp.abs(up["lora_b"]).max()) == 0 and float(jnp.abs(up["lora_a"]).max()) > 0


def test_unmatched_target_is_an_error_naming_it():
    with pytest.raises(ValueError, match="nope_proj"):
        lora.selected_paths(CFG, lora.LoraConfig(targets=("attention", r"nope_proj")))
    with pytest.raises(ValueError, match="attention"):  # a preset that matches nothing in a model without it
        lora.selected_paths(tiny_cfg("M-"), lora.LoraConfig(targets=("attention",)))


def test_rslora_scale():
    assert lora.LoraConfig(rank=16, alpha=32).scale == 2.0
    assert lora.LoraConfig(rank=16, alpha=32, rslora=True).scale == 8.0
    a = lora.init_adapters(CFG, lora.LoraConfig(targets=("attention",), rank=16, alpha=32, rslora=True))
    np.testing.assert_array_equal(a["layers"]["attention"]["mixer"]["q_proj"]["lora_scale"], 8.0)


def test_stacked_adapters_on_layers_held_one_by_one_are_an_error_and_stack_layers_inverts(setup):
    """serve's Engine holds the layers one by one (`unstack_layers`): stacked adapters attached there must fail,
    not match no layer and leave the model unadapted (the Tinker learner trained nothing on most layers);
    `stack_layers` gives back the stacked params exactly."""
    params, _ = setup
    one_by_one = M.unstack_layers(params)
    with pytest.raises(ValueError, match="one by one"):
        lora.attach(one_by_one, lora.init_adapters(CFG, ALL))
    back = M.stack_layers(one_by_one)
    assert jax.tree.structure(back) == jax.tree.structure(params)
    for x, y in zip(jax.tree.leaves(back), jax.tree.leaves(params)):
        np.testing.assert_array_equal(x, y)


@pytest.mark.slow
def test_fresh_adapters_leave_logits_unchanged(setup):
    params, toks = setup
    a = lora.init_adapters(CFG, ALL)
    l0, _ = M.forward(params, toks, CFG)
    l1, _ = M.forward(lora.attach(params, a), toks, CFG)
    np.testing.assert_array_equal(l0, l1)


@pytest.mark.parametrize("dispatch", ["sorted", "capacity", "ragged", "dense"])
def test_merged_equals_unmerged_every_dispatch(setup, dispatch):
    params, toks = setup
    a = _randomised(lora.init_adapters(CFG, ALL))
    opts = M.Options(moe_dispatch=dispatch, capacity_factor=float(CFG.n_routed_experts))
    f = jax.jit(lambda p: M.forward(p, toks, CFG, opts=opts)[0])
    unmerged, merged, plain = f(lora.attach(params, a)), f(lora.merge_adapters(params, a)), f(params)
    np.testing.assert_allclose(unmerged, merged, rtol=1e-5, atol=1e-5)
    assert float(jnp.max(jnp.abs(unmerged - plain))) > 1e-3  # the adapters do change the model


@pytest.mark.parametrize("kind", ["attention", "mamba", "mlp", "experts", "lm_head"])
def test_each_kind_alone_changes_and_merges(setup, kind):
    params, toks = setup
    a = _randomised(lora.init_adapters(CFG, lora.LoraConfig(targets=(kind,), rank=2, alpha=4.0)))
    f = jax.jit(lambda p: M.forward(p, toks, CFG)[0])
    u, m, p0 = f(lora.attach(params, a)), f(lora.merge_adapters(params, a)), f(params)
    np.testing.assert_allclose(u, m, rtol=1e-5, atol=1e-5)
    assert float(jnp.max(jnp.abs(u - p0))) > 1e-4


def test_merge_weight_and_untouched_leaves(setup):
    params, _ = setup
    a = _randomised(lora.init_adapters(CFG, lora.LoraConfig(targets=("experts",), rank=2, alpha=4.0)))
    half = lora.merge_adapters(params, a, weight=0.5)
    w = params["layers"]["moe"]["mixer"]["experts"]["up_proj"]
    ad = a["layers"]["moe"]["mixer"]["experts"]["up_proj_lora"]
    want = w + 0.5 * 2.0 * np.einsum("neir,nero->neio", ad["lora_a"], ad["lora_b"])
    np.testing.assert_allclose(half["layers"]["moe"]["mixer"]["experts"]["up_proj"], want, rtol=1e-6, atol=1e-6)
    assert half["layers"]["mamba"]["mixer"]["in_proj"]["kernel"] is params["layers"]["mamba"]["mixer"]["in_proj"]["kernel"]


def test_gradients_reach_only_adapters(setup):
    params, toks = setup
    a = _randomised(lora.init_adapters(CFG, ALL))

    def loss(adapters, params):
        logits, _ = M.forward(lora.attach(params, adapters), toks, CFG)
        return jnp.mean(jax.nn.logsumexp(logits, -1))

    ga, gp = jax.jit(jax.grad(loss, argnums=(0, 1)))(a, params)
    assert jax.tree.structure(ga) == jax.tree.structure(a)
    for p, g in jax.tree_util.tree_flatten_with_path(ga)[0]:
        if "lora_a" in jax.tree_util.keystr(p):
            assert float(jnp.max(jnp.abs(g))) > 0, jax.tree_util.keystr(p)


@pytest.mark.slow
def test_expert_parallel_and_tensor_parallel_match_one_device(setup):
    params, toks = setup
    a = _randomised(lora.init_adapters(CFG, ALL))
    mesh = make_mesh({"data": 1, "fsdp": 2, "tensor": 2, "expert": 2})
    rules = Rules()
    ps = param_shardings(param_specs(CFG), mesh, rules)
    ash = lora.adapter_shardings(CFG, ALL, mesh, rules)
    up_a = ash["layers"]["moe"]["mixer"]["experts"]["up_proj_lora"]["lora_a"].spec
    assert up_a[1] == "expert"  # adapters shard like their kernels
    q_b = ash["layers"]["attention"]["mixer"]["q_proj"]["lora_b"].spec
    assert q_b[2] == "tensor"
    ref = jax.jit(lambda p, a: M.forward(lora.attach(p, a), toks, CFG)[0])(params, a)
    pm, am = jax.device_put(params, ps), jax.device_put(a, ash)
    opts = M.Options(mesh=mesh)

    def loss(a, p):
        logits, _ = M.forward(lora.attach(p, a), toks, CFG, opts=opts)
        return jnp.mean(jax.nn.logsumexp(logits, -1)), logits

    (l8, lg8), g8 = jax.jit(jax.value_and_grad(loss, has_aux=True))(am, pm)
    np.testing.assert_allclose(lg8, ref, rtol=1e-5, atol=1e-5)
    merged = jax.jit(lambda p, a: M.forward(lora.merge_adapters(p, a), toks, CFG, opts=opts)[0])(pm, am)
    np.testing.assert_allclose(merged, ref, rtol=1e-5, atol=1e-5)
    (l1, _), g1 = jax.jit(jax.value_and_grad(
        lambda a, p: (lambda lg: (jnp.mean(jax.nn.logsumexp(lg, -1)), lg))(M.forward(lora.attach(p, a), toks, CFG)[0]),
        has_aux=True))(a, params)
    for x, y in zip(jax.tree.leaves(g8), jax.tree.leaves(g1)):
        np.testing.assert_allclose(x, y, rtol=1e-4, atol=1e-6)


@pytest.mark.slow
def test_lora_step_skips_the_frozen_base():
    """What differentiating the adapters alone saves, in the compiled program (XLA:CPU, 2 devices of fsdp): no
    weight gradient of the base is reduced (the only reductions carry the adapters' gradients); the frozen lm_head
    is projected twice per token (logits, and the hidden state's gradient in the forward), where a head that gets a
    gradient takes at least three (logits, the hidden state's and the head's gradients); remat
    `save_frozen` keeps the base's matmul outputs (fewer FLOPs than `layer`) with the same gradients."""
    from nemo_jax.plan import hlo as H
    from nemo_jax.train.step import token_loss

    cfg = tiny_cfg("ME*")
    targets = lora.LoraConfig(targets=("all",), rank=4, alpha=8.0)
    mesh = make_mesh({"fsdp": 2}, jax.devices()[:2])
    params = jax.device_put(init_params(cfg, jax.random.key(0)), param_shardings(param_specs(cfg), mesh, Rules()))
    a = jax.device_put(_randomised(lora.init_adapters(cfg, targets)), lora.adapter_shardings(cfg, targets, mesh))
    N = 4 * 32
    toks = jax.random.randint(jax.random.key(1), (4, 33), 0, cfg.vocab_size)
    batch = {"tokens": toks[:, :-1], "targets": toks[:, 1:], "loss_mask": jnp.ones((4, 32), bool),
             "segment_ids": jnp.ones((4, 32), jnp.int32)}

    def compiled(remat, head_trained=False):
        opts = M.Options(remat=remat, mesh=mesh)

        def loss(a, head, p):
            p = dict(p, lm_head={"kernel": head})
            return token_loss(lora.attach(p, a), batch, cfg, opts)[0]

        f = jax.jit(jax.grad(loss, argnums=(0, 1) if head_trained else 0))
        c = f.lower(a, params["lm_head"]["kernel"], params).compile()
        return c, (lambda: f(a, params["lm_head"]["kernel"], params))

    layer, run_layer = compiled("layer")
    kept, run_kept = compiled("save_frozen")
    trained_head, _ = compiled("layer", head_trained=True)
    full = jax.jit(jax.grad(lambda p: token_loss(p, batch, cfg, M.Options(remat="layer", mesh=mesh))[0]))
    cost = {k: H.analyse(c.as_text(), 2) for k, c in (("layer", layer), ("kept", kept), ("head", trained_head),
                                                       ("full", full.lower(params).compile()))}
    reduced = {k: sum(v for kind, v in c.collective_bytes().items() if kind in ("all-reduce", "reduce-scatter"))
               for k, c in cost.items()}
    # both reduce the activations' cotangents of the MoE shard_map alike; full fine-tuning also every weight's
    # gradient (fp32 here), LoRA only its adapters'
    base_bytes = sum(x.size * 4 for x in jax.tree.leaves(params))
    adapter_bytes = sum(x.size * 4 for x in jax.tree.leaves(a))
    assert reduced["full"] - reduced["layer"] >= 0.9 * base_bytes - adapter_bytes, (reduced, base_bytes)
    projection = 2 * (N // 2) * cfg.hidden_size * cfg.vocab_size  # one pass over the vocabulary, per device
    # (here the logits fit one chunk and XLA computes the trained head's recompute once with the forward's)
    assert cost["head"].flops - cost["layer"].flops >= 0.9 * projection
    assert cost["kept"].flops < cost["layer"].flops - 0.5 * projection
    for x, y in zip(jax.tree.leaves(run_layer()), jax.tree.leaves(run_kept())):
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6)
