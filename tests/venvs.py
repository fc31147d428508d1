"""Clean venvs of the base install and of each extra, for the venv tier (tests/test_venvs.py, tools/tiers/test_venvs.sh).

`base_venv()`: a venv (no system site-packages) holding the core dependencies of pyproject.toml, pinned by
constraints.txt (`pip install -c constraints.txt REQS`); `extra_venv(EXTRA)`: a venv holding that extra's
packages on top of the base's (the base's site-packages joined by a .pth file: core + that extra, nothing else).
nemo_jax itself is not installed into them: commands run this checkout's source (PYTHONPATH), so one venv serves
every commit with the same dependencies.

They are built once and kept under $NEMO_JAX_VENV_CACHE (default ~/.cache/nemo_jax/venvs), keyed by the Python
version and the requirement and constraint lines they were built from: the first build costs about a minute for
the base (pip installs from its local cache / the index), seconds to tens of seconds for an extra; later runs
reuse them. A build that fails leaves nothing behind (built in a temporary folder, renamed into place).

Nothing here imports jax (conftest imports helpers before jax; this module is imported by test modules only).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tomllib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONSTRAINTS = os.path.join(ROOT, "constraints.txt")


def pyproject() -> dict:
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)


def core_requirements() -> list[str]:
    return list(pyproject()["project"]["dependencies"])


def extra_requirements(extra: str) -> list[str]:
    return list(pyproject()["project"]["optional-dependencies"][extra])


def cache_dir() -> str:
    return os.environ.get("NEMO_JAX_VENV_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "nemo_jax",
                                                                 "venvs")


def _key(*parts) -> str:
    with open(CONSTRAINTS) as f:
        pins = f.read()
    h = hashlib.sha256(repr((sys.version_info[:2], pins, parts)).encode()).hexdigest()
    return h[:16]


def _site_packages(venv: str) -> str:
    return os.path.join(venv, "lib", f"python{sys.version_info.major}.{sys.version_info.minor}", "site-packages")


def _build(name: str, reqs: list[str], under: str | None = None) -> str:
    """A venv `name` holding `reqs` (pinned), over the venv `under`'s packages when given -> its path."""
    path = os.path.join(cache_dir(), f"{name}-{_key(name, reqs, under)}")
    if os.path.isfile(os.path.join(path, "built")):
        return path
    os.makedirs(cache_dir(), exist_ok=True)
    tmp = f"{path}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        subprocess.run([sys.executable, "-m", "venv", tmp], check=True)
        if under is not None:  # the base's packages on this venv's path, below its own
            with open(os.path.join(_site_packages(tmp), "_nemo_jax_base.pth"), "w") as f:
                f.write(_site_packages(under) + "\n")
        if reqs:
            env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PIP_REQUIRE_VIRTUALENV")}
            out = subprocess.run([os.path.join(tmp, "bin", "python"), "-m", "pip", "install", "-q",
                                  "--disable-pip-version-check", "-c", CONSTRAINTS, *reqs],
                                 capture_output=True, text=True, env=env)
            if out.returncode:
                raise RuntimeError(f"pip install into {name} failed:\n{out.stdout[-3000:]}{out.stderr[-3000:]}")
        open(os.path.join(tmp, "built"), "w").close()
        shutil.rmtree(path, ignore_errors=True)  # (a half-built one of an earlier, killed build)
        os.rename(tmp, path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path


def base_venv() -> str:
    """The venv of the core dependencies (no extra) -> its path."""
    return _build("base", core_requirements())


def extra_venv(extra: str) -> str:
    """The venv of the core dependencies and one extra -> its path."""
    return _build(f"extra-{extra}", extra_requirements(extra), under=base_venv())


def run(venv: str, args: list[str], *, cwd: str | None = None, timeout: float = 600, env: dict | None = None):
    """`python ARGS` in `venv` with this checkout's source on the path (and nothing else of this process's) ->
    CompletedProcess (text, stdout and stderr captured)."""
    keep = ("PATH", "HOME", "TMPDIR", "LANG", "LC_ALL", "XLA_FLAGS", "JAX_PLATFORMS", "JAX_COMPILATION_CACHE_DIR")
    e = {k: os.environ[k] for k in keep if k in os.environ}
    e.update(PYTHONPATH=ROOT, PYTHONNOUSERSITE="1", **(env or {}))
    return subprocess.run([os.path.join(venv, "bin", "python"), *args], cwd=cwd or ROOT, capture_output=True,
                          text=True, timeout=timeout, env=e)
