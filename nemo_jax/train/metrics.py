"""Metrics: metrics.jsonl + TensorBoard scalars, model FLOPs per token, device peaks for MFU."""

from __future__ import annotations

import json
import os

import jax

from nemo_jax.train.tensorboard import SummaryWriter

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


class MetricsLogger:
    def __init__(self, run_dir: str, enabled: bool = True):
        self.enabled = enabled
        if enabled:
            os.makedirs(run_dir, exist_ok=True)
            self.f = open(os.path.join(run_dir, "metrics.jsonl"), "a")
            self.tb = SummaryWriter(os.path.join(run_dir, "tensorboard"))

    def log(self, rec: dict):
        if not self.enabled:
            return
        self.f.write(json.dumps(rec) + "\n")
        self.f.flush()
        scalars = {k: v for k, v in rec.items() if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)}
        if scalars:
            self.tb.scalars(int(rec["step"]), scalars)

    def close(self):
        if self.enabled:
            self.f.close()
            self.tb.close()
