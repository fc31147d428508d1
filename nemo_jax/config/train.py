"""Run configuration for SFT: small dataclasses, one per concern."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class ModelSection:
    config: str = "tiny"  # name in configs/model, a model config JSON path
    init: str = "random"  # "random" | path to a native model dir | an HF dir | an SFT run dir
    init_sft_config: str | None = None  # when `init` does not exist yet: an SFT config that trains it first
    dtype: str = "float32"  # compute dtype: float32 | bfloat16
    remat: str = "none"  # none | layer | save_matmuls
    moe_dispatch: str = "sorted"
    capacity_factor: float = 1.25
    ep_capacity: float = 0.0  # expert parallel: per-device expert buffer = this x the even share (0: dropless, ep x)
    seed: int = 0


@dataclass(frozen=True)
class DataSection:
    train: str = "builtin:tiny_chat/train.jsonl"
    eval: str | None = "builtin:tiny_chat/eval.jsonl"
    tokenizer: str = "builtin:tiny"  # dir with tokenizer.json + tokenizer_config.json
    seq_len: int = 256
    batch_size: int = 8  # global rows per optimizer step (all micro-batches together)
    seed: int = 0
    on_error: str = "raise"  # raise | skip  (malformed lines)
    max_eval_batches: int = 4


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

    def sizes(self) -> dict[str, int]:
        """Axis sizes for `parallel.mesh.make_mesh` (-1 = the devices left over)."""
        return {"data": self.data, "fsdp": self.fsdp, "tensor": self.tensor, "expert": self.expert}


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
