"""The SFT train step: loss, gradient accumulation, AdamW, non-finite guard, correction-bias update."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from nemo_jax.model.layers import chunked_cross_entropy
from nemo_jax.model.model import Options, hidden_states, mtp_hidden
from nemo_jax.parallel.mesh import row_shards


class TrainState(NamedTuple):
    params: Any
    opt_state: Any
    step: jax.Array  # int32, optimizer steps taken (skipped ones included)
    nonfinite_run: jax.Array  # int32, consecutive skipped updates
    skipped: jax.Array  # int32, total skipped updates
    rng: jax.Array  # uint32 key data


def compute_weights(params, dtype):
    """The matmul weights (every `kernel` but the router's, routed experts, adapter matrices) in the compute
    dtype, cast once on their shards. The model casts each of them to that dtype at use anyway (same values),
    but cast inside the layer loop the FSDP all-gathers moved fp32: this halves their bytes under bf16."""
    if dtype == jnp.float32:
        return params

    def cast(path, a):
        keys = [getattr(k, "key", None) for k in path]
        if "gate" not in keys and (keys[-1] in ("kernel", "lora_a", "lora_b") or keys[-2:-1] == ["experts"]):
            return a.astype(dtype)
        return a

    return jax.tree_util.tree_map_with_path(cast, params)


def whole_head(head: dict, mesh) -> dict:
    """The lm_head with its hidden dim gathered once per micro-batch (FSDP), its vocab dim on `tensor`: used
    inside the CE chunk loop as stored, GSPMD re-gathered it for every chunk (forward, recompute, backward)."""
    if mesh is None:
        return head
    from jax.sharding import NamedSharding, PartitionSpec as P

    V, t = head["kernel"].shape[1], mesh.shape.get("tensor", 1)
    spec = P(None, "tensor" if t > 1 and V % t == 0 else None)
    return dict(head, kernel=jax.lax.with_sharding_constraint(head["kernel"], NamedSharding(mesh, spec)))


def token_loss(params, batch, cfg, opts: Options, mtp_coef: float = 0.0):
    """-> (sum of masked NLL, aux). batch: tokens/targets/loss_mask/segment_ids [b, T]."""
    params = compute_weights(params, opts.dtype)
    head = whole_head(params["lm_head"], opts.mesh)
    h, aux = hidden_states(params, batch["tokens"], cfg, batch["segment_ids"], opts=opts)
    rows = row_shards(opts.mesh, h.shape[0])
    nll = chunked_cross_entropy(h, head, batch["targets"], row_shards=rows)
    mask = batch["loss_mask"].astype(jnp.float32)
    total = jnp.sum(nll * mask)
    if mtp_coef and cfg.num_nextn_predict_layers and "mtp" in params:
        seg = batch["segment_ids"]
        for d, hm in enumerate(mtp_hidden(params, h, batch["tokens"], cfg, seg, opts=opts)):
            # depth d at position t predicts targets[t + 1 + d], only inside one document
            tgt = jnp.pad(batch["targets"][:, 1 + d:], ((0, 0), (0, 1 + d)))
            m = jnp.pad(batch["loss_mask"][:, 1 + d:], ((0, 0), (0, 1 + d))) & (
                jnp.pad(seg[:, 1 + d:], ((0, 0), (0, 1 + d))) == seg)
            mnll = chunked_cross_entropy(hm, head, tgt, row_shards=rows)
            aux[f"mtp{d}_nll_sum"] = jnp.sum(mnll * m)
            total = total + mtp_coef * aux[f"mtp{d}_nll_sum"]
    return total, aux


def _model_params(combine):
    """combine(trainable, frozen) -> the model's params; default: the trainable tree is the whole model."""
    return combine or (lambda trainable, frozen: trainable)


def make_train_step(cfg, opts: Options, tx, sched, ocfg, grad_accum: int = 1, combine=None):
    """Returns step(state, batch, frozen=None) -> (state, metrics). batch arrays are [A * b, T] for A
    micro-batches. With `combine` (e.g. LoRA: `lambda adapters, base: attach(base, adapters)`) only
    `state.params` (the adapters) get gradients and optimiser state; `frozen` (the base) is read, never updated."""
    model_params = _model_params(combine)

    def micro_loss(params, frozen, mb, n_tokens):
        total, aux = token_loss(model_params(params, frozen), mb, cfg, opts, ocfg.mtp_loss_coef)
        loss = total / n_tokens
        if "aux_loss" in aux:
            loss = loss + ocfg.aux_loss_coef * aux["aux_loss"] / grad_accum
        return loss, (total, aux)

    grad_fn = jax.value_and_grad(micro_loss, has_aux=True)

    def step(state: TrainState, batch, frozen=None):
        n_tokens = jnp.maximum(jnp.sum(batch["loss_mask"]).astype(jnp.float32), 1.0)
        micro = jax.tree.map(lambda x: x.reshape(grad_accum, x.shape[0] // grad_accum, *x.shape[1:]), batch)
        zeros = jax.tree.map(jnp.zeros_like, state.params)

        def acc(carry, mb):
            g_sum, l_sum, nll_sum, aux_sum, load, dropped = carry
            (l, (total, aux)), g = grad_fn(state.params, frozen, mb, n_tokens)
            g_sum = jax.tree.map(jnp.add, g_sum, g)
            return (g_sum, l_sum + l, nll_sum + total, aux_sum + aux.get("aux_loss", 0.0),
                    load + aux.get("load", 0.0), dropped + aux.get("dropped", 0)), None

        n_moe = cfg.kind_counts().get("moe", 0)
        load0 = jnp.zeros((n_moe, cfg.n_routed_experts), jnp.float32) if n_moe else jnp.zeros(())
        (grads, loss, nll_sum, aux_loss, load, dropped), _ = jax.lax.scan(
            acc, (zeros, 0.0, 0.0, 0.0, load0, jnp.zeros((), jnp.int32)), micro)
        grad_norm = optax.tree.norm(grads)
        finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
        updates, new_opt = tx.update(grads, state.opt_state, state.params)
        new_params = optax.apply_updates(state.params, updates)
        if n_moe and ocfg.bias_update_rate and combine is None:  # a frozen base keeps its router bias
            new_params = _update_correction_bias(new_params, load, ocfg.bias_update_rate)
        keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(finite, a, b), new, old)
        state = TrainState(
            params=keep(new_params, state.params),
            opt_state=keep(new_opt, state.opt_state),
            step=state.step + 1,
            nonfinite_run=jnp.where(finite, 0, state.nonfinite_run + 1),
            skipped=state.skipped + (~finite).astype(jnp.int32),
            rng=state.rng,
        )
        metrics = {"loss": nll_sum / n_tokens, "train_objective": loss, "grad_norm": grad_norm,
                   "lr": sched(state.step - 1), "loss_tokens": n_tokens, "finite": finite,
                   "skipped_updates": state.skipped}
        if n_moe:
            metrics["aux_loss"] = aux_loss / grad_accum
            metrics["moe_dropped"] = dropped  # token-slots dropped (capacity dispatch, or model.ep_capacity)
            mean = jnp.mean(load, axis=-1)
            metrics["expert_load_max_over_mean"] = jnp.max(jnp.max(load, axis=-1) / jnp.maximum(mean, 1e-9))
            metrics["expert_load_min_over_mean"] = jnp.min(jnp.min(load, axis=-1) / jnp.maximum(mean, 1e-9))
            metrics["expert_load"] = load
        return state, metrics

    return step


def _update_correction_bias(params, load, rate):
    """Aux-loss-free balancing: bias += rate * sign(mean load - load), per MoE layer, outside autograd."""
    bias = params["layers"]["moe"]["mixer"]["gate"]["correction_bias"]  # [n_moe, E]
    new = bias + rate * jnp.sign(jnp.mean(load, axis=-1, keepdims=True) - load)
    out = jax.tree.map(lambda x: x, params)
    out["layers"]["moe"]["mixer"]["gate"]["correction_bias"] = new.astype(bias.dtype)
    return out


def make_eval_step(cfg, opts: Options, combine=None, micro_batches: int = 1):
    """ev(params, batch, frozen=None) -> (summed NLL, loss tokens). The batch runs in `micro_batches`
    sequential micro-batches (the training micro-batch size), so eval never needs more memory than a step."""
    model_params = _model_params(combine)

    def ev(params, batch, frozen=None):
        p = model_params(params, frozen)
        micro = jax.tree.map(lambda x: x.reshape(micro_batches, x.shape[0] // micro_batches, *x.shape[1:]), batch)

        def one(total, mb):
            t, _ = token_loss(p, mb, cfg, opts)
            return total + t, None

        total, _ = jax.lax.scan(one, jnp.zeros((), jnp.float32), micro)
        return total, jnp.sum(batch["loss_mask"]).astype(jnp.float32)

    return ev


@jax.jit
def all_finite(tree) -> jax.Array:
    """One compiled reduction over every floating leaf. Jitted so that on several processes it is one program
    with one collective: as eager ops, each leaf's reduction was its own asynchronously dispatched collective,
    and processes running those in different orders deadlocked (seen in the 2-process SFT test)."""
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)
                              if jnp.issubdtype(x.dtype, jnp.floating)]))
