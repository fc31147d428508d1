"""Sharding that splits work: activations stay batch-sharded under FSDP (no global-batch all-reduce in the
compiled step), optimiser state sharded like the params (see test_lora_sft for the per-leaf bytes)."""

import re

import jax
import jax.numpy as jnp

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
