"""The memory traffic of a compiled program, read from its optimized HLO text: the bytes each op reads and writes,
loops counted by their trip counts (XLA's own cost analysis counts a `while` body once, gives opaque custom calls
such as cuBLAS GEMMs and Pallas kernels no bytes at all, and charges an in-place scatter or a gather the whole
buffer it indexes: a decode step's KV-cache write and embedding lookup then count the whole cache and table).

Per op (in the entry computation, loop bodies, conditional branches and calls; not inside fusions):
* a fusion reads each operand whole, except one used inside only as the indexed operand of slices, dynamic
  slices and gathers (it reads what they take) or as the buffer an in-place dynamic-update-slice / scatter writes
  into (it reads and writes the update's bytes there); it writes its outputs (an in-place root: the update);
* a custom call reads its operands and writes its first result (a cuBLAS / cuDNN workspace is scratch);
* the same rules for unfused slices, gathers, dynamic-update-slices and scatters; any other op reads its operands
  and writes its result. Parameters, constants, tuples, get-tuple-element and bitcasts move nothing.
A `while` counts trip count x (body + condition) (`unknown_trips` where XLA did not annotate one), a conditional
its costliest branch.

`traffic(text)` -> Traffic(bytes, per-op rows); `hbm_seconds(bytes, bandwidth)` the memory-bound time.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field

from nemo_jax.plan.hlo import _arrays, _bytes, _called, _trip_count, parse_module

_FREE = {"parameter", "constant", "tuple", "get-tuple-element", "bitcast", "after-all", "partition-id",
         "replica-id", "opt-barrier", "iota"}
_INDEXED = {"slice", "dynamic-slice", "gather"}  # read only what they take from operand 0
_IN_PLACE = {"dynamic-update-slice", "scatter"}  # write only their update into operand 0
_SCRATCH_TARGETS = ("__cublas", "__cudnn")


@dataclass
class Traffic:
    bytes: float = 0.0
    by_op: Counter = field(default_factory=Counter)  # (opcode, op_name) -> bytes, loops counted

    def top(self, n: int = 10) -> list[tuple[str, str, float]]:
        return [(op, name, b) for (op, name), b in self.by_op.most_common(n)]


def _first_array_bytes(type_str: str) -> int:
    a = _arrays(type_str)
    if not a:
        return 0
    d, shape = a[0]
    return _bytes(f"{d}[{','.join(map(str, shape))}]")


def _update_bytes(ins, types: dict) -> int:
    """The bytes an in-place dynamic-update-slice / scatter writes: its update operand."""
    k = 1 if ins.opcode == "dynamic-update-slice" else 2
    return _bytes(types.get(ins.operands[k], "")) if len(ins.operands) > k else 0


def _fusion_bytes(ins, comps, types, comp: str) -> float:
    fused = _called(ins.attrs, "calls")
    if not fused or fused[0] not in comps:
        return sum(_bytes(types[comp].get(o, "")) for o in ins.operands) + _bytes(ins.type)
    body, fty = comps[fused[0]], types[fused[0]]
    params = {}  # fused parameter name -> operand index
    for i in body:
        if i.opcode == "parameter":
            m = re.match(r"\s*(\d+)", i.literal)
            if m:
                params[i.name] = int(m.group(1))
    users: dict[str, list] = {}
    for i in body:
        for o in i.operands:
            users.setdefault(o, []).append(i)
    by_name = {i.name: i for i in body}
    root = body[-1] if body else None
    roots = [by_name.get(o) for o in root.operands] if root is not None and root.opcode == "tuple" else [root]
    total = 0.0
    in_place_params = set()
    for r in roots:  # outputs: an in-place root writes its update only
        if r is None:
            continue
        if r.opcode in _IN_PLACE and r.operands and r.operands[0] in params:
            total += _update_bytes(r, fty)
            in_place_params.add(r.operands[0])
        else:
            total += _bytes(r.type)
    for pname, idx in params.items():
        if idx >= len(ins.operands):
            continue
        full = _bytes(types[comp].get(ins.operands[idx], ""))
        us = users.get(pname, [])
        if us and all((u.opcode in _INDEXED and u.operands[0] == pname) or
                      (u.opcode in _IN_PLACE and u.operands[0] == pname) for u in us):
            total += sum(_bytes(u.type) if u.opcode in _INDEXED else _update_bytes(u, fty) for u in us)
        else:
            total += full
    return total


def _op_bytes(ins, comps, types, comp: str) -> float:
    ty = types[comp]
    if ins.opcode == "fusion":
        return _fusion_bytes(ins, comps, types, comp)
    if ins.opcode == "custom-call":
        out = _first_array_bytes(ins.type) if any(t in ins.attrs for t in _SCRATCH_TARGETS) else _bytes(ins.type)
        return sum(_bytes(ty.get(o, "")) for o in ins.operands) + out
    if ins.opcode in _INDEXED:
        return 2 * _bytes(ins.type) + sum(_bytes(ty.get(o, "")) for o in ins.operands[1:])
    if ins.opcode in _IN_PLACE:
        upd = _update_bytes(ins, ty)
        return 2 * upd + sum(_bytes(ty.get(o, "")) for o in ins.operands[1:]) - upd
    return sum(_bytes(ty.get(o, "")) for o in ins.operands) + _bytes(ins.type)


def traffic(text: str, unknown_trips: int = 1) -> Traffic:
    """The bytes one execution of the program (optimized HLO text) reads and writes (see the module docstring)."""
    comps, types, entry = parse_module(text)
    out = Traffic()
    memo: dict[str, tuple[float, Counter]] = {}

    def visit(comp: str) -> tuple[float, Counter]:
        if comp in memo:
            return memo[comp]
        memo[comp] = (0.0, Counter())  # recursion guard
        total, rows = 0.0, Counter()

        def add(sub: tuple[float, Counter], mult: float = 1.0):
            nonlocal total
            total += mult * sub[0]
            for k, v in sub[1].items():
                rows[k] += mult * v
        for ins in comps[comp]:
            if ins.opcode == "while":
                n = _trip_count(ins.attrs) or unknown_trips
                for key in ("body", "condition"):
                    for b in _called(ins.attrs, key):
                        if b in comps:
                            add(visit(b), n)
            elif ins.opcode == "conditional":
                branches = [visit(b) for key in ("branch_computations", "true_computation", "false_computation")
                            for b in _called(ins.attrs, key) if b in comps]
                if branches:
                    add(max(branches, key=lambda x: x[0]))
            elif ins.opcode == "call":
                for b in _called(ins.attrs, "to_apply"):
                    if b in comps:
                        add(visit(b))
            elif ins.opcode not in _FREE:
                b = _op_bytes(ins, comps, types, comp)
                meta = re.search(r'op_name="([^"]*)"', ins.attrs)
                total += b
                rows[(ins.opcode, (meta.group(1) if meta else "").rsplit("/", 1)[-1])] += b
        memo[comp] = (total, rows)
        return memo[comp]

    out.bytes, out.by_op = visit(entry)
    return out


def hbm_seconds(nbytes: float, bandwidth: float) -> float:
    """The time to move `nbytes` at `bandwidth` bytes/s (the memory-bound floor of a step)."""
    return nbytes / bandwidth
