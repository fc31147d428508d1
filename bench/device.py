"""One device bench for whatever accelerator this process has (GPU first): the SFT step of a ~1B-parameter hybrid
MoE of the Nemotron-H family with kernels auto vs reference, the LoRA learner step, sampler decode at batch 64 and
an SFT step at Nemotron 3 Nano's real layer widths (fewer layers), each next to the plan's estimate of the same
compiled program. Prints one table; `--out DIR` also writes it as DIR/device_bench.json (device, date, commit, every
row's figures) and DIR/device_bench.md.

    python bench/device.py --out /tmp/device_bench            # on the GPU / TPU host (< 10 min on an H200)
    python bench/device.py --tiny --out /tmp/device_bench     # toy size, any machine (CPU included)
    python bench/device.py --dry-run --out /tmp/dry            # compile every program for a deviceless H200 here
    python bench/device.py --dry-run --fit                     # + the table's fitted share, from the recorded SFT row

Rows (columns: docs/performance.md, "Device bench"):
  sft_step kernels=auto | reference   full SFT step (forward, backward, clipping, AdamW; fp32 master weights,
                                      bf16 compute, packed documents), the platform's kernels vs plain jnp
  lora_step r16                       the LoRA learner step (rank 16 on every target, bf16 frozen base; remat
                                      `--lora-remat`, default save_frozen: the base's projections not recomputed),
                                      and the same with the full step's remat (`--remat`)
  sampler decode (batch 64)           nemo_jax.generate at batch 64 (prefill + sampled decode), tokens/s of decode
  nano3 widths (MEM*E)                the SFT step at Nemotron 3 Nano's layer widths (hidden 2688, 128 experts of
                                      1856, top-6, 64 Mamba heads, 32 query heads), five layers
  ... (as measured)                   with --dry-run (or where git history is at hand): the programs of the
                                      recorded H200 run (RECORDED), compiled from the code of the commit that was
                                      measured (bench/recorded.py), next to their measured step times
Plan columns: the same compiled program's memory (what a deviceless compile for this target reports) and the
plan's step time (nemo_jax.plan.roofline: each kernel of the compiled program at max(FLOPs / achievable FLOP/s,
bytes / achievable bandwidth, launch), the table of achievable shares `ACHIEVABLE`).

Compiles go to a persistent cache (DIR/xla_cache, else /tmp/nemo_jax_device_bench_cache), so a rerun skips
them. The script imports only jax, optax, numpy, yaml and nemo_jax's model / train-step / generate / plan modules
(no grain, array-record or tensorboardX) and says what is missing if an import fails.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

NEEDED = ("jax", "numpy", "optax", "yaml", "ml_dtypes")
GiB = 1024 ** 3

# The recorded run (docs/performance.md, "Device bench": one H200, jax 0.11.2) and the commit whose code it ran: its
# rows are recompiled from that code (`bench/recorded.py`) so the plan is checked on the programs that were timed.
# The table's shares are fitted on at most FIT_ROWS (`--fit`); the others are predictions.
RECORDED = {"commit": "06b0d16", "device_kind": "h200", "date": "2026-12-04", "jax": "0.11.2",
            "rows": {"sft_auto": ("sft_step kernels=auto", 0.3472), "sft_reference": ("sft_step kernels=reference",
                                                                                      0.5654),
                     "lora": ("lora_step r16", 0.3460), "decode": ("sampler decode (batch 64)", 0.0064)}}
FIT_ROWS = ("sft_auto",)  # the table's one fitted entry, `pallas`, comes from this row (nemo_jax.plan.roofline)
PLAN_TOLERANCE = 0.25  # the plan's step time against a measurement: within 25%


def _check_imports():
    import importlib.util

    missing = [m for m in NEEDED if importlib.util.find_spec(m) is None]
    if missing:
        sys.exit(f"bench/device.py: missing Python packages: {', '.join(missing)} (pip install them)")


def bench_config(tiny: bool):
    """~1.04B parameters (0.55B active per token): hidden 1536, ("MEM*E") x 5 = 10 Mamba, 10 MoE (16 experts,
    top-4, 768 wide, one shared expert), 5 attention layers (16 heads of 128, 2 KV heads), vocab 131072.
    10 units: the layer stack compiles as a scan (flat compile time). --tiny: the same pattern at toy width."""
    from nemo_jax.config.model import NemotronHConfig, parse_pattern

    if tiny:
        return NemotronHConfig(vocab_size=512, hidden_size=64, layer_kinds=parse_pattern("MEM*E" * 2),
                               num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=128,
                               mamba_num_heads=4, mamba_head_dim=16, ssm_state_size=16, n_groups=2, chunk_size=16,
                               n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                               moe_shared_expert_intermediate_size=64, routed_scaling_factor=2.5)
    return NemotronHConfig(vocab_size=131072, hidden_size=1536, layer_kinds=parse_pattern("MEM*E" * 5),
                           num_attention_heads=16, num_key_value_heads=2, head_dim=128, intermediate_size=3072,
                           mamba_num_heads=48, mamba_head_dim=64, ssm_state_size=128, n_groups=8, chunk_size=128,
                           n_routed_experts=16, num_experts_per_tok=4, moe_intermediate_size=768,
                           moe_shared_expert_intermediate_size=1536, routed_scaling_factor=2.5)


NANO_PATTERN = "MEM*E"


def nano_config(tiny: bool):
    """Nemotron 3 Nano 30B-A3B's layers at their real widths (hidden 2688, 64 Mamba heads of 64 with state 128
    in 8 groups, 128 routed experts of 1856 with top-6 and a 3712-wide shared expert, 32 query heads of 128 over
    2 KV heads, vocab 131072), NANO_PATTERN (5 layers) instead of 52: ~3.4B parameters. --tiny: the bench's toy
    model."""
    import dataclasses

    from nemo_jax.config.model import NemotronHConfig, parse_pattern
    from nemo_jax.train.sft import model_config_path

    if tiny:
        return bench_config(True)
    cfg = NemotronHConfig.from_file(model_config_path("nano3-30b-a3b"))
    return dataclasses.replace(cfg, layer_kinds=parse_pattern(NANO_PATTERN))


def _packed_batch(rng, vocab: int, B: int, T: int):
    """Random tokens in packed documents (lengths T/8 .. T/2, the last one cut at the row's end)."""
    import numpy as np

    seg = np.zeros((B, T), np.int32)
    for r in range(B):
        t, d = 0, 1
        while t < T:
            n = int(rng.integers(T // 8, T // 2 + 1))
            seg[r, t:t + n] = d
            t, d = t + n, d + 1
    toks = rng.integers(3, vocab, (B, T + 1)).astype(np.int32)
    return {"tokens": toks[:, :-1], "targets": toks[:, 1:], "loss_mask": np.ones((B, T), bool), "segment_ids": seg}


def plan_kind(device, dry_kind: str | None = None):
    """The plan's DeviceKind of this device (`nemo_jax.plan.plan.DEVICE_KINDS`; None where it has none: CPUs)."""
    from nemo_jax.plan.plan import DEVICE_KINDS

    if dry_kind:
        return DEVICE_KINDS[dry_kind]
    name = device.device_kind.lower()
    for key in ("h200", "h100", "b200"):
        if key in name:
            return DEVICE_KINDS[key]
    for gen in ("v5p", "v5e", "v6e"):
        if gen in name.replace(" ", "").replace("lite", "e"):
            return DEVICE_KINDS[f"tpu-{gen}"]
    return None


def hlo_figures(text: str, kind) -> dict:
    """The plan's figures of one compiled program (its HLO text) on `kind`: FLOPs (loops counted), bytes,
    kernels launched, the per-kernel roofline's step time and its split, the HBM-bound time of its bytes and its
    custom calls."""
    from nemo_jax.plan.plan import time_of_hlo

    if kind is None:
        from nemo_jax.plan.hlo import analyse, custom_calls

        return {"hlo_flops": analyse(text, 1).flops, "custom_calls": custom_calls(text)}
    t = time_of_hlo(text, 1, kind)
    return {"hlo_flops": t["flops"], "plan_bytes": t["bytes"], "plan_kernels": t["kernel_count"],
            "plan_step_s": t["step_time_s"]["with_overlap"], "hbm_bound_s": t["bytes"] / kind.hbm,
            "plan_s_by_kind": t["kernels"]["by_kind"], "plan_s_by_bound": t["kernels"]["bound"],
            "custom_calls": t["custom_calls"]}


class Bench:
    """The programs of the table. Each row is prepared (inputs' shapes, the program lowered: Python, in this
    thread), compiled (in a thread pool: the rows' XLA compiles overlap), then run one row at a time."""

    def __init__(self, a):
        import jax
        from jax.sharding import Mesh

        self.a = a
        self.cfg = bench_config(a.tiny)
        self.t0 = time.perf_counter()
        if a.dry_run:
            from nemo_jax.plan.targets import get_topology

            self.device = get_topology("gpu", a.device_kind, 1)[0]
        else:
            self.device = jax.devices()[0]
        self.mesh = Mesh([self.device], ("data",))  # what the programs are compiled for (its platform: kernels)
        self.kind = plan_kind(self.device, a.device_kind if a.dry_run else None)

    # ----------------------------------------------------------------------------- helpers
    def left_s(self) -> float:
        return self.a.budget_s - (time.perf_counter() - self.t0)

    def spec(self, tree):
        """ShapeDtypeStructs of a tree's leaves, placed on the device (what programs are lowered with)."""
        import jax
        from jax.sharding import SingleDeviceSharding

        sh = SingleDeviceSharding(self.device)
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh), tree)

    def peak(self) -> float | None:
        """Dense bf16 FLOP/s of the device (None for CPUs: no MFU)."""
        from nemo_jax.train.metrics import device_peak_flops

        return device_peak_flops(self.device)

    def figures(self, compiled, name: str | None = None) -> dict:
        """The plan's figures of a compiled program: its memory (arguments + temporaries + unaliased outputs,
        as a deviceless compile for this device reports it) and `hlo_figures` of its HLO (written to
        `--hlo-dir`/NAME.hlo when given)."""
        if self.a.hlo_dir and name:
            os.makedirs(self.a.hlo_dir, exist_ok=True)
            with open(os.path.join(self.a.hlo_dir, name.replace(" ", "_").replace("/", "-") + ".hlo"), "w") as f:
                f.write(compiled.as_text())
        mem = compiled.memory_analysis()
        total = (mem.argument_size_in_bytes + mem.temp_size_in_bytes
                 + max(0, mem.output_size_in_bytes - mem.alias_size_in_bytes))
        return {"plan_gib": total / GiB, "plan_temp_gib": mem.temp_size_in_bytes / GiB,
                **hlo_figures(compiled.as_text(), self.kind)}

    @staticmethod
    def timed(run, warmup: int, iters: int) -> float:
        """Median seconds of run() (which blocks) after `warmup` untimed calls. (bench/common.timeit's loop: that
        module is not imported here, it sets XLA:CPU flags and the host allocator when imported.)"""
        for _ in range(warmup):
            run()
        ts = []
        for _ in range(iters):
            t = time.perf_counter()
            run()
            ts.append(time.perf_counter() - t)
        return sorted(ts)[len(ts) // 2]

    def memory(self) -> float | None:
        stats = None if self.a.dry_run else self.device.memory_stats()
        return stats["peak_bytes_in_use"] / GiB if stats and "peak_bytes_in_use" in stats else None

    # ----------------------------------------------------------------------------- rows
    def train_step(self, name: str, kernels: str, lora_rank: int = 0, cfg=None, remat: str | None = None,
                   batch: int | None = None):
        """The trainer's step (nemo_jax.train.step.make_train_step) on a packed batch: full SFT (fp32 params) or
        LoRA (adapters trained, base frozen in bf16). -> (row, compile(), run())."""
        import jax
        import jax.numpy as jnp
        import numpy as np

        from nemo_jax import kernels as kernels_lib
        from nemo_jax.config.train import OptimSection
        from nemo_jax.lora import LoraConfig, attach, init_adapters
        from nemo_jax.model import Options, init
        from nemo_jax.train.metrics import model_flops_per_token
        from nemo_jax.train.optimizer import make_optimizer
        from nemo_jax.train.step import TrainState, make_train_step

        a = self.a
        cfg = cfg or self.cfg
        B, T = batch or a.batch, a.seq
        opts = Options(dtype=jnp.bfloat16, remat=remat or a.remat, kernels=kernels_lib.resolve(kernels, self.mesh))
        o = OptimSection(lr=1e-5, bias_update_rate=0.0)
        lcfg = LoraConfig(targets=("all",), rank=lora_rank, alpha=2.0 * lora_rank) if lora_rank else None
        combine = (lambda ad, base: attach(base, ad)) if lora_rank else None  # noqa: E731
        new_trainable = (lambda: init_adapters(cfg, lcfg)) if lora_rank else (lambda: init(cfg, jax.random.key(0)))
        tx, sched = make_optimizer(o, jax.eval_shape(new_trainable), 1000)

        def make():
            trainable = new_trainable()
            z = lambda: jnp.zeros((), jnp.int32)  # noqa: E731  (three buffers: the state is donated)
            state = TrainState(trainable, tx.init(trainable), z(), z(), z(), jax.random.key_data(jax.random.key(1)))
            frozen = (jax.tree.map(lambda x: x.astype(jnp.bfloat16), init(cfg, jax.random.key(0))) if lora_rank
                      else None)
            return state, frozen, {k: jnp.asarray(v) for k, v in _packed_batch(np.random.default_rng(0),
                                                                                cfg.vocab_size, B, T).items()}

        state, frozen, batch_spec = self.spec(jax.eval_shape(make))
        lowered = jax.jit(make_train_step(cfg, opts, tx, sched, o, 1, combine), donate_argnums=0).lower(
            state, batch_spec, frozen)
        tokens = B * T
        model_flops = model_flops_per_token(cfg, T) * tokens
        row = {"row": name, "kernels": opts.kernels, "remat": opts.remat, "tokens_per_step": tokens,
               "model_flops": model_flops}
        held = {}

        def compile_():
            t = time.perf_counter()
            held["compiled"] = lowered.compile()
            row.update(compile_s=time.perf_counter() - t, **self.figures(held["compiled"], name))

        def run():
            compiled, peak = held.pop("compiled"), self.peak()
            state, frozen, batch = jax.device_put(make(), self.device)
            holder = [state]

            def step():
                s, m = compiled(holder[0], batch, frozen)
                jax.block_until_ready(m["loss"])
                holder[0] = s

            step_s = self.timed(step, a.warmup, a.iters)
            row.update(step_s=step_s, tokens_per_s=tokens / step_s, peak_gib=self.memory(),
                       mfu=model_flops / step_s / peak if peak else None)

        return row, compile_, run

    def sampler(self):
        """nemo_jax.generate at batch `--rollouts` (bf16 weights, kernels auto): prefill then sampled decode;
        tokens/s of the decode loop, next to the plan's figures of the program the loop runs per token
        (`decode_program`). -> (row, compile(), run())."""
        import jax
        import jax.numpy as jnp
        import numpy as np

        from nemo_jax.generate import decode as G
        from nemo_jax import kernels as kernels_lib
        from nemo_jax.model import Options, init
        from nemo_jax.train.metrics import model_flops_per_token

        cfg, a = self.cfg, self.a
        opts = Options(dtype=jnp.bfloat16, kernels=kernels_lib.resolve("auto", self.mesh))
        rows, prompt, new = a.rollouts, a.prompt, a.new_tokens
        width = -(-prompt // 32) * 32
        new_params = lambda: jax.tree.map(lambda x: x.astype(jnp.bfloat16), init(cfg, jax.random.key(0)))  # noqa: E731
        sp = G.SamplingParams(max_new_tokens=new, temperature=1.0)
        lowered = decode_program(self, cfg, opts, sp, rows, width + new, new_params)
        row = {"row": f"sampler decode (batch {rows})", "kernels": opts.kernels, "tokens_per_step": rows,
               "model_flops": model_flops_per_token(cfg, width + new) / 3 * rows}  # a token per row, forward only
        rng = np.random.default_rng(0)
        lengths = rng.integers(prompt // 2, prompt + 1, rows)
        prompts = [rng.integers(3, cfg.vocab_size, int(n)).tolist() for n in lengths]
        held = {}

        def prefill():
            logits, state = G.prefill(held["params"], prompts, cfg, width + new, opts=opts, width=width)
            return jax.block_until_ready(logits), state

        def decode(i, logits, state):  # generate() continuing a prefilled state: the decode loop alone
            return G.generate(held["params"], prompts, cfg, sp, key=jax.random.key(i), opts=opts, state=state,
                              last_logits=logits)

        def compile_():
            t = time.perf_counter()
            row.update(self.figures(lowered.compile(), row["row"]))  # the per-token program
            if not a.dry_run:  # generate's own programs (prefill, decode and sample), compiled by a first run
                held["params"] = jax.device_put(new_params(), self.device)
                decode(0, *prefill())
            row["compile_s"] = time.perf_counter() - t

        def run():
            t = time.perf_counter()
            logits, state = prefill()
            prefill_s = time.perf_counter() - t
            t = time.perf_counter()
            g = decode(1, logits, state)  # ends with the tokens on the host: every step is done
            decode_s = time.perf_counter() - t
            held.clear()
            row.update(step_s=decode_s / new, tokens_per_s=sum(len(x) for x in g.tokens) / decode_s,
                       prefill_s=prefill_s, peak_gib=self.memory())

        return row, compile_, run


def decode_program(bench: Bench, cfg, opts, sp, rows: int, max_len: int, new_params):
    """The program generate()'s decode loop runs per token, lowered for `rows` rows of a `max_len` state: sample
    from the last logits, append the token (`generate._decode_and_sample`)."""
    import jax
    import jax.numpy as jnp

    from nemo_jax.generate import decode as G
    from nemo_jax.model.cache import state_shapes

    params = bench.spec(jax.eval_shape(new_params))
    state = bench.spec(state_shapes(cfg, rows, max_len, opts.dtype))
    logits, done = bench.spec((jax.ShapeDtypeStruct((rows, cfg.vocab_size), jnp.float32),
                               jax.ShapeDtypeStruct((rows,), jnp.bool_)))
    key = bench.spec(jax.eval_shape(lambda: jax.random.key(1)))
    return G._decode_and_sample.lower(params, logits, state, done, key, cfg=cfg, opts=opts, sp=sp)


# ----------------------------------------------------------------------------- the recorded run's programs
def git_commit(root: str = ROOT) -> str | None:
    try:
        return subprocess.run(["git", "-C", root, "rev-parse", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def recorded_rows(kind, device_kind: str, cache: str | None = None, hlo_dir: str | None = None) -> list[dict]:
    """The recorded run's programs compiled from the code of RECORDED["commit"] (extracted with `git archive`,
    compiled by bench/recorded.py in a process of its own for a deviceless `device_kind`), each with its
    measured step time, the plan's and their ratio. Without the git history: one row saying so."""
    names = list(RECORDED["rows"])
    with tempfile.TemporaryDirectory(prefix="nemo_jax_recorded-") as tmp:
        tree, out = os.path.join(tmp, "tree"), hlo_dir or os.path.join(tmp, "hlo")
        os.makedirs(tree)
        try:
            archive = subprocess.run(["git", "-C", ROOT, "archive", RECORDED["commit"]], capture_output=True,
                                     check=True).stdout
            subprocess.run(["tar", "-x", "-C", tree], input=archive, check=True)
        except (OSError, subprocess.CalledProcessError) as e:
            return [{"row": f"{RECORDED['rows'][n][0]} (as measured)", "error": f"no git history of "
                     f"{RECORDED['commit']} here ({type(e).__name__}): the recorded rows need it"} for n in names]
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        env["JAX_PLATFORMS"] = "cpu"
        p = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "recorded.py"), tree, out, *names,
                            "--device-kind", device_kind] + (["--cache", cache] if cache else []), env=env,
                           capture_output=True, text=True)
        rows = []
        for n in names:
            label, measured = RECORDED["rows"][n]
            row = {"row": f"{label} (as measured)", "recorded": n, "kernels": "auto" if n != "sft_reference"
                   else "reference", "measured_step_s": measured, "commit": RECORDED["commit"]}
            path = os.path.join(out, f"{n}.hlo")
            if not os.path.exists(path):
                tail = (p.stderr.strip().splitlines() or [f"exit {p.returncode}"])[-1]
                row["error"] = f"bench/recorded.py: {tail[:300]}"
                rows.append(row)
                continue
            with open(path) as f:
                text = f.read()
            with open(os.path.join(out, f"{n}.json")) as f:
                mem = json.load(f)
            row.update(plan_gib=(mem["argument_bytes"] + mem["temp_bytes"]
                                 + max(0, mem["output_bytes"] - mem["alias_bytes"])) / GiB,
                       compile_s=mem["compile_s"], **hlo_figures(text, kind))
            row["hlo"] = text  # for --fit; dropped before the JSON is written
            rows.append(row)
        return rows


def fit_table(rows: list[dict], kind) -> dict:
    """The table's fitted entry from the recorded rows: `pallas` (the share of the peak the Pallas kernels reach)
    so that the plan of FIT_ROWS' program equals its measured time, every other entry as the table has it. ->
    {"pallas", "rows": {row: plan step s with it}} (every recorded row: those not in FIT_ROWS are predictions)."""
    import dataclasses

    from nemo_jax.plan.hlo import kernels
    from nemo_jax.plan.roofline import ACHIEVABLE, fit_share, kernels_time

    by = {r["recorded"]: r for r in rows if "hlo" in r}
    ks = {n: kernels(r["hlo"]) for n, r in by.items()}
    a = ACHIEVABLE[kind.key]
    (row,) = FIT_ROWS
    a = dataclasses.replace(a, pallas=fit_share(ks[row], kind, a, "pallas", by[row]["measured_step_s"]))
    return {"pallas": a.pallas, "rows": {n: kernels_time(k, kind, a)["total"] for n, k in ks.items()}}


# ----------------------------------------------------------------------------- the table
COLUMNS = (("row", "row", "{}"), ("kernels", "kernels", "{}"), ("tokens/s", "tokens_per_s", "{:,.0f}"),
           ("step s", "step_s", "{:.4f}"), ("measured s", "measured_step_s", "{:.4f}"), ("MFU", "mfu", "{:.1%}"),
           ("peak GiB", "peak_gib", "{:.2f}"), ("plan GiB", "plan_gib", "{:.2f}"),
           ("plan step s", "plan_step_s", "{:.4f}"), ("plan / measured", "plan_ratio", "{:.2f}"),
           ("HLO TFLOP", "hlo_tflop", "{:.1f}"), ("GB moved", "plan_gb", "{:.1f}"),
           ("HBM-bound s", "hbm_bound_s", "{:.4f}"), ("kernels", "plan_kernels", "{:,.0f}"),
           ("compile s", "compile_s", "{:.0f}"),
           # the engine decode row (bench/decode_row.py): memory traffic per decode step and its ratio to the bytes of
           # the parameters + decode state (its time at the HBM bandwidth is the HBM-bound column)
           ("GiB/step", "traffic_gib_per_step", "{:.2f}"), ("/ (params+state)", "bytes_ratio", "{:.2f}x"))



def _cell(row: dict, key: str, fmt: str) -> str:
    v = row.get(key)
    if v is None:
        return row.get("error", "")[:60] if key == "kernels" and "error" in row else "-"
    return fmt.format(v)


def finish_rows(rows: list[dict]) -> None:
    """Derived columns: TFLOP and GB of the HLO, and the plan against the time measured (this run's, or the
    recorded run's)."""
    for r in rows:
        if "hlo_flops" in r:
            r["hlo_tflop"] = r["hlo_flops"] / 1e12
        if "plan_bytes" in r:
            r["plan_gb"] = r["plan_bytes"] / 1e9
        measured = r.get("step_s") or r.get("measured_step_s")
        if measured and r.get("plan_step_s"):
            r["plan_ratio"] = r["plan_step_s"] / measured
        if r.get("plan_step_s") and r.get("tokens_per_step"):
            r["plan_tokens_per_s"] = r["tokens_per_step"] / r["plan_step_s"]


def markdown(rows: list[dict], head: str) -> str:
    out = [head, "", "| " + " | ".join(c for c, _, _ in COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    out += ["| " + " | ".join(_cell(r, k, f) for _, k, f in COLUMNS) + " |" for r in rows]
    errors = [f"- {r['row']}: {r['error']}" for r in rows if "error" in r]
    notes = ["", "plan step: each kernel of the compiled program at max(FLOPs / achievable FLOP/s, bytes / achievable "
             "bandwidth, launch) (nemo_jax.plan.roofline); measured s: the recorded run's step time "
             f"({RECORDED['device_kind']}, {RECORDED['date']}, commit {RECORDED['commit']})"]
    return "\n".join(out + (["", "errors:"] + errors if errors else []) + notes)


def main():
    _check_imports()
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", help="directory for device_bench.json / .md and the compilation cache")
    ap.add_argument("--tiny", action="store_true", help="toy sizes (CPU)")
    ap.add_argument("--dry-run", action="store_true", help="compile every program for a deviceless GPU (no run)")
    ap.add_argument("--device-kind", default="h200", help="the deviceless GPU of --dry-run (h100 | h200 | b200)")
    ap.add_argument("--seq", type=int, help="tokens per row (default 4096; --tiny 64)")
    ap.add_argument("--batch", type=int, help="rows per step (default 4; --tiny 2)")
    ap.add_argument("--nano-batch", type=int, help="rows per step of the Nano-widths row (default 2; --tiny 2)")
    ap.add_argument("--remat", default=None, help="none | layer | save_matmuls | save_frozen (default layer; "
                    "--tiny none)")
    ap.add_argument("--lora-remat", default="save_frozen", help="the LoRA row's remat (default save_frozen: its "
                    "frozen base's matmul outputs kept, not recomputed)")
    ap.add_argument("--lora-rank", type=int, default=16)
    ap.add_argument("--rollouts", type=int, default=None, help="sampler rows (default 64; --tiny 8)")
    ap.add_argument("--prompt", type=int, default=None, help="sampler prompt tokens (default 512; --tiny 16)")
    ap.add_argument("--new-tokens", type=int, default=None, help="sampled tokens per row (default 256; --tiny 8)")
    ap.add_argument("--recorded", choices=("auto", "yes", "no"), default="auto", help="the recorded run's rows "
                    "(compiled from its commit's code): auto = with --dry-run")
    ap.add_argument("--fit", action="store_true", help="fit the table's pallas share on the recorded SFT row with "
                    "the GPU kernels and print it (with the recorded rows)")
    ap.add_argument("--hlo-dir", help="write each compiled program's HLO text here (ROW.hlo; recorded/ROW.hlo)")
    ap.add_argument("--jobs", type=int, default=4, help="programs compiled at once (threads)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--budget-s", type=float, default=480.0, help="rows not started within this many seconds are "
                    "skipped (the whole run must fit one 10-minute call on an H200)")
    a = ap.parse_args()
    from nemo_jax.hostmem import tune_xla_gpu  # no jax import: the XLA:GPU flags a GPU run sets, before jax starts

    tune_xla_gpu(force=a.dry_run)  # a deviceless GPU compile gets the flags of the run it stands for
    for k, big, tiny in (("seq", 4096, 64), ("batch", 4, 2), ("nano_batch", 2, 2), ("remat", "layer", "none"),
                         ("rollouts", 64, 8), ("prompt", 512, 16), ("new_tokens", 256, 8)):
        if getattr(a, k) is None:
            setattr(a, k, tiny if a.tiny else big)
    if a.dry_run:
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    cache = os.path.join(a.out, "xla_cache") if a.out else "/tmp/nemo_jax_device_bench_cache"
    import jax

    jax.config.update("jax_compilation_cache_dir", cache)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)
    from nemo_jax.model import count_params

    b = Bench(a)
    dev = b.device
    stats = None if a.dry_run else dev.memory_stats()
    info = {"device": dev.device_kind, "device_kind": dev.device_kind, "platform": dev.platform, "jax": jax.__version__,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "commit": git_commit(),
            # what a hand-written GPU spec (nemo_jax/plan/gpu_specs) can be checked against
            "compute_capability": getattr(dev, "compute_capability", None),
            "core_count": getattr(dev, "core_count", None),
            "memory_gib": stats["bytes_limit"] / GiB if stats and "bytes_limit" in stats else None,
            "plan_device_kind": b.kind.key if b.kind else None,
            "params": count_params(b.cfg), "pattern": b.cfg.pattern, "batch": a.batch, "seq": a.seq, "remat": a.remat,
            "lora_remat": a.lora_remat, "dry_run": a.dry_run}
    head = (f"device bench: {info['device_kind']} ({info['platform']}, jax {info['jax']}"
            + (f", sm {info['compute_capability']}, {info['core_count']} SMs" if info["compute_capability"] else "")
            + f"); model {info['params'] / 1e6:,.1f}M params ({info['pattern']}), SFT batch {a.batch} x {a.seq}, "
            f"remat {a.remat}, bf16; commit {(info['commit'] or 'unknown')[:12]}, {info['date']}"
            + (" -- DRY RUN: compiled only, for a deviceless " + a.device_kind if a.dry_run else ""))
    print(head, flush=True)
    from concurrent.futures import ThreadPoolExecutor

    nano = nano_config(a.tiny)
    specs = [("sft_step kernels=auto", lambda: b.train_step("sft_step kernels=auto", "auto")),
             ("sft_step kernels=reference", lambda: b.train_step("sft_step kernels=reference", "reference")),
             (f"lora_step r{a.lora_rank}", lambda: b.train_step(f"lora_step r{a.lora_rank}", "auto", a.lora_rank,
                                                                remat=a.lora_remat)),
             (f"lora_step r{a.lora_rank} remat={a.remat}", lambda: b.train_step(
                 f"lora_step r{a.lora_rank} remat={a.remat}", "auto", a.lora_rank)),
             ("sampler", b.sampler),
             (f"nano3 widths ({NANO_PATTERN}) sft_step", lambda: b.train_step(
                 f"nano3 widths ({NANO_PATTERN}) sft_step", "auto", cfg=nano, batch=a.nano_batch)),
             ("engine decode", lambda: __import__("decode_row").engine_decode_row(b))]  # bench/decode_row.py
    rows, jobs = [], []
    for name, prepare in specs:  # lowering (Python) here, one row at a time
        try:
            row, compile_, run = prepare()
            jobs.append((row, compile_, run))
        except Exception as e:  # a failing row (a kernel the device rejects, out of memory) is reported, not fatal
            row = {"row": name, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"}
        rows.append(row)

    def attempt(row, fn):
        try:
            fn()
        except Exception as e:  # reported in the row (see above)
            row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"

    with ThreadPoolExecutor(max_workers=max(1, min(a.jobs, len(jobs)))) as pool:  # XLA compiles release the GIL
        list(pool.map(lambda j: attempt(j[0], j[1]), jobs))
    print(f"  compiled in {time.perf_counter() - b.t0:.0f} s", flush=True)
    for row, _, run in jobs:
        if a.dry_run or "error" in row:
            continue
        if b.left_s() <= 0:
            row["error"] = f"skipped: past the {a.budget_s:.0f} s budget"
            continue
        t = time.perf_counter()
        attempt(row, run)
        print(f"  {row['row']}: {time.perf_counter() - t:.0f} s", flush=True)
    if (a.recorded == "yes" or (a.recorded == "auto" and a.dry_run) or a.fit) and not a.tiny and b.kind:
        t = time.perf_counter()
        rows += recorded_rows(b.kind, RECORDED["device_kind"] if a.dry_run else b.kind.key, cache,
                              os.path.join(a.hlo_dir, "recorded") if a.hlo_dir else None)
        print(f"  recorded rows compiled in {time.perf_counter() - t:.0f} s", flush=True)
    finish_rows(rows)
    by_name = {r["row"]: r for r in rows}
    sft, lora = by_name.get("sft_step kernels=auto", {}), by_name.get(f"lora_step r{a.lora_rank}", {})
    lora_same = by_name.get(f"lora_step r{a.lora_rank} remat={a.remat}", {})
    if sft.get("hlo_flops") and lora.get("hlo_flops"):
        info["lora_over_sft_flops"] = lora["hlo_flops"] / sft["hlo_flops"]
    if sft.get("hlo_flops") and lora_same.get("hlo_flops"):
        info["lora_over_sft_flops_same_remat"] = lora_same["hlo_flops"] / sft["hlo_flops"]
    if sft.get("step_s") and lora.get("step_s"):
        info["lora_over_sft_time"] = lora["step_s"] / sft["step_s"]
    ref = by_name.get("sft_step kernels=reference", {})
    if ref.get("step_s") and sft.get("step_s"):
        info["sft_speedup_kernels_vs_reference"] = ref["step_s"] / sft["step_s"]
    recorded = [r for r in rows if "recorded" in r and r.get("plan_ratio")]
    if recorded:
        info["plan_within_tolerance"] = all(abs(r["plan_ratio"] - 1) <= PLAN_TOLERANCE for r in recorded)
    if a.fit and any("hlo" in r for r in rows):
        info["fit"] = fit_table(rows, b.kind)
    md = markdown(rows, head)
    if "lora_over_sft_flops" in info:
        md += (f"\nLoRA step HLO FLOPs / full SFT step's: {info['lora_over_sft_flops']:.3f} (remat {a.lora_remat}; "
               f"goal <= 0.70)" + (f", {info['lora_over_sft_flops_same_remat']:.3f} with remat {a.remat} as the full "
                                   "step" if "lora_over_sft_flops_same_remat" in info else ""))
    if "lora_over_sft_time" in info:
        md += f"\nLoRA step time / full SFT step's: {info['lora_over_sft_time']:.3f} (goal <= 0.75)"
    if "sft_speedup_kernels_vs_reference" in info:
        md += f"\nSFT step, kernels {sft['kernels']} vs reference: {info['sft_speedup_kernels_vs_reference']:.2f}x"
    if "plan_within_tolerance" in info:
        md += ("\nplan vs the recorded measurements: " + ", ".join(
            f"{r['recorded']} {r['plan_ratio']:.2f}x" for r in recorded)
            + f" ({'all' if info['plan_within_tolerance'] else 'NOT all'} within {PLAN_TOLERANCE:.0%})")
    if "fit" in info:
        f = info["fit"]
        md += (f"\nfit on {', '.join(FIT_ROWS)}: pallas {f['pallas']:.3f}; with it: "
               + ", ".join(f"{n} {t:.4f} s" for n, t in f["rows"].items()))
    print(md)
    print(f"total {time.perf_counter() - b.t0:.0f} s")
    for r in rows:
        r.pop("hlo", None)
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        for name, text in (("device_bench.json", json.dumps({"info": info, "rows": rows}, indent=1)),
                           ("device_bench.md", md + "\n")):
            path = os.path.join(a.out, name)
            with open(path + ".tmp", "w") as f:  # written whole, then renamed into place
                f.write(text)
            os.replace(path + ".tmp", path)
        print(f"wrote {a.out}/device_bench.json and device_bench.md")


if __name__ == "__main__":
    main()
