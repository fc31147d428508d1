"""Native checkpoints of model parameters (orbax), with restore onto any mesh.

Layout of a native model directory:
    config.json        the HF-style model config (NemotronHConfig.to_hf_dict)
    params/            orbax PyTree checkpoint of the parameter tree
    tokenizer files    copied along when the source had them
The trainer's run checkpoints (params + optimiser + data state) live in `nemo_jax.train.checkpoint`.
"""

from __future__ import annotations

import os

import jax
import numpy as np
import orbax.checkpoint as ocp

from nemo_jax.config.model import NemotronHConfig, write_config
from nemo_jax.fsutil import atomic_dir, copy_tokenizer_files
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


def save_model(path: str, cfg: NemotronHConfig, params, *, tokenizer_dir: str | None = None):
    with atomic_dir(path) as tmp:
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


def load_model(path: str, mesh=None, rules=None, dtype=None):
    """-> (cfg, params), each leaf placed in its NamedSharding on `mesh` (single device if None)."""
    if not is_native(path):
        raise FileNotFoundError(f"{path}: not a native nemo_jax model (needs config.json and params/)")
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


def load_any(path: str, dtype=None, mesh=None, rules=None):
    """A native model directory or an HF checkpoint directory -> (cfg, params) in their shardings."""
    from nemo_jax.hf.io import load_pretrained

    if is_native(path):
        return load_model(path, mesh=mesh, rules=rules, dtype=dtype)
    return load_pretrained(path, dtype=dtype, mesh=mesh, rules=rules)


def lazy_model(path: str):
    """-> (cfg, NativeReader) reading region by region from a native model, for streaming export without
    holding the model (or even one stacked leaf) in memory."""
    if not is_native(path):
        raise FileNotFoundError(f"{path}: not a native nemo_jax model (needs config.json and params/)")
    cfg = NemotronHConfig.from_file(os.path.join(path, "config.json"))
    check_param_layout(read_layout(path), path, cfg)
    return cfg, NativeReader(os.path.join(path, "params"))


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
