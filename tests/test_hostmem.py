"""The host allocator settings (`nemo_jax.hostmem`): freed large blocks stay mapped and are reused."""

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
