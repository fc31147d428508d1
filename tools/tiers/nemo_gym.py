#!/usr/bin/env python3
"""NeMo-Gym for nemo_jax's `nemo_gym` environment and its `-m nemo_gym` test tier (docs/environments.md).

    python tools/tiers/nemo_gym.py venv [--venv DIR] [--python PYTHON]   # build the Gym venv (nemo-gym==0.4.0)
    python tools/tiers/nemo_gym.py tier [--venv DIR]                     # venv if missing -> pytest -m nemo_gym

NeMo-Gym 0.4.0 needs Python >= 3.12 (pip on 3.11: "No matching distribution found"), so it lives in a venv of its
own, never in nemo_jax's: the environment talks to its resources servers over HTTP and starts them with this venv's
Python (`env_args.python`, else $NEMO_JAX_NEMO_GYM_PYTHON, else DIR/bin/python). The venv lives at --venv, else
$NEMO_JAX_NEMO_GYM_VENV, else ~/.cache/nemo_jax/nemo-gym; --python (else $PYTHON, else the first python3.13 /
python3.12 on PATH or under pyenv) makes it. The wheel ships NeMo-Gym's `resources_servers` package (the example
servers and their data): the tier serves `resources_servers.example_multi_step` from it.
"""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sys

from tier_venv import make_venv, seal, venv_and_tier, venv_python

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NEMO_GYM = "nemo-gym==0.4.0"
MARKER = "nemo_jax_nemo_gym.json"
DEFAULT_VENV = os.path.join(os.path.expanduser("~"), ".cache", "nemo_jax", "nemo-gym")


def venv_dir(arg: str | None = None) -> str:
    return os.path.abspath(arg or os.environ.get("NEMO_JAX_NEMO_GYM_VENV") or DEFAULT_VENV)


def find_python() -> str | None:
    """A Python >= 3.12 to make the venv from."""
    if os.environ.get("PYTHON"):
        return os.environ["PYTHON"]
    for name in ("python3.13", "python3.12"):
        if shutil.which(name):
            return shutil.which(name)
    found = sorted(glob.glob(os.path.expanduser("~/.pyenv/versions/3.1[23].*/bin/python")))
    return found[-1] if found else None


CHECK = r"""
import importlib.metadata as md, json, sys
import nemo_gym, resources_servers.example_multi_step.app
print(json.dumps({"nemo_gym": md.version("nemo-gym"), "python": sys.version.split()[0]}))
"""


def build_venv(venv: str, python: str | None = None) -> dict:
    python = python or find_python()
    if not python:
        raise SystemExit("nemo_gym.py venv: no Python >= 3.12 found (NeMo-Gym 0.4.0 needs it): give --python")
    py = make_venv(venv, python, "nemo_gym.py")
    subprocess.run([py, "-m", "pip", "install", "-q", NEMO_GYM], check=True)
    return seal(venv, MARKER, CHECK, "NeMo-Gym")


def main(argv=None) -> None:
    ap, subs = venv_and_tier(__doc__, f"where (default $NEMO_JAX_NEMO_GYM_VENV, else {DEFAULT_VENV})")
    for s in subs.values():
        s.add_argument("--python", help="a Python >= 3.12 to make it from")
    a = ap.parse_args(argv)
    venv = venv_dir(a.venv)
    if a.cmd == "venv" or not os.path.exists(os.path.join(venv, MARKER)):
        build_venv(venv, a.python)
    if a.cmd == "tier":
        env = dict(os.environ, NEMO_JAX_NEMO_GYM_PYTHON=venv_python(venv))
        sys.exit(subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "0", "-m", "nemo_gym",
                                 "tests/test_nemo_gym.py"], cwd=ROOT, env=env).returncode)


if __name__ == "__main__":
    main()
