"""Device mesh over (data, fsdp, tensor, expert); a size of -1 takes the remaining devices."""

from __future__ import annotations

import math
import os

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from nemo_jax.parallel.rules import MESH_AXES

BATCH_AXES = ("data", "fsdp", "expert")


def resolve_sizes(sizes: dict, n_devices: int) -> dict:
    sizes = {a: int(sizes.get(a, 1)) for a in MESH_AXES}
    free = [a for a, s in sizes.items() if s == -1]
    if len(free) > 1:
        raise ValueError(f"mesh: only one axis may be -1, got {free}")
    fixed = math.prod(s for s in sizes.values() if s != -1)
    for a, s in sizes.items():
        if s == 0 or s < -1:
            raise ValueError(f"mesh.{a}: size must be positive or -1, got {s}")
    if free:
        if n_devices % fixed:
            raise ValueError(f"mesh: {n_devices} devices not divisible by the fixed axes' product {fixed}")
        sizes[free[0]] = n_devices // fixed
    if math.prod(sizes.values()) != n_devices:
        raise ValueError(f"mesh: sizes {sizes} use {math.prod(sizes.values())} devices, {n_devices} available")
    return sizes


def read_mesh_sizes(spec: str) -> dict:
    """A `--mesh` argument: a preset YAML (configs/mesh/*.yaml) or inline sizes "fsdp=8,tensor=2" -> {axis: size}."""
    if os.path.isfile(spec):
        import yaml

        with open(spec) as f:
            sizes = yaml.safe_load(f) or {}
        if not isinstance(sizes, dict):
            raise ValueError(f"{spec}: a mesh preset must be a mapping of axis: size")
    elif "=" in spec:
        sizes = {k.strip(): v for k, v in (kv.split("=", 1) for kv in spec.split(",") if kv)}
    else:
        raise FileNotFoundError(f"--mesh {spec!r}: neither a preset file nor sizes like fsdp=8,tensor=2")
    for k, v in sizes.items():
        if k not in MESH_AXES:
            raise ValueError(f"--mesh {spec}: unknown axis {k!r} (axes: {', '.join(MESH_AXES)})")
        try:
            sizes[k] = int(v)
        except (TypeError, ValueError):
            raise ValueError(f"--mesh {spec}: size of {k!r} must be an integer, got {v!r}") from None
    return sizes


def make_mesh(sizes: dict, devices=None) -> Mesh:
    devices = list(devices if devices is not None else jax.devices())
    s = resolve_sizes(sizes, len(devices))
    arr = np.asarray(devices).reshape([s[a] for a in MESH_AXES])
    return Mesh(arr, MESH_AXES)


def batch_sharding(mesh: Mesh, ndim: int = 2) -> NamedSharding:
    """Rows over (data, fsdp, expert); the rest replicated."""
    return NamedSharding(mesh, P(BATCH_AXES, *([None] * (ndim - 1))))


def batch_shards(mesh: Mesh) -> int:
    return math.prod(mesh.shape[a] for a in BATCH_AXES)


def row_shards(mesh, rows: int) -> int:
    """How many ways `pin_batch` splits `rows` rows on `mesh` (1 without a mesh or when they do not divide)."""
    if mesh is None:
        return 1
    n = math.prod(mesh.shape[a] for a in BATCH_AXES if mesh.shape.get(a, 1) > 1)
    return n if rows % n == 0 else 1


def pin_batch(h, mesh):
    """h [B, ...] (inside jit): rows over the mesh's batch axes, everything else unsharded, so GSPMD never
    picks a layout sharded on the hidden dimension (from an FSDP-sharded embedding table) with global-batch
    activations, nor gathers the rows for an op it partitions poorly (the router's top_k)."""
    if mesh is None or row_shards(mesh, h.shape[0]) == 1:
        return h
    axes = tuple(a for a in BATCH_AXES if mesh.shape.get(a, 1) > 1)
    return jax.lax.with_sharding_constraint(h, NamedSharding(mesh, P(axes, *([None] * (h.ndim - 1)))))


def gather_shards(a, spec, first_dim: int = 0):
    """Inside shard_map: a's local shard, stored as `spec` (a PartitionSpec), all-gathered whole along every
    dimension from `first_dim` on (earlier dimensions, e.g. an expert axis, stay split)."""
    for dim, axes in list(enumerate(spec))[first_dim:]:
        for ax in () if axes is None else (axes,) if isinstance(axes, str) else axes:
            a = jax.lax.all_gather(a, ax, axis=dim, tiled=True)
    return a
