#!/usr/bin/env bash
# The venv tier: the base install and each extra in clean venvs (tests/test_venvs.py; venvs built by tests/venvs.py
# and kept under $NEMO_JAX_VENV_CACHE, default ~/.cache/nemo_jax/venvs: the first run builds them, ~2-3 min on a
# 2-core machine with pip's cache warm; later runs reuse them). Not part of the default suite (`pytest -m venv`
# opts in). NEMO_JAX_VENV_HEAVY=1 adds the accelerator plugins' extras (plan-gpu, plan-tpu: hundreds of MB).
#
#   tools/tiers/test_venvs.sh            # from anywhere in the repo; extra pytest arguments are passed on
set -euo pipefail
cd "$(dirname "$0")/../.."
exec python -m pytest -q -n 0 -m venv tests/test_venvs.py "$@"
