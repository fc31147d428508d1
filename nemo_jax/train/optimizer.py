"""optax AdamW with warmup + cosine/linear decay, global-norm clipping and a weight-decay mask."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import optax

from nemo_jax.model.spec import path_str

# No weight decay on SSM dynamics, norms, biases (incl. the router correction bias).
NO_DECAY = re.compile(r"(^|/)(A_log|D|dt_bias|scale|bias|correction_bias)$")


def decay_mask(params):
    return jax.tree_util.tree_map_with_path(lambda p, _: not NO_DECAY.search(path_str(p)), params)


def schedule(o, total_steps: int):
    peak, floor = o.lr, o.lr * o.min_lr_ratio
    warm = max(0, min(o.warmup_steps, total_steps))
    rest = max(1, total_steps - warm)
    if o.decay == "cosine":
        after = optax.cosine_decay_schedule(peak, rest, alpha=o.min_lr_ratio)
    elif o.decay == "linear":
        after = optax.linear_schedule(peak, floor, rest)
    elif o.decay == "constant":
        after = optax.constant_schedule(peak)
    else:
        raise ValueError(f"optim.decay: {o.decay!r} (expected cosine, linear or constant)")
    if warm == 0:
        return after
    return optax.join_schedules([optax.linear_schedule(0.0, peak, warm), after], [warm])


def global_norm(tree) -> jax.Array:
    """The L2 norm of every leaf together, summed in fp32 whatever the leaves' dtype (bf16 gradients are upcast
    inside the reduction, never as a copy)."""
    return jnp.sqrt(sum(jnp.sum(jnp.square(x.astype(jnp.float32))) for x in jax.tree.leaves(tree)))


def clip_by_global_norm(max_norm: float) -> optax.GradientTransformation:
    """optax.clip_by_global_norm with the norm summed in fp32 (`global_norm`): the gradients of a bf16 step arrive
    in bf16 (the matmuls' dtype) and are scaled into fp32 updates leaf by leaf."""

    def update(updates, state, params=None):
        del params
        norm = global_norm(updates)
        scale = jnp.where(norm < max_norm, 1.0, max_norm / jnp.maximum(norm, 1e-30))
        return jax.tree.map(lambda g: g.astype(jnp.float32) * scale, updates), state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


def make_optimizer(o, params, total_steps: int, frozen: str | None = None):
    """AdamW (+ clipping) over `params`; leaves whose path matches the regex `frozen` get no update and hold no
    optimiser state. `o.mu_dtype` (bfloat16) keeps Adam's first moment in bf16 (the second stays fp32)."""
    sched = schedule(o, total_steps)
    mu_dtype = jnp.bfloat16 if o.mu_dtype == "bfloat16" else None
    tx = optax.chain(
        clip_by_global_norm(o.clip_norm) if o.clip_norm > 0 else optax.identity(),
        optax.adamw(sched, b1=o.b1, b2=o.b2, eps=o.eps, weight_decay=o.weight_decay, mask=decay_mask(params),
                    mu_dtype=mu_dtype),
    )
    if frozen:
        pat = re.compile(frozen)
        labels = jax.tree_util.tree_map_with_path(lambda p, _: "frozen" if pat.search(path_str(p)) else "train",
                                                  params)
        tx = optax.multi_transform({"train": tx, "frozen": optax.set_to_zero()}, labels)
    return tx, sched


def state_shardings(tx, params, param_sharding_tree, replicated):
    """Shardings of `tx.init(params)`: every leaf that mirrors a parameter (Adam's mu, nu, ...) is sharded
    exactly like that parameter (ZeRO-3 / FSDP); counters and other small leaves are replicated.

    Matching is by tree path: a state leaf whose path ends with a parameter's path and has its shape."""
    from nemo_jax.model.spec import path_str

    by_path = {path_str(p): (x.shape, s) for (p, x), s in zip(jax.tree_util.tree_flatten_with_path(params)[0],
                                                              jax.tree.leaves(param_sharding_tree))}

    def pick(path, leaf):
        parts = path_str(path).split("/")
        for i in range(len(parts)):
            hit = by_path.get("/".join(parts[i:]))
            if hit is not None and tuple(hit[0]) == tuple(leaf.shape):
                return hit[1]
        return replicated

    return jax.tree_util.tree_map_with_path(pick, jax.eval_shape(tx.init, params))
