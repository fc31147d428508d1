"""Accelerator kernels and the one place that picks them.

`model.kernels` (config) / `Options.kernels`: "auto" runs the kernels of the platform the program is compiled
for (the mesh's devices', so a deviceless GPU or TPU compile on a CPU host gets that target's kernels; without
a mesh `jax.default_backend()`), and on CPU the reference (plain jnp that XLA lowers: `nemo_jax.model`);
"reference" always runs the reference. "gpu" / "tpu" force a platform's kernels (tests and benches; with
`interpret` the Pallas kernels run in interpret mode, so CPU tests check them against the reference).

`Selection.impl(op, ...)` below is the one dispatch table: which implementation runs each op per platform.

    op                 gpu                                        tpu
    attention          cuDNN flash (bf16/fp16, no segment ids)    splash (segment ids, GQA)
                       else Pallas flash (Triton)
    context_attention  Pallas flash (Triton)                      reference
    cached_attention   Pallas flash (Triton)                      reference
    experts            Pallas grouped matmul (Triton)             megablox gmm
    ssd                Pallas chunked SSD scan (Triton)           Pallas chunked SSD scan (Mosaic)
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

from nemo_jax.config.train import MODEL_KERNELS as KERNELS  # the config key's values
PLATFORMS = ("reference", "gpu", "tpu")  # what a selection resolves to (and what Options may force)
OPS = ("attention", "context_attention", "cached_attention", "experts", "ssd")


def platform_of(mesh=None) -> str:
    """"gpu", "tpu" or "cpu": the platform of the mesh's devices (compile-only topology devices included), else
    of jax's default backend."""
    if mesh is not None:
        p = mesh.devices.flat[0].platform
    else:
        p = jax.default_backend()
    return {"cuda": "gpu", "rocm": "gpu", "gpu": "gpu", "tpu": "tpu"}.get(p, "cpu")


def resolve(kernels: str, mesh=None) -> str:
    """model.kernels / Options.kernels -> the platform whose kernels run: "reference", "gpu" or "tpu"."""
    if kernels == "auto":
        p = platform_of(mesh)
        return p if p in PLATFORMS else "reference"
    if kernels in PLATFORMS:
        return kernels
    raise ValueError(f"kernels: {kernels!r} (expected one of {', '.join(KERNELS + PLATFORMS[1:])})")


@dataclass(frozen=True)
class Selection:
    """The kernels one forward runs (`select`)."""

    platform: str = "reference"  # "reference" | "gpu" | "tpu"
    interpret: bool = False  # Pallas kernels in interpret mode (CPU tests of a forced platform)

    def impl(self, op: str, *, dtype=None, segments: bool = True, head_dim: int = 0) -> str:
        """The implementation of `op` ("reference" where the platform has none). attention facts: the compute
        `dtype`, whether packed `segments` are given, `head_dim`."""
        if op not in OPS:
            raise ValueError(f"kernels: unknown op {op!r}; expected one of {OPS}")
        if self.platform == "gpu":
            if op == "attention":
                cudnn = (not segments and not self.interpret and jnp.dtype(dtype) in (jnp.bfloat16, jnp.float16)
                         and head_dim % 8 == 0 and head_dim <= 128)
                return "cudnn" if cudnn else "flash"
            return "triton" if op in ("experts", "ssd") else "flash"
        if self.platform == "tpu":
            return {"attention": "splash", "experts": "megablox", "ssd": "mosaic"}.get(op, "reference")
        return "reference"


REFERENCE = Selection()


def select(kernels: str = "auto", mesh=None, interpret: bool = False) -> Selection:
    return Selection(resolve(kernels, mesh), interpret)
