"""Native checkpoints of model parameters (orbax), with restore onto any mesh.

Layout of a native model directory:
    config.json        the HF-style model config (NemotronHConfig.to_hf_dict)
    params/            orbax PyTree checkpoint of the parameter tree
    tokenizer files    copied along when the source had them
The trainer's run checkpoints (params + optimiser + data state) live in `nemo_jax.train.checkpoint`.
"""

from __future__ import annotations

import json
import os

import jax
import numpy as np
import orbax.checkpoint as ocp

from nemo_jax.config.model import NemotronHConfig
from nemo_jax.fsutil import RecentCache, atomic_dir, copy_tokenizer_files
from nemo_jax.model.spec import ParamSpec, param_specs


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
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(cfg.to_hf_dict(), f, indent=2)
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
    return cfg, NativeReader(os.path.join(path, "params"))


# --------------------------------------------------------------------------- streaming native format
# A params checkpoint in orbax's own on-disk layout (PyTree metadata + one zarr array per leaf, named by its
# keys joined with '.'), so `load_model` and every orbax restore read it like any other. The writer fills
# each leaf region by region, so a conversion never holds more than a few chunks in memory.
CHUNK_BYTES = 64 << 20
_TS_DTYPES = {"bfloat16", "float16", "float32", "float64", "int32", "int64", "int8", "uint8", "bool"}


class NativeWriter:
    """Write a params tree into `params_dir` leaf by leaf, region by region (single process)."""

    def __init__(self, params_dir: str, max_in_flight: int = 4):
        self.dir = os.path.abspath(params_dir)
        os.makedirs(self.dir, exist_ok=True)
        self.chunks: dict[str, list[int]] = {}  # leaf path -> its storage chunk shape
        self.pending: list = []
        self.max_in_flight = max_in_flight

    def create(self, path: str, shape, dtype, chunks):
        import tensorstore as ts

        dtype = np.dtype(dtype)
        if dtype.name not in _TS_DTYPES:
            raise ValueError(f"{path}: dtype {dtype} cannot be stored")
        name = path.replace("/", ".")
        self.chunks[path] = [max(1, c) for c in chunks]
        spec = {"driver": "zarr", "dtype": dtype.name, "kvstore": {"driver": "file", "path": os.path.join(self.dir, name)},
                "context": {"file_io_sync": False},  # `atomic_dir` syncs every file once before the rename
                "metadata": {"shape": list(shape), "chunks": self.chunks[path], "compressor": None,
                             "order": "C", "dimension_separator": "."},
                "create": True, "delete_existing": True}
        return ts.open(spec).result()

    def write(self, arr, region: tuple, x: np.ndarray):
        """Asynchronous; at most `max_in_flight` writes are outstanding (bounding the memory they hold)."""
        self.pending.append(arr[region].write(x))
        while len(self.pending) > self.max_in_flight:
            self.pending.pop(0).result()

    def finish(self):
        for f in self.pending:
            f.result()
        self.pending = []
        tree, arrays = {}, []
        for path, chunks in self.chunks.items():
            keys = tuple(path.split("/"))
            tree[str(keys)] = {"key_metadata": [{"key": k, "key_type": 2} for k in keys],
                               "value_metadata": {"value_type": "jax.Array", "skip_deserialize": False,
                                                  "write_shape": list(chunks)}}
            arrays.append({"array_metadata": {"param_name": ".".join(keys), "write_shape": list(chunks),
                                              "chunk_shape": list(chunks), "ext_metadata": None}})
        _write_json(os.path.join(self.dir, "_METADATA"),
                    {"tree_metadata": tree, "use_ocdbt": False, "use_zarr3": False,
                     "store_array_data_equal_to_fill_value": True, "custom_metadata": None})
        os.makedirs(os.path.join(self.dir, "array_metadatas"), exist_ok=True)
        _write_json(os.path.join(self.dir, "array_metadatas", "process_0"), {"array_metadatas": arrays})
        _write_json(os.path.join(self.dir, "_CHECKPOINT_METADATA"),
                    {"item_handlers": "orbax.checkpoint._src.handlers.pytree_checkpoint_handler.PyTreeCheckpointHandler",
                     "metrics": {}, "performance_metrics": {}, "custom_metadata": {}})
        with open(os.path.join(self.dir, "commit_success.txt"), "w") as f:
            f.write("Checkpoint successfully committed.")


class NativeReader:
    """Region reads from any orbax params checkpoint (ours, `save_model`'s, OCDBT or not) through
    tensorstore: `src[path]` is the leaf's ShapeDtypeStruct, `src.read(path, region)` a numpy array, and
    `src.chunks(path)` its storage chunk shape (read along it to decode each chunk once)."""

    def __init__(self, params_dir: str):
        from nemo_jax.model.spec import flatten_with_paths

        self.dir = os.path.abspath(params_dir)
        meta = ocp.PyTreeCheckpointer().metadata(self.dir)
        meta = getattr(meta, "item_metadata", meta)
        self._meta = flatten_with_paths(getattr(meta, "tree", meta))
        with open(os.path.join(self.dir, "_METADATA")) as f:
            self._ocdbt = bool(json.load(f).get("use_ocdbt", True))
        self._context = ocp.type_handlers.get_ts_context(use_ocdbt=self._ocdbt)
        self._store = RecentCache(self._open_store, keep=4)

    def paths(self):
        return self._meta.keys()

    def __getitem__(self, path):
        m = self._meta[path]
        return jax.ShapeDtypeStruct(tuple(m.shape), np.dtype(m.dtype))

    def _open_store(self, path):
        import tensorstore as ts
        from etils import epath

        info = ocp.type_handlers.ParamInfo(name=self._meta[path].name, parent_dir=epath.Path(self.dir),
                                           ts_context=self._context)
        spec = ocp.type_handlers.get_json_tspec_read(info, use_ocdbt=self._ocdbt)
        return ts.open(spec, open=True, context=self._context).result()

    def chunks(self, path) -> tuple:
        return tuple(self._store(path).chunk_layout.read_chunk.shape)

    def read(self, path, region=()) -> np.ndarray:
        return np.asarray(self._store(path)[region].read().result())


def _write_json(fp: str, obj):
    with open(fp, "w") as f:
        json.dump(obj, f)


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
