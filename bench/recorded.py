"""The device bench's programs as they were when a recorded measurement was taken: the code of the recorded
commit (`git archive`), compiled for a deviceless GPU, each compiled program's HLO text written out for the
current planner to cost. bench/device.py runs this in a subprocess (one process per code tree: the recorded
commit's nemo_jax and bench/device.py are imported in place of the current ones).

    python bench/recorded.py TREE OUT_DIR ROW [ROW ...]     # TREE: the recorded commit's files; rows below

Rows (the recorded bench's own constructors): sft_auto, sft_reference, lora (its Bench.train_step with the
settings of the recorded run: batch 4 x 4096, remat layer, rank 16) and decode (the program its sampler row
timed: generate()'s per-token `_decode_and_sample` at 64 rows, 512 + 256 positions). OUT_DIR/ROW.hlo is the
compiled HLO text; OUT_DIR/ROW.json the program's memory figures.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("tree")
    ap.add_argument("out")
    ap.add_argument("rows", nargs="+")
    ap.add_argument("--device-kind", default="h200")
    ap.add_argument("--cache", help="persistent compilation cache directory (the bench's: a rerun compiles nothing)")
    a = ap.parse_args()
    sys.path[:0] = [a.tree, os.path.join(a.tree, "bench")]
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    from nemo_jax.hostmem import tune_xla_gpu  # the recorded tree's: the flags its GPU run set

    tune_xla_gpu(force=True)
    import device as recorded_bench  # the recorded tree's bench/device.py
    import jax
    import jax.numpy as jnp

    if a.cache:
        jax.config.update("jax_compilation_cache_dir", a.cache)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)

    args = argparse.Namespace(tiny=False, dry_run=True, device_kind=a.device_kind, seq=4096, batch=4, remat="layer",
                              lora_rank=16, rollouts=64, prompt=512, new_tokens=256, jobs=1, warmup=2, iters=5,
                              budget_s=450.0, out=None)
    bench = recorded_bench.Bench(args)
    os.makedirs(a.out, exist_ok=True)
    for row in a.rows:
        t = time.perf_counter()
        if row == "decode":
            lowered = _decode_program(bench, args, jax, jnp)
        else:
            kernels, rank = {"sft_auto": ("auto", 0), "sft_reference": ("reference", 0), "lora": ("auto", 16)}[row]
            held = {}
            bench.figures = lambda compiled: held.setdefault("compiled", compiled) and {}  # noqa: E731
            _, compile_, _ = bench.train_step(row, kernels, rank)
            compile_()
            lowered = None
        compiled = held["compiled"] if lowered is None else lowered.compile()
        mem = compiled.memory_analysis()
        with open(os.path.join(a.out, f"{row}.hlo"), "w") as f:
            f.write(compiled.as_text())
        with open(os.path.join(a.out, f"{row}.json"), "w") as f:
            json.dump({"argument_bytes": mem.argument_size_in_bytes, "temp_bytes": mem.temp_size_in_bytes,
                       "output_bytes": mem.output_size_in_bytes, "alias_bytes": mem.alias_size_in_bytes,
                       "compile_s": time.perf_counter() - t}, f)
        print(f"{row}: compiled in {time.perf_counter() - t:.0f} s", flush=True)


def _decode_program(bench, args, jax, jnp):
    """generate()'s per-token program in the recorded tree (sample the last logits, append the token), lowered
    for the sampler row's shapes: what its decode loop ran once per token."""
    from nemo_jax.generate import decode as G
    from nemo_jax import kernels as kernels_lib
    from nemo_jax.model import Options, init
    from nemo_jax.model.cache import state_shapes

    cfg, rows = bench.cfg, args.rollouts
    width = -(-args.prompt // 32) * 32
    opts = Options(dtype=jnp.bfloat16, kernels=kernels_lib.resolve("auto", bench.mesh))
    sp = G.SamplingParams(max_new_tokens=args.new_tokens, temperature=1.0)
    params = bench.spec(jax.eval_shape(lambda: jax.tree.map(lambda x: x.astype(jnp.bfloat16),
                                                            init(cfg, jax.random.key(0)))))
    state = bench.spec(state_shapes(cfg, rows, width + args.new_tokens, opts.dtype))
    logits, done = bench.spec((jax.ShapeDtypeStruct((rows, cfg.vocab_size), jnp.float32),
                               jax.ShapeDtypeStruct((rows,), jnp.bool_)))
    key = bench.spec(jax.eval_shape(lambda: jax.random.key(1)))
    return G._decode_and_sample.lower(params, logits, state, done, key, cfg=cfg, opts=opts, sp=sp)


if __name__ == "__main__":
    main()
