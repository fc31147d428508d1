"""The GRPO learner step: forward with adapters, per-token logprobs at the sampling temperature, the policy loss
(nemo_jax.rl.loss), backward into the trainable tree only (the adapters under LoRA), AdamW; micro-batched and
on a mesh like the SFT step (it shares `train.step.accumulate` / `apply_update`).

A learner batch (all [N, T] but `advantages` [N]; N divisible by the micro-batch count and the batch shards):
  tokens, targets, segment_ids   model inputs; targets[t] is the token after tokens[t]
  loss_mask                      True on the sampled (policy) tokens among the targets
  behaviour_logprobs             the rollout policy's logprob of each target (0 off the mask)
  loss_weights                   `rl.loss.loss_weights` over the whole batch (global counts)
  advantages                     `rl.loss.group_advantages`
"""

from __future__ import annotations

from dataclasses import dataclass

import jax

from nemo_jax.model.model import Options
from nemo_jax.rl.loss import KINDS, REDUCTIONS, policy_terms, summarise
from nemo_jax.train.step import TrainState, model_params_of, accumulate, apply_update, token_nll

BATCH_KEYS = ("tokens", "targets", "segment_ids", "loss_mask", "behaviour_logprobs", "loss_weights", "advantages")


@dataclass(frozen=True)
class PolicyLossConfig:
    kind: str = "dppo"  # dppo | importance_sampling | ppo | cross_entropy
    reduction: str = "rollout"  # rollout | token | constant (weights are made on the host: rl.loss.loss_weights)
    delta_low: float = 0.2  # DPPO: drop a token with A < 0 when p - p_mu < -delta_low (ppo: ratio clip 1 - delta_low)
    delta_high: float = 0.2  # DPPO: drop a token with A > 0 when p - p_mu > delta_high
    kl_coef: float = 0.0  # (lp - mu)^2 penalty towards the behaviour policy
    ref_kl_coef: float = 0.0  # k3 KL to the base policy (the model with adapters off; LoRA only)
    temperature: float = 1.0  # the sampler's temperature: both logprobs must come from the same distribution

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"loss.kind: {self.kind!r} (expected one of {', '.join(KINDS)})")
        if self.reduction not in REDUCTIONS:
            raise ValueError(f"loss.reduction: {self.reduction!r} (expected one of {', '.join(REDUCTIONS)})")
        if self.temperature <= 0:
            raise ValueError(f"loss.temperature must be > 0 (got {self.temperature}); sample greedily elsewhere")


def token_logprobs(params, batch, cfg, opts: Options, temperature: float = 1.0) -> jax.Array:
    """[N, T] log p(targets) under softmax(logits / temperature)."""
    return -token_nll(params, batch, cfg, opts, temperature)[0]


def make_learner_step(cfg, opts: Options, tx, sched, loss_cfg: PolicyLossConfig, grad_accum: int = 1,
                      combine=None):
    """-> step(state, batch, frozen=None) -> (state, metrics); with `combine` (LoRA: attach adapters to the
    frozen base) only state.params (the adapters) are trained."""
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
                            kind=c.kind, delta_low=c.delta_low, delta_high=c.delta_high, kl_coef=c.kl_coef,
                            ref_logprobs=ref, ref_kl_coef=c.ref_kl_coef)

    grad_fn = jax.value_and_grad(micro_loss, has_aux=True)

    def step(state: TrainState, batch, frozen=None):
        (loss, stats), grads = accumulate(grad_fn, state.params, frozen, batch, grad_accum)
        state, grad_norm, finite = apply_update(state, grads, loss, tx)
        metrics = dict(summarise(stats), loss=loss, grad_norm=grad_norm, lr=sched(state.step - 1), finite=finite,
                       skipped_updates=state.skipped)
        return state, metrics

    return step
