"""Optional dependencies (`pip install 'nemo_jax[EXTRA]'`): import them on use, with an error that says how to
install them."""

from __future__ import annotations

import importlib


class MissingDependency(ImportError):
    """An optional package a requested feature needs is not installed."""


def require(module: str, extra: str, purpose: str):
    """-> the imported `module`, or MissingDependency naming the pip command that installs it."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise MissingDependency(f"{purpose} needs the {module.split('.')[0]!r} package, which is not installed "
                                f"({e}); install it with: pip install 'nemo_jax[{extra}]'") from None
