"""One parameter spec per tensor: shape, logical axes and initializer.

`param_specs(cfg)` is the single source of the parameter tree. `init`, `abstract_params` and
`logical_axes` are all read off it, so shapes, shardings and initial values cannot disagree.

Layout (leaf paths read like HF names; layers of one kind are stacked on a leading `layers` axis in
layer order, so `layers/moe/mixer/experts/up_proj/kernel` is `[n_moe, E, in, I]`):

    embeddings/embedding              [V, D]
    layers/{kind}/norm/scale          [n_kind, D]
    layers/mamba/mixer/...            in_proj [D, 2*Di + 2*G*N + H] and conv1d kernel [K, C] + bias [C], their
                                      columns / channels group-major (`PARAM_LAYOUT` below; HF's are part-major),
                                      A_log/D/dt_bias [H], norm/scale [Di], out_proj [Di, D]
    layers/attention/mixer/...        q_proj [D, nh*hd], k_proj/v_proj [D, nkv*hd], o_proj [nh*hd, D]
    layers/mlp/mixer/...              up_proj [D, I], down_proj [I, D]
    layers/moe/mixer/...              gate/kernel [D, E], gate/correction_bias [E],
                                      experts/up_proj [E, Din, Ie], experts/down_proj [E, Ie, Din],
                                      shared_experts/up_proj [D, Is], down_proj [Is, D],
                                      fc1_latent_proj [D, Din], fc2_latent_proj [Din, D]  (latent only)
    norm_f/scale [D], lm_head/kernel [D, V]
    mtp/...                           enorm, hnorm, eh_proj [2D, D], layers/{kind}/..., final_layernorm
    vision/..., projector/...         the RADIO tower and projector of omni models (`vision_specs` below; the
                                      forward is `nemo_jax.model.vision`)
"""

from __future__ import annotations

import math
import jax
import jax.numpy as jnp
import numpy as np

from nemo_jax.config.model import NemotronHConfig
from nemo_jax.paramspec import Init, ParamSpec  # noqa: F401  (re-exported: the model's spec type)

EMBEDDING_AXES = ("vocab", "embed")  # the token embedding table [V, D]
LM_HEAD_AXES = ("embed", "vocab")  # the lm_head kernel [D, V]

def _normal(std: float) -> Init:
    return lambda key, shape, dtype: (std * jax.random.normal(key, shape, jnp.float32)).astype(dtype)


def _const(value: float) -> Init:
    return lambda key, shape, dtype: jnp.full(shape, value, dtype)


def _uniform(bound: float) -> Init:
    return lambda key, shape, dtype: jax.random.uniform(key, shape, jnp.float32, -bound, bound).astype(dtype)


def _a_log(key, shape, dtype):
    return jnp.broadcast_to(jnp.log(jnp.arange(1, shape[-1] + 1, dtype=jnp.float32)), shape).astype(dtype)


def _dt_bias(cfg: NemotronHConfig) -> Init:
    def init(key, shape, dtype):
        lo, hi = math.log(cfg.time_step_min), math.log(cfg.time_step_max)
        dt = jnp.exp(jax.random.uniform(key, shape, jnp.float32) * (hi - lo) + lo)
        dt = jnp.maximum(dt, cfg.time_step_floor)
        return (dt + jnp.log(-jnp.expm1(-dt))).astype(dtype)  # inverse softplus

    return init


def dense(d_in: int, d_out: int, in_axis: str | None, out_axis: str | None, std: float) -> dict:
    return {"kernel": ParamSpec((d_in, d_out), (in_axis, out_axis), _normal(std))}


def norm(d: int, axis: str | None = "norm") -> dict:
    return {"scale": ParamSpec((d,), (axis,), _const(1.0))}


def mixer_specs(cfg: NemotronHConfig, kind: str) -> dict:
    """Parameters of one layer's mixer (unstacked)."""
    D, std = cfg.hidden_size, cfg.initializer_range
    if kind == "mamba":
        H, K, C = cfg.mamba_num_heads, cfg.conv_kernel, cfg.conv_dim
        out_std = std / math.sqrt(cfg.num_hidden_layers)
        conv = {"kernel": ParamSpec((K, C), ("conv_kernel", "mamba_conv"), _uniform(1 / math.sqrt(K)))}
        if cfg.use_conv_bias:
            conv["bias"] = ParamSpec((C,), ("mamba_conv",), _uniform(1 / math.sqrt(K)))
        return {
            "in_proj": dense(D, cfg.in_proj_dim, "embed", "mamba_in_proj", std),
            "conv1d": conv,
            "A_log": ParamSpec((H,), ("ssm_heads",), _a_log),
            "D": ParamSpec((H,), ("ssm_heads",), _const(1.0)),
            "dt_bias": ParamSpec((H,), ("ssm_heads",), _dt_bias(cfg)),
            "norm": norm(cfg.d_inner, "mamba_inner"),
            "out_proj": dense(cfg.d_inner, D, "mamba_inner", "embed", out_std),
        }
    if kind == "attention":
        q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
        return {
            "q_proj": dense(D, q, "embed", "q_heads", std),
            "k_proj": dense(D, kv, "embed", "kv_heads", std),
            "v_proj": dense(D, kv, "embed", "kv_heads", std),
            "o_proj": dense(q, D, "q_heads", "embed", std),
        }
    if kind == "mlp":
        return {
            "up_proj": dense(D, cfg.intermediate_size, "embed", "mlp", std),
            "down_proj": dense(cfg.intermediate_size, D, "mlp", "embed", std),
        }
    if kind == "moe":
        E, Din, Ie = cfg.n_routed_experts, cfg.moe_input_size, cfg.moe_intermediate_size
        in_axis = "expert_in"  # the experts' model-side dim (D, or the latent size): FSDP-sharded like `embed`
        out = {
            "gate": {
                "kernel": ParamSpec((D, E), ("embed", "router_experts"), _normal(std)),
                "correction_bias": ParamSpec((E,), ("router_experts",), _const(0.0)),
            },
            "experts": {
                "up_proj": ParamSpec((E, Din, Ie), ("experts", in_axis, "expert_mlp"), _normal(std)),
                "down_proj": ParamSpec((E, Ie, Din), ("experts", "expert_mlp", in_axis), _normal(std)),
            },
        }
        if cfg.n_shared_experts:
            Is = cfg.moe_shared_expert_intermediate_size
            out["shared_experts"] = {
                "up_proj": dense(D, Is, "embed", "mlp", std),
                "down_proj": dense(Is, D, "mlp", "embed", std),
            }
        if cfg.moe_latent_size:
            out["fc1_latent_proj"] = dense(D, Din, "embed", "latent", std)
            out["fc2_latent_proj"] = dense(Din, D, "latent", "embed", std)
        return out
    raise ValueError(f"unknown layer kind {kind!r}")


def _stack_tree(tree, n: int):
    return jax.tree.map(lambda s: s.stacked(n), tree, is_leaf=lambda x: isinstance(x, ParamSpec))


def layer_stack_specs(cfg: NemotronHConfig, kinds: tuple[str, ...]) -> dict:
    counts: dict[str, int] = {}
    for k in kinds:
        counts[k] = counts.get(k, 0) + 1
    return {
        kind: _stack_tree({"norm": norm(cfg.hidden_size), "mixer": mixer_specs(cfg, kind)}, n)
        for kind, n in counts.items()
    }


def param_specs(cfg: NemotronHConfig) -> dict:
    D, V, std = cfg.hidden_size, cfg.vocab_size, cfg.initializer_range
    specs = {
        "embeddings": {"embedding": ParamSpec((V, D), EMBEDDING_AXES, _normal(std))},
        "layers": layer_stack_specs(cfg, cfg.layer_kinds),
        "norm_f": norm(D),
        "lm_head": dense(D, V, *LM_HEAD_AXES, std),
    }
    if cfg.num_nextn_predict_layers:
        specs["mtp"] = [mtp_specs(cfg) for _ in range(cfg.num_nextn_predict_layers)]
    if cfg.vision is not None:
        specs.update(vision_specs(cfg))
    return specs


def mtp_specs(cfg: NemotronHConfig) -> dict:
    D = cfg.hidden_size
    return {
        "enorm": norm(D),
        "hnorm": norm(D),
        "eh_proj": dense(2 * D, D, None, "embed", cfg.initializer_range),
        "layers": layer_stack_specs(cfg, cfg.mtp_layer_kinds),
        "final_layernorm": norm(D),
    }


def vision_specs(cfg: NemotronHConfig) -> dict:
    """ParamSpecs of the vision tower and projector of `cfg` (a NemotronHConfig with `.vision`):
    {"vision": ..., "projector": ...} (the leaf paths are listed in `nemo_jax.model.vision`'s docstring)."""
    v = cfg.vision
    Dv, std = v.hidden_size, 0.02
    zeros, ones = _const(0.0), _const(1.0)

    def affine(d_in, d_out, in_axis, out_axis, bias=True):
        out = {"kernel": ParamSpec((d_in, d_out), (in_axis, out_axis), _normal(std))}
        if bias:
            out["bias"] = ParamSpec((d_out,), (out_axis,), zeros)
        return out

    def layer_norm():
        return {"scale": ParamSpec((Dv,), ("vision_norm",), ones), "bias": ParamSpec((Dv,), ("vision_norm",), zeros)}

    qkv = affine(Dv, 3 * Dv, "vision_embed", "vision_qkv", bias=v.qkv_bias)
    if v.use_swiglu_ffn:
        mlp = {"gate_proj": affine(Dv, v.mlp_size, "vision_embed", "vision_mlp"),
               "up_proj": affine(Dv, v.mlp_size, "vision_embed", "vision_mlp"),
               "down_proj": affine(v.mlp_size, Dv, "vision_mlp", "vision_embed")}
    else:
        mlp = {"fc1": affine(Dv, v.mlp_size, "vision_embed", "vision_mlp"),
               "fc2": affine(v.mlp_size, Dv, "vision_mlp", "vision_embed")}
    layer = {
        "norm1": layer_norm(),
        "attn": {"qkv": qkv, "proj": affine(Dv, Dv, "vision_qkv", "vision_embed")},
        "layer_scale1": {"lambda1": ParamSpec((Dv,), ("vision_norm",), _const(v.layerscale_value))},
        "norm2": layer_norm(),
        "mlp": mlp,
        "layer_scale2": {"lambda1": ParamSpec((Dv,), ("vision_norm",), _const(v.layerscale_value))},
    }
    emb = {
        "patch_projection": affine(v.patch_dim, Dv, "vision_patch", "vision_embed", bias=False),
        "position_embedding": ParamSpec((1, v.max_grid ** 2, Dv), (None, "vision_positions", "vision_embed"),
                                        _normal(std)),
        "cls_register_token": ParamSpec((v.n_prefix, Dv), (None, "vision_embed"), _normal(std)),
    }
    if v.video_temporal_patch_size:
        emb["video_patch_projection"] = affine(v.video_temporal_patch_size * v.patch_dim, Dv, "vision_patch",
                                               "vision_embed", bias=False)
    tower = {"embeddings": emb, "layers": _stack_tree(layer, v.num_hidden_layers)}
    if cfg.num_nextn_predict_layers:
        tower["final_layernorm"] = layer_norm()
    merged = v.merge ** 2 * Dv
    projector = {
        "norm": {"scale": ParamSpec((merged,), ("vision_merged",), ones)},
        "linear_1": affine(merged, v.projector_hidden_size, "vision_merged", "projector", bias=False),
        "linear_2": affine(v.projector_hidden_size, cfg.hidden_size, "projector", "embed", bias=False),
    }
    return {"vision": tower, "projector": projector}


# The storage layout of the parameter tree, recorded in what nemo_jax writes (native models, adapter and run
# checkpoints). 2: the Mamba in_proj columns and conv channels are group-major (for each B/C group: its heads'
# z and x, B_g, C_g, its heads' dt; `nemo_jax.hf.mapping.mamba_group_runs`), so a tensor-parallel shard of
# whole groups splits with no communication. 1 (files without the record): HF's part-major order.
PARAM_LAYOUT = 2


def check_param_layout(found: int, where: str, cfg: NemotronHConfig | None = None):
    """Refuse parameters stored in another layout (`found`; 1 for files written before the record existed):
    loading them would silently permute the Mamba projections. A config without Mamba layers is unaffected."""
    kinds = () if cfg is None else cfg.layer_kinds + (cfg.mtp_layer_kinds if cfg.num_nextn_predict_layers else ())
    if found == PARAM_LAYOUT or (cfg is not None and "mamba" not in kinds):
        return
    raise ValueError(f"{where}: written with parameter layout {found} (Mamba in_proj and conv in HF's part-major "
                     f"order, nemo_jax before the group-major layout {PARAM_LAYOUT}); convert it with the nemo_jax "
                     "that wrote it to HF format and import that, or re-create it (`nemo-jax import` of the HF "
                     "checkpoint)")


def _is_spec(x) -> bool:
    return isinstance(x, ParamSpec)


def init(cfg: NemotronHConfig, key: jax.Array) -> dict:
    """Random parameters (fp32), as HF's initializer draws them in distribution."""
    specs = param_specs(cfg)
    leaves, treedef = jax.tree.flatten(specs, is_leaf=_is_spec)
    keys = jax.random.split(key, len(leaves))
    return jax.tree.unflatten(treedef, [s.init(k, s.shape, s.dtype) for s, k in zip(leaves, keys)])


def abstract_params(cfg: NemotronHConfig, sharding_fn=None) -> dict:
    """Shapes and dtypes only (no memory). `sharding_fn(spec) -> Sharding` adds shardings."""
    return jax.tree.map(
        lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=None if sharding_fn is None else sharding_fn(s)),
        param_specs(cfg), is_leaf=_is_spec,
    )


def logical_axes(cfg: NemotronHConfig) -> dict:
    return jax.tree.map(lambda s: s.axes, param_specs(cfg), is_leaf=_is_spec)


def count_params(cfg: NemotronHConfig) -> int:
    return int(sum(np.prod(s.shape) for s in jax.tree.leaves(param_specs(cfg), is_leaf=_is_spec)))


def path_str(path) -> str:
    """'layers/moe/mixer/gate/kernel' for a jax tree path."""
    parts = []
    for p in path:
        if isinstance(p, jax.tree_util.DictKey):
            parts.append(str(p.key))
        elif isinstance(p, jax.tree_util.SequenceKey):
            parts.append(str(p.idx))
        elif isinstance(p, jax.tree_util.GetAttrKey):
            parts.append(p.name)
        else:
            parts.append(str(p))
    return "/".join(parts)


def flatten_with_paths(tree) -> dict[str, object]:
    return {path_str(p): v for p, v in jax.tree_util.tree_flatten_with_path(tree)[0]}


def unflatten_paths(flat: dict[str, object]) -> dict:
    """{'a/b/c': leaf} -> nested dicts (the inverse of `flatten_with_paths`); `mtp` becomes the list of blocks
    the params hold (missing blocks empty)."""
    tree: dict = {}
    for path, v in flat.items():
        node = tree
        parts = path.split("/")
        for k in parts[:-1]:
            node = node.setdefault(k, {})
        node[parts[-1]] = v
    if "mtp" in tree:
        n = max(int(k) for k in tree["mtp"]) + 1
        tree["mtp"] = [tree["mtp"].get(str(i), {}) for i in range(n)]
    return tree
