"""One device bench for whatever accelerator this process has (GPU first): the SFT step of a ~1B-parameter hybrid
MoE of the Nemotron-H family with kernels auto vs reference, the LoRA learner step, and sampler tokens/s at
batch 64, each next to the plan's estimate of the same program. Prints one table; `--out DIR` also writes it as
DIR/device_bench.json and DIR/device_bench.md.

    python bench/device.py --out /tmp/device_bench            # on the GPU / TPU host (~1B config, < 8 min on H200)
    python bench/device.py --tiny --out /tmp/device_bench     # toy size, any machine (CPU included)
    python bench/device.py --dry-run --out /tmp/dry            # compile every program for a deviceless H200 here

Rows (columns: docs/performance.md, "Device bench"):
  sft_step kernels=auto | reference   full SFT step (forward, backward, clipping, AdamW; fp32 master weights,
                                      bf16 compute, packed documents), the platform's kernels vs plain jnp
  lora_step                           the LoRA learner step (rank 16 on every target, bf16 frozen base)
  sampler decode                      nemo_jax.generate at batch 64 (prefill + sampled decode), tokens/s of decode
Plan columns: the same compiled program's memory (what a deviceless compile for this target reports) and the
plan's roofline (nemo_jax.plan.plan.roofline: the HLO's FLOPs at the device's dense bf16 peak; where the HLO
counter sees fewer FLOPs than the model's, e.g. inside Pallas / cuDNN custom calls, the model FLOPs, marked *).

Compiles go to a persistent cache (DIR/xla_cache, else /tmp/nemo_jax_device_bench_cache), so a rerun skips
them. The script imports only jax, optax, numpy, yaml and nemo_jax's model / train-step / generate / plan modules
(no grain, array-record or tensorboardX) and says what is missing if an import fails.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

NEEDED = ("jax", "numpy", "optax", "yaml", "ml_dtypes")
GiB = 1024 ** 3


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

    def figures(self, compiled) -> dict:
        """The plan's figures of a compiled program: its memory (arguments + temporaries + unaliased outputs,
        as a deviceless compile for this device reports it) and the FLOPs of its HLO (loops counted)."""
        from nemo_jax.plan.hlo import analyse

        mem = compiled.memory_analysis()
        total = (mem.argument_size_in_bytes + mem.temp_size_in_bytes
                 + max(0, mem.output_size_in_bytes - mem.alias_size_in_bytes))
        return {"plan_gib": total / GiB, "plan_temp_gib": mem.temp_size_in_bytes / GiB,
                "hlo_flops": analyse(compiled.as_text(), 1).flops}

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
    def train_step(self, name: str, kernels: str, lora_rank: int = 0):
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

        cfg, a = self.cfg, self.a
        B, T = a.batch, a.seq
        opts = Options(dtype=jnp.bfloat16, remat=a.remat, kernels=kernels_lib.resolve(kernels, self.mesh))
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

        state, frozen, batch = self.spec(jax.eval_shape(make))
        lowered = jax.jit(make_train_step(cfg, opts, tx, sched, o, 1, combine), donate_argnums=0).lower(
            state, batch, frozen)
        tokens = B * T
        model_flops = model_flops_per_token(cfg, T) * tokens
        row = {"row": name, "kernels": opts.kernels, "tokens_per_step": tokens, "model_flops": model_flops}
        held = {}

        def compile_():
            t = time.perf_counter()
            held["compiled"] = lowered.compile()
            row.update(compile_s=time.perf_counter() - t, **self.figures(held["compiled"]))

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
        tokens/s of the decode loop, next to the plan's figures of one decode step. -> (row, compile(), run())."""
        import jax
        import jax.numpy as jnp
        import numpy as np

        from nemo_jax import generate as G
        from nemo_jax import kernels as kernels_lib
        from nemo_jax.model import Options, init
        from nemo_jax.model.cache import state_shapes
        from nemo_jax.train.metrics import model_flops_per_token

        cfg, a = self.cfg, self.a
        opts = Options(dtype=jnp.bfloat16, kernels=kernels_lib.resolve("auto", self.mesh))
        rows, prompt, new = a.rollouts, a.prompt, a.new_tokens
        width = -(-prompt // 32) * 32
        new_params = lambda: jax.tree.map(lambda x: x.astype(jnp.bfloat16), init(cfg, jax.random.key(0)))  # noqa: E731
        st = self.spec(state_shapes(cfg, rows, width + new, opts.dtype))
        toks, valid = self.spec((jax.ShapeDtypeStruct((rows, 1), jnp.int32), jax.ShapeDtypeStruct((rows, 1), bool)))
        lowered = G._append.lower(self.spec(jax.eval_shape(new_params)), toks, valid, st, cfg=cfg, opts=opts)
        row = {"row": f"sampler decode (batch {rows})", "kernels": opts.kernels, "tokens_per_step": rows,
               "model_flops": model_flops_per_token(cfg, width + new) / 3 * rows}  # a token per row, forward only
        rng = np.random.default_rng(0)
        lengths = rng.integers(prompt // 2, prompt + 1, rows)
        prompts = [rng.integers(3, cfg.vocab_size, int(n)).tolist() for n in lengths]
        sp = G.SamplingParams(max_new_tokens=new, temperature=1.0)
        held = {}

        def prefill():
            logits, state = G.prefill(held["params"], prompts, cfg, width + new, opts=opts, width=width)
            return jax.block_until_ready(logits), state

        def decode(i, logits, state):  # generate() continuing a prefilled state: the decode loop alone
            return G.generate(held["params"], prompts, cfg, sp, key=jax.random.key(i), opts=opts, state=state,
                              last_logits=logits)

        def compile_():
            t = time.perf_counter()
            row.update(self.figures(lowered.compile()))  # one decode step, as the plan compiles it
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


def plan_step(rows: list[dict], peak: float | None):
    """The plan's roofline step time of each row: its FLOPs at the bf16 peak. A program with kernels hides their
    FLOPs from the HLO counter (custom calls): it takes the same program's reference compile's FLOPs (marked
    "reference") when the table has one, else the model's (marked "model")."""
    ref = {r["row"].split(" kernels=")[0]: r for r in rows if r.get("kernels") == "reference" and "hlo_flops" in r}
    for r in rows:
        if "hlo_flops" not in r:
            continue
        if r["kernels"] == "reference":
            r["plan_flops"], r["plan_flops_from"] = r["hlo_flops"], "hlo"
        elif r["row"].split(" kernels=")[0] in ref:
            r["plan_flops"], r["plan_flops_from"] = ref[r["row"].split(" kernels=")[0]]["hlo_flops"], "reference"
        else:
            r["plan_flops"], r["plan_flops_from"] = max(r["hlo_flops"], r["model_flops"]), "model"
        r["plan_step_s"] = r["plan_flops"] / peak if peak else None
        r["plan_tokens_per_s"] = r["tokens_per_step"] / r["plan_step_s"] if r["plan_step_s"] else None


COLUMNS = (("row", "row", "{}"), ("kernels", "kernels", "{}"), ("tokens/s", "tokens_per_s", "{:,.0f}"),
           ("step s", "step_s", "{:.4f}"), ("MFU", "mfu", "{:.1%}"), ("peak GiB", "peak_gib", "{:.2f}"),
           ("plan GiB", "plan_gib", "{:.2f}"), ("plan step s", "plan_step_s", "{:.4f}"),
           ("plan tokens/s", "plan_tokens_per_s", "{:,.0f}"), ("compile s", "compile_s", "{:.0f}"),
           # the engine decode row (bench/decode_row.py): memory traffic per decode step, its ratio to the bytes of
           # the parameters + decode state, and that traffic's time at the device's HBM bandwidth
           ("GiB/step", "traffic_gib_per_step", "{:.2f}"), ("/ (params+state)", "bytes_ratio", "{:.2f}x"),
           ("HBM-bound s", "hbm_step_s", "{:.5f}"))


MARKS = {"hlo": "", "reference": "+", "model": "*"}


def _cell(row: dict, key: str, fmt: str) -> str:
    v = row.get(key)
    if v is None:
        return row.get("error", "")[:60] if key == "kernels" and "error" in row else "-"
    s = fmt.format(v)
    return s + MARKS[row["plan_flops_from"]] if key in ("plan_step_s", "plan_tokens_per_s") else s


def markdown(rows: list[dict], head: str) -> str:
    out = [head, "", "| " + " | ".join(c for c, _, _ in COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    out += ["| " + " | ".join(_cell(r, k, f) for _, k, f in COLUMNS) + " |" for r in rows]
    errors = [f"- {r['row']}: {r['error']}" for r in rows if "error" in r]
    notes = ["", "plan step: the program's HLO FLOPs at the bf16 peak; + the reference program's (the HLO counter does "
             "not see inside kernels), \\* the model's"]
    return "\n".join(out + (["", "errors:"] + errors if errors else []) + notes)


def main():
    _check_imports()
    from nemo_jax.hostmem import tune_xla_gpu  # no jax import: the XLA:GPU flags a GPU run sets, before jax starts

    tune_xla_gpu(force="--dry-run" in sys.argv)  # (a dry run compiles for the GPU with its flags, as it will run)
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", help="directory for device_bench.json / .md and the compilation cache")
    ap.add_argument("--tiny", action="store_true", help="toy sizes (CPU)")
    ap.add_argument("--dry-run", action="store_true", help="compile every program for a deviceless GPU (no run)")
    ap.add_argument("--device-kind", default="h200", help="the deviceless GPU of --dry-run (h100 | h200 | b200)")
    ap.add_argument("--seq", type=int, help="tokens per row (default 4096; --tiny 64)")
    ap.add_argument("--batch", type=int, help="rows per step (default 4; --tiny 2)")
    ap.add_argument("--remat", default=None, help="none | layer | save_matmuls (default layer; --tiny none)")
    ap.add_argument("--lora-rank", type=int, default=16)
    ap.add_argument("--rollouts", type=int, default=None, help="sampler rows (default 64; --tiny 8)")
    ap.add_argument("--prompt", type=int, default=None, help="sampler prompt tokens (default 512; --tiny 16)")
    ap.add_argument("--new-tokens", type=int, default=None, help="sampled tokens per row (default 256; --tiny 8)")
    ap.add_argument("--jobs", type=int, default=4, help="programs compiled at once (threads)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--budget-s", type=float, default=450.0, help="rows not started within this many seconds are "
                    "skipped (the whole run must fit 8 minutes on an H200)")
    a = ap.parse_args()
    for k, big, tiny in (("seq", 4096, 64), ("batch", 4, 2), ("remat", "layer", "none"), ("rollouts", 64, 8),
                         ("prompt", 512, 16), ("new_tokens", 256, 8)):
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
    info = {"device_kind": dev.device_kind, "platform": dev.platform, "jax": jax.__version__,
            # what a hand-written GPU spec (nemo_jax/plan/gpu_specs) can be checked against
            "compute_capability": getattr(dev, "compute_capability", None),
            "core_count": getattr(dev, "core_count", None),
            "memory_gib": stats["bytes_limit"] / GiB if stats and "bytes_limit" in stats else None,
            "params": count_params(b.cfg), "pattern": b.cfg.pattern, "batch": a.batch, "seq": a.seq, "remat": a.remat,
            "dry_run": a.dry_run}
    head = (f"device bench: {info['device_kind']} ({info['platform']}, jax {info['jax']}"
            + (f", sm {info['compute_capability']}, {info['core_count']} SMs" if info["compute_capability"] else "")
            + f"); model {info['params'] / 1e6:,.1f}M params ({info['pattern']}), SFT batch {a.batch} x {a.seq}, "
            f"remat {a.remat}, bf16" + (" -- DRY RUN: compiled only, for a deviceless " + a.device_kind
                                        if a.dry_run else ""))
    print(head, flush=True)
    from concurrent.futures import ThreadPoolExecutor

    specs = [("sft_step kernels=auto", lambda: b.train_step("sft_step kernels=auto", "auto")),
             ("sft_step kernels=reference", lambda: b.train_step("sft_step kernels=reference", "reference")),
             (f"lora_step r{a.lora_rank}", lambda: b.train_step(f"lora_step r{a.lora_rank}", "auto", a.lora_rank)),
             ("sampler", b.sampler),
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
    plan_step(rows, b.peak())
    sft = {r["row"]: r for r in rows if r["row"].startswith("sft_step") and "step_s" in r}
    if len(sft) == 2:
        ref, other = sft["sft_step kernels=reference"], sft["sft_step kernels=auto"]
        info["sft_speedup_kernels_vs_reference"] = ref["step_s"] / other["step_s"]
    md = markdown(rows, head)
    if "sft_speedup_kernels_vs_reference" in info:
        md += f"\nSFT step, kernels {other['kernels']} vs reference: {info['sft_speedup_kernels_vs_reference']:.2f}x"
    print(md)
    print(f"total {time.perf_counter() - b.t0:.0f} s")
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
