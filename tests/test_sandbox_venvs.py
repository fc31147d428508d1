"""Sandboxes in the Python installs users have: a venv made with `python -m venv` over this machine's Python (its
files linked, or copied with --copies), in a temporary folder (under /tmp), the way most users install. The
interpreter and its libraries are bound read-only wherever they live; the hostile checks of test_sandbox and
test_code_envs run again inside the venv, with the venv's own interpreter, and hold there."""

import os
import subprocess
import sys

import pytest

from test_sandbox import needs_bwrap

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HOSTILE = ["tests/test_sandbox.py::test_bwrap_blocks_the_host_and_the_neighbours",
           "tests/test_sandbox.py::test_bwrap_limits_bombs_and_loops",
           "tests/test_code_envs.py::test_swe_expert_noop_and_tools",
           "tests/test_code_envs.py::test_swe_hostile_actions_earn_nothing",
           "tests/test_code_envs.py::test_chart_expert_image_tools_and_grading",
           "tests/test_code_envs.py::test_chart_python_tool_figures_and_hostile_code"]


def _venv(tmp_path, copies: bool) -> str:
    """A venv over this interpreter's installation (its packages seen through --system-site-packages: no
    network needed) -> its python."""
    d = tmp_path / ("venv-copies" if copies else "venv")
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", *(["--copies"] if copies else []),
                    str(d)], check=True, timeout=300)
    return str(d / "bin" / "python")


@needs_bwrap
@pytest.mark.slow
@pytest.mark.parametrize("copies", [False, True], ids=["linked", "copies"])
def test_sandboxes_work_and_hold_inside_a_venv(tmp_path, copies):
    py = _venv(tmp_path, copies)
    env = dict(os.environ, PYTHONPATH=ROOT)  # (this checkout's nemo_jax, whatever the venv would import)
    said = subprocess.run([py, "-m", "nemo_jax.cli", "sandbox", "--backend", "bwrap"], env=env, capture_output=True,
                          text=True, timeout=300)
    assert said.returncode == 0, said.stderr
    layout, bwrap = said.stdout.strip().splitlines()
    assert layout.startswith(f"python {py}: a venv ({'copied' if copies else 'linked'} files)"), layout
    assert bwrap.startswith("bwrap: works"), bwrap
    out = subprocess.run([py, "-m", "pytest", "-q", "-p", "no:xdist", "-p", "no:cacheprovider", "-o", "addopts=",
                          *HOSTILE], env=env, cwd=ROOT, capture_output=True, text=True, timeout=1200)
    assert out.returncode == 0 and f"{len(HOSTILE)} passed" in out.stdout, out.stdout[-4000:] + out.stderr[-2000:]
