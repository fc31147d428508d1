"""The low-level tensor reading/writing layer shared by conversion (`nemo_jax.hf.io`), native checkpoints
(`nemo_jax.checkpoint`) and merging (`nemo_jax.merge`): region reads from and region writes to orbax params
directories. It imports neither of those modules, so the dependency runs one way:
`merge -> checkpoint -> hf.io -> tensorio`.
"""

from __future__ import annotations

import json
import os

import jax
import numpy as np
import orbax.checkpoint as ocp

from nemo_jax.fsutil import RecentCache

# --------------------------------------------------------------------------- streaming native format
# A params checkpoint in orbax's own on-disk layout (PyTree metadata + one zarr array per leaf, named by its
# keys joined with '.'), so `load_model` and every orbax restore read it like any other. The writer fills
# each leaf region by region, so a conversion never holds more than a few chunks in memory.
CHUNK_BYTES = 64 << 20
_TS_DTYPES = {"bfloat16", "float16", "float32", "float64", "int32", "int64", "int8", "uint8", "bool"}


class NativeWriter:
    """Write a params tree into `params_dir` leaf by leaf, region by region. Several processes may share one
    directory, each creating its own leaves and `declare`-ing the others'; one of them writes the metadata."""

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
        self.declare(path, chunks)
        spec = {"driver": "zarr", "dtype": dtype.name, "kvstore": {"driver": "file", "path": os.path.join(self.dir, name)},
                "context": {"file_io_sync": False},  # `atomic_dir` syncs every file once before the rename
                "metadata": {"shape": list(shape), "chunks": self.chunks[path], "compressor": None,
                             "order": "C", "dimension_separator": "."},
                "create": True, "delete_existing": True}
        return ts.open(spec).result()

    def declare(self, path: str, chunks):
        """List leaf `path` (with its storage chunk shape) in the metadata `finish` writes."""
        self.chunks[path] = [max(1, c) for c in chunks]

    def write(self, arr, region: tuple, x: np.ndarray):
        """Asynchronous; at most `max_in_flight` writes are outstanding (bounding the memory they hold)."""
        self.pending.append(arr[region].write(x))
        while len(self.pending) > self.max_in_flight:
            self.pending.pop(0).result()

    def finish(self, metadata: bool = True):
        """Wait for every write; then (metadata=True) write orbax's metadata for every created or declared leaf."""
        for f in self.pending:
            f.result()
        self.pending = []
        if not metadata:
            return
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


def tree_metadata(item_dir: str):
    """The tree of array metadata (shape, dtype) of an orbax PyTree item (a native model's params/, a run step's
    state/), read by the item's handler: a run step's items carry no step metadata of their own, which
    `PyTreeCheckpointer.metadata` would warn about on every read."""
    from etils import epath

    meta = ocp.PyTreeCheckpointHandler().metadata(epath.Path(os.path.abspath(item_dir)))
    return getattr(meta, "tree", meta)


class NativeReader:
    """Region reads from any orbax params checkpoint (ours, `save_model`'s, OCDBT or not) through
    tensorstore: `src[path]` is the leaf's ShapeDtypeStruct, `src.read(path, region)` a numpy array, and
    `src.chunks(path)` its storage chunk shape (read along it to decode each chunk once)."""

    def __init__(self, params_dir: str, prefix: str = ""):
        """`prefix`: only the subtree under this key, its paths relative to it (e.g. "params" of a run
        checkpoint's train state)."""
        from nemo_jax.model.spec import flatten_with_paths

        self.dir = os.path.abspath(params_dir)
        flat = flatten_with_paths(tree_metadata(self.dir))
        head = prefix.rstrip("/") + "/" if prefix else ""
        self._meta = {k[len(head):]: v for k, v in flat.items() if k.startswith(head)}
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


LAYOUT_FILE = "nemo_jax.json"  # beside a native model's config.json: {"param_layout": N}


def write_layout(model_dir: str, layout: int):
    """Record the parameter layout (`nemo_jax.model.spec.PARAM_LAYOUT`) of a native model directory."""
    _write_json(os.path.join(model_dir, LAYOUT_FILE), {"param_layout": layout})


def read_layout(model_dir: str) -> int:
    """The parameter layout a native model directory records (1: none recorded, written before the record)."""
    fp = os.path.join(model_dir, LAYOUT_FILE)
    if not os.path.exists(fp):
        return 1
    with open(fp) as f:
        try:
            return int(json.load(f)["param_layout"])
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
            raise ValueError(f"{fp}: not a valid layout record ({e})") from None


def _write_json(fp: str, obj):
    with open(fp, "w") as f:
        json.dump(obj, f)
