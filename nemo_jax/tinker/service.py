"""The Tinker API service behind `nemo-jax serve --tinker-root`: sessions, training models (LoRA adapters over the
one served base), sampling sessions, and the worker that runs the models' requests.

* A training model is a LoRA adapter set with its own AdamW state, over the served model's params (never
  copied): `Learner` runs every model's forward / backward with the same compiled programs. Targets come from
  the SDK's flags (`lora_targets`), alpha is 32 as on Tinker (scale alpha / rank).
* Each model's requests run in `seq_id` order (the SDK numbers them; a forward_backward's chunks arrive out of
  order, its first chunk last). A request waits until the one before it has arrived; consecutive forward_backward
  chunks of one model with the same loss run as one batch (`chunk merging`), each answering its own future. One
  worker thread runs all models' requests (one device), round robin by arrival.
* Sampling goes through serve's continuous-batching `Scheduler` (the engine holds one adapter set at a time and
  switches between them); `save_weights_and_get_sampling_client` snapshots the adapters as they are at that point
  of the model's sequence (updates make new arrays, so a snapshot is a reference, never a copy).
* Every request's bad input fails that request alone, as a user error naming what is wrong (`UserError`).
"""

from __future__ import annotations

import base64
import os
import re
import threading
import time
import traceback
from collections import deque
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import numpy as np

from nemo_jax.lora import LoraConfig
from nemo_jax.model.model import stack_layers
from nemo_jax.lora.adapters import PRESETS, adaptable_paths
from nemo_jax.tinker import wire
from nemo_jax.tinker.futures import FutureStore
from nemo_jax.tinker.learner import Learner, adamw, new_adapters, zeros_like_trained
from nemo_jax.tinker.losses import LOSSES
from nemo_jax.tinker.store import Store, check_name, check_run_id, iso_time, parse_path
from nemo_jax.tinker.wire import UserError

LORA_ALPHA = 32.0  # Tinker's (scale alpha / rank): a cookbook's learning rates mean the same here
GAP_S = 300.0  # a model's missing request: the ones after it wait this long, then run (the gap is named)
SESSION_TTL_S = 900.0  # a session without a heartbeat or request this long is over: its models are freed
MAX_SNAPSHOTS = 8  # ephemeral sampler snapshots kept per model (older sampling sessions expire)
MAX_SAMPLES = 128  # num_samples of one request


def lora_targets(cfg, train_mlp: bool, train_attn: bool, train_unembed: bool) -> tuple[str, ...]:
    """The SDK's LoRA flags -> nemo_jax LoRA target presets present in this model (docs/tinker.md): train_attn:
    attention q/k/v/o and the Mamba mixers' in/out projections (the hybrid's other sequence mixer); train_mlp: dense
    MLPs, shared experts and every routed expert; train_unembed: lm_head."""
    want = (["attention", "mamba"] if train_attn else []) + (["mlp", "experts"] if train_mlp else []) \
        + (["lm_head"] if train_unembed else [])
    have = list(adaptable_paths(cfg))
    return tuple(t for t in want if any(re.search(PRESETS[t], p) for p in have))


def flatten(cfg, chunks: list, what: str) -> tuple[np.ndarray, list]:
    """Chunks -> (token ids, pictures [(PIL image, (patches, grid))]): an image chunk becomes the vision model's
    placeholder tokens, as many as its processor makes of the image alone (the client's expected_tokens must
    agree); token ids are checked against the vocabulary."""
    toks, pics = [], []
    V, v = cfg.vocab_size, cfg.vision
    for j, c in enumerate(chunks):
        if isinstance(c, wire.Image):
            if v is None:
                raise UserError(f"{what}: chunk {j} is an image, but this model has no vision tower")
            from nemo_jax.data.images import ImageError, load_image, picture

            if c.format not in ("png", "jpeg"):
                raise UserError(f"{what}: chunk {j}: image format {c.format[:20]!r} (png or jpeg)")
            try:
                img = load_image(f"data:image/{c.format};base64," + base64.b64encode(c.data).decode())
                pix, grid = picture(v, img)
            except (ImageError, ValueError, OSError) as e:
                raise UserError(f"{what}: chunk {j}: not a readable image ({e})"[:400]) from None
            n = grid[0] * grid[1] // v.merge ** 2
            if c.expected_tokens is not None and c.expected_tokens != n:
                raise UserError(f"{what}: chunk {j}: the image makes {n} tokens here, not expected_tokens="
                                f"{c.expected_tokens}")
            toks.append(np.full(n, v.image_token_id, np.int64))
            pics.append((img, (pix, grid)))
        else:
            bad = np.flatnonzero((c < 0) | (c >= V))
            if len(bad):
                raise UserError(f"{what}: chunk {j}: token id {c[bad[0]]} is outside the vocabulary [0, {V})")
            if v is not None and np.any(c == v.image_token_id):
                raise UserError(f"{what}: chunk {j}: token id {v.image_token_id} is the image placeholder: send "
                                "pictures as image chunks")
            toks.append(c)
    return (np.concatenate(toks) if toks else np.zeros(0, np.int64)), pics


@dataclass(eq=False)
class Session:
    id: str
    sdk_version: str | None
    user_metadata: dict
    last_seen: float = field(default_factory=time.time)
    finished: bool = False
    models: set = field(default_factory=set)
    samplers: set = field(default_factory=set)  # sampling sessions it created from a path or the base


@dataclass(eq=False)
class Model:
    id: str
    session: str
    base_model: str
    lora: LoraConfig
    flags: dict  # rank, seed, train_mlp, train_attn, train_unembed
    adapters: object
    m: object
    v: object
    step: int = 0  # optimiser steps taken
    user_metadata: dict = field(default_factory=dict)
    grads: object = None  # accumulated gradients (None: none pending)
    next_seq: int = 1
    pending: dict = field(default_factory=dict)  # seq_id -> Item, waiting for the ones before it
    seen: dict = field(default_factory=dict)  # seq_id -> request id (a retried submission gets the same future)
    blocked_since: float | None = None
    snapshots: deque = field(default_factory=deque)  # ephemeral sampling session ids, oldest first
    inflight: list = field(default_factory=list)  # sampling sessions sharing the model's inflight weights
    created: float = field(default_factory=time.time)
    last_request: float = field(default_factory=time.time)


@dataclass(eq=False)
class Sampler:
    id: str
    base_model: str
    model_path: str | None
    adapter: object  # serve.scheduler.Adapter, or None: the base


@dataclass(eq=False)
class Item:
    kind: str  # fwdbwd | optim | save_state | save_sampler | load_state | create | load_create | prompt_lp
    rid: str | None
    model: Model | None = None
    seq: int = 0
    args: dict = field(default_factory=dict)
    merge: tuple | None = None  # forward_backward chunks with equal keys run as one batch


class TinkerService:
    def __init__(self, serve_state, store_root: str, *, ckpt: str, tokenizer_dir: str, max_rank: int = 128,
                 max_tokens: int = 16384):
        self.s = serve_state  # nemo_jax.serve.app.ServerState: cfg, params, scheduler, model name, max_len
        self.cfg, self.max_len = serve_state.cfg, serve_state.max_len
        self.max_rank = max_rank
        self.names = {serve_state.model_name, ckpt, os.path.abspath(ckpt), os.path.realpath(ckpt)}
        self.ckpt = ckpt
        self.tokenizer_dir = os.path.abspath(tokenizer_dir)
        self.store = Store(store_root)
        self.futures = FutureStore()
        # the learner trains on stacked layers; serve holds the engine's per-layer copy (a second copy of the base
        # weights while the Tinker API is on)
        self.learner = Learner(self.cfg, stack_layers(serve_state.params), max_tokens=max_tokens)
        self.sessions: dict[str, Session] = {}
        self.models: dict[str, Model] = {}
        self.samplers: dict[str, Sampler] = {}
        self._loaded: dict[str, tuple] = {}  # tinker path -> (Adapter, base model) of sampling sessions made from it
        self._lock = threading.RLock()  # sessions, models, samplers, queues
        self._cv = threading.Condition(self._lock)
        self._work: deque[Item] = deque()
        self._creating: dict[str, str] = {}  # model id -> request id of its create / load (a retry gets it)
        self.busy: dict[str, list] = {}  # request kind -> [requests, seconds the worker spent on them]
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="tinker-learner", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ sessions
    def create_session(self, body: dict) -> dict:
        version = body.get("sdk_version")
        sid = os.urandom(4).hex()
        with self._lock:
            self.sessions[sid] = Session(sid, version if isinstance(version, str) else None,
                                         body.get("user_metadata") or {})
        out = {"type": "create_session", "session_id": sid}
        if not wire.same_minor(version if isinstance(version, str) else None):
            out["warning_message"] = ("nemo-jax serve speaks the Tinker API of SDK " + wire.SDK_VERSION + "; this "
                                      f"client is tinker {version or '(unknown version)'}: if requests fail, "
                                      f"pip install tinker=={wire.SDK_VERSION}")
        return out

    def session(self, sid, *, live: bool = True) -> Session:
        with self._lock:
            s = self.sessions.get(sid) if isinstance(sid, str) else None
            if s is None:
                raise UserError(f"unknown session {str(sid)[:80]!r} (sessions end when the server restarts: start a "
                                "new ServiceClient)")
            if live and s.finished:
                raise UserError(f"session {sid} has finished")
            s.last_seen = time.time()
            return s

    def heartbeat(self, sid) -> str:
        """-> 'ok', 'finished' or 'unknown'."""
        with self._lock:
            s = self.sessions.get(sid) if isinstance(sid, str) else None
            if s is None:
                return "unknown"
            s.last_seen = time.time()
            return "finished" if s.finished else "ok"

    def finish(self, sid) -> None:
        with self._lock:
            s = self.session(sid, live=False)
            s.finished = True
            self._drop_models(s)

    def _drop_models(self, s: Session) -> None:
        for mid in list(s.models):
            if mid in self.models:
                self._forget_locked(self.models[mid])
        for sid in s.samplers:
            self.samplers.pop(sid, None)
        s.samplers.clear()

    def _forget_locked(self, m: Model) -> None:
        """A model and its snapshots freed (its checkpoints stay on disk)."""
        self.models.pop(m.id, None)
        self.sessions[m.session].models.discard(m.id)
        for sp in list(m.snapshots) + m.inflight:
            self.samplers.pop(sp, None)

    # ------------------------------------------------------------------ models
    def check_base(self, name) -> str:
        if not isinstance(name, str) or name not in self.names:
            raise UserError(f"unknown base model {str(name)[:200]!r}: this server trains and samples "
                            f"{self.s.model_name!r} (also named by its path {self.ckpt!r})")
        return name

    def model(self, mid) -> Model:
        with self._lock:
            m = self.models.get(mid) if isinstance(mid, str) else None
        if m is None:
            raise UserError(f"unknown model {str(mid)[:80]!r} (a model lives as long as its session and this server "
                            "process: after a restart, resume from a save_state path with "
                            "create_training_client_from_state_with_optimizer)")
        return m

    def create_model(self, body: dict) -> dict:
        s = self.session(body.get("session_id"))
        base = self.check_base(body.get("base_model"))
        lc = body.get("lora_config") or {}
        if not isinstance(lc, dict):
            raise UserError("lora_config must be an object")
        rank, seed = lc.get("rank"), lc.get("seed")
        if not isinstance(rank, int) or isinstance(rank, bool) or not 1 <= rank <= self.max_rank:
            raise UserError(f"lora_config.rank must be an integer in [1, {self.max_rank}] (this server's limit, "
                            f"--tinker-max-rank), got {str(rank)[:40]}")
        if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
            raise UserError("lora_config.seed must be an integer or null")
        flags = {k: bool(lc.get(k, True)) for k in ("train_mlp", "train_attn", "train_unembed")}
        self._check_optimizer(body.get("optimizer_config"))
        targets = lora_targets(self.cfg, **flags)
        if not targets:
            raise UserError(f"nothing to train: the flags {flags} select no layer of this model")
        seq = body.get("model_seq_id")
        if not isinstance(seq, int) or isinstance(seq, bool) or seq < 0:
            raise UserError("model_seq_id must be a non-negative integer")
        mid = f"{s.id}:train:{seq}"
        seed = int.from_bytes(os.urandom(4), "little") if seed is None else seed
        lora = LoraConfig(targets=targets, rank=rank, alpha=LORA_ALPHA, init_seed=seed & 0x7FFFFFFF)
        meta = body.get("user_metadata") or {}
        return self._create(mid, "create", dict(session=s, base=base, lora=lora, flags={"rank": rank, "seed": seed,
                                                                                          **flags}, meta=meta))

    def _check_optimizer(self, oc) -> None:
        if oc is not None and (not isinstance(oc, dict) or oc.get("type", "adamw") != "adamw"):
            kind = oc.get("type") if isinstance(oc, dict) else oc
            raise UserError(f"optimizer {str(kind)[:40]!r} is not supported by nemo-jax serve: use AdamW (the default)")

    def _create(self, mid: str, kind: str, args: dict) -> dict:
        with self._lock:
            if mid in self._creating:  # a retried submission
                return {"request_id": self._creating[mid], "model_id": mid}
            rec = self.futures.create(kind, mid)
            self._creating[mid] = rec.id
            self._work.append(Item(kind, rec.id, args=dict(args, model_id=mid)))
            self._cv.notify_all()
        return {"request_id": rec.id, "model_id": mid}

    def load_weights(self, body: dict) -> dict:
        path = body.get("path")
        parse_path(path)
        opt = body.get("optimizer")
        if not isinstance(opt, bool):
            raise UserError("optimizer must be true or false")
        if body.get("model_id") is not None:  # the deprecated load_state: a request of an existing model
            return self.submit(body.get("model_id"), body.get("seq_id"), "load_state",
                               dict(path=path, optimizer=opt))
        s = self.session(body.get("session_id"))
        seq = body.get("model_seq_id")
        if not isinstance(seq, int) or isinstance(seq, bool) or seq < 0:
            raise UserError("model_seq_id must be a non-negative integer")
        if body.get("base_model") is not None:
            self.check_base(body.get("base_model"))
        if not opt:
            self._check_optimizer(body.get("optimizer_config"))
        return self._create(f"{s.id}:train:{seq}", "load_create",
                            dict(session=s, path=path, optimizer=opt, base=body.get("base_model"),
                                 meta=body.get("user_metadata") or {}))

    def info(self, mid) -> dict:
        m = self.model(mid)
        return {"type": "get_info", "model_id": m.id, "is_lora": True, "lora_rank": m.lora.rank,
                "model_name": m.base_model, "optimizer_config": {"type": "adamw"},
                "model_data": {"arch": "nemotron_h", "model_name": m.base_model,
                               "tokenizer_id": self.tokenizer_dir}}

    def _register(self, s: Session, mid: str, base: str, lora: LoraConfig, flags: dict, adapters, meta: dict,
                  opt=None) -> Model:
        put = lambda t: jax.tree.map(jnp.asarray, t)  # noqa: E731
        adapters = put(adapters)
        if opt is None:
            m, v, step = zeros_like_trained(adapters), zeros_like_trained(adapters), 0
        else:
            m, v, step = put(opt[0]), put(opt[1]), opt[2]
        model = Model(mid, s.id, base, lora, flags, adapters, m, v, step, user_metadata=meta)
        self.store.write_run(mid, self._run_record(model))
        with self._lock:
            self.models[mid] = model
            s.models.add(mid)
        return model

    def _run_record(self, m: Model) -> dict:
        return {"training_run_id": m.id, "base_model": m.base_model, "model_owner": "nemo-jax", "is_lora": True,
                "lora_rank": m.lora.rank, "lora": dict(m.flags, targets=list(m.lora.targets), alpha=m.lora.alpha),
                "user_metadata": {str(k): str(v) for k, v in (m.user_metadata or {}).items()},
                "created": m.created, "last_request_time": m.last_request}

    # ------------------------------------------------------------------ a model's requests, in seq_id order
    def submit(self, mid, seq, kind: str, args: dict, merge: tuple | None = None, error: str | None = None) -> dict:
        """Queue a request of model `mid` as its `seq`-th -> {request_id, model_id}. A seq_id submitted again (a
        retry) gets the same future. `error`: the request is refused (its future fails now) but holds its place."""
        m = self.model(mid)
        if not isinstance(seq, int) or isinstance(seq, bool) or seq < 0:
            raise UserError("seq_id must be a non-negative integer")
        with self._lock:
            if seq in m.seen:
                return {"request_id": m.seen[seq], "model_id": m.id}
            rec = self.futures.create(kind, m.id)
            m.seen[seq] = rec.id
            m.last_request = time.time()
            self.sessions[m.session].last_seen = m.last_request
            if seq < m.next_seq:
                self.futures.fail(rec.id, f"request seq_id {seq} of model {m.id} arrived after the requests behind it "
                                  f"ran (the server waited {GAP_S:.0f} s for it)")
            else:
                if error is not None:
                    self.futures.fail(rec.id, error, "user")
                    kind, args, merge = "noop", {}, None
                m.pending[seq] = Item(kind, rec.id, m, seq, args, merge)
                self._release_locked(m)
        return {"request_id": rec.id, "model_id": m.id}

    def _release_locked(self, m: Model) -> None:
        moved = False
        while m.next_seq in m.pending:
            self._work.append(m.pending.pop(m.next_seq))
            m.next_seq += 1
            moved = True
        if not m.pending:
            m.blocked_since = None
        elif moved or m.blocked_since is None:  # waiting (again) for the request at next_seq
            m.blocked_since = time.time()
        if len(m.seen) > 4096:  # (retries come soon after the original: old ids are dropped)
            m.seen = {k: v for k, v in m.seen.items() if k >= m.next_seq - 1024}
        if moved:
            self._cv.notify_all()

    def _gaps_locked(self) -> None:
        now = time.time()
        for m in list(self.models.values()):
            if m.pending and m.blocked_since is not None and now - m.blocked_since > GAP_S:
                first = min(m.pending)
                print(f"nemo-jax serve (tinker): model {m.id}: request seq_id {m.next_seq} never arrived in "
                      f"{GAP_S:.0f} s; running seq_id {first} on", flush=True)
                m.next_seq, m.blocked_since = first, None
                self._release_locked(m)

    def _sessions_locked(self) -> None:
        now = time.time()
        for s in list(self.sessions.values()):
            if not s.finished and now - s.last_seen > SESSION_TTL_S:
                s.finished = True
                self._drop_models(s)

    # ------------------------------------------------------------------ the worker
    def _run(self) -> None:
        last_sweep = time.time()
        while True:
            with self._cv:
                while True:
                    if time.time() - last_sweep > 10.0:  # (busy or not: gaps and idle sessions every 10 s)
                        self._gaps_locked()
                        self._sessions_locked()
                        last_sweep = time.time()
                    if self._work or self._closed:
                        break
                    self._cv.wait(timeout=10.0)
                if self._closed:
                    return
                group = [self._work.popleft()]
                if group[0].merge is not None:  # the chunks after it of the same model and loss
                    head, rest = group[0], deque()
                    while self._work:
                        it = self._work.popleft()
                        if it.model is head.model and it.merge == head.merge and it.seq == group[-1].seq + 1:
                            group.append(it)
                        elif it.model is head.model:
                            rest.append(it)
                            break
                        else:
                            rest.append(it)
                    self._work.extendleft(reversed(rest))
            self._execute(group)

    def _execute(self, group: list[Item]) -> None:
        kind, t0 = group[0].kind, time.perf_counter()
        try:
            if kind == "fwdbwd":
                self._fwdbwd(group)
                return
            out = getattr(self, "_do_" + kind)(group[0])
            if group[0].rid is not None and out is not None:
                self.futures.complete(group[0].rid, out)
        except (UserError, ValueError) as e:  # the request's own fault (ValueError: a shape or value it gave)
            for it in group:
                if it.rid is not None:
                    self.futures.fail(it.rid, str(e), "user")
        except Exception as e:  # this server's fault: logged, that request fails, the server and others go on
            traceback.print_exc()
            for it in group:
                if it.rid is not None:
                    self.futures.fail(it.rid, f"{type(e).__name__}: {e}"[:2000], "server")
        finally:
            with self._lock:
                b = self.busy.setdefault(kind, [0, 0.0])
                b[0] += len(group)
                b[1] += time.perf_counter() - t0

    def stats(self) -> dict:
        """GET /api/v1/stats: what the service holds, and the worker's requests and seconds by kind."""
        with self._lock:
            return {"sessions": sum(not s.finished for s in self.sessions.values()), "models": len(self.models),
                    "sampling_sessions": len(self.samplers), "queued": len(self._work),
                    "worker": {k: {"requests": n, "seconds": round(t, 6)} for k, (n, t) in self.busy.items()}}

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        self._thread.join(timeout=30)

    def unload(self, mid) -> dict:
        m = self.model(mid)
        with self._lock:
            self._forget_locked(m)
        rec = self.futures.create("unload_model", m.id)
        self.futures.complete(rec.id, {"type": "unload_model", "model_id": m.id})
        return {"request_id": rec.id, "model_id": m.id}

    # ------------------------------------------------------------------ the work itself (worker thread)
    def _do_noop(self, it: Item) -> None:  # a refused request's place in its model's order
        return None

    def _do_create(self, it: Item) -> dict:
        a = it.args
        adapters = new_adapters(self.cfg, a["lora"])
        self._register(a["session"], a["model_id"], a["base"], a["lora"], a["flags"], adapters, a["meta"])
        return {"type": "create_model", "model_id": a["model_id"]}

    def _do_load_create(self, it: Item) -> dict:
        a = it.args
        lora, adapters, opt, meta = self.store.load(a["path"], self.cfg, optimizer=a["optimizer"])
        base = a["base"] or meta.get("base_model") or self.s.model_name
        flags = dict(meta.get("lora") or {}, rank=lora.rank)
        self._register(a["session"], a["model_id"], base, lora, flags, adapters, a["meta"] or
                       meta.get("run_user_metadata") or {}, opt)
        return {"type": "load_weights", "path": a["path"], "model_id": a["model_id"]}

    def _do_load_state(self, it: Item) -> dict:
        m = it.model
        lora, adapters, opt, _ = self.store.load(it.args["path"], self.cfg, optimizer=it.args["optimizer"])
        if lora.targets != m.lora.targets or lora.rank != m.lora.rank:
            raise UserError(f"{it.args['path']} holds LoRA rank {lora.rank} on {list(lora.targets)}; model {m.id} "
                            f"has rank {m.lora.rank} on {list(m.lora.targets)}")
        m.adapters = jax.tree.map(jnp.asarray, adapters)
        if opt is not None:
            m.m, m.v, m.step = jax.tree.map(jnp.asarray, opt[0]), jax.tree.map(jnp.asarray, opt[1]), opt[2]
        m.grads = None
        return {"type": "load_weights", "path": it.args["path"], "model_id": m.id}

    def rows(self, data: list, loss_fn: str) -> list[dict]:
        """Decoded datums -> learner rows; every shape, id and value checked (errors name the datum and field)."""
        if not data:
            raise UserError("forward_backward: no datums")
        need = ("target_tokens",) + LOSSES[loss_fn].inputs
        V = self.cfg.vocab_size
        out = []
        for i, d in enumerate(data):
            tokens, pics = flatten(self.cfg, d.chunks, f"datum {i}")
            L = len(tokens)
            if not 1 <= L <= self.max_len:
                raise UserError(f"datum {i}: the model input has {L} tokens (1 to {self.max_len}, the server's "
                                "--max-model-len)")
            row = {"tokens": tokens, "pics": [p for _, p in pics]}
            for k in need:
                if k not in d.inputs:
                    raise UserError(f"datum {i}: loss_fn_inputs lacks {k!r} ({loss_fn} needs {', '.join(need)})")
                x = d.inputs[k]
                if x.shape != (L,):
                    raise UserError(f"datum {i}: loss_fn_inputs[{k!r}] has shape {list(x.shape)}; the model input has "
                                    f"{L} tokens (it must be [{L}])")
                if k == "target_tokens":
                    bad = np.flatnonzero((x < 0) | (x >= V))
                    if len(bad):
                        raise UserError(f"datum {i}: target_tokens[{bad[0]}] = {x[bad[0]]} is outside the vocabulary "
                                        f"[0, {V})")
                    row["targets"] = x.astype(np.int32)
                else:
                    bad = np.flatnonzero(~np.isfinite(x))
                    if len(bad):
                        raise UserError(f"datum {i}: loss_fn_inputs[{k!r}][{bad[0]}] is {x[bad[0]]} (not finite)")
                    row[k] = x.astype(np.float32)
            out.append(row)
        return out

    def _fwdbwd(self, group: list[Item]) -> None:
        head = group[0]
        m, loss_fn, backward = head.model, head.args["loss_fn"], not head.args["forward_only"]
        rows, owner = [], []
        for k, it in enumerate(group):
            try:
                r = self.rows(it.args["data"], loss_fn)
            except UserError as e:
                self.futures.fail(it.rid, str(e), "user")
                continue
            rows += r
            owner += [k] * len(r)
        if not rows:
            return
        lps, losses, grads = self.learner.run(m.adapters, rows, loss_fn, head.args["config"], backward)
        if backward:
            m.grads = grads if m.grads is None else jax.tree.map(jnp.add, m.grads, grads)
        for k, it in enumerate(group):
            if not self.futures.pending(it.rid):
                continue
            mine = [i for i, o in enumerate(owner) if o == k]
            self.futures.complete(it.rid, wire.encode_forward_backward_output(
                [{"logprobs": lps[i]} for i in mine], {"loss:sum": float(losses[mine].sum())}))

    def _do_optim(self, it: Item) -> dict:
        m, hp = it.model, it.args["hp"]
        if m.grads is None:  # nothing to apply (as torch skips parameters without a gradient)
            return {"type": "optim_step", "metrics": {"grad_norm:mean": 0.0, "step:max": float(m.step)}}
        grads, m.grads = m.grads, None
        params, mm, vv, norm, finite = adamw(m.adapters, grads, m.m, m.v, np.int32(m.step),
                                             {k: np.float32(v) for k, v in hp.items()})
        norm, finite = jax.device_get((norm, finite))
        if not finite:
            raise UserError(f"the gradient norm is {float(norm)} (not finite): the update was skipped; the adapters "
                            "and optimiser state are unchanged")
        m.adapters, m.m, m.v, m.step = params, mm, vv, m.step + 1
        self._refresh_inflight(m)
        return {"type": "optim_step", "metrics": {"grad_norm:mean": float(norm), "step:max": float(m.step)}}

    def _do_save_state(self, it: Item) -> dict:
        m, a = it.model, it.args
        name = a["name"] if a["name"] is not None else f"step-{m.step:06d}"
        meta = {"kind": "weights", "step": m.step, "base_model": m.base_model, "lora": m.flags,
                "ttl_seconds": a["ttl"], "user_metadata": a["meta"], "run_user_metadata": m.user_metadata}
        path = self.store.save(m.id, "weights", name, self.cfg, m.lora, m.adapters, meta=meta,
                               optimizer=(m.m, m.v, m.step), overwrite=a["overwrite"])
        with self._lock:
            self._loaded.pop(path, None)  # (a sampling session made from it later reads it anew)
        self.store.write_run(m.id, self._run_record(m))
        return {"type": "save_weights", "path": path}

    def _do_save_sampler(self, it: Item) -> dict:
        m, a = it.model, it.args
        if a["name"] is not None:
            meta = {"kind": "sampler_weights", "step": m.step, "base_model": m.base_model, "lora": m.flags,
                    "ttl_seconds": a["ttl"], "user_metadata": a["meta"], "run_user_metadata": m.user_metadata}
            path = self.store.save(m.id, "sampler_weights", a["name"], self.cfg, m.lora, m.adapters, meta=meta)
            self.store.write_run(m.id, self._run_record(m))
            return {"type": "save_weights_for_sampler", "path": path}
        sid = f"{m.session}:sample:{a['sampling_seq']}"
        sampler = Sampler(sid, m.base_model, None, self._adapter(f"{m.id}@{m.step}", m.adapters))
        with self._lock:
            self.samplers[sid] = sampler
            if a["kind"] == "inflight":
                m.inflight.append(sid)
            else:
                m.snapshots.append(sid)
                while len(m.snapshots) > MAX_SNAPSHOTS:
                    self.samplers.pop(m.snapshots.popleft(), None)
        return {"type": "save_weights_for_sampler", "sampling_session_id": sid}

    def _refresh_inflight(self, m: Model) -> None:
        if m.inflight:
            ad = self._adapter(f"{m.id}@{m.step}", m.adapters)
            with self._lock:
                for sid in m.inflight:
                    if sid in self.samplers:
                        self.samplers[sid].adapter = ad

    def _adapter(self, name: str, tree):
        from nemo_jax.serve.scheduler import Adapter

        return Adapter(name, name, tree, self.s.next_version())

    # ------------------------------------------------------------------ sampling
    def create_sampling_session(self, body: dict) -> dict:
        s = self.session(body.get("session_id"))
        seq = body.get("sampling_session_seq_id")
        if not isinstance(seq, int) or isinstance(seq, bool) or seq < 0:
            raise UserError("sampling_session_seq_id must be a non-negative integer")
        path, base = body.get("model_path"), body.get("base_model")
        sid = f"{s.id}:sample:{seq}"
        with self._lock:
            if sid in self.samplers:
                return {"type": "create_sampling_session", "sampling_session_id": sid}
        if path is not None:
            parse_path(path)
            with self._lock:
                got = self._loaded.get(path)
            if got is None:
                _, adapters, _, meta = self.store.load(path, self.cfg, optimizer=False)
                got = (self._adapter(path, jax.tree.map(jnp.asarray, adapters)),
                       meta.get("base_model") or self.s.model_name)
                with self._lock:
                    self._loaded[path] = got
                    while len(self._loaded) > 4 * MAX_SNAPSHOTS:
                        self._loaded.pop(next(iter(self._loaded)))
            sampler = Sampler(sid, base or got[1], path, got[0])
        else:
            sampler = Sampler(sid, self.check_base(base), None, None)
        with self._lock:
            self.samplers[sid] = sampler
            s.samplers.add(sid)
        return {"type": "create_sampling_session", "sampling_session_id": sid}

    def sampler(self, sid) -> Sampler:
        with self._lock:
            sp = self.samplers.get(sid) if isinstance(sid, str) else None
        if sp is None:
            raise UserError(f"unknown sampling session {str(sid)[:80]!r} (snapshots of save_weights_and_get_sampling_"
                            f"client are kept for a model's last {MAX_SNAPSHOTS}; sessions end when the server "
                            "restarts: save_weights_for_sampler names weights that last)")
        return sp

    def sample(self, body: dict) -> dict:
        """asample: the prompt's samples through serve's scheduler (and, asked, its logprobs through the learner)
        -> {request_id, sample_sequence_ids}. The scheduler's APIError (429 when full) is raised as it is."""
        from nemo_jax.serve.openai import Prompt
        from nemo_jax.serve.scheduler import Job

        sp = self.sampler(body.get("sampling_session_id"))
        for key, why in (("topk_prompt_logprobs", "top-k prompt logprobs"),
                         ("prompt_alt_tokens_k", "prompt alternative tokens")):
            if body.get(key):
                raise UserError(f"{key}: {why} are not supported by nemo-jax serve")
        if body.get("target_prompt_logprobs") is not None:
            raise UserError("target_prompt_logprobs is not supported by nemo-jax serve (use prompt_logprobs)")
        tokens, pics = flatten(self.cfg, wire.model_input(body.get("prompt")), "prompt")
        if not len(tokens):
            raise UserError("the prompt is empty")
        n = body.get("num_samples", 1)
        if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= MAX_SAMPLES:
            raise UserError(f"num_samples must be an integer in [1, {MAX_SAMPLES}]")
        topk = body.get("topk_sample_logprobs") or 0
        if not isinstance(topk, int) or isinstance(topk, bool) or not 0 <= topk <= 20:
            raise UserError("topk_sample_logprobs must be an integer in [0, 20]")
        samples, stops = self.sampling_params(body.get("sampling_params") or {}, len(tokens), n, topk)
        want_lp = bool(body.get("prompt_logprobs"))
        last_n = body.get("prompt_logprobs_last_n")
        if last_n is not None and (not isinstance(last_n, int) or isinstance(last_n, bool)
                                   or not 1 <= last_n < len(tokens)):
            raise UserError(f"prompt_logprobs_last_n must be an integer in [1, {len(tokens) - 1}]")
        rec = self.futures.create("sample")
        parts: dict = {}
        lock = threading.Lock()

        def finish(key, value):  # (the engine thread, the worker): the response once every part is in
            with lock:
                parts[key] = value
                if len(parts) < (2 if want_lp else 1):
                    return
            got, plp = parts["samples"], parts.get("prompt")
            if isinstance(got, BaseException):
                code = getattr(got, "status", 500)
                self.futures.fail(rec.id, str(got), "user" if 400 <= code < 500 else "server")
            elif isinstance(plp, BaseException):
                self.futures.fail(rec.id, f"prompt logprobs: {type(plp).__name__}: {plp}", "server")
            else:
                if plp is not None and last_n is not None:
                    plp = np.where(np.arange(len(plp)) < len(plp) - last_n, np.nan, plp)
                seqs = [wire.Sequence(x.tokens, x.logprobs, x.finish_reason == "stop", x.top) for x in got]
                self.futures.complete(rec.id, wire.encode_sample_response(seqs, plp, topk))

        job = Job(Prompt([int(t) for t in tokens], [img for img, _ in pics], samples, stops), sp.adapter,
                  lambda r: finish("samples", r))
        try:
            self.s.scheduler.submit(job)
        except BaseException as e:
            self.futures.fail(rec.id, str(e), "user")
            raise
        if want_lp:
            with self._cv:
                self._work.append(Item("prompt_lp", None, args=dict(
                    adapter=sp.adapter, tokens=tokens, pics=[p for _, p in pics], done=lambda x: finish("prompt", x))))
                self._cv.notify_all()
        return {"request_id": rec.id, "sample_sequence_ids": [f"{rec.id}:{i}" for i in range(n)]}

    def _do_prompt_lp(self, it: Item) -> None:
        try:
            ad = it.args["adapter"]
            it.args["done"](self.learner.prompt_logprobs(None if ad is None else ad.tree, it.args["tokens"],
                                                         it.args["pics"]))
        except Exception as e:  # answered through the sample's future
            traceback.print_exc()
            it.args["done"](e)

    def sampling_params(self, p: dict, prompt_len: int, n: int, topk: int = 0):
        """The SDK's SamplingParams -> (nemo_jax SamplingParams of each of the n samples, stop strings)."""
        from nemo_jax.generate import MAX_STOP_BYTES, SamplingParams

        if not isinstance(p, dict):
            raise UserError("sampling_params must be an object")
        V, bucket = self.cfg.vocab_size, self.s.bucket
        room = self.max_len - -(-prompt_len // bucket) * bucket
        if room < 1:
            raise UserError(f"the prompt has {prompt_len} tokens: no room to sample within --max-model-len "
                            f"{self.max_len}")
        mt = p.get("max_tokens")
        mt = room if mt is None else mt
        if not isinstance(mt, int) or isinstance(mt, bool) or not 1 <= mt <= room:
            raise UserError(f"max_tokens must be in [1, {room}] for a prompt of {prompt_len} tokens (--max-model-len "
                            f"{self.max_len})")

        def num(key, default, lo, hi):
            x = p.get(key, default)
            x = default if x is None else x
            if isinstance(x, bool) or not isinstance(x, (int, float)) or not lo <= x <= hi:
                raise UserError(f"sampling_params.{key} must be a number in [{lo}, {hi}], got {str(x)[:40]}")
            return x
        temperature = float(num("temperature", 1.0, 0, 100))
        top_p = float(num("top_p", 1.0, 0, 1))
        if top_p <= 0:
            raise UserError("sampling_params.top_p must be > 0")
        top_k = int(num("top_k", -1, -1, 2 ** 31 - 1))
        top_k = 0 if top_k < 0 or top_k >= V else top_k
        seed = p.get("seed")
        if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
            raise UserError("sampling_params.seed must be an integer")
        stop = p.get("stop")
        strs, ids = [], tuple(self.s.stop_ids)  # None: the model's end-of-sequence tokens
        if stop is not None:
            stop = [stop] if isinstance(stop, str) else stop
            if not isinstance(stop, list) or len(stop) > 64:
                raise UserError("sampling_params.stop must be a string or a list of at most 64 strings or token ids")
            if all(isinstance(x, str) for x in stop):
                strs, ids = stop, ()
                if any(not 0 < len(x.encode()) <= MAX_STOP_BYTES for x in strs):
                    raise UserError(f"sampling_params.stop: stop strings of 1 to {MAX_STOP_BYTES} bytes")
            elif all(isinstance(x, int) and not isinstance(x, bool) for x in stop):
                if any(not 0 <= x < V for x in stop):
                    raise UserError(f"sampling_params.stop: token ids in [0, {V})")
                ids = tuple(sorted(set(stop)))
            else:
                raise UserError("sampling_params.stop: all strings or all token ids")
        out = [SamplingParams(max_new_tokens=mt, temperature=temperature, top_k=top_k, top_p=top_p,
                              stop_token_ids=ids, seed=None if seed is None else (seed + i) & 0xFFFFFFFF,
                              stop=tuple(strs), top_logprobs=topk) for i in range(n)]
        return out, list(strs)

    # ------------------------------------------------------------------ the REST lookups
    def training_run(self, run_id) -> dict:
        check_run_id(run_id)
        with self._lock:
            m = self.models.get(run_id)
        r = self._run_record(m) if m is not None else self.store.run(run_id)
        ck = self.store.checkpoints(run_id)
        last = lambda t: next((c for c in reversed(ck) if c["checkpoint_type"] == t), None)  # noqa: E731
        return {"training_run_id": r["training_run_id"], "base_model": r["base_model"],
                "model_owner": r.get("model_owner", "nemo-jax"), "is_lora": True, "corrupted": False,
                "lora_rank": r.get("lora_rank"), "last_request_time": iso_time(r.get("last_request_time", 0)),
                "last_checkpoint": last("training"), "last_sampler_checkpoint": last("sampler"),
                "user_metadata": r.get("user_metadata") or None}

    def weights_info(self, path) -> dict:
        run_id, _, _ = parse_path(path)
        d = self.store.run(run_id)
        lora = d.get("lora") or {}
        return {"base_model": d["base_model"], "is_lora": True, "lora_rank": d.get("lora_rank"),
                "optimizer_config": {"type": "adamw"}, **{k: lora.get(k) for k in ("train_unembed", "train_mlp",
                                                                                 "train_attn")}}

    def delete_checkpoint(self, run_id, kind, name) -> None:
        check_name(name)
        self.store.delete(run_id, kind, name)
        with self._lock:
            self._loaded.pop(f"tinker://{run_id}/{kind}/{name}", None)

    def capabilities(self) -> dict:
        return {"supported_models": [{"model_name": self.s.model_name, "max_context_length": self.max_len,
                                      "trainable": True, "sampleable": True}]}
