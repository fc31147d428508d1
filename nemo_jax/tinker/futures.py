"""The Tinker API's futures: every training, sampling and save call answers at once with a request id, and the
client polls `retrieve_future` until the result is there.

A poll is a long poll: it is held until the request finishes (answered the moment it does) or for `HOLD_S`
seconds, then answered `try_again` (the SDK polls again at once, so a shorter hold only costs requests; its own
timeout is 45 s). A failed request answers `{"error", "category"}` with the SDK's categories: `user` (the
request's own fault), `server` (this server's), `unknown`. Results are kept `KEEP_S` seconds after they finish (a
retried poll finds them again). Request ids carry this server process's id: the id of a request an earlier run of
the server took (lost by a restart) answers with an error, never a hang.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field

HOLD_S = 25.0
KEEP_S = 3600.0
MAX_KEPT = 100_000  # finished results kept at most (the oldest are dropped first)


@dataclass(eq=False)
class Record:
    id: str
    kind: str
    model_id: str | None = None
    created: float = field(default_factory=time.time)
    done: bool = False
    payload: object = None  # bytes (protobuf) or a JSON-able dict
    error: str | None = None
    category: str = "user"
    finished: float = 0.0
    waiters: list = field(default_factory=list)  # (loop, asyncio future) of polls held open
    extra: dict = field(default_factory=dict)  # what the submission answered besides the id (sample_sequence_ids)


class FutureStore:
    def __init__(self):
        self.instance = os.urandom(4).hex()
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._records: dict[str, Record] = {}
        self._finished: OrderedDict[str, float] = OrderedDict()

    def create(self, kind: str, model_id: str | None = None) -> Record:
        with self._lock:
            rec = Record(f"{self.instance}-{next(self._ids)}", kind, model_id)
            self._records[rec.id] = rec
            self._evict_locked()
        return rec

    def _evict_locked(self) -> None:
        now = time.time()
        while self._finished:
            rid, t = next(iter(self._finished.items()))
            if now - t < KEEP_S and len(self._finished) <= MAX_KEPT:
                break
            self._finished.popitem(last=False)
            self._records.pop(rid, None)

    def _settle(self, rid: str, **kw) -> None:
        with self._lock:
            rec = self._records.get(rid)
            if rec is None or rec.done:
                return
            for k, v in kw.items():
                setattr(rec, k, v)
            rec.done, rec.finished = True, time.time()
            self._finished[rid] = rec.finished
            waiters, rec.waiters = rec.waiters, []
        for loop, fut in waiters:
            loop.call_soon_threadsafe(lambda f=fut: f.done() or f.set_result(None))

    def complete(self, rid: str, payload) -> None:
        """The request's result: protobuf bytes, or a dict answered as JSON (from any thread)."""
        self._settle(rid, payload=payload)

    def fail(self, rid: str, message: str, category: str = "user") -> None:
        self._settle(rid, error=str(message)[:4000], category=category)

    def pending(self, rid: str) -> bool:
        with self._lock:
            rec = self._records.get(rid)
            return rec is not None and not rec.done

    async def retrieve(self, rid, hold: float = HOLD_S):
        """-> bytes (a protobuf result) or a dict (JSON: a result, an error, or try_again)."""
        if not isinstance(rid, str):
            return {"error": "request_id must be a string", "category": "user"}
        loop = asyncio.get_running_loop()
        with self._lock:
            rec = self._records.get(rid)
            if rec is not None and not rec.done:
                fut = loop.create_future()
                rec.waiters.append((loop, fut))
            else:
                fut = None
        if rec is None:
            return {"error": self._unknown(rid), "category": "server" if self._other_run(rid) else "user"}
        if fut is not None:
            try:
                await asyncio.wait_for(fut, hold)
            except asyncio.TimeoutError:
                return {"type": "try_again", "request_id": rid, "queue_state": "active"}
            finally:
                with self._lock:
                    rec.waiters = [w for w in rec.waiters if w[1] is not fut]
        if rec.error is not None:
            return {"error": rec.error, "category": rec.category}
        return rec.payload

    def _other_run(self, rid: str) -> bool:
        return rid.partition("-")[0] != self.instance

    def _unknown(self, rid: str) -> str:
        if self._other_run(rid):
            return (f"request {rid[:80]!r} was taken by an earlier run of this server, which has restarted since: its "
                    "result is lost (resubmit it; a training client resumes from its last save_state path with "
                    "create_training_client_from_state_with_optimizer)")
        return f"unknown request id {rid[:80]!r} (results are kept {KEEP_S:.0f} s after they finish)"
