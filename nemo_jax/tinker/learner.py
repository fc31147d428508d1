"""The compute behind every training client: one frozen base, any number of LoRA adapter sets.

A `Learner` holds the base and jitted functions of (adapters, base, batch): which client's adapters they are
is an argument, so every client of one LoRA shape (rank, targets) runs the same compiled program, and a new
client compiles nothing. Batches are bucketed: a datum takes a row padded to a power of two in length (at least
`MIN_LEN`), rows are grouped to a power of two at most `max_tokens` tokens per call (longest first), so the
compiled shapes stay few whatever the clients send. Padding (segment id 0) is masked out of the loss, the MoE
routing and the outputs.

`adamw` is torch.optim.AdamW, which Tinker's optimiser is, with each call's hyperparameters as arguments (no
recompile when the learning rate changes): decoupled weight decay `p *= 1 - lr * wd`, bias-corrected moments,
`p -= lr * m_hat / (sqrt(v_hat) + eps)`, after clipping the global gradient norm to `grad_clip_norm` when that
is > 0. Only `lora_a` / `lora_b` move; the scale is a constant.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from nemo_jax.lora import LoraConfig, attach, init_adapters
from nemo_jax.model.model import Options, unstack_layers
from nemo_jax.rl.learner import token_logprobs
from nemo_jax.tinker.losses import LOSSES, token_losses
from nemo_jax.train.optimizer import global_norm

MIN_LEN = 32
TRAINED = ("lora_a", "lora_b")


def held_like(base, adapters):
    """Stacked adapters as `base` holds its layers: one by one (sliced inside the caller's jit, so gradients come
    back stacked) when the base's layers are lists, else as they are."""
    per_layer = any(isinstance(v, list) for v in base.get("layers", {}).values())
    return unstack_layers(adapters) if adapters and per_layer and "layers" in adapters else adapters


def _pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def bucket_len(n: int) -> int:
    return max(MIN_LEN, _pow2(n))


class Learner:
    def __init__(self, cfg, base, *, opts: Options = Options(), max_tokens: int = 16384):
        """`base`: the model's params, stacked or held one layer at a time (`unstack_layers`: the serving
        engine's copy, shared as it is: no second copy of the weights). Adapters stay stacked either way."""
        self.cfg, self.base, self.opts, self.max_tokens = cfg, base, opts, max_tokens
        self._fns: dict = {}

    def _fn(self, loss_fn: str, backward: bool):
        key = (loss_fn, backward)
        if key not in self._fns:
            cfg, opts = self.cfg, self.opts

            def loss(adapters, base, batch, config):
                lp = token_logprobs(attach(base, held_like(base, adapters)), batch, cfg, opts)
                per_row = jnp.sum(token_losses(loss_fn, lp, batch, config), axis=1)
                return jnp.sum(per_row), (lp, per_row)
            self._fns[key] = jax.jit(jax.value_and_grad(loss, has_aux=True) if backward else loss)
        return self._fns[key]

    def groups(self, lengths: list[int]) -> list[tuple[list[int], int, int]]:
        """Datum indices -> calls [(indices, rows, length)]: longest first, `rows` (a power of two) x `length`
        at most max_tokens (one row at least)."""
        order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
        out, at = [], 0
        while at < len(order):
            T = bucket_len(lengths[order[at]])
            cap = max(1, _pow2(self.max_tokens // T + 1) // 2)  # the largest power of two <= max_tokens // T
            take = order[at:at + cap]
            out.append((take, min(_pow2(len(take)), cap), T))
            at += len(take)
        return out

    def run(self, adapters, rows: list[dict], loss_fn: str, config: dict, backward: bool):
        """rows: per datum {"tokens", "targets" (int [L]), the loss's float inputs [L], and "pics": its pictures
        [(patches, grid)] if any} -> (per-datum target logprobs [L] float32, per-datum loss sums, the gradients of
        the adapters summed over every row, or None)."""
        names = LOSSES[loss_fn].inputs
        fn = self._fn(loss_fn, backward)
        conf = {k: jnp.float32(v) for k, v in config.items()}
        out: list = [None] * len(rows)
        losses = np.zeros(len(rows), np.float64)
        grads = None
        for idx, N, T in self.groups([len(r["tokens"]) for r in rows]):
            batch = {"tokens": np.zeros((N, T), np.int32), "targets": np.zeros((N, T), np.int32),
                     "segment_ids": np.zeros((N, T), np.int32), "mask": np.zeros((N, T), np.float32)}
            batch.update({k: np.zeros((N, T), np.float32) for k in names})
            for j, i in enumerate(idx):
                r, L = rows[i], len(rows[i]["tokens"])
                batch["tokens"][j, :L], batch["targets"][j, :L] = r["tokens"], r["targets"]
                batch["segment_ids"][j, :L] = 1
                batch["mask"][j, :L] = 1.0
                for k in names:
                    batch[k][j, :L] = r[k]
            pics = [pic for i in idx for pic in rows[i].get("pics", ())]
            if pics:  # the group's pictures, each processed alone (as its token count was), rows in order
                batch.update(self._images(batch["tokens"], pics))
            batch = {k: jnp.asarray(v) for k, v in batch.items()}
            if backward:
                (_, (lp, per_row)), g = fn(adapters, self.base, batch, conf)
                grads = g if grads is None else jax.tree.map(jnp.add, grads, g)
            else:
                _, (lp, per_row) = fn(adapters, self.base, batch, conf)
            lp, per_row = jax.device_get((lp, per_row))
            for j, i in enumerate(idx):
                out[i] = lp[j, :len(rows[i]["tokens"])].astype(np.float32)
                losses[i] = per_row[j]
        return out, losses, grads

    def _images(self, tokens: np.ndarray, pics: list) -> dict:
        """Pictures [(patches, (h, w))] of a batch's rows, in order -> the per-row image batch (pixel_values and
        the layout arrays), patches and images per row padded to powers of two (few compiled shapes)."""
        from nemo_jax.vision_layout import pack_inputs

        v = self.cfg.vision
        grid = np.asarray([g for _, g in pics], np.int64)
        return pack_inputs(v, tokens, np.concatenate([p for p, _ in pics]), grid,
                           max_patches=_pow2(max(int(grid.prod(-1).sum()), v.merge ** 2)), max_images=_pow2(len(pics)))

    def prompt_logprobs(self, adapters, tokens, pics=()) -> np.ndarray:
        """[len(tokens)] logprob of each token given the ones before it (NaN at position 0); `pics`: the pictures
        [(patches, grid)] of its image placeholders."""
        t = np.asarray(tokens, np.int64)
        out = np.full(len(t), np.nan, np.float32)
        if len(t) > 1:
            row = {"tokens": t[:-1], "targets": t[1:], "weights": np.zeros(len(t) - 1), "pics": list(pics)}
            lp, _, _ = self.run(adapters, [row], "cross_entropy", {}, backward=False)
            out[1:] = lp[0]
        return out


@functools.lru_cache(maxsize=64)
def _initializer(cfg, lora: LoraConfig):
    return jax.jit(lambda key: init_adapters(cfg, lora, key))


def new_adapters(cfg, lora: LoraConfig):
    """A fresh adapter set (A random from lora.init_seed, B zero): one compiled initializer per LoRA shape, so a new
    client compiles nothing."""
    return _initializer(cfg, dataclasses.replace(lora, init_seed=0))(jax.random.key(lora.init_seed))


# ----------------------------------------------------------------------------- the optimiser
def _trained(path) -> bool:
    return getattr(path[-1], "key", None) in TRAINED


def zeros_like_trained(adapters):
    """Adam moments: zeros for lora_a / lora_b, an empty array for the constants."""
    return jax.tree_util.tree_map_with_path(
        lambda p, x: jnp.zeros(x.shape, jnp.float32) if _trained(p) else jnp.zeros((0,), jnp.float32), adapters)


@jax.jit
def adamw(params, grads, m, v, step, hp):
    """One torch.optim.AdamW step (module docstring). step: updates taken before this one (int32 scalar); hp:
    {learning_rate, beta1, beta2, eps, weight_decay, grad_clip_norm} as float32 scalars -> (params, m, v, grad
    norm, finite: the update was applied (a non-finite gradient leaves everything as it was))."""
    norm = global_norm(jax.tree_util.tree_map_with_path(lambda p, g: g if _trained(p) else jnp.zeros(()), grads))
    clip = hp["grad_clip_norm"]
    scale = jnp.where((clip > 0) & (norm > clip), clip / jnp.maximum(norm, 1e-30), 1.0)
    t = (step + 1).astype(jnp.float32)
    lr, b1, b2, eps, wd = (hp[k] for k in ("learning_rate", "beta1", "beta2", "eps", "weight_decay"))
    finite = jnp.isfinite(norm)

    def one(path, p, g, m_, v_):
        if not _trained(path):
            return p, m_, v_
        g = g.astype(jnp.float32) * scale
        m2 = b1 * m_ + (1 - b1) * g
        v2 = b2 * v_ + (1 - b2) * g * g
        m_hat, v_hat = m2 / (1 - b1 ** t), v2 / (1 - b2 ** t)
        p2 = p.astype(jnp.float32) * (1 - lr * wd) - lr * m_hat / (jnp.sqrt(v_hat) + eps)
        return (jnp.where(finite, p2, p).astype(p.dtype), jnp.where(finite, m2, m_), jnp.where(finite, v2, v_))
    flat = jax.tree_util.tree_map_with_path(lambda path, *x: one(path, *x), params, grads, m, v)
    is_triple = lambda x: isinstance(x, tuple) and len(x) == 3  # noqa: E731
    pick = lambda i: jax.tree.map(lambda x: x[i], flat, is_leaf=is_triple)  # noqa: E731
    return pick(0), pick(1), pick(2), norm, finite
