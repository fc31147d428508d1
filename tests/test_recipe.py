"""`nemo-jax recipe`: every stage end to end on the tiny model (few steps), the report, and a rerun that skips
every completed stage."""

import json
import os
import subprocess
import sys

import pytest
import yaml

from helpers import FAST_COMPILE, micro_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _small_recipe(path):
    """configs/recipes/tiny-cpu.yaml with every stage cut to a few steps and a few eval tasks, on the tiny model
    cut to an attention and an MLP layer (every later stage inherits the base's config; the stages' plumbing,
    not the layer kinds, is under test here)."""
    with open(os.path.join(ROOT, "configs/recipes/tiny-cpu.yaml")) as f:
        r = yaml.safe_load(f)
    r["base"]["overrides"] = ["steps=4", "eval_every=0", "checkpoint.every=0", "data.seq_len=128",
                              f"model.config={micro_model(os.path.dirname(path))}"]
    r["sft"]["overrides"] = ["steps=2", "lora.targets=[]", "eval_every=0", "checkpoint.every=0", "data.seq_len=128"]
    warm = os.path.join(os.path.dirname(path), "warm.yaml")  # a warm start cut to 2 steps on 8 demonstrations
    with open(warm, "w") as f:
        yaml.safe_dump({"steps": 2, "eval_every": 0, "checkpoint": {"every": 0}, "logging": {"tensorboard": False},
                        "model": {"config": "tiny", "init": "random"}, "lora": {"targets": ["all"]},
                        "data": {"eval": None, "seq_len": 64, "batch_size": 4, "sources": [
                            {"env": "arithmetic", "env_args": {"n_train": 8, "n_eval": 3}, "tasks": 8}]}}, f)
    for e in r["experts"]:  # both experts with the same shapes: the second reuses the first's compiled programs
        keep = [o for o in e["overrides"] if not o.startswith(("steps=", "rollout.max_new_tokens=", "rollout.seq_len="))]
        e["overrides"] = keep + ["steps=2", "rollout.group_size=2", "rollout.groups_per_step=2",
                                 "rollout.max_new_tokens=16", "rollout.seq_len=128", "logging.tensorboard=false"]
        if not any(o == "lora.init=null" for o in keep):  # (the constraints expert's warm start: in the run)
            e["overrides"].append(f"lora.init_sft_config={warm}")
    for e in r["eval"]["envs"]:
        e["args"] = dict(e["args"], n_train=8, n_eval=3)
    r["eval"]["attempts"], r["eval"]["max_new_tokens"] = 1, 8
    with open(path, "w") as f:
        yaml.safe_dump(r, f)


def _run(recipe, run_dir):
    env = dict(os.environ, XLA_FLAGS=FAST_COMPILE, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
    return subprocess.run([sys.executable, "-m", "nemo_jax.cli", "recipe", str(recipe), f"run_dir={run_dir}"],
                          env=env, cwd=ROOT, capture_output=True, text=True, timeout=900)


@pytest.mark.slow
def test_recipe_runs_every_stage_and_a_rerun_skips_them(tmp_path):
    recipe, run = tmp_path / "recipe.yaml", tmp_path / "run"
    _small_recipe(recipe)
    out = _run(recipe, run)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    stages = ["base", "sft", "base-merge", "expert-arithmetic", "expert-constraints", "final"]
    for d in ("base", "sft", "base-merge", "expert-arithmetic/adapters", "expert-constraints/adapters", "final",
              "expert-constraints-warm/adapters"):  # (the constraints expert's warm start, made in the run)
        assert (run / d).is_dir(), d
    assert not (run / "expert-arithmetic-warm").exists()
    assert (run / "final" / "config.json").exists() and any(f.endswith(".safetensors")
                                                             for f in os.listdir(run / "final"))
    table = json.loads((run / "report.json").read_text())
    assert list(table) == stages and all(set(v) == {"arithmetic", "constraints"} for v in table.values())
    assert all(0.0 <= c["reward_mean"] <= 1.0 and c["tasks"] == 3 for v in table.values() for c in v.values())
    md = (run / "report.md").read_text()
    assert all(f"| {s} |" in md for s in stages) and (run / "report.png").stat().st_size > 1000
    # the expert merge added both adapters (at their weights) to the base merge: the final model differs from it
    assert "add_adapters" in out.stdout
    again = _run(recipe, run)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    done = [line for line in again.stdout.splitlines() if line.startswith("[recipe]")]
    assert len(done) == 6 and all(": done (" in line for line in done), done
    assert "eval" not in again.stdout.split("[recipe] final")[1].split("#")[0]  # scores were kept, not recomputed


def test_shipped_recipes_load():
    from nemo_jax.recipe import load_recipe_config

    for name in sorted(os.listdir(os.path.join(ROOT, "configs/recipes"))):
        c = load_recipe_config(os.path.join(ROOT, "configs/recipes", name))
        assert c.experts and all(os.path.exists(os.path.join(ROOT, e.config)) for e in c.experts), name
        assert all(e.env for e in c.eval.envs)


def _without_matplotlib(monkeypatch):
    for m in ("matplotlib", "matplotlib.figure", "matplotlib.backends.backend_agg"):
        monkeypatch.setitem(sys.modules, m, None)  # import raises ImportError, as on the base install


def test_without_matplotlib_the_recipe_says_so_before_it_starts_and_writes_report_md_without_the_figure(
        tmp_path, monkeypatch, capsys):
    from nemo_jax.recipe import Recipe, load_recipe_config

    path = os.path.join(ROOT, "configs/recipes/tiny-cpu.yaml")
    r = Recipe(load_recipe_config(path, [f"run_dir={tmp_path / 'run'}"]), path)
    assert r.preflight() == []  # (matplotlib is installed here)
    _without_matplotlib(monkeypatch)
    notes = r.preflight()
    assert len(notes) == 1 and "matplotlib" in notes[0] and "report.md" in notes[0]
    os.makedirs(tmp_path / "run")
    (tmp_path / "run" / "report.png").write_bytes(b"an earlier run's figure")
    r.write_report(["# table", "| stage | x |"], {"base": {"x": 0.5}, "final": {"x": 0.7}})
    md = (tmp_path / "run" / "report.md").read_text()
    assert md.startswith("# table") and "matplotlib is not installed" in md
    assert sorted(os.listdir(tmp_path / "run")) == ["report.md"]  # no stale figure, no temporary left
    said = [x for x in capsys.readouterr().out.splitlines() if "matplotlib" in x]
    assert len(said) == 1


def test_the_recipe_refuses_a_missing_extra_before_any_stage(tmp_path, monkeypatch):
    from nemo_jax.recipe import Recipe, load_recipe_config

    path = os.path.join(ROOT, "configs/recipes/tiny-cpu.yaml")
    r = Recipe(load_recipe_config(path, [f"run_dir={tmp_path / 'run'}", 'eval.envs=[{"env": "mcp"}]']), path)
    monkeypatch.setitem(sys.modules, "mcp", None)
    with pytest.raises(ValueError, match="eval.envs: environment 'mcp': .*mcp"):
        r.preflight()
    assert not os.path.exists(tmp_path / "run")
