"""The RADIO vision tower, pixel shuffle and projector of `nemotron_h_omni` models, as pure functions.

    x = patch_projection(pixel patches) + pos(each image's grid)      # cls + register tokens before each image
    for each layer: x = x + ls1 * attn(ln1(x)); x = x + ls2 * mlp(ln2(x))   # attention within each image only
    f = final_layernorm(x)                                             # only with MTP layers in the LM
    t = projector(pixel_shuffle(f))                                    # merge x merge patches -> one token
    embeddings[tokens == image_token_id] = t                           # in order, per row

Images arrive as transformers' image processor emits them (`pixel_values [patches, C*p*p]`, normalised,
each patch channel-major; `image_grid_hw [n, 2]`). Everything that depends on the grids (where each patch
and prefix token sits, the bilinear taps of the position table, which patches merge into which token) is
computed on the host by `layout` into fixed-size index arrays, so a jitted step sees one shape for any mix
of image sizes within a row's patch budget. Rows are independent: `encode` takes [B, ...] arrays and each
row's images become that row's tokens, so images shard with their rows over the batch axes.

Parameter tree (`nemo_jax.model.spec.vision_specs`; leaf paths read like the HF names, see `nemo_jax.hf.mapping`):

    vision/embeddings/patch_projection/kernel    [C*p*p, Dv]
    vision/embeddings/video_patch_projection/kernel [T*C*p*p, Dv]   (carried for the round trip; unused)
    vision/embeddings/position_embedding         [1, G*G, Dv]        (G = max_img_size / patch_size)
    vision/embeddings/cls_register_token         [n_prefix, Dv]
    vision/layers/{norm1,norm2}/{scale,bias}     [L, Dv]
    vision/layers/attn/qkv/{kernel,bias}         [L, Dv, 3*Dv], [L, 3*Dv]   (q | k | v)
    vision/layers/attn/proj/{kernel,bias}        [L, Dv, Dv], [L, Dv]
    vision/layers/layer_scale{1,2}/lambda1       [L, Dv]
    vision/layers/mlp/fc1, fc2                   (or gate_proj / up_proj / down_proj with use_swiglu_ffn)
    vision/final_layernorm/{scale,bias}          [Dv]                (LMs with MTP layers)
    projector/norm/scale [m*m*Dv]; projector/linear_1/kernel [m*m*Dv, P]; projector/linear_2/kernel [P, D]
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from nemo_jax.config.vision import VisionConfig
from nemo_jax.model.layers import linear, relu2, rms_norm
from nemo_jax.parallel.mesh import pin_batch
from nemo_jax.vision_layout import (LAYOUT_KEYS, batch_layout, bilinear_taps, layout, pack_inputs,  # noqa: F401
                                    position_taps, tokens_per_image)

PROJECTOR_EPS = 1e-5  # the projector's RMSNorm (transformers' default; not in config.json)


# --------------------------------------------------------------------------- the tower
def _act(name: str):
    return {"gelu": lambda x: jax.nn.gelu(x, approximate=False), "gelu_new": jax.nn.gelu,
            "gelu_pytorch_tanh": jax.nn.gelu, "quick_gelu": lambda x: x * jax.nn.sigmoid(1.702 * x),
            "relu": jax.nn.relu, "silu": jax.nn.silu}[name]


def _dense(x, p: dict, dtype):
    y = linear(x, p, dtype)
    return y + p["bias"].astype(dtype) if "bias" in p else y


def layer_norm(x, p: dict, eps: float):
    """LayerNorm in fp32, result in x's dtype."""
    x32 = x.astype(jnp.float32)
    mu = jnp.mean(x32, -1, keepdims=True)
    var = jnp.mean(jnp.square(x32 - mu), -1, keepdims=True)
    y = (x32 - mu) * jax.lax.rsqrt(var + eps) * p["scale"].astype(jnp.float32) + p["bias"].astype(jnp.float32)
    return y.astype(x.dtype)


ATTENTION_BLOCK = 1024  # query rows per step of the ViT attention (memory: [B, H, block, S] scores at a time)


def _attend(q, k, val, seg_q, seg_k, dtype):
    """q [B, Q, H, hd], k/val [B, S, H, hd]: softmax attention of each query to the keys of its own image
    (segment; padding slots, segment 0, attend among themselves) -> [B, Q, H, hd]."""
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32) * q.shape[-1] ** -0.5
    s = jnp.where((seg_q[:, :, None] == seg_k[:, None, :])[:, None], s, -1e30)
    a = jax.nn.softmax(s, axis=-1).astype(dtype)
    return jnp.einsum("bhqk,bkhd->bqhd", a, val, preferred_element_type=jnp.float32).astype(dtype)


def attention(q, k, val, segment, dtype, block: int = ATTENTION_BLOCK):
    """Bidirectional attention within each image over [B, S, H, hd], query block by query block (a scan of
    checkpointed blocks: [B, H, block, S] scores live at a time, forward and backward). block >= S: one block,
    the plain reference."""
    B, S, H, hd = q.shape
    if block >= S:
        return _attend(q, k, val, segment, segment, dtype)
    n = -(-S // block)
    pad = n * block - S
    qb = jnp.pad(q, ((0, 0), (0, pad), (0, 0), (0, 0))).reshape(B, n, block, H, hd).swapaxes(0, 1)
    sb = jnp.pad(segment, ((0, 0), (0, pad))).reshape(B, n, block).swapaxes(0, 1)
    step = jax.checkpoint(lambda _, xs: (None, _attend(xs[0], k, val, xs[1], segment, dtype)))
    _, o = jax.lax.scan(step, None, (qb, sb))
    return o.swapaxes(0, 1).reshape(B, n * block, H, hd)[:, :S]


def _block(p: dict, x, segment, v: VisionConfig, dtype, block: int = ATTENTION_BLOCK):
    """One ViT layer over [B, S, Dv]; each slot attends to the slots of its own image (segment)."""
    B, S, Dv = x.shape
    H = v.num_attention_heads
    u = layer_norm(x, p["norm1"], v.layer_norm_eps)
    qkv = _dense(u, p["attn"]["qkv"], dtype).reshape(B, S, 3, H, Dv // H)
    o = attention(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], segment, dtype, block).reshape(B, S, Dv)
    x = x + (_dense(o, p["attn"]["proj"], dtype) * p["layer_scale1"]["lambda1"].astype(dtype)).astype(x.dtype)
    u = layer_norm(x, p["norm2"], v.layer_norm_eps)
    if v.use_swiglu_ffn:
        m = p["mlp"]
        y = _dense(jax.nn.silu(_dense(u, m["gate_proj"], dtype)) * _dense(u, m["up_proj"], dtype), m["down_proj"], dtype)
    else:
        y = _dense(_act(v.hidden_act)(_dense(u, p["mlp"]["fc1"], dtype)), p["mlp"]["fc2"], dtype)
    return x + (y * p["layer_scale2"]["lambda1"].astype(dtype)).astype(x.dtype)


def _replicated(a, mesh):
    if mesh is None:
        return a
    from jax.sharding import NamedSharding, PartitionSpec as P

    return jax.lax.with_sharding_constraint(a, NamedSharding(mesh, P()))


def tower(p: dict, pixel_values, lay: dict, v: VisionConfig, dtype=jnp.float32, *, scan: bool = True, mesh=None):
    """The ViT: pixel_values [B, P, C*p*p] + layout arrays [B, ...] -> last hidden state [B, S, Dv]. On a mesh
    the activations are pinned rows-sharded (each row's images stay on its devices), hidden unsharded."""
    e = p["embeddings"]
    x = linear(pixel_values, e["patch_projection"], dtype)  # [B, P, Dv]
    x = jnp.take_along_axis(x, lay["patch_src"][..., None], axis=1)  # [B, S, Dv]
    # the tables are gathered whole before the lookups (indexing an FSDP-sharded table gave Dv-sharded rows
    # that GSPMD could only re-lay by replicating them)
    table = _replicated(e["position_embedding"][0].astype(jnp.float32), mesh)  # [G*G, Dv]
    pos = jnp.einsum("bsk,bskd->bsd", lay["pos_w"], jnp.take(table, lay["pos_idx"], axis=0))
    prefix = jnp.take(_replicated(e["cls_register_token"].astype(dtype), mesh), lay["prefix_src"], axis=0)
    kind = lay["kind"][..., None]
    x = jnp.where(kind == 2, x + pos.astype(dtype), jnp.where(kind == 1, prefix, jnp.zeros_like(x)))
    pin = lambda x: pin_batch(x, mesh, seq=False)  # noqa: E731
    block = jax.checkpoint(lambda x, lp: pin(_block(lp, x, lay["segment"], v, dtype)))
    x = pin(x)
    if scan:
        x, _ = jax.lax.scan(lambda x, lp: (block(x, lp), None), x, p["layers"])
    else:
        for i in range(v.num_hidden_layers):
            x = pin(_block(jax.tree.map(lambda a: a[i], p["layers"]), x, lay["segment"], v, dtype))
    return x


def encode(params: dict, images: dict, cfg, dtype=jnp.float32, *, scan: bool = True, mesh=None):
    """Image batch {"pixel_values" [B, P, C*p*p], **layout} -> language tokens [B, N, D] in `dtype`
    (rows of `token_valid` false are padding)."""
    v: VisionConfig = cfg.vision
    lay = {k: images[k] for k in LAYOUT_KEYS}
    x = tower(params["vision"], images["pixel_values"].astype(dtype), lay, v, dtype, scan=scan, mesh=mesh)
    if "final_layernorm" in params["vision"]:
        x = layer_norm(x, params["vision"]["final_layernorm"], v.layer_norm_eps)
    B, N, mm = lay["shuffle"].shape
    f = jnp.take_along_axis(x, lay["shuffle"].reshape(B, N * mm)[..., None], axis=1).reshape(B, N, mm * x.shape[-1])
    pj = params["projector"]
    f = rms_norm(f, pj["norm"]["scale"], PROJECTOR_EPS)
    return pin_batch(linear(relu2(linear(f, pj["linear_1"], dtype)), pj["linear_2"], dtype), mesh, seq=False)


def insert(h, tokens, feats, image_token_id: int):
    """h [B, T, D] token embeddings: the k-th placeholder of each row takes that row's k-th image token."""
    mask = tokens == image_token_id
    k = jnp.clip(jnp.cumsum(mask, axis=1) - 1, 0, feats.shape[1] - 1)
    return jnp.where(mask[..., None], jnp.take_along_axis(feats, k[..., None], axis=1).astype(h.dtype), h)


def check_images(images: dict, cfg) -> None:
    """Clear errors for an image batch that does not fit the config (host-side, concrete arrays only)."""
    v = cfg.vision
    if v is None:
        raise ValueError("images given but the model config has no vision tower (not a nemotron_h_omni model)")
    missing = [k for k in ("pixel_values",) + LAYOUT_KEYS if k not in images]
    if missing:
        raise ValueError(f"image batch lacks {missing} (build it with nemo_jax.model.vision.pack_inputs or layout)")
    if images["pixel_values"].shape[-1] != v.patch_dim:
        raise ValueError(f"pixel_values: last dim {images['pixel_values'].shape[-1]}, the vision tower takes "
                         f"{v.patch_dim} = channels x patch_size^2 (video and audio inputs are not supported)")
