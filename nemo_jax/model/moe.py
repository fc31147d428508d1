"""Mixture of experts: sigmoid router with correction bias and group-limited top-k, relu^2 experts,
shared expert, optional latent projections.

Dispatch paths (all give the same values when nothing is dropped):
* "sorted" (default, dropless): token-slots sorted by expert into blocks of `bs` slots, each block owned by
  one expert, then one batched matmul over blocks. Padding is at most E*(bs-1) slots, and bs is chosen
  as n_slots / (2E), so compiled FLOPs stay <= 1.5x the useful expert FLOPs.
* "capacity": per-expert buffers of `ceil(cf * n_slots / E)` slots; overflow is dropped and counted.
* "ragged": `jax.lax.ragged_dot` on the sorted slots (native grouped GEMM on TPU; XLA on CPU and on GPU
  without the cuDNN grouped-GEMM fusion lowers it to dense work over all experts).
* "dense": reference, every expert on every token.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from nemo_jax.model.layers import linear, mlp, relu2

DISPATCHES = ("sorted", "capacity", "ragged", "dense")


def route(p_gate: dict, x: jax.Array, cfg):
    """x [T, D] -> weights [T, k] fp32, expert ids [T, k] int32, sigmoid scores [T, E] fp32."""
    E, k, G = cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.n_group
    logits = jnp.einsum("td,de->te", x.astype(jnp.float32), p_gate["kernel"].astype(jnp.float32))
    scores = jax.nn.sigmoid(logits)
    choice = scores + p_gate["correction_bias"].astype(jnp.float32)
    if G > 1:
        grouped = choice.reshape(-1, G, E // G)
        group_score = jnp.sum(jax.lax.top_k(grouped, 2)[0], axis=-1)  # [T, G]
        _, keep = jax.lax.top_k(group_score, cfg.topk_group)
        gmask = jnp.any(jax.nn.one_hot(keep, G, dtype=bool), axis=1)  # [T, G]
        choice = jnp.where(jnp.repeat(gmask, E // G, axis=1), choice, -jnp.inf)
    _, idx = jax.lax.top_k(jax.lax.stop_gradient(choice), k)
    w = jnp.take_along_axis(scores, idx, axis=1)
    if cfg.norm_topk_prob:
        w = w / (jnp.sum(w, axis=-1, keepdims=True) + 1e-20)
    return w * cfg.routed_scaling_factor, idx.astype(jnp.int32), scores


def block_size(n_slots: int, n_experts: int) -> int:
    return max(1, n_slots // (2 * n_experts))


def _slot_layout(flat_e, E: int, dispatch: str, capacity_factor: float):
    """Where each token-slot goes in the expert buffer.

    Returns dest [n] (slot index), keep [n] bool, block_expert [nb] (expert of each block), nb, bs.
    """
    n = flat_e.shape[0]
    order = jnp.argsort(flat_e, stable=True)
    sorted_e = flat_e[order]
    counts = jnp.bincount(flat_e, length=E)
    start = jnp.cumsum(counts) - counts
    rank_sorted = jnp.arange(n) - start[sorted_e]
    rank = jnp.zeros((n,), jnp.int32).at[order].set(rank_sorted.astype(jnp.int32))
    if dispatch == "capacity":
        bs = max(1, math.ceil(capacity_factor * n / E))
        keep = rank < bs
        dest = jnp.where(keep, flat_e * bs + rank, E * bs)  # dropped slots point past the end
        return dest, keep, jnp.arange(E), E, bs, counts
    bs = block_size(n, E)
    nb = min(n, (n + E * (bs - 1)) // bs)
    padded = (counts + bs - 1) // bs * bs
    pend = jnp.cumsum(padded)
    dest = (pend - padded)[flat_e] + rank
    block_expert = jnp.minimum(jnp.searchsorted(pend, jnp.arange(nb) * bs, side="right"), E - 1)
    return dest, jnp.ones((n,), bool), block_expert, nb, bs, counts


def experts_forward(pe: dict, x: jax.Array, w: jax.Array, idx: jax.Array, cfg, dtype, dispatch: str = "sorted",
                    capacity_factor: float = 1.25):
    """Routed experts. x [T, Din], w/idx [T, k] -> (y [T, Din], counts [E], dropped slots)."""
    T, k = idx.shape
    E = cfg.n_routed_experts
    up, down = pe["up_proj"].astype(dtype), pe["down_proj"].astype(dtype)
    x = x.astype(dtype)
    if dispatch == "dense":
        h = relu2(jnp.einsum("td,edi->tei", x, up, preferred_element_type=jnp.float32).astype(dtype))
        y_all = jnp.einsum("tei,eid->ted", h, down, preferred_element_type=jnp.float32)
        dense_w = jnp.zeros((T, E), jnp.float32).at[jnp.arange(T)[:, None], idx].add(w)
        counts = jnp.bincount(idx.reshape(-1), length=E)
        return jnp.einsum("ted,te->td", y_all, dense_w).astype(dtype), counts, jnp.zeros((), jnp.int32)
    flat_e = idx.reshape(-1)
    tok = jnp.arange(T * k) // k
    if dispatch == "ragged":
        order = jnp.argsort(flat_e, stable=True)
        counts = jnp.bincount(flat_e, length=E)
        xs = x[tok[order]]
        h = relu2(jax.lax.ragged_dot(xs, up, counts.astype(jnp.int32), preferred_element_type=jnp.float32).astype(dtype))
        ys = jax.lax.ragged_dot(h, down, counts.astype(jnp.int32), preferred_element_type=jnp.float32)
        y_slots = jnp.zeros_like(ys).at[order].set(ys)
        y = jnp.sum(y_slots.reshape(T, k, -1) * w[..., None], axis=1)
        return y.astype(dtype), counts, jnp.zeros((), jnp.int32)
    if dispatch not in ("sorted", "capacity"):
        raise ValueError(f"unknown MoE dispatch {dispatch!r}; expected one of {DISPATCHES}")
    dest, keep, block_expert, nb, bs, counts = _slot_layout(flat_e, E, dispatch, capacity_factor)
    buf = jnp.zeros((nb * bs + 1, x.shape[-1]), dtype).at[dest].set(x[tok], mode="drop")[:-1]
    xb = buf.reshape(nb, bs, -1)
    if dispatch == "capacity":
        w_up, w_down = up, down
    else:
        w_up, w_down = up[block_expert], down[block_expert]
    h = relu2(jnp.einsum("gbd,gdi->gbi", xb, w_up, preferred_element_type=jnp.float32).astype(dtype))
    yb = jnp.einsum("gbi,gid->gbd", h, w_down, preferred_element_type=jnp.float32)
    y_slots = jnp.take(yb.reshape(nb * bs, -1), jnp.minimum(dest, nb * bs - 1), axis=0)
    y_slots = jnp.where(keep[:, None], y_slots, 0.0)
    y = jnp.sum(y_slots.reshape(T, k, -1) * w[..., None], axis=1)
    return y.astype(dtype), counts, jnp.sum(~keep).astype(jnp.int32)


def moe(p: dict, u: jax.Array, cfg, dtype, *, dispatch: str = "sorted", capacity_factor: float = 1.25,
        token_mask=None):
    """u [b, l, D] -> (out [b, l, D], aux) with aux = {aux_loss, load [E] (slot counts), dropped}.

    `token_mask` [b, l] (optional) excludes padding from the balance statistics.
    """
    b, l, D = u.shape
    x = u.reshape(b * l, D)
    w, idx, scores = route(p["gate"], x, cfg)
    xin = linear(x, p["fc1_latent_proj"], dtype) if cfg.moe_latent_size else x
    y, counts, dropped = experts_forward(p["experts"], xin, w, idx, cfg, dtype, dispatch, capacity_factor)
    if cfg.moe_latent_size:
        y = linear(y, p["fc2_latent_proj"], dtype)
    if cfg.n_shared_experts:
        y = y + mlp(p["shared_experts"], x, dtype)
    # switch-style balance loss on the unbiased scores: E * sum_e f_e * P_e
    E, k = cfg.n_routed_experts, cfg.num_experts_per_tok
    m = jnp.ones((b * l,), jnp.float32) if token_mask is None else token_mask.reshape(-1).astype(jnp.float32)
    n_tok = jnp.maximum(jnp.sum(m), 1.0)
    onehot = jnp.sum(jax.nn.one_hot(idx, E, dtype=jnp.float32), axis=1) * m[:, None]  # [T, E]
    load = jnp.sum(onehot, axis=0)
    f = load / (n_tok * k)
    probs = scores / (jnp.sum(scores, axis=-1, keepdims=True) + 1e-20)
    P = jnp.sum(probs * m[:, None], axis=0) / n_tok
    aux = {"aux_loss": E * jnp.sum(jax.lax.stop_gradient(f) * P), "load": load, "dropped": dropped}
    return y.reshape(b, l, D).astype(dtype), aux
