"""Step time of a compiled program: a roofline per kernel (`hlo.kernels`) plus the communication not hidden
behind compute.

    kernel time = max(matmul FLOPs / (peak at its precision x mma), vector FLOPs / vector peak,
                      bytes / (memory bandwidth x hbm), launch)
    step        = sum over kernels (times executions) + exposed collectives (`exposed_collectives`)

`launch` is the least time a kernel occupies the device: a step of many small kernels (a decode step) is bound
by how fast they are issued, not by their work. Pallas kernels (flash attention, grouped matmuls, the SSD scan)
use `pallas` in place of `mma`: they reach a smaller share of the peak than the vendor libraries' tuned GEMMs.
Vector FLOPs (elementwise, reductions) run at the device's fp32 vector peak.

ACHIEVABLE is the one table of what each device kind reaches of its datasheet peaks (`DeviceKind`), with where
each number comes from. No figure depends on the program or the config: a plan's step time is this table applied
to the compiled program's own kernels.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Achievable:
    mma: float  # share of the dense matrix-unit peak a library GEMM (cuBLAS, XLA's own dots) sustains
    pallas: float  # the share a Pallas kernel (Triton on GPU, Mosaic on TPU) sustains
    hbm: float  # share of the memory bandwidth a streaming kernel sustains
    launch_s: float  # least device time per kernel (issue + launch + tail), seconds
    source: str = ""


# Sources. [cutlass] CUTLASS's published H100 benchmarks (docs "Performance / Benchmarks": BF16 tensor-core GEMMs
# of 4096^3 at ~70% of peak, 8192^3 at ~75%): `mma`. [hbm-blog] "GPU Memory Bandwidth: What Your Profiler Isn't
# Telling You" (mikamirai.com, 2026; Nsight Compute on H100 SXM: coalesced loads at 2.8 of 3.35 TB/s, 84%): `hbm`.
# [cuda-graphs] NVIDIA Technical Blog, "Getting Started with CUDA Graphs" (short kernels issued back to back on a
# stream take ~4 us each, launch included; nemo_jax runs XLA:GPU without CUDA graphs,
# `--xla_gpu_enable_command_buffer=`): `launch_s`. [fit] `pallas` is the one fitted entry: the recorded H200 SFT
# row with the GPU kernels (docs/performance.md, "Device bench": 0.347 s), its program recompiled from the measured
# commit (`python bench/device.py --dry-run --fit`). The recorded reference SFT, LoRA and decode rows are then
# predictions (docs/planning.md: within 25%). H100 and B200 share the H200's entries (same software stack, not
# measured). TPU: XLA runs a TPU program as one executable (no per-kernel host launch): 1 us per op is an
# estimate; the shares are the GPUs' (not measured on TPU).
ACHIEVABLE = {
    "h200": Achievable(mma=0.70, pallas=0.206, hbm=0.84, launch_s=4e-6, source="[cutlass] [hbm-blog] [cuda-graphs] [fit]"),
    "h100": Achievable(mma=0.70, pallas=0.206, hbm=0.84, launch_s=4e-6, source="as h200 (same GH100 chip)"),
    "b200": Achievable(mma=0.70, pallas=0.206, hbm=0.84, launch_s=4e-6, source="as h200 (not measured)"),
    "tpu-v5p": Achievable(mma=0.70, pallas=0.206, hbm=0.84, launch_s=1e-6, source="as h200; launch estimated"),
    "tpu-v5e": Achievable(mma=0.70, pallas=0.206, hbm=0.84, launch_s=1e-6, source="as h200; launch estimated"),
    "tpu-v6e": Achievable(mma=0.70, pallas=0.206, hbm=0.84, launch_s=1e-6, source="as h200; launch estimated"),
}
# matrix-unit rate of each operand precision, as a share of the dense bf16 peak (H100 / H200 datasheets: TF32
# tensor cores at half the BF16 rate; fp32 at HIGHEST precision runs on the vector units, `DeviceKind.vector`)
PRECISION_RATE = {"bf16": 1.0, "tf32": 0.5}


def kernel_time(k, kind, a: Achievable) -> float:
    """Seconds of one execution of kernel k (`hlo.Kernel`) on device kind `kind` (`plan.DeviceKind`)."""
    share = a.pallas if k.kind == "pallas" else a.mma
    rate = kind.vector if k.precision == "f32" else kind.peak * PRECISION_RATE[k.precision] * share
    compute = k.matmul_flops / rate + k.vector_flops / kind.vector
    return max(compute, k.bytes / (kind.hbm * a.hbm), a.launch_s)


def kernels_time(kernels, kind, a: Achievable | None = None) -> dict:
    """-> {"total": seconds of every kernel of a step, "by_kind": {kernel kind: seconds}, "bound": {"compute" |
    "memory" | "launch": seconds}}."""
    a = a or ACHIEVABLE[kind.key]
    by_kind: dict[str, float] = {}
    bound = {"compute": 0.0, "memory": 0.0, "launch": 0.0}
    for k in kernels:
        t = kernel_time(k, kind, a) * k.count
        by_kind[k.kind] = by_kind.get(k.kind, 0.0) + t
        share = a.pallas if k.kind == "pallas" else a.mma
        rate = kind.vector if k.precision == "f32" else kind.peak * PRECISION_RATE[k.precision] * share
        parts = {"compute": k.matmul_flops / rate + k.vector_flops / kind.vector,
                 "memory": k.bytes / (kind.hbm * a.hbm), "launch": a.launch_s}
        bound[max(parts, key=parts.get)] += t
    return {"total": sum(by_kind.values()), "by_kind": by_kind, "bound": bound}


def fit_share(kernels, kind, a: Achievable, field: str, measured_s: float, lo: float = 0.02,
              hi: float = 1.0) -> float:
    """The value in [lo, hi] of one entry of `a` (`field`: "mma", "pallas", "hbm" or "launch_s") at which
    `kernels_time` of a step equals its measured seconds (bisection: the time is monotonic in each entry);
    clipped to [lo, hi]."""
    from dataclasses import replace

    total = lambda v: kernels_time(kernels, kind, replace(a, **{field: v}))["total"]  # noqa: E731
    rising = total(hi) > total(lo)
    for _ in range(60):
        mid = (lo + hi) / 2
        if (total(mid) > measured_s) == rising:
            hi = mid
        else:
            lo = mid
    return (lo + hi) / 2
