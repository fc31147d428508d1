"""Device mesh over (data, fsdp, tensor, expert, context); a size of -1 takes the remaining devices.

Activations [B, L, ...] are split by rows over BATCH_AXES and by sequence over `context`; flattened tokens
[B*L, ...] (the MoE's) over TOKEN_AXES, the same split read row-major."""

from __future__ import annotations

import math
import os

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from nemo_jax.config.train import read_mesh_sizes  # noqa: F401 (parsed on the config side)
from nemo_jax.config.train import resolve_mesh_sizes as resolve_sizes  # noqa: F401 (pure: checked before JAX)
from nemo_jax.parallel.rules import MESH_AXES

BATCH_AXES = ("data", "fsdp", "expert")
TOKEN_AXES = BATCH_AXES + ("context",)


# Axes placed inside a node first (its fast links: NVLink, a TPU slice's ICI), the heaviest traffic first:
# tensor (an all-reduce per layer), context (the attention layers' K/V all-gather and the Mamba layers' state
# and conv-window passing), expert (token exchange per MoE layer), then fsdp, then data.
NODE_ORDER = ("tensor", "context", "expert", "fsdp", "data")


def nodes_of(devices: list, devices_per_node: int = 0) -> list[list]:
    """The devices grouped into nodes, in order. devices_per_node > 0: consecutive groups of that many (a
    simulated cluster); 0: one node per TPU slice (`slice_index`), else per process (one process per host,
    as the launchers in launch/ start them)."""
    if devices_per_node > 0:
        if len(devices) % devices_per_node:
            raise ValueError(f"mesh.devices_per_node={devices_per_node} does not divide the {len(devices)} devices")
        return [devices[i:i + devices_per_node] for i in range(0, len(devices), devices_per_node)]
    groups: dict = {}
    for d in devices:
        key = getattr(d, "slice_index", None)
        groups.setdefault(d.process_index if key is None else key, []).append(d)
    nodes = list(groups.values())
    if len({len(n) for n in nodes}) > 1:
        raise ValueError(f"mesh: nodes hold different device counts {[len(n) for n in nodes]}; set "
                         "mesh.devices_per_node")
    return nodes


def node_split(sizes: dict, per_node: int) -> dict:
    """{axis: how many of its devices share a node}, filling a node in NODE_ORDER (each axis takes the largest
    part of its size that still fits): e.g. tensor=2, expert=4, fsdp=8 on 8-device nodes -> tensor and expert
    whole inside a node, fsdp across 4 nodes."""
    inner, room = {}, per_node
    for a in NODE_ORDER:
        inner[a] = math.gcd(sizes[a], room)
        room //= inner[a]
    if room != 1:
        raise ValueError(f"mesh: sizes {sizes} cannot fill nodes of {per_node} devices with whole axis blocks")
    return inner


def make_mesh(sizes: dict, devices=None, devices_per_node: int = 0) -> Mesh:
    """A (data, fsdp, tensor, expert) mesh laid over the nodes (`nodes_of`): each axis is split into a part
    inside a node (`node_split`) and a part across nodes, so tensor and expert groups stay on a node's fast
    links and data/fsdp span nodes. Inside a node `mesh_utils.create_device_mesh` orders the devices (the
    physical torus on TPU; device order elsewhere). One node (a single process): the devices in order."""
    from jax.experimental import mesh_utils

    devices = list(devices if devices is not None else jax.devices())
    s = resolve_sizes(sizes, len(devices))
    nodes = nodes_of(devices, devices_per_node)
    inner = node_split(s, len(nodes[0]))
    k = len(MESH_AXES)
    grid = np.stack([mesh_utils.create_device_mesh([inner[a] for a in MESH_AXES], node,
                                                   allow_split_physical_axes=True) for node in nodes])
    # [nodes, *inner] -> [*outer, *inner] -> each axis = (its across-node part, its in-node part)
    grid = grid.reshape([s[a] // inner[a] for a in MESH_AXES] + [inner[a] for a in MESH_AXES])
    grid = grid.transpose([j for i in range(k) for j in (i, k + i)]).reshape([s[a] for a in MESH_AXES])
    return Mesh(grid, MESH_AXES)


def batch_sharding(mesh: Mesh, ndim: int = 2) -> NamedSharding:
    """Rows over (data, fsdp, expert); the rest replicated."""
    return NamedSharding(mesh, P(BATCH_AXES, *([None] * (ndim - 1))))


def batch_shards(mesh: Mesh) -> int:
    return math.prod(mesh.shape[a] for a in BATCH_AXES)


def batch_shards_of(sizes: dict) -> int:
    """`batch_shards` of a mesh given by its axis sizes (before it exists; -1 counts as 1)."""
    return math.prod(max(1, int(sizes.get(a, 1))) for a in BATCH_AXES)


def row_shards(mesh, rows: int) -> int:
    """How many ways `pin_batch` splits `rows` rows on `mesh` (1 without a mesh or when they do not divide)."""
    if mesh is None:
        return 1
    n = math.prod(mesh.shape[a] for a in BATCH_AXES if mesh.shape.get(a, 1) > 1)
    return n if rows % n == 0 else 1


def context_shards(mesh, length: int | None = None) -> int:
    """The mesh's `context` size (1 without a mesh or the axis; 1 too when it does not divide `length`)."""
    n = 1 if mesh is None else mesh.shape.get("context", 1)
    return 1 if length is not None and length % n else n


def token_axes(mesh, tokens: int) -> tuple[str, ...]:
    """The mesh axes that split `tokens` flattened [B*L] tokens as `pin_batch` splits [B, L] (() if they do not
    divide)."""
    if mesh is None:
        return ()
    axes = tuple(a for a in TOKEN_AXES if mesh.shape.get(a, 1) > 1)
    return axes if tokens % math.prod(mesh.shape[a] for a in axes) == 0 else ()


def pin_batch(h, mesh, seq: bool = True):
    """h [B, L, ...] (inside jit): rows over the mesh's batch axes and, for 3-d and larger, the sequence over
    `context` (unless `seq` is False: e.g. the vision tower's sequence, whose attention spans an image),
    everything else unsharded, so GSPMD never picks a layout sharded on the hidden dimension (from an
    FSDP-sharded embedding table) with global-batch activations, nor gathers the rows for an op it partitions
    poorly (the router's top_k)."""
    rows = row_shards(mesh, h.shape[0]) > 1
    seq = seq and h.ndim >= 3 and context_shards(mesh, h.shape[1]) > 1
    if not rows and not seq:
        return h
    axes = tuple(a for a in BATCH_AXES if mesh.shape.get(a, 1) > 1) if rows else None
    return jax.lax.with_sharding_constraint(
        h, NamedSharding(mesh, P(axes or None, "context" if seq else None, *([None] * (h.ndim - 2)))))


def pin_tokens(x, mesh):
    """x [T, ...] flattened tokens (inside jit): split over `token_axes`, the rest unsharded."""
    axes = token_axes(mesh, x.shape[0])
    if not axes:
        return x
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, P(axes, *([None] * (x.ndim - 1)))))


def gather_shards(a, spec, first_dim: int = 0):
    """Inside shard_map: a's local shard, stored as `spec` (a PartitionSpec), all-gathered whole along every
    dimension from `first_dim` on (earlier dimensions, e.g. an expert axis, stay split)."""
    for dim, axes in list(enumerate(spec))[first_dim:]:
        if axes is not None:  # one gather over all of a dim's axes: (fsdp, context) orders blocks fsdp-major
            a = jax.lax.all_gather(a, axes, axis=dim, tiled=True)
    return a


def all_gather_f32_grad(a, axis: str, dim: int):
    """Inside shard_map: `all_gather(a, axis, tiled)` along `dim` in a's dtype, whose transpose (the cotangent's
    reduce-scatter) sums in fp32: the K/V gathers of context-parallel attention. A bf16 reduce-scatter out of a
    partly manual shard_map crashed XLA's CPU all-reduce promotion, and fp32 is the better sum for gradients."""

    @jax.custom_vjp
    def gather(x):
        return jax.lax.all_gather(x, axis, axis=dim, tiled=True)

    def bwd(_, g):
        return (jax.lax.psum_scatter(g.astype(jnp.float32), axis, scatter_dimension=dim, tiled=True).astype(a.dtype),)

    gather.defvjp(lambda x: (gather(x), None), bwd)
    return gather(a)


def fetch(tree):
    """Device arrays -> numpy (`jax.device_get`). Over several processes an array spanning other processes'
    devices is gathered from them (`process_allgather`): a collective, so every process fetches the same arrays in
    the same order (`nemo_jax.serve.replica` replays the calls that do)."""
    if all(getattr(x, "is_fully_addressable", True) for x in jax.tree.leaves(tree)):
        return jax.device_get(tree)
    from jax.experimental import multihost_utils

    return multihost_utils.process_allgather(tree, tiled=True)
