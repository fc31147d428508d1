"""Metrics: the one sink of every command that trains or evaluates (metrics.jsonl, TensorBoard through
tensorboardX, optional Weights & Biases), model FLOPs per token, device peaks for MFU."""

from __future__ import annotations

import json
import os
import uuid

import jax
import numpy as np
import yaml

from nemo_jax.config.train import LoggingSection, WandbSection
from nemo_jax.extras import require

# Dense bf16 peak per device (FLOP/s), for MFU. Unknown devices (CPU) report no MFU.
PEAKS = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "B200": 2250e12, "GB200": 2500e12,
         "TPU v5p": 459e12, "TPU v5 lite": 197e12, "TPU v5e": 197e12, "TPU v6 lite": 918e12, "TPU v4": 275e12}


def device_peak_flops(device=None) -> float | None:
    kind = (device or jax.devices()[0]).device_kind
    for k, v in PEAKS.items():
        if k.lower() in kind.lower():
            return v
    return None


def model_flops_per_token(cfg, seq_len: int) -> float:
    """Training FLOPs per token (forward + backward = 3x forward), counting matmuls with active experts."""
    D = cfg.hidden_size
    fwd = 2 * D * cfg.vocab_size  # lm_head
    for kind in cfg.layer_kinds:
        if kind == "mamba":
            H, P, N, cs = cfg.mamba_num_heads, cfg.mamba_head_dim, cfg.ssm_state_size, min(cfg.chunk_size, seq_len)
            fwd += 2 * D * cfg.in_proj_dim + 2 * cfg.d_inner * D
            fwd += 2 * H * (cs * (N + P) + 2 * P * N)  # SSD: intra-chunk quadratic + state in/out
        elif kind == "attention":
            q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
            fwd += 2 * D * (2 * q + 2 * kv) + 2 * 2 * q * seq_len / 2  # projections + causal QK^T and PV
        elif kind == "mlp":
            fwd += 2 * 2 * D * cfg.intermediate_size
        elif kind == "moe":
            Din = cfg.moe_input_size
            fwd += 2 * D * cfg.n_routed_experts + cfg.num_experts_per_tok * 2 * 2 * Din * cfg.moe_intermediate_size
            if cfg.n_shared_experts:
                fwd += 2 * 2 * D * cfg.moe_shared_expert_intermediate_size
            if cfg.moe_latent_size:
                fwd += 2 * 2 * D * Din
    return 3.0 * fwd


WANDB_MODES = ("online", "offline", "disabled")


def check_logging(section: LoggingSection) -> None:
    """Fail before any work on a logging section that cannot be honoured (bad wandb mode, wandb missing)."""
    w = section.wandb
    if w.mode not in WANDB_MODES:
        raise ValueError(f"logging.wandb.mode: {w.mode!r} (expected one of {', '.join(WANDB_MODES)})")
    if wandb_wanted(w):
        require("wandb", "wandb", "logging.wandb.project (a Weights & Biases run)")


def wandb_wanted(w: WandbSection) -> bool:
    return w.project is not None and w.mode != "disabled"


def split_record(rec: dict) -> tuple[int, dict[str, float], dict[str, np.ndarray]]:
    """-> (step, scalars, arrays): numbers (not bools) become scalars, numeric lists become histogram values;
    anything else (strings, None, bools) stays in metrics.jsonl only."""
    scalars, arrays = {}, {}
    for k, v in rec.items():
        if k == "step" or v is None or isinstance(v, (bool, str)):
            continue
        if isinstance(v, (int, float, np.integer, np.floating)):
            scalars[k] = float(v)
        elif isinstance(v, (list, tuple, np.ndarray)):
            a = np.asarray(v)
            if a.dtype.kind in "iuf" and a.size:
                arrays[k] = a.astype(np.float64).ravel()
    return int(rec["step"]), scalars, arrays


def wandb_run_id(run_dir: str) -> str:
    """The W&B run id of this run directory, kept in RUN_DIR/wandb_run_id so that a resumed run continues it."""
    path = os.path.join(run_dir, "wandb_run_id")
    if os.path.exists(path):
        with open(path) as f:
            return f.read().strip()
    rid = uuid.uuid4().hex[:12]
    with open(path, "w") as f:
        f.write(rid + "\n")
    return rid


def start_wandb(w: WandbSection, run_dir: str, name: str, config: dict | None):
    wandb = require("wandb", "wandb", "logging.wandb.project (a Weights & Biases run)")
    return wandb.init(project=w.project, entity=w.entity, name=w.name or name, mode=w.mode, dir=run_dir,
                      config=config, id=wandb_run_id(run_dir), resume="allow")


class MetricsLogger:
    """The metrics sink of every command that trains or evaluates. `log(rec)` appends `rec` to
    RUN_DIR/metrics.jsonl and sends its numbers as scalars and its numeric lists (e.g. `expert_load`) as
    histograms to TensorBoard (RUN_DIR/tensorboard, tensorboardX) and, when `logging.wandb.project` is set, to a
    Weights & Biases run (files under RUN_DIR/wandb) carrying the resolved `config`. `histogram(step, name,
    values)` sends a distribution (rewards, response lengths) to TensorBoard / W&B only. Only process 0 writes:
    elsewhere pass enabled=False and every call is a no-op."""

    def __init__(self, run_dir: str, enabled: bool = True, logging: LoggingSection = LoggingSection(),
                 config: dict | None = None, name: str | None = None):
        self.enabled = enabled
        self.f = self.tb = self.wandb = None
        if not enabled:
            return
        check_logging(logging)
        os.makedirs(run_dir, exist_ok=True)
        self.f = open(os.path.join(run_dir, "metrics.jsonl"), "a")
        if logging.tensorboard:
            import tensorboardX as tbx  # (a core dependency)

            self.tb = tbx.SummaryWriter(os.path.join(run_dir, "tensorboard"))
            if config is not None:
                self.tb.add_text("config", "```\n" + yaml.safe_dump(config, sort_keys=False) + "```", 0)
        if wandb_wanted(logging.wandb):
            self.wandb = start_wandb(logging.wandb, run_dir, name or os.path.basename(run_dir), config)

    def log(self, rec: dict):
        if not self.enabled:
            return
        self.f.write(json.dumps(rec) + "\n")
        self.f.flush()
        step, scalars, arrays = split_record(rec)
        if self.tb is not None:
            for k, v in scalars.items():
                self.tb.add_scalar(k, v, step)
            for k, v in arrays.items():
                self._tb_histogram(step, k, v)
            self.tb.flush()
        if self.wandb is not None:
            hists = {k: self._wandb_histogram(v) for k, v in arrays.items()}
            self.wandb.log({**scalars, **{k: h for k, h in hists.items() if h is not None}}, step=step)

    def histogram(self, step: int, name: str, values):
        """One distribution (e.g. GRPO rewards or response lengths of a batch) at `step`."""
        if not self.enabled:
            return
        v = np.asarray(values, dtype=np.float64).ravel()
        if self.tb is not None:
            self._tb_histogram(step, name, v)
            self.tb.flush()
        if self.wandb is not None:
            h = self._wandb_histogram(v)
            if h is not None:
                self.wandb.log({name: h}, step=int(step))

    def _tb_histogram(self, step: int, name: str, v: np.ndarray):
        v = v[np.isfinite(v)]
        if v.size:
            self.tb.add_histogram(name, v, int(step))

    def _wandb_histogram(self, v: np.ndarray):
        import wandb

        v = v[np.isfinite(v)]
        return wandb.Histogram(v) if v.size else None

    def close(self):
        if not self.enabled:
            return
        self.f.close()
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()
