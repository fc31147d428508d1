"""Run configuration for SFT: small dataclasses, one per concern."""

from __future__ import annotations

from dataclasses import dataclass, field

MODEL_KERNELS = ("auto", "reference")  # model.kernels (nemo_jax.kernels)


@dataclass(frozen=True)
class ModelSection:
    config: str = "tiny"  # name in configs/model, a model config JSON path
    init: str = "random"  # "random" | path to a native model dir | an HF dir | an SFT run dir
    init_sft_config: str | None = None  # when `init` does not exist yet: an SFT config that trains it first
    dtype: str = "float32"  # compute dtype: float32 | bfloat16
    remat: str = "none"  # none | layer | save_matmuls
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
    freeze_vision: bool = False  # vision-language models: the vision tower gets no gradient or update (projector trains)
    seed: int = 0

    def __post_init__(self):
        if self.moe_chunk_tokens < 0:
            raise ValueError(f"model.moe_chunk_tokens must be >= 0 (0: no chunks), got {self.moe_chunk_tokens}")
        if self.kernels not in MODEL_KERNELS:
            raise ValueError(f"model.kernels: {self.kernels!r} (expected one of {', '.join(MODEL_KERNELS)})")


@dataclass(frozen=True)
class DataSection:
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


@dataclass(frozen=True)
class OptimSection:
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


@dataclass(frozen=True)
class MeshSection:
    data: int = 1
    fsdp: int = -1
    tensor: int = 1
    expert: int = 1
    context: int = 1  # context parallelism: each row's sequence split this many ways (mamba state / K,V passed)
    # devices per node (tensor and expert are kept inside one, data/fsdp span nodes: parallel.mesh.make_mesh);
    # 0 = one node per process (one process per host, as launch/ starts them) or per TPU slice
    devices_per_node: int = 0

    def sizes(self) -> dict[str, int]:
        """Axis sizes for `parallel.mesh.make_mesh` (-1 = the devices left over)."""
        return {"data": self.data, "fsdp": self.fsdp, "tensor": self.tensor, "expert": self.expert,
                "context": self.context}


@dataclass(frozen=True)
class LoraSection:
    """LoRA SFT (nemo_jax.lora): off while `targets` is empty. Only the adapters are trained and checkpointed."""
    targets: list[str] = field(default_factory=list)  # presets (attention, mamba, mlp, experts, lm_head, all) or path regexes
    rank: int = 8
    alpha: float = 16.0
    rslora: bool = False  # scale alpha/sqrt(rank) instead of alpha/rank
    init_seed: int = 0
    base_dtype: str = "float32"  # dtype the frozen base is held in: float32 | bfloat16


@dataclass(frozen=True)
class CheckpointSection:
    every: int = 100
    keep: int = 3
    async_save: bool = True


@dataclass(frozen=True)
class DistributedSection:
    """Multi-process start-up (nemo_jax.parallel.distributed). Defaults detect SLURM / Kubernetes / TPU VMs and
    the NEMO_JAX_COORDINATOR env; a single process needs nothing."""
    cluster: str = "auto"  # auto | none | explicit | slurm | k8s | tpu
    coordinator: str | None = None  # host:port of process 0 (explicit layout)
    num_processes: int | None = None
    process_id: int | None = None
    local_device_ids: list[int] | None = None  # devices this process drives (one process per node)
    port: int = 0  # coordinator port for SLURM/Kubernetes (0: derived from the job id / 12355)
    initialization_timeout: int = 300  # seconds for every peer to join
    heartbeat_timeout: int = 30  # seconds without a heartbeat before a peer counts as lost


@dataclass(frozen=True)
class WandbSection:
    """Weights & Biases run (the `wandb` extra); off while `project` is unset."""
    project: str | None = None
    entity: str | None = None
    name: str | None = None  # default: the run name
    mode: str = "online"  # online | offline (no network; `wandb sync` later) | disabled


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


# ----------------------------------------------------------------------------- GRPO (nemo_jax.rl)
POLICY_LOSS_KINDS = ("dppo", "importance_sampling", "ppo", "cross_entropy")
REDUCTIONS = ("rollout", "token", "constant")


@dataclass(frozen=True)
class PolicyLossConfig:
    """The learner's loss (nemo_jax.rl.loss)."""
    kind: str = "dppo"  # dppo | importance_sampling | ppo | cross_entropy
    reduction: str = "rollout"  # rollout | token | constant (Dr. GRPO)
    delta_low: float = 0.2  # DPPO: drop a token with A < 0 when p - p_mu < -delta_low (ppo: ratio clip 1 - delta_low)
    delta_high: float = 0.2  # DPPO: drop a token with A > 0 when p - p_mu > delta_high
    kl_coef: float = 0.0  # (lp - mu)^2 penalty towards the behaviour policy
    ref_kl_coef: float = 0.0  # k3 KL to the base policy (the model with its adapters off)
    temperature: float = 1.0  # the sampler's temperature: both logprobs come from the same distribution
    advantage_scale: str = "none"  # none (Dr. GRPO: r - mean) | std (divide by the group's std)

    def __post_init__(self):
        if self.kind not in POLICY_LOSS_KINDS:
            raise ValueError(f"loss.kind: {self.kind!r} (expected one of {', '.join(POLICY_LOSS_KINDS)})")
        if self.reduction not in REDUCTIONS:
            raise ValueError(f"loss.reduction: {self.reduction!r} (expected one of {', '.join(REDUCTIONS)})")
        if self.temperature <= 0:
            raise ValueError(f"loss.temperature must be > 0 (got {self.temperature})")
        if self.advantage_scale not in ("none", "std"):
            raise ValueError(f"loss.advantage_scale: {self.advantage_scale!r} (expected none or std)")


@dataclass(frozen=True)
class CurriculumSection:
    """Task sampling weight max(var(last `window` rewards), floor); `prior` for tasks never tried."""
    window: int = 16
    floor: float = 0.01
    prior: float = 0.25


@dataclass(frozen=True)
class RolloutSection:
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


@dataclass(frozen=True)
class GRPOConfig:
    name: str = "grpo"
    run_dir: str | None = None  # default runs/<name>
    steps: int = 100
    log_every: int = 1
    eval_every: int = 0  # held-out eval every this many steps, and before the first (0: none)
    eval_attempts: int = 1  # attempts per held-out task (pass@k and consistency use k = eval_attempts)
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
