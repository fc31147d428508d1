"""Outputs that never destroy what they did not make, written whole or not at all.

* `atomic_dir(path, kind)`: the output is written into a temporary directory beside `path` and renamed into place
  only when complete. An existing non-empty `path` is refused (`OutputExistsError`) unless `overwrite`, and even
  then it is replaced only when it is an earlier output of the same kind written here: it carries the marker
  file `OUTPUT_MARKER` naming its kind and listing its entries, and holds nothing else (a file a user put in it
  keeps it from being replaced).
* Temporaries are named `<name>.tmp-<host>-<pid>-<random>`; those whose writer on this host has died (a killed
  command) are removed by the next write of the same output, and an interrupted swap (`<name>.old-...` left
  while `<name>` is missing) is rolled back, so nothing piles up and nothing is lost.
* Outputs get the permissions `mkdir` and `open` would give them under the user's umask (a temporary is made
  private by `tempfile`; it is opened up before it is published), so another account (a vLLM server) can read them.
* An output is never one of its command's inputs, inside one, or around one (`check_not_input`).
* `read_json` / `read_yaml`: a user's file read with one clear line for a missing file or one that does not parse
  (the file and the line named), in the error type the caller's command reports.
* Content manifests (`write_manifest` / `verify_manifest`): the size and hash of every file of a folder, so a
  reader can prove a checkpoint is as it was written (`nemo_jax.checkpoint.latest_good_step`).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import shutil
import socket
import tempfile
import threading
import time
import zlib
from typing import NamedTuple

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "tokenizer.model", "vocab.json", "merges.txt")
OUTPUT_MARKER = ".nemo_jax-output.json"  # {"kind", "command", "files", "written"} inside every output folder
COMMAND = None  # the `nemo-jax` subcommand running (set by the CLI; recorded in markers)


class OutputExistsError(ValueError):
    """The destination holds something this command may not replace (nothing was written)."""


def umask() -> int:
    """The process's umask (read from /proc where it can be, since setting it to read it is not thread-safe)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _owner_tag() -> str:
    return f"{socket.gethostname().replace('-', '_')}-{os.getpid()}-"


def _writer_alive(name: str, prefix: str) -> bool | None:
    """Whether the writer named in the temporary `name` (`prefix` + host-pid-random) still runs: None when the
    name does not say (another host's writer, or a name of another form)."""
    host, _, rest = name[len(prefix):].partition("-")
    pid = rest.partition("-")[0]
    if host != socket.gethostname().replace("-", "_") or not pid.isdigit():
        return None
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def recover(path: str) -> None:
    """Tidy the surroundings of output `path` after a killed writer: remove its dead writers' temporaries
    (`path.tmp-*`) and roll back an interrupted swap (a `path.old-*` left while `path` is missing is renamed
    back; one left beside a complete `path` is removed)."""
    path = os.path.abspath(os.fspath(path))
    parent, base = os.path.split(path)
    try:
        names = os.listdir(parent)
    except FileNotFoundError:
        return
    for kind in (".tmp-", ".old-"):
        prefix = base + kind
        for name in sorted(n for n in names if n.startswith(prefix)):
            if _writer_alive(name, prefix) is not False:
                continue
            full = os.path.join(parent, name)
            if kind == ".old-" and not os.path.lexists(path):
                os.rename(full, path)  # the swap was interrupted before the new output was in place
            else:
                shutil.rmtree(full, ignore_errors=True)


def move_aside(path: str, tag: str) -> str:
    """Rename `path` to `path.TAG` (or `path.TAG-2`, ...: never over anything) -> the new path. Nothing is
    deleted: a damaged checkpoint step (`damaged`), an earlier run replaced by `--new-run` (`prev`)."""
    path = os.path.abspath(os.fspath(path)).rstrip(os.sep)
    dst, k = f"{path}.{tag}", 1
    while os.path.lexists(dst):
        k += 1
        dst = f"{path}.{tag}-{k}"
    os.rename(path, dst)
    return dst


def read_marker(path: str) -> dict | None:
    """The output marker of folder `path`, or None (none, or unreadable)."""
    try:
        with open(os.path.join(path, OUTPUT_MARKER)) as f:
            m = json.load(f)
    except (OSError, ValueError):
        return None
    return m if isinstance(m, dict) else None


def check_not_input(out: str, inputs, what: str = "destination") -> None:
    """Refuse (OutputExistsError) an output that is one of the `inputs` (paths), lies inside one, or holds one:
    writing it would replace or change what the command reads. Paths are compared after resolving links."""
    real = os.path.realpath(out)
    for src in inputs:
        if not src:
            continue
        s = os.path.realpath(src)
        how = ("is the input" if real == s else "lies inside the input" if real.startswith(s.rstrip(os.sep) + os.sep)
               else "holds the input" if s.startswith(real.rstrip(os.sep) + os.sep) else None)
        if how:
            raise OutputExistsError(f"{out} {how} {src}: an output never replaces or changes what it is made from "
                                    f"(choose another {what})")


def check_output(path: str, kind: str, overwrite: bool = False, own_files=()) -> str:
    """May output `path` (a `kind`, e.g. "HF checkpoint") be written? -> its absolute path, or OutputExistsError.

    Allowed: a missing path or an empty folder; with `overwrite`, a folder holding an earlier output of the same
    kind (its marker, and no entry the marker does not list). `own_files`: names an output of this kind written
    before markers existed holds (a folder of only those counts as one)."""
    path = os.path.abspath(os.fspath(path))
    if not os.path.lexists(path):
        return path
    if os.path.islink(path) or not os.path.isdir(path):
        raise OutputExistsError(f"{path} exists and is not a folder: not replaced (choose another destination)")
    entries = sorted(os.listdir(path))
    if not entries:
        return path
    if not overwrite:
        raise OutputExistsError(f"{path} exists and is not empty: not replaced (pass --overwrite to replace an "
                                f"earlier {kind} written by nemo-jax, or choose another destination)")
    m = read_marker(path)
    if m is None:
        if own_files and set(entries) <= set(own_files):
            return path
        raise OutputExistsError(f"{path}: not replaced even with --overwrite: it has no {OUTPUT_MARKER}, so it is "
                                f"not an output nemo-jax wrote (move or delete it yourself, or choose another "
                                "destination)")
    if m.get("kind") != kind:
        raise OutputExistsError(f"{path}: not replaced: it holds a {m.get('kind')} (written by "
                                f"{m.get('command') or 'nemo-jax'}), not a {kind}")
    foreign = [e for e in entries if e != OUTPUT_MARKER and e not in set(m.get("files") or ())]
    if foreign:
        more = f" (and {len(foreign) - 1} more)" if len(foreign) > 1 else ""
        raise OutputExistsError(f"{path}: not replaced: {foreign[0]!r}{more} in it was not written by nemo-jax; move "
                                "it out first")
    return path


def write_marker(folder: str, kind: str):
    """Record `folder` (complete, about to be published) as a `kind` output listing its entries."""
    files = sorted(e for e in os.listdir(folder) if e != OUTPUT_MARKER)
    with open(os.path.join(folder, OUTPUT_MARKER), "w") as f:
        json.dump({"kind": kind, "command": f"nemo-jax {COMMAND}" if COMMAND else "nemo_jax (Python API)",
                   "files": files, "written": time.strftime("%Y-%m-%dT%H:%M:%S%z")}, f, indent=1)


@contextlib.contextmanager
def atomic_dir(path: str, kind: str, *, overwrite: bool = False, own_files=(), manifest: bool = False):
    """Yield a temporary directory beside `path`; on success it is marked as a `kind` output (with a content
    manifest of every file if `manifest`) and replaces `path`; on failure it is removed and `path` is
    untouched. `path` is checked first (`check_output`), so a refused destination costs no work."""
    path = os.path.abspath(os.fspath(path))
    parent = os.path.dirname(path)
    os.makedirs(parent, exist_ok=True)
    recover(path)
    check_output(path, kind, overwrite, own_files)
    tmp = tempfile.mkdtemp(prefix=f"{os.path.basename(path)}.tmp-{_owner_tag()}", dir=parent)
    os.chmod(tmp, 0o777 & ~umask())  # as mkdir makes a folder (mkdtemp's is private)
    try:
        yield tmp
        seal(tmp, kind, manifest)
        check_output(path, kind, overwrite, own_files)  # nothing appeared there meanwhile
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        code = None if isinstance(e, OSError) and (type(e) is not OSError or e.filename) else os_error_code(e)
        if code and isinstance(e, Exception):  # a full disk while writing (whatever raised it): say which output
            raise OSError(code, os.strerror(code), path) from e
        raise
    publish(tmp, path)


def seal(folder: str, kind: str, manifest: bool = False):
    """A complete output before its rename: content manifest (if asked), output marker, every file synced."""
    if manifest:
        write_manifest(folder)
    write_marker(folder, kind)
    fsync_tree(folder)


def publish(tmp: str, path: str):
    """Rename the complete directory `tmp` to `path` (beside it); an existing `path` is swapped out first
    and removed after (`recover` rolls back a swap interrupted in between)."""
    parent = os.path.dirname(path)
    if os.path.exists(path):
        old = tempfile.mkdtemp(prefix=f"{os.path.basename(path)}.old-{_owner_tag()}", dir=parent)
        os.rmdir(old)
        os.rename(path, old)
        os.rename(tmp, path)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, path)


def fsync_tree(root: str):
    """Flush every file under `root` to disk (before a rename publishes it). A file that vanishes between the
    listing and the open is skipped: in a directory several processes write (`distributed.shared_atomic_dir`)
    another process's writer creates and removes lock files meanwhile (each process syncs after its own
    writes, so nothing it wrote is missed)."""
    for d, _, files in os.walk(root):
        for name in files:
            try:
                fd = os.open(os.path.join(d, name), os.O_RDONLY)
            except FileNotFoundError:
                continue
            try:
                os.fsync(fd)
            finally:
                os.close(fd)


def atomic_write_text(path: str, text: str) -> None:
    """Write `text` to `path` complete or not at all (a temporary file beside it, fsynced, renamed)."""
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix="." + os.path.basename(path) + ".tmp-", dir=d)
    try:
        os.fchmod(fd, 0o666 & ~umask())  # as open() makes a file (mkstemp's is private)
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
# --------------------------------------------------------------------------- content manifests
CONTENT_MANIFEST = "nemo_jax-manifest.json"  # {"hash": "xxh3_64", "files": {relative path: [bytes, hex digest]}}
_READ = 16 << 20


class Damage(NamedTuple):
    """What is wrong with a folder against its content manifest."""
    file: str  # path relative to the folder (the manifest itself when it is unreadable)
    reason: str


class _Crc32:
    """zlib.crc32 behind the hashlib interface (where xxhash is not installed)."""

    def __init__(self):
        self.value = 0

    def update(self, data):
        self.value = zlib.crc32(data, self.value)

    def hexdigest(self) -> str:
        return f"{self.value:08x}"


def _hasher(name: str):
    if name == "xxh3_64":
        import xxhash

        return xxhash.xxh3_64()
    if name == "crc32":
        return _Crc32()
    raise ValueError(f"unknown content hash {name!r}")


def _hash_name() -> str:
    """xxh3_64 (about 20 GB/s) when xxhash is installed, else crc32 (about 2 GB/s)."""
    import importlib.util

    return "xxh3_64" if importlib.util.find_spec("xxhash") else "crc32"


def _digest(fp: str, buf: bytearray, algorithm: str) -> tuple[int, str]:
    h, n, view = _hasher(algorithm), 0, memoryview(buf)
    with open(fp, "rb", buffering=0) as f:
        while True:
            k = f.readinto(view)
            if not k:
                break
            h.update(view[:k])
            n += k
    return n, h.hexdigest()


def _files(folder: str) -> list[str]:
    out = []
    for d, dirs, files in os.walk(folder):
        dirs.sort()
        out += [os.path.relpath(os.path.join(d, f), folder) for f in sorted(files)]
    return [f for f in out if f != CONTENT_MANIFEST]


def write_manifest(folder: str) -> int:
    """Hash every file under `folder` (xxh3_64, or crc32 without xxhash) into `folder/CONTENT_MANIFEST`, written
    last and atomically (complete files first, synced; then the manifest renamed into place) -> bytes hashed."""
    buf, algorithm = bytearray(_READ), _hash_name()
    files = {}
    for rel in _files(folder):
        files[rel] = list(_digest(os.path.join(folder, rel), buf, algorithm))
    tmp = os.path.join(folder, CONTENT_MANIFEST + ".tmp")
    with open(tmp, "w") as f:
        json.dump({"hash": algorithm, "files": files}, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(folder, CONTENT_MANIFEST))
    return sum(n for n, _ in files.values())


def has_manifest(folder: str) -> bool:
    return os.path.exists(os.path.join(folder, CONTENT_MANIFEST))


def verify_manifest(folder: str) -> tuple[Damage | None, int]:
    """Check every file `folder`'s content manifest lists: present, of its size, of its hash (every byte is
    read) -> (the first damage found or None, bytes read). A folder without a manifest is not checked."""
    try:
        with open(os.path.join(folder, CONTENT_MANIFEST)) as f:
            record = json.load(f)
        items = [(str(k), int(v[0]), str(v[1])) for k, v in record["files"].items()]
        algorithm = record.get("hash", "xxh3_64")
        _hasher(algorithm)
    except FileNotFoundError:
        return None, 0
    except (OSError, ValueError, KeyError, TypeError, IndexError) as e:
        return Damage(CONTENT_MANIFEST, f"unreadable manifest ({type(e).__name__})"), 0
    buf, done = bytearray(_READ), 0
    for rel, size, digest in items:
        fp = os.path.join(folder, rel)
        try:
            got = os.path.getsize(fp)
            if got != size:
                return Damage(rel, f"{got} bytes, {size} when written"), done
            n, h = _digest(fp, buf, algorithm)
        except OSError as e:
            return Damage(rel, f"unreadable ({e.strerror or type(e).__name__})"), done
        done += n
        if h != digest:
            return Damage(rel, "content differs from when it was written"), done
    return None, done


_ERRNO_IN_TEXT = re.compile(r"\[Errno (\d+)\]|os_error_code='?(\d+)|Os \{ code: (\d+)|\(os error (\d+)\)")


def read_json(path, missing: str = "no such file", *, error: type[Exception] = ValueError,
              missing_error: type[Exception] = FileNotFoundError, where: str | None = None):
    """The JSON value in the file `path`. A missing file raises `missing_error("WHERE: MISSING")` (`where`: what the
    user named, default the path), one that does not parse `error("PATH: not valid JSON (what, line N)")`."""
    return _read_structured(path, json.load, "JSON", (ValueError,), missing, error, missing_error, where)


def read_yaml(path, missing: str = "no such file", *, error: type[Exception] = ValueError,
              missing_error: type[Exception] = FileNotFoundError, where: str | None = None, mapping: bool = False):
    """`read_json` for a YAML file (an empty file reads as None); `mapping`: the top level must be a mapping (an
    empty file reads as {})."""
    import yaml

    data = _read_structured(path, yaml.safe_load, "YAML", (yaml.YAMLError, ValueError), missing, error,
                            missing_error, where)
    if mapping:
        data = {} if data is None else data
        if not isinstance(data, dict):
            raise error(f"{os.fspath(path)}: top level must be a mapping")
    return data


def _read_structured(path, load, kind: str, parse_errors: tuple, missing: str, error, missing_error, where):
    path = os.fspath(path)
    try:
        with open(path, encoding="utf-8") as f:
            return load(f)
    except FileNotFoundError:
        raise missing_error(f"{where or path}: {missing}") from None
    except parse_errors as e:  # (a file that is not UTF-8 text is a ValueError too)
        raise error(f"{path}: not valid {kind} ({_parse_error(e)})") from None


def _parse_error(e: Exception) -> str:
    """What a JSON or YAML parser says went wrong, with the file's line."""
    if hasattr(e, "lineno"):  # json.JSONDecodeError
        return f"{e.msg}, line {e.lineno}"
    mark = getattr(e, "problem_mark", None)
    problem = getattr(e, "problem", None) or str(e).splitlines()[0]
    return f"{problem}, line {mark.line + 1}" if mark is not None else problem


def os_error_code(e: BaseException, by_message: bool = False) -> int | None:
    """The errno behind a failed write, whichever layer reported it: an OSError's own, or the one in the text of
    tensorstore's ("os_error_code='28'"), safetensors' ("(os error 28)", "Os { code: 28") or a wrapped
    "[Errno 28]"; with `by_message`, else the errno whose C library message the text holds (array_record's "No
    space left on device"). None if there is none."""
    if isinstance(e, OSError) and e.errno:
        return e.errno
    text = str(e)
    m = _ERRNO_IN_TEXT.search(text)
    if m:
        return int(next(g for g in m.groups() if g))
    return next((c for c in errno.errorcode if os.strerror(c) in text), None) if by_message else None


def describe_os_error(e: OSError) -> str:
    """'PATH: [Errno 28] No space left on device (ENOSPC)'."""
    code = errno.errorcode.get(e.errno, "") if e.errno else ""
    where = f"{e.filename}: " if e.filename else ""
    return f"{where}[Errno {e.errno}] {e.strerror or e}" + (f" ({code})" if code else "")


def copy_tokenizer_files(src: str | None, dst: str):
    if not src or not os.path.isdir(src):
        return
    for t in TOKENIZER_FILES:
        if os.path.exists(os.path.join(src, t)):
            shutil.copy2(os.path.join(src, t), os.path.join(dst, t))


class RecentCache:
    """A thread-safe cache of the `keep` most recently used values of `make(key)`."""

    def __init__(self, make, keep: int):
        self._make, self._keep, self._items, self._lock = make, keep, {}, threading.Lock()

    def __call__(self, key):
        with self._lock:
            if key in self._items:
                self._items[key] = self._items.pop(key)
                return self._items[key]
            while len(self._items) >= self._keep:
                self._items.pop(next(iter(self._items)))  # drop before making the next
            value = self._items[key] = self._make(key)
            return value
