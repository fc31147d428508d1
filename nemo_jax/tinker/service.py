"""The Tinker API service behind `nemo-jax serve --tinker-root`: the facade the routes call, over

    registry.py   sessions, training models, sampling sessions
    sequencer.py  each model's requests in seq_id order, chunk merging, the worker thread and its handler table
    sampling.py   sampling sessions and asample through serve's scheduler
    learner.py    the compute: one frozen base, jitted forward / backward shared by every model's adapters; AdamW
    store.py      tinker:// checkpoints as nemo-jax adapter checkpoints

* A training model is a LoRA adapter set with its own AdamW state, over the served model's params (never
  copied): `Learner` runs every model's forward / backward with the same compiled programs. Targets come from
  the SDK's flags (`lora_targets`), alpha is 32 as on Tinker (scale alpha / rank).
* `save_weights_and_get_sampling_client` snapshots the adapters as they are at that point of the model's sequence
  (updates make new arrays, so a snapshot is a reference, never a copy).
* Every request's bad input fails that request alone, as a user error naming what is wrong (`UserError`).
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np

from nemo_jax.lora import LoraConfig, adapter_shardings
from nemo_jax.parallel.mesh import fetch
from nemo_jax.tinker import wire
from nemo_jax.tinker.futures import FutureStore
from nemo_jax.tinker.learner import Learner, adamw, new_adapters, zeros_like_trained
from nemo_jax.tinker.losses import LOSSES
from nemo_jax.tinker.registry import LORA_ALPHA, Model, Registry, SamplingSession, Session, lora_targets
from nemo_jax.tinker.sampling import Sampling, flatten
from nemo_jax.tinker.sequencer import Item, Kind, Sequencer
from nemo_jax.tinker.store import Store, check_name, check_run_id, iso_time, parse_path
from nemo_jax.tinker.wire import UserError


def _seq_id(body: dict, key: str) -> int:
    seq = body.get(key)
    if not isinstance(seq, int) or isinstance(seq, bool) or seq < 0:
        raise UserError(f"{key} must be a non-negative integer")
    return seq


class TinkerService:
    def __init__(self, serve_state, store_root: str, *, ckpt: str, tokenizer_dir: str, max_rank: int = 128,
                 max_tokens: int = 16384, batch_clients: int = 1):
        """serve_state: nemo_jax.serve.app.ServerState (the served model's config, params, scheduler, name);
        batch_clients: how many training models' forward_backward requests ready at once run as one call."""
        self.s = serve_state
        self.cfg, self.max_len = serve_state.cfg, serve_state.max_len
        self.max_rank = max_rank
        self.tokenizer_dir = os.path.abspath(tokenizer_dir)
        self.store = Store(store_root)
        self.futures = FutureStore()
        # the learner computes over the engine's own copy of the base (its layers one by one): the weights are held
        # once, whether the Tinker API is on or not
        self.learner = Learner(self.cfg, serve_state.params, max_tokens=max_tokens)
        self.registry = Registry(serve_state.model_name, ckpt)
        self._creating: dict[str, str] = {}  # model id -> request id of its create / load (a retry gets it)
        handlers = {Kind.CREATE: self._create_model, Kind.LOAD_CREATE: self._load_create,
                    Kind.LOAD_STATE: self._load_state, Kind.FORWARD_BACKWARD: self._forward_backward,
                    Kind.OPTIM: self._optim, Kind.SAVE_STATE: self._save_state, Kind.SAVE_SAMPLER: self._save_sampler,
                    Kind.PROMPT_LOGPROBS: lambda items: self.sampling.prompt_logprobs(items),
                    Kind.REFUSED: lambda items: None}
        self.sequencer = Sequencer(self.futures, handlers, self.registry, batch_models=batch_clients)
        self.sampling = Sampling(serve_state, self.registry, self.sequencer, self.futures, self.store, self.learner)

    # ------------------------------------------------------------------ sessions and sampling (the routes' calls)
    def create_session(self, body: dict) -> dict:
        return self.registry.create_session(body)

    def heartbeat(self, sid) -> str:
        return self.registry.heartbeat(sid)

    def finish(self, sid) -> None:
        self.registry.finish(sid)

    def create_sampling_session(self, body: dict) -> dict:
        return self.sampling.create_session(body)

    def sampler(self, sid) -> SamplingSession:
        return self.registry.sampler(sid)

    def sample(self, body: dict) -> dict:
        return self.sampling.sample(body)

    # ------------------------------------------------------------------ models
    def create_model(self, body: dict) -> dict:
        s = self.registry.session(body.get("session_id"))
        base = self.registry.check_base(body.get("base_model"))
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
        mid = f"{s.id}:train:{_seq_id(body, 'model_seq_id')}"
        seed = int.from_bytes(os.urandom(4), "little") if seed is None else seed
        lora = LoraConfig(targets=targets, rank=rank, alpha=LORA_ALPHA, init_seed=seed & 0x7FFFFFFF)
        meta = body.get("user_metadata") or {}
        return self._creation(mid, Kind.CREATE, dict(session=s, base=base, lora=lora,
                                                     flags={"rank": rank, "seed": seed, **flags}, meta=meta))

    def _check_optimizer(self, oc) -> None:
        if oc is not None and (not isinstance(oc, dict) or oc.get("type", "adamw") != "adamw"):
            kind = oc.get("type") if isinstance(oc, dict) else oc
            raise UserError(f"optimizer {str(kind)[:40]!r} is not supported by nemo-jax serve: use AdamW (the default)")

    def _creation(self, mid: str, kind: Kind, args: dict) -> dict:
        """A new model's creation, queued (a retried submission gets the same request)."""
        with self.registry.lock:
            if mid in self._creating:
                return {"request_id": self._creating[mid], "model_id": mid}
            rec = self.futures.create(kind.value, mid)
            self._creating[mid] = rec.id
        self.sequencer.enqueue(Item(kind, rec.id, args=dict(args, model_id=mid)))
        return {"request_id": rec.id, "model_id": mid}

    def load_weights(self, body: dict) -> dict:
        path = body.get("path")
        parse_path(path)
        opt = body.get("optimizer")
        if not isinstance(opt, bool):
            raise UserError("optimizer must be true or false")
        if body.get("model_id") is not None:  # the deprecated load_state: a request of an existing model
            return self.submit(body.get("model_id"), body.get("seq_id"), Kind.LOAD_STATE,
                               dict(path=path, optimizer=opt))
        s = self.registry.session(body.get("session_id"))
        seq = _seq_id(body, "model_seq_id")
        if body.get("base_model") is not None:
            self.registry.check_base(body.get("base_model"))
        if not opt:
            self._check_optimizer(body.get("optimizer_config"))
        return self._creation(f"{s.id}:train:{seq}", Kind.LOAD_CREATE,
                              dict(session=s, path=path, optimizer=opt, base=body.get("base_model"),
                                   meta=body.get("user_metadata") or {}))

    def info(self, mid) -> dict:
        m = self.registry.model(mid)
        return {"type": "get_info", "model_id": m.id, "is_lora": True, "lora_rank": m.lora.rank,
                "model_name": m.base_model, "optimizer_config": {"type": "adamw"},
                "model_data": {"arch": "nemotron_h", "model_name": m.base_model,
                               "tokenizer_id": self.tokenizer_dir}}

    def unload(self, mid) -> dict:
        m = self.registry.model(mid)
        self.registry.forget(m)
        rec = self.futures.create("unload_model", m.id)
        self.futures.complete(rec.id, {"type": "unload_model", "model_id": m.id})
        return {"request_id": rec.id, "model_id": m.id}

    def submit(self, mid, seq, kind: Kind, args: dict, merge: tuple | None = None, error: str | None = None) -> dict:
        """A request of model `mid` in its seq_id order (`Sequencer.submit`). A merge key gets the model's LoRA
        shape: the requests of models that run in one call share it."""
        m = self.registry.model(mid)
        if merge is not None:
            merge = (*merge, m.lora.rank, m.lora.targets)
        return self.sequencer.submit(m, seq, kind, args, merge, error)

    def place(self, adapters, lora: LoraConfig):
        """An adapter set where the learner computes with it: on a served mesh, each leaf placed by the sharding
        rules the base's are (`adapter_shardings`); else on the default device."""
        if self.s.mesh is None:
            return jax.tree.map(jnp.asarray, adapters)
        return jax.device_put(adapters, adapter_shardings(self.cfg, lora, self.s.mesh))

    def _register(self, s: Session, mid: str, base: str, lora: LoraConfig, flags: dict, adapters, meta: dict,
                  opt=None) -> Model:
        put = lambda t: jax.tree.map(jnp.asarray, t)  # noqa: E731
        adapters = self.place(adapters, lora)
        if opt is None:
            m, v, step = zeros_like_trained(adapters), zeros_like_trained(adapters), 0
        else:
            m, v, step = put(opt[0]), put(opt[1]), opt[2]
        model = Model(mid, s.id, base, lora, flags, adapters, m, v, step, user_metadata=meta)
        self.store.write_run(mid, model.record())
        self.registry.add_model(model)
        return model

    # ------------------------------------------------------------------ the handlers (the worker thread)
    def _create_model(self, items: list[Item]) -> dict:
        a = items[0].args
        adapters = new_adapters(self.cfg, a["lora"])
        self._register(a["session"], a["model_id"], a["base"], a["lora"], a["flags"], adapters, a["meta"])
        return {"type": "create_model", "model_id": a["model_id"]}

    def _load_create(self, items: list[Item]) -> dict:
        a = items[0].args
        lora, adapters, opt, meta = self.store.load(a["path"], self.cfg, optimizer=a["optimizer"])
        base = a["base"] or meta.get("base_model") or self.s.model_name
        flags = dict(meta.get("lora") or {}, rank=lora.rank)
        self._register(a["session"], a["model_id"], base, lora, flags, adapters, a["meta"] or
                       meta.get("run_user_metadata") or {}, opt)
        return {"type": "load_weights", "path": a["path"], "model_id": a["model_id"]}

    def _load_state(self, items: list[Item]) -> dict:
        it = items[0]
        m = it.model
        lora, adapters, opt, _ = self.store.load(it.args["path"], self.cfg, optimizer=it.args["optimizer"])
        if lora.targets != m.lora.targets or lora.rank != m.lora.rank:
            raise UserError(f"{it.args['path']} holds LoRA rank {lora.rank} on {list(lora.targets)}; model {m.id} "
                            f"has rank {m.lora.rank} on {list(m.lora.targets)}")
        m.adapters = self.place(adapters, lora)
        if opt is not None:
            m.adam_m, m.adam_v, m.step = jax.tree.map(jnp.asarray, opt[0]), jax.tree.map(jnp.asarray, opt[1]), opt[2]
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

    def _forward_backward(self, group: list[Item]) -> None:
        """Merged chunks of one or more models, one loss: each model's rows as one batch, the models' batches in
        one call (`Learner.run_many`); each chunk's future answered with its own rows."""
        head = group[0]
        loss_fn, backward = head.args["loss_fn"], not head.args["forward_only"]
        by_model: dict = {}
        for it in group:
            by_model.setdefault(it.model, []).append(it)
        jobs = []  # (model, its items, its rows, the item each row came from)
        for m, items in by_model.items():
            rows, owner = [], []
            for k, it in enumerate(items):
                try:
                    r = self.rows(it.args["data"], loss_fn)
                except UserError as e:
                    self.futures.fail(it.request_id, str(e), "user")
                    continue
                rows += r
                owner += [k] * len(r)
            if rows:
                jobs.append((m, items, rows, owner))
        if not jobs:
            return None
        results = self.learner.run_many([(m.adapters, rows) for m, _, rows, _ in jobs], loss_fn, head.args["config"],
                                        backward, max_jobs=self.sequencer.batch_models)
        for (m, items, _, owner), (lps, losses, grads) in zip(jobs, results):
            if backward:
                m.grads = grads if m.grads is None else jax.tree.map(jnp.add, m.grads, grads)
            for k, it in enumerate(items):
                if not self.futures.pending(it.request_id):
                    continue
                mine = [i for i, o in enumerate(owner) if o == k]
                self.futures.complete(it.request_id, wire.encode_forward_backward_output(
                    [{"logprobs": lps[i]} for i in mine], {"loss:sum": float(losses[mine].sum())}))
        return None

    def _optim(self, items: list[Item]) -> dict:
        m, hp = items[0].model, items[0].args["hp"]
        if m.grads is None:  # nothing to apply (as torch skips parameters without a gradient)
            return {"type": "optim_step", "metrics": {"grad_norm:mean": 0.0, "step:max": float(m.step)}}
        grads, m.grads = m.grads, None
        params, mm, vv, norm, finite = adamw(m.adapters, grads, m.adam_m, m.adam_v, np.int32(m.step),
                                             {k: np.float32(v) for k, v in hp.items()})
        norm, finite = fetch((norm, finite))
        if not finite:
            raise UserError(f"the gradient norm is {float(norm)} (not finite): the update was skipped; the adapters "
                            "and optimiser state are unchanged")
        m.adapters, m.adam_m, m.adam_v, m.step = params, mm, vv, m.step + 1
        self._refresh_inflight(m)
        return {"type": "optim_step", "metrics": {"grad_norm:mean": float(norm), "step:max": float(m.step)}}

    def _meta(self, m: Model, kind: str, a: dict) -> dict:
        return {"kind": kind, "step": m.step, "base_model": m.base_model, "lora": m.flags, "ttl_seconds": a["ttl"],
                "user_metadata": a["meta"], "run_user_metadata": m.user_metadata}

    def _save_state(self, items: list[Item]) -> dict:
        m, a = items[0].model, items[0].args
        name = a["name"] if a["name"] is not None else f"step-{m.step:06d}"
        path = self.store.save(m.id, "weights", name, self.cfg, m.lora, m.adapters, meta=self._meta(m, "weights", a),
                               optimizer=(m.adam_m, m.adam_v, m.step), overwrite=a["overwrite"])
        self.sampling.forget_path(path)  # (a sampling session made from it later reads it anew)
        self.store.write_run(m.id, m.record())
        return {"type": "save_weights", "path": path}

    def _save_sampler(self, items: list[Item]) -> dict:
        m, a = items[0].model, items[0].args
        if a["name"] is not None:
            path = self.store.save(m.id, "sampler_weights", a["name"], self.cfg, m.lora, m.adapters,
                                   meta=self._meta(m, "sampler_weights", a))
            self.store.write_run(m.id, m.record())
            return {"type": "save_weights_for_sampler", "path": path}
        sid = f"{m.session}:sample:{a['sampling_seq']}"
        sampler = SamplingSession(sid, m.base_model, None, self.sampling.adapter(f"{m.id}@{m.step}", m.adapters))
        self.registry.add_sampler(sampler, model=m, inflight=a["kind"] == "inflight")
        return {"type": "save_weights_for_sampler", "sampling_session_id": sid}

    def _refresh_inflight(self, m: Model) -> None:
        if m.inflight:
            ad = self.sampling.adapter(f"{m.id}@{m.step}", m.adapters)
            with self.registry.lock:
                for sid in m.inflight:
                    if sid in self.registry.samplers:
                        self.registry.samplers[sid].adapter = ad

    # ------------------------------------------------------------------ the REST look-ups
    def training_run(self, run_id) -> dict:
        check_run_id(run_id)
        with self.registry.lock:
            m = self.registry.models.get(run_id)
        r = m.record() if m is not None else self.store.run(run_id)
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
        self.sampling.forget_path(f"tinker://{run_id}/{kind}/{name}")

    def capabilities(self) -> dict:
        return {"supported_models": [{"model_name": self.s.model_name, "max_context_length": self.max_len,
                                      "trainable": True, "sampleable": True}]}

    def stats(self) -> dict:
        """GET /api/v1/stats: what the service holds, and the worker's requests and seconds by kind."""
        return {**self.registry.counts(), **self.sequencer.stats()}

    def close(self) -> None:
        self.sequencer.close()
