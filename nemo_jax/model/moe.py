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


def _slot_layout(flat_e, E: int, dispatch: str, capacity_factor: float, valid=None):
    """Where each token-slot goes in the expert buffer.

    flat_e [n] expert of each slot (in [0, E)); valid [n] (optional) marks slots this buffer serves.
    Returns dest [n] (slot index, out of range = dropped), keep [n], block_expert [nb], nb, bs.
    """
    n = flat_e.shape[0]
    bucket = flat_e if valid is None else jnp.where(valid, flat_e, E)  # foreign slots sort last
    order = jnp.argsort(bucket, stable=True)
    counts = jnp.bincount(bucket, length=E + 1)[:E]
    start = jnp.cumsum(counts) - counts
    sorted_b = bucket[order]
    rank_sorted = jnp.arange(n) - jnp.concatenate([start, jnp.zeros((1,), start.dtype)])[sorted_b]
    rank = jnp.zeros((n,), jnp.int32).at[order].set(rank_sorted.astype(jnp.int32))
    ok = jnp.ones((n,), bool) if valid is None else valid
    if dispatch == "capacity":
        bs = max(1, math.ceil(capacity_factor * n / E))
        keep = ok & (rank < bs)
        return jnp.where(keep, flat_e * bs + rank, E * bs), keep, jnp.arange(E), E, bs
    bs = block_size(n, E)
    nb = min(n, (n + E * (bs - 1)) // bs)
    padded = (counts + bs - 1) // bs * bs
    pend = jnp.cumsum(padded)
    dest = (pend - padded)[jnp.minimum(flat_e, E - 1)] + rank
    keep = ok & (dest < nb * bs)
    block_expert = jnp.minimum(jnp.searchsorted(pend, jnp.arange(nb) * bs, side="right"), E - 1)
    return jnp.where(keep, dest, nb * bs), keep, block_expert, nb, bs


def _buffered_experts(up, down, x, w, idx, E: int, dtype, dispatch: str, capacity_factor: float, valid=None):
    """Sorted / capacity dispatch over E local experts. -> (y [T, Din] dtype, dropped slots among valid ones)."""
    T, k = idx.shape
    flat_e = idx.reshape(-1)
    fvalid = None if valid is None else valid.reshape(-1)
    tok = jnp.arange(T * k) // k
    dest, keep, block_expert, nb, bs = _slot_layout(flat_e, E, dispatch, capacity_factor, fvalid)
    buf = jnp.zeros((nb * bs, x.shape[-1]), dtype).at[dest].set(x[tok], mode="drop")
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
    served = jnp.ones_like(keep) if fvalid is None else fvalid
    return y.astype(dtype), jnp.sum(served & ~keep).astype(jnp.int32)


def experts_forward(pe: dict, x: jax.Array, w: jax.Array, idx: jax.Array, cfg, dtype, dispatch: str = "sorted",
                    capacity_factor: float = 1.25, mesh=None):
    """Routed experts. x [T, Din], w/idx [T, k] -> (y [T, Din], dropped slots).

    With a `mesh` whose `expert` axis is > 1 and a sorted/capacity dispatch, experts run expert-parallel
    inside `shard_map` (see `_expert_parallel`).
    """
    T, k = idx.shape
    E = cfg.n_routed_experts
    if dispatch not in DISPATCHES:
        raise ValueError(f"unknown MoE dispatch {dispatch!r}; expected one of {DISPATCHES}")
    if mesh is not None and mesh.shape.get("expert", 1) > 1 and dispatch in ("sorted", "capacity"):
        out = _expert_parallel(pe, x, w, idx, cfg, dtype, dispatch, capacity_factor, mesh)
        if out is not None:
            return out
    up, down = pe["up_proj"].astype(dtype), pe["down_proj"].astype(dtype)
    x = x.astype(dtype)
    if dispatch == "dense":
        h = relu2(jnp.einsum("td,edi->tei", x, up, preferred_element_type=jnp.float32).astype(dtype))
        y_all = jnp.einsum("tei,eid->ted", h, down, preferred_element_type=jnp.float32)
        dense_w = jnp.zeros((T, E), jnp.float32).at[jnp.arange(T)[:, None], idx].add(w)
        return jnp.einsum("ted,te->td", y_all, dense_w).astype(dtype), jnp.zeros((), jnp.int32)
    if dispatch == "ragged":
        flat_e = idx.reshape(-1)
        order = jnp.argsort(flat_e, stable=True)
        counts = jnp.bincount(flat_e, length=E).astype(jnp.int32)
        xs = x[(jnp.arange(T * k) // k)[order]]
        h = relu2(jax.lax.ragged_dot(xs, up, counts, preferred_element_type=jnp.float32).astype(dtype))
        ys = jax.lax.ragged_dot(h, down, counts, preferred_element_type=jnp.float32)
        y_slots = jnp.zeros_like(ys).at[order].set(ys)
        return jnp.sum(y_slots.reshape(T, k, -1) * w[..., None], axis=1).astype(dtype), jnp.zeros((), jnp.int32)
    return _buffered_experts(up, down, x, w, idx, E, dtype, dispatch, capacity_factor)


def _expert_parallel(pe, x, w, idx, cfg, dtype, dispatch, capacity_factor, mesh):
    """Expert parallelism by all-gather / reduce-scatter inside shard_map.

    Tokens are sharded over the batch axes (data, fsdp, expert); routed experts over `expert`. Each device
    gathers the routed tokens of its expert group, runs the slots that go to its own E/ep experts (sorted
    dropless buffers, or per-expert capacity), and a reduce-scatter returns every token's summed output to
    the device that owns it. Returns None when the token count does not split over the mesh (then the plain
    path runs under GSPMD).
    """
    from jax.sharding import PartitionSpec as P

    ep = mesh.shape["expert"]
    E = cfg.n_routed_experts
    if E % ep:
        return None
    El = E // ep
    tok_axes = tuple(a for a in ("data", "fsdp", "expert") if mesh.shape.get(a, 1) > 1)
    if x.shape[0] % math.prod(mesh.shape[a] for a in tok_axes):
        return None
    t_spec, e_spec = P(tok_axes), P("expert")

    def local(up, down, x, w, idx):
        xg = jax.lax.all_gather(x, "expert", axis=0, tiled=True)
        wg = jax.lax.all_gather(w, "expert", axis=0, tiled=True)
        ig = jax.lax.all_gather(idx, "expert", axis=0, tiled=True)
        li = ig - jax.lax.axis_index("expert") * El
        valid = (li >= 0) & (li < El)
        # capacity semantics match the single-device path: cf * (all slots of the group) / E per expert
        cf = capacity_factor * El / E if dispatch == "capacity" else capacity_factor
        y, dropped = _buffered_experts(up.astype(dtype), down.astype(dtype), xg.astype(dtype), wg,
                                       jnp.clip(li, 0, El - 1), El, dtype, dispatch, cf, valid)
        y = jax.lax.psum_scatter(y.astype(jnp.float32), "expert", scatter_dimension=0, tiled=True)
        return y.astype(dtype), jax.lax.psum(dropped, tuple(mesh.axis_names))

    fn = jax.shard_map(local, mesh=mesh, in_specs=(e_spec, e_spec, t_spec, t_spec, t_spec),
                       out_specs=(t_spec, P()), check_vma=False)
    return fn(pe["up_proj"], pe["down_proj"], x, w, idx)


def moe(p: dict, u: jax.Array, cfg, dtype, *, dispatch: str = "sorted", capacity_factor: float = 1.25,
        token_mask=None, mesh=None):
    """u [b, l, D] -> (out [b, l, D], aux) with aux = {aux_loss, load [E] (slot counts), dropped}.

    `token_mask` [b, l] (optional) excludes padding from the balance statistics.
    """
    b, l, D = u.shape
    x = u.reshape(b * l, D)
    w, idx, scores = route(p["gate"], x, cfg)
    xin = linear(x, p["fc1_latent_proj"], dtype) if cfg.moe_latent_size else x
    y, dropped = experts_forward(p["experts"], xin, w, idx, cfg, dtype, dispatch, capacity_factor, mesh)
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
