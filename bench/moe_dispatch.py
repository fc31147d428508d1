"""Our MoE dispatch (sorted, dropless) vs the dense all-experts reference: forward+backward time, compiled
temp memory, and HLO FLOPs / useful expert FLOPs, at (E, k) = (16, 2), (64, 6), (512, 22).
    python bench/moe_dispatch.py [--tokens 2048 --hidden 256 --inter 128 --dispatches sorted,dense]
`sorted-reference` is the sorted dispatch's loop-free reference (every block, padding included), the form
the fast path's block loop replaced; HLO FLOPs count loops by trip count and a `cond` as its dearer branch, so
the loop's figure is its upper bound (it skips the padding steps at run time).
"""

import argparse

import common  # noqa: F401
import jax
import jax.numpy as jnp

from nemo_jax.config.model import NemotronHConfig
from nemo_jax.model import moe as moe_lib
from nemo_jax.model.spec import mixer_specs


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--inter", type=int, default=128)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--dispatches", default="sorted,dense")
    a = ap.parse_args()
    T, D, I = a.tokens, a.hidden, a.inter
    rows = []
    for E, k in ((16, 2), (64, 6), (512, 22)):
        cfg = NemotronHConfig(vocab_size=8, hidden_size=D, layer_kinds=("moe",), n_routed_experts=E,
                              num_experts_per_tok=k, moe_intermediate_size=I, n_shared_experts=0)
        specs = mixer_specs(cfg, "moe")
        leaves, tree = jax.tree.flatten(specs, is_leaf=lambda s: hasattr(s, "init"))
        keys = jax.random.split(jax.random.key(0), len(leaves))
        p = jax.tree.unflatten(tree, [s.init(kk, s.shape, s.dtype) for s, kk in zip(leaves, keys)])
        x = jax.random.normal(jax.random.key(1), (T, D))
        w, idx, _ = moe_lib.route(p["gate"], x, cfg)
        useful = 3 * 2 * 2 * T * k * D * I  # fwd + bwd (3x), two matmuls
        base = None
        for d in a.dispatches.split(","):
            f = jax.jit(jax.value_and_grad(
                lambda pe, x, w, idx, d=d: jnp.sum(moe_lib.experts_forward(
                    pe, x, w, idx, cfg, jnp.float32, d.removesuffix("-reference"), unroll=d.endswith("-reference"))[0] ** 2)))
            st = common.compiled_stats(f, p["experts"], x, w, idx)
            t = common.timeit(lambda: jax.block_until_ready(f(p["experts"], x, w, idx)), iters=a.iters)
            base = base or t
            rows.append({"E,k": f"{E},{k}", "dispatch": d, "fwd+bwd ms": f"{t * 1e3:.1f}",
                         "vs first": f"{t / base:.2f}x", "temp": common.mib(st["temp_bytes"]),
                         "HLO/useful FLOPs": f"{st['flops'] / useful:.2f}" if st["flops"] else "n/a"})
    print(f"MoE experts fwd+bwd, T={T} tokens, D={D}, I={I}, fp32, {jax.devices()[0].device_kind}")
    common.table(rows)


if __name__ == "__main__":
    main()
