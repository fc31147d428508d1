"""Streaming Hugging Face (safetensors, `model_type: nemotron_h`) checkpoint reading and writing.

Reading goes tensor slice by tensor slice through the safetensors library (never pickle): each of our
leaves is read once per host (the region its local devices hold) and its pieces handed to those devices.
Writing streams one tensor at a time into safetensors shards (the format is a JSON header and raw bytes),
inside a temporary directory that is renamed into place only when complete.
"""

from __future__ import annotations

import json
import os
import struct
import sys
from collections import defaultdict, deque
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from safetensors import SafetensorError, safe_open

from nemo_jax.config.model import NemotronHConfig, write_config
from nemo_jax.fsutil import RecentCache, copy_tokenizer_files
from nemo_jax.hf.mapping import (Entry, build_table, hf_constants, hf_ignored, leaf_specs, ours_from_hf, row_axis,
                                  to_hf_layout)
from nemo_jax.model.spec import PARAM_LAYOUT, unflatten_paths
from nemo_jax.parallel import distributed

ST_DTYPES = {
    "F64": np.dtype(np.float64), "F32": np.dtype(np.float32), "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16), "I64": np.dtype(np.int64), "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16), "I8": np.dtype(np.int8), "U8": np.dtype(np.uint8), "BOOL": np.dtype(bool),
}
ST_NAMES = {v: k for k, v in ST_DTYPES.items()}
FLOAT_KINDS = {"F64", "F32", "F16", "BF16"}


class CheckpointError(ValueError):
    """A checkpoint that cannot be read or does not match its config."""


def check_finite(x: np.ndarray, name: str, what: str):
    """Raise CheckpointError naming tensor `name` when the (floating) block `x` holds a NaN or an infinity;
    the commands that write weights (import-hf, export-hf, merge) check each block as it passes
    (`--allow-nonfinite` skips it)."""
    if x.dtype.kind not in "fc" and x.dtype != ml_dtypes.bfloat16:
        return
    if x.dtype.itemsize == 2:  # bf16 / fp16: no exponent bits all ones (integer ops: 3x ml_dtypes' isfinite)
        top = 0x7F80 if x.dtype == ml_dtypes.bfloat16 else 0x7C00
        if x.size == 0 or int(np.bitwise_and(x.view(np.uint16), 0x7FFF).max()) < top:
            return
    ok = np.isfinite(x)
    if not ok.all():
        bad = x.reshape(-1)[np.argmin(ok.reshape(-1))]
        raise CheckpointError(f"{what}: tensor {name!r} holds non-finite values ({int(ok.size - ok.sum())} of "
                              f"{ok.size} in this block, e.g. {float(bad)}); pass --allow-nonfinite to write it "
                              "anyway")


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
            if not isinstance(weight_map, dict):
                raise CheckpointError(f"{index}: weight_map is not a mapping")
            for name, s in weight_map.items():  # shards live in the checkpoint folder, nowhere else
                if (not isinstance(s, str) or not s or os.path.isabs(s)
                        or os.path.normpath(s).split(os.sep)[0] == os.pardir):
                    raise CheckpointError(f"{index}: weight_map entry {name!r} points at {s!r}, outside the "
                                          "checkpoint folder")
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
        self._offsets: dict[str, int] = {}  # absolute file offset of each tensor's data
        for s in shards:
            fp = os.path.join(self.path, s)
            try:  # the safetensors library validates the header (offsets, dtypes, overlaps)
                with safe_open(fp, framework="np") as f:
                    for name in f.keys():
                        sl = f.get_slice(name)
                        self.tensors[name] = (s, tuple(sl.get_shape()), sl.get_dtype())
            except (SafetensorError, OSError) as e:
                raise CheckpointError(f"{fp}: corrupt or truncated safetensors file ({e})") from None
            self._offsets.update(_data_offsets(fp))
        if weight_map is not None:
            for name, s in weight_map.items():
                got = self.tensors.get(name)
                if got is None or got[0] != s:
                    raise CheckpointError(f"{index}: tensor {name!r} is listed in {s!r} but that file does not hold it")

    def _byte_range(self, name: str, slices: tuple) -> tuple[str, int, int, range]:
        """(file, offset, length, rows) of the rows of tensor `name` that `slices[0]` selects."""
        fname, shape, dt = self.tensors[name]
        rows = range(*slices[0].indices(shape[0])) if shape and slices else range(shape[0] if shape else 1)
        if shape and rows.step != 1:
            raise ValueError(f"{name}: strided row reads are not supported")
        row_bytes = int(np.prod(shape[1:])) * ST_DTYPES[dt].itemsize
        return os.path.join(self.path, fname), self._offsets[name] + rows.start * row_bytes, len(rows) * row_bytes, rows

    def prefetch(self, name: str, slices: tuple = ()):
        """Ask the kernel to start reading the rows `read(name, slices)` will want (posix_fadvise WILLNEED):
        a streaming pass hints a few blocks ahead, so reading from disk overlaps the work on earlier blocks."""
        fp, off, n, _ = self._byte_range(name, slices)
        if n and hasattr(os, "posix_fadvise"):
            fd = os.open(fp, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, off, n, os.POSIX_FADV_WILLNEED)
            finally:
                os.close(fd)

    def read(self, name: str, slices: tuple = ()) -> np.ndarray:
        """Tensor `name`, or `slices` of it. The rows the first slice selects are one contiguous byte range,
        read straight into a fresh buffer (no memory map, so nothing read stays resident); the remaining
        slices are applied to those rows."""
        _, shape, dt = self.tensors[name]
        fp, off, _, rows = self._byte_range(name, slices)
        out = np.empty((len(rows),) + tuple(shape[1:]), ST_DTYPES[dt])
        buf = memoryview(out.reshape(-1).view(np.uint8))
        with open(fp, "rb", buffering=0) as f:  # one handle per read: thread-safe
            f.seek(off)
            done = 0
            while done < len(buf):
                n = f.readinto(buf[done:])
                if not n:
                    raise CheckpointError(f"{fp}: truncated while reading {name!r}")
                done += n
        if not shape:
            return out.reshape(())
        return out[(slice(None),) + tuple(slices[1:])] if len(slices) > 1 else out


def _data_offsets(fp: str) -> dict[str, int]:
    """Absolute data offset of every tensor in a safetensors file; a truncated data section is an error
    here rather than mid-load."""
    with open(fp, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
    tensors = {k: v for k, v in header.items() if k != "__metadata__"}
    end = max((v["data_offsets"][1] for v in tensors.values()), default=0)
    size = os.path.getsize(fp)
    if size < 8 + n + end:
        raise CheckpointError(f"{fp}: truncated (has {size} bytes, header says {8 + n + end})")
    return {k: 8 + n + v["data_offsets"][0] for k, v in tensors.items()}


def read_dtypes(path: str) -> dict[str, str]:
    """HF tensor name -> safetensors dtype name, from the headers alone."""
    return {k: v[2] for k, v in HFReader(path).tensors.items()}


def check_against_config(reader: HFReader, cfg: NemotronHConfig, table: list[Entry], ignore_unexpected: bool):
    expected = {e.hf_name: e for e in table}
    missing = [n for n in expected if n not in reader.tensors]
    if missing:
        raise CheckpointError(f"{reader.path}: missing tensor {missing[0]!r} (and {len(missing) - 1} more) "
                              f"required by config.json")
    constants = hf_constants(cfg)
    extra = [n for n in reader.tensors if n not in expected and n not in constants and not hf_ignored(n)]
    if extra and not ignore_unexpected:
        raise CheckpointError(f"{reader.path}: unexpected tensor {extra[0]!r} (and {len(extra) - 1} more); "
                              "the config does not describe it (nemo-jax import-hf --ignore-unexpected skips such tensors; from "
                              "Python: ignore_unexpected=True)")
    for name, e in expected.items():
        fname, shape, dt = reader.tensors[name]
        if shape != e.hf_shape:
            raise CheckpointError(f"{os.path.join(reader.path, fname)}: tensor {name!r} has shape {list(shape)}, "
                                  f"config.json implies {list(e.hf_shape)}")
        if dt not in FLOAT_KINDS:
            raise CheckpointError(f"{os.path.join(reader.path, fname)}: tensor {name!r} has dtype {dt}, "
                                  "expected a floating type (F32/BF16/F16)")


def _open_checked(path: str, ignore_unexpected: bool, config_overrides: dict | None):
    """-> (cfg, reader, {leaf path: its HF entries}) after checking every tensor against config.json."""
    cfg = NemotronHConfig.from_file(os.path.join(path, "config.json"), **(config_overrides or {}))
    reader = HFReader(path)
    table = build_table(cfg)
    check_against_config(reader, cfg, table, ignore_unexpected)
    by_leaf: dict[str, list[Entry]] = defaultdict(list)
    for e in table:
        by_leaf[e.path].append(e)
    return cfg, reader, by_leaf


class HFSource:
    """An HF checkpoint as a region source over our leaves (the interface `save_pretrained` and the merge engine
    read: `paths`, `src[path]` shape and dtype, `chunks`, `read(path, region)`), plus its HF-layout rows as
    they are stored (`read_hf`, `prefetch_hf`). Nothing is read until asked for."""

    def __init__(self, reader: HFReader, cfg: NemotronHConfig):
        self.hf, self.cfg = reader, cfg
        self.specs = leaf_specs(cfg)
        self._by_index = {(e.path, e.index): e for e in build_table(cfg)}
        self._lead = {e.path: len(e.index) for e in self._by_index.values()}
        self._entries: dict[str, list[Entry]] = defaultdict(list)
        for e in self._by_index.values():
            self._entries[e.path].append(e)

    @classmethod
    def open(cls, path: str, ignore_unexpected: bool = False) -> "HFSource":
        cfg, reader, _ = _open_checked(path, ignore_unexpected, None)
        return cls(reader, cfg)

    def paths(self):
        return self.specs.keys()

    def __getitem__(self, path):
        return jax.ShapeDtypeStruct(tuple(self.specs[path].shape), _leaf_dtype(self.hf, self._entries[path], None))

    def chunks(self, path) -> tuple:
        return tuple(self.specs[path].shape)

    def read(self, path, region=()) -> np.ndarray:
        shape = tuple(self.specs[path].shape)
        region = tuple(region) + (slice(None),) * (len(shape) - len(tuple(region)))
        lead = self._lead[path]
        e = self._by_index[(path, tuple(int(i) for i in region[:lead]))]
        return ours_from_hf(e, lambda sl: self.hf.read(e.hf_name, sl), shape[lead:], region[lead:])

    def read_hf(self, e: Entry, block: tuple) -> np.ndarray:
        return self.hf.read(e.hf_name, tuple(block))

    def prefetch_hf(self, e: Entry, block: tuple):
        self.hf.prefetch(e.hf_name, tuple(block))


def _leaf_dtype(reader: HFReader, entries: list[Entry], dtype) -> np.dtype:
    """`dtype` if given, else the promoted type of the leaf's source tensors."""
    if dtype is not None:
        return np.dtype(dtype)
    return np.dtype(jnp.result_type(*{ST_DTYPES[reader.tensors[e.hf_name][2]] for e in entries}))


def load_pretrained(path: str, dtype=None, mesh=None, rules=None, *, ignore_unexpected: bool = False,
                    config_overrides: dict | None = None, progress: bool = False):
    """Read an HF `nemotron_h` checkpoint -> (cfg, params).

    dtype None keeps each tensor's dtype from the safetensors header (a stacked leaf whose sources
    disagree takes their promoted type). With `mesh` (and `rules`, default `Rules()`), every leaf is placed
    straight into its `NamedSharding`: the part of it this process's devices hold is read once (each byte
    about once per host) and sliced for them; reading the next leaf overlaps placing this one (host memory:
    about two leaves' local parts).
    """
    cfg, reader, by_leaf = _open_checked(path, ignore_unexpected, config_overrides)
    specs = leaf_specs(cfg)
    sharding_for = _sharding_fn(mesh, rules)
    flat = {}
    bar = _bar(progress, len(specs), "tensors", "import")

    def read(item):  # on a worker thread, one leaf ahead of the placement below
        path_, spec = item
        entries, sh = by_leaf[path_], sharding_for(spec)
        region = _local_region(spec.shape, sh)
        return path_, spec, sh, region, _read_region(reader, spec.shape, entries, _leaf_dtype(reader, entries, dtype),
                                                     region)

    for path_, spec, sh, region, host in _pipelined(read, list(specs.items()), depth=1):
        flat[path_] = _place(host, region, spec.shape, sh)
        bar.update(1)
    bar.close()
    return cfg, unflatten_paths(flat)


def import_pretrained(path: str, dst: str, dtype=None, *, ignore_unexpected: bool = False,
                      config_overrides: dict | None = None, progress: bool = False, overwrite: bool = False,
                      allow_nonfinite: bool = False) -> NemotronHConfig:
    """HF checkpoint directory -> native model directory (`nemo_jax.checkpoint` layout), streaming.

    Each storage chunk of a leaf is built from the HF rows it holds (one contiguous byte range per tensor,
    or per piece of a grouped leaf), turned into our layout and written whole, so memory holds a few chunks
    (`CHUNK_BYTES` each), never a tensor or a stacked leaf. The output appears at `dst` only when complete;
    an existing `dst` is replaced only with `overwrite` and only when it is an earlier native model written here
    (`nemo_jax.fsutil.check_output`). Every tensor is checked to be finite as it passes (`allow_nonfinite`: not).
    """
    from nemo_jax import tensorio

    cfg, reader, by_leaf = _open_checked(path, ignore_unexpected, config_overrides)
    specs = leaf_specs(cfg)
    hf_bytes = {leaf: sum(int(np.prod(e.hf_shape)) * ST_DTYPES[reader.tensors[e.hf_name][2]].itemsize for e in es)
                for leaf, es in by_leaf.items()}
    # several processes: each converts and writes its share of the leaves (every tensor read and written once)
    mine = {list(specs)[i] for i in distributed.share([hf_bytes[leaf] for leaf in specs])}
    with distributed.shared_atomic_dir(dst, "import-hf", "native model", overwrite=overwrite,
                                       manifest=True) as (tmp, leader):
        writer = tensorio.NativeWriter(os.path.join(tmp, "params"))
        bar = _bar(progress and leader, sum(hf_bytes[leaf] for leaf in mine), "B", "import", unit_scale=True)
        jobs = []  # (target array, region, entry, HF row block, dtype) in file-friendly order
        for leaf, spec in specs.items():
            entries = by_leaf[leaf]
            dt = _leaf_dtype(reader, entries, dtype)
            lead = len(entries[0].index)
            inner = spec.shape[lead:]
            axis = row_axis(entries[0].transform, len(inner))
            rows = _block_rows(inner, axis, dt.itemsize, tensorio.CHUNK_BYTES)
            chunks = (1,) * lead + tuple(rows if k == axis else n for k, n in enumerate(inner))
            if leaf not in mine:
                writer.declare(leaf, chunks)  # another process writes it; the metadata lists it
                continue
            arr = writer.create(leaf, spec.shape, dt, chunks)
            blocks = [(slice(None),) * axis + (slice(r0, min(inner[axis], r0 + rows)),) for r0 in
                      range(0, inner[axis], rows)] if inner else [()]
            jobs += [(arr, e, inner, block, dt) for e in entries for block in blocks]

        def convert(job):  # one storage chunk of ours from the HF rows it holds (a few pieces for a grouped leaf)
            arr, e, inner, block, dt = job
            y = ours_from_hf(e, lambda sl: reader.read(e.hf_name, sl), inner, block)
            if not allow_nonfinite:
                check_finite(y, e.hf_name, path)
            return arr, e.index + block, y.astype(dt, copy=False), y.nbytes

        for arr, region, y, nbytes in _pipelined(convert, jobs):
            writer.write(arr, region, y)
            bar.update(nbytes)
        writer.finish(metadata=leader)
        bar.close()
        _say_share("import", sorted(mine), len(specs), "leaves")
        if not leader:
            return cfg
        write_config(cfg, tmp)
        tensorio.write_layout(tmp, PARAM_LAYOUT)
        copy_tokenizer_files(path, tmp)
    return cfg


def _say_share(what: str, done: list[str], total: int, unit: str):
    """Several processes: each says which part of the output it wrote (stderr)."""
    me, n = distributed.process()
    if n > 1:
        print(f"{what}: process {me} of {n} wrote {len(done)} of {total} {unit}: {', '.join(done)}",
              file=sys.stderr, flush=True)


def _pipelined(fn, jobs, depth: int = 2, hint=None):
    """fn(job) for each job, in order, with up to `depth` jobs computed ahead on worker threads (file reads,
    tensorstore and numpy copies release the GIL, so reading, re-laying out and writing overlap).
    `hint(job)`, if given, is called `depth` jobs before a job is submitted (e.g. a read-ahead request)."""
    with ThreadPoolExecutor(max_workers=depth) as pool:
        window: deque = deque()
        for i, job in enumerate(jobs):
            if hint is not None and i + depth < len(jobs):
                hint(jobs[i + depth])
            window.append(pool.submit(fn, job))
            if len(window) > depth:
                yield window.popleft().result()
        while window:
            yield window.popleft().result()


def _row_blocks(e: Entry, inner: tuple, axis: int, rows: int):
    """Blocks of up to `rows` HF rows of entry e, in HF order, each one contiguous piece of our leaf (whose
    `inner` dims are laid out with the HF row axis at `axis`): (slices of the HF tensor, that region of ours)."""
    if not inner:
        yield (), e.index
        return
    for r0 in range(0, inner[axis], rows):
        for hf, ours in e.pieces(r0, min(inner[axis], r0 + rows)):
            yield (hf,), e.index + (slice(None),) * axis + (ours,)


def _block_rows(inner: tuple, axis: int, itemsize: int, target: int) -> int:
    """Rows along `axis` of an `inner`-shaped array that fit in `target` bytes (at least one)."""
    if not inner:
        return 1
    row = int(np.prod(inner)) // max(1, inner[axis]) * itemsize
    return max(1, min(inner[axis], target // max(1, row)))


def _local_region(shape, sharding) -> tuple:
    """The bounding box (slices of `shape`) of every shard this process's devices hold."""
    idx = list(sharding.addressable_devices_indices_map(tuple(shape)).values())
    out = []
    for d, n in enumerate(shape):
        rs = [range(*(i[d] if d < len(i) else slice(None)).indices(n)) for i in idx]
        out.append(slice(min(r.start for r in rs), max(r.stop for r in rs)))
    return tuple(out)


def _read_region(reader: HFReader, shape, entries: list[Entry], dtype, region: tuple) -> np.ndarray:
    """Our leaf's `region` (slices of `shape`) as one host array, reading each HF tensor's part of it once:
    the HF rows the region covers (one contiguous byte range per tensor), re-laid out and cut to the region."""
    lead = len(entries[0].index)
    where = {e.index: e for e in entries}
    ranges = [range(*sl.indices(n)) for sl, n in zip(region[:lead], shape[:lead])]
    inner = region[lead:]
    out = np.empty([len(range(*sl.indices(n))) for sl, n in zip(region, shape)], dtype)
    for pos in np.ndindex(*[len(r) for r in ranges]):
        e = where[tuple(r[i] for r, i in zip(ranges, pos))]
        out[pos] = ours_from_hf(e, lambda sl: reader.read(e.hf_name, sl), tuple(shape[lead:]), inner).astype(dtype)
    return out


def _place(host: np.ndarray, region: tuple, shape, sharding):
    """A host array holding `region` of a `shape` leaf -> the jax.Array in `sharding`: each local device gets
    its slice of the host array (no further reads)."""
    off = [sl.start for sl in region]

    def cb(index):
        index = tuple(index) + (slice(None),) * (len(shape) - len(index))
        return host[tuple(slice(r.start - o, r.stop - o) for r, o in
                          zip((range(*sl.indices(n)) for sl, n in zip(index, shape)), off))]

    return jax.make_array_from_callback(tuple(shape), sharding, cb)


def _build_leaf(reader: HFReader, shape, entries: list[Entry], dtype, sharding):
    """One leaf in `sharding`: the region this process's devices need is read once (`_read_region`) and its
    pieces handed to the devices, so every checkpoint byte is read about once per host however the leaf is
    sharded (reading per device re-read whole HF rows once per device)."""
    region = _local_region(shape, sharding)
    return _place(_read_region(reader, shape, entries, dtype, region), region, shape, sharding)


def _sharding_fn(mesh, rules) -> Callable:
    if mesh is None:
        dev = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        return lambda spec: dev
    from nemo_jax.parallel.rules import Rules

    rules = rules or Rules()
    return lambda spec: rules.sharding(mesh, spec.axes, spec.shape)


# --------------------------------------------------------------------------- writing
def _parse_size(s) -> int:
    """'5GB', '500MiB', 1000000 -> a positive number of bytes (else a ValueError naming it)."""
    text = str(s).strip().upper()
    try:
        if isinstance(s, int):
            n = s
        else:
            unit, mult = next(((u, m) for u, m in (("GIB", 2**30), ("MIB", 2**20), ("KIB", 2**10), ("GB", 10**9),
                                                     ("MB", 10**6), ("KB", 10**3), ("B", 1)) if text.endswith(u)),
                              ("", 1))
            n = int(float(text[: len(text) - len(unit)]) * mult)
    except ValueError:
        n = 0
    if n <= 0:
        raise ValueError(f"max_shard_size: {s!r} is not a positive size (e.g. 5GB, 500MiB)")
    return n


def save_pretrained(cfg: NemotronHConfig, params: dict, path: str, max_shard_size="5GB", *, dtypes=None,
                    tokenizer_dir: str | None = None, progress: bool = False, overwrite: bool = False,
                    allow_nonfinite: bool = False):
    """Write an HF checkpoint directory (sharded safetensors + index, config.json, generation_config.json).

    Written whole or not at all; an existing `path` is replaced only with `overwrite` and only when it is an
    earlier HF checkpoint written here (`nemo_jax.fsutil.check_output`). Every tensor block is checked to be
    finite as it is written (an error naming the tensor; `allow_nonfinite`: not checked).

    dtypes: None keeps each leaf's dtype; a dtype applies to all; a dict {hf_name: dtype name} (e.g. from
    `read_dtypes` of the original checkpoint) restores each tensor's original dtype.
    """
    table = build_table(cfg)
    flat = params if hasattr(params, "read") else ArraySource(params)
    missing = sorted({e.path for e in table} - set(flat.paths()))
    constants = hf_constants(cfg)
    if constants:  # buffers (not params) the HF model carries: written first, as themselves
        flat = _WithConstants(flat, constants)
        table = [Entry(name, _WithConstants.PREFIX + name, (), "id", x.shape) for name, x in constants.items()] + table
    if missing:
        raise CheckpointError(f"params lack leaf {missing[0]!r} required by the config")
    specs = leaf_specs(cfg)
    for p in {e.path for e in table} - {_WithConstants.PREFIX + n for n in constants}:
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
    nbytes = [sum(int(np.prod(e.hf_shape)) * dt.itemsize for e, dt in shard) for shard in shards]
    mine = distributed.share(nbytes)  # several processes: each writes its share of the files, every tensor once
    with distributed.shared_atomic_dir(path, "export-hf", "HF checkpoint", overwrite=overwrite) as (tmp, leader):
        bar = _bar(progress and leader, sum(nbytes[i] for i in mine), "B", "export", unit_scale=True)
        for i in mine:
            _write_shard(os.path.join(tmp, names[i]), shards[i], flat, bar,
                         where=None if allow_nonfinite else os.path.abspath(path))
        bar.close()
        _say_share("export", [names[i] for i in mine], len(names), "files")
        if not leader:
            return os.path.abspath(path)
        weight_map = {e.hf_name: fname for fname, shard in zip(names, shards) for e, _ in shard}
        total = sum(nbytes)
        if n > 1:
            with open(os.path.join(tmp, "model.safetensors.index.json"), "w") as f:
                json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
        write_config(cfg, tmp)
        gen = {"bos_token_id": cfg.bos_token_id, "eos_token_id": cfg.eos_token_id, "pad_token_id": cfg.pad_token_id}
        with open(os.path.join(tmp, "generation_config.json"), "w") as f:
            json.dump({k: v for k, v in gen.items() if v is not None}, f, indent=2)
        copy_tokenizer_files(tokenizer_dir, tmp)
    return os.path.abspath(path)


class _WithConstants:
    """A region source plus fixed host arrays under `PREFIX + hf_name` (the HF buffers `save_pretrained` writes)."""

    PREFIX = "__constant__/"

    def __init__(self, src, constants: dict[str, np.ndarray]):
        self._src, self._const = src, {self.PREFIX + k: v for k, v in constants.items()}

    def paths(self):
        return list(self._src.paths()) + list(self._const)

    def __getitem__(self, path):
        return self._const[path] if path in self._const else self._src[path]

    def chunks(self, path) -> tuple:
        return self._const[path].shape if path in self._const else self._src.chunks(path)

    def read(self, path, region=()) -> np.ndarray:
        return self._const[path][region] if path in self._const else self._src.read(path, region)

    def __getattr__(self, name):  # a source's HF-layout readers (the merge engine's), constants answered here
        if name not in ("read_hf", "prefetch_hf"):
            raise AttributeError(name)
        inner = getattr(self._src, name)
        const = self._const

        def call(e, block):
            if e.path not in const:
                return inner(e, block)
            return const[e.path][block] if name == "read_hf" else None

        return call


class ArraySource:
    """In-memory params as a region source (the interface `save_pretrained` reads, like
    `nemo_jax.tensorio.NativeReader`): `src[path]` has shape/dtype, `src.read(path, region)` gives numpy.
    The two most recently read leaves are kept on the host (thread-safe)."""

    def __init__(self, params):
        from nemo_jax.model.spec import flatten_with_paths

        self._flat = flatten_with_paths(params)
        self._host = RecentCache(lambda path: np.asarray(jax.device_get(self._flat[path])), keep=2)

    def paths(self):
        return self._flat.keys()

    def __getitem__(self, path):
        return self._flat[path]

    def chunks(self, path) -> tuple:
        return tuple(self._flat[path].shape)

    def read(self, path, region=()) -> np.ndarray:
        return self._host(path)[region]


WRITE_PIECE = 1 << 20  # bytes per write(): the kernel copies a large block into the page cache 1.5-2x slower


def _write_shard(fp: str, shard, src, bar, where: str | None = None):
    """Write one safetensors shard. `src` is a region source over our leaves; one that also has
    `read_hf(entry, hf_row_slices)` (e.g. the merge engine) hands over HF-layout rows directly. With `where`,
    every block is checked to be finite (`check_finite`, naming the tensor and `where`)."""
    from nemo_jax.tensorio import CHUNK_BYTES

    header, off = {"__metadata__": {"format": "pt"}}, 0
    for e, dt in shard:
        nbytes = int(np.prod(e.hf_shape)) * dt.itemsize
        header[e.hf_name] = {"dtype": ST_NAMES[dt], "shape": list(e.hf_shape), "data_offsets": [off, off + nbytes]}
        off += nbytes
    hb = json.dumps(header, separators=(",", ":")).encode()
    hb += b" " * ((-len(hb)) % 8)
    jobs = []
    for e, dt in shard:
        lead = len(e.index)
        inner = tuple(src[e.path].shape)[lead:]
        axis = row_axis(e.transform, len(inner))
        n = inner[axis] if inner else 1
        # HF rows in blocks along our storage chunks (so each decodes about once), cut into pieces of our leaf
        c = src.chunks(e.path)[lead + axis] if inner else 1
        rows = n if c >= n else c * max(1, _block_rows(inner, axis, dt.itemsize, CHUNK_BYTES) // c)
        jobs += [(e, dt, block, region) for block, region in _row_blocks(e, inner, axis, rows)]
    read_hf = getattr(src, "read_hf", None)
    prefetch_hf = getattr(src, "prefetch_hf", None)

    def hf_rows(job):
        e, dt, block, region = job
        x = read_hf(e, block) if read_hf else to_hf_layout(src.read(e.path, region), e.transform)
        x = np.ascontiguousarray(x.astype(dt, copy=False))
        if where is not None:  # the output's path, named in the error
            check_finite(x, e.hf_name, where)
        return x

    with open(fp, "wb") as f:
        f.write(struct.pack("<Q", len(hb)))
        f.write(hb)
        hint = (lambda job: prefetch_hf(job[0], job[2])) if prefetch_hf else None
        for x in _pipelined(hf_rows, jobs, hint=hint):
            buf = memoryview(x.reshape(-1).view(np.uint8))
            for i in range(0, len(buf), WRITE_PIECE):
                f.write(buf[i:i + WRITE_PIECE])
            bar.update(x.nbytes)


def _bar(enabled: bool, total: int, unit: str, desc: str, **kw):
    from tqdm import tqdm

    return tqdm(total=total, unit=unit, desc=desc, disable=not enabled, **kw)
