"""Our jitted train step (forward, backward, AdamW) vs the same step in transformers on torch (CPU),
same config, batch and sequence length, on a ~50M-parameter config with all four layer kinds.
Prints tokens/s of each, the ratio, and our model FLOP/s as a share of this machine's fp32 matmul peak
measured in the same run (a 2048^3 matmul).

    python bench/train_step.py [--seq 1024 --batch 1 --warmup 5 --iters 5]

Both sides run in this one process with the allocator and XLA:CPU settings of `nemo_jax.hostmem` (as the
`nemo-jax` command uses them); `NEMO_JAX_SYSTEM_MALLOC=1` measures without the allocator settings, and an
`XLA_FLAGS` that sets `--xla_cpu_experimental_ynn_fusion_type` itself without ours (it is only added when the
fusion type is unset). Each side is warmed up (the first steps grow the heap) and the median step is reported.
"""

import argparse
import functools
import resource
import time

import common
import jax
import jax.numpy as jnp
import numpy as np
import optax

from nemo_jax.config.model import NemotronHConfig, parse_pattern
from nemo_jax.model import Options, count_params, init
from nemo_jax.train.metrics import model_flops_per_token
from nemo_jax.train.step import token_loss


def bench_config() -> NemotronHConfig:
    return NemotronHConfig(vocab_size=16384, hidden_size=512, layer_kinds=parse_pattern("MEM*E-" * 2),
                           num_attention_heads=8, num_key_value_heads=2, head_dim=64, intermediate_size=2048,
                           mamba_num_heads=16, mamba_head_dim=64, ssm_state_size=64, n_groups=2, chunk_size=128,
                           n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=1024,
                           moe_shared_expert_intermediate_size=1024, routed_scaling_factor=1.0)


def build(cfg: NemotronHConfig, B: int, T: int):
    """The jitted AdamW train step on random tokens -> (step(params, opt, batch) -> (params, opt, loss), params,
    opt state, batch, the tokens [B, T+1] as numpy)."""
    params = init(cfg, jax.random.key(0))
    tx = optax.adamw(1e-4)
    opt = tx.init(params)
    toks = np.random.default_rng(0).integers(0, cfg.vocab_size, (B, T + 1)).astype(np.int32)
    batch = {"tokens": jnp.asarray(toks[:, :-1]), "targets": jnp.asarray(toks[:, 1:]),
             "loss_mask": jnp.ones((B, T), bool), "segment_ids": jnp.ones((B, T), jnp.int32)}
    opts = Options()

    @functools.partial(jax.jit, donate_argnums=(0, 1))  # as the SFT step donates its state
    def step(p, o, b):
        (loss, _), g = jax.value_and_grad(lambda p: token_loss(p, b, cfg, opts), has_aux=True)(p)
        u, o = tx.update(g, o, p)
        return optax.apply_updates(p, u), o, loss

    return step, params, opt, batch, toks


def hf_model(cfg: NemotronHConfig):
    """The same config as a transformers NemotronHForCausalLM (random weights), in train mode."""
    import transformers

    d = {k: v for k, v in cfg.to_hf_dict().items() if k not in ("architectures", "model_type")}
    d["time_step_limit"] = tuple(cfg.time_step_limit)
    return transformers.NemotronHForCausalLM(transformers.NemotronHConfig(**d)).train()


def timed(fn, warmup: int, iters: int) -> tuple[float, float]:
    """(median seconds per step, minor page faults per timed step) after `warmup` untimed steps."""
    for _ in range(warmup):
        fn()
    r0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    t = common.timeit(fn, warmup=0, iters=iters)
    return t, (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - r0) / iters


def matmul_peak() -> float:
    a = jnp.ones((2048, 2048), jnp.float32)
    f = jax.jit(lambda x, y: x @ y)
    run = lambda: f(a, a).block_until_ready()
    run(), run()
    return 2 * 2048 ** 3 / min(common.timeit(run, warmup=0, iters=1) for _ in range(9))  # a peak: the best run


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--no-torch", action="store_true")
    a = ap.parse_args()
    cfg = bench_config()
    B, T = a.batch, a.seq
    step, params, opt, batch, toks = build(cfg, B, T)
    t0 = time.perf_counter()
    params, opt, _ = step(params, opt, batch)
    jax.block_until_ready(params)
    compile_s = time.perf_counter() - t0
    state = [params, opt]

    def run():
        p, o, l = step(state[0], state[1], batch)
        jax.block_until_ready(l)
        state[0], state[1] = p, o

    t_ours, faults = timed(run, a.warmup, a.iters)
    peak = matmul_peak()
    flops = model_flops_per_token(cfg, T) * B * T / t_ours
    rows = [{"impl": "nemo_jax (jax, jit)", "step s": f"{t_ours:.3f}", "tokens/s": f"{B * T / t_ours:,.0f}",
             "model FLOP/s": f"{flops / 1e9:.1f} G", "of fp32 peak": f"{flops / peak:.1%}",
             "page faults/step": f"{faults:,.0f}"}]
    ratio = "n/a"
    if not a.no_torch:
        try:
            import torch

            m = hf_model(cfg)
            topt = torch.optim.AdamW(m.parameters(), lr=1e-4)
            tt = torch.tensor(toks[:, :-1], dtype=torch.long)
            tl = torch.tensor(toks[:, 1:], dtype=torch.long)

            def trun():
                out = m(tt)
                loss = torch.nn.functional.cross_entropy(out.logits.reshape(-1, cfg.vocab_size), tl.reshape(-1))
                loss.backward()
                topt.step()
                topt.zero_grad()

            t_torch, tfaults = timed(trun, a.warmup, a.iters)
            tflops = model_flops_per_token(cfg, T) * B * T / t_torch
            rows.append({"impl": "transformers (torch eager)", "step s": f"{t_torch:.3f}",
                         "tokens/s": f"{B * T / t_torch:,.0f}", "model FLOP/s": f"{tflops / 1e9:.1f} G",
                         "of fp32 peak": f"{tflops / peak:.1%}", "page faults/step": f"{tfaults:,.0f}"})
            ratio = f"{t_torch / t_ours:.2f}x"
        except ImportError:
            ratio = "n/a (torch/transformers not installed)"
    print(f"train step, {count_params(cfg) / 1e6:.1f}M params, pattern {cfg.pattern}, batch {B} x seq {T}, fp32, "
          f"{jax.devices()[0].device_kind}; fp32 matmul peak (2048^3): {peak / 1e9:.1f} GFLOP/s; "
          f"our compile: {compile_s:.1f} s; host malloc keeps freed memory: {common.HOST_MALLOC_KEEPS_FREED}; "
          f"XLA:CPU library fusions for matmuls only: {common.XLA_CPU_TUNED}")
    common.table(rows)
    print(f"ours / transformers tokens/s: {ratio}  (goal >= 1.5x and >= 75% of peak)")


if __name__ == "__main__":
    main()
