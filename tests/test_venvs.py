"""The venv tier (`pytest -m venv`, tools/tiers/test_venvs.sh; skipped otherwise): the base install and each extra in
clean venvs (tests/venvs.py builds and caches them).

* the base install (`pip install -c constraints.txt .`, no extra) imports every nemo_jax module that belongs to
  no extra, loads every shipped config, and runs the first step of the vision-language SFT and GRPO configs (what
  died on a missing Pillow);
* each extra alone (core + that extra) imports every module it promises (nemo_jax.extras.EXTRA_MODULES): the
  rollout worker with `[worker]` only (it lacked httpx). The accelerator plugins' extras (hundreds of MB) run
  only with NEMO_JAX_VENV_HEAVY=1.
"""

import glob
import json
import os

import pytest

from helpers import micro_model
from nemo_jax.extras import EXTRA_MODULES
from venvs import ROOT, base_venv, extra_venv, run

pytestmark = [pytest.mark.venv, pytest.mark.slow]
HEAVY = ("plan-gpu", "plan-tpu")
FAST_ENV = {"XLA_FLAGS": "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false",
            "JAX_PLATFORMS": "cpu"}


def _ok(out, what):
    assert out.returncode == 0, f"{what}: exit {out.returncode}\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}"


def test_the_base_install_imports_every_module_loads_every_config_and_trains_the_vl_configs(tmp_path):
    venv = base_venv()
    extra_mods = sorted({m for mods in EXTRA_MODULES.values() for m in mods if m.startswith("nemo_jax")})
    script = f"""
import importlib, pkgutil, sys
import nemo_jax
skip = set({extra_mods!r})
bad = []
for m in pkgutil.walk_packages(nemo_jax.__path__, "nemo_jax."):
    if m.name not in skip:
        try:
            importlib.import_module(m.name)
        except Exception as e:
            bad.append(f"{{m.name}}: {{type(e).__name__}}: {{e}}")
import PIL.Image  # the vision-language models' pictures: a core dependency
for extra in ("matplotlib", "fastapi", "openai", "mcp", "wandb"):  # no extra is there
    try:
        importlib.import_module(extra)
        bad.append(f"{{extra}} is installed in the base venv")
    except ImportError:
        pass
print("\\n".join(bad))
sys.exit(1 if bad else 0)
"""
    _ok(run(venv, ["-c", script], env=FAST_ENV), "imports on the base install")
    configs = sorted(glob.glob(os.path.join(ROOT, "configs", "*", "*.yaml")))
    script = f"""
import sys
from nemo_jax.config.train import load_grpo_config, load_plan_config, load_sft_config
from nemo_jax.merge.recipe import load_recipe
from nemo_jax.recipe import load_recipe_config
bad = []
for path in {configs!r}:
    kind = path.split("/")[-2]
    load = {{"sft": load_sft_config, "grpo": load_grpo_config, "merge": load_recipe, "recipes": load_recipe_config,
             "mesh": None}}[kind]
    try:
        if load is not None:
            load(path, [])
    except Exception as e:
        bad.append(f"{{path}}: {{type(e).__name__}}: {{e}}")
print("\\n".join(bad))
sys.exit(1 if bad else 0)
"""
    _ok(run(venv, ["-c", script], env=FAST_ENV), "shipped configs on the base install")
    # the VL SFT and GRPO configs' first step (the micro VL model: the same code paths, a cheaper compile)
    model = micro_model(tmp_path, "tiny-vl")
    sft = run(venv, ["-m", "nemo_jax.cli", "sft", "--config", "configs/sft/tiny-vl-cpu.yaml", "steps=1",
                     "eval_every=0", f"model.config={model}", f"run_dir={tmp_path / 'sft'}", "data.batch_size=2"],
              env=FAST_ENV)
    _ok(sft, "the VL SFT config's first step on the base install")
    grpo = run(venv, ["-m", "nemo_jax.cli", "grpo", "--config", "configs/grpo/tiny-vl-gui.yaml", "steps=1",
                      "eval_every=0", f"model.init={tmp_path / 'sft'}", f"run_dir={tmp_path / 'grpo'}",
                      "rollout.groups_per_step=1", "rollout.group_size=2", "rollout.in_flight_groups=1"],
               env=FAST_ENV)
    _ok(grpo, "the VL GRPO config's first step on the base install")
    with open(tmp_path / "grpo" / "metrics.jsonl") as f:
        assert [json.loads(x)["step"] for x in f if '"reward_mean"' in x] == [1]


@pytest.mark.parametrize("extra", sorted(EXTRA_MODULES))
def test_each_extra_alone_imports_every_module_it_promises(extra):
    if extra in HEAVY and not os.environ.get("NEMO_JAX_VENV_HEAVY"):
        pytest.skip(f"[{extra}]: an accelerator plugin of hundreds of MB (NEMO_JAX_VENV_HEAVY=1 runs it)")
    venv = extra_venv(extra)
    mods = EXTRA_MODULES[extra]
    out = run(venv, ["-c", "import importlib, sys\n"
                           f"for m in {mods!r}:\n"
                           "    importlib.import_module(m)\n"
                           "print('ok')"], env=FAST_ENV)
    _ok(out, f"[{extra}] alone: import {', '.join(mods)}")
    if extra == "worker":  # the worker starts (and stops at once: no server there)
        out = run(venv, ["-m", "nemo_jax.cli", "rollout-worker", "--run", "/nonexistent", "--server",
                         "http://127.0.0.1:9", "--wait-s", "0"], env=FAST_ENV, timeout=120)
        assert "ModuleNotFoundError" not in out.stderr and "MissingDependency" not in out.stderr, out.stderr[-2000:]
