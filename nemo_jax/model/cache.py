"""Decode state for the hybrid model: KV cache for `*` layers, conv window + fp32 SSM state for `M` layers.

Per-kind stacks follow the parameter stacks (`[n_attention, ...]`, `[n_mamba, ...]`). Each row has its own
write position `pos[i]` (a chunk advances only the rows it gives tokens, by its width); `valid` [b, S] marks
which cache slots hold real tokens (left padding is invalid; no slot at or past a row's position is valid).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from nemo_jax.model.attention import KVCache, write_rows
from nemo_jax.model.mamba2 import MambaState


class DecodeState(NamedTuple):
    mamba: MambaState | None  # conv [nM, b, K-1, C], ssm [nM, b, H, P, N] fp32
    kv: KVCache | None  # k, v [nA, b, S, nkv, hd]
    valid: jax.Array  # [b, S] bool
    pos: jax.Array  # [b] int32, each row's next write position

    @property
    def max_len(self) -> int:
        return self.valid.shape[1]

    @property
    def row_axis(self) -> int:
        """The axis of the rows in the Mamba and KV leaves: 1 when stacked [layers, b, ...], 0 when held per layer
        (`unstack_state`)."""
        return 0 if isinstance(self.mamba if self.mamba is not None else self.kv, list) else 1

    def written(self, stack: jax.Array, x: jax.Array, valid: jax.Array, axis: int = 0) -> jax.Array:
        """`stack` (rows at `axis`, slots next) with a chunk x [.., b, l, ..] written at each row's position; rows
        appending nothing (no `valid` [b, l] token) write nothing."""
        return write_rows(stack, x, jnp.where(valid.any(1), self.pos, self.max_len), axis)

    def advance(self, new: dict, valid: jax.Array, valid_cache: jax.Array) -> "DecodeState":
        """The state after a chunk valid [b, l]: `new` {kind: per-layer stacks} from the layers (Mamba: the whole
        new conv/SSM state; attention: the chunk's KV entries [nA, b, l, nkv, hd], written at each row's
        position into the cache stack, in place when the state is donated), `valid_cache` [b, S] after it.
        A row appending nothing keeps its position. A state held per layer (`unstack_state`) gets lists back."""
        kv = self.kv
        if isinstance(kv, list):
            kv = [KVCache(*(self.written(c, x, valid, axis=0) for c, x in zip(layer, entries)))
                  for layer, entries in zip(kv, new["attention"])]
        elif kv is not None:
            kv = KVCache(*(self.written(c, x, valid, axis=1) for c, x in zip(kv, new["attention"])))
        return DecodeState(new.get("mamba"), kv, valid_cache, self.pos + jnp.where(valid.any(1), valid.shape[1], 0))

    def layer_caches(self) -> dict:
        out = {}
        if self.mamba is not None:
            out["mamba"] = self.mamba
        if self.kv is not None:
            out["attention"] = self.kv
        return out


def unstack_state(state: DecodeState) -> DecodeState:
    """The state with its per-kind stacks held as lists of each layer's own (MambaState / KVCache per layer, rows
    at axis 0): a cached forward reads and updates each layer's buffers in place, no slice of a stack copied."""
    per = lambda t: None if t is None or isinstance(t, list) else [  # noqa: E731
        type(t)(*(x[i] for x in t)) for i in range(t[0].shape[0])]
    return state._replace(mamba=per(state.mamba), kv=per(state.kv))


def unstack_shardings(sh: DecodeState, cfg) -> DecodeState:
    """`state_shardings` `sh` of a state held per layer (`unstack_state`): each layer's leaves sharded as the
    stack's, without the layers axis."""
    from jax.sharding import NamedSharding, PartitionSpec

    counts = cfg.kind_counts()
    drop = lambda x: NamedSharding(x.mesh, PartitionSpec(*tuple(x.spec)[1:]))  # noqa: E731
    per = lambda t, n: None if t is None else [type(t)(*(drop(x) for x in t)) for _ in range(n)]  # noqa: E731
    return sh._replace(mamba=per(sh.mamba, counts.get("mamba", 0)), kv=per(sh.kv, counts.get("attention", 0)))


def stack_state(state: DecodeState) -> DecodeState:
    """The inverse of `unstack_state`."""
    st = lambda t: t if not isinstance(t, list) else type(t[0])(*(jnp.stack(x) for x in zip(*t)))  # noqa: E731
    return state._replace(mamba=st(state.mamba), kv=st(state.kv))


# Logical axes of each state leaf (see nemo_jax.parallel.rules): rows over the batch axes, KV heads and the
# conv channels over `tensor`, the SSM state over its heads (`ssm_heads` -> `tensor` here, see state_shardings).
STATE_AXES = {
    "conv": ("layers", "batch", None, "mamba_conv"),  # [nM, b, K-1, C]
    "ssm": ("layers", "batch", "ssm_heads", None, None),  # [nM, b, H, P, N]
    "kv": ("layers", "batch", None, "kv_heads", None),  # [nA, b, S, nkv, hd]
    "valid": ("batch", None),  # [b, S]
    "pos": ("batch",),  # [b]
}


def state_shapes(cfg, batch: int, max_len: int, dtype=jnp.float32) -> DecodeState:
    """The state as a tree of ShapeDtypeStructs (no allocation)."""
    counts = cfg.kind_counts()
    nM, nA = counts.get("mamba", 0), counts.get("attention", 0)
    sds = jax.ShapeDtypeStruct
    mamba = None
    if nM:
        mamba = MambaState(sds((nM, batch, cfg.conv_kernel - 1, cfg.conv_dim), dtype),
                           sds((nM, batch, cfg.mamba_num_heads, cfg.mamba_head_dim, cfg.ssm_state_size), jnp.float32))
    kv = None
    if nA:
        shape = (nA, batch, max_len, cfg.num_key_value_heads, cfg.head_dim)
        kv = KVCache(sds(shape, dtype), sds(shape, dtype))
    return DecodeState(mamba, kv, sds((batch, max_len), jnp.bool_), sds((batch,), jnp.int32))


def state_shardings(cfg, batch: int, max_len: int, mesh, rules=None, dtype=jnp.float32) -> DecodeState:
    """NamedShardings of the state on `mesh`: rows over (data, fsdp, expert), KV heads and conv channels over
    `tensor`, the SSM state over its heads on `tensor`. An axis that does not divide a dimension is dropped."""
    from nemo_jax.parallel.rules import Rules

    rules = (rules or Rules()).with_overrides(ssm_heads="tensor")
    sh = state_shapes(cfg, batch, max_len, dtype)
    f = lambda x, axes: rules.sharding(mesh, axes, x.shape)
    mamba = None if sh.mamba is None else MambaState(f(sh.mamba[0], STATE_AXES["conv"]),
                                                     f(sh.mamba[1], STATE_AXES["ssm"]))
    kv = None if sh.kv is None else KVCache(f(sh.kv.k, STATE_AXES["kv"]), f(sh.kv.v, STATE_AXES["kv"]))
    return DecodeState(mamba, kv, f(sh.valid, STATE_AXES["valid"]), f(sh.pos, STATE_AXES["pos"]))


def init_decode_state(cfg, batch: int, max_len: int, dtype=jnp.float32, mesh=None, rules=None) -> DecodeState:
    """An empty state; with `mesh`, created directly in its `state_shardings` (never whole on one device)."""
    sh = state_shapes(cfg, batch, max_len, dtype)
    zeros = lambda: jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), sh)
    if mesh is None:
        return zeros()
    return jax.jit(zeros, out_shardings=state_shardings(cfg, batch, max_len, mesh, rules, dtype))()
