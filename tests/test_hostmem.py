"""The host settings (`nemo_jax.hostmem`): freed large blocks stay mapped and are reused; the XLA:CPU flags."""

import ctypes
import os
import subprocess
import sys

import pytest

from nemo_jax import hostmem

GLIBC = sys.platform.startswith("linux") and hasattr(ctypes.CDLL(None), "gnu_get_libc_version")

# Allocates, touches and frees a 64 MiB block twice; prints the page faults of the second round.
_PROBE = """
import ctypes, resource, sys
from nemo_jax.hostmem import keep_freed_memory
kept = keep_freed_memory() if sys.argv[1] == "keep" else False
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, (ctypes.c_size_t,)
libc.free.argtypes = (ctypes.c_void_p,)

def faults():  # plain malloc + memset: numpy would ask for huge pages
    r0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    p = libc.malloc(64 << 20)
    ctypes.memset(p, 1, 64 << 20)
    libc.free(p)
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - r0

faults()
print(kept, faults())
"""


def _probe(mode: str, **env) -> tuple[str, int]:
    e = {k: v for k, v in os.environ.items() if not k.startswith(("MALLOC_", "NEMO_JAX_SYSTEM_MALLOC"))}
    out = subprocess.run([sys.executable, "-c", _PROBE, mode], env={**e, **env}, capture_output=True, text=True,
                         check=True).stdout.split()
    return out[0], int(out[1])


@pytest.mark.skipif(not GLIBC, reason="glibc malloc only")
def test_freed_blocks_are_reused_without_page_faults():
    kept, faults = _probe("keep")
    assert kept == "True"
    assert faults < 1024  # 16384 pages of 4 KiB would fault again if the block were unmapped on free
    kept, faults = _probe("system")
    # the default: mmap'd, unmapped on free, faulted in again: 16384 faults with 4 KiB faults, ~4200 on kernels
    # that fault in larger folios; either way far above the kept case's < 1024
    assert kept == "False" and faults > 2048


@pytest.mark.skipif(not GLIBC, reason="glibc malloc only")
def test_opt_out_and_too_late():
    assert _probe("keep", NEMO_JAX_SYSTEM_MALLOC="1")[0] == "False"
    assert _probe("keep", JAX_PLATFORMS="cuda")[0] == "False"  # accelerator processes keep the system allocator
    assert "jax" in sys.modules  # conftest imported it: threads may own arenas already, so nothing changes
    assert hostmem.keep_freed_memory() is False


def test_cpu_only_reads_jax_platforms(monkeypatch):
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    assert hostmem.cpu_only()
    monkeypatch.setenv("JAX_PLATFORMS", "cuda,cpu")
    assert not hostmem.cpu_only()


# Sets the XLA:CPU flags (or not), then prints whether they are in effect, XLA_FLAGS, and an RMSNorm's
# forward + backward (the fusions the setting changes), one per line.
_XLA_PROBE = """
import os, sys
from nemo_jax.hostmem import tune_xla_cpu
tuned = tune_xla_cpu() if sys.argv[1] == "tune" else False
import jax, jax.numpy as jnp
from nemo_jax.model.layers import gated_rms_norm, rms_norm
x = jax.random.normal(jax.random.key(0), (4, 64, 96))
f = lambda x, s: jnp.sum(jnp.sin(rms_norm(x, s, 1e-5))) + jnp.sum(gated_rms_norm(x, x * 2, s, 2, 1e-5) ** 2)
v, g = jax.jit(jax.value_and_grad(f, argnums=(0, 1)))(x, jnp.linspace(0.5, 1.5, 96))
print(tuned, os.environ.get("XLA_FLAGS", ""), float(v), *(float(jnp.sum(jnp.abs(a))) for a in g), sep="\\n")
"""


def _xla_probe(mode: str, **env):
    e = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    r = subprocess.run([sys.executable, "-c", _XLA_PROBE, mode], env={**e, "JAX_PLATFORMS": "cpu", **env},
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    out = r.stdout.splitlines()
    return out[0], out[1], [float(v) for v in out[2:]]


def test_xla_cpu_setting_applies_and_keeps_values():
    if not hostmem._jaxlib_knows(hostmem.YNN_FUSIONS):
        pytest.skip("this jaxlib has no YNNPACK fusion flag")
    tuned, flags, vals = _xla_probe("tune", XLA_FLAGS="--xla_force_host_platform_device_count=2")
    assert tuned == "True" and flags.split() == ["--xla_force_host_platform_device_count=2", hostmem.YNN_SETTING]
    untuned, flags, ref = _xla_probe("system")
    assert untuned == "False" and hostmem.YNN_FUSIONS not in flags
    for a, b in zip(vals, ref):
        assert abs(a - b) <= 1e-5 * abs(b), (vals, ref)
    # a fusion type chosen in XLA_FLAGS is the user's
    own = f"--{hostmem.YNN_FUSIONS}=dot,eltwise"
    assert _xla_probe("tune", XLA_FLAGS=own)[:2] == ("False", own)
    if hostmem.YNN_SETTING not in os.environ.get("XLA_FLAGS", "").split():
        assert hostmem.tune_xla_cpu() is False  # too late: this process imported jax


def test_gpu_flags_added_once_and_user_flags_win(monkeypatch):
    """On a GPU host (or for a deviceless GPU compile) the command adds the XLA:GPU flags the launchers used to
    set (latency-hiding scheduler, collective combining); a flag the user set in XLA_FLAGS keeps its value."""
    from nemo_jax import hostmem

    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_enable_triton_gemm=true")
    assert hostmem.tune_xla_gpu(force=True)
    flags = os.environ["XLA_FLAGS"].split()
    assert "--xla_gpu_enable_latency_hiding_scheduler=true" in flags
    assert "--xla_gpu_enable_triton_gemm=true" in flags and "--xla_gpu_enable_triton_gemm=false" not in flags
    hostmem.tune_xla_gpu(force=True)
    assert os.environ["XLA_FLAGS"].split() == flags  # idempotent
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    monkeypatch.setenv("XLA_FLAGS", "")
    assert not hostmem.tune_xla_gpu() and os.environ["XLA_FLAGS"] == ""  # a CPU process is left alone
