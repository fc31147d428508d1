"""The Tinker service over several processes (`nemo_jax.serve.replica`): what of it goes into the call log.

Two things do device work: the worker's requests (`Sequencer._execute`: creates, loads, forward / backward,
optimiser steps, saves, snapshots, prompt logprobs) and a sampling session made from saved weights (they are read
and placed). On the leader both are logged before they run; a follower replays them on its own TinkerService, whose
futures nobody waits on and whose store reads but never writes (the leader writes; a save's gather still runs on
every process). Items go by reference: a model by id, a session by id (a follower makes the sessions it is told of),
an adapter set by version; callbacks stay on the leader.
"""

from __future__ import annotations

from nemo_jax.serve.scheduler import Adapter
from nemo_jax.tinker.registry import Session
from nemo_jax.tinker.sequencer import Item, Kind

TARGET = "tinker"


def _ref(x):
    if isinstance(x, Session):
        return ("session", x.id)
    if isinstance(x, Adapter):
        return ("adapter", x.version)
    return x


def encode(group: list[Item]) -> list[tuple]:
    return [(it.kind.value, it.request_id, None if it.model is None else it.model.id, it.seq,
             {k: _ref(v) for k, v in it.args.items() if not callable(v)}, it.merge) for it in group]


def leader(svc, replica) -> None:
    """Log the service's device work on the leader (`replica`: a serve.replica.Leader)."""
    execute, create = svc.sequencer._execute, svc.sampling.create_session
    svc.sequencer._execute = lambda group: replica.run(TARGET, "execute", (encode(group),), lambda: execute(group))
    svc.sampling.create_session = lambda body: replica.run(TARGET, "sampling_session", (body,), lambda: create(body))


def follower(svc, adapters):
    """A follower's replay of the service's units (`adapters`: serve's AdapterRegistry, versions -> trees). Its
    store never writes and its sessions never expire (the leader's do)."""
    svc.store.read_only = True
    svc.registry.expire = lambda: None
    reg = svc.registry

    def session(sid: str) -> Session:
        with reg.lock:
            if sid not in reg.sessions:
                reg.sessions[sid] = Session(sid, None, {})
            return reg.sessions[sid]

    def deref(v):
        if isinstance(v, tuple) and len(v) == 2 and v[0] == "session":
            return session(v[1])
        if isinstance(v, tuple) and len(v) == 2 and v[0] == "adapter":
            return None if not v[1] else adapters.made(v[1])
        return v

    def replay(method: str, args: tuple):
        if method == "sampling_session":
            body = args[0]
            session(body.get("session_id"))
            svc.sampling.create_session(body)
            return
        group = []
        for kind, rid, mid, seq, a, merge in args[0]:
            a = {k: deref(v) for k, v in a.items()}
            if Kind(kind) == Kind.PROMPT_LOGPROBS:
                a["done"] = lambda x: None
            group.append(Item(Kind(kind), rid, None if mid is None else reg.models.get(mid), seq, a, merge))
        svc.sequencer._execute(group)
    return replay
