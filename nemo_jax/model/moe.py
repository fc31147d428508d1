"""Mixture of experts: sigmoid router with correction bias and group-limited top-k, relu^2 experts,
shared expert, optional latent projections.

Dispatch paths (all give the same values when nothing is dropped):
* "sorted" (default, dropless): token-slots sorted by expert. The fast path (`sorted_experts`, with a
  hand-written backward) runs each expert's rows in row windows of bs = n_slots / (2E) rows, the remainder
  in windows of bs / 4 (padding work <= E*bs/4 rows), in loops whose static bounds (what HLO costs count)
  cover <= 1.5x the useful expert FLOPs and whose unused steps are skipped at run time. With expert
  adapters, and as the loop-free reference, each expert's slots are padded to whole blocks of bs, run in
  ceil(n_blocks / E) batched steps of <= E blocks (`_block_steps`).
* "capacity": per-expert buffers of `ceil(cf * n_slots / E)` slots; overflow is dropped and counted.
* "ragged": `jax.lax.ragged_dot` on the sorted slots (native grouped GEMM on TPU; XLA on CPU and on GPU
  without the cuDNN grouped-GEMM fusion lowers it to dense work over all experts).
* "dense": reference, every expert on every token.
With accelerator kernels (`nemo_jax.kernels`: a GPU or TPU target, `model.kernels: auto`) "sorted" runs each
projection as one grouped matmul over its unpadded sorted buffer (`_grouped_experts`: Pallas on GPU, megablox
on TPU), adapters included, on every path (single device, all-gather and all-to-all expert parallelism).
"""

from __future__ import annotations

import math
from functools import partial

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from nemo_jax.kernels import REFERENCE, Selection
from nemo_jax.kernels.gmm import grouped_matmul
from nemo_jax.model.layers import frozen_product, linear, mlp, relu2
from nemo_jax.parallel.mesh import TOKEN_AXES, gather_shards, pin_tokens, token_axes

DISPATCHES = ("sorted", "capacity", "ragged", "dense")
EXPERT_PARALLEL = ("all_to_all", "all_gather")  # how slots reach their experts' devices (an `expert` axis > 1)
BLOCK_UP = "moe_block_up"  # checkpoint name of the experts' up-projection output: all their backward saves


def route(p_gate: dict, x: jax.Array, cfg, mesh=None):
    """x [T, D] -> weights [T, k] fp32, expert ids [T, k] int32, sigmoid scores [T, E] fp32. With a mesh the
    top_k runs on each device's own token rows."""
    E, k, G = cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.n_group
    logits = jnp.einsum("td,de->te", x.astype(jnp.float32), p_gate["kernel"].astype(jnp.float32))
    scores = jax.nn.sigmoid(logits)
    choice = scores + p_gate["correction_bias"].astype(jnp.float32)
    if G > 1:
        grouped = choice.reshape(-1, G, E // G)
        group_score = jnp.sum(_top_k(grouped, 2, mesh)[0], axis=-1)  # [T, G]
        _, keep = _top_k(group_score, cfg.topk_group, mesh)
        gmask = jnp.any(jax.nn.one_hot(keep, G, dtype=bool), axis=1)  # [T, G]
        choice = jnp.where(jnp.repeat(gmask, E // G, axis=1), choice, -jnp.inf)
    _, idx = _top_k(jax.lax.stop_gradient(choice), k, mesh)
    w = jnp.take_along_axis(scores, idx, axis=1)
    if cfg.norm_topk_prob:
        w = w / (jnp.sum(w, axis=-1, keepdims=True) + 1e-20)
    return w * cfg.routed_scaling_factor, idx.astype(jnp.int32), scores


def _top_k(x: jax.Array, k: int, mesh=None):
    """lax.top_k over the last axis; with a mesh, per device on its own token rows (GSPMD's partitioning of
    top_k gathers every token's scores onto every device)."""
    axes = token_axes(mesh, x.shape[0])
    if not axes:
        return jax.lax.top_k(x, k)
    from jax.sharding import PartitionSpec as P

    rows = P(axes)
    return jax.shard_map(lambda c: tuple(jax.lax.top_k(c, k)), mesh=mesh, in_specs=rows, out_specs=(rows, rows),
                         check_vma=False)(x)


def block_size(n_slots: int, n_experts: int, per_expert: int = 2) -> int:
    """Sorted-dispatch block: n_slots / (per_expert * E), so padding stays <= n_slots / per_expert."""
    return max(1, n_slots // (per_expert * n_experts))


def _slot_layout(flat_e, E: int, dispatch: str, capacity_factor: float, valid=None, max_slots: int | None = None,
                 blocks_per_expert: int = 2, padded: bool = True):
    """Where each token-slot goes in the expert buffer.

    flat_e [n] expert of each slot (in [0, E)); valid [n] (optional) marks slots this buffer serves; max_slots
    (sorted dispatch) bounds the slots the buffer holds (else n, the worst case): the slots past the first
    max_slots in expert order are dropped. A sorted buffer holds the slots in expert order, each expert's
    padded to whole blocks of `block_size(cap, E, blocks_per_expert)` (`padded`: the block loop's layout) or
    not (the row windows' layout, `sorted_experts`).
    Returns dest [n] (slot index, out of range = dropped), keep [n], owners, nb, bs: the buffer is nb blocks of
    bs slots; owners is (block_expert [nb], n_used) (padded: the expert of each block and the number of blocks
    holding slots, the first ones) or (start [E], rows [E]) (unpadded, nb = 1: where each expert's kept rows
    start and how many there are).
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
        return jnp.where(keep, flat_e * bs + rank, E * bs), keep, (jnp.arange(E), E), E, bs
    cap = n if max_slots is None else max(1, min(n, max_slots))
    e = jnp.minimum(flat_e, E - 1)
    keep = ok & (start[e] + rank < cap)
    rows = jnp.clip(cap - start, 0, counts).astype(jnp.int32)  # each expert's slots inside the bound
    if not padded:
        return jnp.where(keep, start[e] + rank, cap), keep, (start.astype(jnp.int32), rows), 1, cap
    bs = block_size(cap, E, blocks_per_expert)
    nb = -(-(cap + E * (bs - 1)) // bs)  # every kept slot fits, whatever the padding
    padded_rows = (rows + bs - 1) // bs * bs
    pend = jnp.cumsum(padded_rows)
    dest = (pend - padded_rows)[e] + rank
    block_expert = jnp.minimum(jnp.searchsorted(pend, jnp.arange(nb) * bs, side="right"), E - 1)
    return jnp.where(keep, dest, nb * bs), keep, (block_expert, jnp.minimum(pend[-1] // bs, nb)), nb, bs


def _lora_einsum(eq: str, x, w, lora, dtype, take=None, out_dtype=jnp.float32):
    """einsum(eq, x, w) (w: per-expert weights, last two dims [in, out]) plus the expert LoRA delta, unmerged:
    + scale * (x A) B with A [..., in, r], B [..., r, out] on the same lead axes as w. `take` gathers the
    lead (expert) axis of w, A and B first (per-block weights of the sorted dispatch). -> `out_dtype` (the sum
    in fp32 first)."""
    pick = (lambda t: t) if take is None else (lambda t: jnp.take(t, take, axis=0, mode="clip"))  # t may be numpy
    if lora is None:
        return frozen_product(lambda a, b: jnp.einsum(eq, a, b, preferred_element_type=out_dtype), x, pick(w))
    y = frozen_product(lambda a, b: jnp.einsum(eq, a, b, preferred_element_type=jnp.float32), x, pick(w))
    (xs, ws), ys = eq.split("->")[0].split(","), eq.split("->")[1]
    o = ws[-1]
    xa_s = ys.replace(o, "r")
    xa = jnp.einsum(f"{xs},{ws[:-1]}r->{xa_s}", x, pick(lora["lora_a"]).astype(dtype),
                    preferred_element_type=jnp.float32)
    yb = jnp.einsum(f"{xa_s},{ws[:-2]}r{o}->{ys}", xa.astype(dtype), pick(lora["lora_b"]).astype(dtype),
                    preferred_element_type=jnp.float32)
    return (y + lora["lora_scale"] * yb).astype(out_dtype)


def _experts_mlp(eq_up: str, eq_down: str, x, pe: dict, dtype, take=None):
    """relu^2 experts on per-expert buffers: down(relu(up(x))**2), each with its optional LoRA. The
    up-projection (what the block loop saves for the backward) is kept in the compute dtype: it is rounded to
    it before relu^2 anyway, and in fp32 it was the largest residual of a LoRA step (2.8 GiB per MoE layer)."""
    u = checkpoint_name(_lora_einsum(eq_up, x, pe["up_proj"], pe.get("up_proj_lora"), dtype, take, dtype),
                        BLOCK_UP)
    h = relu2(u.astype(dtype))
    return _lora_einsum(eq_down, h, pe["down_proj"], pe.get("down_proj_lora"), dtype, take)


def _block_steps(xb, pe: dict, dtype, block_expert, unroll: bool = False):
    """The sorted dispatch's experts over blocks xb [nb, bs, D], block g owned by expert block_expert[g].

    Each block needs its expert's weights: gathered for all nb blocks at once they are nb / E (~3) copies of
    the expert weights, live in the forward and again in the backward. Here the blocks run in
    ceil(nb / E) steps of G <= E blocks (a scan: one copy of the expert weights live at a time; `unroll`:
    the loop-free reference), and the backward saves only each step's up-projection output (BLOCK_UP): it
    re-gathers the weights and recomputes relu^2 and the adapters' rank-r products. Padding blocks (zero
    inputs, the last expert) give zero outputs. -> yb [nb, bs, D] fp32."""
    E, nb = pe["up_proj"].shape[0], xb.shape[0]
    steps = -(-nb // E)
    G = -(-nb // steps)
    pad = steps * G - nb
    xs = jnp.pad(xb, ((0, pad), (0, 0), (0, 0))).reshape(steps, G, *xb.shape[1:])
    owners = jnp.pad(block_expert, (0, pad), constant_values=E - 1).reshape(steps, G)

    def step(_, x_owner):
        x, owner = x_owner
        return None, _experts_mlp("gbd,gdi->gbi", "gbi,gid->gbd", x, pe, dtype, owner)

    step = jax.checkpoint(step, policy=jax.checkpoint_policies.save_only_these_names(BLOCK_UP))
    _, ys = jax.lax.scan(step, None, (xs, owners), unroll=unroll)
    return ys.reshape(steps * G, *ys.shape[2:])[:nb]


def window_sizes(cap: int, E: int, blocks_per_expert: int = 2) -> tuple[int, ...]:
    """The row windows of the sorted fast path: whole windows of `block_size` rows, then windows of a quarter
    of that for each expert's remainder (padding <= E x bs / 4 rows at run time; the static loop bounds, which
    HLO costs count, cover cap + E x bs rows)."""
    bs = block_size(cap, E, blocks_per_expert)
    return (bs, bs // 4) if bs >= 4 else (bs,)


def _row_windows(start, rows, n: int, sizes: tuple[int, ...]):
    """Windows over n rows sorted by expert (expert e's at start[e] .. start[e] + rows[e]): each expert's rows
    in whole windows of sizes[0], what is left in whole windows of sizes[1], ..., the last size's windows
    overhanging the expert's end (those rows are masked). -> per size: (size, steps (a static bound),
    expert [steps], offset [steps], end [steps] (its expert's last row + 1; 0 on unused steps), used (the first
    `used` steps hold rows))."""
    E = rows.shape[0]
    out, base, left = [], start, rows
    for i, sz in enumerate(sizes):
        last = i == len(sizes) - 1
        count = -(-left // sz) if last else left // sz  # [E] windows of this size per expert
        steps = (n + E * (sz - 1)) // sz if last else n // sz
        if i:
            steps = min(steps, E * -(-(sizes[i - 1] - 1) // sz))
        ends = jnp.cumsum(count)
        j = jnp.arange(steps)
        e = jnp.minimum(jnp.searchsorted(ends, j, side="right"), E - 1)
        end = jnp.where(j < ends[-1], start[e] + rows[e], 0)  # unused steps: no rows
        out.append((sz, steps, e, base[e] + (j - (ends - count)[e]) * sz, end, ends[-1]))
        base, left = base + count * sz, left - count * sz
    return out


def _used_steps(n_used, S: int, compute, update, init):
    """fori_loop over S steps (a static trip count, so HLO costs count every step: an upper bound): the first
    n_used fold `compute(s)` into the loop state by `update(s, results, acc)`, the rest are skipped at run time
    (a `cond` that passes the state through; on XLA:CPU this ran faster and with fewer temporaries than a `cond`
    over each step's small results with the update outside it: the bench's routed experts 112 vs 126 ms)."""

    def body(s, acc):
        return jax.lax.cond(s < n_used, lambda acc: update(s, compute(s), acc), lambda acc: acc, acc)

    return jax.lax.fori_loop(0, S, body, init)


def _windowed(arrays, start, rows, sizes, compute, init):
    """`compute(expert, slices, mine)` over the row windows (`_row_windows`) of the [n, ...] arrays: slices are the
    window's rows of each array (padded by the largest window, so no window is clamped), mine [size, 1] marks
    the rows of the window's expert; its per-row results ([size, ...] each) go into the [n + pad, ...]
    accumulators `init` on those rows only, anything else it returns (per-expert sums) is added at its
    expert. `compute(...)` -> (per-row results, per-expert results); init: (the row accumulators, the
    per-expert accumulators [E, ...]). -> the accumulators."""
    n, P = arrays[0].shape[0], sizes[0]
    padded = [jnp.pad(a, ((0, P),) + ((0, 0),) * (a.ndim - 1)) for a in arrays]
    acc = init
    for sz, steps, expert, offset, end, used in _row_windows(start, rows, n, sizes):
        mine = lambda s, sz=sz, offset=offset, end=end: ((offset[s] + jnp.arange(sz)) < end[s])[:, None]  # noqa: E731

        def step(s, expert=expert, offset=offset, sz=sz, mine=mine):
            return compute(expert[s], [jax.lax.dynamic_slice_in_dim(a, offset[s], sz) for a in padded], mine(s))

        def update(s, out, acc, expert=expert, offset=offset, sz=sz, mine=mine):
            (row_out, per_expert), (row_acc, expert_acc) = out, acc
            row_acc = tuple(jax.lax.dynamic_update_slice_in_dim(
                a, jnp.where(mine(s), r, jax.lax.dynamic_slice_in_dim(a, offset[s], sz)), offset[s], 0)
                for a, r in zip(row_acc, row_out))
            return row_acc, tuple(a.at[expert[s]].add(r) for a, r in zip(expert_acc, per_expert))

        acc = _used_steps(used, steps, step, update, acc)
    return acc


def _expert_rows(xs, up, down, start, rows, sizes, save: bool):
    """relu^2 experts on rows xs [n, D] sorted by expert (compute dtype) in row windows: -> (ys [n, D] fp32,
    the up-projection outputs [n, I] if `save`); rows outside every expert's range stay zero."""
    n, f32 = xs.shape[0], jnp.float32

    def compute(e, x, mine):
        u = jnp.dot(x[0], up[e], preferred_element_type=f32).astype(xs.dtype)
        return (jnp.dot(relu2(u), down[e], preferred_element_type=f32),) + ((u,) if save else ()), ()

    pad = n + sizes[0]
    init = (jnp.zeros((pad, down.shape[-1]), f32),) + ((jnp.zeros((pad, up.shape[-1]), xs.dtype),) if save else ())
    out, _ = _windowed([xs], start, rows, sizes, compute, (init, ()))
    return out[0][:n], (out[1][:n] if save else None)


@partial(jax.custom_vjp, nondiff_argnums=(5,))
def sorted_experts(xs, up, down, start, rows, sizes):
    """relu^2 experts on the sorted dispatch's unpadded rows: xs [n, D] in expert order (expert e's rows at
    start[e] .. start[e] + rows[e]; the rest are not computed and give zeros), up [E, D, I], down [E, I, D]
    (all in the compute dtype) -> ys [n, D] fp32. Each expert's rows run in windows of `sizes` (whole windows
    of sizes[0], the remainder in the smaller ones: little padding work, few loop steps), the windows past
    the used ones skipped at run time.

    The fast path of `_block_steps` (which computes every padded block): the backward saves xs and the
    up-projection outputs like `_block_steps` (BLOCK_UP) does, reads each window's expert weights (no
    transposed copy of all of them: that would double the expert weights' memory in the backward) and
    accumulates the weight gradients in fp32."""
    return _expert_rows(xs, up, down, start, rows, sizes, save=False)[0]


def _sorted_experts_fwd(xs, up, down, start, rows, sizes):
    ys, u = _expert_rows(xs, up, down, start, rows, sizes, save=True)
    return ys, (xs, u, up, down, start, rows)


def _sorted_experts_bwd(sizes, res, dys):
    xs, u_all, up, down, start, rows = res
    f32, dt = jnp.float32, xs.dtype

    def compute(e, xud, mine):
        x, u, dy = xud
        r = jax.nn.relu(u)
        dy = jnp.where(mine, dy, 0).astype(dt)  # the window's other rows are other experts'
        g_down = jnp.einsum("bi,bd->id", r * r, dy, preferred_element_type=f32)
        du = (jnp.einsum("bd,id->bi", dy, down[e], preferred_element_type=f32) * (2 * r).astype(f32)).astype(dt)
        g_up = jnp.einsum("bd,bi->di", x, du, preferred_element_type=f32)
        return (jnp.einsum("bi,di->bd", du, up[e], preferred_element_type=f32).astype(dt),), (g_up, g_down)

    n = xs.shape[0]
    init = ((jnp.zeros((n + sizes[0], xs.shape[1]), dt),), (jnp.zeros(up.shape, f32), jnp.zeros(down.shape, f32)))
    (dxs,), (g_up, g_down) = _windowed([xs, u_all, dys], start, rows, sizes, compute, init)
    return dxs[:n], g_up.astype(up.dtype), g_down.astype(down.dtype), None, None


sorted_experts.defvjp(_sorted_experts_fwd, _sorted_experts_bwd)


def _buffered_experts(pe, x, w, idx, E: int, dtype, dispatch: str, capacity_factor: float, valid=None,
                      max_slots: int | None = None, unroll: bool = False, blocks_per_expert: int = 2,
                      kernels: Selection = REFERENCE):
    """Sorted / capacity dispatch over E local experts (pe: up_proj/down_proj [E, ...] in `dtype`, optional
    `*_lora`). -> (y [T, Din] dtype, dropped slots among valid ones)."""
    T, k = idx.shape
    flat_e = idx.reshape(-1)
    fvalid = None if valid is None else valid.reshape(-1)
    tok = jnp.arange(T * k) // k
    gmm = kernels.impl("experts") if dispatch == "sorted" and not unroll else "reference"
    lora = any(k.endswith("_lora") for k in pe)
    fast = dispatch == "sorted" and not unroll and (gmm != "reference" or not lora)
    dest, keep, owners, nb, bs = _slot_layout(flat_e, E, dispatch, capacity_factor, fvalid, max_slots,
                                              blocks_per_expert, padded=not fast)
    # each buffer slot reads its token (the inverse of dest): never materialises x for every slot of the
    # group, most of which (under expert parallelism) belong to other devices' experts ...
    src = jnp.full((nb * bs,), T, jnp.int32).at[dest].set(tok.astype(jnp.int32), mode="drop")
    buf = jnp.take(jnp.pad(x, ((0, 1), (0, 0))), src, axis=0, mode="clip")  # row T: zeros (empty slots)
    xb = buf.reshape(nb, bs, -1)
    if dispatch == "capacity":
        yb = _experts_mlp("gbd,gdi->gbi", "gbi,gid->gbd", xb, pe, dtype)
    elif gmm != "reference":  # the same unpadded buffer, each projection one grouped matmul over it
        yb = _grouped_experts(buf, pe, owners[1], dtype, gmm, kernels.interpret)
    elif fast:  # buf: the bs (= the slot bound) rows in expert order, unpadded
        yb = sorted_experts(buf, pe["up_proj"], pe["down_proj"], *owners, window_sizes(bs, E, blocks_per_expert))
    else:
        yb = _block_steps(xb, pe, dtype, owners[0], unroll)
    # and adds its weighted output back to that token: buffer-sized, never [T * k, Din]
    slot = jnp.full((nb * bs,), T * k, jnp.int32).at[dest].set(jnp.arange(T * k, dtype=jnp.int32), mode="drop")
    wb = jnp.take(jnp.pad(w.reshape(-1), (0, 1)), slot, mode="clip")  # 0 for empty slots
    y = jnp.zeros((T + 1, yb.shape[-1]), jnp.float32).at[src].add(yb.reshape(nb * bs, -1) * wb[:, None])[:T]
    served = jnp.ones_like(keep) if fvalid is None else fvalid
    return y.astype(dtype), jnp.sum(served & ~keep).astype(jnp.int32)


def experts_forward(pe: dict, x: jax.Array, w: jax.Array, idx: jax.Array, cfg, dtype, dispatch: str = "sorted",
                    capacity_factor: float = 1.25, mesh=None, ep_capacity: float = 0.0, unroll: bool = False,
                    expert_parallel: str = "all_to_all", kernels: Selection = REFERENCE, chunk: int = 0):
    """Routed experts. x [T, Din], w/idx [T, k] -> (y [T, Din], dropped slots). On a mesh, `chunk` > 0 runs each
    device's tokens through the experts at most `chunk` at a time (`_in_chunks`).

    On a mesh a sorted/capacity dispatch runs per device inside `shard_map` on that device's tokens. With an
    `expert` axis > 1 the slots reach their experts' devices by `expert_parallel`: "all_to_all" (each token
    sent once to each peer owning one of its experts, at most capacity_factor x the even share of rows per
    peer, overflow dropped; `_all_to_all_experts`) or "all_gather" (the expert group's tokens gathered, exact
    and dropless unless `ep_capacity` bounds the buffer; `_expert_parallel`). Without an `expert` axis every
    device runs all experts on its own tokens.
    """
    T, k = idx.shape
    E = cfg.n_routed_experts
    if dispatch not in DISPATCHES:
        raise ValueError(f"unknown MoE dispatch {dispatch!r}; expected one of {DISPATCHES}")
    if expert_parallel not in EXPERT_PARALLEL:
        raise ValueError(f"unknown expert_parallel {expert_parallel!r}; expected one of {EXPERT_PARALLEL}")
    if mesh is not None and mesh.size > 1 and dispatch in ("sorted", "capacity"):
        if expert_parallel == "all_to_all" and mesh.shape["expert"] > 1:
            out = _all_to_all_experts(pe, x, w, idx, cfg, dtype, dispatch, capacity_factor, mesh, unroll, kernels,
                                      chunk)
        else:
            out = _expert_parallel(pe, x, w, idx, cfg, dtype, dispatch, capacity_factor, mesh, ep_capacity, unroll,
                                   kernels, chunk)
        if out is not None:
            return out
    pe = _cast_experts(pe, dtype)
    x = x.astype(dtype)
    if dispatch == "dense":
        y_all = _experts_mlp("td,edi->tei", "tei,eid->ted", x, pe, dtype)
        dense_w = jnp.zeros((T, E), jnp.float32).at[jnp.arange(T)[:, None], idx].add(w)
        return jnp.einsum("ted,te->td", y_all, dense_w).astype(dtype), jnp.zeros((), jnp.int32)
    if dispatch == "ragged":
        flat_e = idx.reshape(-1)
        order = jnp.argsort(flat_e, stable=True)
        counts = jnp.bincount(flat_e, length=E).astype(jnp.int32)
        xs = x[(jnp.arange(T * k) // k)[order]]
        ys = _grouped_experts(xs, pe, counts, dtype, "ragged_dot")
        y_slots = jnp.zeros_like(ys).at[order].set(ys)
        return jnp.sum(y_slots.reshape(T, k, -1) * w[..., None], axis=1).astype(dtype), jnp.zeros((), jnp.int32)
    return _buffered_experts(pe, x, w, idx, E, dtype, dispatch, capacity_factor, unroll=unroll, kernels=kernels)


def _cast_experts(pe: dict, dtype) -> dict:
    """Expert weights (and adapter matrices) in the compute dtype; adapter scales stay fp32."""
    return jax.tree_util.tree_map_with_path(
        lambda p, a: a if getattr(p[-1], "key", None) == "lora_scale" else a.astype(dtype), pe)


def _grouped_experts(xs, pe: dict, counts, dtype, impl: str, interpret: bool = False):
    """relu^2 experts on rows xs [n, D] sorted by expert (expert e's counts[e] rows after expert e-1's, the rest
    unused), each projection one grouped matmul (`nemo_jax.kernels.gmm`, `impl`) -> ys [n, D] fp32, zero on
    unused rows. The up-projection is named BLOCK_UP, as in `_experts_mlp`; it leaves its matmul in `dtype` (it
    is rounded to it before relu^2 anyway): the largest buffer of a MoE layer, [slots, I], at half the bytes."""
    u = checkpoint_name(_ragged_lora(xs, pe["up_proj"], pe.get("up_proj_lora"), counts, dtype, impl, interpret,
                                     out_dtype=dtype), BLOCK_UP)
    return _ragged_lora(relu2(u.astype(dtype)), pe["down_proj"], pe.get("down_proj_lora"), counts, dtype, impl,
                        interpret)


def _ragged_lora(x, w, lora, counts, dtype, impl: str, interpret: bool = False, out_dtype=jnp.float32):
    """A grouped matmul over expert groups, plus the per-expert LoRA delta (two more through rank r), -> rows in
    `out_dtype` (with an adapter the two terms are summed in fp32 first)."""
    def mm(a, b, dt=jnp.float32, sizes=counts):
        return grouped_matmul(a, b, sizes, impl, interpret=interpret, out_dtype=dt)

    # (the group sizes pass through frozen_product as an operand: a traced array it must not close over)
    if lora is None:
        return frozen_product(lambda a, b, sizes: mm(a, b, out_dtype, sizes), x, w, counts)
    y = (frozen_product(lambda a, b, sizes: mm(a, b, jnp.float32, sizes), x, w, counts)
         + lora["lora_scale"] * mm(mm(x, lora["lora_a"], dtype), lora["lora_b"]))
    return y.astype(out_dtype)


def _stored_axes(cfg) -> dict:
    """Logical axes of the routed-expert leaves `_ep_shard_map` receives: the base weights' (mixer_specs), and
    of an expert adapter `X_lora` those the adapter layout gives it (A [E, in, r], B [E, r, out])."""
    from nemo_jax.model.spec import mixer_specs

    base = {k: v.axes for k, v in mixer_specs(cfg, "moe")["experts"].items()}
    for k, ax in list(base.items()):
        base[f"{k}_lora"] = {"lora_a": (*ax[:-1], None), "lora_b": (*ax[:-2], None, ax[-1])}
    return base


@partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _sum_partials(y, axis: str, n: int):
    """Inside shard_map: psum of y's partial sums over `axis` (the experts' hidden dim split over it). The
    backward scales the cotangent by n instead of psumming it: y leaves shard_map replicated over `axis`,
    whose transpose (check_vma=False) hands every peer the same cotangent divided by n."""
    return jax.lax.psum(y, axis)


_sum_partials.defvjp(lambda y, axis, n: (jax.lax.psum(y, axis), None), lambda axis, n, _, g: (g * n,))


def _ep_shard_map(pe, x, w, idx, cfg, dtype, mesh, body, chunk: int = 0):
    """What both expert-parallel paths share: run body(pe, x, w, idx, El) -> (y [Tl, D], dropped slots) per
    device inside shard_map, tokens split over the token axes, and sum the drop counts over them. Returns None
    when the experts or the tokens do not split over the mesh (then the plain path runs under GSPMD).

    Expert weights and adapter matrices enter in their stored sharding (experts over `expert`, D over fsdp /
    context, the hidden dim I over `tensor`) and are gathered per layer, in the compute dtype, over all but
    `tensor` (with in_specs of P("expert") GSPMD resharded the whole scanned weight stack before the layer
    loop: every layer's experts gathered at once, in fp32). With I split over tensor each peer runs its I / tp
    of every expert (up's columns, down's rows: Megatron-style) on the same tokens, and the partial outputs
    are summed over tensor; the input's cotangent is summed by shard_map's transpose. Without that split
    (tensor = 1, or I not dividing) the experts are whole on every device.
    """
    from jax.sharding import PartitionSpec as P

    from nemo_jax.parallel.rules import Rules

    ep, E = mesh.shape["expert"], cfg.n_routed_experts
    tok_axes = tuple(a for a in TOKEN_AXES if mesh.shape.get(a, 1) > 1)
    if E % ep or x.shape[0] % math.prod(mesh.shape[a] for a in tok_axes):
        return None
    axes = _stored_axes(cfg)
    keys = lambda path: tuple(getattr(q, "key", None) for q in path)  # noqa: E731

    def spec_of(path, a):
        k = keys(path)
        if k[-1] == "lora_scale":
            return P()
        ax = axes[k[0]] if len(k) == 1 else axes[k[0]][k[1]]
        return Rules().spec(ax, a.shape, mesh)

    specs = jax.tree_util.tree_map_with_path(spec_of, pe)
    tp = mesh.shape["tensor"] if specs["up_proj"][-1] == "tensor" else 1
    local_specs = jax.tree.map(lambda s: P(*(None if tp > 1 and a == "tensor" else a for a in s)), specs,
                               is_leaf=lambda s: isinstance(s, P))

    def local(pe, x, w, idx):
        pe = jax.tree.map(lambda a, s: gather_shards(a, s, first_dim=1), _cast_experts(pe, dtype), local_specs)
        y, dropped = _in_chunks(lambda x, w, idx: body(pe, x, w, idx, E // ep), x, w, idx, chunk)
        y = y.astype(jnp.float32)
        if tp > 1:
            y = _sum_partials(y, "tensor", tp)
        return y.astype(dtype), jax.lax.psum(dropped.astype(jnp.int32), tok_axes)

    t_spec = P(tok_axes)
    fn = jax.shard_map(local, mesh=mesh, in_specs=(specs, t_spec, t_spec, t_spec), out_specs=(t_spec, P()),
                       check_vma=False)
    return fn(pe, x, w, idx)


def _in_chunks(run, x, w, idx, chunk: int):
    """run(x, w, idx) -> (y, dropped) on a device's tokens in pieces of at most `chunk` tokens (0: all at once),
    one after another (`lax.scan`), each checkpointed: a MoE layer's dispatch buffers, its [slots, I] expert
    activations and their gradients exist for one piece at a time, while the experts' weights, gathered once
    per layer, serve every piece (micro-batching would gather them again for each). The capacity bounds apply
    per piece."""
    T = x.shape[0]
    n = -(-T // chunk) if chunk else 1
    if n <= 1 or T % n:
        return run(x, w, idx)
    split = lambda a: a.reshape(n, T // n, *a.shape[1:])  # noqa: E731

    def one(total, xs):
        y, dropped = jax.checkpoint(run)(*xs)
        return total + dropped.astype(jnp.int32), y

    dropped, ys = jax.lax.scan(one, jnp.zeros((), jnp.int32), (split(x), split(w), split(idx)))
    return ys.reshape(T, *ys.shape[2:]), dropped


def _expert_parallel(pe, x, w, idx, cfg, dtype, dispatch, capacity_factor, mesh, ep_capacity: float = 0.0,
                     unroll: bool = False, kernels: Selection = REFERENCE, chunk: int = 0):
    """Expert parallelism by all-gather / reduce-scatter inside shard_map (the exact, dropless option).

    Tokens are sharded over the batch axes (data, fsdp, expert); routed experts over `expert`. Each device
    gathers the routed tokens of its expert group, runs the slots that go to its own E/ep experts (sorted
    dropless buffers, or per-expert capacity), and a reduce-scatter returns every token's summed output to
    the device that owns it. Returns None when the token count does not split over the mesh.

    The sorted buffer is dropless only when sized for the worst case, every slot of the group on one device
    (ep x the even share). `ep_capacity` > 0 sizes it for `ep_capacity` x the even share instead (memory and
    FLOPs / (ep / ep_capacity)); slots past it are dropped and counted in `dropped`.
    """
    ep, E = mesh.shape["expert"], cfg.n_routed_experts

    def body(pe, x, w, idx, El):
        xg = jax.lax.all_gather(x, "expert", axis=0, tiled=True)
        wg = jax.lax.all_gather(w, "expert", axis=0, tiled=True)
        ig = jax.lax.all_gather(idx, "expert", axis=0, tiled=True)
        li = ig - jax.lax.axis_index("expert") * El
        valid = (li >= 0) & (li < El)
        # capacity semantics match the single-device path: cf * (all slots of the group) / E per expert
        cf = capacity_factor * El / E if dispatch == "capacity" else capacity_factor
        n = ig.shape[0] * ig.shape[1]
        cap = math.ceil(ep_capacity * n / ep) if ep_capacity > 0 and dispatch == "sorted" else None
        y, dropped = _buffered_experts(pe, xg.astype(dtype), wg, jnp.clip(li, 0, El - 1), El, dtype, dispatch, cf,
                                       valid, cap, unroll, kernels=kernels)
        return jax.lax.psum_scatter(y.astype(jnp.float32), "expert", scatter_dimension=0, tiled=True), dropped

    return _ep_shard_map(pe, x, w, idx, cfg, dtype, mesh, body, chunk)


def peer_rows(n_tokens: int, k: int, ep: int, capacity_factor: float) -> int:
    """Rows each device sends to each peer of its expert group: capacity_factor x the even share of its
    (token, peer) pairs (a token is sent once to each peer owning one of its experts; under uniform routing a
    token reaches 1 - (1 - 1/ep)^k of the peers), at most every token (then no row can be dropped)."""
    share = n_tokens * (1.0 - (1.0 - 1.0 / ep) ** k)
    return max(1, min(n_tokens, math.ceil(capacity_factor * share)))


def _all_to_all_experts(pe, x, w, idx, cfg, dtype, dispatch, capacity_factor, mesh, unroll: bool = False,
                        kernels: Selection = REFERENCE, chunk: int = 0):
    """Expert parallelism by all-to-all inside shard_map: each device sends each of its tokens once to every
    peer that owns one of the token's experts (with the token's expert ids and weights there), the peer runs
    those slots on its experts and sends back one weighted sum per row.

    Per device (Tl tokens, top-k, ep peers of E/ep experts each), R = `peer_rows(Tl, k, ep, cf)`:
      send    [ep, R] rows  row (j, r): the r-th token (in order) with an expert on peer j, its x [D], and per
                            choice its local expert id (-1: elsewhere) and weight; tokens past R are dropped
      recv    [ep*R]        all_to_all over `expert`: row block i came from peer i
      y_recv  [ep*R, D]     the sorted (or capacity) dispatch over the local experts, sum of w x expert(x) per
                            row, at most ceil(cf x Tl x k) slots (the device's even share of slots x cf)
      back    [ep*R, D]     all_to_all again, in send order; y = the sum over a token's rows
    Bytes moved per device and direction: ep x R x D (a token with several experts on one peer travels
    once), memory and FLOPs about cf x the device's own share of slots. Overflow (rows past R, slots past the
    receiver's bound) is dropped and counted in slots. Equal to the single-device path in values and
    gradients when nothing is dropped.
    """
    ep = mesh.shape["expert"]

    def body(pe, x, w, idx, El):
        Tl, k = idx.shape
        R = peer_rows(Tl, k, ep, capacity_factor)
        peer = idx // El  # [Tl, k]
        hits = peer[:, :, None] == jnp.arange(ep)  # [Tl, k, ep]: choice c of token t is on peer j
        wants = jnp.any(hits, axis=1)  # [Tl, ep]: token t has an expert on peer j
        rank = jnp.cumsum(wants, axis=0) - 1  # its row among the tokens going to j, in token order
        sent = wants & (rank < R)
        dest = jnp.where(sent, jnp.arange(ep) * R + rank, ep * R)  # [Tl, ep], ep*R = not sent
        src = jnp.full((ep * R + 1,), Tl, jnp.int32).at[dest].set(
            jnp.broadcast_to(jnp.arange(Tl, dtype=jnp.int32)[:, None], (Tl, ep)))[:ep * R]  # Tl = empty row
        row_peer = jnp.arange(ep * R) // R
        src_peer = jnp.take(jnp.pad(peer, ((0, 1), (0, 0)), constant_values=-1), src, axis=0)  # [ep*R, k]
        mine = src_peer == row_peer[:, None]  # the row's choices served by that peer
        send_e = jnp.where(mine, jnp.take(jnp.pad(idx % El, ((0, 1), (0, 0))), src, axis=0), -1)
        send_w = jnp.where(mine, jnp.take(jnp.pad(w, ((0, 1), (0, 0))), src, axis=0), 0.0)
        send_x = jnp.take(jnp.pad(x.astype(dtype), ((0, 1), (0, 0))), src, axis=0)
        a2a = lambda t: jax.lax.all_to_all(t.reshape(ep, R, *t.shape[1:]), "expert", 0, 0).reshape(t.shape)  # noqa: E731
        recv_x, recv_e, recv_w = a2a(send_x), a2a(send_e), a2a(send_w)
        # the received rows hold ~ its even share of slots, most of ep*R*k entries empty: the buffer is bounded by
        # cf x that share, in finer blocks (padding <= 1/4)
        bound = min(ep * R * k, math.ceil(capacity_factor * Tl * k))
        # "capacity": cf x the even share per local expert, cf * Tl * k / El (not of the ep*R*k entries)
        cf = capacity_factor * Tl / (ep * R) if dispatch == "capacity" else capacity_factor
        y_recv, dropped_recv = _buffered_experts(pe, recv_x, recv_w, jnp.maximum(recv_e, 0), El, dtype, dispatch,
                                                 cf, recv_e >= 0, bound, unroll, blocks_per_expert=4, kernels=kernels)
        back = a2a(y_recv.astype(dtype))  # the weighted sums travel back in the compute dtype (and their cotangents)
        y = jnp.zeros((Tl + 1, back.shape[-1]), jnp.float32).at[src].add(back.astype(jnp.float32))[:Tl]
        unsent = jnp.sum(hits & ~sent[:, None, :])  # slots of rows past R
        return y, unsent + dropped_recv

    return _ep_shard_map(pe, x, w, idx, cfg, dtype, mesh, body, chunk)


def moe(p: dict, u: jax.Array, cfg, dtype, *, dispatch: str = "sorted", capacity_factor: float = 1.25,
        token_mask=None, mesh=None, ep_capacity: float = 0.0, unroll: bool = False,
        expert_parallel: str = "all_to_all", kernels: Selection = REFERENCE, chunk: int = 0):
    """u [b, l, D] -> (out [b, l, D], aux) with aux = {aux_loss, load [E] (slot counts), dropped}.

    `token_mask` [b, l] (optional) excludes padding from the balance statistics; `unroll` runs the sorted
    dispatch's block steps without a loop (the unrolled reference); `kernels` the grouped-matmul kernel of the
    sorted dispatch (`nemo_jax.kernels`).
    """
    b, l, D = u.shape
    x = u.reshape(b * l, D)
    w, idx, scores = route(p["gate"], x, cfg, mesh)
    xin = linear(x, p["fc1_latent_proj"], dtype) if cfg.moe_latent_size else x
    y, dropped = experts_forward(p["experts"], xin, w, idx, cfg, dtype, dispatch, capacity_factor, mesh, ep_capacity,
                                 unroll, expert_parallel, kernels, chunk)
    if cfg.moe_latent_size:
        y = linear(y, p["fc2_latent_proj"], dtype)
    if cfg.n_shared_experts:
        y = y + mlp(p["shared_experts"], x, dtype)
    # switch-style balance loss on the unbiased scores: E * sum_e f_e * P_e
    E, k = cfg.n_routed_experts, cfg.num_experts_per_tok
    m = jnp.ones((b * l,), jnp.float32) if token_mask is None else token_mask.reshape(-1).astype(jnp.float32)
    # per-token statistics stay on their rows (reduced by an all-reduce of [E] sums, never gathered)
    m, scores = pin_tokens(m, mesh), pin_tokens(scores, mesh)
    n_tok = jnp.maximum(jnp.sum(m), 1.0)
    onehot = jnp.sum(jax.nn.one_hot(idx, E, dtype=jnp.float32), axis=1) * m[:, None]  # [T, E]
    load = jnp.sum(onehot, axis=0)
    f = load / (n_tok * k)
    probs = scores / (jnp.sum(scores, axis=-1, keepdims=True) + 1e-20)
    P = jnp.sum(probs * m[:, None], axis=0) / n_tok
    aux = {"aux_loss": E * jnp.sum(jax.lax.stop_gradient(f) * P), "load": load, "dropped": dropped}
    return y.reshape(b, l, D).astype(dtype), aux
