"""What every sandbox backend shares: the settings (`Limits`, `SandboxSpec`), a command's `Result`, running a
host process with a wall clock and bounded output, symlink-safe file access to a host folder, and the ownership
records that let a restarted run sweep what a killed one left. Standard library only (no JAX, nothing of
nemo_jax): the bottom of the layer table."""

from __future__ import annotations

import dataclasses
import errno
import fcntl
import os
import secrets
import shutil
import signal
import socket
import stat
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass, field

BACKENDS = ("auto", "bwrap", "rlimit", "docker", "kubernetes")


class SandboxError(ValueError):
    """A sandbox could not start or was misused; the message names the backend and what is missing (a
    ValueError: the CLI prints it as one error line)."""


@dataclass(frozen=True)
class Limits:
    """Per command (`wall_s`, `cpu_s`, `memory_mb`, `output_kb`) and per sandbox (`processes`, `disk_mb`)."""
    wall_s: float = 30.0  # wall-clock seconds per command (the process tree is killed past it)
    cpu_s: int = 20  # CPU seconds per process (RLIMIT_CPU: SIGXCPU, then SIGKILL)
    memory_mb: int = 1024  # address space per process (RLIMIT_AS; containers: the memory cgroup)
    processes: int = 64  # processes and threads of the sandbox at once (RLIMIT_NPROC of its own uid; pids cgroup)
    file_mb: int = 64  # the largest file a process may write (RLIMIT_FSIZE)
    output_kb: int = 64  # stdout and stderr kept per command, each (the rest is dropped and the result says so)
    open_files: int = 256  # RLIMIT_NOFILE
    disk_mb: int = 256  # the sandbox folder's total size (checked after each command; containers: tmpfs size)

    def __post_init__(self):
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0:
                raise ValueError(f"sandbox limits.{f.name}: a positive number, got {v!r}")


@dataclass(frozen=True)
class SandboxSpec:
    """Which backend and how it is set up (`rollout.env_args.sandbox` of the environments that run code).

    backend   auto (bubblewrap where it works; never rlimit) | bwrap | rlimit | docker | kubernetes
    packages  Python distributions the sandbox's interpreter may import besides the standard library (local
              backends bind exactly these and what they require, read-only; containers: what the image holds)
    python    the interpreter inside (local: this process's own; containers: python3 on the image's PATH)
    image     docker / kubernetes image (needs python3, coreutils `timeout` and util-linux `prlimit`: any
              Debian or Ubuntu based image)
    runtime   docker `--runtime` (e.g. runsc for gVisor); kubernetes runtimeClassName; "auto" (the default):
              gVisor (runsc / a gvisor RuntimeClass) when the engine or cluster offers it, else the default one
    """
    backend: str = "auto"
    limits: Limits = field(default_factory=Limits)
    packages: tuple = ()
    python: str = ""
    image: str = "python:3.11-slim"
    runtime: str = "auto"
    namespace: str = "default"  # kubernetes
    context: str = ""  # kubectl --context
    docker: str = "docker"  # the docker CLI (any docker-compatible one: podman)
    kubectl: str = "kubectl"
    lifetime_s: float = 3600.0  # a container or pod ends itself after this long (a leak cannot outlive it)
    start_timeout_s: float = 180.0  # a container or pod must be ready within this
    uid_base: int = 200000  # bwrap as root: each sandbox runs as its own uid in [uid_base, uid_base + 65536)

    def __post_init__(self):
        if self.backend not in BACKENDS:
            raise ValueError(f"sandbox backend: {self.backend!r} (expected one of {', '.join(BACKENDS)})")
        if not isinstance(self.limits, Limits):
            raise ValueError(f"sandbox limits: a Limits, got {type(self.limits).__name__}")
        if isinstance(self.packages, str) or not all(isinstance(p, str) and p for p in self.packages):
            raise ValueError(f"sandbox packages: a list of distribution names, got {self.packages!r}")
        object.__setattr__(self, "packages", tuple(self.packages))
        for k in ("lifetime_s", "start_timeout_s"):
            if not getattr(self, k) > 0:
                raise ValueError(f"sandbox {k}: positive, got {getattr(self, k)!r}")
        if not 0 < self.uid_base < 2 ** 31 - 65536:
            raise ValueError(f"sandbox uid_base: in (0, 2**31 - 65536), got {self.uid_base!r}")

    @classmethod
    def from_dict(cls, d: dict | None, where: str = "sandbox") -> "SandboxSpec":
        """A YAML/JSON mapping -> a spec; an unknown key is one error line naming it."""
        if isinstance(d, SandboxSpec):
            return d
        d = dict(d or {})
        known = {f.name for f in dataclasses.fields(cls)}
        bad = sorted(set(d) - known)
        if bad:
            raise ValueError(f"{where}: unknown key {bad[0]!r} (known: {', '.join(sorted(known))})")
        lim = d.pop("limits", None) or {}
        if not isinstance(lim, (dict, Limits)):
            raise ValueError(f"{where}.limits: a mapping, got {lim!r}")
        if isinstance(lim, dict):
            lknown = {f.name for f in dataclasses.fields(Limits)}
            lbad = sorted(set(lim) - lknown)
            if lbad:
                raise ValueError(f"{where}.limits: unknown key {lbad[0]!r} (known: {', '.join(sorted(lknown))})")
            lim = Limits(**lim)
        try:
            return cls(limits=lim, **d)
        except (TypeError, ValueError) as e:
            raise ValueError(f"{where}: {e}") from None

    def with_limits(self, **kw) -> "SandboxSpec":
        return dataclasses.replace(self, limits=dataclasses.replace(self.limits, **kw))

    def with_packages(self, *names: str) -> "SandboxSpec":
        return dataclasses.replace(self, packages=tuple(dict.fromkeys(self.packages + names)))


class Sandbox:
    """What every backend's sandbox shares: the processes it started (`_track`), use after `close()` refused,
    `close()` once (a second call does nothing) and the context manager. Each backend says in `_dispose` how it
    kills the processes still running and removes what it made."""
    backend = "sandbox"

    def __init__(self, spec: SandboxSpec):
        self.spec, self.limits = spec, spec.limits
        self.closed = False
        self.commands = 0  # commands run (logged by the environments)
        self._procs: list = []
        self._lock = threading.Lock()

    def _track(self, proc):
        with self._lock:
            self._procs.append(proc)
        return proc

    def _check_open(self):
        if self.closed:
            raise SandboxError(f"sandbox {self.backend}: used after close()")

    def close(self) -> None:
        with self._lock:
            if self.closed:
                return
            self.closed = True
            procs, self._procs = self._procs, []
        self._dispose(procs)

    def _dispose(self, procs: list) -> None:
        raise NotImplementedError

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


@dataclass
class Result:
    """A finished command: exit status (None when killed for time), its output (bytes, each stream cut at
    `limits.output_kb`), whether it ran out of time, its wall seconds, whether output was dropped, and an
    `error` the sandbox adds (disk limit)."""
    rc: int | None
    stdout: bytes = b""
    stderr: bytes = b""
    timed_out: bool = False
    secs: float = 0.0
    truncated: bool = False
    error: str = ""

    @property
    def ok(self) -> bool:
        return self.rc == 0 and not self.timed_out and not self.error

    def text(self, limit: int = 4000) -> str:
        """The result as a tool message would say it: exit status, stdout, stderr, and what went wrong."""
        out = []
        if self.timed_out:
            out.append(f"[killed: over the time limit after {self.secs:.1f}s]")
        elif self.rc not in (0, None):
            out.append(f"[exit code {self.rc}]")
        for label, b in (("", self.stdout), ("stderr:\n", self.stderr)):
            s = b.decode("utf-8", "replace")
            if s:
                out.append(label + (s if len(s) <= limit else s[:limit] + f"\n[... {len(s) - limit} more characters]"))
        if self.truncated:
            out.append("[output cut at the sandbox's output limit]")
        if self.error:
            out.append(f"[{self.error}]")
        return "\n".join(out) if out else "[no output]"


# ----------------------------------------------------------------------------- running a host process
def _drain(stream, cap: int, keep: bytearray, flags: dict):
    while True:
        chunk = stream.read(65536)
        if not chunk:
            break
        room = cap - len(keep)
        if room > 0:
            keep += chunk[:room]
        if len(chunk) > max(room, 0):
            flags["truncated"] = True
    stream.close()


def _feed(stream, data: bytes):
    try:
        stream.write(data)
    except (BrokenPipeError, OSError):
        pass
    finally:
        try:
            stream.close()
        except OSError:
            pass


def kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL a process started with `start_new_session` and its process group."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.kill()
    except OSError:
        pass


def run_process(argv: list[str], *, stdin: bytes | None, wall_s: float, output_bytes: int, env: dict | None = None,
                cwd: str | None = None, pass_fds=(), on_timeout=None) -> Result:
    """Run `argv` on the host in a session of its own: stdout and stderr each kept up to `output_bytes` (read to
    the end all the same, so a chatty process cannot block), killed with its process group past `wall_s`
    (`on_timeout()` is called then, e.g. to kill what a remote exec left running)."""
    t0 = time.monotonic()
    try:
        proc = subprocess.Popen(argv, stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, cwd=cwd,
                                start_new_session=True, pass_fds=tuple(pass_fds), close_fds=True)
    except OSError as e:
        raise SandboxError(f"cannot run {argv[0]}: {e.strerror or e}") from None
    out, err, flags = bytearray(), bytearray(), {}
    threads = [threading.Thread(target=_drain, args=(proc.stdout, output_bytes, out, flags), daemon=True),
               threading.Thread(target=_drain, args=(proc.stderr, output_bytes, err, flags), daemon=True)]
    if stdin is not None:
        threads.append(threading.Thread(target=_feed, args=(proc.stdin, stdin), daemon=True))
    for t in threads:
        t.start()
    timed_out = False
    try:
        proc.wait(timeout=wall_s)
    except subprocess.TimeoutExpired:
        timed_out = True
        kill_group(proc)
        if on_timeout is not None:
            on_timeout()
        proc.wait()
    for t in threads:
        t.join(timeout=5.0)
    return Result(None if timed_out else proc.returncode, bytes(out), bytes(err), timed_out, time.monotonic() - t0,
                  bool(flags.get("truncated")))


# ----------------------------------------------------------------------------- symlink-safe host folder access
def _parts(rel: str) -> list[str]:
    """A path relative to the sandbox folder -> its components; absolute paths and `..` are refused."""
    if not isinstance(rel, str) or not rel or rel.startswith("/") or "\0" in rel:
        raise ValueError(f"sandbox path {rel!r}: a relative path inside the sandbox folder")
    parts = [p for p in rel.split("/") if p not in ("", ".")]
    if not parts or ".." in parts:
        raise ValueError(f"sandbox path {rel!r}: a relative path inside the sandbox folder (no '..')")
    return parts


def _open_dir(root: str, parts: list[str], create: bool, owner: tuple[int, int] | None) -> int:
    """A descriptor of the folder root/parts[0]/... walked without following any link (created when asked)."""
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        for p in parts:
            if create:
                try:
                    os.mkdir(p, 0o755, dir_fd=fd)
                    if owner is not None:
                        os.chown(p, *owner, dir_fd=fd, follow_symlinks=False)
                except FileExistsError:
                    pass
            nxt = os.open(p, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
            os.close(fd)
            fd = nxt
        return fd
    except BaseException:
        os.close(fd)
        raise


def folder_put(root: str, rel: str, data: bytes, mode: int = 0o644, owner: tuple[int, int] | None = None):
    """Write `data` to root/rel (folders made as needed); a link anywhere on the way is refused (ValueError)."""
    parts = _parts(rel)
    try:
        d = _open_dir(root, parts[:-1], True, owner)
    except OSError as e:
        raise ValueError(f"sandbox put {rel!r}: {e.strerror} (links are not followed)") from None
    try:
        try:
            fd = os.open(parts[-1], os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_NONBLOCK, mode,
                         dir_fd=d)
        except OSError as e:
            raise ValueError(f"sandbox put {rel!r}: {e.strerror} (links are not followed)") from None
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise ValueError(f"sandbox put {rel!r}: not a regular file")
            os.fchmod(fd, mode)
            if owner is not None:
                os.fchown(fd, *owner)
            with os.fdopen(os.dup(fd), "wb") as f:
                f.write(data)
        finally:
            os.close(fd)
    finally:
        os.close(d)


def folder_get(root: str, rel: str, max_bytes: int | None = None) -> bytes | None:
    """The bytes of the regular file root/rel, or None (missing, a link on the way, a folder, a device, a pipe);
    at most `max_bytes`."""
    parts = _parts(rel)
    try:
        d = _open_dir(root, parts[:-1], False, None)
    except OSError:
        return None
    try:
        fd = os.open(parts[-1], os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=d)
    except OSError:
        return None
    finally:
        os.close(d)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        with os.fdopen(os.dup(fd), "rb") as f:
            return f.read() if max_bytes is None else f.read(max_bytes)
    finally:
        os.close(fd)


SKIP_DIRS = frozenset({"__pycache__", ".pytest_cache", ".mypy_cache", ".git"})


def folder_files(root: str, max_file_bytes: int, max_files: int = 10000) -> dict[str, bytes | None]:
    """{relative path: bytes} of every regular file under root (links and special files are not listed;
    caches such as __pycache__ skipped); a file over `max_file_bytes` maps to None."""
    out: dict[str, bytes | None] = {}
    for top, dirs, files, dfd in os.fwalk(root, follow_symlinks=False):
        dirs[:] = sorted(d for d in dirs if d not in SKIP_DIRS)
        rel_top = os.path.relpath(top, root)
        for name in sorted(files):
            if len(out) >= max_files:
                return out
            try:
                fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=dfd)
            except OSError:
                continue
            try:
                st = os.fstat(fd)
                if not stat.S_ISREG(st.st_mode):
                    continue
                rel = name if rel_top == "." else f"{rel_top}/{name}"
                if st.st_size > max_file_bytes:
                    out[rel] = None
                    continue
                with os.fdopen(os.dup(fd), "rb") as f:
                    out[rel] = f.read(max_file_bytes + 1)
                if len(out[rel]) > max_file_bytes:
                    out[rel] = None
            finally:
                os.close(fd)
    return out


def folder_size(root: str) -> int:
    total = 0
    for _, dirs, files, dfd in os.fwalk(root, follow_symlinks=False):
        for name in files + dirs:
            try:
                total += os.stat(name, dir_fd=dfd, follow_symlinks=False).st_blocks * 512
            except OSError:
                pass
    return total


def remove_tree(path: str) -> None:
    """rm -rf that also gets through folders a sandboxed process made unreadable (mode 000)."""
    def fix(func, p, exc):
        e = exc[1] if isinstance(exc, tuple) else exc
        if isinstance(e, FileNotFoundError):
            return
        try:
            os.chmod(os.path.dirname(p) or p, 0o700)
            if os.path.isdir(p) and not os.path.islink(p):
                os.chmod(p, 0o700)
                shutil.rmtree(p, onerror=fix)
            else:
                os.unlink(p)
        except FileNotFoundError:
            pass

    if os.path.lexists(path):
        shutil.rmtree(path, onerror=fix)


# ----------------------------------------------------------------------------- ownership and sweeping
class Owner:
    """This process's claim on its sandboxes: ROOT/<host>-<pid>-<token>/ holding `owner.lock`, flocked while the
    process lives. Local sandbox folders live inside it; containers and pods carry its name as a label. A folder
    (or container, or pod) whose owner lock is free belongs to a run that died: `sweep` removes it."""
    _lock = threading.Lock()
    _me: "Owner | None" = None

    def __init__(self):
        self.root = sandbox_root()
        self.name = f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(4)}"
        self.dir = os.path.join(self.root, self.name)
        os.mkdir(self.dir, 0o700)
        self.fd = os.open(os.path.join(self.dir, "owner.lock"), os.O_RDWR | os.O_CREAT, 0o600)
        fcntl.flock(self.fd, fcntl.LOCK_EX)
        self.pid = os.getpid()

    @classmethod
    def get(cls) -> "Owner":
        """The owner of this process (made, and the leftovers of dead runs swept, on first use)."""
        with cls._lock:
            if cls._me is None or cls._me.pid != os.getpid():  # (a forked child claims its own)
                cls._me = cls()
                sweep_local(cls._me.root, keep=cls._me.name)
            return cls._me


def sandbox_root() -> str:
    """$TMPDIR/nemo_jax-sandboxes-<euid>: private to this user (made 0700; refused when someone else owns it or
    it is a link)."""
    root = os.path.join(tempfile.gettempdir(), f"nemo_jax-sandboxes-{os.geteuid()}")
    try:
        os.mkdir(root, 0o700)
    except FileExistsError:
        pass
    st = os.lstat(root)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
        raise SandboxError(f"sandbox root {root}: not a private folder of uid {os.geteuid()} (a link, someone "
                           "else's, or open to others): remove it")
    return root


def owner_alive(root: str, name: str) -> bool:
    """Is the run `name` (an Owner name) alive? Its folder must exist with its lock held."""
    if not name or "/" in name or name.startswith("."):
        return False
    try:
        fd = os.open(os.path.join(root, name, "owner.lock"), os.O_RDWR | os.O_NOFOLLOW)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            return True
        raise
    finally:
        os.close(fd)  # (releases the lock taken on a dead owner's file)
    return False


def sweep_local(root: str, keep: str = "") -> list[str]:
    """Remove every owner folder under `root` whose run has died (its lock is free) -> the names removed."""
    gone = []
    for name in sorted(os.listdir(root)):
        if name == keep or name == "uids" or name.startswith("mpl-"):
            continue
        if not owner_alive(root, name):
            remove_tree(os.path.join(root, name))
            gone.append(name)
    return gone


class UidLease:
    """One uid of [base, base + 65536) held by this sandbox alone (a flock on ROOT/uids/<uid>, across processes)."""

    def __init__(self, root: str, base: int):
        d = os.path.join(root, "uids")
        os.makedirs(d, mode=0o700, exist_ok=True)
        for _ in range(256):
            uid = base + secrets.randbelow(65536)
            fd = os.open(os.path.join(d, str(uid)), os.O_RDWR | os.O_CREAT, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                os.close(fd)
                continue
            self.uid, self.fd = uid, fd
            return
        raise SandboxError(f"sandbox: no free uid in [{base}, {base + 65536}) (256 tries)")

    def release(self):
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
