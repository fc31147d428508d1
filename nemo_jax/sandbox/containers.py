"""Sandboxes on a container engine: `docker` (a container per sandbox, any Docker-compatible CLI; DOCKER_HOST
reaches another machine) and `kubernetes` (a Pod per sandbox through kubectl; a cluster spreads them over its
nodes). Both are driven through their command-line clients, so whatever reaches the engine from this machine
(contexts, kubeconfig, ssh:// hosts) works as it does for the user, and a test can stand a local executable in
for the client.

The container idles (`sleep <lifetime_s>`: a leaked one ends itself) while commands run in it by exec:
`timeout -s KILL <wall> prlimit <limits> -- argv` as uid 1000 in /work (a tmpfs or emptyDir of `disk_mb`). Files
move through a small helper run by the image's python3 (`nemo_jax.sandbox.base`'s own folder functions: no
link is followed, `get` reads regular files only). `close` removes the container or Pod; a restarted run removes
those of runs on this machine that died (labels `nemo-jax.sandbox` and the owner's name).

docker: `--network none`, every capability dropped, `no-new-privileges`, a read-only root, `--pids-limit`,
`--memory` (= swap), `--cpus`, ulimits, `--runtime` when set (runsc: gVisor).
kubernetes: no service-account token, no service links, a deny-all NetworkPolicy (ingress and egress) over the
sandbox Pods, runAsNonRoot uid 1000, no privilege escalation, every capability dropped, a read-only root, the
RuntimeDefault seccomp profile, CPU / memory / ephemeral-storage limits, `activeDeadlineSeconds`, and
`runtimeClassName` gvisor (or what `runtime` names) when the cluster offers it. The process count is the
kubelet's `podPidsLimit` (a cluster setting).
"""

from __future__ import annotations

import base64
import json
import re
import secrets
import shutil
import threading

from nemo_jax.sandbox.base import (Owner, Result, Sandbox, SandboxError, SandboxSpec, owner_alive, run_process)
from nemo_jax.sandbox.local import BASE_ENV, JAIL_PATH, prlimit_args

WORK = "/work"
UID = 1000

_HELPER_MAIN = r'''
def _main():
    import sys, json, base64
    op, work = sys.argv[1], sys.argv[2]
    if op == "put":
        folder_put(work, sys.argv[3], sys.stdin.buffer.read(), int(sys.argv[4], 8))
    elif op == "get":
        data = folder_get(work, sys.argv[3], int(sys.argv[4]))
        if data is None:
            sys.exit(3)
        sys.stdout.buffer.write(data)
    elif op == "files":
        got = folder_files(work, int(sys.argv[3]), int(sys.argv[4]))
        json.dump({k: None if v is None else base64.b64encode(v).decode() for k, v in got.items()}, sys.stdout)
    elif op == "size":
        print(folder_size(work))
    else:
        sys.exit(f"unknown op {op}")
_main()
'''


def helper_source() -> str:
    """The file helper run inside a container: base.py (standard library only) and a small dispatcher."""
    import nemo_jax.sandbox.base as base

    with open(base.__file__, encoding="utf-8") as f:
        src = f.read()
    return src.replace("from __future__ import annotations\n", "") + _HELPER_MAIN


def container_env(env: dict | None = None) -> dict:
    e = dict(BASE_ENV, PATH=JAIL_PATH, HOME=WORK, TMPDIR="/tmp", MPLCONFIGDIR="/tmp/matplotlib",
             XDG_CACHE_HOME="/tmp/.cache")
    e.update(env or {})
    return e


def wrap(spec: SandboxSpec, argv: list[str], wall_s: float | None) -> list[str]:
    """argv as exec runs it: the limits by prlimit (the process count is the engine's: pids cgroup), the wall
    clock by coreutils `timeout` (None: no clock, for the interpreter of the Python tool)."""
    if argv and argv[0] == "python":
        argv = [spec.python or "python3"] + argv[1:]
    lim = [a for a in prlimit_args(spec.limits) if not a.startswith("--nproc")]
    inner = ["prlimit", *lim, "--", *argv]
    return inner if wall_s is None else ["timeout", "-s", "KILL", f"{wall_s:g}", *inner]


_swept: set = set()
_swept_lock = threading.Lock()


class ContainerSandbox(Sandbox):
    """What docker and kubernetes share: exec-based run / popen / file moves, close, sweep."""
    backend = "container"
    work = WORK

    def __init__(self, spec: SandboxSpec, name: str = ""):
        super().__init__(spec)
        self.owner = Owner.get()
        self._helper = helper_source()
        self.exe = self._find_cli()
        with _swept_lock:
            key = (self.backend, tuple(self.cli_base()))
            if key not in _swept:
                _swept.add(key)
                self.sweep()
        self.name = self.make_name(name)
        self.start()

    # to be given by each engine
    def cli_base(self) -> list[str]: ...
    def exec_argv(self, argv: list[str], interactive: bool, env: dict | None = None) -> list[str]: ...
    def start(self): ...
    def remove(self): ...
    def sweep(self): ...

    def _find_cli(self) -> str:
        exe = getattr(self.spec, self.backend if self.backend == "docker" else "kubectl")
        found = shutil.which(exe)
        if not found:
            raise SandboxError(f"sandbox backend {self.backend}: the `{exe}` command is not on PATH (install it, "
                               f"or name it in sandbox.{'docker' if self.backend == 'docker' else 'kubectl'})")
        return found

    @staticmethod
    def make_name(name: str) -> str:
        tag = re.sub(r"[^a-z0-9-]+", "-", name.lower()).strip("-")[:20]
        return f"nemo-jax-sbx-{tag + '-' if tag else ''}{secrets.token_hex(5)}"

    def cli(self, args: list[str], stdin: bytes | None = None, wall_s: float = 120.0) -> Result:
        return run_process(self.cli_base() + args, stdin=stdin, wall_s=wall_s, output_bytes=64 << 20)

    def fail(self, what: str, r: Result):
        lines = [ln.strip() for ln in (r.stderr or r.stdout).decode("utf-8", "replace").splitlines()]
        why = [ln for ln in lines if ln and not ln.startswith("Run '")]  # (not docker's "Run 'docker run --help'")
        raise SandboxError(f"sandbox backend {self.backend} cannot {what}: "
                           f"{why[0] if why else ('timed out' if r.timed_out else f'exit code {r.rc}')}")

    # commands
    def run(self, argv: list[str], stdin: bytes | str | None = None, timeout: float | None = None,
            env: dict | None = None) -> Result:
        self._check_open()
        wall = min(float(timeout or self.limits.wall_s), self.limits.wall_s)
        data = stdin.encode() if isinstance(stdin, str) else stdin
        r = run_process(self.exec_argv(wrap(self.spec, list(argv), wall), data is not None, env), stdin=data,
                        wall_s=wall + 15.0, output_bytes=self.limits.output_kb * 1024, on_timeout=self.kill_all)
        self.commands += 1
        if r.rc == 137 and r.secs >= wall:  # coreutils timeout's SIGKILL
            r.rc, r.timed_out = None, True
        return r

    def popen(self, argv: list[str], env: dict | None = None):
        import subprocess

        from nemo_jax.sandbox.local import Process

        self._check_open()
        try:
            p = subprocess.Popen(self.exec_argv(wrap(self.spec, list(argv), None), True, env),
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                 start_new_session=True)
        except OSError as e:
            raise SandboxError(f"sandbox {self.backend}: cannot start {argv[0]}: {e.strerror or e}") from None
        return self._track(Process(p, on_kill=self.kill_all))

    def kill_all(self):
        """Kill every process of the sandbox's user but the container's idle one (pid 1): what a killed exec
        client left running inside."""
        if not self.closed:
            run_process(self.exec_argv(["sh", "-c", "kill -KILL -1 2>/dev/null; true"], False), stdin=None,
                        wall_s=30.0, output_bytes=4096)

    # files
    def _helper_argv(self, *args: str) -> list[str]:
        return [self.spec.python or "python3", "-c", self._helper, *args]

    def put(self, rel: str, data: bytes | str, mode: int = 0o644) -> None:
        self._check_open()
        from nemo_jax.sandbox.base import _parts

        _parts(rel)
        r = run_process(self.exec_argv(self._helper_argv("put", WORK, rel, f"{mode:o}"), True),
                        stdin=data.encode() if isinstance(data, str) else bytes(data), wall_s=120.0,
                        output_bytes=65536)
        if r.rc != 0:
            self.fail(f"put {rel!r}", r)

    def get(self, rel: str, max_bytes: int | None = None) -> bytes | None:
        self._check_open()
        from nemo_jax.sandbox.base import _parts

        _parts(rel)
        cap = max_bytes if max_bytes is not None else 256 << 20
        r = run_process(self.exec_argv(self._helper_argv("get", WORK, rel, str(cap)), False), stdin=None,
                        wall_s=120.0, output_bytes=cap)
        if r.rc == 3:
            return None
        if r.rc != 0:
            self.fail(f"get {rel!r}", r)
        return r.stdout

    def files(self, max_file_bytes: int = 1 << 20, max_files: int = 10000) -> dict:
        self._check_open()
        r = run_process(self.exec_argv(self._helper_argv("files", WORK, str(max_file_bytes), str(max_files)),
                                       False), stdin=None, wall_s=120.0, output_bytes=1 << 30)
        if r.rc != 0:
            self.fail("list its files", r)
        return {k: None if v is None else base64.b64decode(v) for k, v in json.loads(r.stdout).items()}

    def _dispose(self, procs: list) -> None:
        for p in procs:
            p._on_kill = None
            p.kill()
        self.remove()

    def owner_dead(self, owner: str) -> bool:
        """A sandbox labelled with `owner` belongs to a dead run of this machine."""
        import socket

        host = socket.gethostname()
        return owner.startswith(host + "-") and not owner_alive(self.owner.root, owner)


# ----------------------------------------------------------------------------- docker
def docker_run_argv(spec: SandboxSpec, name: str, owner: str, runtime: str = "") -> list[str]:
    """`docker run` of one sandbox (pure: tests read it)."""
    lim = spec.limits
    mem = f"{lim.memory_mb}m"
    a = ["run", "-d", "--rm", "--name", name, "--label", "nemo-jax.sandbox=1", "--label", f"nemo-jax.owner={owner}",
         "--network", "none", "--cap-drop", "ALL", "--security-opt", "no-new-privileges",
         "--pids-limit", str(lim.processes), "--memory", mem, "--memory-swap", mem, "--cpus", "1",
         "--ulimit", f"nofile={lim.open_files}:{lim.open_files}",
         "--ulimit", f"fsize={lim.file_mb << 20}:{lim.file_mb << 20}", "--ulimit", "core=0:0",
         "--read-only", "--tmpfs", "/tmp:rw,nosuid,nodev,size=64m,mode=1777",
         "--tmpfs", f"{WORK}:rw,nosuid,nodev,size={lim.disk_mb}m,uid={UID},gid={UID},mode=0700",
         "--user", f"{UID}:{UID}", "--workdir", WORK]
    for k, v in sorted(container_env().items()):
        a += ["--env", f"{k}={v}"]
    if runtime:
        a += ["--runtime", runtime]
    return a + ["--entrypoint", "sleep", spec.image, f"{int(spec.lifetime_s)}"]


class DockerSandbox(ContainerSandbox):
    backend = "docker"

    def cli_base(self):
        return [self.exe]

    def exec_argv(self, argv, interactive, env=None):
        a = [self.exe, "exec"] + (["-i"] if interactive else []) + ["-w", WORK]
        for k, v in sorted((env or {}).items()):
            a += ["-e", f"{k}={v}"]
        return a + [self.name, *argv]

    def runtime(self) -> str:
        """spec.runtime; "auto": runsc (gVisor) when the engine offers it."""
        if self.spec.runtime != "auto":
            return self.spec.runtime
        key = tuple(self.cli_base())
        with _swept_lock:
            if key not in _runtime_classes:
                r = self.cli(["info", "--format", "{{json .Runtimes}}"], wall_s=60.0)
                try:
                    offered = json.loads(r.stdout) if r.rc == 0 else {}
                except ValueError:
                    offered = {}
                _runtime_classes[key] = "runsc" if "runsc" in (offered or {}) else ""
            return _runtime_classes[key]

    def start(self):
        r = self.cli(docker_run_argv(self.spec, self.name, self.owner.name, self.runtime()),
                     wall_s=self.spec.start_timeout_s)
        if r.rc != 0:
            self.cli(["rm", "-f", self.name], wall_s=60.0)
            self.fail(f"start a container of {self.spec.image}", r)

    def remove(self):
        self.cli(["rm", "-f", self.name], wall_s=60.0)

    def sweep(self):
        r = self.cli(["ps", "-a", "--filter", "label=nemo-jax.sandbox=1", "--format",
                      '{{.Names}}\t{{.Label "nemo-jax.owner"}}'], wall_s=60.0)
        if r.rc != 0:
            return
        for line in r.stdout.decode().splitlines():
            name, _, owner = line.partition("\t")
            if name and self.owner_dead(owner.strip()):
                self.cli(["rm", "-f", name], wall_s=60.0)


# ----------------------------------------------------------------------------- kubernetes
LABEL = "nemo-jax/sandbox"
OWNER_KEY = "nemo-jax/owner"


def pod_manifest(spec: SandboxSpec, name: str, owner: str, runtime_class: str = "") -> dict:
    """The Pod of one sandbox (pure: tests read it)."""
    lim = spec.limits
    res = {"cpu": "1", "memory": f"{lim.memory_mb}Mi", "ephemeral-storage": f"{lim.disk_mb + 64}Mi"}
    pod = {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "labels": {LABEL: "1", "app.kubernetes.io/managed-by": "nemo-jax"},
                     "annotations": {OWNER_KEY: owner}},
        "spec": {
            "automountServiceAccountToken": False,
            "enableServiceLinks": False,
            "restartPolicy": "Never",
            "activeDeadlineSeconds": int(spec.lifetime_s),
            "terminationGracePeriodSeconds": 0,
            "hostNetwork": False, "hostPID": False, "hostIPC": False,
            "dnsPolicy": "None", "dnsConfig": {"nameservers": ["127.0.0.1"]},
            "securityContext": {"runAsNonRoot": True, "runAsUser": UID, "runAsGroup": UID, "fsGroup": UID,
                                "seccompProfile": {"type": "RuntimeDefault"}},
            "containers": [{
                "name": "sandbox", "image": spec.image, "command": ["sleep", f"{int(spec.lifetime_s)}"],
                "workingDir": WORK,
                "env": [{"name": k, "value": v} for k, v in sorted(container_env().items())],
                "resources": {"limits": res, "requests": dict(res, cpu="100m")},
                "securityContext": {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                                    "privileged": False, "capabilities": {"drop": ["ALL"]}},
                "volumeMounts": [{"name": "work", "mountPath": WORK}, {"name": "tmp", "mountPath": "/tmp"}],
            }],
            "volumes": [{"name": "work", "emptyDir": {"sizeLimit": f"{lim.disk_mb}Mi"}},
                        {"name": "tmp", "emptyDir": {"medium": "Memory", "sizeLimit": "64Mi"}}],
        },
    }
    if runtime_class:
        pod["spec"]["runtimeClassName"] = runtime_class
    return pod


def network_policy() -> dict:
    """Deny every connection in and out of the sandbox Pods (the namespace's NetworkPolicy)."""
    return {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
            "metadata": {"name": "nemo-jax-sandbox-deny-all", "labels": {"app.kubernetes.io/managed-by": "nemo-jax"}},
            "spec": {"podSelector": {"matchLabels": {LABEL: "1"}}, "policyTypes": ["Ingress", "Egress"],
                     "ingress": [], "egress": []}}


_policies: set = set()
_runtime_classes: dict = {}


class KubernetesSandbox(ContainerSandbox):
    backend = "kubernetes"

    def cli_base(self):
        return [self.exe] + (["--context", self.spec.context] if self.spec.context else []) + \
            ["--namespace", self.spec.namespace]

    def exec_argv(self, argv, interactive, env=None):
        if env:
            argv = ["env", *[f"{k}={v}" for k, v in sorted(env.items())], *argv]
        return self.cli_base() + ["exec"] + (["-i"] if interactive else []) + [self.name, "-c", "sandbox", "--",
                                                                                 *argv]

    def runtime_class(self) -> str:
        want = self.spec.runtime
        if want != "auto":
            return want
        key = tuple(self.cli_base())
        with _swept_lock:
            if key not in _runtime_classes:
                r = self.cli(["get", "runtimeclass", "-o", "jsonpath={.items[*].metadata.name}"], wall_s=60.0)
                offered = r.stdout.decode().split() if r.rc == 0 else []
                _runtime_classes[key] = next((c for c in ("gvisor", "runsc") if c in offered), "")
            return _runtime_classes[key]

    def start(self):
        key = tuple(self.cli_base())
        with _swept_lock:
            if key not in _policies:
                r = self.cli(["apply", "-f", "-"], stdin=json.dumps(network_policy()).encode(), wall_s=120.0)
                if r.rc != 0:
                    self.fail("apply the deny-all NetworkPolicy (sandboxes would reach the network)", r)
                _policies.add(key)
        pod = pod_manifest(self.spec, self.name, self.owner.name, self.runtime_class())
        r = self.cli(["create", "-f", "-"], stdin=json.dumps(pod).encode(), wall_s=120.0)
        if r.rc != 0:
            self.fail(f"create Pod {self.name}", r)
        t = self.spec.start_timeout_s
        r = self.cli(["wait", "--for=condition=Ready", f"pod/{self.name}", f"--timeout={int(t)}s"], wall_s=t + 30)
        if r.rc != 0:
            self.remove()
            self.fail(f"start Pod {self.name} within {t:g}s", r)

    def remove(self):
        self.cli(["delete", "pod", self.name, "--grace-period=0", "--force", "--wait=false", "--ignore-not-found"],
                 wall_s=120.0)

    def sweep(self):
        r = self.cli(["get", "pods", "-l", f"{LABEL}=1", "-o", "json"], wall_s=120.0)
        if r.rc != 0:
            return
        try:
            items = json.loads(r.stdout).get("items", [])
        except ValueError:
            return
        for it in items:
            meta = it.get("metadata", {})
            if self.owner_dead((meta.get("annotations") or {}).get(OWNER_KEY, "")):
                self.cli(["delete", "pod", meta.get("name", ""), "--grace-period=0", "--force", "--wait=false",
                          "--ignore-not-found"], wall_s=120.0)

