"""The train-step bench's model, one piece at a time: forward+backward of one layer of each kind, the lm_head with
its cross-entropy, and the AdamW update, ours (jitted) vs transformers on torch (CPU), timed interleaved in one
process (the VM's speed drifts by 20%+ between runs), median of --iters.

    python bench/layers.py [--seq 1024 --iters 9]

The `x n` column is how many of each the bench step holds: where `bench/train_step.py`'s gap comes from.
"""

import argparse
import time

import common
import jax
import jax.numpy as jnp
import numpy as np
import optax

from nemo_jax.model import Options, init
from nemo_jax.model.layers import chunked_cross_entropy
from nemo_jax.model.model import _Ctx, apply_layer

from train_step import bench_config, hf_model


# pause after each timed call: torch's OpenMP threads keep spinning for a while after its ops and, on a small
# machine, slow down whatever runs next (ours ran 1.2-1.45x slower right after a torch piece without it)
SETTLE_S = 0.2
KINDS = ("mamba", "moe", "attention", "mlp")  # one layer of each kind, timed alone


def adamw_update(tx):
    """The AdamW step as the train step runs it: params and state donated (updated in place)."""
    def update(p, o, g):
        u, o = tx.update(g, o, p)
        return optax.apply_updates(p, u), o

    return jax.jit(update, donate_argnums=(0, 1))


def ours(cfg, params, T: int) -> dict:
    """{piece: zero-argument callable that runs it once and blocks}."""
    h = jnp.asarray(np.random.default_rng(0).standard_normal((1, T, cfg.hidden_size)), jnp.float32)
    ctx = _Ctx(cfg, Options(), segment_ids=jnp.ones((1, T), jnp.int32))
    out = {}
    for kind in KINDS:
        p = jax.tree.map(lambda a: a[0], params["layers"][kind])
        f = jax.jit(jax.value_and_grad(lambda p, h, kind=kind: jnp.sum(apply_layer(kind, p, h, ctx)[0] * h),
                                       argnums=(0, 1)))
        out[kind] = lambda f=f, p=p: jax.block_until_ready(f(p, h))
    tgt = jnp.asarray(np.random.default_rng(1).integers(0, cfg.vocab_size, (1, T)), jnp.int32)
    head = jax.jit(jax.value_and_grad(lambda w, h: jnp.mean(chunked_cross_entropy(h, {"kernel": w}, tgt)),
                                      argnums=(0, 1)))
    out["lm_head + CE"] = lambda: jax.block_until_ready(head(params["lm_head"]["kernel"], h))
    tx = optax.adamw(1e-4)
    grads = jax.tree.map(jnp.ones_like, params)
    update = adamw_update(tx)
    state = [jax.tree.map(jnp.copy, params), tx.init(params)]

    def adamw():
        state[0], state[1] = update(state[0], state[1], grads)
        jax.block_until_ready(state[0])

    out["AdamW"] = adamw
    return out


def theirs(cfg, T: int) -> dict:
    import torch

    m = hf_model(cfg)
    h = torch.tensor(np.random.default_rng(0).standard_normal((1, T, cfg.hidden_size)), dtype=torch.float32,
                     requires_grad=True)
    out = {}
    for kind in KINDS:
        i = cfg.layer_kinds.index(kind)
        block = m.model.layers[i]

        def run(block=block):
            y = block(h)
            (y[0] if isinstance(y, tuple) else y).mul(h).sum().backward()
            block.zero_grad()
            h.grad = None

        out[kind] = run
    tgt = torch.tensor(np.random.default_rng(1).integers(0, cfg.vocab_size, (T,)), dtype=torch.long)

    def head():
        torch.nn.functional.cross_entropy(m.lm_head(h).reshape(T, -1), tgt).backward()
        m.lm_head.zero_grad()
        h.grad = None

    out["lm_head + CE"] = head
    opt = torch.optim.AdamW(m.parameters(), lr=1e-4)
    for q in m.parameters():
        q.grad = torch.ones_like(q)
    out["AdamW"] = opt.step
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--iters", type=int, default=9)
    a = ap.parse_args()
    cfg = bench_config()
    params = init(cfg, jax.random.key(0))
    sides = {"ours": ours(cfg, params, a.seq), "transformers": theirs(cfg, a.seq)}
    names = list(sides["ours"])
    for side in sides.values():  # compile / warm up
        for fn in side.values():
            fn(), fn()
    times = {(s, n): [] for s in sides for n in names}
    for _ in range(a.iters):
        for n in names:
            for s, side in sides.items():
                t0 = time.perf_counter()
                side[n]()
                times[(s, n)].append(time.perf_counter() - t0)
                time.sleep(SETTLE_S)
    count = {k: cfg.layer_kinds.count(k) for k in KINDS}
    rows, tot = [], {s: 0.0 for s in sides}
    for n in names:
        med = {s: float(np.median(times[(s, n)])) for s in sides}
        x = count.get(n, 1)
        for s in sides:
            tot[s] += x * med[s]
        rows.append({"piece (fwd+bwd)": n, "x n": x, "ours ms": f"{med['ours'] * 1e3:.1f}",
                     "transformers ms": f"{med['transformers'] * 1e3:.1f}",
                     "ours / transformers speed": f"{med['transformers'] / med['ours']:.2f}x"})
    rows.append({"piece (fwd+bwd)": "sum x n", "x n": "", "ours ms": f"{tot['ours'] * 1e3:.0f}",
                 "transformers ms": f"{tot['transformers'] * 1e3:.0f}",
                 "ours / transformers speed": f"{tot['transformers'] / tot['ours']:.2f}x"})
    print(f"pieces of the train-step bench model, 1 x {a.seq} tokens, fp32, {jax.devices()[0].device_kind}; "
          f"median of {a.iters}, interleaved; XLA:CPU library fusions for matmuls only: {common.XLA_CPU_TUNED}")
    common.table(rows)


if __name__ == "__main__":
    main()
