"""`nemo-jax plan`: what each device of an N-device job holds and does, from an ahead-of-time compile of the
real step with abstract parameters on N simulated CPU devices (nothing is allocated).

Per device: bytes of parameters, optimiser state, gradients, activations / temporaries and the total (XLA's
compiled memory analysis; the split of temporaries into gradients and activations is an estimate, and the
CPU compiler schedules differently from the GPU / TPU ones), FLOPs per step with loop bodies multiplied by
their trip counts (`hlo.analyse`) next to the model FLOPs, the bytes of each collective kind, and the step time:
each kernel of the compiled program costed by its own roofline (`hlo.kernels`, `roofline.kernels_time`: FLOPs
at the achievable share of the device's peak, bytes at the achievable share of its bandwidth, at least a
launch), plus the collectives at NVLink / InfiniBand / ICI bandwidth not hidden behind compute; and the implied
MFU.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import os
import time
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from nemo_jax.config.train import load_plan_config  # noqa: F401  (a plan's config: SFT or GRPO)
from nemo_jax.plan.hlo import analyse
from nemo_jax.plan.targets import default_target, native_target  # noqa: F401

GiB = 1024 ** 3


@dataclass(frozen=True)
class DeviceKind:
    name: str
    memory: float  # bytes of device memory as the runtime reports it
    peak: float  # dense bf16 FLOP/s
    intra_bw: float  # bytes/s per device, one direction, inside a node (NVLink) or a slice (ICI)
    inter_bw: float  # bytes/s per device between nodes (InfiniBand); unused when a slice is one ICI domain
    per_node: int | None  # devices per node (None: every device on one ICI domain)
    key: str = ""  # its name in DEVICE_KINDS
    hbm: float = 0.0  # bytes/s of device memory bandwidth (datasheet)
    vector: float = 0.0  # FLOP/s of fp32 non-matrix math (CUDA cores; TPU VPU)


# datasheets: H100 SXM (989 TFLOP/s dense BF16, 67 TFLOP/s FP32, 3.35 TB/s HBM3), H200 SXM (the same chip, 4.8 TB/s
# HBM3e), B200 (2.25 PFLOP/s dense BF16, 80 TFLOP/s FP32, 8 TB/s), TPU v5p (459 TFLOP/s, 2.76 TB/s), v5e (197,
# 0.82), v6e (918, 1.64); the TPUs' vector rates are not published: 1/16 of the MXU's, an estimate
DEVICE_KINDS = {
    "h100": DeviceKind("H100 SXM 80GB", 79.1 * GiB, 989e12, 450e9, 50e9, 8, "h100", 3.35e12, 67e12),
    "h200": DeviceKind("H200 SXM 141GB", 139.8 * GiB, 989e12, 450e9, 50e9, 8, "h200", 4.8e12, 67e12),
    "b200": DeviceKind("B200 180GB", 178.4 * GiB, 2250e12, 900e9, 50e9, 8, "b200", 8.0e12, 80e12),
    "tpu-v5p": DeviceKind("TPU v5p", 95.0 * GiB, 459e12, 200e9, 200e9, None, "tpu-v5p", 2.765e12, 459e12 / 16),
    "tpu-v5e": DeviceKind("TPU v5e", 15.75 * GiB, 197e12, 100e9, 100e9, None, "tpu-v5e", 0.819e12, 197e12 / 16),
    "tpu-v6e": DeviceKind("TPU v6e", 31.25 * GiB, 918e12, 224e9, 224e9, None, "tpu-v6e", 1.64e12, 918e12 / 16),
}
# the compiler a plan's program is compiled by: the device kind's own (XLA:GPU through jax-cuda12-plugin, libtpu)
# without the device (`nemo_jax.plan.targets`), or XLA:CPU on simulated devices (an estimate: it computes bf16
# matmuls and every collective in fp32 and schedules and fuses differently)
TARGETS = ("gpu", "tpu", "cpu")


# ring algorithms: bytes each device sends per byte of the collective's buffer, for a group of n
_TRAFFIC = {"all-reduce": lambda n: 2 * (n - 1) / n, "all-gather": lambda n: (n - 1) / n,
            "reduce-scatter": lambda n: (n - 1) / n, "all-to-all": lambda n: (n - 1) / n,
            "collective-permute": lambda n: 1.0}
ESTIMATES = ("gradients and activations split the compiled temporaries by estimate (gradients = one fp32 copy of "
             "the trainable shards); on the cpu target the compiler schedules and fuses differently from GPU / TPU "
             "ones (and keeps collectives in fp32), so its temporaries are an estimate; step times are rooflines "
             "per kernel (each at max(FLOPs / achievable FLOP/s, bytes / achievable bandwidth, launch), "
             "nemo_jax.plan.roofline) plus ring collectives at the kind's link bandwidth, not measurements")


def _shard_bytes(tree) -> int:
    """Bytes one device holds of a tree of ShapeDtypeStructs with shardings (the largest shard)."""
    total = 0
    for x in jax.tree.leaves(tree):
        shape = x.sharding.shard_shape(x.shape) if x.sharding is not None else x.shape
        total += math.prod(shape) * np.dtype(x.dtype).itemsize
    return total


def _spans_nodes(groups, per_node: int | None) -> bool:
    return per_node is not None and any(len({d // per_node for d in g}) > 1 for g in groups)


# Which collectives a step can hide behind compute: the weights' all-gathers (FSDP, prefetched a layer ahead by
# XLA's latency-hiding scheduler) and the gradients' reduce-scatters (issued as each layer's backward ends). The
# rest sit on the critical path: an all-to-all's result (the MoE dispatch), a tensor-parallel all-reduce or a
# context-parallel permute is needed by the very next op.
OVERLAPPABLE = ("all-gather", "reduce-scatter")


def roofline(compute_s: float, collectives, kind: DeviceKind) -> dict:
    """-> seconds: `compute` (the step's kernels, `compute_s`: `roofline.kernels_time` of the compiled program),
    `collectives` (every collective at its link's ring bandwidth), `exposed` (the critical-path collectives, plus
    the overlappable ones that outlast the compute), `overlapped` (communication hidden behind compute),
    `with_overlap` (the step: compute + exposed) and `without_overlap` (compute + every collective, nothing
    hidden)."""
    hidden = path = 0.0
    for c in collectives:
        bw = kind.inter_bw if _spans_nodes(c.groups, kind.per_node) else kind.intra_bw
        t = c.count * c.bytes * _TRAFFIC[c.kind](max(c.group, 1)) / bw
        if c.kind in OVERLAPPABLE:
            hidden += t
        else:
            path += t
    overlapped = min(compute_s, hidden)
    exposed = path + hidden - overlapped
    return {"compute": compute_s, "collectives": hidden + path, "exposed": exposed, "overlapped": overlapped,
            "with_overlap": compute_s + exposed, "without_overlap": compute_s + hidden + path}


def time_of_hlo(text: str, n_devices: int, kind: DeviceKind) -> dict:
    """The plan's figures of one device's compiled step from its HLO text: FLOPs (loops counted), the kernels'
    time by the per-kernel roofline (`nemo_jax.plan.roofline`), collectives and the step time (`roofline`)."""
    from nemo_jax.plan.hlo import custom_calls, kernels
    from nemo_jax.plan.roofline import ACHIEVABLE, kernels_time

    hlo = analyse(text, n_devices)
    ks = kernels(text)
    kt = kernels_time(ks, kind, ACHIEVABLE[kind.key])
    return {"flops": hlo.flops, "hlo": hlo, "kernels": kt, "kernel_count": sum(k.count for k in ks),
            "bytes": sum(k.bytes * k.count for k in ks), "custom_calls": custom_calls(text),
            "step_time_s": roofline(kt["total"], hlo.collectives, kind)}


def analyse_compiled(compiled, n_devices: int, kind: DeviceKind, inputs: dict, model_flops: float,
                     gradient_bytes: int = 0) -> dict:
    """Figures of one compiled program. inputs: {name: abstract tree} whose per-device bytes are reported."""
    mem = compiled.memory_analysis()
    timed = time_of_hlo(compiled.as_text(), n_devices, kind)
    hlo = timed["hlo"]
    per = {k: _shard_bytes(v) for k, v in inputs.items()}
    temp = int(mem.temp_size_in_bytes)
    per["gradients"] = gradient_bytes
    per["activations"] = max(0, temp - gradient_bytes)
    per["temporaries"] = temp
    per["arguments"] = int(mem.argument_size_in_bytes)
    per["outputs_not_aliased"] = max(0, int(mem.output_size_in_bytes) - int(mem.alias_size_in_bytes))
    per["total"] = per["arguments"] + per["outputs_not_aliased"] + temp
    per["capacity"] = int(kind.memory)
    t = timed["step_time_s"]
    peak_all = kind.peak * n_devices
    return {
        "per_device_bytes": per,
        "flops_per_step": hlo.flops,  # per device, loops counted
        "flops_per_step_all_devices": hlo.flops * n_devices,
        "model_flops_per_step": model_flops,
        "flops_ratio": hlo.flops * n_devices / model_flops if model_flops else None,
        "collective_bytes": hlo.collective_bytes(),
        "step_time_s": t,
        "kernel_costs": {"count": timed["kernel_count"], "bytes": timed["bytes"],
                    "seconds_by_kind": timed["kernels"]["by_kind"], "seconds_by_bound": timed["kernels"]["bound"],
                    "custom_calls": timed["custom_calls"]},
        "mfu": {k: (model_flops / (t[k] * peak_all) if t[k] else None) for k in ("with_overlap", "without_overlap")},
        "unknown_loop_trip_counts": hlo.unknown_trip_counts,
    }


def model_config(c):
    """The model config a run would use: `model.init`'s config.json when it exists, else `model.config`."""
    from nemo_jax.config.model import NemotronHConfig
    from nemo_jax.train.sft import model_config_path

    init = c.model.init
    if init not in ("random", None) and os.path.isfile(os.path.join(init, "config.json")):
        return NemotronHConfig.from_file(os.path.join(init, "config.json"))
    return NemotronHConfig.from_file(model_config_path(c.model.config))


def _devices(n: int, target: str = "cpu", device_kind: str = "h100"):
    """n devices to compile for: compile-only devices of the target (gpu / tpu), or simulated CPU devices."""
    if target != "cpu":
        from nemo_jax.plan.targets import get_topology

        if native_target(device_kind) != target:
            raise ValueError(f"--target {target} cannot compile for device kind {device_kind!r} "
                             f"(its target is {native_target(device_kind)}, or cpu)")
        return get_topology(target, device_kind, n)
    devs = jax.devices("cpu")
    if len(devs) < n:
        raise RuntimeError(f"plan: {n} simulated devices asked, but jax started with {len(devs)} CPU devices; run "
                           f"`nemo-jax plan` in a fresh process (it sets jax_num_cpu_devices={n} before jax starts)")
    return devs[:n]


def _per_node(c, kind: DeviceKind, n: int) -> int:
    """Devices per simulated node for make_mesh: the config's mesh.devices_per_node, else the device kind's
    node size when n fills whole nodes, else 0 (one node)."""
    return c.mesh.devices_per_node or (kind.per_node if kind.per_node and n % kind.per_node == 0 else 0)


def _code_version() -> str:
    """A hash of the nemo_jax sources: a cached plan is reused only by the code that made it."""
    import hashlib

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    h = hashlib.sha256(jax.__version__.encode())
    for d, _, files in sorted(os.walk(root)):
        for f in sorted(files):
            if f.endswith((".py", ".txtpb")):
                with open(os.path.join(d, f), "rb") as fh:
                    h.update(f.encode() + fh.read())
    return h.hexdigest()[:16]


def cache_dir() -> str:
    return os.environ.get("NEMO_JAX_PLAN_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "nemo_jax", "plans"))


def _cached(what: str, key: dict, compute):
    """compute() -> a JSON-able result, reused from cache_dir() for the same (what, key, code): a plan's figures
    depend only on the config, the device count and kind, the target and the code."""
    import hashlib
    import json

    from nemo_jax.fsutil import atomic_write_text

    digest = hashlib.sha256(json.dumps({"what": what, "code": _code_version(), **key}, sort_keys=True,
                                       default=str).encode()).hexdigest()[:24]
    path = os.path.join(cache_dir(), f"{what}-{digest}.json")
    try:
        with open(path) as f:
            out = json.load(f)
        out["cached"] = True
        return out
    except (OSError, ValueError):
        pass
    out = compute()
    try:
        atomic_write_text(path, json.dumps(out))
    except OSError:  # a read-only home: plans still work, uncached
        pass
    out["cached"] = False
    return out


def _plan_key(c, n_devices: int, kind: DeviceKind, target: str, headroom: float, **extra) -> dict:
    """What a compiled program depends on: the model, data shape, optimiser, mesh and LoRA sections."""
    keep = ("model", "data", "optim", "mesh", "lora")
    return {"config": {k: dataclasses.asdict(c)[k] for k in keep}, "model_config": model_config(c).to_hf_dict(),
            "n": n_devices, "kind": kind.key or kind.name, "target": target, "headroom": headroom, **extra}


def plan_sft(c, n_devices: int, kind: DeviceKind, headroom: float = 0.1, target: str = "cpu",
             cache: bool = True) -> dict:
    """Compile the config's SFT (or LoRA SFT) step for n_devices devices of `kind` with the `target`'s compiler
    (gpu / tpu: deviceless, the real backend; cpu: simulated CPU devices, an estimate) and report its figures.
    Results are cached by (config, devices, kind, target, code)."""
    run = lambda: _plan_sft(c, n_devices, kind, headroom, target)  # noqa: E731
    return _cached("sft", _plan_key(c, n_devices, kind, target, headroom), run) if cache else run()


def _plan_sft(c, n_devices: int, kind: DeviceKind, headroom: float, target: str) -> dict:
    from nemo_jax.parallel.mesh import make_mesh
    from nemo_jax.parallel.rules import Rules
    from nemo_jax.train.metrics import model_flops_per_token
    from nemo_jax.train.sft import step_program

    cfg = model_config(c)
    mesh = make_mesh(c.mesh.sizes(), _devices(n_devices, target, kind.key), _per_node(c, kind, n_devices))
    prog = step_program(c, cfg, mesh, Rules())
    state, batch, frozen = prog.abstract_inputs(c.data.batch_size, c.data.seq_len)
    t0 = time.perf_counter()
    compiled = prog.step.lower(state, batch, frozen).compile()
    compile_s = time.perf_counter() - t0
    trainable_fp32 = sum(math.prod(x.sharding.shard_shape(x.shape)) * 4 for x in jax.tree.leaves(state.params))
    inputs = {"params": state.params if frozen is None else frozen, "optimizer": state.opt_state, "batch": batch}
    if frozen is not None:
        inputs["adapters"] = state.params
    tokens = c.data.batch_size * c.data.seq_len
    out = analyse_compiled(compiled, n_devices, kind, inputs, model_flops_per_token(cfg, c.data.seq_len) * tokens,
                           trainable_fp32)
    out.update(program="lora_sft_step" if frozen is not None else "sft_step", compile_s=compile_s,
               tokens_per_step=tokens, mesh=dict(mesh.shape), remat=c.model.remat, grad_accum=c.optim.grad_accum,
               target=target, estimate=target == "cpu", kernels=c.model.kernels)
    out["fits"] = out["per_device_bytes"]["total"] <= (1 - headroom) * kind.memory
    return out


def plan_sampler(c, n_devices: int, kind: DeviceKind, batch: int, context: int, headroom: float = 0.1,
                 target: str = "cpu", cache: bool = True, prefill: int | None = None) -> list[dict]:
    """Compile the sampler's prefill (`prefill` tokens per row appended to a decode state of `context` positions;
    default the whole context: a first prompt filling it) and one-token decode step for `batch` rows, with the
    weights in the compute dtype and the decode state on the mesh. Multi-turn rollouts prefill each turn's new
    tokens (a tool result, a screenshot) into a state that already holds the conversation: `prefill` < context."""
    prefill = min(prefill or context, context)
    run = lambda: {"programs": _plan_sampler(c, n_devices, kind, batch, context, headroom, target,  # noqa: E731
                                             prefill)}
    key = _plan_key(c, n_devices, kind, target, headroom, rows=batch, context=context, prefill=prefill)
    return (_cached("sampler", key, run) if cache else run())["programs"]


def _plan_sampler(c, n_devices: int, kind: DeviceKind, batch: int, context: int, headroom: float,
                  target: str, prefill: int) -> list[dict]:
    from nemo_jax.generate import decode as G
    from nemo_jax.model.cache import state_shapes, state_shardings
    from nemo_jax.model.spec import abstract_params, param_specs
    from nemo_jax.parallel.mesh import make_mesh
    from nemo_jax.parallel.rules import Rules, param_shardings
    from nemo_jax.train.metrics import model_flops_per_token
    from nemo_jax.train.sft import options_from

    cfg = model_config(c)
    mesh = make_mesh(c.mesh.sizes(), _devices(n_devices, target, kind.key), _per_node(c, kind, n_devices))
    opts = dataclasses.replace(options_from(c.model, mesh), remat="none")
    sh = param_shardings(param_specs(cfg), mesh, Rules())
    params = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, opts.dtype, sharding=s), abstract_params(cfg), sh)
    st = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                      state_shapes(cfg, batch, context, opts.dtype),
                      state_shardings(cfg, batch, context, mesh, dtype=opts.dtype))
    rows = Rules().sharding(mesh, ("batch", None), (batch, context))
    out = []
    for name, length in (("prefill", prefill), ("decode", 1)):
        toks = jax.ShapeDtypeStruct((batch, length), jnp.int32, sharding=rows)
        valid = jax.ShapeDtypeStruct((batch, length), jnp.bool_, sharding=rows)
        t0 = time.perf_counter()
        compiled = G._append.lower(params, toks, valid, st, cfg=cfg, opts=opts, mesh=mesh).compile()
        compile_s = time.perf_counter() - t0
        fwd_flops = model_flops_per_token(cfg, context) / 3 * batch * length  # forward only
        r = analyse_compiled(compiled, n_devices, kind, {"params": params, "decode_state": st}, fwd_flops)
        tps = batch * length / r["step_time_s"]["with_overlap"] if r["step_time_s"]["with_overlap"] else None
        r.update(program=f"sampler_{name}", compile_s=compile_s, rows=batch, context=context, tokens=length,
                 tokens_per_s=tps,
                 mesh=dict(mesh.shape), target=target, estimate=target == "cpu")
        r["fits"] = r["per_device_bytes"]["total"] <= (1 - headroom) * kind.memory
        out.append(r)
    return out


def tinker_plan(learner: dict, samplers: list[dict], clients: int, kind: DeviceKind, headroom: float) -> dict:
    """The Tinker server (`serve --tinker-root`) on one device set, from its compiled programs: the learner step of
    one client's batch (`learner`, a LoRA step), the adapters and Adam moments of `clients` LoRA models resident at
    once, and the sampler's decode state and temporaries (`samplers`: its prefill / decode programs) beside them;
    the base weights held once (the learner computes over the sampler's copy). Clients' steps run one after another:
    a round of all of them takes `clients` learner steps."""
    per = learner["per_device_bytes"]
    more_clients = (clients - 1) * (per["adapters"] + per["optimizer"])
    sampler = max((p["per_device_bytes"]["decode_state"] + p["per_device_bytes"]["temporaries"] for p in samplers),
                  default=0)
    total = per["total"] + more_clients + sampler
    step = learner["step_time_s"]["with_overlap"]
    return {"clients": clients, "fits": total <= (1 - headroom) * kind.memory,
            "per_device_bytes": {"learner_step": per["total"], "more_clients": more_clients,
                                 "adapters_and_optimizer_per_client": per["adapters"] + per["optimizer"],
                                 "sampler_state_and_temporaries": sampler, "total": total,
                                 "capacity": int(kind.memory)},
            "step_time_s": step, "round_time_s": step * clients, "sampler_planned": bool(samplers)}


def format_tinker(t: dict) -> str:
    b = t["per_device_bytes"]
    return (f"tinker server, {t['clients']} LoRA clients: {'FITS' if t['fits'] else 'DOES NOT FIT'} "
            f"{fmt_bytes(b['total'])} of {fmt_bytes(b['capacity'])} per device (learner step "
            f"{fmt_bytes(b['learner_step'])}, {t['clients'] - 1} more clients' adapters + Adam "
            f"{fmt_bytes(b['more_clients'])}, sampler state + temporaries "
            f"{fmt_bytes(b['sampler_state_and_temporaries'])}{'' if t['sampler_planned'] else ' (no --sampler)'}); "
            f"a client's step {fmt_seconds(t['step_time_s'])}, a round of all {fmt_seconds(t['round_time_s'])}")


# ----------------------------------------------------------------------------- mesh search
def candidate_meshes(n: int, kind: DeviceKind, n_experts: int) -> list[dict]:
    """Mesh shapes over n devices: tensor within a node (1, 2, 4, 8), expert dividing the routed experts,
    data 1 or one replica per node group (HSDP), fsdp the rest."""
    out = []
    per_node = kind.per_node or n
    for tensor, expert in itertools.product((1, 2, 4, 8), (1, 2, 4, 8, 16, 32, 64)):
        if tensor > per_node or n % (tensor * expert) or (n_experts and n_experts % expert) or (
                expert > 1 and not n_experts):
            continue
        for data in sorted({1, max(1, n // per_node)}):
            rest = n // (tensor * expert)
            if rest % data:
                continue
            out.append({"data": data, "fsdp": rest // data, "tensor": tensor, "expert": expert})
    return out


class _MeshShape:
    """What `Rules.spec` reads of a mesh (its axis sizes), without devices."""

    def __init__(self, sizes: dict):
        self.shape = sizes


def state_lower_bound(c, n_devices: int) -> int:
    """Bytes per device of the training state alone (trainable params, two Adam moments, one gradient, and a
    frozen base under LoRA), from the shardings the mesh gives each leaf: no compile. A candidate above the
    device's memory cannot fit whatever the compiler does."""
    from nemo_jax.model.spec import ParamSpec, param_specs
    from nemo_jax.parallel.mesh import resolve_sizes
    from nemo_jax.parallel.rules import Rules

    cfg = model_config(c)
    mesh = _MeshShape(resolve_sizes(c.mesh.sizes(), n_devices))
    rules = Rules()

    def shard(s: ParamSpec, itemsize: int) -> int:
        spec = rules.spec(s.axes, s.shape, mesh)
        split = math.prod(math.prod(mesh.shape[a] for a in ((x,) if isinstance(x, str) else x)) for x in spec if x)
        return math.prod(s.shape) * itemsize // split

    specs = jax.tree.leaves(param_specs(cfg), is_leaf=lambda x: isinstance(x, ParamSpec))
    if not c.lora.targets:
        return sum(shard(s, 4 * 4) for s in specs)  # params, mu, nu, gradient: fp32 each
    base = 2 if c.lora.base_dtype == "bfloat16" else 4
    return sum(shard(s, base) for s in specs)  # the adapters are small next to the frozen base


def search(c, n_devices: int, kind: DeviceKind, max_candidates: int = 12, headroom: float = 0.1,
           remats=("layer", "save_matmuls", "none"), progress=print, target: str = "cpu", jobs: int = 1,
           grad_accums: tuple[int, ...] | None = None) -> list[dict]:
    """Try (mesh, remat, grad_accum) variants of the config's step -> one row per compiled candidate, those that
    fit first, ranked by the roofline step time with overlap. Fewer micro-batches gather every weight and
    reduce-scatter every gradient fewer times per step (one micro-batch: once) at the price of activation
    memory; the search tries the config's `optim.grad_accum` and the counts dividing it.

    Candidates whose training state alone (`state_lower_bound`) exceeds the device's memory are dropped before
    anything compiles; up to `max_candidates` of the rest are compiled, `jobs` at a time (each in its own
    process), each result cached (`plan_sft`)."""
    from nemo_jax.config.train import MeshSection
    from nemo_jax.parallel.mesh import batch_shards_of

    cfg = model_config(c)
    meshes = candidate_meshes(n_devices, kind, cfg.n_routed_experts if "moe" in cfg.layer_kinds else 0)
    meshes.sort(key=lambda m: (m["tensor"], m["data"], -m["expert"]))  # fewest TP collectives, most EP
    ga0 = c.optim.grad_accum
    accums = grad_accums or tuple(a for a in range(1, ga0 + 1) if ga0 % a == 0)[::-1]
    variants = []
    for r_i, remat in enumerate(remats):
        for m in meshes:
            for ga in accums:
                if c.data.batch_size % (ga * batch_shards_of(m)):
                    continue
                ci = dataclasses.replace(c, mesh=MeshSection(**m), model=dataclasses.replace(c.model, remat=remat),
                                         optim=dataclasses.replace(c.optim, grad_accum=ga))
                variants.append((r_i, ci))
    limit = (1 - headroom) * kind.memory
    fitting = [(r_i, ci) for r_i, ci in variants if state_lower_bound(ci, n_devices) <= limit]
    pruned = len(variants) - len(fitting)
    if pruned:
        progress(f"{pruned} of {len(variants)} candidates pruned: their training state alone exceeds "
                 f"{limit / GiB:.1f} GiB per device")
    fitting.sort(key=lambda x: x[0])  # the first remat policy's candidates first
    cands = [ci for _, ci in fitting][:max_candidates]

    def one(i_ci):
        i, ci = i_ci
        sizes = {k: v for k, v in dataclasses.asdict(ci.mesh).items() if k != "devices_per_node"}
        label = f"{sizes} remat={ci.model.remat} grad_accum={ci.optim.grad_accum}"
        try:
            r = plan_sft(ci, n_devices, kind, headroom, target) if jobs <= 1 else _plan_in_process(
                ci, n_devices, kind, headroom, target)
        except ValueError as e:
            progress(f"[{i + 1}/{len(cands)}] {label}: skipped ({e})")
            return None
        how = "cached" if r.get("cached") else f"compiled in {r['compile_s']:.0f} s"
        progress(f"[{i + 1}/{len(cands)}] {label}: {r['per_device_bytes']['total'] / GiB:.1f} GiB, "
                 f"{'fits' if r['fits'] else 'does not fit'}, {r['step_time_s']['with_overlap']:.3f} s ({how})")
        return r

    if jobs <= 1:
        rows = [one(x) for x in enumerate(cands)]
    else:
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(jobs) as pool:
            rows = list(pool.map(one, enumerate(cands)))
    rows = [r for r in rows if r is not None]
    rows.sort(key=lambda r: (not r["fits"], r["step_time_s"]["with_overlap"]))
    return rows


def _plan_in_process(c, n_devices: int, kind: DeviceKind, headroom: float, target: str) -> dict:
    """`plan_sft` in a fresh `nemo-jax plan` process (a compile per process: `--jobs` compiles in parallel, and a
    CPU plan needs its own simulated device count). The config travels as a resolved YAML file."""
    import json
    import subprocess
    import sys
    import tempfile

    from nemo_jax.config.load import dump_yaml

    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        f.write(dump_yaml(c))
    try:
        cmd = [sys.executable, "-m", "nemo_jax.cli", "plan", "--config", f.name, "--devices", str(n_devices),
               "--device-kind", kind.key, "--target", target, "--headroom", str(headroom), "--json"]
        p = subprocess.run(cmd, capture_output=True, text=True)
    finally:
        os.unlink(f.name)
    if p.returncode:
        raise ValueError(p.stderr.strip().splitlines()[-1] if p.stderr.strip() else f"exit {p.returncode}")
    return json.loads(p.stdout)["programs"][0]


# ----------------------------------------------------------------------------- text
def fmt_bytes(b: float) -> str:
    """Bytes in the unit that shows them: 1.50 GiB, 12.3 MiB, 640 KiB, 96 B."""
    for unit, size in (("GiB", GiB), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(b) >= size:
            v = b / size
            return f"{v:.2f} {unit}" if v < 10 else f"{v:.1f} {unit}" if v < 100 else f"{v:.0f} {unit}"
    return f"{int(b)} B"


def fmt_seconds(t: float) -> str:
    """Seconds in the unit that shows them: 2.35 s, 14.2 ms, 310 us."""
    for unit, size in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
        if abs(t) >= size:
            v = t / size
            return f"{v:.3g} {unit}"
    return f"{t * 1e9:.3g} ns" if t else "0 s"


TARGET_NOTE = {"gpu": "XLA:GPU deviceless compile", "tpu": "libtpu deviceless compile",
               "cpu": "XLA:CPU on simulated devices: an estimate (bf16 matmuls and collectives run in fp32 there)"}


def format_plan(r: dict, kind: DeviceKind) -> str:
    b = r["per_device_bytes"]
    t, m = r["step_time_s"], r["mfu"]
    target = r.get("target", "cpu")
    how = "cached" if r.get("cached") else f"compiled in {r['compile_s']:.1f} s"
    lines = [f"## {r['program']}  mesh {r['mesh']}" + (f"  remat {r['remat']}" if "remat" in r else "")
             + (f"  grad_accum {r['grad_accum']}" if "grad_accum" in r else "")
             + f"  on {kind.name}  [{TARGET_NOTE[target]}; {how}]",
             "per device: " + ", ".join(f"{k} {fmt_bytes(v)}" for k, v in b.items() if k != "capacity")
             + f" of {fmt_bytes(b['capacity'])} -> " + ("fits" if r["fits"] else "DOES NOT FIT"),
             f"FLOPs per step: {r['flops_per_step']:.3e} per device, {r['flops_per_step_all_devices']:.3e} all devices; "
             f"model {r['model_flops_per_step']:.3e} (ratio {r['flops_ratio']:.2f})" if r["flops_ratio"] else "",
             "collectives per step per device: " + (", ".join(f"{k} {fmt_bytes(v)}" for k, v in
                                                              sorted(r["collective_bytes"].items())) or "none"),
             f"step time: compute {fmt_seconds(t['compute'])}, collectives {fmt_seconds(t['collectives'])} of which "
             f"{fmt_seconds(t['overlapped'])} overlapped and {fmt_seconds(t['exposed'])} exposed -> "
             f"{fmt_seconds(t['with_overlap'])} (serial {fmt_seconds(t['without_overlap'])}); "
             f"MFU {100 * m['with_overlap']:.1f}% (serial {100 * m['without_overlap']:.1f}%)"]
    k = r.get("kernel_costs")
    if k:
        lines.append(f"kernels: {k['count']:,.0f} launched, {fmt_bytes(k['bytes'])} moved; their time by kind "
                     + ", ".join(f"{n} {fmt_seconds(v)}" for n, v in sorted(k["seconds_by_kind"].items()))
                     + "; bound by " + ", ".join(f"{n} {fmt_seconds(v)}" for n, v in k["seconds_by_bound"].items()))
    if r.get("tokens_per_s"):
        lines.append(f"rollout tokens/s (roofline): {r['tokens_per_s']:,.0f}")
    if r.get("unknown_loop_trip_counts"):
        lines.append(f"note: {r['unknown_loop_trip_counts']} loops without a known trip count were counted once")
    return "\n".join(x for x in lines if x)


def format_search(rows: list[dict]) -> str:
    head = ("| rank | data | fsdp | tensor | expert | remat | grad_accum | memory/device | fits | step (overlap) | "
            "step (serial) | MFU |")
    out = [head, "|" + "---|" * 12]
    for i, r in enumerate(rows):
        m = r["mesh"]
        out.append(f"| {i + 1} | {m['data']} | {m['fsdp']} | {m['tensor']} | {m['expert']} | {r['remat']} | "
                   f"{r.get('grad_accum', 1)} | {fmt_bytes(r['per_device_bytes']['total'])} | "
                   f"{'yes' if r['fits'] else 'no'} | {fmt_seconds(r['step_time_s']['with_overlap'])} | "
                   f"{fmt_seconds(r['step_time_s']['without_overlap'])} | {100 * r['mfu']['with_overlap']:.1f}% |")
    return "\n".join(out)
