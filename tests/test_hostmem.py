"""The host settings (`nemo_jax.hostmem`): freed large blocks stay mapped and are reused; the XLA:CPU flags."""

import ctypes
import os
import subprocess
import sys

import pytest

from nemo_jax import hostmem

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

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


@pytest.mark.slow
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


# ----------------------------------------------------------------------------- quiet CPU hosts
_NOISE = (b"WARNING: All log messages before absl::InitializeLog() is called are written to STDERR\n"
          b"I0000 00:00:1796459711.954112    7478 cudart_stub.cc:31] Could not find cuda drivers on your machine, "
          b"GPU will not be used.\n")
# a jax plugin (found in the `jax_plugins` namespace) whose registration writes the CUDA noise and real warnings
_NOISY_PLUGIN = f"""
import os, warnings
def initialize():
    os.write(2, {_NOISE!r})
    os.write(2, b"W0000 00:00:1.0 1 plugin.cc:7] a real warning from a plugin library\\n")
    warnings.warn("a real Python warning from a plugin")
"""


def _noise_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if hostmem.PLUGIN_NOISE.fullmatch(line)]


_FILTER_PROBE = f"""
import ctypes, os, sys
from nemo_jax import hostmem
with hostmem.stderr_filtered():
    os.write(2, b"first real line\\n" + {_NOISE!r})
    ctypes.CDLL(None).write(2, b"E0000 a native error line\\n", 26)
    print("a Python line on sys.stderr", file=sys.stderr)
    os.write(2, {_NOISE!r} + b"last real line, no newline")
print("stdout untouched")
"""


def test_stderr_filter_drops_the_plugin_noise_and_keeps_everything_else():
    r = subprocess.run([sys.executable, "-c", _FILTER_PROBE], capture_output=True, text=True, check=True)
    assert r.stderr == ("first real line\nE0000 a native error line\na Python line on sys.stderr\n"
                        "last real line, no newline")
    assert r.stdout == "stdout untouched\n"
    assert len(_noise_lines(_NOISE.decode())) == 2  # the pattern matches the real noise, line by line


def _gpu_plugin_installed() -> bool:
    import importlib.util

    return any(importlib.util.find_spec(m) for m in hostmem._GPU_PLUGINS)


@pytest.mark.skipif(not _gpu_plugin_installed(), reason="no GPU plugin installed (pip install '.[plan-gpu]')")
def test_cpu_host_commands_print_no_plugin_noise_and_keep_real_warnings(tmp_path):
    """With the CUDA plugin installed on a host without a GPU, `import jax` alone prints the driver lines three
    times; a `nemo-jax` command (serve, which imports jax before it finds the checkpoint missing) prints none of
    them, while a plugin's real warnings, written while jax registers its plugins, still reach stderr, in order,
    and so does the command's error line. Its child processes are quiet too."""
    env = {k: v for k, v in os.environ.items() if k != "NEMO_JAX_QUIET_PLUGINS"}
    env["JAX_PLATFORMS"] = "cpu"
    plain = subprocess.run([sys.executable, "-c", "import jax"], env=env, capture_output=True, text=True)
    if not _noise_lines(plain.stderr):
        pytest.skip("the installed plugin logs nothing on this host (a GPU host?)")
    assert len(_noise_lines(plain.stderr)) == 6  # the reproduction: three absl preambles, three driver lines

    (tmp_path / "jax_plugins" / "nemo_jax_test_noisy").mkdir(parents=True)
    (tmp_path / "jax_plugins" / "nemo_jax_test_noisy" / "__init__.py").write_text(_NOISY_PLUGIN)
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path)] + [p for p in [env.get("PYTHONPATH")] if p])
    r = subprocess.run([sys.executable, "-m", "nemo_jax.cli", "serve", "--ckpt", str(tmp_path / "missing")],
                       env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 2, r.stderr
    assert not _noise_lines(r.stderr), r.stderr
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert lines[0] == "W0000 00:00:1.0 1 plugin.cc:7] a real warning from a plugin library", r.stderr
    assert lines[1] == "nemo-jax serve: warning: a real Python warning from a plugin"  # (one line, as every warning)
    assert lines[-1] == f"nemo-jax serve: error: {tmp_path / 'missing'}: no such model, checkpoint or run dir"

    child = ("import subprocess, sys; from nemo_jax import hostmem; hostmem.quiet_plugin_noise(); "
             "subprocess.run([sys.executable, '-c', 'import nemo_jax, jax'], check=True)")
    r = subprocess.run([sys.executable, "-c", child], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and not _noise_lines(r.stderr), r.stderr
    assert "a real warning from a plugin library" in r.stderr


def test_library_users_get_the_plugin_filter_on_import(tmp_path):
    """`import nemo_jax` (the README's "From Python" snippet) on a CPU-only host with a GPU plugin installed puts
    the filter in place before jax is imported, as the CLI does (no environment variable needed)."""
    (tmp_path / "jax_cuda12_plugin").mkdir()
    (tmp_path / "jax_cuda12_plugin" / "__init__.py").write_text("")
    env = {k: v for k, v in os.environ.items() if k != "NEMO_JAX_QUIET_PLUGINS"}
    env.update(JAX_PLATFORMS="cpu", PYTHONPATH=os.pathsep.join([str(tmp_path), ROOT]))
    probe = ("import sys; import nemo_jax; from nemo_jax import hostmem; "
             "print('jax' in sys.modules, any(isinstance(f, hostmem._QuietJaxImport) for f in sys.meta_path))")
    r = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=120)
    assert r.stdout.split()[-1] == "True", r.stdout + r.stderr


def test_plan_answers_after_the_compilers_log_lines():
    """`plan --target gpu`: what native code logs to stderr while the plan compiles comes out first (less the
    plugin noise), then the answer: never interleaved."""
    code = ("import os, sys\nfrom nemo_jax.hostmem import answer_after_logs\n"
            "def plan():\n"
            "    print('answer line 1', flush=True)\n"
            "    os.write(2, b'I0000 00:00:1.0 1 gpu_compiler.cc:1] an XLA log line\\n')\n"
            "    print('answer line 2', flush=True)\n"
            "    os.write(2, b'WARNING: All log messages before absl::InitializeLog() is called are written to STDERR\\n')\n"
            "    return 7\n"
            "assert answer_after_logs(plan) == 7\n")
    r = subprocess.run([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=120,
                       env=dict(os.environ, PYTHONPATH=ROOT))
    assert r.stdout.decode().splitlines() == ["I0000 00:00:1.0 1 gpu_compiler.cc:1] an XLA log line",
                                              "answer line 1", "answer line 2"], r.stdout


@pytest.mark.skipif(not _gpu_plugin_installed(), reason="no GPU plugin installed (pip install '.[plan-gpu]')")
def test_benches_on_a_cpu_host_print_no_plugin_noise():
    """A bench script (bench/common.py first, then jax) on a CPU host with the CUDA plugin installed and nothing
    set by the user runs on the CPU without the driver lines and tracebacks a bare `import jax` prints there."""
    env = {k: v for k, v in os.environ.items() if k not in ("NEMO_JAX_QUIET_PLUGINS", "JAX_PLATFORMS")}
    if any(os.path.exists(n) for n in hostmem._ACCELERATOR_NODES):
        pytest.skip("an accelerator is present: jax's own choice stands")
    bench = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench")
    code = (f"import sys; sys.path.insert(0, {bench!r}); import common; import jax; "
            "print(jax.devices()[0].platform)")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip() == "cpu", r.stderr
    assert not _noise_lines(r.stderr) and "Traceback" not in r.stderr, r.stderr
