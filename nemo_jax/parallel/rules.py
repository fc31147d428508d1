"""Logical axis names -> mesh axes. One small rules object; two logical axes of one tensor may not share a
mesh axis, and a dimension takes the longest prefix of its mesh axes whose sizes multiply to a divisor of it
(fsdp=4 x expert=2 on a dimension of 12 keeps fsdp only; of 6, neither)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import jax
from jax.sharding import NamedSharding, PartitionSpec as P

from nemo_jax.paramspec import ParamSpec

MESH_AXES = ("data", "fsdp", "tensor", "expert", "context")

DEFAULT_RULES = {
    "layers": None,
    "vocab": "tensor",
    # weights' D dim over fsdp, context and expert: the context and expert groups are data-parallel groups for
    # the dense weights (their members see other tokens), so they split the weights, gradients (reduce-scatter
    # instead of an all-reduce) and optimiser state as FSDP does; without it context=8 or expert=8 held 8x the
    # bytes of every non-expert weight. Routed experts' D dim is `expert_in` (their E dim takes `expert`).
    "embed": ("fsdp", "context", "expert"),
    "q_heads": "tensor",
    "kv_heads": "tensor",
    "mlp": "tensor",
    "mamba_in_proj": "tensor",
    "mamba_inner": "tensor",
    "mamba_conv": "tensor",
    "conv_kernel": None,
    "ssm_heads": None,
    "norm": None,
    "router_experts": None,
    "experts": "expert",
    "expert_mlp": "tensor",
    "expert_in": ("fsdp", "context"),  # routed experts' D (or latent) dim: without it latent experts were split only E-ways
    "latent": None,
    # the vision tower (small next to the LM): weights split over the FSDP group on Dv, replicated over tensor
    # (the fused q|k|v output would not split at head boundaries)
    "vision_embed": ("fsdp", "context", "expert"),
    "vision_qkv": None,
    "vision_mlp": "tensor",
    "vision_norm": None,
    "vision_patch": None,
    "vision_positions": None,
    "vision_merged": ("fsdp", "context", "expert"),
    "projector": "tensor",
    # activations
    "batch": ("data", "fsdp", "expert"),
    "seq": "context",  # context parallelism: each device holds a contiguous part of every row
    "act_embed": None,
}


@dataclass(frozen=True)
class Rules:
    table: dict = field(default_factory=lambda: dict(DEFAULT_RULES))

    def spec(self, axes: tuple, shape: tuple | None = None, mesh=None) -> P:
        used: set[str] = set()
        out = []
        for i, a in enumerate(axes):
            if a is not None and a not in self.table:
                raise ValueError(f"sharding rules: no rule for logical axis {a!r}")
            m = self.table.get(a) if a is not None else None
            ms = (m,) if isinstance(m, str) else tuple(m or ())
            for x in ms:
                if x in used:
                    raise ValueError(f"sharding rules: mesh axis {x!r} used twice in {axes}")
            if mesh is not None:
                ms = tuple(x for x in ms if x in mesh.shape and mesh.shape[x] > 1)
                while shape is not None and ms and shape[i] % math.prod(mesh.shape[x] for x in ms):
                    ms = ms[:-1]
            used.update(ms)
            out.append(None if not ms else (ms[0] if len(ms) == 1 else ms))
        return P(*out)

    def sharding(self, mesh, axes: tuple, shape: tuple | None = None) -> NamedSharding:
        return NamedSharding(mesh, self.spec(axes, shape, mesh))

    def with_overrides(self, **kw) -> "Rules":
        t = dict(self.table)
        t.update(kw)
        return Rules(t)


def param_shardings(specs_tree, mesh, rules: Rules | None = None):
    """ParamSpec tree -> NamedSharding tree."""
    rules = rules or Rules()
    return jax.tree.map(lambda s: rules.sharding(mesh, s.axes, s.shape), specs_tree,
                        is_leaf=lambda x: isinstance(x, ParamSpec))
