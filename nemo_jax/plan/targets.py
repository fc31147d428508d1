"""Compile for a GPU or TPU without one: compile-only ("deviceless") devices of a target, on this CPU host.

    get_topology("gpu", "h100", 16)  -> 16 compile-only H100 devices (2 hosts x 8), from gpu_specs/h100.txtpb
    get_topology("tpu", "tpu-v5p", 8) -> 8 compile-only TPU v5p chips (libtpu's "v5p:2x2x2" topology)
    target_mesh("gpu", "h100", {"fsdp": 8, "expert": 2}) -> a Mesh over them (nemo_jax.parallel.mesh.make_mesh)

Programs lowered with ShapeDtypeStructs sharded on such a mesh and `.compile()`d are compiled by the target's
real compiler (XLA:GPU with its Triton / cuDNN / cuBLAS choices, or libtpu), so `memory_analysis()` and the HLO
are the target's. What it needs: `jax-cuda12-plugin` + `jax-cuda12-pjrt` (GPU; no CUDA libraries) or `libtpu`
(TPU) at jax's version (the `nemo_jax[plan-gpu]` / `[plan-tpu]` extras), and the process running on CPU
(`JAX_PLATFORMS=cpu`); `get_topology` sets the other variables it needs before the plugin starts.

GPU targets are described by an XLA `GpuTargetConfigProto` in text form under `gpu_specs/` (which come from
where: the comment at the top of each file). To add one, copy a spec XLA dumped from a real device
(`xla/tools/hlo_opt/gpu_specs/` in XLA's repository) or write one from the datasheet (compute capability, SM count,
shared memory, L2, memory size and bandwidth, clock), put it in gpu_specs/NAME.txtpb and add NAME to `GPU_SPECS`.
`bench/device.py` prints a real card's compute capability, SM count and memory to check a hand-written spec.
"""

from __future__ import annotations

import os
import re
from functools import lru_cache

SPEC_DIR = os.path.join(os.path.dirname(__file__), "gpu_specs")
GPU_SPECS = {"h100": "h100.txtpb", "h200": "h200.txtpb", "b200": "b200.txtpb"}
TPU_GENERATIONS = {"tpu-v5p": "v5p", "tpu-v5e": "v5e", "tpu-v6e": "v6e"}
TARGETS = ("gpu", "tpu")
PER_HOST = {"gpu": 8, "v5p": 4, "v5e": 4, "v6e": 4}  # devices per host of the compile-only topologies


def gpu_spec(device_kind: str) -> str:
    """The GpuTargetConfigProto text of a GPU kind (GPU_SPECS)."""
    if device_kind not in GPU_SPECS:
        raise ValueError(f"no GPU target spec for device kind {device_kind!r} (have: {', '.join(GPU_SPECS)})")
    with open(os.path.join(SPEC_DIR, GPU_SPECS[device_kind])) as f:
        return f.read()


PLUGINS = {"gpu": ("jax_plugins.xla_cuda12", "plan-gpu"), "tpu": ("libtpu", "plan-tpu")}  # module, extra


def plugin_installed(target: str) -> bool:
    """Whether this host can compile for `target` without its device: the CUDA plugin or libtpu is installed
    (decided without importing either; a missing `jax_plugins` namespace is "not installed")."""
    import importlib.util

    if target not in PLUGINS:
        raise ValueError(f"target {target!r}: expected one of {TARGETS}")
    try:
        return importlib.util.find_spec(PLUGINS[target][0]) is not None
    except ModuleNotFoundError:  # the parent package (jax_plugins) is absent
        return False


def require_plugin(target: str) -> None:
    """MissingDependency (one line naming the extra) unless `target`'s compile-only plugin is installed."""
    from nemo_jax.extras import MissingDependency

    if not plugin_installed(target):
        raise MissingDependency(f"--target {target} compiles with {'XLA:GPU' if target == 'gpu' else 'libtpu'} "
                                f"without the device, which needs the {PLUGINS[target][1]!r} extra: pip install "
                                f"'nemo_jax[{PLUGINS[target][1]}]' (at jax's version), or plan with --target cpu "
                                "(an estimate)")


def tpu_topology_name(generation: str, n: int) -> str:
    """libtpu's topology name of n chips (at least one host's 4): 2-D for v5e/v6e, 3-D for v5p."""
    n = max(n, PER_HOST[generation])
    if n & (n - 1):
        raise ValueError(f"TPU {generation}: {n} chips is not a power of two")
    dims = [1, 1, 1] if generation == "v5p" else [1, 1]
    i = 0
    while dims[0] * dims[1] * (dims[2] if len(dims) == 3 else 1) < n:
        dims[i % len(dims)] *= 2
        i += 1
    dims = sorted(d for d in dims if d > 1) + [d for d in dims if d == 1]  # e.g. v5e:2x4, v5p:2x2x4, v5p:2x2x1
    return f"{generation}:" + "x".join(str(d) for d in dims)


def _cudnn_version(spec: str) -> int:
    """The cuDNN version (as cudnnGetVersion reports it: 90800 for 9.8.0) a GPU spec's dnn_version_info names;
    0 without one."""
    m = re.search(r"dnn_version_info\s*\{([^}]*)\}", spec)
    if not m:
        return 0
    field = lambda key: int(next(iter(re.findall(rf"{key}:\s*(\d+)", m.group(1))), 0))  # noqa: E731
    return field("major") * 10000 + field("minor") * 100 + field("patch")


def _assume_target_cudnn(spec: str) -> None:
    """jax's cuDNN attention asks the cuDNN library of this process for its version before lowering; a CPU host
    has none. For a deviceless compile the version is the target's (the spec's dnn_version_info): answer with
    it. A host with cuDNN keeps its own answer."""
    import jax._src.cudnn.fused_attention_stablehlo as fa

    try:
        fa.check_cudnn_version()
    except RuntimeError:
        version = _cudnn_version(spec)
        if version:
            fa.check_cudnn_version = lambda: version


@lru_cache(maxsize=None)
def _topology(target: str, device_kind: str, n: int):
    from jax.experimental import topologies

    if target == "gpu":
        spec = gpu_spec(device_kind)
        per = min(n, PER_HOST["gpu"])
        if n % per:
            raise ValueError(f"{n} GPUs do not fill hosts of {per}")
        os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")  # no CUDA libraries to check
        topo = topologies.get_topology_desc(platform="cuda", topology_name="", target_config=spec,
                                            topology=f"1x{n // per}x{per}")
        _assume_target_cudnn(spec)
        return topo
    if target == "tpu":
        if device_kind not in TPU_GENERATIONS:
            raise ValueError(f"no TPU topology for device kind {device_kind!r} (have: {', '.join(TPU_GENERATIONS)})")
        os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # other processes may hold libtpu's lockfile
        return topologies.get_topology_desc(platform="tpu",
                                            topology_name=tpu_topology_name(TPU_GENERATIONS[device_kind], n))
    raise ValueError(f"target {target!r}: expected one of {TARGETS}")


def get_topology(target: str, device_kind: str, n: int) -> list:
    """n compile-only devices of `device_kind` ("h100" | "h200" | "b200" for gpu, "tpu-v5p" | "tpu-v5e" |
    "tpu-v6e" for tpu), in host order. Raises ValueError for an unknown kind or count, MissingDependency when the
    target's plugin is not installed."""
    require_plugin(target)
    return list(_topology(target, device_kind, n).devices)[:n]


def target_mesh(target: str, device_kind: str, sizes: dict, devices_per_node: int = 0):
    """A (data, fsdp, tensor, expert, context) Mesh of `sizes` (a -1 axis takes the rest; `n` the device count
    when given as sizes["devices"]) on compile-only devices of the target."""
    import math

    from nemo_jax.parallel.mesh import make_mesh

    sizes = dict(sizes)
    n = sizes.pop("devices", None) or math.prod(s for s in sizes.values() if s > 0)
    return make_mesh(sizes, get_topology(target, device_kind, n), devices_per_node)


def native_target(device_kind: str) -> str:
    return "tpu" if device_kind.startswith("tpu") else "gpu"


def default_target(device_kind: str) -> str:
    """The device kind's real backend when its compile-only plugin is installed, else "cpu"."""
    t = native_target(device_kind)
    return t if plugin_installed(t) else "cpu"
