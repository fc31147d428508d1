"""Where the train step of `bench/train_step.py` spends its time on XLA:CPU, by source line.

    python bench/profile_step.py [--seq 1024 --top 40]

Runs the step under `jax.profiler.trace` with XLA's per-thunk trace events on, and attributes every thunk's time
to the innermost nemo_jax source line that made it (through the compiled HLO's op metadata and stack frames),
forward or backward (an op under `transpose(...)`). Thread time: each of XLA's worker threads counts its own
thunks, so the totals exceed the wall time when thunks run side by side; a matmul split over threads counts
once. Control flow (while / conditional thunks) is skipped in favour of the thunks it runs.
"""

import argparse
import collections
import glob
import os
import re
import tempfile

import common

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_cpu_enable_xprof_traceme=true").strip()

import jax  # noqa: E402

from nemo_jax.plan.hlo import parse_module  # noqa: E402

from train_step import bench_config, build  # noqa: E402


def source_of_ops(hlo: str) -> dict[str, tuple[str, str]]:
    """Compiled HLO text -> {instruction name: (op name, "file:line function" of its innermost frame)}, None
    for control flow (while / conditional / call), whose nested thunks are counted themselves."""
    tables, cur = {}, None
    for line in hlo.splitlines():
        if line in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
            cur, tables[line] = line, {}
        elif cur and re.match(r"^\d+ ", line):
            i, rest = line.split(" ", 1)
            tables[cur][int(i)] = rest
        elif cur and not line.strip():
            cur = None
    field = lambda v, k: int(re.search(rf"{k}=(\d+)", v).group(1))  # noqa: E731
    files = {k: os.path.basename(v.strip('"')) for k, v in tables.get("FileNames", {}).items()}
    funcs = {k: v.strip('"') for k, v in tables.get("FunctionNames", {}).items()}
    locs = {k: f"{files[field(v, 'file_name_id')]}:{field(v, 'line')} {funcs[field(v, 'function_name_id')]}"
            for k, v in tables.get("FileLocations", {}).items()}
    frames = {k: locs[field(v, "file_location_id")] for k, v in tables.get("StackFrames", {}).items()}
    ops = {}
    for ins in (i for instrs in parse_module(hlo)[0].values() for i in instrs):
        meta = re.search(r"metadata=\{([^}]*)\}", ins.attrs)
        if ins.opcode in ("while", "conditional", "call"):
            ops[ins.name] = None  # control flow: the thunks it runs count instead
        elif meta:
            name = re.search(r'op_name="([^"]*)"', meta.group(1))
            frame = re.search(r"stack_frame_id=(\d+)", meta.group(1))
            ops[ins.name] = (name.group(1) if name else "", frames.get(int(frame.group(1)), "?") if frame else "?")
    return ops


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=2, help="profiled steps (after 5 warm-up steps)")
    ap.add_argument("--top", type=int, default=40)
    a = ap.parse_args()
    cfg = bench_config()
    step, params, opt, batch, _ = build(cfg, a.batch, a.seq)
    ops = source_of_ops(step.lower(params, opt, batch).compile().as_text())
    state = [params, opt]

    def run():
        p, o, loss = step(state[0], state[1], batch)
        jax.block_until_ready(loss)
        state[0], state[1] = p, o

    for _ in range(5):
        run()
    wall = common.timeit(run, warmup=0, iters=1)
    with tempfile.TemporaryDirectory() as d:
        jax.profiler.start_trace(d)
        for _ in range(a.steps):
            run()
        jax.profiler.stop_trace()
        trace = jax.profiler.ProfileData.from_file(glob.glob(f"{d}/**/*.xplane.pb", recursive=True)[0])
    by_line, by_file = collections.Counter(), collections.Counter()
    for plane in trace.planes:
        for line in plane.lines:
            if not line.name.startswith("tf_XLAEigen"):  # XLA's worker threads
                continue
            for ev in line.events:
                if ev.name.startswith(("ThunkExecutor", "Slinky")) or (ev.name in ops and ops[ev.name] is None):
                    continue
                op_name, src = ops.get(ev.name) or (re.sub(r"\.\d+$", "", ev.name), "? (no metadata)")
                pas = "bwd" if "transpose(" in op_name else "fwd"
                by_line[(src, pas, op_name.rsplit("/", 1)[-1])] += ev.duration_ns / a.steps / 1e6
                by_file[(src.split(":")[0], pas)] += ev.duration_ns / a.steps / 1e6
    print(f"train step, pattern {cfg.pattern}, batch {a.batch} x seq {a.seq}: {wall:.3f} s wall (untraced); "
          f"thunk time per step {sum(by_file.values()):,.0f} ms over the worker threads")
    common.table([{"file": f, "pass": p, "ms/step": f"{v:.1f}"} for (f, p), v in by_file.most_common()])
    common.table([{"source": s, "pass": p, "op": o, "ms/step": f"{v:.1f}"}
                  for (s, p, o), v in by_line.most_common(a.top)])


if __name__ == "__main__":
    main()
