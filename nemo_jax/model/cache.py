"""Decode state for the hybrid model: KV cache for `*` layers, conv window + fp32 SSM state for `M` layers.

Per-kind stacks follow the parameter stacks (`[n_attention, ...]`, `[n_mamba, ...]`). All rows share one
write position `pos`; `valid` [b, S] marks which cache slots hold real tokens (left padding is invalid).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from nemo_jax.model.attention import KVCache
from nemo_jax.model.mamba2 import MambaState


class DecodeState(NamedTuple):
    mamba: MambaState | None  # conv [nM, b, K-1, C], ssm [nM, b, H, P, N] fp32
    kv: KVCache | None  # k, v [nA, b, S, nkv, hd]
    valid: jax.Array  # [b, S] bool
    pos: jax.Array  # [] int32, next write position

    @property
    def max_len(self) -> int:
        return self.valid.shape[1]

    def layer_caches(self) -> dict:
        out = {}
        if self.mamba is not None:
            out["mamba"] = self.mamba
        if self.kv is not None:
            out["attention"] = self.kv
        return out


def init_decode_state(cfg, batch: int, max_len: int, dtype=jnp.float32) -> DecodeState:
    counts = cfg.kind_counts()
    nM, nA = counts.get("mamba", 0), counts.get("attention", 0)
    mamba = None
    if nM:
        mamba = MambaState(
            jnp.zeros((nM, batch, cfg.conv_kernel - 1, cfg.conv_dim), dtype),
            jnp.zeros((nM, batch, cfg.mamba_num_heads, cfg.mamba_head_dim, cfg.ssm_state_size), jnp.float32),
        )
    kv = None
    if nA:
        shape = (nA, batch, max_len, cfg.num_key_value_heads, cfg.head_dim)
        kv = KVCache(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))
    return DecodeState(mamba, kv, jnp.zeros((batch, max_len), bool), jnp.zeros((), jnp.int32))

