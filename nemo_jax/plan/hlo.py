"""What one device does per step, read from a compiled SPMD module's HLO text: FLOPs with loops counted
(XLA's own cost analysis counts a `while` body once, whatever its trip count) and the bytes of every
collective, with the size of its replica groups.

The counting follows XLA's HloCostAnalysis where it matters: a dot is 2 x output elements x contracted
elements; elementwise arithmetic and compares are one FLOP per output element; transcendentals are counted
apart; a reduce is one FLOP per input element folded in. Fusions and calls are counted through their
computations, a `while` as trip count x (body + condition), a conditional as its most expensive branch.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field

import numpy as np

_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4,
                "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16, "f8e4m3fn": 1, "f8e5m2": 1,
                "s4": 1, "u4": 1, "token": 0}
_ARRAY = re.compile(r"\b([a-z][a-z0-9]*)\[([0-9,]*)\]")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*?)\s+([a-z][a-z0-9\-]*)\((.*)$")
_HEADER = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s*\((.*)\)\s*->\s*.*\{\s*$")
ELEMENTWISE = {"add", "subtract", "multiply", "divide", "maximum", "minimum", "compare", "select", "negate", "abs",
               "and", "or", "xor", "not", "clamp", "remainder", "sign", "floor", "ceil", "round-nearest-even",
               "round-nearest-afz", "atan2", "shift-left", "shift-right-logical", "shift-right-arithmetic"}
TRANSCENDENTAL = {"exponential", "log", "tanh", "logistic", "sqrt", "rsqrt", "cbrt", "sine", "cosine", "tan",
                  "exponential-minus-one", "log-plus-one", "power", "erf"}
COLLECTIVES = {"all-reduce": "all-reduce", "all-gather": "all-gather", "reduce-scatter": "reduce-scatter",
               "all-to-all": "all-to-all", "collective-permute": "collective-permute", "ragged-all-to-all": "all-to-all"}
COLLECTIVES.update({k + "-start": v for k, v in list(COLLECTIVES.items())})  # async forms (XLA:GPU, TPU)
# library matmuls XLA:GPU emits as custom calls (with triton gemm fusions off, or for the shapes cuBLAS wins):
# their backend_config carries the dot's dimension numbers
GEMM_TARGETS = ("__cublas$gemm", "__cublas$lt$matmul", "__cublas$lt$matmul$f8", "__cudnn$matmul")


def _arrays(type_str: str) -> list[tuple[str, tuple[int, ...]]]:
    """'(f32[2,3]{1,0}, s32[])' -> [('f32', (2, 3)), ('s32', ())]."""
    return [(d, tuple(int(x) for x in dims.split(",") if x)) for d, dims in _ARRAY.findall(type_str)
            if d in _DTYPE_BYTES]


def _bytes(type_str: str) -> int:
    return sum(_DTYPE_BYTES[d] * math.prod(s) for d, s in _arrays(type_str))


def _elements(type_str: str) -> int:
    a = _arrays(type_str)
    return math.prod(a[0][1]) if a else 0


@dataclass
class Instr:
    name: str
    type: str
    opcode: str
    operands: list[str]
    attrs: str
    literal: str = ""  # the text inside the parentheses (a constant's value)


@dataclass
class Collective:
    kind: str
    bytes: int  # per device, per execution: the full buffer (all-gather: gathered output; others: operand)
    group: int  # devices in one replica group
    groups: list[list[int]]  # device ids of each group (logical, as the mesh numbers them)
    count: int  # executions per step (loop trips multiplied in)


@dataclass
class HloCost:
    flops: float = 0.0
    transcendentals: float = 0.0
    collectives: list[Collective] = field(default_factory=list)
    unknown_trip_counts: int = 0  # while loops whose trip count XLA did not annotate (counted once)

    def collective_bytes(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for c in self.collectives:
            out[c.kind] = out.get(c.kind, 0) + c.bytes * c.count
        return out


def _split_operands(s: str) -> tuple[list[str], str, str]:
    """The text after 'opcode(' -> (operand names, attribute text after the closing paren, the text inside)."""
    depth, i = 1, 0
    while i < len(s) and depth:
        depth += {"(": 1, ")": -1}.get(s[i], 0)
        i += 1
    inner, attrs = s[:i - 1], s[i:]
    return re.findall(r"%([\w.\-]+)", inner), attrs, inner


def parse_module(text: str) -> tuple[dict[str, list[Instr]], dict[str, dict[str, str]], str]:
    """-> ({computation: [instructions]}, {computation: {value name: type}}, entry computation name)."""
    comps: dict[str, list[Instr]] = {}
    types: dict[str, dict[str, str]] = {}
    entry, cur = None, None
    for line in text.splitlines():
        if cur is None:
            m = _HEADER.match(line)
            if m:
                cur = m.group(1)
                comps[cur], types[cur] = [], {}
                if line.startswith("ENTRY"):
                    entry = cur
                for pname, ptype in re.findall(r"([\w.\-]+):\s*((?:\([^)]*\))|(?:[a-z0-9]+\[[0-9,]*\](?:\{[^}]*\})?))",
                                               m.group(2)):
                    types[cur][pname] = ptype
            continue
        if line.strip() == "}":
            cur = None
            continue
        m = _INSTR.match(line)
        if m:
            name, typ, opcode, rest = m.groups()
            operands, attrs, inner = _split_operands(rest)
            comps[cur].append(Instr(name, typ, opcode, operands, attrs, inner))
            types[cur][name] = typ
    if entry is None:
        raise ValueError("HLO text without an ENTRY computation")
    return comps, types, entry


def _called(attrs: str, key: str) -> list[str]:
    m = re.search(key + r"=\{?([^}\s,]+(?:,\s*%[\w.\-]+)*)\}?", attrs)
    return re.findall(r"%?([\w.\-]+)", m.group(1)) if m else []


def _trip_count(attrs: str) -> int | None:
    m = re.search(r'"known_trip_count":\{"n":"(\d+)"\}', attrs)
    return int(m.group(1)) if m else None


def _constant(comps, comp: str, name: str, depth: int = 0):
    """The integer value of `name` in `comp` when it is a constant (through copies / converts), else None."""
    ins = next((i for i in comps.get(comp, ()) if i.name == name), None)
    if ins is None or depth > 4:
        return None
    if ins.opcode == "constant":
        return int(ins.literal) if re.fullmatch(r"-?\d+", ins.literal.strip()) else None
    if ins.opcode in ("copy", "convert", "bitcast") and ins.operands:
        return _constant(comps, comp, ins.operands[0], depth + 1)
    return None


def _inferred_trip_count(comps, comp: str, ins) -> int | None:
    """A while loop's trip count when XLA did not annotate it (libtpu leaves many unannotated): the condition
    compares a counter (tuple element i) with a constant bound, the body adds a constant step to it, and the
    loop's init tuple starts it at a constant (`for i in range(lo, hi, step)`); None when the loop is not of
    that form."""
    cond, body = (_called(ins.attrs, k) for k in ("condition", "body"))
    if not cond or not body or cond[0] not in comps or body[0] not in comps:
        return None
    root = next((i for i in comps[cond[0]] if i.opcode == "compare"), None)
    if root is None or len(root.operands) != 2:
        return None
    d = re.search(r"direction=(\w+)", root.attrs)
    by_name = {i.name: i for i in comps[cond[0]]}
    gte = by_name.get(root.operands[0])
    bound = _constant(comps, cond[0], root.operands[1])
    if gte is None or gte.opcode != "get-tuple-element" or bound is None or not d or d.group(1) not in ("LT", "LE"):
        return None
    idx = int(re.search(r"index=(\d+)", gte.attrs).group(1))
    # the counter's step: body root tuple element idx = add(get-tuple-element(param, idx), constant)
    broot = next((i for i in reversed(comps[body[0]]) if i.opcode == "tuple"), None)
    step = 1
    if broot is not None and idx < len(broot.operands):
        bnames = {i.name: i for i in comps[body[0]]}
        upd = bnames.get(broot.operands[idx])
        if upd is not None and upd.opcode == "add":
            consts = [_constant(comps, body[0], o) for o in upd.operands]
            step = next((c for c in consts if c), 1)
    init_tuple = next((i for i in comps[comp] if ins.operands and i.name == ins.operands[0]), None)
    start = 0
    if init_tuple is not None and init_tuple.opcode == "tuple" and idx < len(init_tuple.operands):
        start = _constant(comps, comp, init_tuple.operands[idx])
        if start is None:
            return None
    hi = bound + (1 if d.group(1) == "LE" else 0)
    return max(0, -(-(hi - start) // max(step, 1)))


def _conv_flops(ins, ty) -> float:
    """2 x output elements x (input features x window) per output element: the rhs dims labelled `i` (input
    feature) or with a digit (spatial window) in dim_labels (e.g. bf_io->bf for a dot, b01f_01io->b01f)."""
    m = re.search(r"dim_labels=[^_]+_([^-]+)->", ins.attrs)
    rhs = _arrays(ty.get(ins.operands[1], "")) if len(ins.operands) > 1 else []
    if not m or not rhs or len(m.group(1)) != len(rhs[0][1]):
        return 0.0
    k = math.prod(n for lab, n in zip(m.group(1), rhs[0][1]) if lab == "i" or lab.isdigit())
    return 2.0 * _elements(ins.type) * k


# FLOPs of the Pallas kernels of `nemo_jax.kernels` (a custom call whose op_name ends in <name>/pallas_call): the
# compiler sees an opaque call, so they are counted from their operands here. flash: q in the rows layout
# [b, kv, rows, hd] (the first 4-D floating operand), k [b, s_k, kv, hd] (the second); one QK^T and one PV per
# (row, key) for the forward, 3 matmuls for dq, 4 for dk/dv (both recompute the probabilities); causal blocks
# above the diagonal are skipped (x 1/2). gmm [M, K] x [G, K, N] -> [M, N]; tgmm [M, K]^T x [M, N] -> [G, K, N].
# ssd_fwd / ssd_bwd (`nemo_jax.kernels.ssd`): x [b, h, L, P] (the first operand), B [b, g, L, N] (the seventh),
# the chunk-major cumulative decay [b, h, chunks, 1, cs] (the fourth); per chunk and head, matmuls of cs x cs x
# (N or P) and cs x P x N: SSD_MATMULS[name] = (how many of the first, with N; with P; of the second).
FLASH_MATMULS = {"flash_fwd": 2, "flash_bwd_dq": 3, "flash_bwd_dkv": 4}
SSD_MATMULS = {"ssd_fwd": (1, 1, 2), "ssd_bwd": (3, 2, 5)}
CAUSAL = 0.5
KERNELS = (*FLASH_MATMULS, *SSD_MATMULS, "gmm", "tgmm")


_PALLAS = re.compile(r'op_name="[^"]*/(?:\w+\()*(\w+)\)*/pallas_call"')  # .../flash_fwd/pallas_call, .../jvp(gmm)/...


def _kernel_name(attrs: str) -> str | None:
    m = _PALLAS.search(attrs)
    return m.group(1) if m and m.group(1) in KERNELS else None


def _kernel_flops(name: str, ins, ty) -> float:
    arrs = [a for o in ins.operands for a in _arrays(ty.get(o, "")) if a[0] in ("bf16", "f16", "f32")]
    out = _arrays(ins.type)
    if name in SSD_MATMULS:
        shapes = [_arrays(ty.get(o, "")) for o in ins.operands]
        if len(shapes) < 7 or not all(shapes[i] for i in (0, 3, 6)):
            return 0.0
        (b, h, L, P), (N, cs) = shapes[0][0][1], (shapes[6][0][1][3], shapes[3][0][1][4])
        with_n, with_p, state = SSD_MATMULS[name]
        return 2.0 * b * h * L * (cs * (with_n * N + with_p * P) + state * P * N)
    if name in FLASH_MATMULS:
        four = [a for a in arrs if len(a[1]) == 4]
        if len(four) < 2:
            return 0.0
        q, k = four[0][1], four[1][1]
        return 2.0 * FLASH_MATMULS[name] * math.prod(q) * k[1] * CAUSAL
    lhs = next((a[1] for a in arrs if len(a[1]) == 2), None)
    if lhs is None or not out:
        return 0.0
    if name == "gmm":
        return 2.0 * math.prod(out[0][1]) * lhs[1]
    return 2.0 * lhs[0] * math.prod(out[0][1][1:])  # tgmm: sum over groups of M_g K N


def _gemm_flops(ins, ty) -> float:
    """2 x output elements x contracted elements of a library matmul custom call (dimension numbers in its
    backend_config); its output is the first array of the result tuple."""
    m = re.search(r'"lhs_contracting_dimensions":\[([^\]]*)\]', ins.attrs)
    lhs = _arrays(ty.get(ins.operands[0], "")) if ins.operands else []
    if not m or not lhs:
        return 0.0
    k = math.prod(lhs[0][1][int(d)] for d in re.findall(r"\d+", m.group(1)))
    out = _arrays(ins.type)
    return 2.0 * math.prod(out[0][1]) * k if out else 0.0


def replica_groups(attrs: str, n_devices: int) -> list[list[int]]:
    """Parse `replica_groups={{0,1},{2,3}}`, the iota form `replica_groups=[2,4]<=[4,2]T(1,0)` or the mesh form
    `replica_groups=mesh['x'=4,'y'=2] device_ids=([8]) {'y'}`; collective permutes give their source-target
    pairs as groups. Empty -> one group of all devices."""
    m = re.search(r"replica_groups=\[([0-9,]+)\]<=\[([0-9,]+)\](?:T\(([0-9,]+)\))?", attrs)
    if m:
        shape = [int(x) for x in m.group(1).split(",")]
        dims = [int(x) for x in m.group(2).split(",")]
        ids = np.arange(math.prod(dims)).reshape(dims)
        if m.group(3):
            ids = ids.transpose([int(x) for x in m.group(3).split(",")])
        return ids.reshape(shape).tolist()
    m = re.search(r"replica_groups=mesh\[([^\]]*)\](?:\s*device_ids=\(\[([0-9,]+)\](?:T\(([0-9,]+)\))?\))?"
                  r"\s*\{([^}]*)\}", attrs)
    if m:  # mesh form: mesh['a'=32,'b'=2] device_ids=([2,32]T(1,0)) {'a'}: groups vary along the listed axes
        names, sizes = zip(*[(k, int(v)) for k, v in re.findall(r"'([^']+)'=(\d+)", m.group(1))])
        ids = np.arange(math.prod(sizes))
        if m.group(2):
            dims = [int(x) for x in m.group(2).split(",")]
            ids = ids.reshape(dims)
            if m.group(3):
                ids = ids.transpose([int(x) for x in m.group(3).split(",")])
        ids = ids.reshape(sizes)
        along = [names.index(a) for a in re.findall(r"'([^']+)'", m.group(4))]
        rest = [i for i in range(len(sizes)) if i not in along]
        size = math.prod(sizes[i] for i in along)
        return ids.transpose(rest + along).reshape(-1, size).tolist()
    m = re.search(r"replica_groups=\{((?:\{[0-9,]*\},?)*)\}", attrs)
    if m and m.group(1):
        return [[int(x) for x in g.split(",") if x] for g in re.findall(r"\{([0-9,]*)\}", m.group(1))]
    m = re.search(r"source_target_pairs=\{((?:\{[0-9,]*\},?)*)\}", attrs)
    if m and m.group(1):
        return [[int(x) for x in g.split(",")] for g in re.findall(r"\{([0-9,]*)\}", m.group(1))]
    return [list(range(n_devices))]


def analyse(text: str, n_devices: int) -> HloCost:
    """FLOPs and collectives of one device's step (the SPMD module), loops counted by their trip counts."""
    comps, types, entry = parse_module(text)
    cost = HloCost()
    memo: dict[str, tuple[float, float, list]] = {}

    def visit(comp: str) -> tuple[float, float, list]:
        if comp in memo:
            return memo[comp]
        memo[comp] = (0.0, 0.0, [])  # recursion guard
        flops = trans = 0.0
        colls: list[tuple[Collective, int]] = []  # (collective, multiplier)
        ty = types[comp]

        def sub(names, mult=1):
            nonlocal flops, trans
            for n in names:
                if n in comps:
                    f, t, c = visit(n)
                    flops += mult * f
                    trans += mult * t
                    colls.extend((x, m * mult) for x, m in c)

        for ins in comps[comp]:
            op = ins.opcode
            if op == "dot":
                lhs = _arrays(ty.get(ins.operands[0], ""))
                m = re.search(r"lhs_contracting_dims=\{([0-9,]*)\}", ins.attrs)
                k = math.prod(lhs[0][1][int(d)] for d in m.group(1).split(",") if d) if (m and lhs) else 1
                flops += 2.0 * _elements(ins.type) * k
            elif op in ELEMENTWISE:
                flops += _elements(ins.type)
            elif op in TRANSCENDENTAL:
                trans += _elements(ins.type)
            elif op == "reduce":
                n_in = sum(_elements(ty.get(o, "")) for o in ins.operands[:max(1, len(ins.operands) // 2)])
                flops += max(0, n_in - _elements(ins.type))
            elif op == "convolution":  # libtpu lowers dots to convolutions (dim_labels=bf_io->bf, ...)
                flops += _conv_flops(ins, ty)
            elif op == "custom-call" and any(f'custom_call_target="{t}"' in ins.attrs for t in GEMM_TARGETS):
                flops += _gemm_flops(ins, ty)
            elif op == "custom-call" and _kernel_name(ins.attrs):
                flops += _kernel_flops(_kernel_name(ins.attrs), ins, ty)
            elif op in ("fusion", "call", "async-start", "custom-call"):
                sub(_called(ins.attrs, "calls") + _called(ins.attrs, "to_apply"))
            elif op == "while":
                n = _trip_count(ins.attrs)
                if n is None:
                    n = _inferred_trip_count(comps, comp, ins)
                if n is None:
                    cost.unknown_trip_counts += 1
                    n = 1
                sub(_called(ins.attrs, "body") + _called(ins.attrs, "condition"), n)
            elif op == "conditional":
                branches = (_called(ins.attrs, "branch_computations")
                            or _called(ins.attrs, "true_computation") + _called(ins.attrs, "false_computation"))
                best = max((visit(b) for b in branches if b in comps), key=lambda r: r[0], default=None)
                if best:
                    flops += best[0]
                    trans += best[1]
                    colls.extend(best[2])
            if op in COLLECTIVES:
                kind = COLLECTIVES[op]
                operand_bytes = sum(_bytes(ty.get(o, "")) for o in ins.operands)
                size = _bytes(ins.type) if kind == "all-gather" else operand_bytes
                groups = replica_groups(ins.attrs, n_devices)
                if kind == "all-gather" and op.endswith("-start"):
                    size = _bytes(ins.type) - operand_bytes  # the start's type is (operand, output)
                colls.append((Collective(kind, size, max(len(g) for g in groups), groups, 1), 1))
        memo[comp] = (flops, trans, colls)
        return memo[comp]

    f, t, c = visit(entry)
    cost.flops, cost.transcendentals = f, t
    cost.collectives = [Collective(x.kind, x.bytes, x.group, x.groups, m) for x, m in c]
    return cost


# ----------------------------------------------------------------------------- per kernel
# instructions that run no kernel of their own (containers are walked into; collectives are costed apart by
# `analyse`'s link model; their `-done` halves and host transfers wait on work counted elsewhere)
FREE = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "while", "conditional", "call",
        "after-all", "add-dependency", "opt-barrier", "partition-id", "replica-id", "domain", "copy-start",
        "copy-done", "send", "recv", "send-done", "recv-done", "infeed", "outfeed", "async-start", "async-done",
        "async-update"} | set(COLLECTIVES) | {k[:-len("-start")] + "-done" for k in COLLECTIVES if k.endswith("-start")}
_SLICING = ("dynamic-slice", "slice", "gather")


@dataclass
class Kernel:
    """One kernel a step launches: what it is, its work, its memory traffic and how often it runs.

    kind: "gemm" (a library matmul, or a fusion around a dot), "pallas" (a Pallas / Triton / Mosaic kernel, named
    in `name`), "library" (another library call: cuDNN attention, sorts), "fusion" (XLA's elementwise / reduce
    kernels), "copy" (copies, slices, in-place updates). matmul_flops run on the matrix units at `precision`
    ("bf16" for 16-bit operands, "tf32" for fp32 at default precision, "f32" for fp32 at HIGHEST), vector_flops
    (elementwise, reductions, transcendentals) on the vector units; bytes = what it reads and writes of device
    memory (a fusion reads the slices of its operands it slices, an in-place update writes its update)."""

    name: str
    kind: str
    matmul_flops: float = 0.0
    vector_flops: float = 0.0
    bytes: float = 0.0
    precision: str = "bf16"
    count: float = 1.0


def _matmul_precision(dtype: str, attrs: str) -> str:
    if dtype in ("bf16", "f16", "f8e4m3fn", "f8e5m2", "s8"):
        return "bf16"
    return "f32" if re.search(r'(?i)"?operand_precision"?[=:]\s*[\[{]"?highest', attrs) else "tf32"


def _instr_flops(ins, ty) -> tuple[float, float, str | None]:
    """(matmul FLOPs, vector FLOPs, matmul precision) of one instruction inside a computation (a fusion's)."""
    op = ins.opcode
    if op == "dot":
        lhs = _arrays(ty.get(ins.operands[0], ""))
        m = re.search(r"lhs_contracting_dims=\{([0-9,]*)\}", ins.attrs)
        k = math.prod(lhs[0][1][int(d)] for d in m.group(1).split(",") if d) if (m and lhs) else 1
        return 2.0 * _elements(ins.type) * k, 0.0, _matmul_precision(lhs[0][0] if lhs else "f32", ins.attrs)
    if op == "convolution":
        rhs = _arrays(ty.get(ins.operands[1], "")) if len(ins.operands) > 1 else []
        return _conv_flops(ins, ty), 0.0, _matmul_precision(rhs[0][0] if rhs else "f32", ins.attrs)
    if op in ELEMENTWISE or op in TRANSCENDENTAL:
        return 0.0, float(_elements(ins.type)), None
    if op == "reduce":
        n_in = sum(_elements(ty.get(o, "")) for o in ins.operands[:max(1, len(ins.operands) // 2)])
        return 0.0, float(max(0, n_in - _elements(ins.type))), None
    return 0.0, 0.0, None


def _read_bytes(name: str, users: dict, ty: dict, depth: int = 0) -> float:
    """Bytes a fusion reads of its parameter `name`: the slices it takes when every use slices it (through
    bitcasts), nothing when it is only the buffer an in-place update writes into, else all of it."""
    us = users.get(name, [])
    if us and depth < 4:
        part = 0.0
        for u in us:
            if u.opcode in _SLICING and u.operands[0] == name:
                part += _bytes(u.type)
            elif u.opcode == "dynamic-update-slice" and u.operands[0] == name:
                continue  # the buffer written in place: only its update moves (`_written_bytes`)
            elif u.opcode == "bitcast":
                part += _read_bytes(u.name, users, ty, depth + 1)
            else:
                return float(_bytes(ty.get(name, "")))
        return part
    return float(_bytes(ty.get(name, "")))


def _written_bytes(ins, by_name: dict, ty: dict) -> float:
    """Bytes a fusion's root writes: an in-place update writes its update, a tuple each element's."""
    if ins.opcode == "dynamic-update-slice" and len(ins.operands) > 1:
        return float(_bytes(ty.get(ins.operands[1], "")))
    if ins.opcode == "tuple":
        return sum(_written_bytes(by_name[o], by_name, ty) if o in by_name else 0.0 for o in ins.operands)
    if ins.opcode == "bitcast" and ins.operands and ins.operands[0] in by_name:
        return _written_bytes(by_name[ins.operands[0]], by_name, ty)
    return float(_bytes(ins.type))


def _fusion_kernel(ins, comps, types) -> Kernel:
    called = [c for c in _called(ins.attrs, "calls") if c in comps]
    mm = vec = 0.0
    prec = None
    kind = "fusion"
    read = written = 0.0
    for c in called:
        body, ty = comps[c], types[c]
        by_name = {i.name: i for i in body}
        users: dict[str, list] = {}
        for i in body:
            for o in i.operands:
                users.setdefault(o, []).append(i)
        for i in body:
            f, v, p = _instr_flops(i, ty)
            mm, vec = mm + f, vec + v
            if p and f:
                prec = p if prec is None or prec == "bf16" else prec
            if i.opcode == "parameter":
                read += _read_bytes(i.name, users, ty)
        root = body[-1] if body else None  # XLA prints a computation's ROOT last
        written += _written_bytes(root, by_name, ty) if root is not None else _bytes(ins.type)
        if not mm and all(i.opcode in ("parameter", "constant", "bitcast", "copy", "transpose", "slice",
                                         "dynamic-slice", "dynamic-update-slice", "concatenate", "pad", "reshape",
                                         "broadcast", "tuple", "get-tuple-element", "iota", "convert", "select",
                                         "compare")
                          for i in body) and any(i.opcode in ("copy", "transpose", "dynamic-slice",
                                                              "dynamic-update-slice", "concatenate", "pad", "slice")
                                                 for i in body):
            kind = "copy"
    if mm:
        kind = "gemm"
    return Kernel(ins.name, kind, mm, vec, read + written, prec or "bf16")


def _custom_kernel(ins, ty) -> Kernel:
    target = re.search(r'custom_call_target="([^"]+)"', ins.attrs)
    target = target.group(1) if target else ""
    operands = [a for o in ins.operands for a in _arrays(ty.get(o, ""))]
    outs = [a for a in _arrays(ins.type) if a[0] not in ("s8", "u8")]  # less cuBLAS' workspace
    nbytes = float(sum(_DTYPE_BYTES[d] * math.prod(s) for d, s in operands + outs))
    if any(f'"{t}"' in f'"{target}"' for t in GEMM_TARGETS):
        lhs = operands[0][0] if operands else "bf16"
        return Kernel(ins.name, "gemm", _gemm_flops(ins, ty), 0.0, nbytes, _matmul_precision(lhs, ins.attrs))
    name = _kernel_name(ins.attrs)
    if name:
        floats = [d for d, _ in operands if d in ("bf16", "f16", "f32")]
        return Kernel(name, "pallas", _kernel_flops(name, ins, ty), 0.0, nbytes,
                      "tf32" if floats and floats[0] == "f32" else "bf16")
    return Kernel(target or ins.name, "library", 0.0, 0.0, nbytes)


def kernels(text: str) -> list[Kernel]:
    """Every kernel one device's step launches (the SPMD module's HLO after optimisation), each with its FLOPs,
    bytes and executions per step (loop bodies times their trip counts; of a conditional, its costliest
    branch). Collectives are left to `analyse`."""
    comps, types, entry = parse_module(text)
    memo: dict[str, list[Kernel]] = {}

    def visit(comp: str) -> list[Kernel]:
        if comp in memo:
            return memo[comp]
        memo[comp] = []
        out: list[Kernel] = []
        ty = types[comp]
        for ins in comps[comp]:
            op = ins.opcode
            if op == "while":
                n = _trip_count(ins.attrs) or _inferred_trip_count(comps, comp, ins) or 1
                for c in _called(ins.attrs, "body") + _called(ins.attrs, "condition"):
                    out += [Kernel(k.name, k.kind, k.matmul_flops, k.vector_flops, k.bytes, k.precision, k.count * n)
                            for k in visit(c)] if c in comps else []
            elif op in ("call", "async-start"):
                for c in _called(ins.attrs, "to_apply") + _called(ins.attrs, "calls"):
                    out += visit(c) if c in comps else []
            elif op == "conditional":
                branches = (_called(ins.attrs, "branch_computations")
                            or _called(ins.attrs, "true_computation") + _called(ins.attrs, "false_computation"))
                costs = [visit(b) for b in branches if b in comps]
                if costs:
                    out += max(costs, key=lambda ks: sum((k.matmul_flops + k.vector_flops + k.bytes) * k.count
                                                         for k in ks))
            elif op in FREE:
                continue
            elif op == "fusion":
                out.append(_fusion_kernel(ins, comps, types))
            elif op == "custom-call":
                out.append(_custom_kernel(ins, ty))
            else:
                f, v, p = _instr_flops(ins, ty)
                nbytes = float(sum(_bytes(ty.get(o, "")) for o in ins.operands) + _bytes(ins.type))
                if op == "dynamic-update-slice" and len(ins.operands) > 1:
                    nbytes = 2.0 * _bytes(ty.get(ins.operands[1], ""))
                kind = "gemm" if f else "copy" if op in ("copy", "transpose", "dynamic-update-slice",
                                                          "dynamic-slice", "slice", "concatenate", "pad") else "fusion"
                out.append(Kernel(ins.name, kind, f, v, nbytes, p or "bf16"))
        memo[comp] = out
        return out

    return visit(entry)


def custom_calls(text: str) -> dict[str, int]:
    """The custom calls of a compiled program: {target, or target:kernel name for Pallas calls: instructions}
    (cuBLAS GEMMs, `__gpu$xla.gpu.triton` calls, Mosaic `tpu_custom_call`s, cuDNN)."""
    out: dict[str, int] = {}
    for line in text.splitlines():
        m = re.search(r'custom_call_target="([^"]+)"', line)
        if not m or " custom-call(" not in line:
            continue
        k = _PALLAS.search(line)
        key = f"{m.group(1)}:{k.group(1)}" if k else m.group(1)
        out[key] = out.get(key, 0) + 1
    return dict(sorted(out.items()))


def cost_analysis_flops(compiled) -> float:
    """XLA's own FLOP count of a compiled program (loop bodies once; 0 where the compiler reports none, e.g. a
    deviceless XLA:GPU compile)."""
    ca = compiled.cost_analysis()
    ca = ca[0] if isinstance(ca, (list, tuple)) and ca else ca
    return float((ca or {}).get("flops", 0.0))


def dumps(cost: HloCost) -> str:
    return json.dumps({"flops": cost.flops, "transcendentals": cost.transcendentals,
                       "collective_bytes": cost.collective_bytes()})
