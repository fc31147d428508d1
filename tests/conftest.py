import gc
import os

from helpers import FAST_COMPILE  # noqa: E402

# 8 fake CPU devices for the sharding tests; must be set before jax is imported anywhere. The suite is dominated
# by compiling many tiny programs: FAST_COMPILE skips LLVM's optimisation of the generated CPU code (the HLO, and
# so every value, shape, sharding, FLOP and byte count the tests check, is the same) and uses XLA:CPU's cheaper
# fusion emitters (helpers.py): about half the time.
# Deviceless GPU compiles (plan, kernels) use the flags a GPU run sets (cuBLAS GEMMs, latency-hiding scheduler).
from nemo_jax.hostmem import GPU_XLA_FLAGS  # noqa: E402  (no jax import)

os.environ.setdefault("XLA_FLAGS", f"--xla_force_host_platform_device_count=8 {FAST_COMPILE} {' '.join(GPU_XLA_FLAGS)}")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
from nemo_jax.hostmem import quiet_plugin_noise  # noqa: E402

quiet_plugin_noise()  # no CUDA driver lines from the optional plugins on this CPU host, as the CLI
# One persistent compilation cache for the session, shared by every test and the subprocesses they start (they
# inherit the environment): the suite builds the same tiny programs many times (each Trainer jits its own step).
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    import atexit
    import shutil
    import tempfile

    _cache = tempfile.mkdtemp(prefix="nemo_jax_test_xla_cache-")
    atexit.register(shutil.rmtree, _cache, ignore_errors=True)
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.5")

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")


@pytest.fixture(autouse=True, scope="module")
def _drop_compiled_programs():
    """Drop every compiled program after each test module: the suite compiles thousands, and with all of them
    kept for the session the last module's compiles crashed twice inside XLA (a segfault, then an abort; cause
    not pinned down); dropped, the suite passes with the process under 6 GB. A later module that needs one
    again loads it from the persistent cache above."""
    yield
    jax.clear_caches()
    gc.collect()


# tiers that run only when the -m expression names their marker (the default run deselects them), and how to run each
OPT_IN_TIERS = {"venv": "tools/tiers/test_venvs.sh: the base install and each extra in clean venvs",
                "vllm": "python tools/tiers/vllm_cpu.py tier: a real vLLM process, with $NEMO_JAX_VLLM_VENV",
                "nemo_gym": "python tools/tiers/nemo_gym.py tier: real NeMo-Gym resources servers, in their own venv",
                "verifiers": "python tools/tiers/verifiers.py tier: verifiers 0.4 environments, in a venv with verifiers"}


# The longest modules (seconds on one worker, a 2-core host), started first: xdist hands out whole modules
# (--dist=loadfile) in collection order, and a long module handed out last ran alone at the end while the other
# worker idled. Order only: every module still runs.
LONG_FIRST = ("test_safety", "test_model", "test_generate", "test_vision", "test_sft", "test_grpo", "test_multihost",
              "test_lora", "test_moe", "test_kernels", "test_worker", "test_train_step", "test_context", "test_rl",
              "test_lora_sft", "test_hf", "test_sharding", "test_scale", "test_generate_scale", "test_tinker",
              "test_recipe", "test_observability", "test_plan")


@pytest.fixture(scope="module")
def host_listener():
    """For hostile-code tests: the port of a listener on the host's loopback (sandboxed code must not reach it),
    with a secret in the host's environment (NEMO_JAX_TEST_SECRET; sandboxed code must not see it)."""
    import socket

    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen()
    os.environ["NEMO_JAX_TEST_SECRET"] = "hunter2"
    yield srv.getsockname()[1]
    srv.close()
    os.environ.pop("NEMO_JAX_TEST_SECRET", None)


def pytest_collection_modifyitems(config, items):
    expr = config.getoption("markexpr", "") or ""
    off = [it for it in items if any(it.get_closest_marker(m) is not None and m not in expr for m in OPT_IN_TIERS)]
    if off:
        config.hook.pytest_deselected(items=off)
        items[:] = [it for it in items if it not in off]
    rank = {name: i for i, name in enumerate(LONG_FIRST)}
    items.sort(key=lambda it: rank.get(it.path.stem, len(rank)))  # (stable: the rest keep their order)
