"""Streaming Hugging Face (safetensors, `model_type: nemotron_h`) checkpoint reading and writing.

Reading goes tensor slice by tensor slice through the safetensors library (never pickle): each of our
leaves is built with `jax.make_array_from_callback`, so with a mesh each device reads only its own shard.
Writing streams one tensor at a time into safetensors shards (the format is a JSON header and raw bytes),
inside a temporary directory that is renamed into place only when complete.
"""

from __future__ import annotations

import json
import os
import struct
from collections import defaultdict
from typing import Callable

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from safetensors import SafetensorError, safe_open

from nemo_jax.config.model import NemotronHConfig
from nemo_jax.fsutil import atomic_dir, copy_tokenizer_files
from nemo_jax.hf.mapping import Entry, build_table, from_hf_layout, leaf_specs, to_hf_layout

ST_DTYPES = {
    "F64": np.dtype(np.float64), "F32": np.dtype(np.float32), "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16), "I64": np.dtype(np.int64), "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16), "I8": np.dtype(np.int8), "U8": np.dtype(np.uint8), "BOOL": np.dtype(bool),
}
ST_NAMES = {v: k for k, v in ST_DTYPES.items()}
FLOAT_KINDS = {"F64", "F32", "F16", "BF16"}


class CheckpointError(ValueError):
    """A checkpoint that cannot be read or does not match its config."""


# --------------------------------------------------------------------------- reading
class HFReader:
    """Index over an HF checkpoint directory: which file holds which tensor, with shapes and dtypes."""

    def __init__(self, path: str):
        self.path = os.fspath(path)
        if not os.path.isdir(self.path):
            raise CheckpointError(f"{self.path}: not a directory")
        files = os.listdir(self.path)
        index = os.path.join(self.path, "model.safetensors.index.json")
        if os.path.exists(index):
            try:
                with open(index) as f:
                    weight_map = json.load(f)["weight_map"]
            except (json.JSONDecodeError, KeyError) as e:
                raise CheckpointError(f"{index}: not a valid safetensors index ({e})") from None
            shards = sorted(set(weight_map.values()))
            for s in shards:
                if not os.path.exists(os.path.join(self.path, s)):
                    users = [k for k, v in weight_map.items() if v == s]
                    raise CheckpointError(f"{index}: points at missing file {s!r} (for {users[0]!r} and {len(users) - 1} more)")
        elif "model.safetensors" in files:
            shards, weight_map = ["model.safetensors"], None
        else:
            legacy = [f for f in files if f.endswith((".bin", ".pt", ".pth", ".ckpt"))]
            hint = (f" Found {legacy[0]!r}: pickled checkpoints are refused; convert it to safetensors first "
                    "(e.g. transformers' save_pretrained(..., safe_serialization=True)).") if legacy else ""
            raise CheckpointError(f"{self.path}: no model.safetensors or model.safetensors.index.json.{hint}")
        self.tensors: dict[str, tuple[str, tuple[int, ...], str]] = {}
        for s in shards:
            fp = os.path.join(self.path, s)
            try:
                with safe_open(fp, framework="np") as f:
                    for name in f.keys():
                        sl = f.get_slice(name)
                        self.tensors[name] = (s, tuple(sl.get_shape()), sl.get_dtype())
            except (SafetensorError, OSError) as e:
                raise CheckpointError(f"{fp}: corrupt or truncated safetensors file ({e})") from None
            _check_size(fp)
        if weight_map is not None:
            for name, s in weight_map.items():
                got = self.tensors.get(name)
                if got is None or got[0] != s:
                    raise CheckpointError(f"{index}: tensor {name!r} is listed in {s!r} but that file does not hold it")
        self._open: dict[str, object] = {}

    def read(self, name: str, slices: tuple = ()) -> np.ndarray:
        fname = self.tensors[name][0]
        f = self._open.get(fname)
        if f is None:
            f = self._open[fname] = safe_open(os.path.join(self.path, fname), framework="np")
        sl = f.get_slice(name)
        return np.asarray(sl[slices] if slices else sl[:]) if self.tensors[name][1] else np.asarray(f.get_tensor(name))

    def close(self):
        self._open.clear()


def _check_size(fp: str):
    """safetensors maps lazily; catch a truncated data section here rather than mid-load."""
    with open(fp, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
    end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    size = os.path.getsize(fp)
    if size < 8 + n + end:
        raise CheckpointError(f"{fp}: truncated (has {size} bytes, header says {8 + n + end})")


def read_dtypes(path: str) -> dict[str, str]:
    """HF tensor name -> safetensors dtype name, from the headers alone."""
    return {k: v[2] for k, v in HFReader(path).tensors.items()}


def check_against_config(reader: HFReader, cfg: NemotronHConfig, table: list[Entry], ignore_unexpected: bool):
    expected = {e.hf_name: e for e in table}
    missing = [n for n in expected if n not in reader.tensors]
    if missing:
        raise CheckpointError(f"{reader.path}: missing tensor {missing[0]!r} (and {len(missing) - 1} more) "
                              f"required by config.json")
    extra = [n for n in reader.tensors if n not in expected]
    if extra and not ignore_unexpected:
        raise CheckpointError(f"{reader.path}: unexpected tensor {extra[0]!r} (and {len(extra) - 1} more); "
                              "the config does not describe it (pass ignore_unexpected=True to skip)")
    for name, e in expected.items():
        fname, shape, dt = reader.tensors[name]
        if shape != e.hf_shape:
            raise CheckpointError(f"{os.path.join(reader.path, fname)}: tensor {name!r} has shape {list(shape)}, "
                                  f"config.json implies {list(e.hf_shape)}")
        if dt not in FLOAT_KINDS:
            raise CheckpointError(f"{os.path.join(reader.path, fname)}: tensor {name!r} has dtype {dt}, "
                                  "expected a floating type (F32/BF16/F16)")


def load_pretrained(path: str, dtype=None, mesh=None, rules=None, *, ignore_unexpected: bool = False,
                    config_overrides: dict | None = None, progress: bool = False):
    """Read an HF `nemotron_h` checkpoint -> (cfg, params).

    dtype None keeps each tensor's dtype from the safetensors header (a stacked leaf whose sources
    disagree takes their promoted type). With `mesh` (and `rules`, default `Rules()`), every leaf is placed
    straight into its `NamedSharding`, each device reading only its slice.
    """
    cfg = NemotronHConfig.from_file(os.path.join(path, "config.json"), **(config_overrides or {}))
    reader = HFReader(path)
    table = build_table(cfg)
    check_against_config(reader, cfg, table, ignore_unexpected)
    specs = leaf_specs(cfg)
    by_leaf: dict[str, list[Entry]] = defaultdict(list)
    for e in table:
        by_leaf[e.path].append(e)
    sharding_for = _sharding_fn(mesh, rules)
    flat = {}
    bar = _bar(progress, len(specs), "tensors", "import")
    for path_, spec in specs.items():
        entries = by_leaf[path_]
        src = {ST_DTYPES[reader.tensors[e.hf_name][2]] for e in entries}
        dt = np.dtype(dtype) if dtype is not None else np.dtype(jnp.result_type(*src))
        flat[path_] = _build_leaf(reader, spec.shape, entries, dt, sharding_for(spec))
        bar.update(1)
    bar.close()
    reader.close()
    return cfg, _unflatten(flat, cfg)


def _build_leaf(reader: HFReader, shape, entries: list[Entry], dtype, sharding):
    lead = len(entries[0].index)
    where = {e.index: e for e in entries}

    def cb(index):
        index = tuple(index) + (slice(None),) * (len(shape) - len(index))
        ranges = [range(*sl.indices(n)) for sl, n in zip(index[:lead], shape[:lead])]
        inner = index[lead:]
        rest_shape = shape[lead:]
        out = np.empty([len(r) for r in ranges] + [len(range(*s.indices(n))) for s, n in zip(inner, rest_shape)], dtype)
        for pos in np.ndindex(*[len(r) for r in ranges]):
            e = where[tuple(r[i] for r, i in zip(ranges, pos))]
            out[pos] = from_hf_layout(reader.read(e.hf_name, _hf_slices(inner, e.transform)), e.transform).astype(dtype)
        return out

    return jax.make_array_from_callback(tuple(shape), sharding, cb)


def _hf_slices(inner: tuple, transform: str) -> tuple:
    if transform == "T":
        return tuple(reversed(inner))
    if transform == "conv":
        return (inner[1], slice(None), inner[0])
    return inner


def _sharding_fn(mesh, rules) -> Callable:
    if mesh is None:
        dev = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        return lambda spec: dev
    from nemo_jax.parallel.rules import Rules

    rules = rules or Rules()
    return lambda spec: rules.sharding(mesh, spec.axes, spec.shape)


def _unflatten(flat: dict[str, object], cfg) -> dict:
    tree: dict = {}
    for path, v in flat.items():
        node = tree
        parts = path.split("/")
        for p in parts[:-1]:
            node = node.setdefault(p, {})
        node[parts[-1]] = v
    if "mtp" in tree:
        tree["mtp"] = [tree["mtp"][str(d)] for d in range(cfg.num_nextn_predict_layers)]
    return tree


# --------------------------------------------------------------------------- writing
def _parse_size(s) -> int:
    if isinstance(s, int):
        return s
    s = str(s).strip().upper()
    for unit, mult in (("GIB", 2**30), ("MIB", 2**20), ("KIB", 2**10), ("GB", 10**9), ("MB", 10**6), ("KB", 10**3), ("B", 1)):
        if s.endswith(unit):
            return int(float(s[: -len(unit)]) * mult)
    return int(s)


def save_pretrained(cfg: NemotronHConfig, params: dict, path: str, max_shard_size="5GB", *, dtypes=None,
                    tokenizer_dir: str | None = None, progress: bool = False):
    """Write an HF checkpoint directory (sharded safetensors + index, config.json, generation_config.json).

    dtypes: None keeps each leaf's dtype; a dtype applies to all; a dict {hf_name: dtype name} (e.g. from
    `read_dtypes` of the original checkpoint) restores each tensor's original dtype.
    """
    table = build_table(cfg)
    flat = params if isinstance(params, LeafSource) else LeafSource.from_tree(params)
    missing = sorted({e.path for e in table} - set(flat.paths()))
    if missing:
        raise CheckpointError(f"params lack leaf {missing[0]!r} required by the config")
    specs = leaf_specs(cfg)
    for p in {e.path for e in table}:
        if tuple(flat[p].shape) != tuple(specs[p].shape):
            raise CheckpointError(f"param {p!r} has shape {tuple(flat[p].shape)}, config implies {specs[p].shape}")
    # write leaf by leaf (HF readers go by the index, not the file order), so a lazy source holds one leaf
    first = {}
    for i, e in enumerate(table):
        first.setdefault(e.path, i)
    table = sorted(table, key=lambda e: first[e.path])

    def out_dtype(e: Entry) -> np.dtype:
        if dtypes is None:
            return np.dtype(flat[e.path].dtype)
        if isinstance(dtypes, dict):
            d = dtypes.get(e.hf_name)
            return ST_DTYPES[d] if isinstance(d, str) and d in ST_DTYPES else np.dtype(d or flat[e.path].dtype)
        return np.dtype(dtypes)

    plan = [(e, out_dtype(e)) for e in table]
    limit = _parse_size(max_shard_size)
    shards: list[list[tuple[Entry, np.dtype]]] = [[]]
    size = 0
    for e, dt in plan:
        nbytes = int(np.prod(e.hf_shape)) * dt.itemsize
        if shards[-1] and size + nbytes > limit:
            shards.append([])
            size = 0
        shards[-1].append((e, dt))
        size += nbytes
    n = len(shards)
    names = ["model.safetensors"] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    with atomic_dir(path) as tmp:
        total = sum(int(np.prod(e.hf_shape)) * dt.itemsize for e, dt in plan)
        bar = _bar(progress, total, "B", "export", unit_scale=True)
        weight_map = {}
        for fname, shard in zip(names, shards):
            _write_shard(os.path.join(tmp, fname), shard, flat, bar)
            weight_map.update({e.hf_name: fname for e, _ in shard})
        bar.close()
        if n > 1:
            with open(os.path.join(tmp, "model.safetensors.index.json"), "w") as f:
                json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(cfg.to_hf_dict(), f, indent=2)
        gen = {"bos_token_id": cfg.bos_token_id, "eos_token_id": cfg.eos_token_id, "pad_token_id": cfg.pad_token_id}
        with open(os.path.join(tmp, "generation_config.json"), "w") as f:
            json.dump({k: v for k, v in gen.items() if v is not None}, f, indent=2)
        copy_tokenizer_files(tokenizer_dir, tmp)
    return os.path.abspath(path)


class LeafSource:
    """Our leaves by path: `src[path]` gives shape/dtype metadata, `src.load(path)` the array. A lazy source
    (e.g. a native checkpoint read leaf by leaf) keeps only the most recently loaded leaf in memory."""

    def __init__(self, meta: dict, load):
        self._meta, self._load, self._cached = meta, load, (None, None)

    @classmethod
    def from_tree(cls, params) -> "LeafSource":
        from nemo_jax.model.spec import flatten_with_paths

        flat = flatten_with_paths(params)
        return cls(flat, flat.__getitem__)

    def paths(self):
        return self._meta.keys()

    def __getitem__(self, path):
        return self._meta[path]

    def load(self, path):
        if self._cached[0] != path:
            self._cached = (None, None)  # drop the previous leaf before reading the next
            self._cached = (path, self._load(path))
        return self._cached[1]


def _write_shard(fp: str, shard, flat: "LeafSource", bar):
    header, off = {"__metadata__": {"format": "pt"}}, 0
    for e, dt in shard:
        nbytes = int(np.prod(e.hf_shape)) * dt.itemsize
        header[e.hf_name] = {"dtype": ST_NAMES[dt], "shape": list(e.hf_shape), "data_offsets": [off, off + nbytes]}
        off += nbytes
    hb = json.dumps(header, separators=(",", ":")).encode()
    hb += b" " * ((-len(hb)) % 8)
    with open(fp, "wb") as f:
        f.write(struct.pack("<Q", len(hb)))
        f.write(hb)
        for e, dt in shard:
            leaf = flat.load(e.path)
            x = np.asarray(jax.device_get(leaf[e.index] if e.index else leaf))
            x = np.ascontiguousarray(to_hf_layout(x, e.transform).astype(dt, copy=False))
            f.write(memoryview(x.reshape(-1).view(np.uint8)))
            bar.update(x.nbytes)


def _bar(enabled: bool, total: int, unit: str, desc: str, **kw):
    from tqdm import tqdm

    return tqdm(total=total, unit=unit, desc=desc, disable=not enabled, **kw)
