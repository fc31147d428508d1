"""What the Tinker service holds: sessions (ended by `finish` or SESSION_TTL_S without a heartbeat or request),
training models (a LoRA adapter set, its AdamW state and its place in its seq_id order) and sampling sessions (an
adapter snapshot, a saved sampler's weights, or the base), each owned by a session and freed with it."""

from __future__ import annotations

import os
import re
import threading
import time
from collections import deque
from dataclasses import dataclass, field

from nemo_jax.lora import LoraConfig
from nemo_jax.lora.adapters import PRESETS, adaptable_paths
from nemo_jax.tinker import wire
from nemo_jax.tinker.wire import UserError

LORA_ALPHA = 32.0  # Tinker's (scale alpha / rank): a cookbook's learning rates mean the same here
SESSION_TTL_S = 900.0  # a session without a heartbeat or request this long is over: its models are freed
MAX_SNAPSHOTS = 8  # ephemeral sampler snapshots kept per model (older sampling sessions expire)


def lora_targets(cfg, train_mlp: bool, train_attn: bool, train_unembed: bool) -> tuple[str, ...]:
    """The SDK's LoRA flags -> nemo_jax LoRA target presets present in this model (docs/tinker.md): train_attn:
    attention q/k/v/o and the Mamba mixers' in/out projections (the hybrid's other sequence mixer); train_mlp: dense
    MLPs, shared experts and every routed expert; train_unembed: lm_head."""
    want = (["attention", "mamba"] if train_attn else []) + (["mlp", "experts"] if train_mlp else []) \
        + (["lm_head"] if train_unembed else [])
    have = list(adaptable_paths(cfg))
    return tuple(t for t in want if any(re.search(PRESETS[t], p) for p in have))


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
    """A training model: LoRA adapters over the served base, their AdamW moments, and its requests' order."""
    id: str
    session: str
    base_model: str
    lora: LoraConfig
    flags: dict  # rank, seed, train_mlp, train_attn, train_unembed
    adapters: object
    adam_m: object  # AdamW's first moments, shaped like the adapters
    adam_v: object  # its second moments
    step: int = 0  # optimiser steps taken
    user_metadata: dict = field(default_factory=dict)
    grads: object = None  # accumulated gradients (None: none pending)
    next_seq: int = 1
    pending: dict = field(default_factory=dict)  # seq_id -> sequencer.Item, waiting for the ones before it
    seen: dict = field(default_factory=dict)  # seq_id -> request id (a retried submission gets the same future)
    blocked_since: float | None = None
    snapshots: deque = field(default_factory=deque)  # ephemeral sampling session ids, oldest first
    inflight: list = field(default_factory=list)  # sampling sessions sharing the model's inflight weights
    created: float = field(default_factory=time.time)
    last_request: float = field(default_factory=time.time)

    def record(self) -> dict:
        """The training run's record (RestClient's view; written beside its checkpoints)."""
        return {"training_run_id": self.id, "base_model": self.base_model, "model_owner": "nemo-jax",
                "is_lora": True, "lora_rank": self.lora.rank,
                "lora": dict(self.flags, targets=list(self.lora.targets), alpha=self.lora.alpha),
                "user_metadata": {str(k): str(v) for k, v in (self.user_metadata or {}).items()},
                "created": self.created, "last_request_time": self.last_request}


@dataclass(eq=False)
class SamplingSession:
    id: str
    base_model: str
    model_path: str | None
    adapter: object  # serve.scheduler.Adapter, or None: the base


class Registry:
    """Sessions, models and sampling sessions by id, under one lock. `names`: what clients may call the base
    model (the served name, the checkpoint's path)."""

    def __init__(self, model_name: str, ckpt: str):
        self.model_name, self.ckpt = model_name, ckpt
        self.names = {model_name, ckpt, os.path.abspath(ckpt), os.path.realpath(ckpt)}
        self.sessions: dict[str, Session] = {}
        self.models: dict[str, Model] = {}
        self.samplers: dict[str, SamplingSession] = {}
        self.lock = threading.RLock()

    # ------------------------------------------------------------------ sessions
    def create_session(self, body: dict) -> dict:
        version = body.get("sdk_version")
        sid = os.urandom(4).hex()
        with self.lock:
            self.sessions[sid] = Session(sid, version if isinstance(version, str) else None,
                                         body.get("user_metadata") or {})
        out = {"type": "create_session", "session_id": sid}
        if not wire.same_minor(version if isinstance(version, str) else None):
            out["warning_message"] = ("nemo-jax serve speaks the Tinker API of SDK " + wire.SDK_VERSION + "; this "
                                      f"client is tinker {version or '(unknown version)'}: if requests fail, "
                                      f"pip install tinker=={wire.SDK_VERSION}")
        return out

    def session(self, sid, *, live: bool = True) -> Session:
        with self.lock:
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
        with self.lock:
            s = self.sessions.get(sid) if isinstance(sid, str) else None
            if s is None:
                return "unknown"
            s.last_seen = time.time()
            return "finished" if s.finished else "ok"

    def finish(self, sid) -> None:
        with self.lock:
            s = self.session(sid, live=False)
            s.finished = True
            self._drop(s)

    def expire(self) -> None:
        """Sessions quiet for SESSION_TTL_S are finished, their models and sampling sessions freed."""
        now = time.time()
        with self.lock:
            for s in list(self.sessions.values()):
                if not s.finished and now - s.last_seen > SESSION_TTL_S:
                    s.finished = True
                    self._drop(s)

    def _drop(self, s: Session) -> None:
        for mid in list(s.models):
            if mid in self.models:
                self.forget(self.models[mid])
        for sid in s.samplers:
            self.samplers.pop(sid, None)
        s.samplers.clear()

    # ------------------------------------------------------------------ models
    def check_base(self, name) -> str:
        if not isinstance(name, str) or name not in self.names:
            raise UserError(f"unknown base model {str(name)[:200]!r}: this server trains and samples "
                            f"{self.model_name!r} (also named by its path {self.ckpt!r})")
        return name

    def model(self, mid) -> Model:
        with self.lock:
            m = self.models.get(mid) if isinstance(mid, str) else None
        if m is None:
            raise UserError(f"unknown model {str(mid)[:80]!r} (a model lives as long as its session and this server "
                            "process: after a restart, resume from a save_state path with "
                            "create_training_client_from_state_with_optimizer)")
        return m

    def add_model(self, m: Model) -> None:
        with self.lock:
            self.models[m.id] = m
            self.sessions[m.session].models.add(m.id)

    def forget(self, m: Model) -> None:
        """A model and its snapshots freed (its checkpoints stay on disk)."""
        with self.lock:
            self.models.pop(m.id, None)
            self.sessions[m.session].models.discard(m.id)
            for sp in list(m.snapshots) + m.inflight:
                self.samplers.pop(sp, None)

    def touched(self, m: Model) -> None:
        """A request of the model came: the model and its session are in use."""
        with self.lock:
            m.last_request = time.time()
            self.sessions[m.session].last_seen = m.last_request

    # ------------------------------------------------------------------ sampling sessions
    def sampler(self, sid) -> SamplingSession:
        with self.lock:
            sp = self.samplers.get(sid) if isinstance(sid, str) else None
        if sp is None:
            raise UserError(f"unknown sampling session {str(sid)[:80]!r} (snapshots of save_weights_and_get_sampling_"
                            f"client are kept for a model's last {MAX_SNAPSHOTS}; sessions end when the server "
                            "restarts: save_weights_for_sampler names weights that last)")
        return sp

    def add_sampler(self, sp: SamplingSession, owner: Session | None = None, model: Model | None = None,
                    inflight: bool = False) -> None:
        """Hold a sampling session: created by `owner` (from a path or the base), or a snapshot of `model` (its
        last MAX_SNAPSHOTS kept), or one sharing the model's inflight weights."""
        with self.lock:
            self.samplers[sp.id] = sp
            if owner is not None:
                owner.samplers.add(sp.id)
            elif inflight:
                model.inflight.append(sp.id)
            else:
                model.snapshots.append(sp.id)
                while len(model.snapshots) > MAX_SNAPSHOTS:
                    self.samplers.pop(model.snapshots.popleft(), None)

    def counts(self) -> dict:
        with self.lock:
            return {"sessions": sum(not s.finished for s in self.sessions.values()), "models": len(self.models),
                    "sampling_sessions": len(self.samplers)}
