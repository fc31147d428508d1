"""The GRPO-family policy loss (docs/grpo.md, docs/design.md: RL), advantages and reduction weights.

Per token t of rollout i, with learner logprob `lp`, behaviour (rollout-policy) logprob `mu` and the rollout's
advantage `A_i`:

    rho    = exp(clip(lp - mu, -20, 20))                      importance ratio
    keep   = not (A > 0 and p - p_mu > delta_high) and not (A < 0 and p - p_mu < -delta_low)
             with p = exp(lp), p_mu = exp(mu), held constant      DPPO binary total-variation trust region
    loss_t = -where(keep, rho * A, 0) + kl_coef * clip(lp - mu, -20, 20)^2  [+ ref_kl_coef * k3(lp, ref)]

and the loss is sum_{i,t} w_{i,t} loss_t with weights from `loss_weights` (computed on the host from the
counts of the whole batch, so micro-batches and data-parallel shards add up to the update of one big batch):

    rollout   w = mask / (N * |o_i|)       mean within each rollout, then over rollouts (default)
    token     w = mask / sum(mask)         mean over all loss tokens
    constant  w = mask / (N * max_len)     Dr. GRPO's constant normaliser

Corrections for rollouts sampled by another engine or an older policy (the sampler's and the learner's logprobs
differ: kernels, precision, staleness), as `kind`s next to DPPO. Both are policy gradients whose weight is held
constant (`sg`), written as `-sg(w) * A * exp(lp - sg(lp))`: its value is `-w A`, its gradient `-w A grad(lp)`:

    tis      w = min(rho, is_cap)                                   truncated importance sampling (TIS)
    icepop   w = rho if is_low <= rho <= is_high else 0 (masked)    masked importance sampling (IcePop / MIS)

and, with any kind, a per-rollout mismatch bound: a rollout whose mean log-ratio over its loss tokens,
`mean_t(lp - mu)` (the log of its geometric-mean ratio), lies outside `+-seq_mismatch_max` is dropped from the
update (weight 0), counted in `mismatch_dropped` (0 turns it off).

Other `kind`s (the primitives a user's own loop may want): `importance_sampling` (no trust-region mask),
`ppo` (-min(rho A, clip(rho, 1 - delta_low, 1 + delta_high) A)) and `cross_entropy` (-lp, advantages unused).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from nemo_jax.config.train import POLICY_LOSS_KINDS as KINDS, REDUCTIONS

LOG_RATIO_CLIP = 20.0


# ----------------------------------------------------------------------------- host side: advantages, weights
def group_advantages(rewards, group_ids, scale: str = "none", eps: float = 1e-6):
    """rewards [N], group_ids [N] (rollouts of one task prompt share an id) -> (advantages [N] float32,
    zero_variance [N] bool). Dr. GRPO: A = r - mean(group rewards), unscaled; scale="std" divides by the
    group's standard deviation (+ eps) as in the original GRPO. Rollouts of a group whose rewards are all
    equal carry no signal (A = 0): `zero_variance` marks them so the caller can count and skip them."""
    if scale not in ("none", "std"):
        raise ValueError(f"advantage scale: {scale!r} (expected 'none' or 'std')")
    r = np.asarray(rewards, np.float64)
    g = np.asarray(group_ids)
    if r.shape != g.shape or r.ndim != 1:
        raise ValueError(f"rewards {r.shape} and group_ids {g.shape} must be the same 1-D shape")
    if not np.all(np.isfinite(r)):
        raise ValueError(f"rewards must be finite (rows {np.flatnonzero(~np.isfinite(r)).tolist()})")
    _, inv = np.unique(g, return_inverse=True)
    count = np.bincount(inv)
    mean = np.bincount(inv, r) / count
    centred = r - mean[inv]
    var = np.bincount(inv, centred ** 2) / count
    zero = var[inv] <= 1e-12
    adv = centred / (np.sqrt(var[inv]) + eps) if scale == "std" else centred
    fmax = float(np.finfo(np.float32).max)  # rewards finite in fp32 can be 2x apart: never an inf advantage
    return np.clip(np.where(zero, 0.0, adv), -fmax, fmax).astype(np.float32), zero


def loss_weights(loss_mask, reduction: str = "rollout", max_len: int | None = None, n_rollouts: int | None = None):
    """loss_mask [N, T] (the whole batch, before any micro-batching) -> float32 weights [N, T] whose weighted
    token sum is the reduction. max_len: the constant normaliser's length (default T, e.g. the generation
    budget); n_rollouts: N when rows of the batch are split elsewhere (default: the rows given). numpy in,
    numpy out (the learner computes them on the host); a jax array in (e.g. traced), jax out."""
    xp = jnp if isinstance(loss_mask, jax.Array) else np
    m = xp.asarray(loss_mask).astype(xp.float32)
    if m.ndim != 2:
        raise ValueError(f"loss_mask must be [N, T], got {m.shape}")
    n = max(m.shape[0] if n_rollouts is None else n_rollouts, 1)
    if reduction == "rollout":
        per_row = m.sum(axis=1, keepdims=True)
        w = m / xp.maximum(per_row, 1.0) / n  # rows without loss tokens have weight 0 everywhere
    elif reduction == "token":
        w = m / xp.maximum(m.sum(), 1.0)
    elif reduction == "constant":
        w = m / (n * (m.shape[1] if max_len is None else max_len))
    else:
        raise ValueError(f"reduction: {reduction!r} (expected one of {', '.join(REDUCTIONS)})")
    return w.astype(xp.float32)


# ----------------------------------------------------------------------------- device side: the loss
def policy_terms(logprobs, behaviour_logprobs, advantages, weights, loss_mask, *, kind: str = "dppo",
                 delta_low: float = 0.2, delta_high: float = 0.2, kl_coef: float = 0.0, ref_logprobs=None,
                 ref_kl_coef: float = 0.0, is_cap: float = 2.0, is_low: float = 0.5, is_high: float = 5.0,
                 seq_mismatch_max: float = 0.0):
    """The weighted loss sum and additive statistics (token sums; `_min` / `_max` keys combine by min / max) for
    one (micro-)batch. logprobs, behaviour_logprobs, weights, loss_mask [N, T]; advantages [N] (one per rollout)
    or [N, T] (one per token: per-turn credit). Rows are whole
    rollouts (micro-batches split rows, never a row), so the per-rollout mismatch bound sees each rollout whole."""
    if kind not in KINDS:
        raise ValueError(f"policy loss kind: {kind!r} (expected one of {', '.join(KINDS)})")
    lp = logprobs.astype(jnp.float32)
    mu = behaviour_logprobs.astype(jnp.float32)
    m = loss_mask.astype(jnp.float32)
    a = advantages.astype(jnp.float32)
    a = a if a.ndim == 2 else a[:, None]  # per token (per-turn credit) or per rollout
    log_ratio = jnp.clip(lp - mu, -LOG_RATIO_CLIP, LOG_RATIO_CLIP)
    rho = jnp.exp(log_ratio)
    gap = jax.lax.stop_gradient(jnp.exp(lp) - jnp.exp(mu))
    high = (a > 0) & (gap > delta_high)
    low = (a < 0) & (gap < -delta_low)
    d = jax.lax.stop_gradient(log_ratio)
    ratio = jnp.exp(d)  # rho, held constant
    outside = (ratio < is_low) | (ratio > is_high)
    if kind == "dppo":
        pg = -jnp.where(high | low, 0.0, rho * a)
    elif kind == "importance_sampling":
        pg = -rho * a
    elif kind == "ppo":
        pg = -jnp.minimum(rho * a, jnp.clip(rho, 1.0 - delta_low, 1.0 + delta_high) * a)
    elif kind in ("tis", "icepop"):
        w = jnp.minimum(ratio, is_cap) if kind == "tis" else jnp.where(outside, 0.0, ratio)
        pg = -w * a * jnp.exp(lp - jax.lax.stop_gradient(lp))
    else:
        pg = -lp
    if kl_coef:  # on the clipped log ratio: a huge gap never gives an inf term (nor 0 x inf at kl_coef 0)
        pg = pg + kl_coef * jnp.square(log_ratio)
    per_token = pg
    rows = jnp.sum(m, axis=1) > 0  # rollouts with loss tokens here
    if seq_mismatch_max:  # the rollout's mean log-ratio (log of its geometric-mean ratio) out of bounds: dropped
        seq = jnp.sum(m * d, axis=1) / jnp.maximum(jnp.sum(m, axis=1), 1.0)
        dropped = rows & (jnp.abs(seq) > seq_mismatch_max)
        m_loss = m * ~dropped[:, None]
    else:
        dropped, m_loss = jnp.zeros_like(rows), m
    stats = {"loss_tokens": jnp.sum(m), "masked_high": jnp.sum(m * high), "masked_low": jnp.sum(m * low),
             "is_truncated": jnp.sum(m * (ratio > is_cap)) if kind == "tis" else jnp.zeros(()),
             "is_masked": jnp.sum(m * outside) if kind == "icepop" else jnp.zeros(()),
             "rollouts": jnp.sum(rows), "mismatch_dropped": jnp.sum(dropped),
             # KL(behaviour || learner) on the behaviour's samples, k3 estimator: rho - 1 - log rho
             "mismatch_kl_sum": jnp.sum(m * (jnp.exp(d) - 1.0 - d)),
             "ratio_max": jnp.max(jnp.where(m > 0, jnp.exp(d), -jnp.inf)),
             "ratio_min": jnp.min(jnp.where(m > 0, jnp.exp(d), jnp.inf))}
    if ref_logprobs is not None:
        r = ref_logprobs.astype(jnp.float32) - lp  # k3(pi || ref) = exp(ref - lp) - (ref - lp) - 1
        k3 = jnp.exp(jnp.clip(r, -LOG_RATIO_CLIP, LOG_RATIO_CLIP)) - r - 1.0
        per_token = per_token + ref_kl_coef * k3
        stats["ref_kl_sum"] = jnp.sum(m * jax.lax.stop_gradient(k3))
    # tokens outside the mask (weight 0) and dropped rollouts add exactly 0, whatever their terms are
    return jnp.sum(jnp.where(m_loss > 0, weights.astype(jnp.float32) * per_token, 0.0)), stats


def summarise(stats: dict) -> dict:
    """Token sums from `policy_terms` (summed over micro-batches) -> the logged metrics."""
    n = jnp.maximum(stats["loss_tokens"], 1.0)
    out = {"masked_frac_high": stats["masked_high"] / n, "masked_frac_low": stats["masked_low"] / n,
           "mismatch_kl": stats["mismatch_kl_sum"] / n, "ratio_max": stats["ratio_max"],
           "ratio_min": stats["ratio_min"], "loss_tokens": stats["loss_tokens"],
           "is_truncated_frac": stats["is_truncated"] / n, "is_masked_frac": stats["is_masked"] / n,
           "mismatch_dropped": stats["mismatch_dropped"],
           "mismatch_dropped_frac": stats["mismatch_dropped"] / jnp.maximum(stats["rollouts"], 1.0)}
    if "ref_kl_sum" in stats:
        out["ref_kl"] = stats["ref_kl_sum"] / n
    return out


def policy_loss(logprobs, behaviour_logprobs, advantages, loss_mask, *, reduction: str = "rollout",
                weights=None, max_len: int | None = None, **terms):
    """-> (loss, metrics) for a whole batch: arrays [N, T], advantages [N]; `terms` are `policy_terms`'s keywords
    (kind, delta_low, ..., seq_mismatch_max). `weights` (from `loss_weights` over the global batch) override
    `reduction` when this call sees only part of the batch."""
    if weights is None:
        weights = loss_weights(jnp.asarray(loss_mask), reduction, max_len)
    loss, stats = policy_terms(logprobs, behaviour_logprobs, advantages, weights, loss_mask, **terms)
    return loss, summarise(stats)


def loss_options(c) -> dict:
    """A `PolicyLossConfig` -> the keywords of `policy_terms` (one place that names them)."""
    return dict(kind=c.kind, delta_low=c.delta_low, delta_high=c.delta_high, kl_coef=c.kl_coef,
                is_cap=c.is_cap, is_low=c.is_low, is_high=c.is_high, seq_mismatch_max=c.seq_mismatch_max)
