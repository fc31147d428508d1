"""Write-then-rename: outputs appear complete or not at all."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import threading

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "tokenizer.model", "vocab.json", "merges.txt")


@contextlib.contextmanager
def atomic_dir(path: str):
    """Yield a temporary directory beside `path`; on success it replaces `path` (an existing directory is
    swapped out only after the new one is complete); on failure it is removed and `path` is untouched."""
    path = os.path.abspath(os.fspath(path))
    parent = os.path.dirname(path)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=os.path.basename(path) + ".tmp-", dir=parent)
    try:
        yield tmp
        fsync_tree(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    publish(tmp, path)


def publish(tmp: str, path: str):
    """Rename the complete directory `tmp` to `path` (beside it); an existing `path` is swapped out first
    and removed after."""
    parent = os.path.dirname(path)
    if os.path.exists(path):
        old = tempfile.mkdtemp(prefix=os.path.basename(path) + ".old-", dir=parent)
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
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


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
