"""The memory and communication defects of the Super-scale plan, each measured in the compiled program it left
(XLA:CPU on fake devices, or the deviceless XLA:GPU target where only it shows the dtype of a collective)."""

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from nemo_jax.model import Options, abstract_params
from nemo_jax.plan import hlo as H

from helpers import tiny_cfg


def _collectives(text: str, n: int):
    return H.analyse(text, n).collectives


def _gpu():
    from nemo_jax.plan.targets import get_topology, plugin_installed

    if not plugin_installed("gpu"):
        pytest.skip("the gpu plugin is not installed (nemo_jax[plan-gpu])")
    return get_topology("gpu", "h100", 1)[0]


@pytest.mark.slow
def test_blocked_attention_keeps_one_block_of_logits():
    """The reference attention's backward on the deviceless H100 target, 16 query blocks of a 4k-row layer:
    with each block checkpointed the temporaries stay under a third of every block's fp32 logits and
    probabilities, which the layer's backward held before (a flash kernel holds none: `model.kernels`)."""
    from nemo_jax.model import attention as A

    sh = jax.sharding.SingleDeviceSharding(_gpu())
    b, l, kv, r, hd, block = 1, 4096, 2, 16, 128, 256
    q = jax.ShapeDtypeStruct((b, l, kv, r, hd), jnp.bfloat16, sharding=sh)
    k = jax.ShapeDtypeStruct((b, l, kv, hd), jnp.bfloat16, sharding=sh)

    def temp(checkpoint_blocks):
        def loss(q, k, v):
            out = A._attend_blocked(q, k, v, None, jnp.bfloat16, block, checkpoint_blocks)
            return jnp.sum(out.astype(jnp.float32) ** 2)
        return jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, k, k).compile().memory_analysis().temp_size_in_bytes

    every_block = 2 * 4 * b * kv * r * sum(block * e for e in range(block, l + 1, block))
    assert temp(True) < every_block / 3 < temp(False), (temp(True), temp(False), every_block)


def _train_step_program(mesh_sizes, grad_accum=1, **over):
    from nemo_jax.config.load import load_config
    from nemo_jax.config.train import SFTConfig
    from nemo_jax.parallel.mesh import make_mesh
    from nemo_jax.parallel.rules import Rules
    from nemo_jax.plan.plan import model_config
    from nemo_jax.train.sft import step_program

    overrides = ["data.batch_size=8", "data.seq_len=64", f"optim.grad_accum={grad_accum}",
                 "model.dtype=bfloat16", "model.remat=layer"] + [f"{k}={v}" for k, v in over.items()]
    c = load_config(SFTConfig, None, overrides)
    mesh = make_mesh(mesh_sizes)
    prog = step_program(c, model_config(c), mesh, Rules())
    state, batch, frozen = prog.abstract_inputs(c.data.batch_size, c.data.seq_len)
    return prog, state, prog.step.lower(state, batch, frozen).compile()


@pytest.mark.slow
def test_accumulation_copies_no_fp32_weights_and_one_micro_batch_has_no_loop():
    """Micro-batches run on compute-dtype copies of the weights: the accumulation loop carries one fp32
    accumulator per weight and no fp32 weights (the donated masters were copied into the loop before);
    with one micro-batch there is no accumulation loop at all."""
    _, state, two = _train_step_program({"fsdp": 8}, grad_accum=2, **{"data.batch_size": 16})
    text = two.as_text()
    shard = lambda x: tuple(x.sharding.shard_shape(x.shape))  # noqa: E731
    big = {shard(x) for x in jax.tree.leaves(state.params) if math.prod(x.shape) >= 4096 and x.ndim >= 2}
    comps, types, entry = H.parse_module(text)
    loops = [i for i in comps[entry] if i.opcode == "while"]
    assert loops
    outer = max(loops, key=lambda i: len(i.type))  # the micro-batch loop carries every weight's accumulator
    f32 = [tuple(s) for d, s in H._arrays(outer.type) if d == "f32" and tuple(s) in big]
    counts = {s: f32.count(s) for s in set(f32)}
    per_leaf = {s: sum(shard(x) == s for x in jax.tree.leaves(state.params)) for s in counts}
    assert all(counts[s] <= per_leaf[s] for s in counts), (counts, per_leaf)  # accumulators only, no masters
    _, _, one = _train_step_program({"fsdp": 8}, grad_accum=1)
    comps1, _, entry1 = H.parse_module(one.as_text())
    assert not any(len(H._arrays(i.type)) > 100 for i in comps1[entry1] if i.opcode == "while")


@pytest.mark.slow
def test_head_gradient_is_reduce_scattered():
    """fsdp=4 x tensor=2: the lm_head is gathered once per micro-batch (in the compute dtype) and its gradient
    leaves by one reduce-scatter; no all-reduce moves an array of the head's tensor-local [D, V/2] shape (under
    GSPMD the head was gathered in fp32 and its gradient all-reduced in fp32)."""
    prog, state, compiled = _train_step_program({"fsdp": 4, "tensor": 2}, **{"data.seq_len": 48})
    text = compiled.as_text()
    cfg = prog.cfg
    head = {(cfg.hidden_size, cfg.vocab_size // 2), (cfg.vocab_size // 2, cfg.hidden_size)}
    reduced, scattered, gathered = set(), set(), set()
    for line in text.splitlines():
        for op, into in (("all-reduce", reduced), ("reduce-scatter", scattered), ("all-gather", gathered)):
            m = re.search(rf"= (\(.*?\)|\S+) {op}(-start)?\((.*)", line)
            if m:
                into |= {tuple(shape) for _, shape in H._arrays(m.group(1))}
    shard = {(cfg.hidden_size // 4, cfg.vocab_size // 2)}  # what each device keeps of the head (and its gradient)
    assert not reduced & head, reduced & head
    assert scattered & shard and gathered & head, (scattered, gathered)
    assert len([line for line in text.splitlines() if re.search(r"all-gather(-start)?\(", line)
                and any(f"[{a},{b}]" in line for a, b in head)]) == 1  # once per micro-batch, not per chunk


def test_mtp_layers_run_under_the_remat_policy():
    """MTP layers are rematerialised like the main stack's (they ran without remat), and their MoE takes the
    sorted dispatch (the unrolled padded-block reference kept [blocks, rows, I] per step)."""
    from nemo_jax.train.step import token_loss

    cfg = tiny_cfg(num_nextn_predict_layers=1)
    params = abstract_params(cfg)
    b = {k: jax.ShapeDtypeStruct((2, 32), jnp.int32) for k in ("tokens", "targets", "segment_ids")}
    b["loss_mask"] = jax.ShapeDtypeStruct((2, 32), bool)

    def remats(remat):
        jaxpr = jax.make_jaxpr(jax.grad(lambda p, b: token_loss(p, b, cfg, Options(remat=remat), 0.1)[0]))(params, b)
        return str(jaxpr).count("remat") + str(jaxpr).count("checkpoint")

    n_layers = len(cfg.layer_kinds) + len(cfg.mtp_layer_kinds)
    assert remats("layer") - remats("none") >= n_layers


def test_expert_lora_saves_its_up_projection_in_the_compute_dtype():
    """The padded-block dispatch (expert adapters on the reference path) saves each step's up-projection for the
    backward in the compute dtype, not fp32."""
    from nemo_jax.model import moe as M

    x = jnp.ones((4, 8, 16), jnp.bfloat16)
    pe = {"up_proj": jnp.ones((4, 16, 32), jnp.bfloat16), "down_proj": jnp.ones((4, 32, 16), jnp.bfloat16),
          "up_proj_lora": {"lora_a": jnp.ones((4, 16, 2)), "lora_b": jnp.ones((4, 2, 32)), "lora_scale": 2.0}}
    jaxpr = jax.make_jaxpr(lambda x: M._experts_mlp("gbd,gdi->gbi", "gbi,gid->gbd", x, pe, jnp.bfloat16))(x)
    named = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "name"]
    assert named and all(e.outvars[0].aval.dtype == jnp.bfloat16 for e in named)


@pytest.mark.slow
def test_gpu_all_to_all_moves_the_compute_dtype_both_ways():
    """On the deviceless XLA:GPU target (which keeps a collective's dtype, unlike XLA:CPU) a bf16 step's
    expert all-to-alls move bf16 both ways (the outputs came back in fp32), and no weight gradient is
    reduce-scattered in fp32."""
    from nemo_jax.plan.targets import plugin_installed

    if not plugin_installed("gpu"):
        pytest.skip("the gpu plugin is not installed (nemo_jax[plan-gpu])")
    from nemo_jax.config.load import load_config
    from nemo_jax.config.train import SFTConfig
    from nemo_jax.plan.plan import model_config
    from nemo_jax.plan.targets import target_mesh
    from nemo_jax.parallel.rules import Rules
    from nemo_jax.train.sft import step_program

    c = load_config(SFTConfig, None, ["data.batch_size=8", "data.seq_len=64", "model.dtype=bfloat16",
                                      "model.kernels=reference", "model.remat=layer"])
    mesh = target_mesh("gpu", "h100", {"fsdp": 4, "expert": 2})
    prog = step_program(c, model_config(c), mesh, Rules())
    text = prog.step.lower(*prog.abstract_inputs(8, 64)).compile().as_text()
    D = prog.cfg.moe_latent_size or prog.cfg.hidden_size
    dtypes = set()
    for line in text.splitlines():
        m = re.search(r"= (\(.*?\)|\S+) all-to-all(-start)?\(", line)
        if m:  # the token rows (hidden-sized), not the routing weights or expert ids travelling beside them
            dtypes |= {d for d, shape in H._arrays(m.group(1)) if shape and shape[-1] == D}
    assert dtypes == {"bf16"}, dtypes
    rs32 = [line for line in text.splitlines() if re.search(r"= \(?f32\[\d+,\d+\].*reduce-scatter(-start)?\(", line)]
    assert not rs32, rs32[:2]
