"""Step time of a compiled program: a roofline per kernel (`hlo.kernels`) plus the communication not hidden
behind compute.

    kernel time = max(matmul FLOPs / (peak at its precision x mma), vector FLOPs / vector peak,
                      bytes / (memory bandwidth x hbm), launch)
    step        = sum over kernels (times executions) + exposed collectives (`exposed_collectives`)

`launch` is the least time a kernel occupies the device: a step of many small kernels (a decode step) is bound
by how fast they are issued, not by their work. Pallas kernels (flash attention, grouped matmuls, the SSD scan)
use `pallas` in place of `mma`: they reach a smaller share of the peak than the vendor libraries' tuned GEMMs.

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


# Sources: [nv-gemm] NVIDIA's cuBLAS / Transformer Engine GEMM benchmarks on H100 SXM (large BF16 GEMMs at
# 650-750 of 989 TFLOP/s: 0.66-0.76); [hopper-ubench] Luo et al., "Benchmarking and Dissecting the Nvidia Hopper
# GPU Architecture" (IPDPS 2024): ~90% of HBM3 bandwidth in streaming kernels; [launch] CUDA kernel launch
# latency without CUDA graphs (XLA's thunk runtime, `--xla_gpu_enable_command_buffer=` as nemo_jax sets it):
# ~4-6 us per kernel issued back to back (NVIDIA CUDA Programming Guide, "CUDA Graphs" motivation; PyTorch and
# XLA dispatch measurements); [fit] the two recorded H200 SFT rows of the device bench (docs/performance.md:
# 0.347 s with the GPU kernels, 0.565 s with the reference), fitted by bench/device.py --fit: the Pallas share
# only. TPU: [tpu-docs] Google Cloud TPU performance guide (MXU utilisation of large matmuls ~0.6-0.8, HBM
# streaming ~0.85-0.9); Pallas on TPU as on GPU (not measured).
ACHIEVABLE = {
    "h100": Achievable(mma=0.70, pallas=0.35, hbm=0.90, launch_s=5e-6, source="[nv-gemm] [hopper-ubench] [launch] [fit]"),
    "h200": Achievable(mma=0.70, pallas=0.35, hbm=0.90, launch_s=5e-6, source="as h100 (same GH100 chip) [fit]"),
    "b200": Achievable(mma=0.70, pallas=0.35, hbm=0.90, launch_s=5e-6, source="as h100 (not measured)"),
    "tpu-v5p": Achievable(mma=0.70, pallas=0.35, hbm=0.85, launch_s=2e-6, source="[tpu-docs]"),
    "tpu-v5e": Achievable(mma=0.70, pallas=0.35, hbm=0.85, launch_s=2e-6, source="[tpu-docs]"),
    "tpu-v6e": Achievable(mma=0.70, pallas=0.35, hbm=0.85, launch_s=2e-6, source="[tpu-docs]"),
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
    """The value of one share of `a` (`field`: "mma" or "pallas") at which `kernels_time` of a step equals its
    measured seconds (bisection: the time falls as the share grows); clipped to [lo, hi]."""
    from dataclasses import replace

    for _ in range(60):
        mid = (lo + hi) / 2
        if kernels_time(kernels, kind, replace(a, **{field: mid}))["total"] > measured_s:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2
