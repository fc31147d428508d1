"""`nemo-jax plan`: what each device of an N-device job holds and does, from an ahead-of-time compile of the
real step with abstract parameters on N simulated CPU devices (nothing is allocated).

Per device: bytes of parameters, optimiser state, gradients, activations / temporaries and the total (XLA's
compiled memory analysis; the split of temporaries into gradients and activations is an estimate, and the
CPU compiler schedules differently from the GPU / TPU ones), FLOPs per step with loop bodies multiplied by
their trip counts (`hlo.analyse`) next to the model FLOPs, the bytes of each collective kind, and a roofline
step time: compute at the device's dense bf16 peak, collectives at NVLink / InfiniBand / ICI bandwidth, with
and without overlap, and the implied MFU.
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

from nemo_jax.plan.hlo import analyse

GiB = 1024 ** 3


@dataclass(frozen=True)
class DeviceKind:
    name: str
    memory: float  # bytes of device memory as the runtime reports it
    peak: float  # dense bf16 FLOP/s
    intra_bw: float  # bytes/s per device, one direction, inside a node (NVLink) or a slice (ICI)
    inter_bw: float  # bytes/s per device between nodes (InfiniBand); unused when a slice is one ICI domain
    per_node: int | None  # devices per node (None: every device on one ICI domain)


DEVICE_KINDS = {
    "h100": DeviceKind("H100 SXM 80GB", 79.1 * GiB, 989e12, 450e9, 50e9, 8),
    "h200": DeviceKind("H200 SXM 141GB", 139.8 * GiB, 989e12, 450e9, 50e9, 8),
    "b200": DeviceKind("B200 180GB", 178.4 * GiB, 2250e12, 900e9, 50e9, 8),
    "tpu-v5p": DeviceKind("TPU v5p", 95.0 * GiB, 459e12, 200e9, 200e9, None),
}
# ring algorithms: bytes each device sends per byte of the collective's buffer, for a group of n
_TRAFFIC = {"all-reduce": lambda n: 2 * (n - 1) / n, "all-gather": lambda n: (n - 1) / n,
            "reduce-scatter": lambda n: (n - 1) / n, "all-to-all": lambda n: (n - 1) / n,
            "collective-permute": lambda n: 1.0}
ESTIMATES = ("gradients and activations split the compiled temporaries by estimate (gradients = one fp32 copy of "
             "the trainable shards); the CPU compiler schedules and fuses differently from GPU / TPU ones, so "
             "temporaries are indicative; step times are rooflines (dense bf16 peak, ring collectives at the "
             "kind's link bandwidth), not measurements")


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


def roofline(flops: float, collectives, kind: DeviceKind) -> dict:
    """-> seconds: `compute` (FLOPs at the dense bf16 peak), `collectives` (every collective at its link's ring
    bandwidth), `exposed` (the critical-path collectives, plus the overlappable ones that outlast the compute),
    `overlapped` (communication hidden behind compute), `with_overlap` (the step: compute + exposed) and
    `without_overlap` (compute + every collective, nothing hidden)."""
    hidden = path = 0.0
    for c in collectives:
        bw = kind.inter_bw if _spans_nodes(c.groups, kind.per_node) else kind.intra_bw
        t = c.count * c.bytes * _TRAFFIC[c.kind](max(c.group, 1)) / bw
        if c.kind in OVERLAPPABLE:
            hidden += t
        else:
            path += t
    compute = flops / kind.peak
    overlapped = min(compute, hidden)
    exposed = path + hidden - overlapped
    return {"compute": compute, "collectives": hidden + path, "exposed": exposed, "overlapped": overlapped,
            "with_overlap": compute + exposed, "without_overlap": compute + hidden + path}


def analyse_compiled(compiled, n_devices: int, kind: DeviceKind, inputs: dict, model_flops: float,
                     gradient_bytes: int = 0) -> dict:
    """Figures of one compiled program. inputs: {name: abstract tree} whose per-device bytes are reported."""
    mem = compiled.memory_analysis()
    hlo = analyse(compiled.as_text(), n_devices)
    per = {k: _shard_bytes(v) for k, v in inputs.items()}
    temp = int(mem.temp_size_in_bytes)
    per["gradients"] = gradient_bytes
    per["activations"] = max(0, temp - gradient_bytes)
    per["temporaries"] = temp
    per["arguments"] = int(mem.argument_size_in_bytes)
    per["outputs_not_aliased"] = max(0, int(mem.output_size_in_bytes) - int(mem.alias_size_in_bytes))
    per["total"] = per["arguments"] + per["outputs_not_aliased"] + temp
    per["capacity"] = int(kind.memory)
    t = roofline(hlo.flops, hlo.collectives, kind)
    peak_all = kind.peak * n_devices
    return {
        "per_device_bytes": per,
        "flops_per_step": hlo.flops,  # per device, loops counted
        "flops_per_step_all_devices": hlo.flops * n_devices,
        "model_flops_per_step": model_flops,
        "flops_ratio": hlo.flops * n_devices / model_flops if model_flops else None,
        "collective_bytes": hlo.collective_bytes(),
        "step_time_s": t,
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


def _devices(n: int):
    devs = jax.devices("cpu")
    if len(devs) < n:
        raise RuntimeError(f"plan: {n} simulated devices asked, but jax started with {len(devs)} CPU devices; run "
                           f"`nemo-jax plan` in a fresh process (it sets jax_num_cpu_devices={n} before jax starts)")
    return devs[:n]


def _per_node(c, kind: DeviceKind, n: int) -> int:
    """Devices per simulated node for make_mesh: the config's mesh.devices_per_node, else the device kind's
    node size when n fills whole nodes, else 0 (one node)."""
    return c.mesh.devices_per_node or (kind.per_node if kind.per_node and n % kind.per_node == 0 else 0)


def plan_sft(c, n_devices: int, kind: DeviceKind, headroom: float = 0.1) -> dict:
    """Compile the config's SFT (or LoRA SFT) step for n_devices simulated devices and report its figures."""
    from nemo_jax.parallel.mesh import make_mesh
    from nemo_jax.parallel.rules import Rules
    from nemo_jax.train.metrics import model_flops_per_token
    from nemo_jax.train.sft import step_program

    cfg = model_config(c)
    mesh = make_mesh(c.mesh.sizes(), _devices(n_devices), _per_node(c, kind, n_devices))
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
               tokens_per_step=tokens, mesh=dict(mesh.shape), remat=c.model.remat, grad_accum=c.optim.grad_accum)
    out["fits"] = out["per_device_bytes"]["total"] <= (1 - headroom) * kind.memory
    return out


def plan_sampler(c, n_devices: int, kind: DeviceKind, batch: int, context: int, headroom: float = 0.1) -> list[dict]:
    """Compile the sampler's prefill (a full `context` prompt) and one-token decode step for `batch` rows,
    with the weights in the compute dtype and the decode state on the mesh."""
    from nemo_jax import generate as G
    from nemo_jax.model.cache import state_shapes, state_shardings
    from nemo_jax.model.spec import abstract_params, param_specs
    from nemo_jax.parallel.mesh import make_mesh
    from nemo_jax.parallel.rules import Rules, param_shardings
    from nemo_jax.train.metrics import model_flops_per_token
    from nemo_jax.train.sft import options_from

    cfg = model_config(c)
    mesh = make_mesh(c.mesh.sizes(), _devices(n_devices), _per_node(c, kind, n_devices))
    opts = dataclasses.replace(options_from(c.model, mesh), remat="none")
    sh = param_shardings(param_specs(cfg), mesh, Rules())
    params = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, opts.dtype, sharding=s), abstract_params(cfg), sh)
    st = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                      state_shapes(cfg, batch, context, opts.dtype),
                      state_shardings(cfg, batch, context, mesh, dtype=opts.dtype))
    rows = Rules().sharding(mesh, ("batch", None), (batch, context))
    out = []
    for name, length in (("prefill", context), ("decode", 1)):
        toks = jax.ShapeDtypeStruct((batch, length), jnp.int32, sharding=rows)
        valid = jax.ShapeDtypeStruct((batch, length), jnp.bool_, sharding=rows)
        t0 = time.perf_counter()
        compiled = G._append.lower(params, toks, valid, st, cfg=cfg, opts=opts, mesh=mesh).compile()
        compile_s = time.perf_counter() - t0
        fwd_flops = model_flops_per_token(cfg, context) / 3 * batch * length  # forward only
        r = analyse_compiled(compiled, n_devices, kind, {"params": params, "decode_state": st}, fwd_flops)
        tps = batch * length / r["step_time_s"]["with_overlap"] if r["step_time_s"]["with_overlap"] else None
        r.update(program=f"sampler_{name}", compile_s=compile_s, rows=batch, context=context, tokens_per_s=tps,
                 mesh=dict(mesh.shape))
        r["fits"] = r["per_device_bytes"]["total"] <= (1 - headroom) * kind.memory
        out.append(r)
    return out


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


def search(c, n_devices: int, kind: DeviceKind, max_candidates: int = 12, headroom: float = 0.1,
           remats=("layer", "save_matmuls", "none"), progress=print) -> list[dict]:
    """Compile up to `max_candidates` (mesh, remat) variants of the config's step; -> one row each, those that
    fit first, ranked by the roofline step time with overlap."""
    from nemo_jax.config.train import MeshSection

    cfg = model_config(c)
    meshes = candidate_meshes(n_devices, kind, cfg.n_routed_experts if "moe" in cfg.layer_kinds else 0)
    # cheap order before compiling: fewest tensor-parallel collectives, then most expert parallelism
    meshes.sort(key=lambda m: (m["tensor"], m["data"], -m["expert"]))
    first = [(m, remats[0]) for m in meshes]
    rest = [(m, r) for m in meshes for r in remats[1:]]
    cands = (first[:max(1, (max_candidates + 1) // 2)] + rest + first[(max_candidates + 1) // 2:])[:max_candidates]
    rows = []
    for i, (m, remat) in enumerate(cands):
        ci = dataclasses.replace(c, mesh=MeshSection(**m), model=dataclasses.replace(c.model, remat=remat))
        try:
            r = plan_sft(ci, n_devices, kind, headroom)
        except ValueError as e:  # e.g. the batch does not divide over this mesh's batch shards
            progress(f"[{i + 1}/{len(cands)}] {m} remat={remat}: skipped ({e})")
            continue
        rows.append(r)
        progress(f"[{i + 1}/{len(cands)}] {m} remat={remat}: {r['per_device_bytes']['total'] / GiB:.1f} GiB, "
                 f"{'fits' if r['fits'] else 'does not fit'}, {r['step_time_s']['with_overlap']:.3f} s "
                 f"(compile {r['compile_s']:.0f} s)")
    rows.sort(key=lambda r: (not r["fits"], r["step_time_s"]["with_overlap"]))
    return rows


# ----------------------------------------------------------------------------- text
def _gib(b) -> str:
    return f"{b / GiB:.2f}"


def format_plan(r: dict, kind: DeviceKind) -> str:
    b = r["per_device_bytes"]
    t, m = r["step_time_s"], r["mfu"]
    lines = [f"## {r['program']}  mesh {r['mesh']}" + (f"  remat {r['remat']}" if "remat" in r else "")
             + f"  on {kind.name}  (compiled in {r['compile_s']:.1f} s)",
             "per device (GiB): " + "  ".join(f"{k} {_gib(v)}" for k, v in b.items() if k != "capacity")
             + f"  of {_gib(b['capacity'])}  -> " + ("fits" if r["fits"] else "DOES NOT FIT"),
             f"FLOPs per step: {r['flops_per_step']:.3e} per device, {r['flops_per_step_all_devices']:.3e} all devices; "
             f"model {r['model_flops_per_step']:.3e} (ratio {r['flops_ratio']:.2f})" if r["flops_ratio"] else "",
             "collectives per step per device: " + (", ".join(f"{k} {_gib(v)} GiB" for k, v in
                                                              sorted(r["collective_bytes"].items())) or "none"),
             f"step time: compute {t['compute']:.4f} s, collectives {t['collectives']:.4f} s -> "
             f"{t['with_overlap']:.4f} s overlapped .. {t['without_overlap']:.4f} s serial; "
             f"MFU {100 * m['with_overlap']:.1f}% .. {100 * m['without_overlap']:.1f}%"]
    if r.get("tokens_per_s"):
        lines.append(f"rollout tokens/s (roofline): {r['tokens_per_s']:,.0f}")
    if r.get("unknown_loop_trip_counts"):
        lines.append(f"note: {r['unknown_loop_trip_counts']} loops without a known trip count were counted once")
    return "\n".join(x for x in lines if x)


def format_search(rows: list[dict]) -> str:
    head = "| rank | data | fsdp | tensor | expert | remat | GiB/device | fits | step s (overlap) | step s (serial) | MFU |"
    out = [head, "|" + "---|" * 11]
    for i, r in enumerate(rows):
        m = r["mesh"]
        out.append(f"| {i + 1} | {m['data']} | {m['fsdp']} | {m['tensor']} | {m['expert']} | {r['remat']} | "
                   f"{_gib(r['per_device_bytes']['total'])} | {'yes' if r['fits'] else 'no'} | "
                   f"{r['step_time_s']['with_overlap']:.3f} | {r['step_time_s']['without_overlap']:.3f} | "
                   f"{100 * r['mfu']['with_overlap']:.1f}% |")
    return "\n".join(out)
