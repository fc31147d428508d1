"""Faults and recovery: outputs never replace what they did not make, temporaries of killed writers are cleared,
run checkpoints prove their integrity and heal (a damaged step is set aside, the previous one used, readers
fall back without touching the run), a failed async save is raised at the next check with its errno, one
resolver reads run dirs everywhere, non-finite tensors and escaping index entries are refused, and settings
are checked before JAX is imported."""

import errno
import glob
import json
import os
import socket
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from nemo_jax.checkpoint import save_model
from nemo_jax.cli import main
from nemo_jax.config.train import SFTConfig
from nemo_jax.fsutil import OUTPUT_MARKER, OutputExistsError, atomic_dir
from nemo_jax.hf.io import CheckpointError, import_pretrained, save_pretrained
from nemo_jax.hf.mapping import leaf_specs
from nemo_jax.model.spec import unflatten_paths
from nemo_jax.train.checkpoint import CheckpointWriteError, RunCheckpointer, abstract_like

from helpers import tiny_cfg

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CFG = tiny_cfg("M*E")


def rand_params(cfg, seed=0):
    rng = np.random.default_rng(seed)
    return unflatten_paths({p: (0.1 * rng.standard_normal(s.shape)).astype(np.float32)
                            for p, s in leaf_specs(cfg).items()})


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A native model dir and an HF dir of the same random tiny model."""
    d = tmp_path_factory.mktemp("models")
    params = rand_params(CFG)
    save_model(str(d / "native"), CFG, params)
    save_pretrained(CFG, params, str(d / "hf"))
    return d, params


def _cli(capsys, *argv) -> tuple[int, str]:
    """Run `nemo-jax argv` in-process -> (exit code, stderr)."""
    capsys.readouterr()
    try:
        main([str(a) for a in argv])
        code = 0
    except SystemExit as e:
        code = e.code
    return code, capsys.readouterr().err


def _user_folder(path):
    os.makedirs(path, exist_ok=True)
    (path / "notes.txt").write_text("mine")
    return path / "notes.txt"


# --------------------------------------------------------------------------- outputs
def test_commands_refuse_a_folder_they_did_not_make(models, tmp_path, capsys):
    d, _ = models
    recipe = tmp_path / "merge.yaml"
    recipe.write_text(json.dumps({"output": str(tmp_path / "x"), "models": {"base": str(d / "hf")},
                                  "rules": [{"match": ".*", "take": "base"}]}))
    commands = {
        "export-hf": ["export-hf", d / "native", "{out}"],
        "import-hf": ["import-hf", d / "hf", "{out}"],
        "merge": ["merge", recipe, "output={out}"],
        "data prepare": ["data", "prepare", os.path.join(ROOT, "nemo_jax/assets/tiny_chat/train.jsonl"),
                         "--tokenizer", "builtin:tiny", "--out", "{out}", "--workers", "1"],
    }
    for name, argv in commands.items():
        out = tmp_path / name.replace(" ", "-")
        mine = _user_folder(out)
        for extra in ([], ["--overwrite"]):
            code, err = _cli(capsys, *[str(a).replace("{out}", str(out)) for a in argv], *extra)
            assert code == 2 and len(err.strip().splitlines()) == 1, (name, extra, err)
            assert str(out) in err and "not" in err, (name, err)
            assert mine.read_text() == "mine" and sorted(os.listdir(out)) == ["notes.txt"], name
    # an earlier output of the command's own kind: refused without --overwrite, replaced with it; a user's file
    # put into it keeps it from being replaced; an output of another kind is never replaced
    out = tmp_path / "exported"
    assert _cli(capsys, "export-hf", d / "native", out)[0] == 0
    marker = json.loads((out / OUTPUT_MARKER).read_text())
    assert marker["kind"] == "HF checkpoint" and marker["command"] == "nemo-jax export-hf"
    code, err = _cli(capsys, "export-hf", d / "native", out)
    assert code == 2 and "--overwrite" in err
    assert _cli(capsys, "export-hf", d / "native", out, "--overwrite")[0] == 0
    (out / "notes.txt").write_text("mine")
    code, err = _cli(capsys, "export-hf", d / "native", out, "--overwrite")
    assert code == 2 and "'notes.txt'" in err and (out / "notes.txt").read_text() == "mine"
    os.remove(out / "notes.txt")
    code, err = _cli(capsys, "import-hf", d / "hf", out, "--overwrite")
    assert code == 2 and "holds a HF checkpoint" in err and (out / "model.safetensors").exists()
    # merge: `overwrite: true` in the recipe (or --overwrite) replaces its own earlier output
    assert _cli(capsys, "merge", recipe, f"output={tmp_path / 'merged'}")[0] == 0
    assert _cli(capsys, "merge", recipe, f"output={tmp_path / 'merged'}")[0] == 2
    assert _cli(capsys, "merge", recipe, f"output={tmp_path / 'merged'}", "overwrite=true")[0] == 0


def test_killed_writers_temporaries_are_cleared(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    host = socket.gethostname().replace("-", "_")
    out = tmp_path / "out"
    stale = tmp_path / f"out.tmp-{host}-{dead.pid}-abc"
    live = tmp_path / f"out.tmp-{host}-{os.getpid()}-def"  # a writer still running: left alone
    for t in (stale, live):
        os.makedirs(t)
        (t / "half.safetensors").write_bytes(b"x" * 10)
    with atomic_dir(out, "native model") as tmp:
        (open(os.path.join(tmp, "a"), "w")).close()
    assert not stale.exists() and live.exists() and (out / "a").exists()
    # a swap killed between its two renames: the previous output is rolled back into place
    old = tmp_path / f"prev.old-{host}-{dead.pid}-xyz"
    os.makedirs(old)
    (old / "model.safetensors").write_bytes(b"previous")
    with pytest.raises(OutputExistsError):  # rolled back, then (not marked as ours) not replaced
        with atomic_dir(tmp_path / "prev", "HF checkpoint"):
            pass
    assert (tmp_path / "prev" / "model.safetensors").read_bytes() == b"previous" and not old.exists()
    assert not glob.glob(str(tmp_path / "prev.tmp-*"))
    # data prepare: a shard stopped by a bad line leaves no temporary; one left by a killed run is removed
    from nemo_jax.data.chat import DataError
    from nemo_jax.data.prepared import prepare

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}\n'
                   "not json\n")
    with pytest.raises(DataError, match="bad.jsonl:2"):
        prepare([str(bad)], "builtin:tiny", str(tmp_path / "prep"))
    assert not (tmp_path / "prep").exists()  # it finished nothing: no skeleton left behind
    os.makedirs(tmp_path / "prep" / "shards")  # what a run killed mid-shard leaves
    (tmp_path / "prep" / "shards" / "left.array_record.tmp").write_bytes(b"x")
    good = tmp_path / "good.jsonl"
    good.write_text(bad.read_text().splitlines()[0] + "\n")
    prepare([str(good)], "builtin:tiny", str(tmp_path / "prep"))
    assert not glob.glob(str(tmp_path / "prep" / "shards" / "*.tmp"))


def test_nonfinite_tensors_and_escaping_index_entries(models, tmp_path, capsys):
    d, params = models
    bad = jax.tree.map(np.copy, params)
    bad["layers"]["mamba"]["mixer"]["in_proj"]["kernel"][0, 3, 5] = np.nan
    save_pretrained(CFG, bad, str(tmp_path / "nan_hf"), allow_nonfinite=True)
    code, err = _cli(capsys, "import-hf", tmp_path / "nan_hf", tmp_path / "imported")
    assert code == 2 and "backbone.layers.0.mixer.in_proj.weight" in err and "non-finite" in err
    assert not (tmp_path / "imported").exists()
    assert _cli(capsys, "import-hf", tmp_path / "nan_hf", tmp_path / "imported", "--allow-nonfinite")[0] == 0
    with pytest.raises(CheckpointError, match="in_proj.weight.*non-finite"):
        save_pretrained(CFG, bad, str(tmp_path / "out"))
    code, err = _cli(capsys, "export-hf", tmp_path / "imported", tmp_path / "exported")
    assert code == 2 and "in_proj.weight" in err and not (tmp_path / "exported").exists()
    recipe = tmp_path / "merge.yaml"
    recipe.write_text(json.dumps({"output": str(tmp_path / "merged"), "models": {"base": str(d / "hf"),
                                                                                  "other": str(tmp_path / "nan_hf")},
                                  "rules": [{"match": ".*", "linear": {"base": 0.5, "other": 0.5}}]}))
    code, err = _cli(capsys, "merge", recipe)
    assert code == 2 and "in_proj.weight" in err and not (tmp_path / "merged").exists()
    # an index entry pointing outside the checkpoint folder is refused, naming it
    import shutil

    from safetensors import safe_open

    shutil.copytree(d / "hf", tmp_path / "escape")
    with safe_open(str(d / "hf" / "model.safetensors"), "np") as f:
        wm = {k: "model.safetensors" for k in f.keys()}
    name = sorted(wm)[0]
    wm[name] = "../x.safetensors"
    (tmp_path / "escape" / "model.safetensors.index.json").write_text(json.dumps({"weight_map": wm}))
    with pytest.raises(CheckpointError, match=f"{name}.*outside the checkpoint folder"):
        import_pretrained(str(tmp_path / "escape"), str(tmp_path / "never"))


# --------------------------------------------------------------------------- run checkpoints
def _state(seed, n=24):
    """A train-state-like tree of `n` arrays."""
    k = jax.random.split(jax.random.key(seed), n)
    return {"params": {f"w{i}": jax.random.normal(k[i], (64, 32)) for i in range(n)}, "step": jnp.int32(seed)}


def _flip(step_dir, offset=0.5):
    f = max(glob.glob(os.path.join(step_dir, "state", "**", "d", "*"), recursive=True), key=os.path.getsize)
    n = os.path.getsize(f)
    with open(f, "r+b") as fh:
        fh.seek(int(n * offset))
        b = fh.read(64)
        fh.seek(int(n * offset))
        fh.write(bytes(x ^ 0xFF for x in b))
    return os.path.relpath(f, step_dir)


def test_damaged_step_is_set_aside_and_saved_again(tmp_path, capfd):
    ck_dir = tmp_path / "run" / "checkpoints"
    ck = RunCheckpointer(str(ck_dir), keep=5, async_save=True)
    for s in (1, 2, 3):
        ck.save(s, _state(s), {"pos": s}, {"config": {"data": {"tokenizer": "builtin:tiny"}}})
        ck.check()
    ck.close()
    assert all((ck_dir / str(s) / "nemo_jax-manifest.json").exists() for s in (1, 2, 3))
    target = abstract_like(_state(0), jax.tree.map(lambda x: x.sharding, _state(0)))
    damaged = _flip(str(ck_dir / "3"))
    # a reader falls back to the newest good step and leaves the run as it is; the step named is refused
    from nemo_jax.sources import Run, resolve

    capfd.readouterr()
    got = resolve(str(tmp_path / "run"))
    assert isinstance(got, Run) and got.step == 2 and (ck_dir / "3").exists()
    with pytest.raises(FileNotFoundError, match="3 is damaged.*" + os.path.basename(damaged)):
        resolve(str(ck_dir / "3"))
    # the trainer's restore: named once, moved aside, the previous step restored, the step saved again
    ck = RunCheckpointer(str(ck_dir), keep=5, async_save=False)
    step, state, data, _ = ck.restore_latest(target)
    err = capfd.readouterr().err
    assert step == 2 and data == {"pos": 2} and int(state["step"]) == 2
    assert err.count("is damaged") == 1 and os.path.basename(damaged) in err and "Traceback" not in err
    assert sorted(os.listdir(ck_dir)) == ["1", "2", "3.damaged"]
    ck.save(3, _state(3), {"pos": 3}, {})
    ck.close()
    assert sorted(os.listdir(ck_dir)) == ["1", "2", "3", "3.damaged"]
    # a step of another train state is an error naming the leaf, not damage
    other = abstract_like({"params": {"v": jnp.zeros(3)}, "step": jnp.int32(0)},
                          {"params": {"v": target["step"].sharding}, "step": target["step"].sharding})
    with pytest.raises(ValueError, match="another configuration"):
        RunCheckpointer(str(ck_dir), async_save=False).restore_latest(other)
    assert (ck_dir / "3").exists()


def test_unverified_damaged_step_falls_back_without_tracebacks(tmp_path, capfd, monkeypatch):
    """A step without a manifest (an older version's) that orbax cannot read: detected by reading it chunk by
    chunk, never handed to orbax's restore (whose event loop closes on the first failed read while sibling reads
    are in flight: each then prints an `Event loop is closed` traceback, ~80 of them on a cold page cache)."""
    import orbax.checkpoint as ocp

    restored = []
    orig = ocp.CheckpointManager.restore
    monkeypatch.setattr(ocp.CheckpointManager, "restore",
                        lambda self, step, *a, **k: restored.append(step) or orig(self, step, *a, **k))
    ck_dir = tmp_path / "checkpoints"
    ck = RunCheckpointer(str(ck_dir), keep=5, async_save=False)
    for s in (1, 2):
        ck.save(s, _state(s, n=64), {"pos": s}, {})
    ck.close()
    for s in (1, 2):
        if (ck_dir / str(s) / "nemo_jax-manifest.json").exists():
            os.remove(ck_dir / str(s) / "nemo_jax-manifest.json")
    for f in glob.glob(str(ck_dir / "2" / "state" / "**" / "d" / "*"), recursive=True):
        with open(f, "r+b") as fh:
            fh.truncate(100)
    capfd.readouterr()
    target = abstract_like(_state(0, n=64), jax.tree.map(lambda x: x.sharding, _state(0, n=64)))
    step, *_ = RunCheckpointer(str(ck_dir), async_save=False).restore_latest(target)
    err = capfd.readouterr().err
    assert "Event loop is closed" not in err and "Traceback" not in err, err[-2000:]
    assert restored == [1] and step == 1 and os.path.isdir(ck_dir / "2.damaged")


def test_failed_async_save_is_raised_at_the_next_check(tmp_path, monkeypatch):
    from orbax.checkpoint._src.checkpointers import async_checkpointer

    ck = RunCheckpointer(str(tmp_path / "ck"), keep=3, async_save=True)
    ck.save(1, _state(1), {}, {})
    ck.wait()

    wait = async_checkpointer._background_wait_for_commit_futures

    def full_disk(directory, commit_futures, on_commit_callback, **kw):  # the writes end, the commit fails
        wait(directory, commit_futures, lambda: None, **kw)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(async_checkpointer, "_background_wait_for_commit_futures", full_disk)
    assert ck.save(2, _state(2), {}, {})  # returns at once; the write fails in the background
    ck._sealer.join(timeout=60)
    with pytest.raises(CheckpointWriteError) as e:
        ck.check()
    assert e.value.errno == errno.ENOSPC and "checkpoint step 2" in str(e.value) and "ENOSPC" in str(e.value)
    assert str(tmp_path / "ck" / "2") in str(e.value) and "resumes from step 1" in str(e.value)
    assert sorted(os.listdir(tmp_path / "ck")) == ["1"]  # no orbax temporary left behind


# --------------------------------------------------------------------------- one resolver
def test_run_dirs_are_read_everywhere(models, tmp_path, capsys):
    """A (fabricated) full SFT run and a LoRA run over the native model: export-hf, merge, lora export and
    load_any read them through `nemo_jax.sources`."""
    import dataclasses

    from safetensors import safe_open

    from nemo_jax.config.load import load_config
    from nemo_jax.lora import LoraConfig, init_adapters, merge_adapters
    from nemo_jax.sources import load_any

    d, params = models
    trained = jax.tree.map(lambda x: jnp.asarray(x) + 0.01, params)
    c = load_config(SFTConfig, None, [f"run_dir={tmp_path / 'sft'}"])
    ck = RunCheckpointer(str(tmp_path / "sft" / "checkpoints"), async_save=False)
    ck.save(2, {"params": trained, "opt_state": jax.tree.map(jnp.zeros_like, trained)}, {},
            {"config": dataclasses.asdict(c), "model_config": CFG.to_hf_dict()})
    ck.close()
    lc = LoraConfig(("attention",), rank=2, alpha=4.0)
    adapters = jax.tree_util.tree_map_with_path(
        lambda p, x: x + 0.1 if getattr(p[-1], "key", "") == "lora_b" else x, init_adapters(CFG, lc))
    c = load_config(SFTConfig, None, [f"model.init={d / 'native'}", "lora.targets=[attention]", "lora.rank=2",
                                      "lora.alpha=4.0"])
    ck = RunCheckpointer(str(tmp_path / "lora" / "checkpoints"), async_save=False)
    ck.save(3, {"params": adapters}, {}, {"config": dataclasses.asdict(c), "model_config": CFG.to_hf_dict()})
    ck.close()

    def tensors(path):
        with safe_open(str(path / "model.safetensors"), "np") as f:
            return {k: f.get_tensor(k) for k in f.keys()}

    assert _cli(capsys, "export-hf", tmp_path / "sft", tmp_path / "sft_hf")[0] == 0
    assert _cli(capsys, "export-hf", tmp_path / "sft" / "checkpoints" / "2", tmp_path / "step_hf")[0] == 0
    assert (tmp_path / "sft_hf" / "tokenizer.json").exists()  # the run's tokenizer comes along
    ref = tmp_path / "ref_hf"
    save_pretrained(CFG, trained, str(ref))
    for got in (tensors(tmp_path / "sft_hf"), tensors(tmp_path / "step_hf")):
        want = tensors(ref)
        assert got.keys() == want.keys() and all(np.array_equal(got[k], want[k]) for k in want)
    # the LoRA run as a model: its base with the adapters merged, streamed (export) or loaded (load_any)
    assert _cli(capsys, "export-hf", tmp_path / "lora", tmp_path / "lora_hf")[0] == 0
    save_pretrained(CFG, merge_adapters(params, jax.tree.map(np.asarray, adapters)), str(tmp_path / "ref_lora"))
    got, want = tensors(tmp_path / "lora_hf"), tensors(tmp_path / "ref_lora")
    assert all(np.allclose(got[k], want[k], atol=1e-6) for k in want)
    _, loaded = load_any(str(tmp_path / "lora"))
    q = loaded["layers"]["attention"]["mixer"]["q_proj"]["kernel"]
    assert not np.allclose(np.asarray(q), params["layers"]["attention"]["mixer"]["q_proj"]["kernel"])
    # as adapters: lora export, and a merge whose models are run dirs
    assert _cli(capsys, "lora", "export", tmp_path / "lora", tmp_path / "peft")[0] == 0
    assert json.loads((tmp_path / "peft" / "adapter_config.json").read_text())["lora_alpha"] == 4.0
    recipe = tmp_path / "m.yaml"
    recipe.write_text(json.dumps({"output": str(tmp_path / "m"), "models": {"base": str(d / "native"),
                                                                            "sft": str(tmp_path / "sft")},
                                  "adapters": {"lora": str(tmp_path / "lora")},
                                  "rules": [{"match": "q_proj", "add_adapters": {"lora": 1.0}},
                                            {"match": ".*", "take": "sft"}]}))
    assert _cli(capsys, "merge", recipe)[0] == 0
    m, sft = tensors(tmp_path / "m"), tensors(ref)
    q = "backbone.layers.1.mixer.q_proj.weight"
    assert np.allclose(m[q], want[q], atol=1e-6) and not np.allclose(m[q], sft[q])  # base + the run's adapters
    k = "backbone.layers.0.mixer.in_proj.weight"
    assert np.array_equal(m[k], sft[k])  # the SFT run's params


# --------------------------------------------------------------------------- settings
@pytest.mark.parametrize("argv, key", [
    (["sft", "data.batch_size=0"], "data.batch_size"), (["sft", "data.seq_len=0"], "data.seq_len"),
    (["sft", "log_every=0"], "log_every"), (["sft", "steps=-5"], "steps"), (["sft", "checkpoint.keep=0"], "keep"),
    (["sft", "optim.b2=1.5"], "optim.b2"), (["sft", "lora.rank=0"], "lora.rank"), (["sft", "mesh.data=0"], "mesh.data"),
    (["sft", "badkey=1"], "badkey"), (["sft", "--bogus"], "--bogus"),
    (["grpo", "--config", "configs/grpo/tiny-cpu.yaml", "rollout.group_size=1"], "rollout.group_size"),
    (["eval", "--ckpt", "x", "--env", "arithmetic", "--attempts", "0"], "--attempts"),
    (["plan", "--devices", "0", "--device-kind", "h100"], "--devices"),
    (["generate", "--ckpt", "x", "--prompt", "p", "--top-p", "0"], "--top-p"),
    (["export-hf", "a", "b", "--dtype", "bf17"], "--dtype"), (["serve", "--ckpt", "x", "--dtype", "f32"], "--dtype"),
    (["sft", "mesh.tensor=3"], "tensor=3"), (["grpo", "--config", "configs/grpo/tiny-cpu.yaml", "mesh.fsdp=3"], "fsdp"),
    (["sft", "optim.lrr=1"], "did you mean 'optim.lr'"), (["sft", "steps=many"], "steps"),
])
def test_bad_settings_fail_in_one_line_before_jax(tmp_path, argv, key):
    run = tmp_path / "run"
    code = ("import sys; from nemo_jax.cli import main\ntry:\n    main(sys.argv[1:])\nexcept SystemExit as e:\n"
            "    print('jax imported' if 'jax' in sys.modules else 'no jax', file=sys.stderr); raise")
    p = subprocess.run([sys.executable, "-c", code, *argv, *([f"run_dir={run}"] if argv[0] == "sft" else [])],
                       cwd=ROOT, capture_output=True, text=True, timeout=60,
                       env=dict(os.environ, PYTHONPATH=ROOT))
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 2 and lines[-1] == "no jax" and len(lines) == 2, p.stderr
    assert "error:" in lines[0] and key in lines[0], lines[0]
    assert not run.exists()


def test_lm_head_adapter_checkpoint_round_trip(tmp_path):
    """An adapter set whose scale is a scalar (lm_head) is written as a scalar and read back; one written as [1]
    (by earlier versions: np.ascontiguousarray made it 1-d, and it was then refused) is read too."""
    from safetensors.numpy import load_file, save_file

    from nemo_jax.lora import LoraConfig, init_adapters, load_adapter_checkpoint, save_adapter_checkpoint

    lc = LoraConfig(("lm_head",), rank=2, alpha=4.0)
    save_adapter_checkpoint(str(tmp_path / "a"), CFG, lc, init_adapters(CFG, lc))
    tensors = load_file(str(tmp_path / "a" / "adapters.safetensors"))
    assert tensors["lm_head/lora_scale"].shape == ()
    assert load_adapter_checkpoint(str(tmp_path / "a"))[2]["lm_head"]["lora_scale"] == np.float32(2.0)
    save_file({**tensors, "lm_head/lora_scale": np.array([2.0], np.float32)}, str(tmp_path / "a" / "adapters.safetensors"))
    assert load_adapter_checkpoint(str(tmp_path / "a"))[2]["lm_head"]["lora_scale"].shape == ()


# --------------------------------------------------------------------------- second fault round (issues 49, 50)
def _fake_run(path, params, cfg=CFG, step=2, config=None):
    """A full SFT run dir holding one checkpoint step of `params` (what readers need of a run)."""
    import dataclasses

    c = config or SFTConfig(run_dir=str(path))
    ck = RunCheckpointer(str(path / "checkpoints"), async_save=False)
    ck.save(step, {"params": params}, {}, {"config": dataclasses.asdict(c), "model_config": cfg.to_hf_dict()})
    ck.close()
    return path / "checkpoints"


def test_readers_pass_over_a_partial_step_and_name_a_looping_one(models, tmp_path, capfd):
    """A step folder cut short (no manifest, no meta/metadata: a copy or a save cut short) and a step that is a
    symbolic link looping on itself: every reader names each once and reads the newest good step; the run's
    trainer sets both aside."""
    import shutil

    from nemo_jax.sources import load_for_generation, resolve

    d, params = models
    ck = _fake_run(tmp_path / "run", jax.tree.map(jnp.asarray, params))
    os.makedirs(ck / "3" / "state")
    shutil.copytree(ck / "2" / "state" / "d", ck / "3" / "state" / "d")
    os.symlink("4", ck / "4")
    capfd.readouterr()
    assert resolve(str(tmp_path / "run")).step == 2
    err = capfd.readouterr().err
    assert "checkpoints/3 is damaged: meta/metadata: missing" in err and "incomplete" in err, err
    assert "checkpoints/4 is damaged: a symbolic link that leads nowhere" in err, err
    assert _cli(capfd, "export-hf", tmp_path / "run", tmp_path / "hf")[0] == 0  # export-hf
    recipe = tmp_path / "m.yaml"
    recipe.write_text(json.dumps({"output": str(tmp_path / "m"), "models": {"base": str(d / "native"),
                                                                            "sft": str(tmp_path / "run")},
                                  "rules": [{"match": ".*", "linear": {"base": 0.5, "sft": 0.5}}]}))
    assert _cli(capfd, "merge", recipe)[0] == 0  # merge
    _, got, _ = load_for_generation(str(tmp_path / "run"))  # generate, eval
    assert all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(jax.tree.leaves(got),
                                                                             jax.tree.leaves(params)))
    with pytest.raises(FileNotFoundError, match="symbolic link that leads nowhere"):
        resolve(str(ck / "4"))
    assert sorted(os.listdir(ck)) == ["2", "3", "4"]  # readers never change the run
    target = abstract_like({"params": jax.tree.map(jnp.asarray, params)},
                           jax.tree.map(lambda x: jax.devices()[0] and x.sharding, {"params": jax.tree.map(
                               jnp.asarray, params)}))
    step, *_ = RunCheckpointer(str(ck), async_save=False).restore_latest(target)
    assert step == 2 and sorted(os.listdir(ck)) == ["2", "3.damaged", "4.damaged"]


def test_damaged_steps_missing_manifest_zero_length_or_unreadable(tmp_path, capfd, monkeypatch):
    """A step whose manifest alone is missing is checked by reading every array, and used; a step whose files are
    zero-length, or unreadable (chmod 000), is named, set aside and the previous one used."""
    import stat

    from nemo_jax import fsutil

    if os.geteuid() == 0:  # root reads a chmod 000 file: make it fail as it does for everyone else
        digest = fsutil._digest

        def _digest(fp, *a):
            if stat.S_IMODE(os.stat(fp).st_mode) == 0:
                raise PermissionError(errno.EACCES, "Permission denied", fp)
            return digest(fp, *a)

        monkeypatch.setattr(fsutil, "_digest", _digest)
    ck_dir = tmp_path / "checkpoints"
    ck = RunCheckpointer(str(ck_dir), keep=5, async_save=False)
    for s in (1, 2, 3):
        ck.save(s, _state(s), {"pos": s}, {})
    ck.close()
    target = abstract_like(_state(0), jax.tree.map(lambda x: x.sharding, _state(0)))
    os.remove(ck_dir / "3" / "nemo_jax-manifest.json")
    capfd.readouterr()
    step, state, _, _ = RunCheckpointer(str(ck_dir), async_save=False).restore_latest(target)
    assert step == 3 and int(state["step"]) == 3 and "damaged" not in capfd.readouterr().err
    for f in glob.glob(str(ck_dir / "3" / "state" / "**" / "d" / "*"), recursive=True):
        open(f, "w").close()  # zero-length
    step, *_ = RunCheckpointer(str(ck_dir), async_save=False).restore_latest(target)
    assert step == 2 and os.path.isdir(ck_dir / "3.damaged") and "3 is damaged" in capfd.readouterr().err
    f = max(glob.glob(str(ck_dir / "2" / "state" / "**" / "d" / "*"), recursive=True), key=os.path.getsize)
    os.chmod(f, 0)
    try:
        step, *_ = RunCheckpointer(str(ck_dir), async_save=False).restore_latest(target)
        err = capfd.readouterr().err
        assert step == 1 and "2 is damaged" in err and "unreadable (Permission denied)" in err, err
    finally:
        for g in glob.glob(str(tmp_path / "**" / "*"), recursive=True):
            os.chmod(g, 0o755) if os.path.isdir(g) else os.chmod(g, 0o644)


def test_rerun_with_other_settings_is_refused(tmp_path, capsys):
    """A rerun on a run dir holding checkpoints refuses settings that differ from the run's (one line naming the
    keys; its config.yaml untouched); settings of how it runs may change; --new-run moves the run aside."""
    import dataclasses

    from nemo_jax.config.load import dump_yaml
    from nemo_jax.config.train import check_rerun, load_grpo_config, load_sft_config
    from nemo_jax.train.sft import start_run

    run = tmp_path / "run"
    os.makedirs(run / "checkpoints" / "300")
    (run / "config.yaml").write_text(dump_yaml(load_sft_config(None, [f"run_dir={run}"])))
    before = (run / "config.yaml").read_bytes()
    code, err = _cli(capsys, "sft", "steps=60", "optim.lr=1e-3", f"run_dir={run}")
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "steps 300 -> 60" in err and "optim.lr 0.003 -> 0.001" in err and "--new-run" in err, err
    assert (run / "config.yaml").read_bytes() == before
    check_rerun(load_sft_config(None, [f"run_dir={run}", "log_every=5", "mesh.fsdp=2", "checkpoint.every=7",
                                       "data.workers=2", "name=renamed"]), str(run))  # how it runs: allowed
    g = load_grpo_config(os.path.join(ROOT, "configs/grpo/tiny-cpu.yaml"), [f"run_dir={tmp_path / 'g'}"])
    os.makedirs(tmp_path / "g" / "checkpoints" / "20")
    (tmp_path / "g" / "config.yaml").write_text(dump_yaml(g))
    with pytest.raises(ValueError, match=r"rollout.group_size 8 -> 4"):
        check_rerun(dataclasses.replace(g, rollout=dataclasses.replace(g.rollout, group_size=4)), str(tmp_path / "g"))
    # raising `steps` extends the run (sft and grpo), saying how the schedule changes; lowering it, or raising it
    # together with a setting that changes what is trained, is refused
    note = check_rerun(load_sft_config(None, [f"run_dir={run}", "steps=400"]), str(run))
    assert "steps raised from 300 to 400" in note and "decay now ends at step 400" in note, note
    assert check_rerun(load_sft_config(None, [f"run_dir={run}"]), str(run)) is None
    with pytest.raises(ValueError, match=r"optim.lr 0.003 -> 0.001") as e:
        check_rerun(load_sft_config(None, [f"run_dir={run}", "steps=400", "optim.lr=1e-3"]), str(run))
    assert "steps" not in str(e.value).split("(")[1].split(")")[0]
    assert "steps raised from" in check_rerun(dataclasses.replace(g, steps=g.steps + 10), str(tmp_path / "g"))
    with pytest.raises(ValueError, match=rf"steps {g.steps} -> {g.steps - 1}"):
        check_rerun(dataclasses.replace(g, steps=g.steps - 1), str(tmp_path / "g"))
    c = load_sft_config(None, [f"run_dir={run}", "steps=60"])
    start_run(str(run), c, "sft", new_run=True)
    assert "moved aside to" in capsys.readouterr().out
    assert not run.exists() and (tmp_path / "run.prev" / "config.yaml").read_bytes() == before
    os.makedirs(run / "checkpoints" / "60")
    start_run(str(run), c, "sft", new_run=True)
    assert (tmp_path / "run.prev-2" / "checkpoints" / "60").is_dir()


def test_recipe_stops_at_a_stopped_stage(tmp_path, monkeypatch, capsys):
    """A training stage that stops early (SIGTERM) writes no stage output, stops the recipe (exit 3, one line)
    and nothing after it runs; a trainer puts the signal handlers it replaced back."""
    import signal

    import yaml

    from nemo_jax.train import sft
    from nemo_jax.train.checkpoint import catch_stop_signals

    ran = []
    monkeypatch.setattr(sft, "main", lambda path, overrides=(), **k: ran.append(path) or {"step": 33,
                                                                                            "stopped_early": True})
    recipe = tmp_path / "r.yaml"
    with open(os.path.join(ROOT, "configs/recipes/tiny-cpu.yaml")) as f:
        r = yaml.safe_load(f)
    recipe.write_text(yaml.safe_dump({**r, "run_dir": str(tmp_path / "run")}))
    code, err = _cli(capsys, "recipe", recipe)
    assert code == 3 and len(err.strip().splitlines()) == 1, err
    assert "stopped at stage base" in err and "step 33" in err and "rerun" in err, err
    assert len(ran) == 1 and not (tmp_path / "run" / "base").exists() and not (tmp_path / "run" / "sft").exists()
    before = signal.getsignal(signal.SIGTERM)
    restore = catch_stop_signals(lambda signum: None)
    assert signal.getsignal(signal.SIGTERM) is not before
    restore()
    assert signal.getsignal(signal.SIGTERM) is before


def test_plan_without_the_plan_gpu_extra(monkeypatch, capsys):
    """Without jax-cuda12-plugin (the `jax_plugins` namespace missing): --target gpu is one line naming the extra;
    without --target the plan runs on the cpu target and says so."""
    import importlib.util

    from nemo_jax.plan.targets import default_target, plugin_installed

    real = importlib.util.find_spec

    def find_spec(name, *a, **k):
        if name == "jax_plugins" or name.startswith("jax_plugins."):
            raise ModuleNotFoundError("No module named 'jax_plugins'", name="jax_plugins")
        return real(name, *a, **k)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    assert plugin_installed("gpu") is False and default_target("h100") == "cpu"
    code, err = _cli(capsys, "plan", "--devices", "64", "--device-kind", "h100", "--target", "gpu")
    assert code == 2 and len(err.strip().splitlines()) == 1 and "pip install 'nemo_jax[plan-gpu]'" in err, err
    code, err = _cli(capsys, "plan", "--devices", "8", "--device-kind", "h100", "--mesh", "tensor=3")
    assert "note: planning on the cpu target, an estimate" in err and "plan-gpu" in err, err
    assert code == 2 and "tensor=3" in err.strip().splitlines()[-1]  # (stopped by the mesh, before compiling)


def test_outputs_get_the_users_umask(models, tmp_path):
    """Published outputs (exports, merges, policy versions, adapter dirs) are readable by others as mkdir and
    open would make them, not private to the writer."""
    from nemo_jax.fsutil import atomic_write_text

    d, params = models
    old = os.umask(0o022)
    try:
        save_pretrained(CFG, params, str(tmp_path / "hf"))
        atomic_write_text(str(tmp_path / "LATEST"), "3\n")
        os.umask(0o077)
        save_model(str(tmp_path / "private"), CFG, params)
    finally:
        os.umask(old)
    mode = lambda p: oct(os.stat(p).st_mode & 0o777)  # noqa: E731
    assert mode(tmp_path / "hf") == "0o755" and mode(tmp_path / "hf" / "model.safetensors") == "0o644"
    assert mode(tmp_path / "LATEST") == "0o644"
    assert mode(tmp_path / "private") == "0o700"


def test_an_output_is_never_its_input_nor_inside_it(models, tmp_path, capsys):
    import hashlib
    import shutil

    d, _ = models
    shutil.copytree(d / "hf", tmp_path / "x")
    assert _cli(capsys, "export-hf", d / "native", tmp_path / "y")[0] == 0  # an HF checkpoint nemo-jax wrote
    digest = hashlib.sha1((tmp_path / "y" / "model.safetensors").read_bytes()).hexdigest()
    code, err = _cli(capsys, "export-hf", tmp_path / "y", tmp_path / "y", "--overwrite", "--dtype", "bf16")
    assert code == 2 and "is the input" in err and len(err.strip().splitlines()) == 1, err
    assert hashlib.sha1((tmp_path / "y" / "model.safetensors").read_bytes()).hexdigest() == digest
    code, err = _cli(capsys, "export-hf", tmp_path / "x", tmp_path / "x" / "inner")
    assert code == 2 and "lies inside the input" in err and not (tmp_path / "x" / "inner").exists()
    (tmp_path / "file").write_text("mine")
    code, err = _cli(capsys, "import-hf", tmp_path / "x", tmp_path / "file")
    assert code == 2 and "not a folder" in err and (tmp_path / "file").read_text() == "mine"
    recipe = tmp_path / "m.yaml"
    recipe.write_text(json.dumps({"output": str(tmp_path / "x" / "merged"), "models": {"base": str(tmp_path / "x")},
                                  "rules": [{"match": ".*", "take": "base"}]}))
    code, err = _cli(capsys, "merge", recipe)
    assert code == 2 and "lies inside the input" in err
    os.makedirs(tmp_path / "data")
    shutil.copy(os.path.join(ROOT, "nemo_jax/assets/tiny_chat/eval.jsonl"), tmp_path / "data" / "a.jsonl")
    code, err = _cli(capsys, "data", "prepare", tmp_path / "data" / "a.jsonl", "--tokenizer", "builtin:tiny",
                     "--out", tmp_path / "data")
    assert code == 2 and "holds the input" in err and sorted(os.listdir(tmp_path / "data")) == ["a.jsonl"]


def test_an_unexpected_tensor_names_the_flag(models, tmp_path, capsys):
    import shutil

    from safetensors.numpy import load_file, save_file

    d, _ = models
    shutil.copytree(d / "hf", tmp_path / "hf")
    t = load_file(str(tmp_path / "hf" / "model.safetensors"))
    save_file({**t, "backbone.extra.weight": np.zeros(3, np.float32)}, str(tmp_path / "hf" / "model.safetensors"))
    code, err = _cli(capsys, "import-hf", tmp_path / "hf", tmp_path / "n")
    assert code == 2 and "backbone.extra.weight" in err and "--ignore-unexpected" in err, err
    assert _cli(capsys, "import-hf", tmp_path / "hf", tmp_path / "n", "--ignore-unexpected")[0] == 0


def test_a_full_disk_is_one_line(tmp_path, capsys, monkeypatch):
    """`lora export` on a full disk (safetensors' own error type) and an async checkpoint save that fails in
    orbax's background threads (a file size limit: EFBIG, as ENOSPC takes the same path): one line each, no
    traceback."""
    import safetensors.numpy
    from safetensors import SafetensorError

    from nemo_jax.lora import LoraConfig, init_adapters, save_adapter_checkpoint

    lc = LoraConfig(("attention",), rank=2, alpha=4.0)
    save_adapter_checkpoint(str(tmp_path / "a"), CFG, lc, init_adapters(CFG, lc))

    def full(*a, **k):
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(safetensors.numpy, "save_file", full)
    code, err = _cli(capsys, "lora", "export", tmp_path / "a", tmp_path / "peft")
    assert code == 1 and err.strip().splitlines() == [
        f"nemo-jax lora export: error: {tmp_path / 'peft'}: [Errno 28] No space left on device (ENOSPC)"], err
    assert sorted(os.listdir(tmp_path)) == ["a"]
    script = ("import resource, signal, sys\nsignal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
              "import jax, jax.numpy as jnp\nfrom nemo_jax.train.checkpoint import RunCheckpointer\n"
              "k = jax.random.split(jax.random.key(0), 60)\n"
              "state = {'params': {f'w{i}': jax.random.normal(k[i], (256, 256)) for i in range(60)}}\n"
              "ck = RunCheckpointer(sys.argv[1], async_save=True)\n"
              "resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, resource.RLIM_INFINITY))\n"
              "try:\n    ck.save(1, state, {}, {})\n    ck.wait()\nexcept OSError as e:\n"
              "    print(f'nemo-jax sft: error: {e}', file=sys.stderr)\n")
    p = subprocess.run([sys.executable, "-c", script, str(tmp_path / "ck")], cwd=ROOT, capture_output=True,
                       text=True, timeout=120, env=dict(os.environ, PYTHONPATH=ROOT))
    lines = [x for x in p.stderr.splitlines() if "cudart_stub" not in x and "absl::InitializeLog" not in x]
    assert len(lines) == 1 and "checkpoint step 1 could not be written" in lines[0] and "EFBIG" in lines[0], \
        p.stderr[-3000:]
    assert os.listdir(tmp_path / "ck") == []


def _jsonl(path, lines):
    path.write_bytes(b"".join((x if isinstance(x, bytes) else json.dumps(x).encode()) + b"\n" for x in lines))
    return str(path)


def test_data_prepare_names_every_bad_line(tmp_path, capsys):
    """Non-UTF-8 bytes, an unknown role, a message without a role, a malformed line: each an error naming
    FILE:LINE, or with --on-error skip recorded under the file's own line number (in any shard) and said; an
    empty file is one line; a prepare that finishes nothing leaves no folder."""
    from nemo_jax.data.chat import DataError, ChatTokenizer, read_chat_jsonl
    from nemo_jax.data.prepared import prepare

    conv = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello there"}]}
    bad = {2: b'{"messages": [{"role": "user", "content": "caf\xe9"}, {"role": "assistant", "content": "ok"}]}',
           5: {"messages": [{"role": "wizard", "content": "hi"}, {"role": "assistant", "content": "ok"}]},
           7: {"messages": [{"content": "hi"}, {"role": "assistant", "content": "ok"}]},
           9: b"{not json"}
    want = {2: r"not UTF-8: byte 0xe9 at column 47 \(invalid continuation byte\)",
            5: r"messages\[0\]: unknown role 'wizard'", 7: r'messages\[0\] needs string "role"', 9: "not valid JSON"}
    for line, reason in want.items():
        path = _jsonl(tmp_path / f"bad{line}.jsonl", [conv] * (line - 1) + [bad[line]] + [conv])
        with pytest.raises(DataError, match=f"bad{line}.jsonl:{line}: {reason}"):
            prepare([path], "builtin:tiny", str(tmp_path / "out"))
        assert not (tmp_path / "out").exists()  # it finished nothing: nothing left behind
    with pytest.raises(DataError, match="bad2.jsonl:2: not UTF-8"):  # the eval file too
        read_chat_jsonl(str(tmp_path / "bad2.jsonl"), ChatTokenizer.load("builtin:tiny"), 4096)
    # skipped lines in later shards keep the file's line numbers
    lines = [conv] * 400
    for n, at in zip(want, (100, 250, 350, 400)):
        lines[at - 1] = bad[n]
    path = _jsonl(tmp_path / "mixed.jsonl", lines)
    code, err = _cli(capsys, "data", "prepare", path, "--tokenizer", "builtin:tiny", "--out", tmp_path / "p",
                     "--on-error", "skip", "--shard-mb", "1", "--workers", "1")
    assert code == 0 and "skipped 4 lines" in err and f"{path}:100: not UTF-8" in err, err
    from nemo_jax.data.prepared import read_manifest

    m = read_manifest(str(tmp_path / "p"))
    assert m["documents"] == 396 and [r["line"] for r in m["rejected"]] == [100, 250, 350, 400]
    m = prepare([path], "builtin:tiny", str(tmp_path / "q"), on_error="skip", chunk_bytes=4_000)
    assert len(m["shards"]) > 4 and [(r["line"], r["reason"][:10]) for r in m["rejected"]] == [
        (100, "not UTF-8:"), (250, "messages[0"), (350, "messages[0"), (400, "not valid ")]
    # an empty file: one line naming it, and an empty folder given as --out is left as it was
    os.makedirs(tmp_path / "empty-out")
    code, err = _cli(capsys, "data", "prepare", _jsonl(tmp_path / "empty.jsonl", []), "--tokenizer",
                     "builtin:tiny", "--out", tmp_path / "empty-out", "--workers", "1")
    assert code == 2 and "empty.jsonl: no usable conversations (the files hold no lines)" in err, err
    assert os.listdir(tmp_path / "empty-out") == []


@pytest.mark.slow
def test_data_prepare_keeps_a_5mb_message(tmp_path):
    """A 5 MB message is one document of its full length (4.2M tokens with the tiny tokenizer), never dropped."""
    from nemo_jax.data.prepared import prepare

    big = {"messages": [{"role": "user", "content": "write"}, {"role": "assistant", "content": "word " * (1 << 20)}]}
    m = prepare([_jsonl(tmp_path / "big.jsonl", [big])], "builtin:tiny", str(tmp_path / "p"))
    assert m["documents"] == 1 and m["max_length"] > 4_000_000 and m["rejected_count"] == 0


def test_run_dir_reads_print_no_orbax_warning(models, tmp_path, caplog):
    """Reading a run dir (generate, eval, export-hf, lora export) logs no orbax "Metadata file does not exist"
    warning: a run step's items carry no step metadata of their own."""
    import logging

    from nemo_jax.sources import open_lazy, restore_run_params

    _, params = models
    ck = _fake_run(tmp_path / "run", jax.tree.map(jnp.asarray, params))
    with caplog.at_level(logging.WARNING):
        _, reader, _ = open_lazy(str(tmp_path / "run"))
        restore_run_params(str(ck / "2" / "state"))
    assert not [r for r in caplog.records if "Metadata file does not exist" in r.getMessage()], caplog.text
    assert len(list(reader.paths())) == len(jax.tree.leaves(params))


def test_plot_keeps_the_policy_loss_apart_and_colours_each_reward(tmp_path):
    """A GRPO run's `loss` (its policy loss) is not drawn on the SFT cross-entropy axis, and its 8 reward series
    get 8 colours, also when overlaid with an SFT run."""
    from nemo_jax.plot import figures

    for name, recs in (("sft", [{"step": s, "loss": 5.0 / s, "eval_loss": 6.0 / s} for s in range(1, 31)]),
                       ("grpo", [{"step": s, "loss": 0.01 * s, "reward_mean": 0.1 * (s % 5),
                                  "reward_mean_uniform": 0.2, "reward_mean/constraints": 0.3, "eval_reward_mean": 0.4,
                                  "eval_pass@1": 0.5, "eval_pass@2": 0.6, "eval_success_rate": 0.7,
                                  "eval_consistency": 0.8} for s in range(1, 31)])):
        os.makedirs(tmp_path / name)
        (tmp_path / name / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    figs = dict(figures([str(tmp_path / "sft"), str(tmp_path / "grpo")]))
    labels = lambda fig, i=0: {ln.get_label(): ln for ln in fig.axes[i].get_lines()  # noqa: E731
                               if not ln.get_label().startswith("_")}
    assert set(labels(figs["loss"])) == {"sft: loss", "sft: eval_loss"}
    assert set(labels(figs["policy_loss"])) == {"grpo: policy_loss"}
    rewards = labels(figs["reward"])
    assert len(rewards) == 8 and len({ln.get_color() for ln in rewards.values()}) == 8


def test_eval_and_sft_say_what_they_do(tmp_path, monkeypatch, capsys):
    """`eval` names what it loads before loading it (it was silent for 40 s); the first `sft` line names the run
    once and no config.yaml that may never be written."""
    from nemo_jax import sources
    from nemo_jax.train import sft

    def stop(*a, **k):
        raise FileNotFoundError("stopped here")

    monkeypatch.setattr(sources, "load_for_generation", stop)
    code, err = _cli(capsys, "eval", "--ckpt", tmp_path / "m", "--env", "arithmetic")
    assert code == 2 and err.splitlines()[0] == f"eval: loading {tmp_path / 'm'}", err
    monkeypatch.setattr(sft, "Trainer", stop)
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        main(["sft", f"run_dir={tmp_path / 'run'}"])
    out = capsys.readouterr().out
    assert e.value.code == 2 and not (tmp_path / "run").exists()
    assert out.startswith(f"sft: run 'sft' from the embedded tiny CPU config, 300 steps of 8 x 256 tokens, into "
                          f"{tmp_path / 'run'}") and "sft sft" not in out and "config.yaml" not in out, out


def test_readme_first_hour_commands_agree():
    """The README's first hour: the LoRA and GRPO runs start from runs/sft (no retrained copy), the eval line
    scores the GRPO run's own environment settings, the plan line uses the GPU compiler after installing it."""
    import re
    import shlex

    import yaml

    text = open(os.path.join(ROOT, "README.md")).read()
    block = text.split("## A first hour", 1)[1].split("```bash", 1)[1].split("```", 1)[0].replace("\\\n", " ")
    lines = [shlex.split(x.split(" #")[0]) for x in block.splitlines() if "nemo-jax" in x]
    made = {"runs/sft"}  # the Quick start's `nemo-jax sft`
    for argv in lines:
        cmd = argv[argv.index("nemo-jax") + 1:]
        sets = dict(a.split("=", 1) for a in cmd if "=" in a and not a.startswith("-"))
        if cmd[0] in ("sft", "grpo") and "--config" in cmd:
            with open(os.path.join(ROOT, cmd[cmd.index("--config") + 1])) as f:
                c = yaml.safe_load(f)
            init = sets.get("model.init", c["model"]["init"])
            assert init == "random" or init in made, (cmd, init)
            made.add(sets.get("run_dir", f"runs/{c['name']}"))
            if cmd[0] == "grpo":
                grpo = c
        if cmd[0] == "eval":
            args = dict(zip(cmd[1::2], cmd[2::2]))
            assert json.loads(args["--env-args"]) == grpo["rollout"]["env_args"]
            assert int(args["--max-new-tokens"]) == grpo["rollout"]["max_new_tokens"]
            assert args["--env"] == grpo["rollout"]["env"] and args["--ckpt"] in made
        if cmd[0] == "plan":
            assert "--target" in cmd and cmd[cmd.index("--target") + 1] == "gpu"
            assert re.search(r"pip install .*'\.\[plan-gpu\]'", block)


def _nemo(argv, tmp_path, patch: str = ""):
    """`python -m nemo_jax.cli argv` as a process (stdout and stderr to files under tmp_path; `patch`: Python run
    first, e.g. to make a step hang at a known point) -> (Popen, stdout path, stderr path)."""
    from helpers import FAST_COMPILE

    k = len(glob.glob(str(tmp_path / "out-*.txt")))
    out, err = tmp_path / f"out-{k}.txt", tmp_path / f"err-{k}.txt"
    code = patch + "\nimport sys\nfrom nemo_jax.cli import main\nmain(sys.argv[1:])\n"
    env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1",
               XLA_FLAGS=f"{FAST_COMPILE} --xla_force_host_platform_device_count=1")
    p = subprocess.Popen([sys.executable, "-c", code, *map(str, argv)], cwd=ROOT, env=env,
                         stdout=open(out, "w"), stderr=open(err, "w"))
    return p, out, err


def _wait_for(p, path, text: str, timeout: float = 300.0):
    """Wait until `text` appears in file `path` (the process still running), or fail."""
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if os.path.exists(path) and text in open(path).read():
            return
        assert p.poll() is None, f"exited {p.returncode} before {text!r}: {open(path).read()[-3000:]}"
        time.sleep(0.1)
    p.kill()
    raise AssertionError(f"no {text!r} in {timeout} s: {open(path).read()[-3000:]}")


def _wait_for_file(p, path, err, timeout: float = 300.0):
    import time

    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if p.poll() is not None or time.monotonic() > deadline:
            p.kill()
            raise AssertionError(f"{path} never appeared: {open(err).read()[-3000:]}")
        time.sleep(0.1)


HANG = ("import os, time\n"
        "def hang(*a, **k):\n"
        "    open(os.environ['NEMO_JAX_TEST_SENTINEL'], 'w').close()\n"
        "    time.sleep(900)\n")


@pytest.mark.slow
def test_recipe_stopped_and_killed_mid_stage_and_mid_merge_then_rerun(tmp_path):
    """SIGTERM during the base stage: the recipe stops there (exit 3), writes no base, builds nothing on it. A
    rerun resumes the base run; SIGKILL while the base merge is being written leaves its temporary; the next
    rerun skips the finished stages, removes the temporary, writes the merge and finishes."""
    import signal

    import yaml

    from helpers import micro_model

    run = tmp_path / "run"
    quick = ["eval_every=0", "data.eval=null", "data.seq_len=128", "log_every=1"]
    arith = {"n_train": 8, "n_eval": 2}
    # (the micro model: every stage inherits the base's config; stages and processes are under test, not layers)
    recipe = {"name": "kill", "run_dir": str(run),
              "base": {"sft_config": "configs/sft/tiny-cpu.yaml",
                       "overrides": quick + ["steps=40", "checkpoint.every=1",  # (stopped in its first steps)
                                             f"model.config={micro_model(str(tmp_path))}"]},
              "sft": {"config": "configs/sft/tiny-lora-cpu.yaml",
                      "overrides": quick + ["steps=2", "lora.targets=[]", "checkpoint.every=0"]},
              "base_merge": {"recipe": "configs/merge/base-merge-qk-restore.yaml"},
              "experts": [{"name": "a", "config": "configs/grpo/tiny-cpu.yaml", "overrides": [
                  "steps=1", "eval_every=0", "rollout.env=arithmetic", f"rollout.env_args={json.dumps(arith)}",
                  "rollout.group_size=2", "rollout.groups_per_step=1", "rollout.max_new_tokens=8",
                  "rollout.seq_len=64", "rollout.publish_every=0", "logging.tensorboard=false", "lora.init=null"]}],
              "expert_merge": {"recipe": "configs/merge/add-experts.yaml"},
              "eval": {"envs": [{"env": "arithmetic", "args": arith}], "attempts": 1, "max_new_tokens": 4}}
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    p, out, err = _nemo(["recipe", path], tmp_path)
    _wait_for(p, out, "compiled and ran step")
    p.send_signal(signal.SIGTERM)
    assert p.wait(timeout=120) == 3, open(err).read()[-3000:]
    assert "nemo-jax recipe: stopped at stage base" in open(err).read()
    assert not (run / "base").exists() and not (run / "sft-run").exists()
    stopped_at = max(int(n) for n in os.listdir(run / "base-run" / "checkpoints") if n.isdigit())
    assert 0 < stopped_at < 40
    sentinel = tmp_path / "merging"
    merge_hangs = HANG + ("import nemo_jax.merge.engine as e\nfrom nemo_jax.fsutil import atomic_dir\n"
                          "def save(cfg, src, path, **k):\n"
                          "    with atomic_dir(path, 'HF checkpoint') as tmp:\n"
                          "        open(os.path.join(tmp, 'model.safetensors'), 'w').write('half written')\n"
                          "        hang()\n"
                          "e.save_pretrained = save\n")
    os.environ["NEMO_JAX_TEST_SENTINEL"] = str(sentinel)
    try:
        p, out, err = _nemo(["recipe", path], tmp_path, merge_hangs)
        _wait_for_file(p, sentinel, err)
    finally:
        os.environ.pop("NEMO_JAX_TEST_SENTINEL")
    p.kill()
    p.wait()
    text = open(out).read()
    assert f"at step {stopped_at}" in text and "[recipe] sft ->" in text, text[-3000:]
    assert (run / "base").is_dir() and (run / "sft").is_dir() and not (run / "base-merge").exists()
    assert glob.glob(str(run / "base-merge.tmp-*"))
    p, out, err = _nemo(["recipe", path], tmp_path)
    assert p.wait(timeout=600) == 0, open(err).read()[-3000:]
    text = open(out).read()
    assert "[recipe] base: done" in text and "[recipe] sft: done" in text and "[recipe] base-merge ->" in text
    assert not glob.glob(str(run / "base-merge.tmp-*")) and (run / "final" / "config.json").exists()
    assert json.loads((run / "report.json").read_text())["final"]["arithmetic"]["tasks"] == 2


@pytest.mark.slow
def test_grpo_killed_in_its_first_compile_and_in_a_save_then_stopped_then_rerun(tmp_path):
    """SIGKILL while the first step compiles, then while step 1 is being sealed (its manifest not written): each
    rerun continues (the unsealed step is read by decoding every array). SIGTERM: the run saves, says it stopped
    and writes no adapters/; the last rerun completes them."""
    import signal

    from helpers import micro_model

    run = tmp_path / "g"
    argv = ["grpo", "--config", "configs/grpo/tiny-cpu.yaml", f"run_dir={run}", "model.init=random",
            f"model.config={micro_model(str(tmp_path))}", "model.init_sft_config=null", "lora.init=null",
            "steps=3", "eval_every=0",
            "rollout.env=arithmetic", "rollout.env_args={n_train: 8, n_eval: 2}", "rollout.group_size=2",
            "rollout.groups_per_step=1", "rollout.max_new_tokens=8", "rollout.seq_len=64", "rollout.publish_every=0",
            "checkpoint.every=1", "logging.tensorboard=false"]
    p, out, err = _nemo(argv, tmp_path)
    _wait_for(p, out, "groups x 2 rollouts per step")  # the header: the first step (its compile) comes next
    p.kill()
    p.wait()
    assert not glob.glob(str(run / "checkpoints" / "[0-9]*")) and not (run / "adapters").exists()
    sentinel = tmp_path / "sealing"
    os.environ["NEMO_JAX_TEST_SENTINEL"] = str(sentinel)
    try:
        p, out, err = _nemo(argv, tmp_path, HANG + "import nemo_jax.train.checkpoint as c\nc.write_manifest = hang\n")
        _wait_for_file(p, sentinel, err)
    finally:
        os.environ.pop("NEMO_JAX_TEST_SENTINEL")
    p.kill()
    p.wait()
    assert (run / "checkpoints" / "1" / "meta" / "metadata").exists()
    assert not (run / "checkpoints" / "1" / "nemo_jax-manifest.json").exists()
    p, out, err = _nemo(argv, tmp_path)
    _wait_for(p, out, "(resumed at step 1)")
    p.send_signal(signal.SIGTERM)
    assert p.wait(timeout=300) == 0, open(err).read()[-3000:]
    assert "stopped at step" in open(out).read() and not (run / "adapters").exists()
    assert "damaged" not in open(err).read()
    p, out, err = _nemo(argv, tmp_path)
    assert p.wait(timeout=300) == 0, open(err).read()[-3000:]
    assert "done at step 3" in open(out).read() and (run / "adapters").is_dir()


def test_the_mesh_error_is_two_sentences_properly_joined(tmp_path, capsys):
    """A mesh that does not fit this CPU host's devices: one line, the mesh's reason, then how many devices the
    host has (it used to splice "of this CPU host" after the reason's closing parenthesis)."""
    for mesh, reason in (("mesh.fsdp=16", "mesh: fsdp=16 uses 16 devices, 8 are available (set one axis to -1 to "
                                          "take the devices left over); this CPU host has 8 devices ("),
                         ("mesh.tensor=3", "does not divide the 8 devices; this CPU host has 8 devices (")):
        code, err = _cli(capsys, "sft", mesh, f"run_dir={tmp_path / 'r'}")
        assert code == 2 and len(err.strip().splitlines()) == 1 and reason in err and ") of this" not in err, err
