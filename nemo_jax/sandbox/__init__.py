"""Sandboxes for model-written code (no JAX here: the bottom of the layer table).

    spec = SandboxSpec.from_dict({"backend": "bwrap", "limits": {"wall_s": 10}, "packages": ["numpy"]})
    with open_sandbox(spec, name="rollout-7") as sb:
        sb.put("a.py", "print(6 * 7)")
        r = sb.run(["python", "a.py"])          # Result(rc, stdout, stderr, timed_out, secs, truncated, error)
        data = sb.get("out.txt")                # None for a link, a folder, a device or nothing
        session = PythonSession(sb)             # a stateful interpreter inside (nemo_jax.sandbox.python)

Backends (`SandboxSpec.backend`): `bwrap` (bubblewrap; the default where it works), `rlimit` (limits only; must
be named), `docker` and `kubernetes` (a container or Pod per sandbox, driven through their CLIs). See
docs/sandbox.md for what each isolates and what it does not.
"""

from nemo_jax.moved import alias
from nemo_jax.sandbox.base import BACKENDS, Limits, Result, SandboxError, SandboxSpec  # noqa: F401

alias(__name__, {"remote": "nemo_jax.sandbox.containers"})  # (the container backends' module, by its old name)


def open_sandbox(spec: SandboxSpec | dict | None = None, name: str = ""):
    """A started sandbox of `spec`'s backend (a dict is read with `SandboxSpec.from_dict`). `auto` is bubblewrap
    when it starts here, else an error naming why and the other choices (auto never falls back to rlimit)."""
    from nemo_jax.sandbox import local

    spec = spec if isinstance(spec, SandboxSpec) else SandboxSpec.from_dict(spec)
    backend = resolve_backend(spec)
    if backend == "bwrap":
        why = local.probe_bwrap(spec)  # (once per process and interpreter): a bwrap that cannot start is an error
        if why:  # here, not every command failing later with rc 1 and bwrap's message in its stderr
            raise SandboxError(why)
        return local.BwrapSandbox(spec, name)
    if backend == "rlimit":
        return local.RlimitSandbox(spec, name)
    from nemo_jax.sandbox import containers

    if backend == "docker":
        return containers.DockerSandbox(spec, name)
    return containers.KubernetesSandbox(spec, name)


def resolve_backend(spec: SandboxSpec) -> str:
    """`auto` -> bwrap when it works here (else SandboxError naming why and the other backends); others as named."""
    if spec.backend != "auto":
        return spec.backend
    from nemo_jax.sandbox import local

    why = local.probe_bwrap(spec)
    if why:
        raise SandboxError(f"{why}; no sandbox backend works by default here: name one in sandbox.backend "
                           "(rlimit: limits only, no isolation; docker; kubernetes)")
    return "bwrap"


def check(spec: SandboxSpec) -> str:
    """The backend `spec` resolves to, checked before any episode: bwrap and rlimit start a sandbox and run a command
    (once per process), docker and kubernetes need their CLI on PATH. SandboxError names what is missing."""
    import shutil

    from nemo_jax.sandbox import local

    backend = resolve_backend(spec)
    if backend == "bwrap":
        why = local.probe_bwrap(spec)
        if why:
            raise SandboxError(why)
    elif backend == "rlimit":
        local._tool("prlimit", "rlimit")
    else:
        exe = spec.docker if backend == "docker" else spec.kubectl
        if not shutil.which(exe):
            raise SandboxError(f"sandbox backend {backend}: the `{exe}` command is not on PATH (install it, or name "
                               f"it in sandbox.{'docker' if backend == 'docker' else 'kubectl'})")
    return backend


def probe_backends(backends=None, sweep: bool = False) -> list[str]:
    """One line per backend: does a sandbox start here and run `true` (its start-up cost), or why not; with `sweep`,
    what dead runs left is removed first (local folders; containers / Pods of this machine's dead runs)."""
    import shutil
    import time

    from nemo_jax.sandbox.base import Owner, sweep_local

    if backends is None:
        backends = ["bwrap", "rlimit"] + [b for b, exe in (("docker", "docker"), ("kubernetes", "kubectl"))
                                          if shutil.which(exe)]
    from nemo_jax.sandbox.local import describe_python

    out = [describe_python()]
    if sweep:
        me = Owner.get()
        gone = sweep_local(me.root, keep=me.name)
        out.append(f"swept {len(gone)} folder{'s' if len(gone) != 1 else ''} of dead runs under {me.root}")
    for b in backends:
        try:
            t0 = time.perf_counter()
            with open_sandbox(SandboxSpec(backend=b), "probe") as sb:
                t1 = time.perf_counter()
                r = sb.run(["true"])
            t2 = time.perf_counter()
            if not r.ok:
                raise SandboxError(f"sandbox backend {b}: `true` failed: {r.text()}")
            note = " (limits only: no isolation, see docs/sandbox.md)" if b == "rlimit" else ""
            out.append(f"{b}: works{note}; open {1000 * (t1 - t0):.0f} ms, a command {1000 * (t2 - t1):.0f} ms "
                       "(close included)")
        except (SandboxError, ValueError) as e:
            fix = FIXES.get(b, "")
            out.append(f"{b}: cannot start: {e}" + (f" ({fix})" if fix else ""))
    return out


FIXES = {  # what to do when a backend cannot start here
    "bwrap": "bubblewrap needs user namespaces or root: run as root, allow unprivileged user namespaces "
             "(sysctl kernel.unprivileged_userns_clone=1 / apparmor_restrict_unprivileged_userns=0), or name the "
             "interpreter to sandbox with sandbox.python; docs/sandbox.md",
    "docker": "start the Docker daemon or point DOCKER_HOST at one",
    "kubernetes": "point kubectl at a cluster (KUBECONFIG) where NetworkPolicies are enforced",
}


def __getattr__(name):
    if name == "PythonSession":
        from nemo_jax.sandbox.python import PythonSession

        return PythonSession
    raise AttributeError(name)
