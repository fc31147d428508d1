"""Shared helpers for the bench scripts: wall-clock timing and compiled memory / FLOP figures."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from nemo_jax.hostmem import (  # noqa: E402  (before jax is imported; see nemo_jax.hostmem)
    choose_platforms, keep_freed_memory, quiet_plugin_noise, tune_xla_cpu)

# as the `nemo-jax` command: on a host without accelerators but with a GPU plugin installed (the plan-gpu extra),
# jax runs on the CPU and the plugin's CUDA lines stay out of stderr (a bench that sets JAX_PLATFORMS keeps it)
choose_platforms()
quiet_plugin_noise()

# the same process-wide allocator settings as the `nemo-jax` command (they apply to torch's side too)
HOST_MALLOC_KEEPS_FREED = keep_freed_memory()
XLA_CPU_TUNED = tune_xla_cpu()  # as the `nemo-jax` command (XLA:CPU library fusions for matmuls only)


def timeit(fn, *, warmup: int = 1, iters: int = 5) -> float:
    """Median seconds per call of fn() (which must block until done)."""
    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    ts.sort()
    return ts[len(ts) // 2]


def compiled_stats(jitted, *args) -> dict:
    """Temp bytes and HLO FLOPs of a jitted function at these arguments (loops counted by trip count: XLA's own
    cost analysis counts a loop body once)."""
    from nemo_jax.plan.hlo import analyse

    c = jitted.lower(*args).compile()
    mem = c.memory_analysis()
    return {"temp_bytes": getattr(mem, "temp_size_in_bytes", None), "flops": analyse(c.as_text(), 1).flops}


def mib(n) -> str:
    return "n/a" if n is None else f"{n / 2**20:,.1f} MiB"


def table(rows: list[dict]):
    keys = list(rows[0])
    w = {k: max(len(k), *(len(str(r[k])) for r in rows)) for k in keys}
    print("  ".join(k.ljust(w[k]) for k in keys))
    for r in rows:
        print("  ".join(str(r[k]).ljust(w[k]) for k in keys))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_serve(args: list[str], log, *, env: dict | None = None, timeout_s: float = 900.0):
    """`nemo-jax serve ARGS` of this checkout on a free port of 127.0.0.1 in a subprocess (its output to the open
    file `log`), once its /health answers -> (the process, its port). A server that exits first, or is not up
    within `timeout_s`, is one error with its log's tail."""
    import httpx

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    port = free_port()
    env = dict(os.environ, **(env or {}), PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen([sys.executable, "-m", "nemo_jax.cli", "serve", "--host", "127.0.0.1", "--port",
                             str(port), *args], stdout=log, stderr=subprocess.STDOUT, env=env, cwd=root)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            with open(log.name) as f:
                raise RuntimeError(f"the server exited ({proc.returncode}); {log.name}:\n{f.read()[-3000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc, port
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError(f"the server did not come up within {timeout_s:g} s; see {log.name}")
