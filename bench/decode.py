"""Cached decode: tokens/s with the decode state vs recomputing the full forward at context 1024, and
per-token decode time at context 256 vs 4096 for a Mamba-only and a mixed config (Mamba-only ~ flat).

    python bench/decode.py
"""

import common
import jax
import jax.numpy as jnp

from nemo_jax.config.model import NemotronHConfig, parse_pattern
from nemo_jax.model import forward, forward_cached, init, init_decode_state


def cfg_for(pattern: str) -> NemotronHConfig:
    return NemotronHConfig(vocab_size=4096, hidden_size=256, layer_kinds=parse_pattern(pattern),
                           num_attention_heads=8, num_key_value_heads=2, head_dim=32, intermediate_size=512,
                           mamba_num_heads=8, mamba_head_dim=32, ssm_state_size=64, n_groups=2, chunk_size=128,
                           n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=256,
                           moe_shared_expert_intermediate_size=256)


def decode_time(cfg, params, ctx: int, batch: int = 4) -> float:
    state = init_decode_state(cfg, batch, ctx + 8)
    toks = jax.random.randint(jax.random.key(1), (batch, ctx), 0, cfg.vocab_size)
    step = jax.jit(lambda p, t, s: forward_cached(p, t, jnp.ones(t.shape, bool), s, cfg))
    _, state = step(params, toks, state)  # prefill
    one = toks[:, :1]
    st = [state]

    def run():
        logits, s = step(params, one, st[0])
        jax.block_until_ready(logits)

    return common.timeit(run, warmup=2, iters=10)


def main():
    rows = []
    mixed = cfg_for("MEM*EM*E")
    params = init(mixed, jax.random.key(0))
    ctx, batch = 1024, 4
    t_cached = decode_time(mixed, params, ctx, batch)
    toks = jax.random.randint(jax.random.key(2), (batch, ctx), 0, mixed.vocab_size)
    full = jax.jit(lambda p, t: forward(p, t, mixed)[0][:, -1])
    t_full = common.timeit(lambda: jax.block_until_ready(full(params, toks)), warmup=1, iters=3)
    rows.append({"what": f"mixed, ctx {ctx}, batch {batch}", "cached tok/s": f"{batch / t_cached:,.0f}",
                 "full re-forward tok/s": f"{batch / t_full:,.1f}", "ratio": f"{t_full / t_cached:.1f}x"})
    common.table(rows)
    rows = []
    for name, pat in (("mamba-only", "MEME-M-M"), ("mixed", "MEM*EM*E")):
        cfg = cfg_for(pat)
        p = init(cfg, jax.random.key(0))
        t256, t4096 = decode_time(cfg, p, 256), decode_time(cfg, p, 4096)
        rows.append({"config": f"{name} ({pat})", "ms/token @256": f"{t256 * 1e3:.2f}",
                     "ms/token @4096": f"{t4096 * 1e3:.2f}", "4096 / 256": f"{t4096 / t256:.2f}x"})
    common.table(rows)


if __name__ == "__main__":
    main()
