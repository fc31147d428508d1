"""One writer per output folder: `hold(path, command)`, taken by `nemo-jax sft`, `grpo`, `recipe` (their run dirs)
and `data prepare` (its --out). Checkpoints, metrics, TensorBoard events, the spool and prepared shards all assume
a single writer; readers (`generate`, `eval`, `serve`, `export-hf`, rollout workers) never take the lock.

The lock is the file `LOCK_FILE` inside the folder, created atomically (a complete temporary file hard-linked
into place: on every POSIX filesystem, NFS included, exactly one of two racing creators succeeds). It records the
holder: command, pid, host, the machine's boot id and PID namespace, the process's start time, when the lock
was taken, and a random token. Its modification time is the holder's heartbeat: a thread of the holder touches
it every HEARTBEAT_S seconds (and checks the file is still its own). The holder removes it when done, however
it ends short of being killed.

When a process finds the lock taken, it decides whether the holder is still there:

* on the same machine (same host name, boot id and PID namespace): the holder is gone when no process has its
  pid, the process with that pid started at another time (the pid was reused), or it is a zombie (it exited and
  its parent has not reaped it yet). This is exact and immediate, so a command killed a moment ago does not
  block its rerun.
* elsewhere (another host sharing the filesystem, a container in another PID namespace, or this host before a
  reboot): the holder is gone when its heartbeat is older than STALE_S seconds (default 300; 10 heartbeats). The
  heartbeat is the lock file's modification time, which on NFS the server stamps with its own clock; its age is
  measured against a file the reader touches in the same folder (`_fs_now`), so the hosts' and the server's
  clocks need not agree (where the folder cannot be written, this host's clock is used). A holder whose host died
  or lost the filesystem stops refreshing the heartbeat; after STALE_S its lock is reclaimed.
* a lock file that is not a readable lock (a crash while the filesystem was full): gone when older than STALE_S.

A live holder: `LockHeld`, one line naming the folder, the holder's command, pid, host, start time and last
heartbeat. A gone holder: its lock is moved aside, removed, and retaken, with one line on stderr saying whose
lock was reclaimed and why. Two processes reclaiming at once cannot both win: each renames the stale file to a
name of its own and checks it renamed the file it judged; the loser retries and finds the winner's live lock.
A holder whose lock file was replaced by another's (possible only by hand or if the rule above misjudged)
stops at once with a line saying so rather than write beside another writer.

NEMO_JAX_LOCK_HEARTBEAT_S and NEMO_JAX_LOCK_STALE_S change the two periods (the stale period should stay many
heartbeats long). Multi-process runs take the lock once, on process 0
(`nemo_jax.parallel.distributed.writer_lock`).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import secrets
import socket
import sys
import threading
import time

LOCK_FILE = ".nemo_jax-lock.json"
HEARTBEAT_S = 30.0
STALE_S = 300.0


class LockHeld(ValueError):
    """The folder is being written by another live process (nothing was touched)."""


def _periods() -> tuple[float, float]:
    def env(name, default):
        try:
            v = float(os.environ.get(name, default))
        except ValueError:
            raise ValueError(f"{name}={os.environ[name]!r}: expected a number of seconds") from None
        if not v > 0:
            raise ValueError(f"{name}={os.environ[name]!r}: must be > 0")
        return v

    return env("NEMO_JAX_LOCK_HEARTBEAT_S", HEARTBEAT_S), env("NEMO_JAX_LOCK_STALE_S", STALE_S)


def _read_text(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def _machine() -> dict:
    """What makes two processes' pids comparable: host name, boot id, PID namespace (None where unknown)."""
    try:
        pid_ns = os.readlink("/proc/self/ns/pid")
    except OSError:
        pid_ns = None
    return {"host": socket.gethostname(), "boot_id": _read_text("/proc/sys/kernel/random/boot_id"),
            "pid_ns": pid_ns}


def _stat_fields(pid: int) -> list[str] | None:
    """/proc/PID/stat's fields after the command name (state first), None where unknown."""
    text = _read_text(f"/proc/{pid}/stat")
    return text.rpartition(")")[2].split() if text else None


def _process_start(pid: int) -> int | None:
    """The start time of process `pid` in clock ticks since boot (/proc/PID/stat field 22), None where unknown."""
    try:
        return int(_stat_fields(pid)[19])
    except (TypeError, IndexError, ValueError):
        return None


def _pid_alive(pid: int, start: int | None) -> bool:
    """Whether process `pid` (started at `start`) still runs: not gone, not another process that reused the pid,
    and not a zombie (exited, waiting for its parent to reap it: it writes nothing more)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # another user's process: it exists
    fields = _stat_fields(pid)
    if fields and fields[0] in ("Z", "X"):
        return False
    now = _process_start(pid)
    return start is None or now is None or now == start


def _describe(holder: dict | None, age: float) -> str:
    if not holder:
        return f"an unreadable lock file (last written {age:.0f} s ago)"
    started = holder.get("started", "?")
    return (f"{holder.get('command') or 'nemo-jax'} (pid {holder.get('pid')} on {holder.get('host')}, started "
            f"{started}, heartbeat {age:.0f} s ago)")


def judge(holder: dict | None, age: float, stale_s: float | None = None) -> str | None:
    """Why the holder of a lock (its recorded fields; None if unreadable) whose heartbeat is `age` seconds old is
    gone, or None while it may still be writing (the rules in the module docstring)."""
    stale_s = _periods()[1] if stale_s is None else stale_s
    if holder is None:
        return f"the lock file is unreadable and {age:.0f} s old (> {stale_s:.0f} s)" if age > stale_s else None
    here = _machine()
    same = all(holder.get(k) == here[k] for k in ("host", "boot_id", "pid_ns"))
    if same and isinstance(holder.get("pid"), int):
        if holder["pid"] == os.getpid() and holder.get("token") not in _HELD_TOKENS:
            return "its pid is this process's now"
        if not _pid_alive(holder["pid"], holder.get("proc_start")):
            return "that process is gone"
        return None
    if age > stale_s:
        where = "another host" if holder.get("host") != here["host"] else "another PID namespace or boot"
        return f"its heartbeat is {age:.0f} s old (> {stale_s:.0f} s; the holder runs on {where})"
    return None


def read(folder: str) -> tuple[dict | None, float] | None:
    """(the lock's recorded holder, None if unreadable; its heartbeat's age in seconds) of `folder`, or None
    when the folder holds no lock."""
    path = os.path.join(folder, LOCK_FILE)
    try:
        st = os.stat(path)
        with open(path) as f:
            text = f.read()
    except FileNotFoundError:
        return None
    try:
        holder = json.loads(text)
    except ValueError:
        holder = None
    if not isinstance(holder, dict):
        holder = None
    here = _machine()
    if holder is not None and all(holder.get(k) == here[k] for k in ("host", "boot_id", "pid_ns")):
        return holder, max(0.0, time.time() - st.st_mtime)
    return holder, max(0.0, _fs_now(folder) - st.st_mtime)  # (a holder elsewhere: judged by its heartbeat's age)


def _fs_now(folder: str) -> float:
    """`now` by the clock that stamps files in `folder`: on NFS the heartbeat's mtime is the server's clock, not
    the holder's, so its age is measured against a file this process touches there now (this host's clock where
    the folder cannot be written)."""
    probe = os.path.join(folder, f"{LOCK_FILE}.clock-{os.getpid()}-{secrets.token_hex(4)}")
    try:
        with open(probe, "w"):
            pass
        try:
            os.utime(probe)  # (set by the server on NFS, as the holder's heartbeat is)
            return os.stat(probe).st_mtime
        finally:
            os.unlink(probe)
    except OSError:
        return time.time()


def _create(path: str, record: dict) -> bool:
    """Create lock file `path` holding `record`, atomically: True, or False when one exists."""
    tmp = f"{path}.tmp-{record['token']}"
    with open(tmp, "w") as f:
        json.dump(record, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    try:
        os.link(tmp, path)
        return True
    except FileExistsError:
        return False
    except OSError as e:  # a filesystem without hard links: exclusive create (briefly empty: read as unreadable,
        if e.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV):  # and fresh, so held)
            raise
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "w") as f:
            json.dump(record, f, indent=1)
        return True
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)


def _reclaim(path: str, holder: dict | None, token: str) -> bool:
    """Move the stale lock `path` (recorded `holder`) out of the way: True when the file moved was that lock."""
    aside = f"{path}.stale-{token}"
    try:
        os.rename(path, aside)
    except FileNotFoundError:
        return False  # someone else reclaimed it first
    try:
        with open(aside) as f:
            moved = json.load(f)
    except ValueError:
        moved = None
    if holder is not None and (not isinstance(moved, dict) or moved.get("token") != holder.get("token")):
        # a contender reclaimed it and took the lock between our look and our rename: put its lock back
        with contextlib.suppress(FileExistsError):
            os.link(aside, path)
        os.unlink(aside)
        return False
    os.unlink(aside)
    return True


def is_lock_entry(name: str) -> bool:
    """Whether a folder entry is the lock or one of its passing temporaries (not content of the folder)."""
    return name == LOCK_FILE or name.startswith(LOCK_FILE + ".")


_HELD: dict[str, list] = {}  # folder -> [depth, Holder] for the locks this process holds (nested holds count)
_HELD_TOKENS: set[str] = set()


class Holder:
    """A taken lock: its file, record and heartbeat thread."""

    def __init__(self, folder: str, record: dict, heartbeat_s: float):
        self.folder, self.path, self.record = folder, os.path.join(folder, LOCK_FILE), record
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, args=(heartbeat_s,), daemon=True,
                                        name=f"nemo-jax lock heartbeat {folder}")
        self._thread.start()

    def _mine(self) -> bool:
        with open(self.path) as f:
            return json.load(f).get("token") == self.record["token"]

    def _beat(self, every: float):
        while not self._stop.wait(every):
            try:
                os.utime(self.path)
                mine = self._mine()
            except FileNotFoundError:  # removed by hand: take it back unless another process has it now
                if not os.path.isdir(self.folder):
                    return  # the folder itself is gone (its writer removed it): nothing left to guard
                try:
                    mine = _create(self.path, self.record)
                except OSError:
                    continue
            except (OSError, ValueError):
                continue  # a passing filesystem error: look again at the next beat
            if not mine and not self._stop.is_set():
                print(f"{self.record['command']}: error: {self.folder}: lost the write lock ({LOCK_FILE} now "
                      f"belongs to another process); stopping at once so that two writers do not interleave",
                      file=sys.stderr, flush=True)
                os._exit(5)  # no exit handlers: they would write (a checkpoint) beside the other writer

    def release(self):
        """Stop the heartbeat and remove the lock file if it is still this holder's (idempotent)."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._thread.join(timeout=5)
        with contextlib.suppress(OSError, ValueError):
            if self._mine():
                os.unlink(self.path)
        _HELD_TOKENS.discard(self.record["token"])


def _held(folder: str, holder: dict | None, age: float) -> LockHeld:
    return LockHeld(f"{folder} is being written by {_describe(holder, age)}: one writer at a time; wait for it to "
                    f"end or stop it (a holder that died is detected and its lock reclaimed)")


def check_free(folder: str) -> None:
    """LockHeld when a live process other than this one holds the write lock of `folder`: what a command asks
    before it judges or moves what is in the folder (a stale lock passes: `acquire` reclaims it)."""
    folder = os.path.abspath(folder)
    found = read(folder) if os.path.isdir(folder) else None
    if found is None:
        return
    holder, age = found
    if holder is not None and holder.get("token") in _HELD_TOKENS:
        return
    if judge(holder, age) is None:
        raise _held(folder, holder, age)


def acquire(folder: str, command: str) -> Holder:
    """Take the write lock of `folder` (made if missing) for `command` (e.g. "nemo-jax sft"), reclaiming a stale
    one with a line on stderr; LockHeld when a live process holds it. Release with `Holder.release`."""
    heartbeat_s, stale_s = _periods()
    folder = os.path.abspath(folder)
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, LOCK_FILE)
    token = secrets.token_hex(8)
    record = {"command": command, "pid": os.getpid(), **_machine(), "proc_start": _process_start(os.getpid()),
              "started": time.strftime("%Y-%m-%d %H:%M:%S %z"), "started_unix": round(time.time(), 3),
              "token": token}
    for _ in range(100):
        if _create(path, record):
            _HELD_TOKENS.add(token)
            return Holder(folder, record, heartbeat_s)
        found = read(folder)
        if found is None:
            continue  # released meanwhile: try again
        holder, age = found
        why = judge(holder, age, stale_s)
        if why is None:
            if holder is None:
                time.sleep(0.05)  # being written by a filesystem without hard links: look again
                found = read(folder)
                if found is not None and found[0] is not None:
                    continue
            raise _held(folder, holder, age)
        if _reclaim(path, holder, token):
            print(f"{command}: {folder}: reclaimed the write lock of {_describe(holder, age)}: {why}",
                  file=sys.stderr, flush=True)
    raise LockHeld(f"{folder}: could not take the write lock ({LOCK_FILE} keeps changing hands)")


@contextlib.contextmanager
def hold(folder: str, command: str):
    """Hold the write lock of `folder` for the block (see `acquire`); nested holds of one folder in one process
    share the outer one."""
    key = os.path.abspath(folder)
    if key in _HELD:
        _HELD[key][0] += 1
    else:
        _HELD[key] = [1, acquire(key, command)]
    try:
        yield _HELD[key][1]
    finally:
        _HELD[key][0] -= 1
        if not _HELD[key][0]:
            _HELD.pop(key)[1].release()
