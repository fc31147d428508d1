"""Cached decode: tokens/s with the decode state vs recomputing the full forward at context 1024, and
per-token decode time at context 256 vs 4096 for a Mamba-only and a mixed config (Mamba-only ~ flat).
Prefill (lm_head at the last position, cached attention in query blocks) peak temporaries and time vs prompt
length 1k / 4k / 16k against the reference (all logits, whole-chunk attention), and decode tokens/s vs batch
1 / 16 / 64 with the state donated (updated in place).

    python bench/decode.py [--quick]   # --quick: skip the 16k prefill and the reference at 16k
    python bench/decode.py --engine    # only the serving Engine: steps per dispatch vs a dispatch per step
"""

import common
import jax
import jax.numpy as jnp

from nemo_jax.config.model import NemotronHConfig, parse_pattern
import sys

from nemo_jax.generate.decode import _append
from nemo_jax.model import Options, forward, forward_cached, init, init_decode_state
from nemo_jax.model.cache import state_shapes


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


def prefill_rows(cfg, params, lengths) -> list[dict]:
    """Compiled temporaries (+ returned logits) and wall time of a one-row prefill, fast path vs reference."""
    rows = []
    for L in lengths:
        toks = jax.random.randint(jax.random.key(1), (1, L), 0, cfg.vocab_size)
        valid = jnp.ones((1, L), bool)
        out = {"prompt": L}
        for name, pos, impl in (("last+blocked", "last", "blocked"), ("reference", None, "full")):
            if name == "reference" and L > 4096:
                out[f"{name} MiB"] = out[f"{name} s"] = "skipped"
                continue
            f = jax.jit(lambda p, t, v, s, pos=pos, impl=impl: forward_cached(
                p, t, v, s, cfg, opts=Options(attention=impl), positions=pos)[0])
            m = f.lower(params, toks, valid, state_shapes(cfg, 1, L)).compile().memory_analysis()
            out[f"{name} MiB"] = f"{(m.temp_size_in_bytes + m.output_size_in_bytes) / 2**20:,.1f}"
            run = lambda: jax.block_until_ready(f(params, toks, valid, init_decode_state(cfg, 1, L)))
            out[f"{name} s"] = f"{common.timeit(run, warmup=1, iters=2):.2f}"
        rows.append(out)
    return rows


def decode_rows(cfg, params, batches, ctx: int = 512, steps: int = 16) -> list[dict]:
    """Decode tokens/s at `ctx` context vs batch, one token per row per step, the state donated."""
    rows = []
    opts = Options()
    for b in batches:
        toks = jax.random.randint(jax.random.key(2), (b, ctx), 0, cfg.vocab_size)
        _, state = _append(params, toks, jnp.ones((b, ctx), bool), init_decode_state(cfg, b, ctx + 2 * steps + 2),
                           cfg, opts)
        one, on = toks[:, :1], jnp.ones((b, 1), bool)
        c = _append.lower(params, one, on, state, cfg, opts).compile()
        st = [state]

        def run():
            for _ in range(steps // 2):
                logits, st[0] = _append(params, one, on, st[0], cfg, opts)
            jax.block_until_ready(logits)

        t = common.timeit(run, warmup=1, iters=3) / (steps // 2)
        rows.append({"batch": b, "ms/step": f"{t * 1e3:.2f}", "tokens/s": f"{b / t:,.0f}",
                     "state MiB": f"{sum(x.nbytes for x in jax.tree.leaves(st[0])) / 2**20:,.1f}",
                     "aliased MiB": f"{c.memory_analysis().alias_size_in_bytes / 2**20:,.1f}"})
    return rows


def engine_rows(batch: int = 16, steps: int = 8, new: int = 64, waves: int = 3) -> list[dict]:
    """The serving Engine on the tiny model (`tiny.json`, the model `nemo-jax sft` trains): decode tokens/s of
    `batch` rows sampling `new` tokens each (prefill included), `steps` decode steps per dispatch (its fast path)
    vs one dispatch per step (its reference), interleaved, median of `waves` waves after a warm-up wave."""
    import json
    import os
    import time

    import numpy as np

    from nemo_jax.generate import Engine, SamplingParams

    with open(os.path.join(os.path.dirname(common.__file__), "..", "nemo_jax", "assets", "models", "tiny.json")) as f:
        cfg = NemotronHConfig.from_hf_dict(json.load(f))
    params = init(cfg, jax.random.key(0))
    rng = np.random.default_rng(0)
    prompts = [rng.integers(10, cfg.vocab_size, int(n)).tolist() for n in rng.integers(14, 42, batch)]
    sp = SamplingParams(max_new_tokens=new, temperature=1.0)
    engines = {fused: Engine(params, cfg, batch=batch, max_len=2048, check_every=steps, fused=fused)
               for fused in (False, True)}

    def wave(eng) -> float:
        left = {eng.submit(p, sp) for p in prompts}
        t, n0 = time.perf_counter(), eng.tokens_sampled
        while left:
            for end in eng.step():
                left.discard(end.seq_id)
                eng.release(end.seq_id)
        return (eng.tokens_sampled - n0) / (time.perf_counter() - t)

    got = {fused: [] for fused in engines}
    for i in range(waves + 1):
        for fused, eng in engines.items():
            r = wave(eng)
            if i:
                got[fused].append(r)
    med = {k: sorted(v)[len(v) // 2] for k, v in got.items()}
    return [{"engine, tiny model": f"{batch} rows x {new} tokens, 2048 positions",
             "a dispatch per step tok/s": " / ".join(f"{x:,.0f}" for x in got[False]),
             f"{steps} steps per dispatch tok/s": " / ".join(f"{x:,.0f}" for x in got[True]),
             "ratio of medians": f"{med[True] / med[False]:.2f}x"}]


def main():
    if "--engine" in sys.argv:  # the serving Engine's fast path vs its reference only
        common.table(engine_rows())
        return
    quick = "--quick" in sys.argv
    mixed = cfg_for("MEM*EM*E")
    params = init(mixed, jax.random.key(0))
    print("prefill, one row, mixed (MEM*EM*E, D=256, V=4096): temporaries + returned logits, and time")
    common.table(prefill_rows(mixed, params, (1024, 4096) if quick else (1024, 4096, 16384)))
    print("decode, mixed, context 512, state donated")
    common.table(decode_rows(mixed, params, (1, 16, 64)))
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
