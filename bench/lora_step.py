"""Full SFT vs LoRA SFT (rank 16, every target kind) on the train-step bench config, side by side in one run:
step time and compiled memory per step (arguments + temporaries, from XLA's memory analysis).

    python bench/lora_step.py [--seq 1024 --batch 1 --rank 16 --remat none,layer --warmup 2 --iters 5]

Both use the trainer's own step (`nemo_jax.train.step.make_train_step`: forward, backward, clipping, AdamW with
the decay mask); LoRA differentiates only the adapters (the base is a frozen argument, held in fp32 or in
bf16 as `lora.base_dtype` allows; full SFT keeps fp32 master weights) and keeps optimiser state only for them. Goal: LoRA memory <= 0.5x and time <= 0.8x of full SFT.
"""

import argparse

import common
import jax
import jax.numpy as jnp
import numpy as np
from train_step import bench_config, timed

from nemo_jax.config.train import OptimSection
from nemo_jax.lora import LoraConfig, attach, init_adapters
from nemo_jax.model import Options, count_params, init
from nemo_jax.train.optimizer import make_optimizer
from nemo_jax.train.step import TrainState, make_train_step


def compiled(step, state, batch, frozen):
    c = jax.jit(step, donate_argnums=0).lower(state, batch, frozen).compile()
    m = c.memory_analysis()
    return c, {"args": m.argument_size_in_bytes, "temp": m.temp_size_in_bytes,
               "total": m.argument_size_in_bytes + m.temp_size_in_bytes}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--remat", default="none,layer",
                    help="remat policies to compare under (comma-separated): none | layer | save_matmuls")
    a = ap.parse_args()
    cfg = bench_config()
    B, T = a.batch, a.seq
    o = OptimSection(lr=1e-4, bias_update_rate=0.0)
    rng = np.random.default_rng(0)
    toks = rng.integers(0, cfg.vocab_size, (B, T + 1)).astype(np.int32)
    batch = {"tokens": jnp.asarray(toks[:, :-1]), "targets": jnp.asarray(toks[:, 1:]),
             "loss_mask": jnp.ones((B, T), bool), "segment_ids": jnp.ones((B, T), jnp.int32)}
    params = init(cfg, jax.random.key(0))
    base_bf16 = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)
    lcfg = LoraConfig(targets=("all",), rank=a.rank, alpha=2.0 * a.rank)
    adapters = init_adapters(cfg, lcfg)
    z = lambda: jnp.zeros((), jnp.int32)  # noqa: E731
    rows, ratios = [], []
    for remat in a.remat.split(","):
        results = {}
        for name, trainable, frozen, combine in (
                ("full SFT", jax.tree.map(jnp.copy, params), None, None),  # donated: keep `params` for LoRA
                (f"LoRA r{a.rank} (all targets), fp32 base", jax.tree.map(jnp.copy, adapters), params,
                 lambda ad, base: attach(base, ad)),
                (f"LoRA r{a.rank} (all targets), bf16 base", jax.tree.map(jnp.copy, adapters), base_bf16,
                 lambda ad, base: attach(base, ad))):
            tx, sched = make_optimizer(o, trainable, 100)
            state = TrainState(trainable, tx.init(trainable), z(), z(), z(), jax.random.key_data(jax.random.key(1)))
            step = make_train_step(cfg, Options(remat=remat), tx, sched, o, 1, combine)
            fn, mem = compiled(step, state, batch, frozen)
            holder = [state]

            def run(fn=fn, holder=holder, frozen=frozen):
                s, m = fn(holder[0], batch, frozen)
                jax.block_until_ready(m["loss"])
                holder[0] = s

            t, _ = timed(run, a.warmup, a.iters)
            n_train = sum(x.size for x in jax.tree.leaves(trainable))
            results[name] = (t, mem)
            rows.append({"remat": remat, "run": name, "trained params": f"{n_train / 1e6:.2f} M",
                         "step s": f"{t:.3f}", "args": common.mib(mem["args"]), "temps": common.mib(mem["temp"]),
                         "args + temps": common.mib(mem["total"])})
        (tf, mf), *_ = results.values()
        ratios += [f"remat {remat}, {name} / full: time {tl / tf:.2f}x (goal <= 0.8x), memory "
                   f"{ml['total'] / mf['total']:.2f}x (goal <= 0.5x)" for name, (tl, ml) in list(results.items())[1:]]
    print(f"train step, {count_params(cfg) / 1e6:.1f}M params, pattern {cfg.pattern}, batch {B} x seq {T}, fp32, "
          f"{jax.devices()[0].device_kind}")
    common.table(rows)
    print("\n".join(ratios))


if __name__ == "__main__":
    main()
