#!/usr/bin/env python3
"""verifiers 0.4 for nemo_jax's `verifiers:<id>` environments and their `-m verifiers` test tier
(docs/environments.md).

    python tools/tiers/verifiers.py venv [--classic] [--venv DIR]                 # nemo_jax + verifiers + uv
    python tools/tiers/verifiers.py tier [--classic] [--venv DIR] [--examples DIR] # venv if missing -> pytest

--classic: verifiers 0.3.1 (its classic `load_environment()` environments; it pins `mcp<2`, which clashes with
nemo_jax's `mcp` extra) in a venv of its own (default ~/.cache/nemo_jax/verifiers-0.3); else verifiers 0.4.0.

verifiers 0.4.0 pins `mcp==2.0.0` and `openai<3`, which clash with nemo_jax's `mcp` and `worker` extras (and their
pins in constraints.txt), so it gets a venv of its own: nemo_jax (this checkout, editable, with its core
dependencies; no constraints file) and verifiers beside it, `uv` (verifiers runs each harness program as a uv
script: the first episode installs the program's few dependencies from the package registry into uv's cache) and
pytest. The venv lives at --venv, else $NEMO_JAX_VERIFIERS_VENV, else ~/.cache/nemo_jax/verifiers.

--examples (or $NEMO_JAX_VERIFIERS_EXAMPLES): a checkout of github.com/PrimeIntellect-ai/verifiers, whose
environments/glossary (one of verifiers' own offline examples, not on PyPI) the tier installs and runs too.
"""

from __future__ import annotations

import os
import subprocess
import sys

from tier_venv import make_venv, seal, venv_and_tier, venv_python

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
VERIFIERS = {False: "verifiers==0.4.0", True: "verifiers==0.3.1"}
MARKER = "nemo_jax_verifiers.json"
DEFAULT_VENV = {False: os.path.join(os.path.expanduser("~"), ".cache", "nemo_jax", "verifiers"),
                True: os.path.join(os.path.expanduser("~"), ".cache", "nemo_jax", "verifiers-0.3")}


def venv_dir(arg: str | None = None, classic: bool = False) -> str:
    return os.path.abspath(arg or (None if classic else os.environ.get("NEMO_JAX_VERIFIERS_VENV"))
                           or DEFAULT_VENV[classic])


CHECK = r"""
import importlib.metadata as md, json, sys
import verifiers.v1, nemo_jax
print(json.dumps({"verifiers": md.version("verifiers"), "nemo_jax": md.version("nemo_jax"),
                  "python": sys.version.split()[0]}))
"""


def build_venv(venv: str, classic: bool = False) -> dict:
    py = make_venv(venv, sys.executable, "verifiers.py")
    subprocess.run([py, "-m", "pip", "install", "-q", "-e", f"{ROOT}[serve]", VERIFIERS[classic], "uv", "pytest",
                    "pytest-xdist"], check=True)
    return seal(venv, MARKER, CHECK, "verifiers")


def main(argv=None) -> None:
    ap, subs = venv_and_tier(__doc__, f"where (default $NEMO_JAX_VERIFIERS_VENV, else {DEFAULT_VENV[False]})")
    for s in subs.values():
        s.add_argument("--classic", action="store_true", help="verifiers 0.3.1 (classic environments)")
    subs["tier"].add_argument("--examples", help="a verifiers source checkout (its environments/glossary)")
    a = ap.parse_args(argv)
    venv = venv_dir(a.venv, a.classic)
    if a.cmd == "venv" or not os.path.exists(os.path.join(venv, MARKER)):
        build_venv(venv, a.classic)
    if a.cmd == "tier":
        env = dict(os.environ)
        if getattr(a, "examples", None):
            env["NEMO_JAX_VERIFIERS_EXAMPLES"] = os.path.abspath(a.examples)
        sys.exit(subprocess.run([venv_python(venv), "-m", "pytest", "-q", "-n", "0", "-m", "verifiers",
                                 "tests/test_verifiers.py"], cwd=ROOT, env=env).returncode)


if __name__ == "__main__":
    main()
