"""`nemo-jax` command line: sft, grpo, eval, demos, recipe, plan, generate, serve, rollout-worker, plot, import-hf,
export-hf, merge, lora, data, forward, sandbox.

Arguments and configs are checked before JAX is imported (a bad flag or setting fails in a fraction of a second)
and every bad input is one line `nemo-jax CMD: error: ...` (exit 2). Any path naming a model may be a native
model dir, an HF dir, a run dir (its latest good checkpoint) or RUN/checkpoints/N (`nemo_jax.sources`).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading

from nemo_jax import fsutil
from nemo_jax.config.train import CAST_DTYPES, cast_dtype
from nemo_jax.extras import MissingDependency
from nemo_jax.hostmem import choose_platforms, keep_freed_memory, quiet_plugin_noise, tune_xla_cpu, tune_xla_gpu
from nemo_jax.rl.envs.episode import EnvironmentFailed  # (the protocol's types only: no environment is imported)


class _Parser(argparse.ArgumentParser):
    """argparse with every usage error as one line (`nemo-jax CMD: error: ...`; --help shows the usage)."""

    def error(self, message):
        sys.stderr.write(f"{self.prog}: error: {message} (see {self.prog} --help)\n")
        raise SystemExit(2)


def _number(kind, lo=None, hi=None, lo_open=False, hi_open=False):
    """An argparse type: an int or float within bounds (a bound None: unbounded)."""
    def parse(text):
        try:
            v = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {'an integer' if kind is int else 'a number'}, got {text!r}")
        if lo is not None and (v <= lo if lo_open else v < lo):
            raise argparse.ArgumentTypeError(f"must be {'>' if lo_open else '>='} {lo}, got {text}")
        if hi is not None and (v >= hi if hi_open else v > hi):
            raise argparse.ArgumentTypeError(f"must be {'<' if hi_open else '<='} {hi}, got {text}")
        return v

    parse.__name__ = kind.__name__  # argparse names the type in its messages
    return parse


POSITIVE = _number(int, 1)
NON_NEGATIVE = _number(int, 0)
TEMPERATURE = _number(float, 0)


def _dtype_arg(text: str) -> str:
    """An argparse type: a --dtype name (`config.train.CAST_DTYPES`), checked with the other arguments (before
    JAX starts)."""
    if text in ("", "keep") or text in CAST_DTYPES:
        return text
    raise argparse.ArgumentTypeError(f"unknown dtype {text!r} (one of {', '.join(CAST_DTYPES)}, or keep)")


def _converting(command: str):
    """Conversions run as one process or as several (started like a training command: SLURM, Kubernetes,
    NEMO_JAX_* env, launch/local/run.sh), each converting its share of the tensors into one output."""
    from nemo_jax.parallel import distributed

    distributed.initialize()
    return distributed.failure_guard(command)


def _share_note() -> str:
    from nemo_jax.parallel import distributed

    me, n = distributed.process()
    return f" (process {me} of {n}: its share of the tensors)" if n > 1 else ""


def cmd_import_hf(a):
    fsutil.check_not_input(a.dst, [a.src])
    fsutil.check_output(a.dst, "native model", a.overwrite)  # before JAX starts
    from nemo_jax.hf.io import import_pretrained

    with _converting("import-hf"):
        import_pretrained(a.src, a.dst, dtype=cast_dtype(a.dtype), ignore_unexpected=a.ignore_unexpected,
                          progress=True, overwrite=a.overwrite, allow_nonfinite=a.allow_nonfinite)
    print(f"imported {a.src} -> {a.dst}{_share_note()}")


def cmd_export_hf(a):
    fsutil.check_not_input(a.dst, [a.src, a.like])
    fsutil.check_output(a.dst, "HF checkpoint", a.overwrite)  # before JAX starts
    with _converting("export-hf"):
        _export_hf(a)
    print(f"exported {a.src} -> {a.dst}{_share_note()}")


def _export_hf(a):
    from nemo_jax.hf.io import read_dtypes, save_pretrained
    from nemo_jax.sources import open_lazy

    cfg, params, tok_dir = open_lazy(a.src)  # read region by region (a run dir: its latest good checkpoint)
    if a.adapters:  # merged per HF tensor while streaming (fp32 math, rounded once to each tensor's dtype)
        from nemo_jax.lora.peft import MergedSource, parse_adapter_arg
        from nemo_jax.sources import load_adapters

        named = [parse_adapter_arg(x) for x in a.adapters]
        fsutil.check_not_input(a.dst, [d for d, _ in named])
        sets = [(load_adapters(d, cfg), w) for d, w in named]
        params = MergedSource(params, cfg, sets)
    dtypes = read_dtypes(a.like) if a.like else cast_dtype(a.dtype)
    save_pretrained(cfg, params, a.dst, max_shard_size=a.max_shard_size, dtypes=dtypes, tokenizer_dir=tok_dir,
                    progress=True, overwrite=a.overwrite, allow_nonfinite=a.allow_nonfinite)


def cmd_merge(a):
    from nemo_jax.merge.recipe import load_recipe

    flags = [f"{k}=true" for k in ("overwrite", "allow_nonfinite") if getattr(a, k)]
    recipe = load_recipe(a.recipe, list(a.overrides) + flags)
    fsutil.check_not_input(recipe.output, list(recipe.models.values()) + list(recipe.adapters.values()), "output")
    fsutil.check_output(recipe.output, "HF checkpoint", recipe.overwrite)  # all before JAX starts
    from nemo_jax.merge import run_recipe, summary

    src = run_recipe(recipe, progress=True)
    print(summary(src.stats))
    if a.report:
        from nemo_jax.merge import stats_table

        with open(a.report, "w") as f:
            f.write(stats_table(src.stats))
    print(f"merged {len(recipe.models)} models -> {recipe.output}")


def cmd_lora_export(a):
    fsutil.check_not_input(a.dst, [a.src])
    fsutil.check_output(a.dst, "PEFT adapter dir", a.overwrite)  # before JAX starts
    from nemo_jax.lora.peft import save_peft
    from nemo_jax.sources import load_adapter_set

    cfg, lora_cfg, adapters = load_adapter_set(a.src)  # a run dir: its latest good checkpoint's adapters
    save_peft(cfg, adapters, a.dst, format=a.format, base_model_name_or_path=a.base_model, lora_config=lora_cfg,
              overwrite=a.overwrite)
    print(f"exported {a.src} -> {a.dst} ({a.format} adapter format)")


def cmd_lora_import(a):
    fsutil.check_not_input(a.dst, [a.src, a.model])
    fsutil.check_output(a.dst, "adapter checkpoint", a.overwrite)  # before JAX starts
    from nemo_jax.config.model import NemotronHConfig
    from nemo_jax.lora import save_adapter_checkpoint
    from nemo_jax.lora.peft import ADAPTER_CONFIG, load_peft, lora_config_of, read_peft_config
    from nemo_jax.sources import model_config_of

    model = a.model or read_peft_config(a.src).get("base_model_name_or_path")
    if model and model.endswith(".json") and os.path.isfile(model):
        cfg = NemotronHConfig.from_file(model)
    elif model and os.path.isdir(model):
        cfg = model_config_of(model)  # a model dir or a run dir
    else:
        raise FileNotFoundError(f"lora import needs the base model's config: pass --model (a model dir, run dir or "
                                f"config.json); {os.path.join(a.src, ADAPTER_CONFIG)} base_model_name_or_path "
                                f"{model!r} is not a local model dir")
    adapters = load_peft(a.src, cfg)
    save_adapter_checkpoint(a.dst, cfg, lora_config_of(a.src, adapters), adapters, overwrite=a.overwrite)
    print(f"imported {a.src} -> {a.dst}")


def cmd_forward(a):
    import jax
    import jax.numpy as jnp
    import numpy as np

    from nemo_jax import model as M
    from nemo_jax.config.model import NemotronHConfig

    if a.model.endswith(".json"):
        cfg = NemotronHConfig.from_file(a.model)
        params = M.init(cfg, jax.random.key(a.seed))
    else:
        from nemo_jax.sources import load_any

        cfg, params = load_any(a.model)
    toks = jax.random.randint(jax.random.key(a.seed + 1), (a.batch, a.seq_len), 0, cfg.vocab_size)
    logits, aux = jax.jit(lambda p, t: M.forward(p, t, cfg))(params, toks)
    lp = jax.nn.log_softmax(logits)
    nll = -jnp.mean(jnp.take_along_axis(lp[:, :-1], toks[:, 1:, None], axis=-1))
    print(json.dumps({"params": M.count_params(cfg), "logits_shape": list(logits.shape),
                      "next_token_nll": float(nll), "uniform_nll": float(np.log(cfg.vocab_size))}))


def _mesh_overrides(mesh: str | None) -> list[str]:
    """--mesh (a preset YAML or inline sizes "fsdp=8,tensor=2") -> mesh.* overrides."""
    if not mesh:
        return []
    from nemo_jax.config.train import read_mesh_sizes

    return [f"mesh.{k}={v}" for k, v in read_mesh_sizes(mesh).items()]


def _check_run(c, new_run: bool):
    """Before JAX starts: the mesh against the devices this host will have (where that is known then: a CPU
    host), and a rerun's settings against the run it would resume."""
    from nemo_jax.config.train import check_rerun, resolve_mesh_sizes
    from nemo_jax.hostmem import known_device_count
    from nemo_jax.parallel.distributed import resolve as process_layout
    from nemo_jax.runlock import check_free

    n = known_device_count()
    if n is not None and not process_layout(getattr(c, "distributed", None)).multi:
        try:
            resolve_mesh_sizes(c.mesh.sizes(), n)
        except ValueError as e:
            raise ValueError(f"{e}; this CPU host has {n} device{'s' if n != 1 else ''} "
                             "(XLA_FLAGS=--xla_force_host_platform_device_count=N or JAX_NUM_CPU_DEVICES=N simulates "
                             "N)") from None
    run_dir = os.path.abspath(c.run_dir or os.path.join("runs", c.name))
    check_free(run_dir)  # a run dir another process is writing is named as such, before its settings are judged
    if not new_run:
        check_rerun(c, run_dir)


def cmd_sft(a):
    from nemo_jax.config.train import load_sft_config

    c = load_sft_config(a.config, _mesh_overrides(a.mesh) + list(a.overrides))  # checked before JAX starts
    _check_run(c, a.new_run)
    from nemo_jax.rl.warmstart import make_source
    from nemo_jax.train.sft import main as sft_main

    sft_main(a.config, config=c, verbose=a.verbose, new_run=a.new_run, make_source=make_source)


def cmd_grpo(a):
    from nemo_jax.config.train import load_grpo_config

    c = load_grpo_config(a.config, _mesh_overrides(a.mesh) + list(a.overrides))  # checked before JAX starts
    _check_run(c, a.new_run)
    from nemo_jax.rl.grpo import main as grpo_main

    grpo_main(a.config, config=c, new_run=a.new_run)


def cmd_recipe(a):
    from nemo_jax.recipe import RecipeStopped, main as recipe_main

    try:
        recipe_main(a.recipe, a.overrides)
    except RecipeStopped as e:
        print(f"nemo-jax recipe: {e}", file=sys.stderr)
        raise SystemExit(3) from None


def cmd_eval(a):
    from nemo_jax.rl.envs import make_env
    from nemo_jax.rl.envs.demos import json_object

    args = json_object(a.env_args, "--env-args")  # the environment is built before JAX loads: a bad one fails now
    try:
        env = make_env(a.env, **args)
    except TypeError as e:  # an argument the environment does not take
        raise ValueError(f"--env {a.env} --env-args: {e}") from None
    except ValueError as e:
        raise ValueError(f"--env {a.env}: {e}") from None
    from nemo_jax.rl.grpo import cli_eval

    cli_eval(a, env)


def cmd_plan(a):
    from nemo_jax.config.train import load_plan_config
    from nemo_jax.plan.targets import PLUGINS, default_target, native_target, require_plugin

    load_plan_config(a.config, _mesh_overrides(a.mesh) + list(a.overrides))  # checked before JAX starts
    if a.target is None and default_target(a.device_kind) == "cpu":
        own = native_target(a.device_kind)
        print(f"note: planning on the cpu target, an estimate: compiling for {a.device_kind} itself needs the "
              f"{PLUGINS[own][1]!r} extra (pip install 'nemo_jax[{PLUGINS[own][1]}]', then --target {own})",
              file=sys.stderr)
    a.target = a.target or default_target(a.device_kind)
    if a.target != "cpu" and native_target(a.device_kind) != a.target:
        raise ValueError(f"--target {a.target} cannot compile for --device-kind {a.device_kind} (its target is "
                         f"{native_target(a.device_kind)}, or cpu for an estimate)")
    if a.target != "cpu":
        require_plugin(a.target)  # one line naming the extra, before JAX starts
    if a.target == "gpu":
        tune_xla_gpu(force=True)  # the flags a GPU run sets (nemo_jax.hostmem.GPU_XLA_FLAGS): the same program
    import jax

    jax.config.update("jax_platforms", "cpu")
    try:  # the simulated devices: possible only before jax starts its backends (plan then says how many it has)
        jax.config.update("jax_num_cpu_devices", a.devices if a.target == "cpu" else 1)
    except RuntimeError as e:
        print(f"note: {e}", file=sys.stderr)
    from nemo_jax.plan import cli_plan

    if a.target == "gpu":  # XLA:GPU's compile logs come out before the answer, not inside it
        from nemo_jax.hostmem import answer_after_logs

        answer_after_logs(cli_plan, a, _mesh_overrides(a.mesh) + list(a.overrides))
    else:
        cli_plan(a, _mesh_overrides(a.mesh) + list(a.overrides))


def cmd_plot(a):
    from nemo_jax.plot import plot_runs

    keys = [k for arg in a.keys for k in arg.split(",") if k] if a.keys else None
    for path in plot_runs(a.run_dirs, a.out, keys=keys, smoothing=a.smoothing):
        print(path)


def cmd_generate(a):
    from nemo_jax.generate.cli import cli_generate

    cli_generate(a)


def cmd_demos(a):
    from nemo_jax.rl.envs.demos import json_object, run

    json_object(a.env_args, "--env-args")  # (checked before any environment is built)
    json_object(a.demo_args, "--demo-args")
    if a.n_train < 0 or a.n_eval < 0:
        raise ValueError("--n-train and --n-eval must be >= 0")
    run(a)


def cmd_serve(a):
    from nemo_jax.parallel.distributed import resolve

    layout = resolve()  # (the environment's process layout: over several processes, process 0 answers HTTP)
    if layout.multi and not a.mesh:
        raise ValueError(f"nemo-jax serve over {layout.num_processes} processes ({layout.source}) needs --mesh over "
                         "all their devices (e.g. --mesh fsdp=4,tensor=2)")
    if layout.multi and a.enable_runtime_lora_updating:
        raise ValueError("--enable-runtime-lora-updating is not supported over several processes (load adapters "
                         "with --adapters)")
    if not 0 < a.port < 65536:
        raise ValueError(f"--port {a.port}: expected 1..65535")
    if a.max_num_seqs < 1 or a.max_model_len < 2 or a.bucket < 1 or a.check_every < 1:
        raise ValueError("--max-num-seqs, --bucket and --check-every must be >= 1 and --max-model-len >= 2")
    if a.max_waiting_queue_length < 0 or not a.max_request_mb > 0 or a.request_timeout < 0 or a.shutdown_timeout < 0:
        raise ValueError("--max-waiting-queue-length, --request-timeout and --shutdown-timeout must be >= 0 and "
                         "--max-request-mb > 0")
    from nemo_jax.serve import check_roots, parse_adapter_specs

    adapters = parse_adapter_specs(a.adapters)  # (before JAX starts)
    if a.enable_runtime_lora_updating and not a.adapter_root:
        raise ValueError("--enable-runtime-lora-updating needs --adapter-root DIR (the folders adapters may be "
                         "loaded from)")
    if a.adapter_root and not a.enable_runtime_lora_updating:
        raise ValueError("--adapter-root is for runtime loading: add --enable-runtime-lora-updating")
    check_roots("--adapter-root", a.adapter_root)
    check_roots("--allowed-local-media-path", a.allowed_local_media_path)
    if a.tinker_root:
        if os.path.exists(a.tinker_root) and not os.path.isdir(a.tinker_root):
            raise ValueError(f"--tinker-root {a.tinker_root}: exists and is not a folder")
        if a.tinker_max_rank < 1 or a.tinker_max_tokens < 1 or a.tinker_batch_clients < 1:
            raise ValueError("--tinker-max-rank, --tinker-max-tokens and --tinker-batch-clients must be >= 1")
    a.api_key = a.api_key or os.environ.get("NEMO_JAX_API_KEY") or os.environ.get("VLLM_API_KEY") or None
    from nemo_jax.serve.main import cli_serve

    services = None
    if a.tinker_root:  # the Tinker API over the served model (nemo_jax.tinker builds on serve; serve names it not)
        from nemo_jax.tinker import service_for

        services = lambda state, tok_dir: [service_for(state, a, tok_dir)]  # noqa: E731
    cli_serve(a, adapters, services)


def cmd_sandbox(a):
    from nemo_jax.sandbox import probe_backends

    for line in probe_backends(a.backend.split(",") if a.backend else None, sweep=a.sweep):
        print(line, flush=True)


def cmd_rollout_worker(a):
    from nemo_jax.rl.transport.worker import cli_worker

    cli_worker(a)


NEW_RUN_HELP = ("start afresh in the run dir: an earlier run there is moved aside to RUN_DIR.prev (never deleted); "
                "without it a run dir holding checkpoints resumes, and is refused if its settings differ")


def _env_forms() -> str:
    from nemo_jax.rl.envs.episode import env_forms  # (names only: no environment is imported)

    return env_forms()


def _add_sft(sub) -> None:
    s = sub.add_parser("sft", help="supervised fine-tuning from a YAML config")
    s.add_argument("--config", default=None, help="YAML config (default: the embedded tiny CPU config)")
    s.add_argument("--mesh", default=None, help="mesh preset YAML (configs/mesh/*.yaml) or sizes like fsdp=4,expert=2")
    s.add_argument("--verbose", action="store_true", help="print the whole resolved config (always in RUN/config.yaml)")
    s.add_argument("--new-run", action="store_true", help=NEW_RUN_HELP)
    s.add_argument("overrides", nargs="*", help="dotted key=value overrides, e.g. steps=20 optim.lr=1e-4")
    s.set_defaults(fn=cmd_sft)


def _add_grpo(sub) -> None:
    s = sub.add_parser("grpo", help="asynchronous GRPO on LoRA adapters from a YAML config (see configs/grpo)")
    s.add_argument("--config", required=True, help="GRPO YAML config, e.g. configs/grpo/tiny-cpu.yaml")
    s.add_argument("--mesh", default=None, help="mesh preset YAML (configs/mesh/*.yaml) or sizes like fsdp=4")
    s.add_argument("--new-run", action="store_true", help=NEW_RUN_HELP)
    s.add_argument("overrides", nargs="*", help="dotted key=value overrides, e.g. steps=20 rollout.group_size=4")
    s.set_defaults(fn=cmd_grpo)


def _add_recipe(sub) -> None:
    s = sub.add_parser("recipe", help="the whole recipe: base -> SFT -> base merge (QK-restore) -> GRPO experts -> "
                       "expert merge -> HF export -> report (stage x environment)")
    s.add_argument("recipe", help="recipe YAML, e.g. configs/recipes/tiny-cpu.yaml")
    s.add_argument("overrides", nargs="*", help="dotted key=value overrides, e.g. run_dir=runs/r1")
    s.set_defaults(fn=cmd_recipe)


def _add_eval(sub) -> None:
    s = sub.add_parser("eval", help="attempt an environment's held-out tasks K times: mean reward, success rate, "
                       "pass@1, pass@K, consistency")
    s.add_argument("--ckpt", required=True, help="native model dir, HF dir, or SFT run dir")
    s.add_argument("--adapters", default=None, help="PEFT dir, adapter checkpoint, or LoRA / GRPO run dir")
    s.add_argument("--env", required=True, help=_env_forms())
    s.add_argument("--env-args", default=None, help="JSON object of the environment's arguments")
    s.add_argument("--attempts", type=POSITIVE, default=1)
    s.add_argument("--split", default="eval", help="task split (default eval)")
    s.add_argument("--max-new-tokens", type=POSITIVE, default=32, help="per assistant turn")
    s.add_argument("--temperature", type=TEMPERATURE, default=1.0)
    s.add_argument("--rows", type=POSITIVE, default=32, help="decode rows of the sampler (continuous batching)")
    s.add_argument("--max-len", type=POSITIVE, default=1024, help="positions per row: a whole conversation")
    s.add_argument("--tokenizer", default=None, help="dir with tokenizer.json/tokenizer_config.json")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--images", choices=("real", "blank", "shuffle"), default="real",
                   help="what the policy sees: the real pictures, each one blanked (its mean colour), or another "
                        "task's (does success depend on the screen?)")
    s.add_argument("--json", default=None, help="also write the figures (and each task's mean reward) as JSON")
    s.set_defaults(fn=cmd_eval)


def _add_demos(sub) -> None:
    from nemo_jax.rl.envs.demos import add_arguments  # (argparse only: no environment is imported)

    s = sub.add_parser("demos", help="an environment's expert demonstrations as SFT chat data (OUT/train.jsonl, "
                       "OUT/eval.jsonl), each run through a real episode")
    add_arguments(s)
    s.set_defaults(fn=cmd_demos)


def _add_plan(sub) -> None:
    s = sub.add_parser("plan", help="per-device memory, FLOPs, collectives and step time of a config on N "
                       "simulated devices (ahead-of-time compile on this CPU machine)")
    s.add_argument("--config", default=None, help="SFT or GRPO YAML config (GRPO: its learner step; default: the "
                   "embedded tiny CPU config)")
    s.add_argument("--devices", type=POSITIVE, required=True, help="number of devices of the job")
    s.add_argument("--device-kind", required=True, choices=("h100", "h200", "b200", "tpu-v5p", "tpu-v5e", "tpu-v6e"))
    s.add_argument("--target", choices=("gpu", "tpu", "cpu"), default=None,
                   help="compiler: the device kind's own (gpu: XLA:GPU via jax-cuda12-plugin, tpu: libtpu; "
                        "deviceless) or cpu (simulated CPU devices, an estimate); default: the kind's own when "
                        "nemo_jax[plan-gpu] / [plan-tpu] is installed, else cpu")
    s.add_argument("--jobs", type=POSITIVE, default=1, help="--search: compile this many candidates at once")
    s.add_argument("--mesh", default=None, help="mesh preset YAML or sizes like fsdp=8,expert=8")
    s.add_argument("--json", action="store_true", help="print every figure as JSON (stable keys)")
    s.add_argument("--search", action="store_true", help="try mesh shapes and remat policies, rank those that fit")
    s.add_argument("--max-candidates", type=POSITIVE, default=12, help="--search: compile at most this many variants")
    s.add_argument("--headroom", type=_number(float, 0, 1, hi_open=True), default=0.1,
                   help="share of device memory kept free (default 0.1)")
    s.add_argument("--sampler", action="store_true", help="also plan the sampler's prefill and decode steps")
    s.add_argument("--tinker-clients", type=POSITIVE, default=None,
                   help="a LoRA config: plan the Tinker server (serve --tinker-root): this many LoRA models resident "
                        "beside the learner step (and, with --sampler, the sampler), the base held once")
    s.add_argument("--no-lora-ratio", action="store_true", help="a LoRA config: skip compiling the same step "
                   "without LoRA (whose FLOPs the LoRA step's are printed against)")
    s.add_argument("--rollout-batch", type=POSITIVE, default=None,
                   help="sampler rows (default: data.batch_size; a GRPO config's rollout.sampler_rows or its rollouts)")
    s.add_argument("--prefill", type=POSITIVE, default=None,
                   help="sampler: tokens per row one prefill appends (default: the whole context); a multi-turn "
                        "rollout prefills each turn's new tokens into a state holding the conversation")
    s.add_argument("--context", type=POSITIVE, default=None,
                   help="sampler context (default: data.seq_len; a GRPO config's rollout.sampler_positions)")
    s.add_argument("overrides", nargs="*", help="dotted key=value overrides, e.g. data.seq_len=4096")
    s.set_defaults(fn=cmd_plan)


def _add_generate(sub) -> None:
    s = sub.add_parser("generate", help="sample from a model with the chat template applied")
    s.add_argument("--ckpt", required=True, help="native model dir, HF dir, or SFT run dir")
    s.add_argument("--prompt", required=True)
    s.add_argument("--tokenizer", default=None, help="dir with tokenizer.json/tokenizer_config.json")
    s.add_argument("--max-new-tokens", type=POSITIVE, default=64)
    s.add_argument("--temperature", type=TEMPERATURE, default=0.7)
    s.add_argument("--top-k", type=NON_NEGATIVE, default=0)
    s.add_argument("--top-p", type=_number(float, 0, 1, lo_open=True), default=1.0)
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--no-chat-template", action="store_true")
    s.add_argument("--image", action="append", default=[], metavar="FILE",
                   help="a picture shown before the prompt (vision-language models; repeat for several)")
    s.add_argument("--mesh", default=None, help="mesh preset YAML (configs/mesh/*.yaml): params and the decode "
                   "state are sharded over it")
    s.add_argument("--kernels", choices=("auto", "reference"), default="auto",
                   help="accelerator kernels (docs/kernels.md): auto = this device's, reference = plain jnp")
    s.set_defaults(fn=cmd_generate)


def _add_serve(sub) -> None:
    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server (chat and completions with logprobs and token "
                       "ids, tools, images, LoRA adapters by name) with continuous batching")
    s.add_argument("--ckpt", required=True, help="native model dir, HF dir, or SFT run dir")
    s.add_argument("--adapters", action="append", default=[], metavar="NAME=DIR",
                   help="serve this adapter set (PEFT dir, peft or vllm layout, or adapter checkpoint) as model NAME; "
                        "repeatable (more load at run time: POST /v1/load_lora_adapter)")
    s.add_argument("--mesh", default=None, help="mesh preset YAML or sizes like tensor=4: params and the decode "
                   "state are sharded over it")
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--tokenizer", default=None, help="dir with tokenizer.json/tokenizer_config.json (default: the "
                   "checkpoint's)")
    s.add_argument("--served-model-name", default=None, help="the base model's name in the API (default: the "
                   "checkpoint dir's name)")
    s.add_argument("--max-num-seqs", type=int, default=8, help="decode rows: sequences sampled at once")
    s.add_argument("--max-model-len", type=int, default=4096, help="positions per row: prompt + completion")
    s.add_argument("--dtype", type=_dtype_arg, default=None,
                   help="cast the weights (default: as stored), e.g. bf16 or fp32")
    s.add_argument("--bucket", type=int, default=32, help="prompts are padded to a multiple of this (few compiles)")
    s.add_argument("--check-every", type=int, default=4, help="decode steps between looks for finished rows")
    s.add_argument("--return-tokens-as-token-ids", action="store_true",
                   help="logprob entries name their token as token_id:<id> (as vLLM's flag)")
    s.add_argument("--seed", type=int, default=0, help="seeds the draws of requests without a seed")
    s.add_argument("--log-level", default="warning", choices=("critical", "error", "warning", "info", "debug"),
                   help="uvicorn's log level (info: one line per request)")
    s.add_argument("--api-key", default=None, help="clients must send it as a bearer token on every route but "
                   "/health (default: $NEMO_JAX_API_KEY, else $VLLM_API_KEY; none: no key)")
    s.add_argument("--enable-runtime-lora-updating", action="store_true",
                   help="serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (off by default, as vLLM's "
                        "VLLM_ALLOW_RUNTIME_LORA_UPDATING); loads only under --adapter-root")
    s.add_argument("--adapter-root", action="append", default=[], metavar="DIR",
                   help="a folder runtime-loaded adapters may come from (repeatable; '..' and links out refused)")
    s.add_argument("--allowed-local-media-path", action="append", default=[], metavar="DIR",
                   help="image_url parts may name files (paths, file:// URLs) under DIR (repeatable; default: "
                        "data URLs only)")
    s.add_argument("--max-request-mb", type=float, default=32.0, help="larger request bodies are refused (413) "
                   "before they are read")
    s.add_argument("--max-waiting-queue-length", type=int, default=256, help="sequences that may wait for a decode "
                   "row; more are refused with 429 and Retry-After")
    s.add_argument("--request-timeout", type=float, default=1800.0, help="seconds a request may take before it is "
                   "cancelled with a 503 (0: no limit)")
    s.add_argument("--shutdown-timeout", type=float, default=30.0, help="on SIGTERM: seconds running requests may "
                   "take to finish before they are cancelled (then the server exits 0)")
    s.add_argument("--tinker-root", default=None, metavar="DIR",
                   help="serve the Tinker API (the official tinker SDK, tinker-cookbook) under /api/v1 too: LoRA "
                        "training clients over this model; tinker:// checkpoints are adapter checkpoints under DIR "
                        "(docs/tinker.md; the API key, if any, as X-API-Key: tml-<key>)")
    s.add_argument("--tinker-max-rank", type=int, default=128, help="the largest LoRA rank a Tinker client may ask for")
    s.add_argument("--tinker-max-tokens", type=int, default=16384, help="tokens (rows x padded length) per learner "
                   "call; larger forward_backward batches run in several calls (gradients summed)")
    s.add_argument("--tinker-batch-clients", type=int, default=1, help="forward_backward requests of up to this many "
                   "training clients of one LoRA shape, ready at once, run as one batched call over the base (within "
                   "--tinker-max-tokens; default 1: each client's alone; docs/tinker.md says when it pays)")
    s.add_argument("--no-warmup", action="store_true", help="say ready without compiling every row count and "
                   "sampling variant first (tests; the first requests then wait on compiles)")
    s.add_argument("--compilation-cache", default=None, metavar="DIR", help="persistent compilation cache (default: "
                   "$NEMO_JAX_COMPILATION_CACHE, else ~/.cache/nemo_jax/xla; 'off': none): a restart loads its "
                   "programs")
    s.set_defaults(fn=cmd_serve)


def _add_rollout_worker(sub) -> None:
    s = sub.add_parser("rollout-worker", help="sample a GRPO run's requested groups (rollout.spool=true) on an "
                       "OpenAI-compatible server (vLLM, SGLang, nemo-jax serve) with the newest published adapter; "
                       "rollouts go to the run's spool")
    s.add_argument("--run", required=True, metavar="RUN_DIR", help="the learner's run dir (on a shared filesystem)")
    s.add_argument("--server", required=True, metavar="URL", help="the server, e.g. http://inference-0:8000")
    s.add_argument("--env", default=None, help="environment (default: the run's rollout.env, from RUN/config.yaml)")
    s.add_argument("--env-args", default=None, help="JSON object of its arguments (default: the run's "
                   "rollout.env_args)")
    s.add_argument("--model", default=None, help="the server's base model name (default: the first base model "
                   "/v1/models lists)")
    s.add_argument("--tokenizer", default=None, help="the learner's tokenizer (default: the run's `tokenizer`): its "
                   "chat template renders the prompts and environment turns")
    s.add_argument("--concurrency", type=int, default=4, help="groups sampled at once (their episodes concurrently)")
    s.add_argument("--lease-s", type=float, default=None, help="renew claims at least every LEASE_S / 3 seconds "
                   "(default: each request's lease_s, the learner's rollout.lease_s)")
    s.add_argument("--worker-id", default=None, help="name in claims and spool files (default: HOST-PID)")
    s.add_argument("--api", default="auto", choices=("auto", "chat"), help="auto: turns are /v1/completions of the "
                   "conversation's token ids (exact), chat completions for conversations with pictures; chat: every "
                   "turn a chat completion of the messages")
    s.add_argument("--server-run-dir", default=None, help="the run dir as the server's machine sees it (adapter "
                   "paths it loads; default: --run)")
    s.add_argument("--api-key", default=None, help="bearer token for the server (default: $OPENAI_API_KEY)")
    s.add_argument("--request-timeout", type=float, default=900.0, help="seconds one turn may take")
    s.add_argument("--wait-s", type=float, default=600.0, help="seconds to wait for the server to answer at start")
    s.add_argument("--max-groups", type=int, default=0, help="stop after completing this many groups (0: run until "
                   "SIGTERM / SIGINT)")
    s.set_defaults(fn=cmd_rollout_worker)


def _add_plot(sub) -> None:
    s = sub.add_parser("plot", help="PNG figures of runs' metrics.jsonl (several runs overlaid)")
    s.add_argument("run_dirs", nargs="+", metavar="RUN_DIR")
    s.add_argument("--keys", action="append", default=None,
                   help="only these metrics (comma-separated, repeatable), e.g. loss,eval_loss")
    s.add_argument("--out", default=None, help="output dir (default: RUN_DIR/plots of the first run)")
    s.add_argument("--smoothing", type=_number(float, 0, 1, hi_open=True), default=0.6,
                   help="EMA weight of the smoothed curves of dense series (sparse series such as eval and "
                        "schedules such as the learning rate are drawn as logged), in [0, 1)")
    s.set_defaults(fn=cmd_plot)


def _add_import_hf(sub) -> None:
    s = sub.add_parser("import-hf", help="HF safetensors checkpoint -> native checkpoint")
    s.add_argument("src")
    s.add_argument("dst")
    s.add_argument("--dtype", type=_dtype_arg, default=None,
                   help="cast every tensor (default: keep the checkpoint's dtypes)")
    s.add_argument("--ignore-unexpected", action="store_true", help="skip tensors the config does not describe")
    s.add_argument("--overwrite", action="store_true", help="replace DST if it is an earlier native model written "
                   "by nemo-jax (a folder holding anything else is never replaced)")
    s.add_argument("--allow-nonfinite", action="store_true", help="import NaN / Inf tensors instead of stopping")
    s.set_defaults(fn=cmd_import_hf)


def _add_export_hf(sub) -> None:
    s = sub.add_parser("export-hf", help="native model, run dir (its latest good checkpoint) or HF dir -> HF "
                       "safetensors checkpoint")
    s.add_argument("src", help="native model dir, run dir, RUN/checkpoints/N or HF dir")
    s.add_argument("dst")
    s.add_argument("--dtype", type=_dtype_arg, default=None,
                   help="write every tensor in this dtype (default: as stored)")
    s.add_argument("--like", default=None, help="HF dir whose per-tensor dtypes to reproduce")
    s.add_argument("--max-shard-size", default="5GB")
    s.add_argument("--adapters", action="append", default=None, metavar="DIR[:WEIGHT]",
                   help="merge this LoRA adapter set (PEFT dir, adapter checkpoint or LoRA SFT run dir) into the "
                        "written weights, times WEIGHT (default 1); repeatable")
    s.add_argument("--overwrite", action="store_true", help="replace DST if it is an earlier HF checkpoint written "
                   "by nemo-jax (a folder holding anything else is never replaced)")
    s.add_argument("--allow-nonfinite", action="store_true", help="write NaN / Inf tensors instead of stopping")
    s.set_defaults(fn=cmd_export_hf)


def _add_merge(sub) -> None:
    s = sub.add_parser("merge", help="merge checkpoints (HF or native) by a YAML recipe of per-tensor rules")
    s.add_argument("recipe", metavar="RECIPE.yaml")
    s.add_argument("overrides", nargs="*", help="dotted key=value overrides, e.g. output=runs/m rules.1.linear.sft=0.3")
    s.add_argument("--report", default=None, help="also write every tensor's change norm and survival here (TSV)")
    s.add_argument("--overwrite", action="store_true", help="replace the output if it is an earlier HF checkpoint "
                   "written by nemo-jax (as `overwrite: true` in the recipe)")
    s.add_argument("--allow-nonfinite", action="store_true", help="write NaN / Inf tensors instead of stopping (as "
                   "`allow_nonfinite: true` in the recipe)")
    s.set_defaults(fn=cmd_merge)


def _add_lora(sub) -> None:
    s = sub.add_parser("lora", help="LoRA adapters: export to / import from PEFT (vLLM) adapter directories")
    lsub = s.add_subparsers(dest="lora_cmd", required=True)
    t = lsub.add_parser("export", help="adapter checkpoint or LoRA SFT run dir -> PEFT adapter dir")
    t.add_argument("src")
    t.add_argument("dst")
    t.add_argument("--format", choices=("peft", "vllm"), default="peft",
                   help="peft: routed experts as peft target_parameters (transformers>=5); vllm: per-expert modules")
    t.add_argument("--base-model", default=None, help="base_model_name_or_path to record in adapter_config.json")
    t.add_argument("--overwrite", action="store_true", help="replace DST if it is an earlier PEFT dir written by "
                   "nemo-jax")
    t.set_defaults(fn=cmd_lora_export)
    t = lsub.add_parser("import", help="PEFT adapter dir -> adapter checkpoint")
    t.add_argument("src", metavar="PEFT_DIR")
    t.add_argument("dst")
    t.add_argument("--model", default=None,
                   help="base model dir, run dir or config.json (default: base_model_name_or_path if a local dir)")
    t.add_argument("--overwrite", action="store_true", help="replace DST if it is an earlier adapter checkpoint "
                   "written by nemo-jax")
    t.set_defaults(fn=cmd_lora_import)


def _add_data(sub) -> None:
    s = sub.add_parser("data", help="SFT data: prepare chat JSONL / Parquet into sharded ArrayRecord files")
    dsub = s.add_subparsers(dest="data_cmd", required=True)
    t = dsub.add_parser("prepare", help="render + tokenise in worker processes; shards + manifest.json in OUT "
                                        "(re-running skips finished shards)")
    t.add_argument("src", nargs="+", metavar="SRC", help="chat JSONL (.jsonl) or Parquet (.parquet) files")
    t.add_argument("--tokenizer", required=True, help="dir with tokenizer.json + tokenizer_config.json (or builtin:NAME)")
    t.add_argument("--out", required=True, help="output directory (new, empty, or an earlier prepared output)")
    t.add_argument("--workers", type=POSITIVE, default=os.cpu_count() or 1, help="tokenising processes (default: all cores)")
    t.add_argument("--on-error", choices=("raise", "skip"), default="raise",
                   help="malformed lines: stop naming FILE:LINE, or skip and list them in the manifest")
    t.add_argument("--vocab-size", type=POSITIVE, default=None, help="token ids must be below this (default: the tokenizer's)")
    t.add_argument("--shard-mb", type=POSITIVE, default=64, help="JSONL megabytes per shard")
    t.add_argument("--overwrite", action="store_true", help="clear an earlier prepared output in OUT first (by "
                   "default its finished shards are reused)")
    t.set_defaults(fn=cmd_data_prepare)


def _add_sandbox(sub) -> None:
    s = sub.add_parser("sandbox", help="which sandbox backends work here (a command run in each, its start-up "
                       "cost), and --sweep: remove what killed runs left (docs/sandbox.md)")
    s.add_argument("--backend", default=None, help="comma-separated: bwrap, rlimit, docker, kubernetes (default: "
                   "bwrap and rlimit, and docker / kubernetes when their CLI is on PATH)")
    s.add_argument("--sweep", action="store_true", help="remove the sandboxes of dead runs (folders here; containers "
                   "and Pods of this machine's dead runs on the engines named)")
    s.set_defaults(fn=cmd_sandbox)


def _add_forward(sub) -> None:
    s = sub.add_parser("forward", help="one forward pass (smoke test) on a model or a config JSON")
    s.add_argument("model", nargs="?", default=os.path.join(os.path.dirname(__file__), "assets", "models", "tiny.json"))
    s.add_argument("--batch", type=POSITIVE, default=2)
    s.add_argument("--seq-len", type=POSITIVE, default=64)
    s.add_argument("--seed", type=int, default=0)
    s.set_defaults(fn=cmd_forward)


# every command's parser, in the order --help lists them
COMMANDS = (_add_sft, _add_grpo, _add_recipe, _add_eval, _add_demos, _add_plan, _add_generate, _add_serve,
            _add_rollout_worker, _add_plot, _add_import_hf, _add_export_hf, _add_merge, _add_lora, _add_data,
            _add_sandbox, _add_forward)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="nemo-jax", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True, parser_class=_Parser)
    for add in COMMANDS:
        add(sub)
    return p


def cmd_data_prepare(args):
    from nemo_jax.data.prepared import prepare

    m = prepare(args.src, args.tokenizer, args.out, workers=args.workers, vocab_size=args.vocab_size,
                on_error=args.on_error, chunk_bytes=args.shard_mb << 20, quiet=False, overwrite=args.overwrite)
    print(f"{args.out}: {m['documents']:,} documents, {m['tokens']:,} tokens ({m['assistant_tokens']:,} trained), "
          f"{len(m['shards'])} shards, lengths {m['min_length']}..{m['max_length']}, "
          f"{m['rejected_count']} rejected lines")
    if m["rejected"]:  # --on-error skip: nothing is dropped without a word
        r = m["rejected"][0]
        print(f"skipped {m['rejected_count']} lines ({len(m['rejected'])} listed in "
              f"{os.path.join(args.out, 'manifest.json')}), the first {r['file']}:{r['line']}: {r['reason']}",
              file=sys.stderr)


def main(argv=None):
    args = build_parser().parse_args(argv)
    choose_platforms()  # before cpu_only() is asked and before jax starts
    quiet_plugin_noise()  # no CUDA driver lines from an installed GPU plugin on a host without a GPU
    keep_freed_memory()  # CPU-only processes: see nemo_jax.hostmem
    tune_xla_cpu()
    tune_xla_gpu()
    cmd = fsutil.COMMAND = " ".join(  # e.g. "lora export" (recorded in the output markers)
        x for x in (args.cmd, getattr(args, "lora_cmd", None), getattr(args, "data_cmd", None)) if x)
    one_line_warnings(f"nemo-jax {cmd}")
    stop_on_signals()
    try:
        args.fn(args)
    except Stopped as e:  # SIGINT / SIGTERM before the command took the signals over (a trainer's loop does)
        _end_progress_bars()
        print(f"nemo-jax {cmd}: stopped by {e} before it finished (no output is half-written: rerun the same "
              "command to continue)", file=sys.stderr)
        raise SystemExit(128 + getattr(signal, str(e), signal.SIGINT)) from None
    except (ValueError, FileNotFoundError, MissingDependency) as e:
        _end_progress_bars()
        print(f"nemo-jax {cmd}: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    except OSError as e:  # a full disk, a read-only or missing folder: where and why, in one line
        _end_progress_bars()
        print(f"nemo-jax {cmd}: error: {e if e.filename is None else fsutil.describe_os_error(e)}", file=sys.stderr)
        raise SystemExit(1) from None
    except EnvironmentFailed as e:  # an environment's own error: its author's frames, then the line (no internals)
        _end_progress_bars()
        head = f"Traceback of the environment's code (most recent call last):\n{e.author_traceback}" \
            if e.author_traceback else ""
        print(f"{head}nemo-jax {cmd}: error: {e}", file=sys.stderr)
        raise SystemExit(1) from None


class Stopped(KeyboardInterrupt):
    """SIGINT or SIGTERM came before the command's own handling of them (a trainer saves and stops at a step)."""


def stop_on_signals() -> None:
    """SIGINT and SIGTERM stop the command at once, from the first moment: each raises `Stopped` in the main
    thread (files being written are cleaned up as on any error). A process started in the background of a script
    inherits SIGINT ignored, and a Ctrl-C before a trainer's loop took the signals over used to be lost: the run
    went on to its last step. Commands that handle the signals themselves (sft and grpo during training, serve,
    rollout-worker) take them over when they start."""
    def stop(signum, frame):
        raise Stopped(signal.Signals(signum).name)

    if threading.current_thread() is not threading.main_thread():  # (main() called from a thread: an embedding's)
        return
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, stop)


def one_line_warnings(prog: str) -> None:
    """Python warnings as one line each, `PROG: warning: message` (not the file, line number and source line of
    the code that warned: a user has nothing to do with them)."""
    import warnings

    warnings.formatwarning = lambda message, category, filename, lineno, line=None: f"{prog}: warning: {message}\n"


def _end_progress_bars():
    """Close the progress bars still open (a run stopped by an error mid-bar): the error line then stands on a line
    of its own, not glued to the bar's."""
    tqdm = sys.modules.get("tqdm")
    for bar in list(getattr(getattr(tqdm, "tqdm", None), "_instances", ())):
        bar.close()


if __name__ == "__main__":
    main()
