"""Host allocator and XLA:CPU settings for runs on the CPU.

XLA:CPU takes every buffer of an execution (the temporaries of a train step are GBs) from the C allocator.
glibc serves blocks over its mmap threshold (at most 32 MiB) with a fresh `mmap` and returns them with
`munmap` on free, so each step faults its whole working set in again: ~560k page faults and 1-1.5 s of
kernel time per step of `bench/train_step.py` (4.4-4.8 s per step; 3.0-3.9 s once they are gone).
`keep_freed_memory` makes glibc serve large blocks from one heap that it never shrinks, so after a few steps
buffers reuse pages that are already mapped. The price: the process keeps its peak memory until it exits.

It must run before jax starts its thread pools (threads that already own an arena keep it), i.e. before
`import jax`. It applies to CPU-only processes (JAX_PLATFORMS=cpu, or no GPU/TPU plugin installed); the
`nemo-jax` command calls it for every subcommand, and `NEMO_JAX_SYSTEM_MALLOC=1` leaves the allocator alone. The same settings
as environment variables, for other entry points:
`MALLOC_ARENA_MAX=1 MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=1099511627776 MALLOC_TOP_PAD_=67108864`.

`tune_xla_cpu` hands XLA:CPU's library fusions (YNNPACK) the matmuls only, and leaves elementwise ops and
reductions to XLA's own loop fusions. With YNNPACK's default set, a reduction fused with its elementwise
producers runs 3-4x slower than XLA's loop (the backward of an RMSNorm on [1024, 512]: 12.4 ms vs 3.5 ms; of
the Mamba gated norm on [1024, 2048]: 51 vs 22 ms), and a chain of elementwise ops about 2x slower (a*x + b*y
over [4, 1024, 512]: 1.16 vs 0.63 ms; AdamW's update of the bench model: 138 vs 80 ms). The bench train step:
median 2.78 s vs 3.04 s with matmuls and elementwise ops in YNNPACK (`dot,eltwise`, which was itself ~10%
faster than the default set). Same results to rounding (exp, rsqrt, silu within ~1e-6 relative). Like the
allocator settings it must run before `import jax`, applies to CPU-only processes, and is left alone when
XLA_FLAGS already sets the fusion type or the installed jaxlib does not know the flag (an unknown XLA flag
aborts the process).

`quiet_plugin_noise`: on a host without a GPU where a CUDA plugin is installed anyway (`nemo_jax[plan-gpu]`, for
deviceless GPU plans), each of the plugin's native libraries logs "Could not find cuda drivers on your machine"
when it loads, behind absl's "All log messages before absl::InitializeLog() ..." line: three pairs when `import
jax` loads the GPU kernels' libraries, a fourth when jax registers its plugins. The C++ logging of those
libraries honours no setting, so the `nemo-jax` command runs those two moments (the import of jax, wherever a
command first does it, and the plugin registration right after) with file descriptor 2 sent to a temporary file,
then copies what was written there to stderr less exactly those lines: every other line, a real warning
included, is kept and in order.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib.abc
import importlib.machinery
import importlib.util
import mmap
import os
import re
import sys
import tempfile

# mallopt parameters (glibc malloc.h)
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_MAX, _M_ARENA_MAX = -1, -2, -4, -8
# one arena; no mmap'd blocks; never trim the heap (-1 is read as SIZE_MAX); grow it 64 MiB at a time
_SETTINGS = ((_M_ARENA_MAX, 1), (_M_MMAP_MAX, 0), (_M_TRIM_THRESHOLD, -1), (_M_TOP_PAD, 64 << 20))


_ACCELERATOR_PLUGINS = ("jax_cuda12_plugin", "jax_cuda13_plugin", "jax_rocm60_plugin", "jax_rocm7_plugin", "libtpu")


# device nodes of accelerators jax can drive (NVIDIA GPUs, TPU chips: /dev/accel* on v4/v5p, vfio on v5e/v6e)
_ACCELERATOR_NODES = ("/dev/nvidia0", "/dev/nvidiactl", "/dev/accel0", "/dev/vfio")


def choose_platforms() -> str | None:
    """On a machine without accelerators but with an accelerator plugin installed (e.g. `nemo_jax[plan-gpu]` for
    deviceless plans on a laptop), jax would try the plugin's backend and fail ("Unable to load CUDA"): set
    JAX_PLATFORMS=cpu there. -> the value set, or None (JAX_PLATFORMS already set, an accelerator present, or no
    plugin installed: jax's own choice is right)."""
    if os.environ.get("JAX_PLATFORMS", "").strip() or "jax" in sys.modules:
        return None
    if not any(importlib.util.find_spec(m) for m in _ACCELERATOR_PLUGINS):
        return None
    if any(os.path.exists(n) for n in _ACCELERATOR_NODES):
        return None
    os.environ["JAX_PLATFORMS"] = "cpu"
    return "cpu"


def cpu_only() -> bool:
    """Whether jax will run on the CPU alone (decided without importing jax)."""
    platforms = os.environ.get("JAX_PLATFORMS", "").strip()
    if platforms:
        return platforms.split(",")[0].strip() == "cpu"
    return not any(importlib.util.find_spec(m) for m in _ACCELERATOR_PLUGINS)


def known_device_count() -> int | None:
    """How many devices this process's jax will have, where that is known before jax starts: on the CPU alone
    (`cpu_only`), JAX_NUM_CPU_DEVICES, else XLA_FLAGS' last --xla_force_host_platform_device_count, else 1.
    None where accelerators decide (their count is known once jax has started)."""
    import re

    if not cpu_only():
        return None
    try:
        n = int(os.environ.get("JAX_NUM_CPU_DEVICES", "-1"))
    except ValueError:
        return None
    if n >= 0:
        return n
    forced = re.findall(r"--xla_force_host_platform_device_count=(\d+)", os.environ.get("XLA_FLAGS", ""))
    return int(forced[-1]) if forced else 1


def keep_freed_memory() -> bool:
    """Configure glibc malloc as described above. Returns False (and changes nothing) where jax will use an
    accelerator (see `cpu_only`), where the C library has no `mallopt` (not glibc), where jax is already
    imported, or when NEMO_JAX_SYSTEM_MALLOC is set."""
    if (os.environ.get("NEMO_JAX_SYSTEM_MALLOC") or "jax" in sys.modules or not sys.platform.startswith("linux")
            or not cpu_only()):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # musl and other C libraries
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return all(mallopt(param, value) == 1 for param, value in _SETTINGS)


YNN_FUSIONS = "xla_cpu_experimental_ynn_fusion_type"
YNN_SETTING = f"--{YNN_FUSIONS}=dot"


def _jaxlib_knows(flag: str) -> bool:
    """Whether the installed jaxlib's XLA parses `flag` (its name is in the library that defines the flags)."""
    spec = importlib.util.find_spec("jaxlib")
    for d in (spec.submodule_search_locations or []) if spec else []:
        path = os.path.join(d, "libjax_common.so")
        if os.path.exists(path):
            with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
                return m.find(flag.encode()) >= 0
    return False


def tune_xla_cpu() -> bool:
    """Add YNN_SETTING to XLA_FLAGS (see above). Returns whether it is in effect: False (and nothing changed)
    where jax will use an accelerator, where jax is already imported, where XLA_FLAGS sets the fusion type
    itself, or where the installed jaxlib lacks the flag."""
    flags = os.environ.get("XLA_FLAGS", "")
    if YNN_SETTING in flags.split():
        return True
    if "jax" in sys.modules or not cpu_only() or YNN_FUSIONS in flags or not _jaxlib_knows(YNN_FUSIONS):
        return False
    os.environ["XLA_FLAGS"] = f"{flags} {YNN_SETTING}".strip()
    return True


# XLA:GPU settings for training steps on H100 / H200 / B200 (NVLink inside a node, InfiniBand or RoCE between
# nodes). The `nemo-jax` command adds them on a GPU host (`tune_xla_gpu`) and `nemo-jax plan --target gpu` compiles
# with them, so a plan is the program a cluster runs; the launchers leave them to the command.
GPU_XLA_FLAGS = (
    "--xla_gpu_enable_latency_hiding_scheduler=true",  # overlap FSDP all-gathers / reduce-scatters with compute
    "--xla_gpu_enable_triton_gemm=false",  # cuBLAS GEMMs (Triton's gemm fusions found no tiling for the fp32
    #                                        HIGHEST-precision SSD segment sums: "Couldn't find output tile sizes")
    "--xla_gpu_enable_command_buffer=",  # no CUDA graphs: they pin memory and hurt with the MoE dispatch
    "--xla_gpu_all_reduce_combine_threshold_bytes=134217728",  # combine small collectives (128 MiB)
    "--xla_gpu_all_gather_combine_threshold_bytes=134217728",
    "--xla_gpu_reduce_scatter_combine_threshold_bytes=134217728",
)


def gpu_host() -> bool:
    """Whether jax will run on NVIDIA GPUs (decided without importing jax)."""
    platforms = os.environ.get("JAX_PLATFORMS", "").strip()
    if platforms:
        return platforms.split(",")[0].strip() in ("cuda", "gpu")
    return (any(importlib.util.find_spec(m) for m in ("jax_cuda12_plugin", "jax_cuda13_plugin"))
            and os.path.exists("/dev/nvidiactl"))


def tune_xla_gpu(force: bool = False) -> bool:
    """Add GPU_XLA_FLAGS to XLA_FLAGS (each unless XLA_FLAGS sets that flag already) where jax will use GPUs, or
    always with `force` (a deviceless GPU compile). Returns whether they are in effect; must run before jax starts
    its backends."""
    if not (force or gpu_host()) or "jax" in sys.modules and not force:
        return False
    flags = os.environ.get("XLA_FLAGS", "")
    have = {f.split("=")[0] for f in flags.split()}
    add = [f for f in GPU_XLA_FLAGS if f.split("=")[0] not in have]
    os.environ["XLA_FLAGS"] = " ".join([flags] + add).strip()
    return True



# What an accelerator plugin's native libraries log on a host without that accelerator (nothing else matches)
PLUGIN_NOISE = re.compile(
    r"WARNING: All log messages before absl::InitializeLog\(\) is called are written to STDERR"
    r"|I\d{4} [\d:.]+ +\d+ cudart_stub\.cc:\d+\] Could not find cuda drivers on your machine, GPU will not be used\.")


@contextlib.contextmanager
def stderr_filtered(noise: re.Pattern = PLUGIN_NOISE):
    """Run the block with file descriptor 2 (what native libraries and Python's sys.stderr write to) sent to a
    temporary file; then write its lines to the real stderr in order, less the lines that `noise` matches whole."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as tmp:
        os.dup2(tmp.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            kept = [line for line in tmp.read().splitlines(keepends=True)
                    if not noise.fullmatch(line.rstrip(b"\r\n").decode("utf-8", "replace"))]
            if kept:
                os.write(2, b"".join(kept))


def answer_after_logs(fn, *args, noise: re.Pattern = PLUGIN_NOISE, **kwargs):
    """fn(*args, **kwargs) with what it prints held back: the log lines native libraries write to stderr meanwhile
    (XLA:GPU's compiler, less `noise`) come out first, then its stdout (the answer), never interleaved. -> its
    result."""
    import io

    out = io.StringIO()
    try:
        with stderr_filtered(noise), contextlib.redirect_stdout(out):
            return fn(*args, **kwargs)
    finally:
        sys.stdout.write(out.getvalue())
        sys.stdout.flush()


def _register_plugins():
    """Let jax find and register its PJRT plugins now (it does so at its first device query otherwise); the
    registration creates no backend, so a later `jax.distributed.initialize()` is still in time."""
    from jax._src import xla_bridge

    register = getattr(xla_bridge, "_discover_and_register_pjrt_plugins", None)
    if register is not None:
        register()


class _QuietJaxImport(importlib.abc.MetaPathFinder):
    """Finds `jax` as Python would and runs its import (then the plugin registration) under `stderr_filtered`."""

    def find_spec(self, name, path=None, target=None):
        if name != "jax":
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module):
            with contextlib.suppress(ValueError):
                sys.meta_path.remove(self)
            with stderr_filtered():
                run(module)
                _register_plugins()

        spec.loader.exec_module = exec_module
        return spec


_GPU_PLUGINS = ("jax_cuda12_plugin", "jax_cuda13_plugin", "jax_rocm60_plugin", "jax_rocm7_plugin")


def quiet_plugin_noise() -> bool:
    """On a CPU-only process (see `cpu_only`) with a GPU plugin installed, filter PLUGIN_NOISE out of stderr while
    jax is imported and registers its plugins (see above). -> whether the filter is in place; False (nothing
    changed) where jax is already imported, where jax will use an accelerator, or where no GPU plugin is
    installed."""
    if "jax" in sys.modules or not cpu_only() or not any(importlib.util.find_spec(m) for m in _GPU_PLUGINS):
        return False
    if not any(isinstance(f, _QuietJaxImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _QuietJaxImport())
    os.environ["NEMO_JAX_QUIET_PLUGINS"] = "1"  # child processes too (nemo_jax/__init__.py)
    return True
