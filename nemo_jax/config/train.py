"""Run configuration for SFT and GRPO: small frozen dataclasses, one per concern.

Every section checks its own values when it is built (`__post_init__`): sizes and counts positive, ranges and
choices checked, each failure a `SettingError` naming the key (`config.load.from_dict` prefixes the section,
e.g. `data.batch_size`). Loading a config therefore rejects a bad setting before JAX is imported, before any work
and before the run dir exists. (Choices that belong to the model, such as model.remat or model.attention, are
checked by `nemo_jax.model.Options`, also before the run dir is made.)
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

MODEL_KERNELS = ("auto", "reference")  # model.kernels (nemo_jax.kernels)
PUBLISH_FORMATS = ("peft", "vllm")  # rollout.publish_format (nemo_jax.lora.peft.save_peft formats)


class SettingError(ValueError):
    """A setting out of its range, naming its dotted key (e.g. `data.batch_size`)."""

    def __init__(self, section, name: str, msg: str):
        where = getattr(section, "SECTION", "")  # each section class names where it sits in a run config
        self.key, self.msg = f"{where}.{name}" if where else name, msg
        super().__init__(f"{self.key}: {msg}")


def _at_least(section, lo, *names):
    for n in names:
        v = getattr(section, n)
        if v < lo:
            raise SettingError(section, n, f"must be >= {lo}, got {v!r}")


def _within(section, name: str, lo: float, hi: float, *, hi_open: bool = False, lo_open: bool = False):
    v = getattr(section, name)
    if (v <= lo if lo_open else v < lo) or (v >= hi if hi_open else v > hi):
        raise SettingError(section, name, f"must be in {'(' if lo_open else '['}{lo}, {hi}{')' if hi_open else ']'}, "
                                          f"got {v!r}")


def _one_of(section, name: str, choices: tuple):
    v = getattr(section, name)
    if v not in choices:
        raise SettingError(section, name, f"{v!r} is not one of {', '.join(map(str, choices))}")


DTYPES = ("float32", "bfloat16")
CAST_DTYPES = {"bf16": "bfloat16", "bfloat16": "bfloat16", "fp32": "float32", "float32": "float32",
               "fp16": "float16", "float16": "float16"}  # the names a --dtype flag accepts


def cast_dtype(name: str | None):
    """A `--dtype` value (`bf16`, `fp32`, `fp16` or their long names) -> that jnp dtype; None, "" or "keep" -> None
    (keep each tensor's own dtype). An unknown name is a ValueError naming the flag."""
    if name in (None, "", "keep"):
        return None
    if name not in CAST_DTYPES:
        raise ValueError(f"--dtype: unknown dtype {name!r} (use one of {', '.join(sorted(CAST_DTYPES))})")
    import jax.numpy as jnp

    return getattr(jnp, CAST_DTYPES[name])


FREEZE_PARTS = {"vision": r"^vision/", "projector": r"^projector/"}  # model.freeze names -> parameter-path regexes


@dataclass(frozen=True)
class ModelSection:
    SECTION = "model"  # where it sits in a run config (named in errors)
    config: str = "tiny"  # name in configs/model, a model config JSON path
    init: str = "random"  # "random" | path to a native model dir | an HF dir | an SFT run dir
    init_sft_config: str | None = None  # when `init` does not exist yet: an SFT config that trains it first (a
    # relative path: from the config file's folder or one above it, else the working directory)
    dtype: str = "float32"  # compute dtype: float32 | bfloat16
    remat: str = "none"  # none | layer | save_matmuls | save_frozen (LoRA: keep the frozen base's matmul outputs)
    moe_dispatch: str = "sorted"
    capacity_factor: float = 1.25
    # expert parallelism: all_to_all (each token sent once per peer owning one of its experts, <= capacity_factor x
    # the even share of rows per peer, overflow dropped, logged as moe_dropped_frac) | all_gather (exact; dropless
    # unless ep_capacity > 0 bounds the buffer)
    expert_parallel: str = "all_to_all"
    ep_capacity: float = 0.0  # all_gather: per-device expert buffer = this x the even share (0: dropless, ep x)
    # expert parallelism: each device's tokens go through the routed experts at most this many at a time (0: all at
    # once): bounds a MoE layer's dispatch buffers and [slots, I] activations; the weights are gathered once per layer
    moe_chunk_tokens: int = 0
    attention: str = "blocked"  # blocked | ring (context-parallel K/V passed around the ring) | full (reference)
    # accelerator kernels (nemo_jax.kernels, docs/kernels.md): auto (the compile target's: cuDNN / Pallas flash attention
    # and Pallas grouped-matmul experts on GPU, splash attention and megablox experts on TPU; the reference on CPU) |
    # reference (plain jnp everywhere)
    kernels: str = "auto"
    # full fine-tuning: parts that get no gradient, no update and no optimiser state: `vision` (the vision tower),
    # `projector` (vision-language models), or parameter-path regexes (e.g. "^lm_head/")
    freeze: list[str] = field(default_factory=list)
    freeze_vision: bool = False  # the same as `vision` in `freeze` (kept for existing configs)
    seed: int = 0

    def __post_init__(self):
        _one_of(self, "dtype", DTYPES)
        if isinstance(self.freeze, str):
            object.__setattr__(self, "freeze", [self.freeze])
        for f in self.freeze:
            if not isinstance(f, str) or not f:
                raise SettingError(self, "freeze", f"{f!r}: give part names ({', '.join(FREEZE_PARTS)}) or "
                                                   "parameter-path regexes")
            try:
                re.compile(FREEZE_PARTS.get(f, f))
            except re.error as e:
                raise SettingError(self, "freeze", f"{f!r} is neither a part ({', '.join(FREEZE_PARTS)}) nor a "
                                                   f"valid regex: {e}") from None
        _within(self, "capacity_factor", 0, float("inf"), lo_open=True)
        _at_least(self, 0, "ep_capacity", "moe_chunk_tokens")
        _one_of(self, "kernels", MODEL_KERNELS)

    def frozen_pattern(self) -> str | None:
        """One regex over parameter paths for every frozen part (None: nothing frozen)."""
        parts = list(self.freeze) + (["vision"] if self.freeze_vision and "vision" not in self.freeze else [])
        return "|".join(f"(?:{FREEZE_PARTS.get(f, f)})" for f in parts) or None


@dataclass(frozen=True)
class DataSection:
    SECTION = "data"  # where it sits in a run config (named in errors)
    train: str = "builtin:tiny_chat/train.jsonl"
    # a weighted mixture instead of `train`: [{path: ..., weight: ...}, ...] (weight defaults to 1)
    sources: list[dict] = field(default_factory=list)
    eval: str | None = "builtin:tiny_chat/eval.jsonl"
    tokenizer: str = "builtin:tiny"  # dir with tokenizer.json + tokenizer_config.json
    seq_len: int = 256
    batch_size: int = 8  # global rows per optimizer step (all micro-batches together)
    seed: int = 0
    on_error: str = "raise"  # raise | skip  (malformed lines, missing or corrupt images)
    # vision-language models: each row's images within a budget (documents are packed to fit it)
    max_image_patches: int = 0  # patches of all images in a row (0: what the row's tokens could hold, seq_len x 4)
    max_images: int = 4  # images in a row
    max_eval_batches: int = 4
    packing: str = "ffd"  # ffd (first-fit decreasing in windows of pack_window documents) | greedy (next-fit, in order)
    pack_window: int = 1024
    long_documents: str = "split"  # documents longer than a row (ffd): split into consecutive pieces | drop
    shards: int = 0  # data shards of the global batch, each its own share of the documents (0: one per row range
    #                  the processes hold); the same count reproduces the same batches on any number of processes
    workers: int = 0  # grain loader worker processes (0: load in the training process)
    prefetch: int = 2  # batches each loader worker keeps ready
    prepare_workers: int = 1  # processes tokenising JSONL given directly (prepared into RUN_DIR/data)

    def __post_init__(self):
        _at_least(self, 1, "seq_len", "batch_size", "max_eval_batches", "pack_window", "prepare_workers")
        _at_least(self, 0, "max_image_patches", "max_images", "shards", "workers", "prefetch")
        _one_of(self, "on_error", ("raise", "skip"))
        _one_of(self, "packing", ("ffd", "greedy"))
        _one_of(self, "long_documents", ("split", "drop"))


@dataclass(frozen=True)
class OptimSection:
    SECTION = "optim"  # where it sits in a run config (named in errors)
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 20
    decay: str = "cosine"  # cosine | linear | constant
    weight_decay: float = 0.01
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    clip_norm: float = 1.0
    mu_dtype: str = "float32"  # Adam's first moment: float32 | bfloat16 (2 bytes per parameter less; the second stays fp32)
    grad_accum: int = 1
    aux_loss_coef: float = 1e-3
    bias_update_rate: float = 1e-3  # aux-loss-free correction-bias update (0 = off)
    mtp_loss_coef: float = 0.0
    max_nonfinite_in_a_row: int = 5

    def __post_init__(self):
        _within(self, "lr", 0, float("inf"))
        _within(self, "min_lr_ratio", 0, 1)
        _one_of(self, "decay", ("cosine", "linear", "constant"))
        _within(self, "b1", 0, 1, hi_open=True)
        _within(self, "b2", 0, 1, hi_open=True)
        _within(self, "eps", 0, float("inf"), lo_open=True)
        _at_least(self, 0, "warmup_steps", "weight_decay", "clip_norm", "aux_loss_coef", "bias_update_rate",
                  "mtp_loss_coef")
        _at_least(self, 1, "grad_accum", "max_nonfinite_in_a_row")
        _one_of(self, "mu_dtype", ("float32", "bfloat16"))


@dataclass(frozen=True)
class MeshSection:
    SECTION = "mesh"  # where it sits in a run config (named in errors)
    data: int = 1
    fsdp: int = -1
    tensor: int = 1
    expert: int = 1
    context: int = 1  # context parallelism: each row's sequence split this many ways (mamba state / K,V passed)
    # devices per node (tensor and expert are kept inside one, data/fsdp span nodes: parallel.mesh.make_mesh);
    # 0 = one node per process (one process per host, as launch/ starts them) or per TPU slice
    devices_per_node: int = 0

    def __post_init__(self):
        sizes = self.sizes()
        for k, v in sizes.items():
            if v == 0 or v < -1:
                raise SettingError(self, k, f"must be a positive size or -1 (the devices left over), got {v!r}")
        free = [k for k, v in sizes.items() if v == -1]
        if len(free) > 1:
            raise SettingError(self, free[1], f"only one mesh axis may be -1 (also {free[0]})")
        _at_least(self, 0, "devices_per_node")

    def sizes(self) -> dict[str, int]:
        """Axis sizes for `parallel.mesh.make_mesh` (-1 = the devices left over)."""
        return {"data": self.data, "fsdp": self.fsdp, "tensor": self.tensor, "expert": self.expert,
                "context": self.context}


@dataclass(frozen=True)
class LoraSection:
    """LoRA SFT (nemo_jax.lora): off while `targets` is empty. Only the adapters are trained and checkpointed."""
    SECTION = "lora"  # where it sits in a run config (named in errors)
    targets: list[str] = field(default_factory=list)  # presets (attention, mamba, mlp, experts, lm_head, all) or path regexes
    rank: int = 8
    alpha: float = 16.0
    rslora: bool = False  # scale alpha/sqrt(rank) instead of alpha/rank
    init_seed: int = 0
    base_dtype: str = "float32"  # dtype the frozen base is held in: float32 | bfloat16
    # a warm start (GRPO): the adapters to start from (an adapter checkpoint, a PEFT dir, or a LoRA SFT / GRPO run
    # dir: its final or latest adapters) instead of fresh ones; their targets, rank and alpha must be these
    init: str | None = None
    # when `init` does not exist yet: a LoRA SFT config that trains it first, on the same base model, e.g. on an
    # environment's demonstrations or the start's own verified successes (data.sources: {env: ...}, docs/grpo.md)
    init_sft_config: str | None = None

    def __post_init__(self):
        _at_least(self, 1, "rank")
        _within(self, "alpha", 0, float("inf"), lo_open=True)
        _one_of(self, "base_dtype", DTYPES)


@dataclass(frozen=True)
class CheckpointSection:
    SECTION = "checkpoint"  # where it sits in a run config (named in errors)
    every: int = 100  # save every this many steps (0: only at the end)
    keep: int = 3  # newest steps kept
    async_save: bool = True
    # restore checks every file of a step against the manifest written when it was saved (every byte read; a
    # damaged step is moved aside to N.damaged and the previous one used): false trusts the files
    verify: bool = True

    def __post_init__(self):
        _at_least(self, 0, "every")
        _at_least(self, 1, "keep")


@dataclass(frozen=True)
class DistributedSection:
    """Multi-process start-up (nemo_jax.parallel.distributed). Defaults detect SLURM / Kubernetes / TPU VMs and
    the NEMO_JAX_COORDINATOR env; a single process needs nothing."""
    SECTION = "distributed"  # where it sits in a run config (named in errors)
    cluster: str = "auto"  # auto | none | explicit | slurm | k8s | tpu
    coordinator: str | None = None  # host:port of process 0 (explicit layout)
    num_processes: int | None = None
    process_id: int | None = None
    local_device_ids: list[int] | None = None  # devices this process drives (one process per node)
    port: int = 0  # coordinator port for SLURM/Kubernetes (0: derived from the job id / 12355)
    initialization_timeout: int = 300  # seconds for every peer to join
    heartbeat_timeout: int = 30  # seconds without a heartbeat before a peer counts as lost

    def __post_init__(self):
        _one_of(self, "cluster", ("auto", "none", "explicit", "slurm", "k8s", "tpu"))
        if self.num_processes is not None:
            _at_least(self, 1, "num_processes")
        if self.process_id is not None:
            _at_least(self, 0, "process_id")
        _within(self, "port", 0, 65535)
        _at_least(self, 1, "initialization_timeout", "heartbeat_timeout")


@dataclass(frozen=True)
class WandbSection:
    """Weights & Biases run (the `wandb` extra); off while `project` is unset."""
    SECTION = "logging.wandb"  # where it sits in a run config (named in errors)
    project: str | None = None
    entity: str | None = None
    name: str | None = None  # default: the run name
    mode: str = "online"  # online | offline (no network; `wandb sync` later) | disabled

    def __post_init__(self):
        _one_of(self, "mode", ("online", "offline", "disabled"))


@dataclass(frozen=True)
class LoggingSection:
    """Metric sinks besides RUN_DIR/metrics.jsonl (nemo_jax.train.metrics.MetricsLogger)."""
    tensorboard: bool = True  # event files in RUN_DIR/tensorboard
    wandb: WandbSection = field(default_factory=WandbSection)


@dataclass(frozen=True)
class SFTConfig:
    name: str = "sft"
    run_dir: str | None = None  # default runs/<name>
    steps: int = 300
    log_every: int = 10
    eval_every: int = 50
    model: ModelSection = field(default_factory=ModelSection)
    data: DataSection = field(default_factory=DataSection)
    optim: OptimSection = field(default_factory=OptimSection)
    mesh: MeshSection = field(default_factory=MeshSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    lora: LoraSection = field(default_factory=LoraSection)
    logging: LoggingSection = field(default_factory=LoggingSection)
    distributed: DistributedSection = field(default_factory=DistributedSection)

    def __post_init__(self):
        _at_least(self, 1, "steps", "log_every")
        _at_least(self, 0, "eval_every")


# ----------------------------------------------------------------------------- GRPO (nemo_jax.rl)
POLICY_LOSS_KINDS = ("dppo", "tis", "icepop", "importance_sampling", "ppo", "cross_entropy")
REDUCTIONS = ("rollout", "token", "constant")


@dataclass(frozen=True)
class PolicyLossConfig:
    """The learner's loss (nemo_jax.rl.loss)."""
    SECTION = "loss"  # where it sits in a run config (named in errors)
    kind: str = "dppo"  # dppo | tis | icepop | importance_sampling | ppo | cross_entropy
    reduction: str = "rollout"  # rollout | token | constant (Dr. GRPO)
    delta_low: float = 0.2  # DPPO: drop a token with A < 0 when p - p_mu < -delta_low (ppo: ratio clip 1 - delta_low)
    delta_high: float = 0.2  # DPPO: drop a token with A > 0 when p - p_mu > delta_high
    kl_coef: float = 0.0  # (lp - mu)^2 penalty towards the behaviour policy
    ref_kl_coef: float = 0.0  # k3 KL to the base policy (the model with its adapters off)
    temperature: float = 1.0  # the sampler's temperature: both logprobs come from the same distribution
    advantage_scale: str = "none"  # none (Dr. GRPO: r - mean) | std (divide by the group's std)
    is_cap: float = 2.0  # tis: importance weights truncated at this ratio
    is_low: float = 0.5  # icepop: tokens whose ratio lies outside [is_low, is_high] are masked out
    is_high: float = 5.0
    # any kind: drop a rollout whose mean log-ratio learner/sampler over its loss tokens is beyond +- this (0: off)
    seq_mismatch_max: float = 0.0
    # per-turn credit of multi-turn episodes (0: off, one advantage per rollout): a turn's tokens get
    # A + turn_credit * (c_turn - mean c), c_turn the reward earned from that turn on (discounted by turn_gamma per
    # turn), from the rewards the environment reports after each turn (docs/grpo.md#per-turn-credit)
    turn_credit: float = 0.0
    turn_gamma: float = 1.0

    def __post_init__(self):
        _one_of(self, "kind", POLICY_LOSS_KINDS)
        _within(self, "is_cap", 0, float("inf"), lo_open=True)
        _within(self, "is_low", 0, 1)
        _within(self, "is_high", 1, float("inf"))
        _at_least(self, 0, "seq_mismatch_max", "turn_credit")
        _within(self, "turn_gamma", 0, 1)
        _one_of(self, "reduction", REDUCTIONS)
        _within(self, "temperature", 0, float("inf"), lo_open=True)
        _one_of(self, "advantage_scale", ("none", "std"))
        _at_least(self, 0, "delta_low", "delta_high", "kl_coef", "ref_kl_coef")


@dataclass(frozen=True)
class CurriculumSection:
    """Task sampling weight max(var(last `window` rewards), floor); `prior` for tasks never tried."""
    SECTION = "curriculum"  # where it sits in a run config (named in errors)
    window: int = 16
    floor: float = 0.01
    prior: float = 0.25

    def __post_init__(self):
        _at_least(self, 1, "window")
        _at_least(self, 0, "floor", "prior")


@dataclass(frozen=True)
class RolloutSection:
    SECTION = "rollout"  # where it sits in a run config (named in errors)
    env: str = "arithmetic"  # arithmetic | constraints | jsonl:PATH | package.module:Class
    env_args: dict = field(default_factory=dict)
    group_size: int = 8  # rollouts per task draw (advantages compare them)
    groups_per_step: int = 4  # groups per learner step
    in_flight_groups: int = 8  # the in-process producer keeps this many groups requested ahead
    max_off_policy_steps: int = 2  # groups sampled more policy versions ago are dropped
    max_new_tokens: int = 32  # per assistant turn
    seq_len: int = 128  # learner rows (prompt + every turn)
    sampler_rows: int = 0  # decode rows of the in-process sampler (0: every rollout of a step); with fewer rows than
    #                        rollouts, continuous batching refills a finished rollout's row with the next one
    sampler_positions: int = 0  # KV cache positions per row of the sampler's decode state (0: 2 x (seq_len + max_new_tokens))
    producer: str = "thread"  # thread (in-process sampler beside the learner) | inline (sample, then learn) | none (spool only)
    spool: bool = False  # also read rollouts external producers write to RUN/spool
    publish_every: int = 1  # publish the adapters to RUN/policy/<version> every this many steps (0: never)
    episode_timeout_s: float = 0.0  # wall-clock limit per episode (0: the environment's own `timeout_s`, or none);
    #                                 a timed-out episode is scored 0, closed and counted (episodes_timed_out)
    env_workers: int = 16  # threads running the environment's plain (non-async) episode methods
    max_image_patches: int = 0  # vision-language models: picture patches per learner row (0: seq_len x merge^2)
    max_images: int = 8  # vision-language models: pictures per learner row
    publish_format: str = "vllm"  # vllm (vLLM's nemotron_h layout: one module per routed expert) | peft (peft's
    #                               target_parameters layout, transformers >= 5; it cannot hold Mamba out_proj);
    #                               targets the format cannot hold are refused when the run starts
    publish_dtype: str = "train"  # train (the adapters' training dtype) | bf16 (half the bytes)
    publish_keep: int = 3  # keep the newest this many published versions (0: keep all)
    publish_keep_every: int = 0  # ... and every version that is a multiple of this (0: none)
    # sampling parameters every request to external producers carries (the in-process producer samples with
    # loss.temperature and these top_p / top_k too); the learner's logprobs are of the untruncated distribution
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    stop: list[str] = field(default_factory=list)  # stop strings for external producers (needs producer=none)
    lease_s: float = 120.0  # a claimed request not renewed for this long (worker heartbeat) is reposted
    max_failed_episodes: int = 0  # a group with more failed episodes (or expired leases) is cancelled (0: group_size)
    spool_max_file_mb: float = 256.0  # larger spool files are rejected unread
    reward_range: list[float] | None = None  # [lo, hi]: spool rollouts with rewards outside are rejected
    min_logprob: float = -1.0e4  # spool rollouts whose sampled tokens have lower behaviour logprobs are rejected

    def __post_init__(self):
        _at_least(self, 2, "group_size")
        _at_least(self, 1, "groups_per_step", "in_flight_groups", "max_new_tokens", "seq_len")
        _at_least(self, 0, "max_off_policy_steps", "sampler_rows", "sampler_positions", "publish_every")
        _one_of(self, "producer", ("thread", "inline", "none"))
        if self.producer == "none" and not self.spool:
            raise SettingError(self, "producer", "none needs rollout.spool=true (otherwise nothing produces rollouts)")
        # publishing, requests, leases and the spool
        _one_of(self, "publish_format", PUBLISH_FORMATS)
        _one_of(self, "publish_dtype", ("train", "bf16"))
        _at_least(self, 0, "publish_keep", "publish_keep_every", "top_k", "max_failed_episodes")
        _within(self, "top_p", 0, 1, lo_open=True)
        _within(self, "lease_s", 0, float("inf"), lo_open=True)
        _within(self, "spool_max_file_mb", 0, float("inf"), lo_open=True)
        if self.stop and self.producer != "none":
            raise SettingError(self, "stop", "stop strings need rollout.producer=none: the in-process sampler stops "
                                             "at end-of-turn tokens only")
        rr = self.reward_range
        if rr is not None and not (len(rr) == 2 and all(map(math.isfinite, rr)) and rr[0] <= rr[1]):
            raise SettingError(self, "reward_range", f"must be [lo, hi] with finite lo <= hi, got {rr}")
        if not (math.isfinite(self.min_logprob) and self.min_logprob < 0):
            raise SettingError(self, "min_logprob", f"must be < 0, got {self.min_logprob}")


@dataclass(frozen=True)
class GRPOConfig:
    name: str = "grpo"
    run_dir: str | None = None  # default runs/<name>
    steps: int = 100
    log_every: int = 1
    eval_every: int = 0  # held-out eval every this many steps, and before the first (0: none)
    eval_attempts: int = 1  # attempts per held-out task (pass@k and consistency use k = eval_attempts)
    # the start gate: the step-0 eval's pass@k - pass@1 below this (with eval_attempts >= 2) is warned of: the
    # start rarely succeeds where it usually fails, so RL has little to sharpen (warm-start the expert first)
    eval_min_headroom: float = 0.05
    eval_tasks: int = 0  # the fixed held-out set: the environment's first eval_tasks "eval" tasks (0: all)
    eval_rows: int = 0  # decode rows of the eval sampler (0: rollout.sampler_rows or one step's rollouts)
    seed: int = 0
    model: ModelSection = field(default_factory=ModelSection)
    tokenizer: str = "builtin:tiny"
    lora: LoraSection = field(default_factory=lambda: LoraSection(targets=["all"]))
    optim: OptimSection = field(default_factory=lambda: OptimSection(lr=1e-3, warmup_steps=0, decay="constant",
                                                                     weight_decay=0.0, aux_loss_coef=0.0,
                                                                     bias_update_rate=0.0))
    loss: PolicyLossConfig = field(default_factory=PolicyLossConfig)
    rollout: RolloutSection = field(default_factory=RolloutSection)
    curriculum: CurriculumSection = field(default_factory=CurriculumSection)
    mesh: MeshSection = field(default_factory=MeshSection)
    checkpoint: CheckpointSection = field(default_factory=lambda: CheckpointSection(every=10, keep=2))
    logging: LoggingSection = field(default_factory=LoggingSection)

    def __post_init__(self):
        _at_least(self, 1, "steps", "log_every", "eval_attempts")
        _at_least(self, 0, "eval_every", "eval_min_headroom")
        if not self.lora.targets:
            raise SettingError(self, "lora.targets", "grpo trains LoRA adapters: name some (e.g. [all])")


# ----------------------------------------------------------------------------- loading (no JAX needed)
def load_sft_config(path: str | None, overrides=()) -> SFTConfig:
    """YAML (None: the embedded tiny CPU defaults) + dotted overrides -> a validated SFTConfig; the run is named
    after the file unless `name` is set."""
    import dataclasses
    import os

    from nemo_jax.config.load import load_config

    c = load_config(SFTConfig, path, list(overrides))
    if path and c.name == "sft":
        c = dataclasses.replace(c, name=os.path.splitext(os.path.basename(path))[0])
    return _init_config_from(c, path, overrides)


def _init_config_from(c, path: str | None, overrides):
    """`model.init_sft_config` (and a GRPO config's `lora.init_sft_config`) as written in the config file at `path`:
    a relative path is looked up from that file's folder and then each folder above it (the shipped configs name
    `configs/sft/...` from the repository root), the working directory last; made absolute, so the run finds it
    from any directory. Given as an override, it is the working directory's."""
    import dataclasses

    for section in ("model", "lora"):
        sec = getattr(c, section)
        rel = getattr(sec, "init_sft_config", None)
        if not (path and rel) or any(str(o).startswith(f"{section}.init_sft_config=") for o in overrides):
            continue
        c = dataclasses.replace(c, **{section: dataclasses.replace(sec, init_sft_config=_found_beside(path, rel))})
    return c


def _found_beside(path: str, rel: str) -> str:
    """A path named in the config file at `path`: looked up from its folder and each folder above it, then the
    working directory's (absolute paths as they are)."""
    import os

    if os.path.isabs(rel):
        return rel
    d = os.path.dirname(os.path.abspath(path))
    while True:
        if os.path.isfile(os.path.join(d, rel)):
            return os.path.join(d, rel)
        if os.path.dirname(d) == d:
            return os.path.abspath(rel)
        d = os.path.dirname(d)


def load_grpo_config(path: str | None, overrides=()) -> GRPOConfig:
    """YAML + dotted overrides -> a validated GRPOConfig, named after the file unless `name` is set."""
    import dataclasses
    import os

    from nemo_jax.config.load import load_config

    c = load_config(GRPOConfig, path, list(overrides))
    if path and c.name == "grpo":  # runs/<config name> by default
        c = dataclasses.replace(c, name=os.path.splitext(os.path.basename(path))[0])
    return _init_config_from(c, path, overrides)


def load_plan_config(path: str | None, overrides=()):
    """The step a plan compiles, from an SFT config or a GRPO config -> (SFTConfig, sampler defaults). A GRPO
    config's learner step is a LoRA step over its rollout batch (groups_per_step x group_size rows of
    rollout.seq_len tokens, in optim.grad_accum micro-batches; the policy loss costs what the token loss costs),
    and its sampler serves rollout.sampler_rows rows of rollout.sampler_positions (defaults as the run's)."""
    import yaml

    raw = {}
    if path:
        try:
            with open(path) as f:
                raw = yaml.safe_load(f) or {}
        except (OSError, yaml.YAMLError):
            raw = {}  # load_sft_config names the file and what is wrong with it
    if not (isinstance(raw, dict) and "rollout" in raw):
        c = load_sft_config(path, overrides)
        return c, {"rows": c.data.batch_size, "context": c.data.seq_len, "program": None, "prefill": None}
    g = load_grpo_config(path, overrides)
    r = g.rollout
    rows = r.groups_per_step * r.group_size
    c = SFTConfig(name=g.name, model=g.model, lora=g.lora, optim=g.optim, mesh=g.mesh,
                  data=DataSection(seq_len=r.seq_len, batch_size=rows, tokenizer=g.tokenizer, eval=None))
    return c, {"rows": r.sampler_rows or rows, "context": r.sampler_positions or 2 * (r.seq_len + r.max_new_tokens),
               "program": "grpo_learner_step", "prefill": None}


def resolve_mesh_sizes(sizes: dict, n_devices: int) -> dict:
    """Mesh axis sizes (a -1 axis takes the devices left over) on `n_devices` devices -> every axis's size, or a
    ValueError naming what does not fit. Pure: the CLI checks a run's mesh with it before JAX starts where the
    device count is known then (`nemo_jax.hostmem.known_device_count`), `parallel.mesh.make_mesh` on the real
    devices."""
    axes = tuple(MeshSection().sizes())
    sizes = {a: int(sizes.get(a, 1)) for a in axes}
    free = [a for a, s in sizes.items() if s == -1]
    if len(free) > 1:
        raise ValueError(f"mesh: only one axis may be -1, got {free}")
    for a, s in sizes.items():
        if s == 0 or s < -1:
            raise ValueError(f"mesh.{a}: size must be positive or -1, got {s}")
    fixed = math.prod(s for s in sizes.values() if s != -1)
    named = ", ".join(f"{a}={s}" for a, s in sizes.items() if s not in (1, -1)) or "all 1"
    if free:
        if n_devices % fixed:
            raise ValueError(f"mesh: {named} (product {fixed}) does not divide the {n_devices} devices")
        sizes[free[0]] = n_devices // fixed
    if math.prod(sizes.values()) != n_devices:
        raise ValueError(f"mesh: {named} uses {math.prod(sizes.values())} devices, {n_devices} are available "
                         "(set one axis to -1 to take the devices left over)")
    return sizes


# Settings a resumed run may change: where and how it runs, logs, evaluates and saves, not what it trains. Every
# other key must equal the run's (`rerun_conflicts`): a rerun with other settings would silently resume (or, when
# the run is finished, do nothing) under a config that no longer matches its checkpoints.
RESUMABLE_KEYS = ("name", "run_dir", "log_every", "eval_every", "eval_attempts", "eval_tasks", "eval_rows",
                  "mesh.*", "checkpoint.*", "logging.*", "distributed.*", "model.init_sft_config", "model.remat",
                  "model.kernels", "model.attention", "model.moe_chunk_tokens", "optim.grad_accum", "data.eval",
                  "data.max_eval_batches", "data.workers", "data.prefetch", "data.prepare_workers",
                  "rollout.producer", "rollout.spool", "rollout.in_flight_groups", "rollout.sampler_rows",
                  "rollout.sampler_positions", "rollout.env_workers", "rollout.lease_s", "rollout.spool_max_file_mb",
                  "rollout.publish_*")


def _flat(d, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict) and v:
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def rerun_conflicts(saved: dict, config) -> list[tuple[str, object, object]]:
    """The settings of `config` (a run config) that differ from a run's `saved` config (its RUN/config.yaml, as
    a dict) outside RESUMABLE_KEYS -> [(dotted key, the run's value, this one)]. Keys one of them lacks (a
    setting added or removed between versions) are not compared."""
    import dataclasses
    import fnmatch
    import json

    ours = _flat(json.loads(json.dumps(dataclasses.asdict(config))))
    theirs = _flat(json.loads(json.dumps(saved)))
    return [(k, theirs[k], v) for k, v in ours.items()
            if k in theirs and theirs[k] != v and not any(fnmatch.fnmatchcase(k, p) for p in RESUMABLE_KEYS)
            and not (k == "steps" and _raised(theirs[k], v))]


def _raised(before, after) -> bool:
    return isinstance(before, int) and isinstance(after, int) and after > before


def extension_note(saved: dict, config) -> str | None:
    """The line a rerun that raises `steps` says (None when it does not): it resumes from the run's latest good
    checkpoint, and the learning-rate schedule is rebuilt for the new total, so its decay now ends at the new
    last step (a finished cosine / linear decay steps back up to the rebuilt schedule's value there)."""
    before, after = saved.get("steps"), getattr(config, "steps", None)
    if not _raised(before, after):
        return None
    return (f"steps raised from {before} to {after}: resuming from the run's latest good checkpoint; the learning-"
            f"rate schedule is rebuilt for {after} steps (warmup unchanged, the decay now ends at step {after})")


def check_rerun(config, run_dir: str) -> str | None:
    """Refuse (ValueError, one line naming the differing keys) to resume a run dir that holds checkpoints of a
    run with other settings (`rerun_conflicts` against RUN/config.yaml). Nothing is read but that file. A rerun
    may raise `steps` (the run is extended) -> the line that says so (`extension_note`), else None."""
    import os

    import yaml

    ckpts = os.path.join(run_dir, "checkpoints")
    path = os.path.join(run_dir, "config.yaml")
    if not (os.path.isdir(ckpts) and any(n.isdigit() for n in os.listdir(ckpts))) or not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            saved = yaml.safe_load(f)
    except (OSError, yaml.YAMLError) as e:
        raise ValueError(f"{path}: unreadable ({type(e).__name__}), so a rerun cannot tell whether its settings are "
                         "the run's: repair it, or pass --new-run to start afresh") from None
    diff = rerun_conflicts(saved if isinstance(saved, dict) else {}, config)
    if diff:
        shown = ", ".join(f"{k} {a!r} -> {b!r}" for k, a, b in diff[:6]) + (f" (and {len(diff) - 6} more)"
                                                                              if len(diff) > 6 else "")
        raise ValueError(f"{run_dir} holds a run with other settings ({shown}): its checkpoints were trained with "
                         f"its own ({path}); rerun with those to continue it, give another run_dir, or pass --new-run "
                         "to move it aside and start afresh")
    return extension_note(saved if isinstance(saved, dict) else {}, config)


def read_mesh_sizes(spec: str) -> dict:
    """A `--mesh` argument: a preset YAML (configs/mesh/*.yaml) or inline sizes "fsdp=8,tensor=2" -> {axis: size}."""
    import os

    axes = tuple(MeshSection().sizes())
    if os.path.isfile(spec):
        import yaml

        with open(spec) as f:
            sizes = yaml.safe_load(f) or {}
        if not isinstance(sizes, dict):
            raise ValueError(f"{spec}: a mesh preset must be a mapping of axis: size")
    elif "=" in spec:
        sizes = {k.strip(): v for k, v in (kv.split("=", 1) for kv in spec.split(",") if kv)}
    else:
        raise FileNotFoundError(f"--mesh {spec!r}: neither a preset file nor sizes like fsdp=8,tensor=2")
    for k, v in sizes.items():
        if k not in axes + ("devices_per_node",):
            raise ValueError(f"--mesh {spec}: unknown axis {k!r} (axes: {', '.join(axes)}; or devices_per_node)")
        try:
            sizes[k] = int(v)
        except (TypeError, ValueError):
            raise ValueError(f"--mesh {spec}: size of {k!r} must be an integer, got {v!r}") from None
    return sizes
