"""Native checkpoints of model parameters (orbax), with restore onto any mesh, and the integrity of run
checkpoint steps.

Layout of a native model directory:
    config.json              the HF-style model config (NemotronHConfig.to_hf_dict)
    params/                  orbax PyTree checkpoint of the parameter tree
    tokenizer files          copied along when the source had them
    nemo_jax-manifest.json   size and xxh3 hash of every file (`fsutil.write_manifest`), checked before a load

A run's checkpoints (RUN/checkpoints/N, written by `nemo_jax.train.checkpoint.RunCheckpointer`) carry the same
manifest, written once orbax has finalised the step; `latest_good_step` is the one answer to "which step can be
read": the newest whose files match their manifest (a damaged one is named once and, when healing, moved aside
to N.damaged).
The trainer's run checkpoints (params + optimiser + data state) live in `nemo_jax.train.checkpoint`; turning any
path (native, HF, run dir) into a model is `nemo_jax.sources`. This layer knows no HF names.
"""

from __future__ import annotations

import os
import sys

import jax
import numpy as np
import orbax.checkpoint as ocp

from nemo_jax.config.model import NemotronHConfig, write_config
from nemo_jax.fsutil import Damage, atomic_dir, copy_tokenizer_files, has_manifest, move_aside, verify_manifest
from nemo_jax.model.spec import PARAM_LAYOUT, ParamSpec, check_param_layout, param_specs


def target_tree(cfg: NemotronHConfig, mesh=None, rules=None, dtype=None, like=None):
    """Abstract params with shardings for restore. `like`: a tree of ShapeDtypeStructs whose dtypes to keep."""
    from nemo_jax.parallel.rules import Rules

    if mesh is None:
        dev = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        shard = lambda s: dev
    else:
        rules = rules or Rules()
        shard = lambda s: rules.sharding(mesh, s.axes, s.shape)
    tree = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, dtype or s.dtype, sharding=shard(s)),
                        param_specs(cfg), is_leaf=lambda x: isinstance(x, ParamSpec))
    if like is not None and dtype is None:
        tree = jax.tree.map(lambda t, l: jax.ShapeDtypeStruct(t.shape, l.dtype, sharding=t.sharding), tree, like)
    return tree


def save_model(path: str, cfg: NemotronHConfig, params, *, tokenizer_dir: str | None = None,
               overwrite: bool = False):
    """Write a native model directory, whole or not at all (an existing `path` is replaced only with
    `overwrite` and only when it is an earlier native model written here: `nemo_jax.fsutil.check_output`)."""
    with atomic_dir(path, "native model", overwrite=overwrite, manifest=True) as tmp:
        write_config(cfg, tmp)
        write_layout(tmp, PARAM_LAYOUT)
        ckptr = ocp.PyTreeCheckpointer()
        tree = _dicts(params)
        save_args = jax.tree.map(lambda _: ocp.SaveArgs(chunk_byte_size=CHUNK_BYTES), tree)
        ckptr.save(os.path.join(tmp, "params"), args=ocp.args.PyTreeSave(tree, save_args=save_args))
        copy_tokenizer_files(tokenizer_dir, tmp)
    return os.path.abspath(path)


def is_native(path: str) -> bool:
    return os.path.isdir(os.path.join(path, "params")) and os.path.exists(os.path.join(path, "config.json"))


def check_model_dir(path: str):
    """Raise CorruptCheckpoint when a native model directory's files differ from its manifest (every byte is
    read); a directory written before manifests existed is not checked."""
    damage, _ = verify_manifest(path)
    if damage is not None:
        raise CorruptCheckpoint(f"{os.path.join(path, damage.file)}: {damage.reason} (the model directory is "
                                "damaged: restore it from its source, e.g. import or export it again)")


def load_model(path: str, mesh=None, rules=None, dtype=None):
    """-> (cfg, params), each leaf placed in its NamedSharding on `mesh` (single device if None)."""
    if not is_native(path):
        raise FileNotFoundError(f"{path}: not a native nemo_jax model (needs config.json and params/)")
    check_model_dir(path)
    cfg = NemotronHConfig.from_file(os.path.join(path, "config.json"))
    check_param_layout(read_layout(path), path, cfg)
    ckptr = ocp.StandardCheckpointer()
    meta = ckptr.metadata(os.path.join(path, "params"))
    meta = getattr(meta, "item_metadata", meta)
    like = jax.tree.map(lambda m: jax.ShapeDtypeStruct(tuple(m.shape), np.dtype(m.dtype)), _as_tree(meta))
    target = target_tree(cfg, mesh, rules, dtype, like=like if _same_structure(like, cfg) else None)
    return cfg, _lists(ckptr.restore(os.path.join(path, "params"), _dicts(target)))


def restore_tree(path: str, device=None):
    """Restore any orbax pytree checkpoint onto one device (lists come back as lists)."""
    path = os.path.abspath(path)
    ckptr = ocp.StandardCheckpointer()
    meta = ckptr.metadata(path)
    meta = getattr(meta, "item_metadata", meta)
    dev = jax.sharding.SingleDeviceSharding(device or jax.devices()[0])
    raw = getattr(meta, "tree", meta)
    target = jax.tree.map(lambda m: jax.ShapeDtypeStruct(tuple(m.shape), np.dtype(m.dtype), sharding=dev), raw)
    return _lists(ckptr.restore(path, target))


def lazy_model(path: str):
    """-> (cfg, NativeReader) reading region by region from a native model, for streaming export without
    holding the model (or even one stacked leaf) in memory."""
    if not is_native(path):
        raise FileNotFoundError(f"{path}: not a native nemo_jax model (needs config.json and params/)")
    check_model_dir(path)
    cfg = NemotronHConfig.from_file(os.path.join(path, "config.json"))
    check_param_layout(read_layout(path), path, cfg)
    return cfg, NativeReader(os.path.join(path, "params"))


# --------------------------------------------------------------------------- run checkpoint steps
class CorruptCheckpoint(ValueError):
    """A checkpoint whose files do not match their manifest."""


def step_dirs(ckpt_dir: str) -> list[int]:
    """The committed steps (folders named by their number) of a run's checkpoint folder, oldest first."""
    return [s for s, is_dir in _step_entries(ckpt_dir) if is_dir]


def _step_entries(ckpt_dir: str) -> list[tuple[int, bool]]:
    """(step, whether it is a folder) of every entry named by a number, oldest first: a step that is a file or a
    symbolic link leading nowhere (a loop, a target gone) is listed too, to be named, not skipped unseen."""
    try:
        names = os.listdir(ckpt_dir)
    except FileNotFoundError:
        return []
    return sorted((int(n), os.path.isdir(os.path.join(ckpt_dir, n))) for n in names if n.isdigit())


_WARNED: set = set()


def warn_damaged(step_dir: str, damage: Damage, action: str):
    """Say once per process that checkpoint `step_dir` is damaged, naming the file and what is done."""
    key = (os.path.abspath(step_dir), damage.file)
    if key in _WARNED:
        return
    _WARNED.add(key)
    what = f"{damage.file}: " if damage.file else ""
    print(f"warning: checkpoint {step_dir} is damaged: {what}{damage.reason}; {action}", file=sys.stderr, flush=True)


def set_aside(step_dir: str) -> str:
    """Move a damaged step out of the way (N -> N.damaged, or N.damaged-2, ...; never deleted) -> the new path."""
    return move_aside(step_dir, "damaged")


def _decodes(step_dir: str) -> Damage | None:
    """A step without a manifest (written before manifests existed, or killed while being sealed): read every
    array of its orbax items through tensorstore, one storage chunk at a time, and parse its JSON items -> the
    first failure, or None. (Handing such a step to orbax's restore instead fails from inside its event loop,
    which is closed while sibling reads are still in flight: each then prints an `Event loop is closed`
    traceback.)"""
    import json

    for item in sorted(os.listdir(step_dir)):
        d = os.path.join(step_dir, item)
        if not os.path.isdir(d):
            continue
        if not os.path.exists(os.path.join(d, "_METADATA")):  # a JSON item
            for name in os.listdir(d):
                if name.endswith("metadata") or name.endswith(".json"):
                    try:
                        with open(os.path.join(d, name)) as f:
                            json.load(f)
                    except (OSError, ValueError) as e:
                        return Damage(f"{item}/{name}", f"unreadable ({type(e).__name__})")
            continue
        try:
            reader = NativeReader(d)
        except Exception as e:  # noqa: BLE001 - whatever orbax / tensorstore raise on a damaged metadata file
            return Damage(f"{item}/_METADATA", f"unreadable ({type(e).__name__})")
        for leaf in reader.paths():
            try:
                shape = tuple(reader[leaf].shape)
                rows = reader.chunks(leaf)[0] if shape else 1
                for r0 in range(0, shape[0] if shape else 1, max(1, rows)):
                    reader.read(leaf, (slice(r0, r0 + rows),) if shape else ())
            except Exception as e:  # noqa: BLE001 - tensorstore reports a damaged chunk as ValueError/Exception
                first = str(e).splitlines()[0][:120] if str(e) else ""
                return Damage(f"{item}/{leaf}", f"cannot be read ({type(e).__name__}: {first})")
    return None


STEP_RECORD = os.path.join("meta", "metadata")  # what every reader of a step reads first (config, model config)


def step_damage(step_dir: str) -> Damage | None:
    """What is wrong with a run checkpoint step: its files against its manifest (every byte read), or for a step
    without one, whether its record is there and every array decodes (`_decodes`). A step that is not a folder
    (a symbolic link that loops or leads nowhere, a file) is damaged too."""
    if not os.path.isdir(step_dir):
        kind = "a symbolic link that leads nowhere (a loop, or its target is gone)" if os.path.islink(step_dir) \
            else "not a folder"
        return Damage("", kind)
    if has_manifest(step_dir):
        return verify_manifest(step_dir)[0]
    if not os.path.isfile(os.path.join(step_dir, STEP_RECORD)):
        return Damage(STEP_RECORD, "missing, and the step has no manifest: it is incomplete (a save or a copy cut "
                                   "short)")
    return _decodes(step_dir)


def latest_good_step(ckpt_dir: str, *, heal: bool = False, verify: bool = True) -> int | None:
    """The newest step of `ckpt_dir` that is good (`step_damage`: its files match its manifest; a step without a
    manifest, written before manifests existed or killed while being sealed, decodes), or None.

    Every damaged step passed over is named once on stderr; with `heal` (the run's own trainer, on its primary
    process) it is moved aside to N.damaged, so the step is written again when training passes it. Readers
    (generate, eval, export, merge, model.init) do not heal: they leave the run dir as it is. `verify=False`
    trusts every step (the newest is returned)."""
    ckpt_dir = os.path.abspath(ckpt_dir)
    for step, _ in reversed(_step_entries(ckpt_dir)):
        d = os.path.join(ckpt_dir, str(step))
        damage = step_damage(d) if verify else None
        if damage is None:
            return step
        if heal:
            warn_damaged(d, damage, f"moved aside to {set_aside(d)}; using the previous step (this one is saved "
                                    "again when training passes it)")
        else:
            warn_damaged(d, damage, "using the previous step")
    return None


def step_verified(step_dir: str) -> bool:
    """Whether a step carries a manifest (its files were checked by `latest_good_step`)."""
    return has_manifest(step_dir)


# The streaming native format (orbax layout, written and read region by region) lives in `nemo_jax.tensorio`.
from nemo_jax.tensorio import CHUNK_BYTES, NativeReader, NativeWriter, read_layout, write_layout  # noqa: E402,F401


def _dicts(tree):
    """Lists -> dicts keyed '0', '1', ... (the on-disk form; `_lists` undoes it)."""
    if isinstance(tree, dict):
        return {k: _dicts(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return {str(i): _dicts(v) for i, v in enumerate(tree)}
    return tree


def _as_tree(meta):
    tree = getattr(meta, "tree", meta)
    return _lists(tree)


def _lists(tree):
    """orbax returns lists as dicts keyed '0', '1', ...; turn them back into lists."""
    if isinstance(tree, dict):
        if tree and all(k.isdigit() for k in tree):
            return [_lists(tree[str(i)]) for i in range(len(tree))]
        return {k: _lists(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return [_lists(v) for v in tree]
    return tree


def _same_structure(like, cfg) -> bool:
    specs = param_specs(cfg)
    return jax.tree.structure(like) == jax.tree.structure(
        jax.tree.map(lambda s: 0, specs, is_leaf=lambda x: isinstance(x, ParamSpec)))
