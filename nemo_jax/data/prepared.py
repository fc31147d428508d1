"""Prepared SFT data: chat JSONL / Parquet -> sharded ArrayRecord files + manifest, read back lazily by index.

    DIR/manifest.json                 written last, atomically: documents, tokens, assistant tokens, length
                                      histogram, min/max length, max token id, shards, rejected lines
    DIR/shards/NAME-CHUNK.array_record one record per document (`encode_record`)
    DIR/shards/NAME-CHUNK.json        the shard's statistics + fingerprint, written after its records: a shard
                                      whose fingerprint matches (same input bytes, same tokenizer) is not redone

Each input is cut into chunks at line starts (JSONL) or row groups (Parquet); worker processes render and
tokenise chunks independently. The documents' global index is the shards' records in manifest order, so a
reader knows every shard's size from the manifest and opens a shard only when one of its records is asked for:
start-up reads no token data, and each process reads only the records of its own share.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import multiprocessing
import os
import shutil
import struct
from dataclasses import dataclass

import numpy as np

from nemo_jax import fsutil, runlock
from nemo_jax.data.chat import DataError, Document, resolve
from nemo_jax.fsutil import check_not_input, os_error_code, read_json

MANIFEST = "manifest.json"
VERSION = 1
CHUNK_BYTES = 64 << 20  # JSONL bytes per shard
HIST_EDGES = [0] + [2 ** k for k in range(4, 21)]  # document lengths: [0,16), [16,32), ... [2^19, 2^20), >= 2^20
MAX_REJECTS_LISTED = 1000
_HEADER = struct.Struct("<II")  # tokens, meta bytes


def encode_record(ids: np.ndarray, mask: np.ndarray, meta: dict | None = None) -> bytes:
    """One document: header (n, meta bytes) + ids int32[n] + loss mask uint8[n] + JSON meta (image refs)."""
    m = json.dumps(meta).encode() if meta else b""
    return (_HEADER.pack(len(ids), len(m)) + np.asarray(ids, "<i4").tobytes() + np.asarray(mask, np.uint8).tobytes()
            + m)


def decode_record(b: bytes, source: int = 0) -> Document:
    n, nm = _HEADER.unpack_from(b)
    o = _HEADER.size
    ids = np.frombuffer(b, "<i4", n, o).astype(np.int32)
    mask = np.frombuffer(b, np.uint8, n, o + 4 * n).astype(bool)
    meta = json.loads(b[o + 5 * n:o + 5 * n + nm]) if nm else {}
    return Document(ids, mask, source, meta.get("images", []), meta.get("image_hw", []))


# --------------------------------------------------------------------------- preparing
@dataclass(frozen=True)
class Chunk:
    """One shard's input: lines [start, stop) bytes of a JSONL file, or one Parquet row group."""
    path: str
    kind: str  # jsonl | parquet
    start: int
    stop: int
    name: str


def _stem(path: str) -> str:
    base = os.path.basename(path)
    for ext in (".jsonl", ".json", ".parquet"):
        if base.endswith(ext):
            return base[:-len(ext)]
    return base


def plan_chunks(paths: list[str], chunk_bytes: int = CHUNK_BYTES) -> list[Chunk]:
    """Inputs -> chunks, each ending at a line end (found by seeking, without reading the file through)."""
    out, stems = [], set()
    for path in paths:
        path = resolve(path)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{path}: no such data file")
        stem = _stem(path)
        while stem in stems:
            stem += "_"
        stems.add(stem)
        if path.endswith(".parquet"):
            pq = _parquet()
            groups = pq.ParquetFile(path).num_row_groups
            out += [Chunk(path, "parquet", g, g + 1, f"{stem}-{g:05d}") for g in range(groups)]
            continue
        size, start, k = os.path.getsize(path), 0, 0
        with open(path, "rb") as f:
            while start < size:
                f.seek(min(start + chunk_bytes, size))
                stop = min(start + chunk_bytes, size)
                if stop < size:
                    f.readline()  # to the end of the line the cut falls in
                    stop = f.tell()
                out.append(Chunk(path, "jsonl", start, stop, f"{stem}-{k:05d}"))
                start, k = stop, k + 1
    return out


def _parquet():
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError("reading Parquet needs pyarrow: pip install 'nemo_jax[parquet]'") from None
    return pq


def _records(chunk: Chunk):
    """-> (line number within the chunk (1-based) or row, raw record: a JSON line's bytes (decoded, strictly, by
    `parse_record`) or a dict). Lines end at b"\n" only, as a JSONL reader counts them."""
    if chunk.kind == "parquet":
        table = _parquet().ParquetFile(chunk.path).read_row_group(chunk.start)
        for i, row in enumerate(table.to_pylist()):
            yield i + 1, row
        return
    with open(chunk.path, "rb") as f:
        f.seek(chunk.start)
        data = f.read(chunk.stop - chunk.start)
    for i, line in enumerate(data.split(b"\n")):
        if line.strip():
            yield i + 1, line


def _tokenizer_digest(tokenizer: str) -> str:
    """Digest of the tokenizer files that decide the tokens (read once per `prepare`, not once per shard)."""
    h = hashlib.sha1()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        p = os.path.join(resolve(tokenizer), name)
        if os.path.exists(p):
            with open(p, "rb") as f:
                h.update(f.read())
    return h.hexdigest()


def _fingerprint(chunk: Chunk, tokenizer_digest: str) -> str:
    st = os.stat(chunk.path)
    return hashlib.sha1(json.dumps([os.path.abspath(chunk.path), st.st_size, st.st_mtime_ns, chunk.start, chunk.stop,
                                    VERSION, tokenizer_digest]).encode()).hexdigest()


class ShardWriter:
    """Documents -> DIR/shards/NAME.array_record (written under a temporary name, renamed when complete) and
    then NAME.json, its statistics; `finish()` returns them."""

    def __init__(self, out: str, name: str, **info):
        from array_record.python.array_record_module import ArrayRecordWriter

        self.base = os.path.join(out, "shards", name)
        self.hist = np.zeros(len(HIST_EDGES), np.int64)
        self.stats = {"file": name + ".array_record", **info, "documents": 0, "tokens": 0, "assistant_tokens": 0,
                      "min_length": None, "max_length": 0, "max_token_id": -1, "rejected": [], "rejected_count": 0,
                      "line_base": None}  # rejected JSONL lines: numbered in the chunk until `_file_lines`
        self.w = ArrayRecordWriter(self.base + ".array_record.tmp", "group_size:1")

    def add(self, doc: Document):
        meta = {"images": doc.images, **({"image_hw": doc.image_hw} if doc.image_hw else {})} if doc.images else None
        try:
            self.w.write(encode_record(doc.ids, doc.mask, meta))
        except RuntimeError as e:
            raise _os_error(e, self.base + ".array_record") from None
        st, n = self.stats, len(doc.ids)
        st["documents"] += 1
        st["tokens"] += n
        st["assistant_tokens"] += int(doc.mask.sum())
        st["min_length"] = n if st["min_length"] is None else min(st["min_length"], n)
        st["max_length"] = max(st["max_length"], n)
        st["max_token_id"] = max(st["max_token_id"], int(doc.ids.max(initial=-1)))
        self.hist[np.searchsorted(HIST_EDGES, n, side="right") - 1] += 1

    def reject(self, where, reason: str):
        self.stats["rejected_count"] += 1
        if len(self.stats["rejected"]) < MAX_REJECTS_LISTED:
            self.stats["rejected"].append({"line": where, "reason": reason})

    def close(self):
        if self.w is not None:
            w, self.w = self.w, None
            try:
                w.close()
            except RuntimeError as e:
                raise _os_error(e, self.base + ".array_record") from None

    def finish(self) -> dict:
        self.close()
        self.stats["length_histogram"] = self.hist.tolist()
        os.replace(self.base + ".array_record.tmp", self.base + ".array_record")
        _write_json(self.base + ".json", self.stats)
        return self.stats


def _shard_job(args) -> dict:
    """Render + tokenise one chunk into DIR/shards/NAME.array_record (+ its .json, last). Runs in a worker."""
    from nemo_jax.data.chat import ChatTokenizer, parse_record

    chunk, tokenizer, out, fp, on_error, vocab = args
    tok = ChatTokenizer.load(tokenizer)
    w = ShardWriter(out, chunk.name, input=chunk.path, fingerprint=fp)
    try:
        for line, raw in _records(chunk):
            try:
                doc = parse_record(raw, tok, vocab, base_dir=os.path.dirname(os.path.abspath(chunk.path)))
            except DataError as e:
                where = line if chunk.kind == "jsonl" else f"row group {chunk.start} row {line}"
                if on_error == "raise":
                    return {"error": (chunk.path, chunk.start, where, str(e))}
                w.reject(where, str(e))
                continue
            w.add(doc)
        return w.finish()
    finally:
        if w.w is not None or not os.path.exists(w.base + ".array_record"):  # stopped: no temporary left behind
            with contextlib.suppress(OSError):
                w.close()
            with contextlib.suppress(FileNotFoundError):
                os.remove(w.base + ".array_record.tmp")


def _os_error(e: RuntimeError, path: str) -> OSError:
    """array_record reports a failed write (e.g. a full disk) as a RuntimeError with the C library's message ->
    the OSError it stands for (`fsutil.os_error_code`; EIO when it names none), naming the shard."""
    import errno as errno_

    code = os_error_code(e, by_message=True) or errno_.EIO
    return OSError(code, os.strerror(code), path)


def _write_json(path: str, obj):
    with open(path + ".tmp", "w") as f:
        json.dump(obj, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(path + ".tmp", path)


def _finished(base: str, fp: str) -> dict | None:
    try:
        with open(base + ".json") as f:
            stats = json.load(f)
    except (FileNotFoundError, json.JSONDecodeError):
        return None
    if stats.get("fingerprint") != fp or not os.path.exists(base + ".array_record"):
        return None
    return stats


def _lines_before(path: str, starts) -> dict[int, int]:
    """{byte offset: lines of `path` before it} for chunk starts, in one pass up to the last of them."""
    out, n, at = {}, 0, 0
    with open(path, "rb") as f:
        for start in sorted(set(starts)):
            while at < start:
                block = f.read(min(1 << 24, start - at))
                if not block:
                    break
                n, at = n + block.count(b"\n"), at + len(block)
            out[start] = n
    return out


def _file_lines(out: str, chunks: list[Chunk], done: dict) -> None:
    """The rejected lines a JSONL shard recorded are numbered within its chunk (a worker does not count the lines
    before it); number them within the file (one pass per file, only for shards with rejects) and rewrite the
    shard's statistics (`line_base` set: done once)."""
    todo = [c for c in chunks if c.kind == "jsonl" and done[c.name]["rejected"]
            and done[c.name].get("line_base") is None]
    for path in {c.path for c in todo}:
        mine = [c for c in todo if c.path == path]
        before = _lines_before(path, [c.start for c in mine])
        for c in mine:
            stats = done[c.name]
            stats["line_base"] = before[c.start]
            for r in stats["rejected"]:
                r["line"] += before[c.start]
            _write_json(os.path.join(out, "shards", c.name + ".json"), stats)


def prepare(sources: list[str], tokenizer: str, out: str, *, workers: int = 1, vocab_size: int | None = None,
            on_error: str = "raise", chunk_bytes: int = CHUNK_BYTES, quiet: bool = True,
            overwrite: bool = False) -> dict:
    """Prepare chat JSONL / Parquet files into DIR `out` (see the module docstring) -> the manifest.

    `vocab_size`: token ids must be below it (default: the tokenizer's vocabulary). Finished shards of a
    previous run on the same inputs are kept (`overwrite`: an earlier prepared output in `out` is cleared
    first); the manifest is written last and atomically. `out` must be new, empty, or a prepared-data folder
    (`claim_output`): a folder holding anything else is refused before any work, and a prepare that fails before
    finishing a shard leaves no folder behind that it made. The folder's write lock (`nemo_jax.runlock`) is held
    throughout: a second writer of `out` stops at once, naming this one."""
    if on_error not in ("raise", "skip"):
        raise ValueError(f"data.on_error: {on_error!r} (expected raise or skip)")
    if not sources:
        raise ValueError("data prepare: no input files")
    check_not_input(out, [resolve(p) for p in sources], "--out")
    check_prepared_output(out)  # a file or a foreign folder is refused before anything is made
    new, made = not os.path.lexists(out), None
    try:
        with runlock.hold(out, f"nemo-jax {fsutil.COMMAND or 'data prepare'}"):  # one writer per folder
            made = claim_output(out, overwrite)
            return _prepare(sources, tokenizer, out, workers, vocab_size, on_error, chunk_bytes, quiet)
    except BaseException:
        shards = os.path.join(out, "shards")
        if made and not any(n.endswith(".array_record") for n in (os.listdir(shards) if os.path.isdir(shards) else ())):
            _unclaim(out, "new" if new else made)  # nothing finished: leave no empty skeleton behind (lock released)
        raise


def _prepare(sources, tokenizer, out, workers, vocab_size, on_error, chunk_bytes, quiet) -> dict:
    from nemo_jax.data.chat import ChatTokenizer

    tok = ChatTokenizer.load(tokenizer)  # fails early on a bad tokenizer directory
    vocab = vocab_size or tok.tokenizer.get_vocab_size()
    chunks = plan_chunks(list(sources), chunk_bytes)
    os.makedirs(os.path.join(out, "shards"), exist_ok=True)
    for name in os.listdir(os.path.join(out, "shards")):  # temporaries of a killed earlier run
        if name.endswith(".tmp"):
            os.remove(os.path.join(out, "shards", name))
    jobs, done, digest = [], {}, _tokenizer_digest(tokenizer)
    for c in chunks:
        fp = _fingerprint(c, digest)
        got = _finished(os.path.join(out, "shards", c.name), fp)
        if got is None:
            jobs.append((c, tokenizer, out, fp, on_error, vocab))
        else:
            done[c.name] = got
    if not quiet:
        print(f"data prepare: {len(chunks)} shards, {len(done)} already done, {len(jobs)} to do "
              f"with {workers} worker(s)")
    results = _run_jobs(jobs, workers)
    for (c, *_), r in zip(jobs, results):
        if "error" in r:
            path, start, local, msg = r["error"]
            line = _lines_before(path, [start])[start] + local if isinstance(local, int) else local
            raise DataError(f"{path}:{line}: {msg}")
        done[c.name] = r
    _file_lines(out, chunks, done)
    shards = [done[c.name] for c in chunks]
    if not sum(s["documents"] for s in shards):
        bad = [(s["input"], r) for s in shards for r in s["rejected"]][:1]
        why = (f" (every line was rejected; the first, {bad[0][0]}:{bad[0][1]['line']}: {bad[0][1]['reason']})" if bad
               else " (the files hold no lines)" if not chunks else "")
        raise DataError(f"{', '.join(map(str, sources))}: no usable conversations{why}")
    return write_manifest(out, shards, tokenizer, vocab)


OWN_ENTRIES = (MANIFEST, "shards")  # what a prepared-data folder holds (besides its output marker)


def check_prepared_output(out: str) -> dict | None:
    """May `out` become a prepared-data folder (new, empty, or one already)? -> its output marker (None: none
    yet); a file, or a folder holding anything else, is an OutputExistsError naming the entry."""
    from nemo_jax.fsutil import OUTPUT_MARKER, OutputExistsError, read_marker

    out = os.path.abspath(out)
    if os.path.lexists(out) and (os.path.islink(out) or not os.path.isdir(out)):
        raise OutputExistsError(f"{out} exists and is not a folder: not touched (choose another --out)")
    entries = [e for e in sorted(os.listdir(out)) if not runlock.is_lock_entry(e)] if os.path.isdir(out) else []
    marker = read_marker(out) if entries else None
    if marker is not None and marker.get("kind") != "prepared data":
        raise OutputExistsError(f"{out}: not touched: it holds a {marker.get('kind')} (written by "
                                f"{marker.get('command')}), not prepared data")
    foreign = [e for e in entries if e not in OWN_ENTRIES + (OUTPUT_MARKER, MANIFEST + ".tmp")]
    if foreign:
        more = f" (and {len(foreign) - 1} more)" if len(foreign) > 1 else ""
        raise OutputExistsError(f"{out}: not touched: {foreign[0]!r}{more} in it is not part of a prepared-data "
                                "folder (choose an empty or new --out)")
    return marker


def claim_output(out: str, overwrite: bool = False) -> str | None:
    """Make `out` a prepared-data folder: new or empty (marked now, so a killed run is recognised), or one
    already (kept, to reuse its finished shards; with `overwrite` cleared). A folder holding anything else is
    an OutputExistsError naming the entry: nothing in it is touched (`check_prepared_output`). -> "new" (this
    call made the folder), "empty" (it marked an empty one) or None (it was prepared data already)."""
    from nemo_jax.fsutil import write_marker

    out = os.path.abspath(out)
    marker = check_prepared_output(out)
    made = None if marker is not None else "empty" if os.path.isdir(out) else "new"
    os.makedirs(out, exist_ok=True)
    if overwrite:
        for e in OWN_ENTRIES + (MANIFEST + ".tmp",):
            p = os.path.join(out, e)
            if os.path.isdir(p):
                shutil.rmtree(p)
            elif os.path.exists(p):
                os.remove(p)
    os.makedirs(os.path.join(out, "shards"), exist_ok=True)
    if marker is None:
        write_marker(out, "prepared data")
    return made


def _unclaim(out: str, made: str) -> None:
    """Undo `claim_output` of a prepare that finished nothing: the folder it made is removed, an empty one it
    marked is left empty (only what it wrote there is removed)."""
    from nemo_jax.fsutil import OUTPUT_MARKER

    if made == "new":
        shutil.rmtree(out, ignore_errors=True)
        return
    shutil.rmtree(os.path.join(out, "shards"), ignore_errors=True)
    for name in (OUTPUT_MARKER, MANIFEST + ".tmp"):
        with contextlib.suppress(FileNotFoundError):
            os.remove(os.path.join(out, name))


def _run_jobs(jobs, workers: int) -> list[dict]:
    if workers <= 1 or len(jobs) <= 1:
        return [_shard_job(j) for j in jobs]
    # spawn: the caller may hold threads (jax, grain) that make fork unsafe
    with multiprocessing.get_context("spawn").Pool(min(workers, len(jobs))) as pool:
        return pool.map(_shard_job, jobs, chunksize=1)


def write_manifest(out: str, shards: list[dict], tokenizer: str, vocab: int) -> dict:
    """The manifest of finished shards (ShardWriter.finish's statistics, in index order), written atomically."""
    manifest = _manifest(shards, tokenizer, vocab)
    _write_json(os.path.join(out, MANIFEST), manifest)
    return manifest


def _manifest(shards: list[dict], tokenizer: str, vocab: int) -> dict:
    hist = np.sum([s["length_histogram"] for s in shards], axis=0).tolist()
    lengths = [s["min_length"] for s in shards if s["min_length"] is not None]
    rejected = [{"file": s["input"], **r} for s in shards for r in s["rejected"]][:MAX_REJECTS_LISTED]
    return {
        "version": VERSION, "tokenizer": tokenizer, "vocab_size": vocab,
        "documents": sum(s["documents"] for s in shards), "tokens": sum(s["tokens"] for s in shards),
        "assistant_tokens": sum(s["assistant_tokens"] for s in shards),
        "min_length": min(lengths) if lengths else 0, "max_length": max(s["max_length"] for s in shards),
        "max_token_id": max(s["max_token_id"] for s in shards),
        "length_histogram": {"edges": HIST_EDGES, "counts": hist},
        "rejected_count": sum(s["rejected_count"] for s in shards), "rejected": rejected,
        "shards": [{"file": s["file"], "documents": s["documents"], "tokens": s["tokens"]} for s in shards],
    }


# --------------------------------------------------------------------------- reading
def absl_flags_parsed():
    """grain and array_record read absl flags (defaults are fine); a program that never parsed them (ours) must
    mark them parsed first."""
    from absl import flags

    if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()


def is_prepared(path: str) -> bool:
    return os.path.isfile(os.path.join(resolve(path), MANIFEST))


def read_manifest(path: str) -> dict:
    path = resolve(path)
    m = read_json(os.path.join(path, MANIFEST), f"no {MANIFEST} (not prepared data; run `nemo-jax data prepare`)",
                  error=DataError, where=path)
    if m.get("version") != VERSION:
        raise DataError(f"{os.path.join(path, MANIFEST)}: version {m.get('version')!r}, expected {VERSION}")
    return m


class PreparedDocuments:
    """The documents of one or more prepared directories as one sequence (directory i = mixture source i).

    Only manifests are read here; the ArrayRecord shards are opened (grain's `ArrayRecordDataSource`) on the
    first record asked for, in whichever process asks (the object pickles without open files)."""

    def __init__(self, dirs: list[str], vocab_size: int | None = None):
        self.dirs = [resolve(d) for d in dirs]
        self.manifests = [read_manifest(d) for d in self.dirs]
        self.paths, counts, self.shard_source = [], [], []  # paths as "FILE[0:N]": opening reads no file
        for s, (d, m) in enumerate(zip(self.dirs, self.manifests)):
            if vocab_size is not None and m["max_token_id"] >= vocab_size:
                raise DataError(f"{d}: token id {m['max_token_id']} outside the model vocabulary ({vocab_size})")
            for sh in m["shards"]:
                if sh["documents"]:
                    self.paths.append(f'{os.path.join(d, "shards", sh["file"])}[0:{sh["documents"]}]')
                    counts.append(sh["documents"])
                    self.shard_source.append(s)
        self.shard_starts = np.concatenate([[0], np.cumsum(counts, dtype=np.int64)])
        per_source = [m["documents"] for m in self.manifests]
        self.bounds = np.concatenate([[0], np.cumsum(per_source, dtype=np.int64)])  # source s: [b[s], b[s+1])
        self.min_length = min(m["min_length"] for m in self.manifests)
        self.max_length = max(m["max_length"] for m in self.manifests)
        self._source = None

    def __len__(self) -> int:
        return int(self.shard_starts[-1])

    def __getstate__(self):
        return {**self.__dict__, "_source": None}

    def _open(self):
        if self._source is None:
            import grain

            absl_flags_parsed()
            self._source = grain.sources.ArrayRecordDataSource(self.paths)
        return self._source

    def __getitem__(self, i: int) -> Document:
        return self.read([i])[0]

    def read(self, indices) -> list[Document]:
        """Documents at `indices` (one batched read)."""
        indices = [int(i) for i in indices]
        shards = np.searchsorted(self.shard_starts, indices, side="right") - 1
        try:
            recs = self._open().__getitems__(indices)
        except (RuntimeError, OSError) as e:  # array_record reports a missing or damaged shard as RuntimeError
            raise DataError(f"{', '.join(self.dirs)}: reading the prepared shards failed: {e}") from None
        return [decode_record(r, self.shard_source[s]) for r, s in zip(recs, shards)]


def open_sources(data, vocab_size: int, cache_dir: str, *, quiet: bool = True):
    """A data config section's `sources` (or its `train` alone) -> (PreparedDocuments, mixture weights or None,
    source names, rejected lines). A path is a prepared directory, or a JSONL / Parquet file prepared here into
    `cache_dir`/NAME (kept there: a resumed run finds its shards done)."""
    entries = data.sources or [{"path": data.train}]
    dirs, weights, names, rejected = [], [], [], 0
    for i, src in enumerate(entries):
        where = f"data.sources[{i}]" if data.sources else "data.train"
        if not isinstance(src, dict) or not isinstance(src.get("path"), str) or set(src) - {"path", "weight"}:
            raise ValueError(f"{where}: expected {{path: FILE, weight: NUMBER}}, got {src!r}")
        w = src.get("weight", 1.0)
        if isinstance(w, bool) or not isinstance(w, (int, float)) or w <= 0:
            raise ValueError(f"{where}.weight must be a positive number, got {w!r}")
        path = resolve(src["path"])
        stem = _stem(path.rstrip("/"))
        name = stem if stem not in names else f"{stem}_{i}"
        if not is_prepared(path):
            out = os.path.join(cache_dir, name)
            if not quiet:
                print(f"{where}: preparing {path} into {out}")
            prepare([path], data.tokenizer, out, workers=data.prepare_workers, vocab_size=vocab_size,
                    on_error=data.on_error)
            path = out
        rejected += read_manifest(path)["rejected_count"]
        dirs.append(path)
        weights.append(float(w))
        names.append(name)
    docs = PreparedDocuments(dirs, vocab_size)
    return docs, (weights if data.sources else None), (names if data.sources else ["train"]), rejected
