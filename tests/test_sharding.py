"""Sharding that splits work: activations stay batch-sharded under FSDP (no global-batch all-reduce in the
compiled step), optimiser state sharded like the params (see test_lora_sft for the per-leaf bytes)."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from nemo_jax.model import Options
from nemo_jax.model.spec import abstract_params, param_specs
from nemo_jax.parallel.mesh import batch_sharding, make_mesh
from nemo_jax.parallel.rules import Rules, param_shardings
from nemo_jax.train.step import token_loss

from helpers import tiny_cfg

COLLECTIVE = re.compile(r"=\s*(\S+)\s+(all-reduce|all-gather)(?:-start)?\(")


def collectives(hlo: str) -> list[tuple[str, str]]:
    """(result shape, kind) of every all-reduce / all-gather in compiled HLO text."""
    return [(m.group(1), m.group(2)) for m in COLLECTIVE.finditer(hlo)]


def compiled_grad_hlo(cfg, mesh, B, T, pin: bool) -> str:
    sh = param_shardings(param_specs(cfg), mesh, Rules())
    params = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract_params(cfg), sh)
    bs = batch_sharding(mesh)
    batch = {k: jax.ShapeDtypeStruct((B, T), dt, sharding=bs) for k, dt in
             (("tokens", jnp.int32), ("targets", jnp.int32), ("loss_mask", jnp.bool_), ("segment_ids", jnp.int32))}
    opts = Options(mesh=mesh if pin else None)
    f = jax.jit(jax.grad(lambda p, b: token_loss(p, b, cfg, opts)[0]))
    return f.lower(params, batch).compile().as_text()


def test_fsdp_activations_stay_batch_sharded():
    cfg = tiny_cfg("M*-", hidden_size=64, vocab_size=512)
    mesh = make_mesh({"fsdp": 8})
    B, T = 16, 32
    act = re.compile(rf"^(f32|bf16)\[{B},{T},\d+\]")  # a global-batch float activation [B, T, *]
    before = [c for c in collectives(compiled_grad_hlo(cfg, mesh, B, T, pin=False)) if act.match(c[0])]
    after = [c for c in collectives(compiled_grad_hlo(cfg, mesh, B, T, pin=True)) if act.match(c[0])]
    assert before, "the unpinned step was expected to all-reduce global-batch activations (test is stale)"
    assert not after, after


def test_embedding_and_expert_parallel_moe_never_gather_the_global_batch():
    """FSDP + expert parallel on a latent-MoE model: the embedding lookup (per device, table gathered), the
    expert dispatch (within the expert group only) and the CE (local rows) move no global-batch activation,
    forward or backward."""
    cfg = tiny_cfg("M*E", hidden_size=64, vocab_size=384, moe_latent_size=16)
    mesh = make_mesh({"fsdp": 4, "expert": 2})
    B, T = 16, 32
    act = re.compile(rf"^(f32|bf16)\[({B},{T}|{B * T}),\d+\]")  # [B, T, *] or flattened [B*T, *]
    found = [c for c in collectives(compiled_grad_hlo(cfg, mesh, B, T, pin=True)) if act.match(c[0])]
    assert not found, found


def _groups(mesh, axis):
    """The device-id groups that communicate over `axis` (all other coordinates fixed)."""
    arr = np.vectorize(lambda d: d.id)(mesh.devices)
    moved = np.moveaxis(arr, mesh.axis_names.index(axis), -1)
    return [list(g) for g in moved.reshape(-1, mesh.shape[axis])]


def test_meshes_keep_tensor_and_expert_inside_a_node():
    devs = jax.devices()
    # one node (a single process): the devices in order, as before
    flat = make_mesh({"fsdp": 2, "tensor": 2, "expert": 2}, devs)
    assert [d.id for d in flat.devices.reshape(-1)] == [d.id for d in devs]
    # two simulated nodes of 4: tensor (2) and then expert (2 of its 4) fill a node, the rest spans nodes
    m = make_mesh({"tensor": 2, "expert": 4}, devs, devices_per_node=4)
    node = lambda i: i // 4  # noqa: E731
    assert all(len({node(i) for i in g}) == 1 for g in _groups(m, "tensor"))
    assert all(len({node(i) for i in g}) == 2 for g in _groups(m, "expert"))
    m = make_mesh({"data": 2, "fsdp": 2, "tensor": 2}, devs, devices_per_node=2)
    assert all(len({i // 2 for i in g}) == 1 for g in _groups(m, "tensor"))
    assert all(len({i // 2 for i in g}) == 2 for g in _groups(m, "fsdp") + _groups(m, "data"))
    assert sorted(d.id for d in m.devices.reshape(-1)) == list(range(8))
    with pytest.raises(ValueError, match="devices_per_node=3"):
        make_mesh({"fsdp": 8}, devs, devices_per_node=3)
