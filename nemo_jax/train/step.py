"""The SFT train step: loss, gradient accumulation, AdamW, non-finite guard, correction-bias update."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from nemo_jax.model.layers import cross_entropy
from nemo_jax.model.model import Options, hidden_states, input_embeddings, mtp_hidden
from nemo_jax.model.vision import LAYOUT_KEYS
from nemo_jax.train.optimizer import global_norm


class TrainState(NamedTuple):
    params: Any
    opt_state: Any
    step: jax.Array  # int32, optimizer steps taken (skipped ones included)
    nonfinite_run: jax.Array  # int32, consecutive skipped updates
    skipped: jax.Array  # int32, total skipped updates
    rng: jax.Array  # uint32 key data


def train_state_shardings(tx, trainable, trainable_shardings, mesh) -> TrainState:
    """Shardings of a TrainState on `mesh`: the trainable tree as given, optimiser moments sharded like it
    (`train.optimizer.state_shardings`), counters and RNG replicated."""
    from jax.sharding import NamedSharding, PartitionSpec as P

    from nemo_jax.train.optimizer import state_shardings

    rep = NamedSharding(mesh, P())
    return TrainState(trainable_shardings, state_shardings(tx, trainable, trainable_shardings, rep), rep, rep, rep,
                      rep)


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


def token_nll(params, batch, cfg, opts: Options, temperature: float = 1.0):
    """-> (nll [b, T] = -log softmax(logits / temperature)[target], h, aux): the model's per-token loss on batch
    tokens/targets/segment_ids [b, T], the vocabulary projected in chunks per device (never all logits)."""
    params = compute_weights(params, opts.dtype)
    emb = batch_embeddings(params, batch, cfg, opts)
    h, aux = hidden_states(params, batch["tokens"], cfg, batch["segment_ids"], opts=opts, embeddings=emb)
    if emb is not None:
        aux["embeddings"] = emb
    nll = cross_entropy(h, params["lm_head"], batch["targets"], mesh=opts.mesh, temperature=temperature)
    return nll, h, aux


def batch_embeddings(params, batch, cfg, opts: Options):
    """The input embeddings of a batch with images (`pixel_values` + the layout arrays of
    `nemo_jax.model.vision.layout`, per row), else None (the model looks the tokens up itself)."""
    if "pixel_values" not in batch:
        return None
    images = {k: batch[k] for k in ("pixel_values",) + LAYOUT_KEYS}
    return input_embeddings(params, batch["tokens"], cfg, opts=opts, images=images)


def token_loss(params, batch, cfg, opts: Options, mtp_coef: float = 0.0):
    """-> (sum of masked NLL, aux). batch: tokens/targets/loss_mask/segment_ids [b, T]."""
    params = compute_weights(params, opts.dtype)  # once (token_nll's cast is then a no-op)
    nll, h, aux = token_nll(params, batch, cfg, opts)
    emb = aux.pop("embeddings", None)  # image features at their placeholders: the MTP heads see them too
    mask = batch["loss_mask"].astype(jnp.float32)
    total = jnp.sum(nll * mask)
    if mtp_coef and cfg.num_nextn_predict_layers and "mtp" in params:
        seg = batch["segment_ids"]
        for d, hm in enumerate(mtp_hidden(params, h, batch["tokens"], cfg, seg, opts=opts, embeddings=emb)):
            # depth d at position t predicts targets[t + 1 + d], only inside one document
            tgt = jnp.pad(batch["targets"][:, 1 + d:], ((0, 0), (0, 1 + d)))
            m = jnp.pad(batch["loss_mask"][:, 1 + d:], ((0, 0), (0, 1 + d))) & (
                jnp.pad(seg[:, 1 + d:], ((0, 0), (0, 1 + d))) == seg)
            mnll = cross_entropy(hm, params["lm_head"], tgt, mesh=opts.mesh)
            aux[f"mtp{d}_nll_sum"] = jnp.sum(mnll * m)
            total = total + mtp_coef * aux[f"mtp{d}_nll_sum"]
    return total, aux


def model_params_of(combine):
    """combine(trainable, frozen) -> the model's params; default: the trainable tree is the whole model."""
    return combine or (lambda trainable, frozen: trainable)


def split_micro(batch, n: int):
    """[n * b, ...] leaves -> [n, b, ...] (the leading axis scanned over)."""
    return jax.tree.map(lambda x: x.reshape(n, x.shape[0] // n, *x.shape[1:]), batch)


def combine_stat(key: str):
    """How a statistic adds up over micro-batches: `_max` / `_min` keys by max / min, the rest by sum."""
    return jnp.maximum if key.endswith("_max") else jnp.minimum if key.endswith("_min") else jnp.add


def accumulate(grad_fn, params, frozen, batch, n: int, dtype=jnp.float32):
    """Run grad_fn(params, frozen, micro_batch) -> ((loss, stats), grads) over n micro-batches of `batch` ->
    ((summed loss, stats), summed grads: fp32 accumulators over several micro-batches, the compute dtype's for one).
    Stats are summed, except keys ending in `_max` / `_min`.

    The matmul weights are cast to the compute `dtype` once, before the micro-batches (`compute_weights`), and
    the gradients are taken with respect to those copies: the fp32 masters never enter the micro-batch loop
    (as loop-invariant operands of a scan XLA copied them, in fp32, 7.4 GiB per device for Super), and each
    weight gradient leaves its matmul, and its reduce-scatter, in `dtype`. The micro-batch gradients add up in
    fp32. One micro-batch runs without a loop (no accumulator at all), its gradients handed on as they are: an
    fp32 copy of every gradient, made before the update, was the peak of an optimiser-bound step (Nano 3 on 8
    H100s)."""
    wp = compute_weights(params, dtype)
    if n == 1:  # the gradients as the matmuls leave them (bf16 under bf16): the optimiser upcasts leaf by leaf
        return grad_fn(wp, frozen, batch)
    micro = split_micro(batch, n)
    (_, stats0), _ = jax.eval_shape(grad_fn, wp, frozen, jax.tree.map(lambda x: x[0], micro))
    init = jax.tree_util.tree_map_with_path(
        lambda path, s: jnp.full(s.shape, {jnp.maximum: -jnp.inf, jnp.minimum: jnp.inf}.get(
            combine_stat(path[-1].key), 0), s.dtype), stats0)

    def acc(carry, mb):
        (l_sum, st_sum), g_sum = carry
        (l, st), g = grad_fn(wp, frozen, mb)
        st_sum = {k: combine_stat(k)(st_sum[k], v) for k, v in st.items()}
        return ((l_sum + l, st_sum), jax.tree.map(lambda a, b: a + b.astype(a.dtype), g_sum, g)), None

    zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.promote_types(p.dtype, jnp.float32)), params)
    (out, g), _ = jax.lax.scan(acc, ((jnp.zeros((), jnp.float32), init), zeros), micro)
    return out, g


def apply_update(state: TrainState, grads, objective, tx, post=None):
    """One optimiser update of state.params from summed grads, skipped (params and optimiser state kept) when
    the objective or the gradient norm is not finite. post(new_params) -> params runs after the update
    (e.g. the router's correction-bias step). -> (state, grad_norm, finite)."""
    grad_norm = global_norm(grads)
    finite = jnp.isfinite(objective) & jnp.isfinite(grad_norm)
    updates, new_opt = tx.update(grads, state.opt_state, state.params)
    new_params = optax.apply_updates(state.params, updates)
    if post is not None:
        new_params = post(new_params)
    keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(finite, a, b), new, old)  # noqa: E731
    state = TrainState(
        params=keep(new_params, state.params),
        opt_state=keep(new_opt, state.opt_state),
        step=state.step + 1,
        nonfinite_run=jnp.where(finite, 0, state.nonfinite_run + 1),
        skipped=state.skipped + (~finite).astype(jnp.int32),
        rng=state.rng,
    )
    return state, grad_norm, finite


def make_train_step(cfg, opts: Options, tx, sched, ocfg, grad_accum: int = 1, combine=None):
    """Returns step(state, batch, frozen=None) -> (state, metrics). batch arrays are [A * b, T] for A
    micro-batches. With `combine` (e.g. LoRA: `lambda adapters, base: attach(base, adapters)`) only
    `state.params` (the adapters) get gradients and optimiser state; `frozen` (the base) is read, never updated."""
    model_params = model_params_of(combine)
    n_moe = cfg.kind_counts().get("moe", 0)

    def micro_loss(params, frozen, mb, n_tokens):
        total, aux = token_loss(model_params(params, frozen), mb, cfg, opts, ocfg.mtp_loss_coef)
        loss = total / n_tokens
        stats = {"nll_sum": total}
        if n_moe:
            stats.update(aux_loss=aux["aux_loss"], load=aux["load"], dropped=aux["dropped"])
            loss = loss + ocfg.aux_loss_coef * aux["aux_loss"] / grad_accum
        return loss, stats

    grad_fn = jax.value_and_grad(micro_loss, has_aux=True)

    def step(state: TrainState, batch, frozen=None):
        n_tokens = jnp.maximum(jnp.sum(batch["loss_mask"]).astype(jnp.float32), 1.0)
        (loss, st), grads = accumulate(lambda p, f, mb: grad_fn(p, f, mb, n_tokens), state.params, frozen, batch,
                                       grad_accum, opts.dtype)
        post = None
        if n_moe and ocfg.bias_update_rate and combine is None:  # a frozen base keeps its router bias
            post = lambda p: _update_correction_bias(p, st["load"], ocfg.bias_update_rate)  # noqa: E731
        state, grad_norm, finite = apply_update(state, grads, loss, tx, post)
        metrics = {"loss": st["nll_sum"] / n_tokens, "train_objective": loss, "grad_norm": grad_norm,
                   "lr": sched(state.step - 1), "loss_tokens": n_tokens, "finite": finite,
                   "skipped_updates": state.skipped}
        if n_moe:
            load = st["load"]
            metrics["aux_loss"] = st["aux_loss"] / grad_accum
            # token-slots dropped (capacity dispatch, the all-to-all's per-peer budget, or all_gather's ep_capacity),
            # and their share of every routed slot of the step (every token x top-k x MoE layer)
            metrics["moe_dropped"] = st["dropped"]
            slots = float(batch["tokens"].size) * cfg.num_experts_per_tok * n_moe  # past int32 at long contexts
            metrics["moe_dropped_frac"] = st["dropped"] / slots
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
    model_params = model_params_of(combine)

    def ev(params, batch, frozen=None):
        p = model_params(params, frozen)
        micro = split_micro(batch, micro_batches)

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
