"""Supervised fine-tuning: the loop that ties model, mesh, data, optimiser, checkpoints and metrics together."""

from __future__ import annotations

import json
import os
import re
import time
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from nemo_jax.config.load import dump_yaml
from nemo_jax.config.model import NemotronHConfig
from nemo_jax.config.train import (SFTConfig, check_rerun, load_sft_config,  # noqa: F401 (load_sft_config: re-exported)
                                   resolve_mesh_sizes)
from nemo_jax.data.chat import ASSETS, ChatTokenizer, read_chat_jsonl
from nemo_jax.data.loader import PackedIterator, ShardedBatches
from nemo_jax.data.prepared import open_sources
from nemo_jax.fsutil import atomic_write_text, move_aside
from nemo_jax.kernels import resolve as resolve_kernels
from nemo_jax.model import model as M
from nemo_jax.model.spec import abstract_params, count_params, init as init_params, param_specs, path_str
from nemo_jax.parallel import distributed
from nemo_jax.parallel.mesh import batch_shards, batch_sharding, make_mesh
from nemo_jax.parallel.rules import Rules, param_shardings
from nemo_jax.runlock import check_free
from nemo_jax.train.checkpoint import RunCheckpointer, abstract_like, catch_stop_signals
from nemo_jax.train.metrics import MetricsLogger, check_logging, device_peak_flops, model_flops_per_token
from nemo_jax.lora import (CONSTANT_LEAVES, LoraConfig, adapter_shardings, attach, init_adapters,
                           save_adapter_checkpoint, summary_table)
from nemo_jax.train.optimizer import make_optimizer
from nemo_jax.train.step import TrainState, all_finite, make_eval_step, make_train_step, train_state_shardings

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


def model_config_path(name: str) -> str:
    if os.path.isfile(name):
        return name
    p = os.path.join(ASSETS, "models", f"{name}.json")
    if os.path.exists(p):
        return p
    raise FileNotFoundError(f"model.config: {name!r} is neither a file nor a shipped model config "
                            f"({', '.join(sorted(f[:-5] for f in os.listdir(os.path.join(ASSETS, 'models'))))})")


def options_from(section, mesh=None) -> M.Options:
    """Model options of a config's `model` section (its dtype checked by the config) on `mesh`: forward Options
    (which check the model's choices); `model.kernels: auto` is resolved here, from the mesh's devices (a single
    device's mesh is dropped from the options, but its platform still decides)."""
    return M.Options(dtype=DTYPES[section.dtype], remat=section.remat, moe_dispatch=section.moe_dispatch,
                     capacity_factor=section.capacity_factor, ep_capacity=section.ep_capacity,
                     moe_chunk_tokens=section.moe_chunk_tokens,
                     expert_parallel=section.expert_parallel, kernels=resolve_kernels(section.kernels, mesh),
                     attention=section.attention, mesh=mesh if mesh is not None and mesh.size > 1 else None)


def initial_params(c: SFTConfig, mesh, rules):
    """-> (model cfg, params placed in their shardings). `model.init` is anything `nemo_jax.sources` reads: a
    native model dir, an HF dir, a run dir (its latest good checkpoint; a LoRA run's adapters merged into its
    base) or RUN/checkpoints/N; with `model.init_sft_config`, a missing init run is trained first."""
    init = c.model.init
    if init != "random":
        if not os.path.exists(init) and c.model.init_sft_config:
            print(f"model.init {init} does not exist yet: training it with {c.model.init_sft_config}")
            main(c.model.init_sft_config, [f"run_dir={init}"])
        from nemo_jax.sources import load_any

        return load_any(init, dtype=jnp.float32, mesh=mesh, rules=rules)
    cfg = NemotronHConfig.from_file(model_config_path(c.model.config))
    shardings = param_shardings(param_specs(cfg), mesh, rules)
    params = jax.jit(lambda k: init_params(cfg, k), out_shardings=shardings)(jax.random.key(c.model.seed))
    return cfg, params


def initial_adapters(c, cfg, lora_cfg, shardings=None, *, tokenizer: str, make_source=None):
    """The adapters a LoRA run starts from: fresh ones (A random, B zero), or `lora.init`'s, trained first with
    `lora.init_sft_config` when missing: a LoRA SFT of that config from the same base model (`model.init`), with
    this run's targets, rank, alpha and `tokenizer` (`make_source`: what makes its environment data sources). The
    warm adapters must be of this run's LoRA layout (targets and rank: every tensor's shape; alpha and rsLoRA where
    the checkpoint records them); the result is placed in `shardings`."""
    lc = c.lora
    if lc.init is None:
        return init_adapters(cfg, lora_cfg, shardings=shardings)
    init = lc.init
    if not os.path.exists(init):
        if not lc.init_sft_config:
            raise FileNotFoundError(f"lora.init {init}: no such adapters (set lora.init_sft_config to train them)")
        print(f"lora.init {init} does not exist yet: training it with {lc.init_sft_config}", flush=True)
        same_base = [f"model.init={c.model.init}", "model.init_sft_config=null"] + (
            [f"model.config={c.model.config}", f"model.seed={c.model.seed}"] if c.model.init == "random" else [])
        main(lc.init_sft_config, [f"run_dir={init}", *same_base, f"data.tokenizer={tokenizer}",
                                  f"lora.targets={list(lc.targets)}", f"lora.rank={lc.rank}", f"lora.alpha={lc.alpha}",
                                  f"lora.rslora={lc.rslora}", "lora.init=null", "lora.init_sft_config=null"],
             make_source=make_source)
    theirs = _trained_from(init)
    if theirs is not None and c.model.init != "random" and os.path.abspath(theirs) != os.path.abspath(c.model.init):
        raise ValueError(f"lora.init {init} was trained from model.init {theirs}; this run starts from "
                         f"{c.model.init}: the adapters were fitted to another model (give lora.init a path of its "
                         "own for this base)")
    from nemo_jax.sources import load_adapters

    tree = load_adapters(init, cfg)
    want = jax.eval_shape(lambda: init_adapters(cfg, lora_cfg))
    got_shapes = jax.tree.map(lambda x: tuple(np.shape(x)), tree)
    want_shapes = jax.tree.map(lambda x: tuple(x.shape), want)
    if got_shapes != want_shapes:
        raise ValueError(f"lora.init {init}: its adapters are not of this run's lora.targets {list(lc.targets)} and "
                         f"lora.rank {lc.rank} (another layout: train them with the same lora settings)")
    recorded = _recorded_lora(init)
    if recorded is not None and (recorded.alpha, recorded.rslora) != (lora_cfg.alpha, lora_cfg.rslora):
        raise ValueError(f"lora.init {init}: trained with lora.alpha {recorded.alpha} (rslora {recorded.rslora}); "
                         f"this run has {lora_cfg.alpha} ({lora_cfg.rslora}): the same adapters would scale otherwise")
    if shardings is None:
        return jax.tree.map(jnp.asarray, tree)
    return jax.tree.map(lambda x, sh: jax.device_put(np.asarray(x), sh), tree, shardings)


def env_sources(data, run_dir: str, make_source, model):
    """`data.sources` entries an environment makes ({env: NAME, make: demonstrations | rejection_sampling, ...,
    weight}) -> entries of the chat JSONL files `make_source(entry, where, path, model)` writes, once, as
    RUN/data/env-<i>.jsonl (a rerun finds them made). `model`: (config, params, tokenizer) of the run's start."""
    if not any(isinstance(src, dict) and "env" in src for src in data.sources):
        return data
    import dataclasses

    first = next(i for i, src in enumerate(data.sources) if isinstance(src, dict) and "env" in src)
    if make_source is None:
        raise ValueError(f"data.sources[{first}]: an environment's data ({{env: ...}}) is made by `nemo-jax sft` and "
                         "`nemo-jax grpo` (nemo_jax.rl.warmstart), not by this caller")
    if jax.process_count() > 1:
        raise ValueError(f"data.sources[{first}]: an environment's data is made in a single process: make it with "
                         "a one-process run first (RUN/data/env-<i>.jsonl is then reused)")
    out = []
    for i, src in enumerate(data.sources):
        if not (isinstance(src, dict) and "env" in src):
            out.append(src)
            continue
        path = os.path.join(run_dir, "data", f"env-{i}.jsonl")
        if not os.path.exists(path):
            make_source(src, f"data.sources[{i}]", path, model)
        out.append({"path": path, **({"weight": src["weight"]} if "weight" in src else {})})
    return dataclasses.replace(data, sources=out)


def _trained_from(path: str) -> str | None:
    """The `model.init` a LoRA run at `path` trained from (its config.yaml), or None (not a run dir)."""
    from nemo_jax.fsutil import read_yaml

    conf = os.path.join(path, "config.yaml")
    if not os.path.isfile(conf):
        return None
    return ((read_yaml(conf) or {}).get("model") or {}).get("init")


def _recorded_lora(path: str):
    """The LoraConfig an adapter checkpoint or LoRA run records, or None (a PEFT dir: its shapes were checked)."""
    from nemo_jax.lora.checkpoint import is_adapter_checkpoint, load_adapter_checkpoint

    for p in (path, os.path.join(path, "adapters")):
        if is_adapter_checkpoint(p):
            return load_adapter_checkpoint(p)[1]
    return None


def row_images(cfg, data, tok: ChatTokenizer | None):
    """The loader's image handling for a vision-language model (None for a text-only one). The tokenizer's
    `<image>` token must be the model's image_token_id."""
    if cfg.vision is None:
        return None
    from nemo_jax.data.chat import IMAGE_TOKEN
    from nemo_jax.data.images import RowImages

    v = cfg.vision
    if tok is not None and tok.tokenizer.token_to_id(IMAGE_TOKEN) != v.image_token_id:
        raise ValueError(f"data.tokenizer ({tok.path}): {IMAGE_TOKEN} is token {tok.tokenizer.token_to_id(IMAGE_TOKEN)}, "
                         f"the model's image_token_id is {v.image_token_id}")
    return RowImages(v, data.max_image_patches or data.seq_len * v.merge ** 2, data.max_images,
                     data.on_error)


def packing_args(data) -> dict:
    """PackedIterator keywords from the config's data section."""
    return {"packing": data.packing, "long_documents": data.long_documents, "window": data.pack_window,
            "prefetch": data.prefetch}


@dataclass
class StepProgram:
    """The SFT (or LoRA SFT) step on a mesh, decided before any array exists: the Trainer fills it with arrays,
    `nemo-jax plan` compiles it with abstract ones (`abstract_inputs`)."""
    cfg: NemotronHConfig
    mesh: Any
    opts: M.Options
    lora_cfg: LoraConfig | None
    base_dtype: Any  # the frozen base's dtype under LoRA (None: no frozen base)
    model_shardings: Any  # of the full model's params
    trainable_shardings: Any  # of state.params (the model, or the adapters under LoRA)
    tx: Any
    sched: Any
    state_shardings: TrainState
    batch_sharding: Any
    step: Any  # jitted step(state, batch, frozen) -> (state, metrics); the state is donated
    eval_step: Any  # jitted ev(params, batch, frozen) -> (summed NLL, tokens)
    combine: Any
    data: Any = None  # the config's data section (the image budget of a row)

    def abstract_trainable(self):
        if self.lora_cfg is None:
            return abstract_params(self.cfg)
        return jax.eval_shape(lambda: init_adapters(self.cfg, self.lora_cfg))

    def abstract_inputs(self, batch_rows: int, seq_len: int) -> tuple:
        """(state, batch, frozen) as ShapeDtypeStructs in their shardings: what `step` is lowered with."""
        sds = lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s)
        trainable = self.abstract_trainable()
        opt = jax.eval_shape(self.tx.init, trainable)
        scalar, key = jax.ShapeDtypeStruct((), jnp.int32), jax.eval_shape(
            lambda: jax.random.key_data(jax.random.key(0)))
        state = jax.tree.map(sds, TrainState(trainable, opt, scalar, scalar, scalar, key), self.state_shardings)
        b = lambda dt: jax.ShapeDtypeStruct((batch_rows, seq_len), dt, sharding=self.batch_sharding)
        batch = {"tokens": b(jnp.int32), "targets": b(jnp.int32), "loss_mask": b(jnp.bool_),
                 "segment_ids": b(jnp.int32)}
        if self.cfg.vision is not None:  # each row's image budget (data.max_image_patches / max_images)
            row = row_images(self.cfg, self.data, None).row([])
            batch.update({k: jax.ShapeDtypeStruct((batch_rows, *v.shape), v.dtype, sharding=self.batch_sharding)
                          for k, v in row.items()})
        frozen = None
        if self.base_dtype is not None:
            frozen = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, self.base_dtype, sharding=s),
                                  abstract_params(self.cfg), self.model_shardings)
        return state, batch, frozen


def step_program(c: SFTConfig, cfg, mesh, rules) -> StepProgram:
    """Everything about the step that follows from the config, the model config and the mesh."""
    opts = options_from(c.model, mesh)
    model_sh = param_shardings(param_specs(cfg), mesh, rules)
    lora_cfg, base_dtype, combine, trainable_sh = None, None, None, model_sh
    if c.lora.targets:
        lora_cfg = LoraConfig(tuple(c.lora.targets), c.lora.rank, c.lora.alpha, c.lora.rslora, c.lora.init_seed)
        base_dtype = DTYPES[c.lora.base_dtype]
        trainable_sh = adapter_shardings(cfg, lora_cfg, mesh, rules)
        combine = lambda adapters, base: attach(base, adapters)  # noqa: E731
    o = c.optim
    shards = batch_shards(mesh)
    if c.data.batch_size % (o.grad_accum * shards):
        raise ValueError(f"data.batch_size={c.data.batch_size} must split into optim.grad_accum={o.grad_accum} "
                         f"micro-batches whose rows divide over {shards} batch shards (data*fsdp*expert)")
    trainable = (abstract_params(cfg) if lora_cfg is None
                 else jax.eval_shape(lambda: init_adapters(cfg, lora_cfg)))
    frozen = None if lora_cfg is None else CONSTANT_LEAVES  # the LoRA scale is a constant, never trained
    if c.model.frozen_pattern() and lora_cfg is None:
        frozen = c.model.frozen_pattern()  # no update, no Adam moments; and no gradient computed through them:
        combine = _stop_gradient_where(trainable, frozen)
    tx, sched = make_optimizer(o, trainable, c.steps, frozen)
    state_sh = train_state_shardings(tx, trainable, trainable_sh, mesh)  # Adam moments sharded like params
    step = make_train_step(cfg, opts, tx, sched, o, o.grad_accum, combine)
    return StepProgram(cfg, mesh, opts, lora_cfg, base_dtype, model_sh, trainable_sh, tx, sched, state_sh,
                       batch_sharding(mesh), jax.jit(step, donate_argnums=0, out_shardings=(state_sh, None)),
                       jax.jit(make_eval_step(cfg, opts, combine, o.grad_accum)), combine, c.data)


def _stop_gradient_where(params, pattern: str):
    """combine(params, _) -> params with `stop_gradient` on every leaf whose path matches `pattern`
    (`model.freeze`); a pattern that matches no parameter is an error naming it."""
    rx = re.compile(pattern)
    hit = [path_str(p) for p, _ in jax.tree_util.tree_flatten_with_path(params)[0] if rx.search(path_str(p))]
    if not hit:
        raise ValueError(f"model.freeze: {pattern!r} matches no parameter of this model (a text model has no "
                         "vision tower or projector)")

    def combine(params, _):
        return jax.tree_util.tree_map_with_path(
            lambda p, x: jax.lax.stop_gradient(x) if rx.search(path_str(p)) else x, params)
    return combine


class Trainer:
    def __init__(self, c: SFTConfig, *, quiet: bool = False, devices=None, make_source=None):
        """make_source(entry, where, path, model): writes the chat JSONL an environment data source of `data.sources`
        describes ({env: ...}; `nemo_jax.rl.warmstart.make_source`); without it such a source is refused."""
        check_logging(c.logging)  # a bad wandb mode or a missing extra fails before any work
        self.c = c
        self.quiet = quiet
        self.run_dir = os.path.abspath(c.run_dir or os.path.join("runs", c.name))
        self.mesh = make_mesh(c.mesh.sizes(), devices, c.mesh.devices_per_node)
        self.rules = Rules()
        self.cfg, params = initial_params(c, self.mesh, self.rules)
        if c.data.batch_size % jax.process_count():
            raise ValueError(f"data.batch_size={c.data.batch_size} not divisible by {jax.process_count()} processes")
        prog = self.program = step_program(c, self.cfg, self.mesh, self.rules)
        self.opts, self.lora_cfg, self.frozen = prog.opts, prog.lora_cfg, None
        start = params  # the model the run starts from (environment data sources may sample it)
        if prog.lora_cfg is not None:  # the trainable tree is the adapters; the base is frozen in lora.base_dtype
            dt = prog.base_dtype
            self.frozen = jax.jit(lambda p: jax.tree.map(lambda x: x.astype(dt), p),
                                  out_shardings=prog.model_shardings)(params)
            params = initial_adapters(c, self.cfg, prog.lora_cfg, prog.trainable_shardings,
                                      tokenizer=c.data.tokenizer, make_source=make_source)
            if not quiet:
                print(summary_table(self.cfg, prog.lora_cfg))
        self.tx, self.sched = prog.tx, prog.sched
        opt_state = jax.jit(self.tx.init, out_shardings=prog.state_shardings.opt_state)(params)
        rng = jax.random.key_data(jax.random.key(c.model.seed + 1))
        z = lambda: jnp.zeros((), jnp.int32)  # distinct buffers (the state is donated)
        self.state_shardings = prog.state_shardings
        self.state = jax.device_put(TrainState(params, opt_state, z(), z(), z(), rng), self.state_shardings)
        self.batch_sharding = prog.batch_sharding
        self.step_fn, self.eval_fn = prog.step, prog.eval_step
        self.tok = ChatTokenizer.load(c.data.tokenizer)
        self.eval_docs = None
        if c.data.eval:  # read (and checked) before any data is prepared into the run dir
            self.eval_docs, _ = read_chat_jsonl(c.data.eval, self.tok, self.cfg.vocab_size, c.data.on_error)
        cache = os.path.join(self.run_dir, "data" if jax.process_count() == 1 else f"data/process-{jax.process_index()}")
        data = env_sources(c.data, self.run_dir, make_source, (self.cfg, start, self.tok))
        del start
        docs, weights, self.source_names, self.rejected_lines = open_sources(data, self.cfg.vocab_size, cache,
                                                                              quiet=quiet)
        # The global batch is made of data.shards shards (default: one per row range the processes hold), each
        # packed from its own share of the documents; a process reads only the shards its rows fall in. The
        # batch (and a checkpoint's data position) depends on the shard count, not on the process count.
        spans = _process_rows(self.batch_sharding, c.data.batch_size, c.data.seq_len)
        self.local_rows = lo, hi = spans[jax.process_index()]
        self.data_shards = c.data.shards or len(set(spans.values()))
        self.images = row_images(self.cfg, c.data, self.tok)
        self.it = ShardedBatches(docs, c.data.seq_len, c.data.batch_size, self.data_shards, lo, hi, c.data.seed,
                                 weights=weights, workers=c.data.workers, images=self.images, **packing_args(c.data))
        per = c.data.batch_size // self.data_shards  # the shards whose counters this process reports: those
        self.counted_shards = [k for k in self.it.mine  # whose first row no lower-numbered process holds
                               if min(p for p, (a, b) in spans.items() if a < (k + 1) * per and b > k * per)
                               == jax.process_index()]
        self._counted_rows = np.asarray([min(p for p, (a, b) in spans.items() if a <= r < b) == jax.process_index()
                                         for r in range(lo, hi)])  # rows whose tokens this process reports
        self.trace_dir = os.environ.get("NEMO_JAX_TRACE_BATCHES")  # debugging: per-process row digests
        self.ckpt = RunCheckpointer(os.path.join(self.run_dir, "checkpoints"), c.checkpoint.keep,
                                    c.checkpoint.async_save, verify=c.checkpoint.verify)
        self.saved_steps = set(self.ckpt.steps())
        self.flops_per_token = model_flops_per_token(self.cfg, c.data.seq_len)
        self.peak = device_peak_flops()
        self.stop_requested = False

    # ------------------------------------------------------------------ pieces
    def _global_batch(self, np_batch: dict, local: bool = True) -> dict:
        """This process's rows (`local`; else the global numpy batch, of which it takes its rows) -> global jax
        arrays."""
        lo, hi = (0, None) if local else self.local_rows
        return {k: jax.make_array_from_process_local_data(self.batch_sharding, v[lo:hi]) for k, v in np_batch.items()}

    def _trace(self, step: int, np_batch: dict):
        import hashlib

        rows = [hashlib.sha1(np.ascontiguousarray(r)).hexdigest()[:16] for r in np_batch["tokens"]]
        with open(os.path.join(self.trace_dir, f"batches.{jax.process_index()}.jsonl"), "a") as f:
            f.write(json.dumps({"step": step, "process": jax.process_index(), "rows": rows}) + "\n")

    def _any_process(self, flag: bool) -> bool:
        """True on every process when any process has the flag (a stop request must be taken by all)."""
        if jax.process_count() == 1:
            return flag
        from jax.experimental import multihost_utils

        return bool(np.any(multihost_utils.process_allgather(np.int32(flag))))

    def evaluate(self) -> float | None:
        if not self.eval_docs:
            return None
        # the same global batches on every process (each takes its rows), so all processes run the collective
        # eval step the same number of times; rows past the end of the eval set are empty (loss_mask 0)
        it = PackedIterator(self.eval_docs, self.c.data.seq_len, self.c.data.batch_size, 0, shuffle=False,
                            repeat=False, images=self.images, **packing_args(self.c.data))
        total = count = 0.0
        try:
            for i, b in enumerate(it):
                if i >= self.c.data.max_eval_batches:
                    break
                t, n = self.eval_fn(self.state.params, self._global_batch(b, local=False), self.frozen)
                total += float(t)
                count += float(n)
        finally:
            it.close()
        return total / max(count, 1.0)

    def save(self, force: bool = False):
        # decided from what this process itself saved or found at start, never from a fresh directory listing:
        # processes that disagreed (one seeing the primary's new step, one not) would deadlock in the save
        if int(self.state.step) in self.saved_steps:
            return
        self.saved_steps.add(int(self.state.step))
        if not bool(all_finite(self.state.params)):
            print("warning: parameters are not finite; checkpoint not written")
            return
        meta = {"step": int(self.state.step), "config": json.loads(json.dumps(_asdict(self.c))),
                "model_config": self.cfg.to_hf_dict(), "process_count": jax.process_count()}
        self.ckpt.save(int(self.state.step), self.state, self._data_states(), meta, force=force)
        if self.lora_cfg is not None:  # the latest adapters, readable without the optimiser (lora export, eval)
            save_adapter_checkpoint(os.path.join(self.run_dir, "adapters"), self.cfg, self.lora_cfg, self.state.params,
                                    overwrite=True)

    def _over_processes(self, *counts: int) -> tuple[int, ...]:
        """Counts of this process -> summed over all processes (every process must call it)."""
        if jax.process_count() == 1:
            return counts
        from jax.experimental import multihost_utils

        every = np.asarray(multihost_utils.process_allgather(np.asarray(counts, np.int64)))
        return tuple(int(x) for x in every.reshape(jax.process_count(), -1).sum(0))

    def _data_states(self) -> dict:
        """Every data shard's iterator position (gathered from the processes that read it)."""
        states = self.it.get_state()
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            raw = np.frombuffer(json.dumps(states).encode(), np.uint8)
            n = int(np.max(multihost_utils.process_allgather(np.int32(len(raw)))))
            every = np.asarray(multihost_utils.process_allgather(np.pad(raw, (0, n - len(raw)))))
            for row in every.reshape(jax.process_count(), -1):
                states.update(json.loads(bytes(row).rstrip(b"\0")))
        return {"shards": [states[str(k)] for k in range(self.data_shards)]}

    def maybe_restore(self) -> bool:
        target = abstract_like(self.state, self.state_shardings)
        got = self.ckpt.restore_latest(target)
        if got is None:
            return False
        step, state, data_state, _ = got
        self.state = state
        # the steps left after a damaged one was moved aside (the same listing on every process, after the
        # restore's barrier): a step no longer on disk is saved again when training passes it
        self.saved_steps = set(self.ckpt.steps())
        shards = data_state.get("shards")
        if shards is None or len(shards) != self.data_shards:
            raise ValueError(f"{self.ckpt.directory}: the checkpoint's data positions are for "
                             f"{'an older loader' if shards is None else f'{len(shards)} data shards'}; this run "
                             f"reads {self.data_shards} (data.shards, by default one per row range the processes "
                             "hold): set data.shards to the saved count, or start afresh")
        self.it.set_state({str(k): st for k, st in enumerate(shards)})
        if not self.quiet:
            print(f"resumed from {self.ckpt.directory} at step {step}")
        return True

    def _on_signal(self, signum):
        self.stop_requested = True
        if not self.quiet:
            print(f"\nsignal {signum}: saving a checkpoint and stopping after this step")

    # ------------------------------------------------------------------ loop
    def run(self) -> dict:
        from tqdm import tqdm

        c = self.c
        os.makedirs(self.run_dir, exist_ok=True)
        self.maybe_restore()
        restore_signals = catch_stop_signals(self._on_signal)
        logger = MetricsLogger(self.run_dir, enabled=jax.process_index() == 0, logging=c.logging,
                               config=_asdict(c), name=c.name)
        start = int(self.state.step)
        show = not self.quiet and jax.process_index() == 0
        say = print if show else (lambda *a, **k: None)
        last = {}
        if start == 0 and self.eval_docs and c.eval_every:  # (eval_every=0: no eval at all, nor its compile)
            t = time.perf_counter()
            ev = self.evaluate()
            logger.log({"step": 0, "eval_loss": ev})
            last["eval_loss"] = ev
            say(f"eval at step 0: loss {ev:.4f} ({time.perf_counter() - t:.1f} s, its compile included)", flush=True)
        # the progress bar starts after the first step, whose time is the compile's: its rate and ETA are then
        # those of the steps that follow
        bar = None
        if start < c.steps:
            say(f"compiling the train step (step {start + 1} of {c.steps}) ...", flush=True)
        t0, tokens_since, rows_since = time.perf_counter(), 0, 0
        step = start
        while step < c.steps and not self._any_process(self.stop_requested):
            np_batch = next(self.it)
            if self.trace_dir:
                self._trace(step + 1, np_batch)
            tokens_since += int(np.sum(np_batch["segment_ids"][self._counted_rows] > 0))  # summed at logging
            rows_since += np_batch["segment_ids"][self._counted_rows].size
            self.state, m = self.step_fn(self.state, self._global_batch(np_batch), self.frozen)
            step += 1
            self.ckpt.check()  # a background save that failed (e.g. a full disk) stops the run here
            if int(m["skipped_updates"]) and int(self.state.nonfinite_run) >= c.optim.max_nonfinite_in_a_row:
                logger.close()
                raise RuntimeError(f"{int(self.state.nonfinite_run)} non-finite updates in a row at step {step}; "
                                   "stopping (the last checkpoint holds finite values)")
            compiled_now = bar is None
            if compiled_now:
                say(f"compiled and ran step {step} in {time.perf_counter() - t0:.1f} s", flush=True)
                bar = tqdm(total=c.steps, initial=step - 1, desc="sft", disable=not show, dynamic_ncols=True)
            if step % c.log_every == 0 or step == c.steps:
                dt = time.perf_counter() - t0
                tokens_since, rows_since, split, dropped, truncated, *per_source = self._over_processes(
                    tokens_since, rows_since, *self.it.counts(self.counted_shards))
                tps = tokens_since / max(dt, 1e-9)
                rec = {"step": step, **{k: _scalar(v) for k, v in m.items() if k != "expert_load"}}
                rec["tokens_per_sec"] = tps
                # real tokens / row tokens of the batches since the last log; documents split / dropped, tokens
                # of each source: since this process started (all data shards)
                rec.update(packing_efficiency=tokens_since / max(rows_since, 1), documents_split=split,
                           documents_dropped=dropped, documents_truncated=truncated)
                if len(self.source_names) > 1:
                    rec.update({f"source_tokens/{n}": t for n, t in zip(self.source_names, per_source)})
                if self.peak:
                    rec["mfu"] = tps * self.flops_per_token / (self.peak * jax.device_count())
                if "expert_load" in m:
                    rec["expert_load"] = np.asarray(m["expert_load"]).round(1).tolist()
                logger.log(rec)
                last.update(rec)
                bar.set_postfix(loss=f"{rec['loss']:.3f}", tok_s=f"{tps:,.0f}", refresh=False)
                t0, tokens_since, rows_since = time.perf_counter(), 0, 0
            if c.eval_every and step % c.eval_every == 0 and self.eval_docs:
                ev = self.evaluate()
                logger.log({"step": step, "eval_loss": ev})
                last["eval_loss"] = ev
                bar.write(f"step {step}: eval_loss {ev:.4f}")
            if c.checkpoint.every and step % c.checkpoint.every == 0:
                self.save()
            bar.update(1)
            if compiled_now:  # throughput from the first compiled step on
                t0, tokens_since, rows_since = time.perf_counter(), 0, 0
        if bar is not None:
            bar.close()
        self.save(force=True)
        restore_signals()
        self.ckpt.close()
        self.it.close()
        logger.close()
        last["step"] = step
        last["stopped_early"] = self.stop_requested
        return last


def start_run(run_dir: str, c, command: str, new_run: bool = False) -> None:
    """Before a training command builds anything in `run_dir`: with `new_run`, an earlier run there is moved
    aside to RUN.prev (never deleted; process 0 moves it, every process waits for that); else a run there with
    other settings is refused (`config.train.check_rerun`). A run dir another process is writing is refused
    first, naming that process (`runlock.check_free`): it is neither judged nor moved."""
    if jax.process_index() == 0:
        check_free(run_dir)
    if not new_run:
        note = check_rerun(c, run_dir)
        if note and jax.process_index() == 0:
            print(f"{command}: {note}", flush=True)
        return
    if jax.process_index() == 0 and os.path.lexists(run_dir) and os.listdir(run_dir):
        print(f"{command}: --new-run: the earlier run in {run_dir} moved aside to {move_aside(run_dir, 'prev')}",
              flush=True)
    if jax.process_count() > 1:
        distributed.barrier(f"nemo-jax {command}: new run", 300.0)


def _process_rows(sharding, batch: int, seq_len: int) -> dict[int, tuple[int, int]]:
    """-> {process: the contiguous global row range [lo, hi) its devices hold under the batch sharding}."""
    ranges = {}
    for d, s in sharding.devices_indices_map((batch, seq_len)).items():
        ranges.setdefault(d.process_index, []).append((s[0].start or 0, batch if s[0].stop is None else s[0].stop))
    spans = {}
    for p, rs in ranges.items():
        lo, hi = min(a for a, _ in rs), max(b for _, b in rs)
        covered = set()
        for a, b in rs:
            covered.update(range(a, b))
        if covered != set(range(lo, hi)):
            raise ValueError(f"mesh: process {p} holds non-contiguous batch rows {sorted(covered)}")
        spans[p] = (lo, hi)
    return spans


def _scalar(v):
    v = np.asarray(v)
    return v.item() if v.size == 1 else v.tolist()


def _asdict(c):
    import dataclasses

    return dataclasses.asdict(c)


def main(path: str | None = None, overrides=(), *, config: SFTConfig | None = None, verbose: bool = False,
         new_run: bool = False, make_source=None):
    """`nemo-jax sft`: the config (`config`, or loaded from `path` + `overrides`) is validated before anything
    is written; the run dir gets its config.yaml once the trainer is built (model, data and mesh checked), and a
    run dir this call created is removed again when building the trainer fails. A run dir holding checkpoints
    of a run with other settings is refused (`check_rerun`), or with `new_run` moved aside to RUN.prev first.
    The run dir's write lock is held throughout (`distributed.writer_lock`): a second writer of it stops at once,
    naming this one. The resolved config is printed in full with `verbose` only (it is always in
    RUN/config.yaml)."""
    c = config or load_sft_config(path, overrides)
    distributed.initialize(c.distributed)  # before any device use
    resolve_mesh_sizes(c.mesh.sizes(), jax.device_count())  # the mesh fits the devices, before anything is said
    run_dir = os.path.abspath(c.run_dir or os.path.join("runs", c.name))
    options_from(c.model)  # the model's own choices (remat, attention, ...) before anything is written
    start_run(run_dir, c, "sft", new_run)
    text = dump_yaml(c)
    new_dir = not os.path.exists(run_dir)
    with (distributed.failure_guard("sft"),  # a lost peer: name it, exit non-zero at once
          distributed.writer_lock(run_dir, "nemo-jax sft") as lock):  # one writer per run dir
        if jax.process_index() == 0:
            if verbose:
                print(f"# resolved config ({path or 'embedded default: tiny CPU SFT'})\n{text}")
            print(f"sft: run {c.name!r} from {path or 'the embedded tiny CPU config'}, {c.steps} steps of "
                  f"{c.data.batch_size} x {c.data.seq_len} tokens, into {run_dir}"
                  + ("" if verbose else " (--verbose prints the resolved config)"), flush=True)
        try:
            tr = Trainer(c, make_source=make_source)
        except Exception:  # (an interrupt keeps what was prepared, for the rerun)
            if new_dir and jax.process_index() == 0 and os.path.isdir(run_dir):
                import shutil

                lock.release()
                shutil.rmtree(run_dir, ignore_errors=True)  # made by this call, holding nothing of value
            raise
        if jax.process_index() == 0:
            atomic_write_text(os.path.join(run_dir, "config.yaml"), text)
        print(f"model: {count_params(tr.cfg):,} parameters, pattern {tr.cfg.pattern}; mesh {dict(tr.mesh.shape)}; "
              f"resolved config in {os.path.join(run_dir, 'config.yaml')}")
        out = tr.run()
    summary = {k: out[k] for k in ("step", "loss", "eval_loss", "tokens_per_sec", "stopped_early") if k in out}
    print("done:", json.dumps(summary))
    if jax.process_index() == 0:
        kept = [n for n in ("checkpoints", "adapters", "metrics.jsonl", "tensorboard", "config.yaml")
                if os.path.exists(os.path.join(run_dir, n))]
        print(f"outputs in {run_dir}: {', '.join(kept)}  (nemo-jax generate --ckpt {run_dir} ..., "
              f"nemo-jax plot {run_dir}, nemo-jax export-hf {run_dir} OUT)")
    return out
