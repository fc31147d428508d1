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
