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

from nemo_jax.sandbox.base import BACKENDS, Limits, Result, SandboxError, SandboxSpec  # noqa: F401


def open_sandbox(spec: SandboxSpec | dict | None = None, name: str = ""):
    """A started sandbox of `spec`'s backend (a dict is read with `SandboxSpec.from_dict`). `auto` is bubblewrap
    when it starts here, else an error naming why and the other choices (auto never falls back to rlimit)."""
    from nemo_jax.sandbox import local

    spec = spec if isinstance(spec, SandboxSpec) else SandboxSpec.from_dict(spec)
    backend = resolve_backend(spec)
    if backend == "bwrap":
        return local.BwrapSandbox(spec, name)
    if backend == "rlimit":
        return local.RlimitSandbox(spec, name)
    from nemo_jax.sandbox import remote

    if backend == "docker":
        return remote.DockerSandbox(spec, name)
    return remote.KubernetesSandbox(spec, name)


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


def __getattr__(name):
    if name == "PythonSession":
        from nemo_jax.sandbox.python import PythonSession

        return PythonSession
    raise AttributeError(name)
