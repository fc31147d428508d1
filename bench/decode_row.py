"""The device bench's engine decode row (bench/device.py calls `engine_decode_row(bench)`): the Engine's decode
dispatch (`nemo_jax.generate.decode_program`: --check-every steps per program, stops checked on the device, the
layers' weights and the decode state held one layer at a time) for --rollouts rows of --prompt + --new-tokens
positions. Its compiled program's memory traffic per decode step (`nemo_jax.plan.traffic`: loops counted, the
kernels' and GEMMs' operands, gathers and in-place scatters at the bytes they touch) against the bytes of the
parameters plus the decode state (the floor: every weight and the whole state read once), and the HBM-bound step
time (traffic / the device's bandwidth) next to the measured step time.

Imports nothing beyond what device.py imports (no bench/common: it sets XLA:CPU flags).
"""

from __future__ import annotations

import re
import time

GOAL = 1.5  # traffic per step <= 1.5 x (parameters + decode state) (issue 57, item 3)


def hbm_bandwidth(device_kind: str) -> float | None:
    """Bytes/s of a GPU kind's memory, from its target spec (nemo_jax/plan/gpu_specs): "NVIDIA H200" or "h200"."""
    from nemo_jax.plan.targets import GPU_SPECS, gpu_spec

    kind = next((k for k in GPU_SPECS if k in device_kind.lower()), None)
    if kind is None:
        return None
    m = re.search(r"memory_bandwidth:\s*(\d+)", gpu_spec(kind))
    return float(m.group(1)) if m else None


def engine_decode_row(bench, steps: int = 8):
    """-> (row, compile(), run()) for device.py's table. The row: bytes_per_step, param_bytes, state_bytes,
    bytes_ratio (traffic / (params + state)), hbm_bound_s (traffic at the device's bandwidth), and after a run on a
    device step_s (median seconds per decode step inside the Engine's dispatches) and tokens_per_s."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import SingleDeviceSharding

    from nemo_jax import generate as G
    from nemo_jax import kernels as kernels_lib
    from nemo_jax.model import Options, init
    from nemo_jax.plan.traffic import traffic
    from nemo_jax.train.metrics import model_flops_per_token

    cfg, a = bench.cfg, bench.a
    opts = Options(dtype=jnp.bfloat16, kernels=kernels_lib.resolve("auto", bench.mesh))
    rows, prompt, new = a.rollouts, a.prompt, a.new_tokens
    width = -(-prompt // 32) * 32
    new_params = lambda: jax.tree.map(lambda x: x.astype(jnp.bfloat16), init(cfg, jax.random.key(0)))  # noqa: E731
    sh = SingleDeviceSharding(bench.device)
    place = lambda t: jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh), t)  # noqa: E731
    lowered, sizes = G.decode_program(jax.eval_shape(new_params), cfg, rows=rows, max_len=width + new, steps=steps,
                                      opts=opts, place=place)
    row = {"row": f"engine decode (batch {rows}, {steps} steps/dispatch)", "kernels": opts.kernels,
           "tokens_per_step": rows, "model_flops": model_flops_per_token(cfg, width + new) / 3 * rows,
           "param_bytes": sizes["params"], "state_bytes": sizes["state"]}
    held = {}

    def compile_():
        t = time.perf_counter()
        compiled = lowered.compile()
        row.update(bench.figures(compiled))
        row["hlo_flops"] /= steps  # (the program runs `steps` decode steps)
        per_step = traffic(compiled.as_text(), unknown_trips=steps).bytes / steps
        bw = hbm_bandwidth(bench.device.device_kind) or hbm_bandwidth(getattr(a, "device_kind", ""))
        row.update(bytes_per_step=per_step, traffic_gib_per_step=per_step / 2 ** 30,
                   bytes_ratio=per_step / (sizes["params"] + sizes["state"]),
                   hbm_bound_s=per_step / bw if bw else None)
        if not a.dry_run:
            held["params"] = jax.device_put(new_params(), bench.device)
        row["compile_s"] = time.perf_counter() - t

    def run():
        rng = np.random.default_rng(0)
        prompts = [rng.integers(3, cfg.vocab_size, int(n)).tolist() for n in rng.integers(prompt // 2, prompt + 1, rows)]
        eng = G.Engine(held.pop("params"), cfg, batch=rows, max_len=width + new, opts=opts, check_every=steps)
        sp = G.SamplingParams(max_new_tokens=new, temperature=1.0)

        def turn():
            left = {eng.submit(p, sp) for p in prompts}
            eng.step()  # the prefill and the first dispatch (compiles the first time)
            t, steps0, tokens0 = time.perf_counter(), eng.decode_steps, eng.tokens_sampled
            while left:
                for end in eng.step():
                    left.discard(end.seq_id)
                    eng.release(end.seq_id)
            s = time.perf_counter() - t
            return s / max(eng.decode_steps - steps0, 1), (eng.tokens_sampled - tokens0) / s

        turn()  # warm-up
        got = sorted(turn() for _ in range(3))
        row.update(step_s=got[1][0], tokens_per_s=got[1][1], peak_gib=bench.memory())

    return row, compile_, run
