"""The GRPO learner step: forward with adapters, per-token logprobs at the sampling temperature, the policy loss
(nemo_jax.rl.loss), backward into the trainable tree only (the adapters under LoRA), AdamW; micro-batched and
on a mesh like the SFT step (it shares `train.step.accumulate` / `apply_update`).

A learner batch (all [N, T] but `advantages`: [N], or [N, T] under per-turn credit; N divisible by the micro-batch
count and the batch shards):
  tokens, targets, segment_ids   model inputs; targets[t] is the token after tokens[t]
  loss_mask                      True on the sampled (policy) tokens among the targets
  behaviour_logprobs             the rollout policy's logprob of each target (0 off the mask)
  loss_weights                   `rl.loss.loss_weights` over the whole batch (global counts)
  advantages                     `rl.loss.group_advantages` (per token: `rl.rollout.token_advantages`)
"""

from __future__ import annotations

import jax

from nemo_jax.model.model import Options
from nemo_jax.config.train import PolicyLossConfig  # noqa: F401 (re-exported)
from nemo_jax.rl.loss import loss_options, policy_terms, summarise
from nemo_jax.train.step import TrainState, model_params_of, accumulate, apply_update, token_nll

def token_logprobs(params, batch, cfg, opts: Options, temperature: float = 1.0) -> jax.Array:
    """[N, T] log p(targets) under softmax(logits / temperature)."""
    return -token_nll(params, batch, cfg, opts, temperature)[0]


def make_learner_grads(cfg, opts: Options, loss_cfg: PolicyLossConfig, grad_accum: int = 1, combine=None):
    """-> grads(params, frozen, batch) -> ((loss, token statistics), gradients of state.params), summed over
    `grad_accum` micro-batches. With `combine` (LoRA: attach adapters to the frozen base) only the adapters get
    gradients; the reference policy for `ref_kl_coef` is the frozen base alone."""
    if loss_cfg.ref_kl_coef and combine is None:
        raise ValueError("loss.ref_kl_coef needs a frozen base (LoRA): the reference policy is the model with "
                         "its adapters off")
    model_params = model_params_of(combine)
    c = loss_cfg

    def micro_loss(params, frozen, mb):
        lp = token_logprobs(model_params(params, frozen), mb, cfg, opts, c.temperature)
        ref = None
        if c.ref_kl_coef:
            ref = jax.lax.stop_gradient(token_logprobs(frozen, mb, cfg, opts, c.temperature))
        return policy_terms(lp, mb["behaviour_logprobs"], mb["advantages"], mb["loss_weights"], mb["loss_mask"],
                            ref_logprobs=ref, ref_kl_coef=c.ref_kl_coef, **loss_options(c))

    grad_fn = jax.value_and_grad(micro_loss, has_aux=True)
    return lambda params, frozen, batch: accumulate(grad_fn, params, frozen, batch, grad_accum, opts.dtype)


def make_learner_step(cfg, opts: Options, tx, sched, loss_cfg: PolicyLossConfig, grad_accum: int = 1,
                      combine=None):
    """-> step(state, batch, frozen=None) -> (state, metrics): `make_learner_grads` and one optimiser update."""
    grads_of = make_learner_grads(cfg, opts, loss_cfg, grad_accum, combine)

    def step(state: TrainState, batch, frozen=None):
        (loss, stats), grads = grads_of(state.params, frozen, batch)
        state, grad_norm, finite = apply_update(state, grads, loss, tx)
        metrics = dict(summarise(stats), loss=loss, grad_norm=grad_norm, lr=sched(state.step - 1), finite=finite,
                       skipped_updates=state.skipped)
        return state, metrics

    return step
