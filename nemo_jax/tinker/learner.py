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

from nemo_jax.kernels import select
from nemo_jax.lora import LoraConfig, attach, init_adapters
from nemo_jax.model.model import Options, unstack_layers
from nemo_jax.parallel.mesh import fetch
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

    def _loss(self, loss_fn: str):
        cfg, opts = self.cfg, self.opts

        def loss(adapters, base, batch, config):
            lp = token_logprobs(attach(base, held_like(base, adapters)), batch, cfg, opts)
            per_row = jnp.sum(token_losses(loss_fn, lp, batch, config), axis=1)
            return jnp.sum(per_row), (lp, per_row)
        return loss

    def _fn(self, loss_fn: str, backward: bool):
        """One model's call: (adapters, base, batch [N, T], config) -> (loss, (lp, per_row)) [and gradients]."""
        key = (loss_fn, backward)
        if key not in self._fns:
            loss = self._loss(loss_fn)
            self._fns[key] = jax.jit(jax.value_and_grad(loss, has_aux=True) if backward else loss)
        return self._fns[key]

    def _many_fn(self, loss_fn: str, backward: bool):
        """Several models' call: (a tuple of J adapter sets, base, batch [J, N, T], config) -> ((lp [J, N, T],
        per_row [J, N]), a tuple of J gradient sets or None). The adapter sets are stacked inside (the base is
        not: every job reads the one copy) and the model runs once over the J jobs (`vmap`)."""
        key = (loss_fn, backward, "many")
        if key not in self._fns:
            one = self._loss(loss_fn)
            one = jax.value_and_grad(one, has_aux=True) if backward else one

            def many(ads, base, batch, config):
                stacked = jax.tree.map(lambda *x: jnp.stack(x), *ads)
                out = jax.vmap(one, in_axes=(0, None, 0, None))(stacked, base, batch, config)
                if not backward:
                    return out[1], None
                (_, aux), g = out
                return aux, tuple(jax.tree.map(lambda x, j=j: x[j], g) for j in range(len(ads)))
            self._fns[key] = jax.jit(many)
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
        the adapters summed over every row, or None). The plain path: one model, its calls one by one."""
        conf = {k: jnp.float32(v) for k, v in config.items()}
        out: list = [None] * len(rows)
        losses = np.zeros(len(rows), np.float64)
        grads = None
        for idx, N, T in self.groups([len(r["tokens"]) for r in rows]):
            lp, per_row, g = self._call(adapters, self._batch(rows, idx, N, T, loss_fn, self._need(rows, idx)),
                                        loss_fn, conf, backward)
            if backward:
                grads = g if grads is None else jax.tree.map(jnp.add, grads, g)
            _collect((lp, per_row), rows, idx, out, losses)
        return out, losses, grads

    def _call(self, adapters, batch: dict, loss_fn: str, conf: dict, backward: bool):
        """One model's batch [N, T] (numpy) -> (lp [N, T], per_row [N] on the host, its gradients or None)."""
        batch = {k: jnp.asarray(v) for k, v in batch.items()}
        out = self._fn(loss_fn, backward)(adapters, self.base, batch, conf)
        (_, (lp, per_row)), g = out if backward else (out, None)
        return *fetch((lp, per_row)), g

    def run_many(self, jobs: list[tuple], loss_fn: str, config: dict, backward: bool,
                 max_jobs: int = 8) -> list[tuple]:
        """Several models' batches in as few calls as fit: jobs [(adapters, rows)] (adapter sets of one shape) ->
        per job what `run` gives for it, the same values (each model's rows as `groups` splits them, each group in
        a call of up to `max_jobs` groups of one padded length and the same row count; a call's jobs x rows x
        length at most max_tokens, unless one group alone is more). A job's gradients are summed over its groups in
        `run`'s order. One job, or adapter sets of different shapes: `run` for each."""
        if len(jobs) == 1 or len({_shape(ad) for ad, _ in jobs}) > 1 or not self._mappable():
            return [self.run(ad, rows, loss_fn, config, backward) for ad, rows in jobs]
        conf = {k: jnp.float32(v) for k, v in config.items()}
        res = [([None] * len(rows), np.zeros(len(rows), np.float64), {}) for _, rows in jobs]
        parts = [(j, k, idx, N, T) for j, (_, rows) in enumerate(jobs)
                 for k, (idx, N, T) in enumerate(self.groups([len(r["tokens"]) for r in rows]))]
        for call in self.calls(parts, [bool(self._need(jobs[j][1], idx)[1]) for j, _, idx, _, _ in parts], max_jobs):
            N, T = max(p[3] for p in call), call[0][4]
            need = tuple(int(x) for x in np.max([self._need(jobs[j][1], idx) for j, _, idx, _, _ in call], axis=0))
            batches = [self._batch(jobs[j][1], idx, N, T, loss_fn, need) for j, _, idx, _, _ in call]
            if len(call) == 1:  # (alone in its call: the plain path's program)
                lp, per_row, g = self._call(jobs[call[0][0]][0], batches[0], loss_fn, conf, backward)
                lp, per_row, g = lp[None], per_row[None], (g,)
            else:  # jobs padded to a power of two (few compiled shapes) with copies of the first, left unread
                pad = _pow2(len(call)) - len(call)
                ads = tuple(jobs[j][0] for j, *_ in call) + (jobs[call[0][0]][0],) * pad
                batch = {k: jnp.asarray(np.stack([b[k] for b in batches + batches[:1] * pad])) for k in batches[0]}
                (lp, per_row), g = self._many_fn(loss_fn, backward)(ads, self.base, batch, conf)
                lp, per_row = fetch((lp, per_row))
            for c, (j, k, idx, _, _) in enumerate(call):
                _collect((lp[c], per_row[c]), jobs[j][1], idx, res[j][0], res[j][1])
                if backward:
                    res[j][2][k] = g[c]
        out = []
        for lps, losses, gs in res:
            grads = None
            for k in sorted(gs):
                grads = gs[k] if grads is None else jax.tree.map(jnp.add, grads, gs[k])
            out.append((lps, losses, grads))
        return out

    def _mappable(self) -> bool:
        """Whether the model may be mapped over several adapter sets. TPU's splash attention kernel does not map
        (its mask metadata leaks a tracer under `vmap`, seen in interpret mode): there each model runs alone."""
        return select(self.opts.kernels, self.opts.mesh, self.opts.interpret_kernels).platform != "tpu"

    def calls(self, parts: list[tuple], pics: list[bool], max_jobs: int) -> list[list[tuple]]:
        """Groups of several jobs [(job, k, idx, rows, length)] -> calls: groups of one length (and alike in
        having pictures or not), most rows first, as many per call as `max_jobs` and max_tokens allow (the jobs
        padded to a power of two count, each to the call's first row count)."""
        out = []
        keyed: dict = {}
        for p, pic in zip(parts, pics):
            keyed.setdefault((p[4], pic), []).append(p)
        for (T, _), ps in sorted(keyed.items(), key=lambda kv: -kv[0][0]):
            ps.sort(key=lambda p: -p[3])
            while ps:
                call = [ps.pop(0)]
                while ps and len(call) < max_jobs and _pow2(len(call) + 1) * call[0][3] * T <= self.max_tokens:
                    call.append(ps.pop(0))
                out.append(call)
        return out

    def _batch(self, rows: list[dict], idx: list[int], N: int, T: int, loss_fn: str, pics_need) -> dict:
        """Rows `idx` as one padded batch [N, T] (numpy; segment id 0 and mask 0 past each row's end), with the
        image batch of their pictures (padded to `pics_need`: (patches, images)) when they have any."""
        names = LOSSES[loss_fn].inputs
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
            batch.update(self._images(batch["tokens"], pics, *pics_need))
        return batch

    def _need(self, rows: list[dict], idx: list[int]) -> tuple[int, int]:
        return _pics_need(rows, idx, self.cfg.vision.merge ** 2 if self.cfg.vision is not None else 1)

    def _images(self, tokens: np.ndarray, pics: list, max_patches: int, max_images: int) -> dict:
        """Pictures [(patches, (h, w))] of a batch's rows, in order -> the per-row image batch (pixel_values and
        the layout arrays) with room for `max_patches` patches and `max_images` images (`_pics_need`)."""
        from nemo_jax.vision_layout import pack_inputs

        grid = np.asarray([g for _, g in pics], np.int64)
        return pack_inputs(self.cfg.vision, tokens, np.concatenate([p for p, _ in pics]), grid,
                           max_patches=max_patches, max_images=max_images)

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


def _pics_need(rows: list[dict], idx: list[int], least: int = 1) -> tuple[int, int]:
    """(patches, images) an image batch of rows `idx` makes room for, each a power of two, the patches at least
    `least` ((0, 0): no pictures)."""
    grids = [g for i in idx for _, g in rows[i].get("pics", ())]
    if not grids:
        return 0, 0
    return _pow2(max(int(sum(h * w for h, w in grids)), least)), _pow2(len(grids))


def _collect(got, rows: list[dict], idx: list[int], out: list, losses: np.ndarray) -> None:
    """A call's (lp [N, T], per_row [N]) (host arrays) -> each datum's logprobs [L] and loss sum."""
    lp, per_row = got
    for j, i in enumerate(idx):
        out[i] = lp[j, :len(rows[i]["tokens"])].astype(np.float32)
        losses[i] = per_row[j]


def _shape(adapters) -> tuple:
    """What must agree for adapter sets to run in one call: their tree and each leaf's shape and dtype."""
    leaves, tree = jax.tree.flatten(adapters)
    return tree, tuple((x.shape, str(x.dtype)) for x in leaves)


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
