"""Tinker's built-in losses, exactly as Tinker defines them: plain sums over tokens and datums, no normalisation.

Per token t of datum i, with the learner's logprob of the target `lp`, the sampler's `mu` (`logprobs`), the
advantage `A` and weight `w` (all per token, from `loss_fn_inputs`), and the ratio r = exp(lp - mu):

    cross_entropy         -lp * w                                   (any float w, also negative)
    importance_sampling   -r * A
    ppo                   -min(r * A, clip(r, lo, hi) * A)          lo, hi = clip_low/high_threshold (0.8, 1.2)
    cispo                 -sg(clip(r, lo, hi)) * lp * A             (sg: stop gradient)

The loss is the sum over every token of every datum (padding contributes exactly 0), returned as `loss:sum`; each
datum's `lp` comes back as `logprobs` in `loss_fn_outputs`. Gradients of several forward_backward calls add up
until `optim_step`, so chunks and calls are one big sum.

Losses this server does not implement are refused by name with the alternative (`refusal`).
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp


@dataclass(frozen=True)
class Loss:
    inputs: tuple[str, ...]  # loss_fn_inputs it needs besides target_tokens (float32, one per token)
    config: tuple[tuple[str, float], ...] = ()  # loss_fn_config keys and their defaults


CLIP = (("clip_low_threshold", 0.8), ("clip_high_threshold", 1.2))
LOSSES = {
    "cross_entropy": Loss(("weights",)),
    "importance_sampling": Loss(("logprobs", "advantages")),
    "ppo": Loss(("logprobs", "advantages"), CLIP),
    "cispo": Loss(("logprobs", "advantages"), CLIP),
}
INPUTS = ("target_tokens", "weights", "logprobs", "advantages")  # every per-token input a built-in loss reads

_INSTEAD = "use loss_fn='importance_sampling' (or 'ppo', 'cispo')"
REFUSED = {
    "stable_reinforce": f"StableReinforce's formula is not public, so nemo-jax serve does not offer it: {_INSTEAD}",
    "custom": "server-side custom losses are not supported (this server's client/config has custom_loss_server_side "
              "false: forward_backward_custom runs your loss client-side over cross_entropy)",
    "dro": f"'dro' is not implemented by nemo-jax serve: {_INSTEAD}",
    "gspo": f"'gspo' is not implemented by nemo-jax serve: {_INSTEAD}",
}


def refusal(loss_fn: str) -> str | None:
    """Why `loss_fn` is refused (None: it is one of LOSSES)."""
    if loss_fn in LOSSES:
        return None
    return REFUSED.get(loss_fn, f"unknown loss_fn {loss_fn[:80]!r} (expected one of {', '.join(LOSSES)})")


def loss_config(loss_fn: str, given: dict) -> dict[str, float]:
    """loss_fn_config -> every key of the loss with its value (defaults filled); an unknown key, a non-number or
    thresholds that are not 0 <= low <= high are ValueErrors naming it."""
    spec = dict(LOSSES[loss_fn].config)
    for k, v in given.items():
        if k not in spec:
            raise ValueError(f"loss_fn_config key {k[:80]!r} is not one of {loss_fn}'s "
                             f"({', '.join(spec) or 'it takes none'})")
        if isinstance(v, str) or not (abs(float(v)) < float("inf")):
            raise ValueError(f"loss_fn_config {k!r} must be a finite number, got {v!r:.80}")
    out = {k: float(given.get(k, d)) for k, d in spec.items()}
    if "clip_low_threshold" in out and not 0 <= out["clip_low_threshold"] <= out["clip_high_threshold"]:
        raise ValueError(f"loss_fn_config: 0 <= clip_low_threshold <= clip_high_threshold, got "
                         f"{out['clip_low_threshold']} and {out['clip_high_threshold']}")
    return out


def token_losses(loss_fn: str, lp: jax.Array, inputs: dict, config: dict) -> jax.Array:
    """Per-token loss [N, T] (0 where `inputs["mask"]` is 0). lp: learner logprobs [N, T]; inputs: the float32
    per-token inputs [N, T] and `mask`; config: `loss_config`'s values (scalars, may be traced)."""
    lp = lp.astype(jnp.float32)
    if loss_fn == "cross_entropy":
        per = -lp * inputs["weights"]
    else:
        adv = inputs["advantages"]
        r = jnp.exp(lp - inputs["logprobs"])
        if loss_fn == "importance_sampling":
            per = -r * adv
        else:
            clipped = jnp.clip(r, config["clip_low_threshold"], config["clip_high_threshold"])
            if loss_fn == "ppo":
                per = -jnp.minimum(r * adv, clipped * adv)
            elif loss_fn == "cispo":
                per = -jax.lax.stop_gradient(clipped) * lp * adv
            else:
                raise ValueError(f"loss_fn {loss_fn!r}")
    return jnp.where(inputs["mask"] > 0, per, 0.0)
