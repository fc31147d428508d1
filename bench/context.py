"""Context parallelism bench: a long row split over 8 (fake) devices vs the longest row one device can take.

    python bench/context.py                    # 32k tokens, context=8, the tiny bench model
    python bench/context.py --tokens 32768 --context 8 --hidden 64 --attention blocked,ring --iters 3

Prints, for the train step (loss + gradients) of one row: per-device temporaries, FLOPs per device and summed
over devices, the bytes each collective kind moves per device per step (compiled HLO, loops by trip count),
and the measured step time, for each context-parallel attention form (`--attention`: "blocked", K/V
all-gathered; "ring", K/V passed around the ring; "full", the all-gathered reference). "One device" is the longest power-of-two row whose single-device temporaries fit
in what each device of the split run uses (its memory budget), timed the same way; tokens/s compare the two.
On this CPU the 8 devices share the host's cores, so the time ratio shows overheads, not a GPU speed-up.
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import timeit  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402

from nemo_jax.config.model import NemotronHConfig, parse_pattern  # noqa: E402
from nemo_jax.model import Options  # noqa: E402
from nemo_jax.model.spec import init, param_specs  # noqa: E402
from nemo_jax.parallel.mesh import batch_sharding, make_mesh  # noqa: E402
from nemo_jax.parallel.rules import Rules, param_shardings  # noqa: E402
from nemo_jax.plan.hlo import analyse  # noqa: E402
from nemo_jax.train.step import token_loss  # noqa: E402


def bench_cfg(hidden: int) -> NemotronHConfig:
    return NemotronHConfig(vocab_size=512, hidden_size=hidden, layer_kinds=parse_pattern("MEM*E-"),
                           num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=2 * hidden,
                           mamba_num_heads=4, mamba_head_dim=16, ssm_state_size=16, n_groups=2, chunk_size=128,
                           n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=hidden,
                           moe_shared_expert_intermediate_size=hidden)


def step(cfg, params, tokens: int, context: int, attention: str = "blocked"):
    """(compiled grad step, its inputs) of one row of `tokens` on `context` devices."""
    mesh = make_mesh({"fsdp": 1, "context": context}, jax.devices()[:context])
    p = jax.device_put(params, param_shardings(param_specs(cfg), mesh, Rules()))
    rng = np.random.default_rng(0)
    t = rng.integers(0, cfg.vocab_size, (1, tokens)).astype(np.int32)
    batch = jax.device_put({"tokens": t, "targets": np.roll(t, -1, 1), "loss_mask": np.ones((1, tokens), bool),
                            "segment_ids": np.ones((1, tokens), np.int32)}, batch_sharding(mesh))
    f = jax.jit(jax.grad(lambda p, b: token_loss(p, b, cfg, Options(mesh=mesh, attention=attention))[0]))
    return f.lower(p, batch).compile(), (p, batch)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--context", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--attention", default="blocked,ring", help="context-parallel attention forms, comma-separated")
    ap.add_argument("--iters", type=int, default=3, help="timed steps per run (after one warm-up)")
    a = ap.parse_args()
    cfg = bench_cfg(a.hidden)
    params = init(cfg, jax.random.key(0))
    runs = []
    for form in a.attention.split(","):
        split, args = step(cfg, params, a.tokens, a.context, form)
        runs.append((f"{a.tokens} tokens, context={a.context}, attention={form}", a.tokens, a.context, split, args))
    budget = runs[0][3].memory_analysis().temp_size_in_bytes
    n = 256
    while n * 2 <= a.tokens:
        c, _ = step(cfg, params, n * 2, 1)
        if c.memory_analysis().temp_size_in_bytes > budget:
            break
        n *= 2
    one, args1 = step(cfg, params, n, 1)
    runs.append((f"{n} tokens, one device (longest that fits the split run's per-device temporaries)", n, 1, one,
                 args1))
    for name, tokens, c, compiled, _ in runs:
        print(f"{name}: compiled temporaries {compiled.memory_analysis().temp_size_in_bytes / 2**20:,.1f} MiB per device",
              flush=True)
    print("| run | temps / device | FLOPs / device | FLOPs, all devices | collectives / device / step | step s | "
          "tokens/s |\n| --- | --- | --- | --- | --- | --- | --- |")
    for name, tokens, c, compiled, inputs in runs:
        cost = analyse(compiled.as_text(), c)
        coll = ", ".join(f"{k} {v / 2**20:,.1f} MiB" for k, v in sorted(cost.collective_bytes().items())) or "none"
        t = timeit(lambda: jax.block_until_ready(compiled(*inputs)), warmup=1, iters=a.iters)
        print(f"| {name} | {compiled.memory_analysis().temp_size_in_bytes / 2**20:,.1f} MiB | {cost.flops / 1e9:,.2f} G "
              f"| {cost.flops * c / 1e9:,.2f} G | {coll} | {t:.2f} | {tokens / t:,.0f} |")


if __name__ == "__main__":
    main()
