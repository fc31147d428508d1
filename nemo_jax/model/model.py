"""The Nemotron-H forward pass, top to bottom.

    h = embed(tokens)
    for each layer: h = h + mixer(rms_norm(h))        # mixer in {mamba, attention, mlp, moe}
    logits = lm_head(rms_norm(h))                      # fp32, never tied, no embedding scale

Layers are grouped into *units* of at most one Mamba, one attention and one FFN (mlp or moe) layer, in
that order ("MEMEM*E" -> ME, ME, M*E), and runs of identical units into periods repeated back to back
(`segments`: Super is ("ME"x3, "M*E") x3 + ("ME"x4, "M*E") x4 + ...). Each repeated period is one `lax.scan`
with the period's runs in the body (a run of n > 1 identical units is an inner scan), so compile time is flat in
depth and every layer runs unconditionally. Patterns without a short period fall back to one scan over all
units where a kind present in only some units runs under `lax.cond` (`_run_cond_scan`). A stack of at most
`INLINE_UNITS` units runs its layers one after another (compiling it is cheap, and a scan stacks every saved
activation). `scan=False` is the plain unrolled reference path (no remat).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from nemo_jax import kernels as kernels_lib
from nemo_jax.model import attention as attn_lib
from nemo_jax.model import mamba2, moe as moe_lib, vision as vision_lib
from nemo_jax.model.cache import DecodeState
from nemo_jax.parallel.mesh import BATCH_AXES, context_shards, gather_shards, pin_batch
from nemo_jax.model.layers import FROZEN_PRODUCT, embed, linear, logits_from_hidden, mlp, rms_norm

KIND_ORDER = ("mamba", "attention", "mlp", "moe")
_SLOTS = (("mamba",), ("attention",), ("mlp", "moe"))
REMAT_POLICIES = ("none", "layer", "save_matmuls", "save_frozen")


@dataclass(frozen=True)
class Options:
    """How to run the forward (never what the network is)."""

    dtype: Any = jnp.float32  # compute dtype; params stay fp32, router/norms/softmax/SSM in fp32
    scan: bool = True  # scan over repeated units (False: unrolled reference)
    ssd: str = "chunked"  # "chunked" | "sequential" (reference)
    attention: str = "blocked"  # "blocked" (causal query blocks over key prefixes) | "ring" | "full" (reference)
    moe_dispatch: str = "sorted"  # see moe.DISPATCHES
    capacity_factor: float = 1.25
    # expert parallelism (an `expert` mesh axis > 1): "all_to_all" sends each token once to each peer owning one of
    # its experts, at most capacity_factor x the even share of rows per peer (overflow dropped, counted); "all_gather"
    # gathers the expert group's tokens (exact; dropless unless ep_capacity > 0 bounds each device's buffer)
    expert_parallel: str = "all_to_all"
    ep_capacity: float = 0.0
    # expert parallelism: run each device's tokens through the routed experts at most this many at a time (0: all
    # at once); bounds a MoE layer's dispatch buffers and expert activations without re-gathering its weights
    moe_chunk_tokens: int = 0
    remat: str = "none"  # "none" | "layer" | "save_matmuls" | "save_frozen" (`remat_policy`)
    # accelerator kernels (nemo_jax.kernels): "auto" (those of the platform the program is compiled for: the mesh's
    # devices', else the default backend; the reference on CPU) | "reference" | "gpu" | "tpu" (forced);
    # interpret_kernels: forced Pallas kernels in interpret mode (CPU tests)
    kernels: str = "auto"
    interpret_kernels: bool = False
    # a Mesh: activations are pinned batch-sharded (rows over data/fsdp/expert, hidden unsharded) at every layer
    # boundary, and an `expert` axis > 1 turns on expert parallelism for routed experts
    mesh: Any = None

    def __post_init__(self):
        if self.remat not in REMAT_POLICIES:
            raise ValueError(f"remat: {self.remat!r} not in {REMAT_POLICIES}")
        if self.expert_parallel not in moe_lib.EXPERT_PARALLEL:
            raise ValueError(f"expert_parallel: {self.expert_parallel!r} not in {moe_lib.EXPERT_PARALLEL}")
        if self.moe_dispatch not in moe_lib.DISPATCHES:
            raise ValueError(f"moe_dispatch: {self.moe_dispatch!r} not in {moe_lib.DISPATCHES}")
        if self.ssd not in mamba2.SCANS:
            raise ValueError(f"ssd: {self.ssd!r} not in {tuple(mamba2.SCANS)}")
        if self.attention not in attn_lib.IMPLEMENTATIONS:
            raise ValueError(f"attention: {self.attention!r} not in {attn_lib.IMPLEMENTATIONS}")
        if self.kernels not in kernels_lib.KERNELS + kernels_lib.PLATFORMS:
            raise ValueError(f"kernels: {self.kernels!r} not in {kernels_lib.KERNELS + kernels_lib.PLATFORMS[1:]}")


def units(kinds: tuple[str, ...]) -> list[dict[str, int]]:
    """Group layers into units: [{kind: index within that kind's stack}], in layer order."""
    out, i, seen = [], 0, {}
    while i < len(kinds):
        unit = {}
        for slot in _SLOTS:
            if i < len(kinds) and kinds[i] in slot:
                unit[kinds[i]] = seen.get(kinds[i], 0)
                seen[kinds[i]] = unit[kinds[i]] + 1
                i += 1
        out.append(unit)
    return out


# --------------------------------------------------------------------------- one layer
@dataclass
class _Ctx:
    cfg: Any
    opts: Options
    segment_ids: Any = None
    valid: Any = None  # [b, l] for cached runs
    valid_cache: Any = None  # [b, S]
    pos: Any = None

    @property
    def kernels(self) -> kernels_lib.Selection:
        return kernels_lib.select(self.opts.kernels, self.opts.mesh, self.opts.interpret_kernels)


def _zero_aux(kind: str, cfg) -> dict:
    if kind == "moe":
        return {"aux_loss": jnp.zeros((), jnp.float32), "load": jnp.zeros((cfg.n_routed_experts,), jnp.float32),
                "dropped": jnp.zeros((), jnp.int32)}
    return {}


def apply_layer(kind: str, p: dict, h: jax.Array, ctx: _Ctx, cache=None):
    """h + mixer(rms_norm(h)). Returns (h, new cache for this layer or None, aux dict)."""
    cfg, dtype = ctx.cfg, ctx.opts.dtype
    u = rms_norm(h, p["norm"]["scale"], cfg.layer_norm_epsilon)
    aux, new = {}, None
    if kind == "mamba":
        y, st = mamba2.mamba_mixer(p["mixer"], u, cfg, dtype, segment_ids=ctx.segment_ids, state=cache,
                                   valid=ctx.valid, scan=ctx.opts.ssd, mesh=ctx.opts.mesh, kernels=ctx.kernels)
        new = st if cache is not None else None
    elif kind == "attention":
        y, new = attn_lib.attention(p["mixer"], u, cfg, dtype, segment_ids=ctx.segment_ids, cache=cache,
                                    valid_cache=ctx.valid_cache, valid=ctx.valid, pos=ctx.pos, impl=ctx.opts.attention,
                                    mesh=ctx.opts.mesh, kernels=ctx.kernels)
    elif kind == "mlp":
        y = mlp(p["mixer"], u, dtype)
    elif kind == "moe":
        mask = ctx.valid if ctx.valid is not None else (None if ctx.segment_ids is None else ctx.segment_ids > 0)
        y, aux = moe_lib.moe(p["mixer"], u, cfg, dtype, dispatch=ctx.opts.moe_dispatch,
                             capacity_factor=ctx.opts.capacity_factor, token_mask=mask, mesh=ctx.opts.mesh,
                             ep_capacity=ctx.opts.ep_capacity, unroll=not ctx.opts.scan,
                             chunk=ctx.opts.moe_chunk_tokens,
                             expert_parallel=ctx.opts.expert_parallel, kernels=ctx.kernels)
    else:
        raise ValueError(f"unknown layer kind {kind!r}")
    return pin_batch((h + y.astype(h.dtype)).astype(h.dtype), ctx.opts.mesh), new, aux


def embed_tokens(emb: dict, tokens: jax.Array, dtype, mesh) -> jax.Array:
    """tokens [B, T] -> [B, T, D] in `dtype`. On a mesh the lookup runs per device inside `shard_map`: the table
    enters in its stored sharding, is gathered in `dtype` and indexed with the device's own rows, so the
    table's gradient leaves by reduce-scatter (FSDP). Under GSPMD a D-sharded table made it gather the
    tokens (the global batch's embeddings on every device) and, in the backward, every row's cotangent."""
    from jax.sharding import PartitionSpec as P

    from nemo_jax.model.spec import EMBEDDING_AXES
    from nemo_jax.parallel.rules import Rules

    rows = tuple(a for a in BATCH_AXES if mesh is not None and mesh.shape.get(a, 1) > 1)
    if mesh is None or tokens.shape[0] % int(np.prod([mesh.shape[a] for a in rows] or [1])):
        return embed(emb, tokens, dtype)
    table = emb["embedding"]
    stored = Rules().spec(EMBEDDING_AXES, table.shape, mesh)

    def local(t, tok):
        return jnp.take(gather_shards(t.astype(dtype), stored), tok, axis=0)

    seq = "context" if context_shards(mesh, tokens.shape[1]) > 1 else None
    tok_spec = P(rows or None, seq)
    return jax.shard_map(local, mesh=mesh, in_specs=(stored, tok_spec), out_specs=P(rows or None, seq, None),
                         check_vma=False)(table, tokens)


def _spread(tree, unit_to_layer: np.ndarray, layer_to_unit: np.ndarray):
    """[n, ...] stacks -> [U, ...] (slice unit_to_layer[u] for unit u). The cotangent goes back by a static
    gather of the units that own a layer (the others contribute nothing), not by a scatter-add."""

    @jax.custom_vjp
    def spread(t):
        return jax.tree.map(lambda a: jnp.take(a, unit_to_layer, axis=0), t)

    def fwd(t):
        return spread(t), None

    def bwd(_, g):
        return (jax.tree.map(lambda a: jnp.take(a, layer_to_unit, axis=0), g),)

    spread.defvjp(fwd, bwd)
    return spread(tree)


def _index(tree, i):
    return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, i, keepdims=False), tree)


def _update(tree, new, i):
    return jax.tree.map(lambda a, b: jax.lax.dynamic_update_index_in_dim(a, b.astype(a.dtype), i, 0), tree, new)


# --------------------------------------------------------------------------- the layer stack
MAX_BODY_UNITS = 8  # periodic schedules whose scan bodies would hold more runs fall back to the cond scan
# A stack of at most this many units runs inline, its layers one after another (with the same remat): it
# compiles quickly either way, and a scan stacks every saved activation per iteration and reads it back (on
# CPU ~45 ms per layer of the bench model, 17% of its train step); deeper stacks scan to bound compile time.
INLINE_UNITS = 8


def run_layers(stacks: dict, h: jax.Array, kinds: tuple[str, ...], ctx: _Ctx, caches: dict | None = None):
    """Run all layers. stacks: {kind: params stacked [n_kind, ...]}; caches: {kind: stacked cache}.

    Returns (h, new caches {kind: stacked}, aux {kind: {name: [n_kind, ...]}}).
    """
    caches = caches or {}
    if not ctx.opts.scan:
        return _run_unrolled(stacks, h, kinds, ctx, caches)
    if any(isinstance(v, list) for v in stacks.values()):  # layers held one by one (`unstack_layers`): inline
        return _run_unrolled(stacks, h, kinds, ctx, caches, _layer_fn(ctx))
    us = units(kinds)
    if len(us) <= INLINE_UNITS:
        return _run_unrolled(stacks, h, kinds, ctx, caches, _layer_fn(ctx))
    segs = segments(us)
    if sum(len(period) for period, _ in segs) > MAX_BODY_UNITS:  # runs of scan body
        return _run_cond_scan(stacks, h, us, ctx, caches)
    return _run_periodic(stacks, h, segs, ctx, caches)


def segments(us: list[dict]) -> list[tuple[list[tuple[dict, int]], int]]:
    """Split the units into runs of a repeated period: [(period, repeats)], a period being a list of runs
    (unit, n) of n identical consecutive units (n > 1 runs as an inner scan). Greedy: at each point take the
    period whose repeats save the most runs of scan body (covered - period), the shortest on ties. Units one
    by one when that keeps the body within MAX_BODY_UNITS (unrolled bodies compile faster than inner scans),
    else over the run-length encoded units (Super's release order: ("ME"x3, "M*E") x3, ("ME"x4, "M*E") x4,
    "ME"x3, "M*E", "ME"x4 -> 7 runs, where units one by one need 14)."""
    flat = _periodic([(u, 1) for u in us])
    if sum(len(p) for p, _ in flat) <= MAX_BODY_UNITS:
        return flat
    runs: list[tuple[dict, int]] = []
    for u in us:
        if runs and tuple(runs[-1][0]) == tuple(u):
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((u, 1))
    return _periodic(runs)


def _periodic(runs: list[tuple[dict, int]]) -> list[tuple[list[tuple[dict, int]], int]]:
    sig = [(tuple(u), n) for u, n in runs]
    out, i = [], 0
    while i < len(sig):
        best = (-1, 0, 0, 0)  # (runs saved, -period, period, repeats)
        for p in range(1, max(1, min(MAX_BODY_UNITS, len(sig) - i)) + 1):
            reps = 1
            while sig[i + reps * p:i + (reps + 1) * p] == sig[i:i + p]:
                reps += 1
            best = max(best, ((reps - 1) * p, -p, p, reps))
        _, _, p, reps = best
        out.append((runs[i:i + p], reps))
        i += p * reps
    return out


def remat_policy(remat: str):
    """The jax.checkpoint policy of a remat setting (per layer; "none": no checkpoint at all). "layer": the
    backward recomputes the whole layer; "save_matmuls": it keeps every matmul's output; "save_frozen": it keeps
    the outputs of the projections whose weights get no gradient (a LoRA step's frozen base,
    `layers.FROZEN_PRODUCT`) and recomputes the rest, so a LoRA step never re-runs its base's matmuls (in full
    fine-tuning nothing is frozen and it is "layer")."""
    return {"layer": None, "save_matmuls": jax.checkpoint_policies.checkpoint_dots,
            "save_frozen": jax.checkpoint_policies.save_only_these_names(FROZEN_PRODUCT)}[remat]


def _layer_fn(ctx: _Ctx):
    """apply_layer under the remat policy: remat is per layer (a scan saves each layer's input, not its
    internals)."""
    policy = None if ctx.opts.remat == "none" else remat_policy(ctx.opts.remat)

    def layer(kind, p, h, c):
        f = lambda p, h, c: apply_layer(kind, p, h, ctx, c)
        return (f if ctx.opts.remat == "none" else jax.checkpoint(f, policy=policy))(p, h, c)

    return layer


def _run_periodic(stacks: dict, h: jax.Array, segs, ctx: _Ctx, caches: dict):
    """Each segment is one `lax.scan` over its repeats (inline when it repeats once); in the body each run of n
    identical units is an inner `lax.scan` (n > 1) or inline, so every layer runs unconditionally. Per kind, a
    segment owns a contiguous slice of the stack, viewed as [repeats, per-period count, ...]."""
    layer = _layer_fn(ctx)
    start = {k: 0 for k in stacks}
    new_caches: dict[str, list] = {k: [] for k in caches}
    auxs: dict[str, list] = {}
    for period, reps in segs:
        count = {k: sum(n for u, n in period if k in u) for k in stacks}
        view = lambda t, k: jax.tree.map(lambda a: a[start[k]:start[k] + reps * count[k]].reshape(
            (reps, count[k]) + a.shape[1:]), t)
        xs = ({k: view(stacks[k], k) for k in stacks if count[k]}, {k: view(caches[k], k) for k in caches if count[k]})

        def body(h, xs, period=period):
            h, new, aux = _run_runs(xs[0], h, period, xs[1], layer, ctx)
            return h, (new, aux)

        if reps == 1:  # a one-off stretch runs inline
            h, ys = body(h, jax.tree.map(lambda a: a[0], xs))
            ys_c, ys_aux = jax.tree.map(lambda a: a[None], ys)
        else:
            h, (ys_c, ys_aux) = jax.lax.scan(body, h, xs, length=reps)
        flat = lambda t: jax.tree.map(lambda a: a.reshape((-1,) + a.shape[2:]), t)
        for k, v in ys_c.items():
            new_caches[k].append(flat(v))
        for k, v in ys_aux.items():
            auxs.setdefault(k, []).append(flat(v))
        start = {k: start[k] + reps * count[k] for k in stacks}
    cat = lambda parts: jax.tree.map(lambda *x: jnp.concatenate(x), *parts)
    return h, {k: cat(v) for k, v in new_caches.items() if v}, {k: cat(v) for k, v in auxs.items()}


def _run_runs(stacks: dict, h: jax.Array, period, caches: dict, layer, ctx: _Ctx):
    """One period: its runs (unit, n) in order over per-period stacks {kind: [count, ...]}. Returns (h, new
    caches {kind: [count, ...]}, aux {kind: {name: [count, ...]}})."""
    off: dict[str, int] = {}
    new_caches: dict[str, list] = {k: [] for k in caches}
    auxs: dict[str, list] = {}
    for unit, n in period:
        kinds = tuple(unit)
        take = lambda t: {k: jax.tree.map(lambda a: a[off.get(k, 0):off.get(k, 0) + n], t[k]) for k in kinds if k in t}
        p_run, c_run = take(stacks), take(caches)
        if n == 1:
            h, new, aux = _run_unrolled(p_run, h, kinds, ctx, c_run, layer)
        else:
            def step(h, xs, kinds=kinds):
                one = lambda t: jax.tree.map(lambda a: a[None], t)
                h, new, aux = _run_unrolled(one(xs[0]), h, kinds, ctx, one(xs[1]), layer)
                return h, jax.tree.map(lambda a: a[0], (new, aux))

            h, (new, aux) = jax.lax.scan(step, h, (p_run, c_run), length=n)
        for k, v in new.items():
            new_caches[k].append(v)
        for k, v in aux.items():
            auxs.setdefault(k, []).append(v)
        for k in kinds:
            off[k] = off.get(k, 0) + n
    cat = lambda parts: jax.tree.map(lambda *x: jnp.concatenate(x), *parts)
    return h, {k: cat(v) for k, v in new_caches.items() if v}, {k: cat(v) for k, v in auxs.items()}


def _run_cond_scan(stacks: dict, h: jax.Array, us: list[dict], ctx: _Ctx, caches: dict):
    """One scan over all units; a kind present in only some units runs under `lax.cond` (for patterns
    without a short period)."""
    U = len(us)
    present = [k for k in KIND_ORDER if k in stacks]
    every = {k: all(k in u for u in us) for k in present}
    has = {k: jnp.asarray(np.array([k in u for u in us])) for k in present if not every[k]}
    idx = {k: jnp.asarray(np.array([u.get(k, 0) for u in us], np.int32)) for k in present if not every[k]}
    # Every kind's params are scanned as xs. A kind missing from some units is spread to one slice per unit
    # (units without it get a copy of slice 0 that the lax.cond below never reads).
    xs_params = {k: stacks[k] if every[k] else _spread(stacks[k], np.array([u.get(k, 0) for u in us]),
                                                       np.array([i for i, u in enumerate(us) if k in u]))
                 for k in present}
    xs_caches = {k: caches[k] for k in present if every[k] and k in caches}
    read = {k: caches[k] for k in present if not every[k] and k in caches}  # indexed by layer, read only
    # a kind missing from some units collects its layers' new caches (a Mamba state, a chunk's KV entries) in
    # a stack carried through the scan, written at the layer's index
    carry_caches = {k: jax.tree.map(lambda s: jnp.zeros((ctx.cfg.kind_counts()[k],) + s.shape, s.dtype),
                                    jax.eval_shape(lambda p, c, k=k: apply_layer(k, p, h, ctx, c)[1],
                                                   _index(stacks[k], 0), _index(read[k], 0)))
                    for k in read}

    def body(carry, xs):
        h, cstacks = carry
        p_xs, c_xs, has_u, idx_u = xs
        new_xs, aux_u = {}, {}
        cstacks = dict(cstacks)
        for k in present:
            if every[k]:
                h, new, aux_u[k] = apply_layer(k, p_xs[k], h, ctx, c_xs.get(k))
                if k in c_xs:
                    new_xs[k] = new
            else:
                def yes(h, cs, k=k, i=idx_u[k]):
                    c = _index(read[k], i) if k in cs else None
                    h2, new, aux = apply_layer(k, p_xs[k], h, ctx, c)
                    if k in cs:
                        cs = dict(cs, **{k: _update(cs[k], new, i)})
                    return h2, cs, aux

                def no(h, cs, k=k):
                    return h, cs, _zero_aux(k, ctx.cfg)

                sub = {k: cstacks[k]} if k in cstacks else {}
                h, sub, aux_u[k] = jax.lax.cond(has_u[k], yes, no, h, sub)
                cstacks.update(sub)
        return (h, cstacks), (new_xs, aux_u)

    if ctx.opts.remat != "none":
        body = jax.checkpoint(body, policy=remat_policy(ctx.opts.remat))
    (h, carry_caches), (ys_caches, ys_aux) = jax.lax.scan(body, (h, carry_caches), (xs_params, xs_caches, has, idx),
                                                          length=U)
    new_caches = {**ys_caches, **carry_caches}
    aux = {}
    for k, a in ys_aux.items():
        if not a:
            continue
        sel = np.array([i for i, u in enumerate(us) if k in u])
        aux[k] = a if every[k] else jax.tree.map(lambda x: x[sel], a)
    return h, new_caches, aux


@jax.custom_vjp
def _unstack(a: jax.Array) -> tuple[jax.Array, ...]:
    return tuple(a[i] for i in range(a.shape[0]))


def _unstack_fwd(a):
    return _unstack(a), None


def _unstack_bwd(_, cts):
    return (jnp.stack(cts),)


_unstack.defvjp(_unstack_fwd, _unstack_bwd)


def unstack(a: jax.Array) -> tuple[jax.Array, ...]:
    """A stacked leaf [n, ...] -> its n layers, whose gradients are stacked back in one concatenation (each
    slice's own transpose pads a full [n, ...] zero array per layer and adds them up: O(n^2) traffic, 4% of
    the bench train step at n = 4). Integer leaves slice plainly."""
    if not jnp.issubdtype(a.dtype, jnp.inexact):
        return tuple(a[i] for i in range(a.shape[0]))
    return _unstack(a)


def _run_unrolled(stacks, h, kinds, ctx, caches, layer=None):
    """The layers one after another (the reference path, and the body of each periodic scan).
    layer(kind, params, h, cache) -> (h, new cache, aux) defaults to `apply_layer`."""
    layer = layer or (lambda kind, p, h, c: apply_layer(kind, p, h, ctx, c))
    seen: dict[str, int] = {}
    new_caches = {k: [] for k in caches}
    auxs: dict[str, list] = {}
    # a kind's params (and caches) are stacked [n, ...] leaves, or a list of the n layers' own (`unstack_layers`,
    # `cache.unstack_state`): those are read as they are, never sliced out of a stack (a copy on XLA:GPU)
    per_layer = {k: v if isinstance(v, list) else jax.tree.map(unstack, v) for k, v in stacks.items() if k in kinds}
    for kind in kinds:
        i = seen.get(kind, 0)
        seen[kind] = i + 1
        v = per_layer[kind]
        p = v[i] if isinstance(v, list) else jax.tree.map(lambda a: a[i], v, is_leaf=lambda a: isinstance(a, tuple))
        c = None
        if kind in caches:
            c = caches[kind][i] if isinstance(caches[kind], list) else jax.tree.map(lambda a: a[i], caches[kind])
        h, new, aux = layer(kind, p, h, c)
        if kind in caches:
            new_caches[kind].append(new)
        if aux:
            auxs.setdefault(kind, []).append(aux)
    new_caches = {k: v if isinstance(caches[k], list) else jax.tree.map(lambda *xs: jnp.stack(xs), *v)
                  for k, v in new_caches.items()}
    aux = {k: jax.tree.map(lambda *xs: jnp.stack(xs), *v) for k, v in auxs.items()}
    return h, new_caches, aux


def unstack_layers(params: dict) -> dict:
    """`params` with each layer kind's stacked leaves [n, ...] held as a list of the n layers' own trees (adapters
    attached beside their weights go along). A cached forward over such params runs the layers inline and reads
    each layer's weights as they are: no slice of a stack (on XLA:GPU a copy of the weights per step). Arrays are
    sliced once, here (a copy: call it outside the step)."""
    out = dict(params)
    out["layers"] = {k: v if isinstance(v, list) else [jax.tree.map(lambda a, i=i: a[i], v)
                                                        for i in range(jax.tree.leaves(v)[0].shape[0])]
                     for k, v in params["layers"].items()}
    return out


def stack_layers(params: dict) -> dict:
    """The inverse of `unstack_layers`: each layer kind's list of n layer trees -> its stacked leaves [n, ...] (a
    copy; kinds already stacked are kept). Training steps (scan, LoRA targets) take stacked layers."""
    out = dict(params)
    out["layers"] = {k: jax.tree.map(lambda *xs: jnp.stack(xs), *v) if isinstance(v, list) else v
                     for k, v in params["layers"].items()}
    return out


# --------------------------------------------------------------------------- public entry points
def input_embeddings(params: dict, tokens: jax.Array, cfg, *, opts: Options = Options(), images: dict | None = None):
    """tokens [B, T] -> [B, T, D] in opts.dtype; with `images` (see `nemo_jax.model.vision.pack_inputs`) each
    row's image-placeholder tokens take that row's image features."""
    h = embed_tokens(params["embeddings"], tokens, opts.dtype, opts.mesh)
    return pin_batch(_with_images(params, h, tokens, cfg, opts, images), opts.mesh)


def _with_images(params: dict, h: jax.Array, tokens: jax.Array, cfg, opts: Options, images: dict | None):
    if images is None:
        return h
    if cfg.vision is None:
        raise ValueError("images given but the model config has no vision tower (not a nemotron_h_omni model)")
    feats = vision_lib.encode(params, images, cfg, opts.dtype, scan=opts.scan, mesh=opts.mesh)
    return vision_lib.insert(h, tokens, feats, cfg.vision.image_token_id)


def hidden_states(params: dict, tokens: jax.Array, cfg, segment_ids=None, *, opts: Options = Options(),
                  images: dict | None = None, embeddings: jax.Array | None = None):
    """tokens [B, T] -> (final-normed hidden [B, T, D] in opts.dtype, aux). `embeddings` (from
    `input_embeddings`) skips the lookup."""
    ctx = _Ctx(cfg, opts, segment_ids=segment_ids)
    h = input_embeddings(params, tokens, cfg, opts=opts, images=images) if embeddings is None else embeddings
    h, _, aux = run_layers(params["layers"], h, cfg.layer_kinds, ctx)
    return rms_norm(h, params["norm_f"]["scale"], cfg.layer_norm_epsilon), _summarise_aux(aux)


def forward(params: dict, tokens: jax.Array, cfg, segment_ids=None, *, opts: Options = Options(), mtp: bool = True,
            images: dict | None = None, pixel_values=None, image_grid_hw=None):
    """tokens [B, T] int -> (logits [B, T, V] fp32, aux).

    aux: `aux_loss` (MoE balance loss, mean over MoE layers), `load` [n_moe, E] token-slot counts,
    `dropped`, and `mtp_logits` (list over MTP depths of [B, T, V]; depth d at t predicts t+2+d) when the
    config has MTP layers and `mtp` is set.
    Images: `images`, a per-row image batch (`vision.pack_inputs` / the data loader), or transformers-style
    `pixel_values [patches, C*p*p]` + `image_grid_hw [n, 2]` (host arrays: laid out here, so not under jit).
    """
    if pixel_values is not None:
        images = vision_lib.pack_inputs(cfg.vision, np.asarray(tokens), pixel_values, image_grid_hw)
    emb = None if images is None else input_embeddings(params, tokens, cfg, opts=opts, images=images)
    h, aux = hidden_states(params, tokens, cfg, segment_ids, opts=opts, embeddings=emb)
    logits = logits_from_hidden(h, params["lm_head"])
    if mtp and cfg.num_nextn_predict_layers and "mtp" in params:
        aux["mtp_logits"] = [logits_from_hidden(m, params["lm_head"])
                             for m in mtp_hidden(params, h, tokens, cfg, segment_ids, opts=opts, embeddings=emb)]
    return logits, aux


def mtp_hidden(params: dict, h: jax.Array, tokens: jax.Array, cfg, segment_ids=None, *, opts: Options = Options(),
               embeddings: jax.Array | None = None):
    """Multi-token prediction: for depth d, eh_proj(concat(enorm(embed(t+1+d)), hnorm(h_t))) -> MTP layers ->
    final_layernorm. h is the main model's final-normed hidden state. Returns a list of [B, T, D].
    `embeddings` (the main model's input embeddings, with image features) are shifted instead of
    looking the next tokens up."""
    ctx = _Ctx(cfg, opts, segment_ids=segment_ids)  # the main stack's remat policy and MoE dispatch
    outs, prev = [], h
    for d, p in enumerate(params["mtp"]):
        if embeddings is None:
            nxt = jnp.pad(tokens[:, 1 + d:], ((0, 0), (0, 1 + d)))
            e = embed_tokens(params["embeddings"], nxt, opts.dtype, opts.mesh)
        else:
            e = jnp.pad(embeddings[:, 1 + d:], ((0, 0), (0, 1 + d), (0, 0)))
        e = rms_norm(e, p["enorm"]["scale"], cfg.layer_norm_epsilon)
        hh = rms_norm(prev, p["hnorm"]["scale"], cfg.layer_norm_epsilon)
        x = linear(jnp.concatenate([e, hh], axis=-1), p["eh_proj"], opts.dtype)
        x, _, _ = run_layers(p["layers"], x, cfg.mtp_layer_kinds, ctx)
        prev = rms_norm(x, p["final_layernorm"]["scale"], cfg.layer_norm_epsilon)
        outs.append(prev)
    return outs


def _summarise_aux(aux: dict) -> dict:
    out: dict[str, Any] = {}
    if "moe" in aux:
        m = aux["moe"]
        out["aux_loss"] = jnp.mean(m["aux_loss"])
        out["load"] = m["load"]
        out["dropped"] = jnp.sum(m["dropped"])
    return out


def forward_cached(params: dict, tokens: jax.Array, valid: jax.Array, state: DecodeState, cfg, *,
                   opts: Options = Options(), positions=None, images: dict | None = None):
    """Append a chunk to a decode state. tokens/valid [b, l] (padding only on the left of the chunk).

    positions: None -> logits at every position [b, l, V] fp32 (the reference); "last" -> [b, 1, V] for the
    chunk's last position; an int array [b, n] of chunk positions -> [b, n, V]. The lm_head runs only where
    logits are returned, so a long prefill never holds [b, l, V]. Returns (logits, new state).
    Prefill = this on an empty state; decode = l == 1.
    """
    h, new = hidden_cached(params, tokens, valid, state, cfg, opts=opts, images=images)
    if isinstance(positions, str):
        if positions != "last":
            raise ValueError(f"positions: {positions!r} is not 'last', None or an index array")
        h = h[:, -1:]
    elif positions is not None:
        h = jnp.take_along_axis(h, jnp.asarray(positions, jnp.int32)[..., None], axis=1)
    return logits_from_hidden(h, params["lm_head"]), new


def hidden_cached(params: dict, tokens: jax.Array, valid: jax.Array, state: DecodeState, cfg, *,
                  opts: Options = Options(), images: dict | None = None):
    """`forward_cached` without the lm_head: -> (final-normed hidden [b, l, D] in opts.dtype, new state).
    `images`: the chunk's images (a prefill holding all of a row's image placeholders)."""
    l = tokens.shape[1]
    valid = valid.astype(bool)
    valid_cache = state.written(state.valid, valid, valid)
    ctx = _Ctx(cfg, opts, valid=valid, valid_cache=valid_cache, pos=state.pos)
    h = _with_images(params, embed(params["embeddings"], tokens, opts.dtype), tokens, cfg, opts, images)
    h, new, _ = run_layers(params["layers"], h, cfg.layer_kinds, ctx, state.layer_caches())
    h = rms_norm(h, params["norm_f"]["scale"], cfg.layer_norm_epsilon)
    if "attention" in new:  # written after every layer has read the cache: the entries are tied to the output
        # by a zero per row (0 * its sum; NaN only in a row whose output is NaN already), so XLA orders the reads
        # first and updates the donated cache in place instead of copying it around them (2 copies a step)
        tie = 0.0 * jnp.sum(h.astype(jnp.float32), axis=(1, 2))  # [b]
        new = dict(new, attention=jax.tree.map(  # (stacked [nA, b, l, ...] or per layer [b, l, ...])
            lambda x: x + tie.reshape((-1,) + (1,) * 3 if x.ndim == 4 else (1, -1) + (1,) * 3).astype(x.dtype),
            new["attention"]))
    return h, state.advance(new, valid, valid_cache)
