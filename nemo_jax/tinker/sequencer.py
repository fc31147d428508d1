"""The order the Tinker service runs requests in, and the worker thread that runs them.

* Each training model's requests run in `seq_id` order (the SDK numbers them; a forward_backward's chunks arrive
  out of order, its first chunk last). A request waits until the one before it has arrived; a missing one is
  waited for GAP_S, then skipped (named in a line).
* Consecutive forward_backward chunks of one model with the same loss run as one batch (chunk merging), each
  answering its own future.
* Forward_backward requests of other models with the same merge key (loss, its config, forward only, and the
  LoRA shape the service adds) that are next in their own model's order join them, up to `batch_models` models:
  the handler runs them as one batched call (`Learner.run_many`). A model's requests still run in its order: one
  whose next queued request cannot join stays out with everything after it.
* One worker thread runs every model's requests (one device), in arrival order; each kind of request has its
  handler in the table the service gives (`handlers`: Kind -> handler(items) -> the result of the first item's
  future, or None when the handler answered the futures itself).
"""

from __future__ import annotations

import enum
import threading
import time
import traceback
from collections import deque
from dataclasses import dataclass, field

from nemo_jax.tinker.wire import UserError

GAP_S = 300.0  # a model's missing request: the ones after it wait this long, then run (the gap is named)
SWEEP_S = 10.0  # gaps and idle sessions are looked for this often, busy or not


class Kind(enum.Enum):
    """What a request does (the handler it runs); the value names it in /api/v1/stats."""
    CREATE = "create"  # create_model
    LOAD_CREATE = "load_create"  # load_weights into a new model
    FORWARD_BACKWARD = "fwdbwd"
    OPTIM = "optim"
    SAVE_STATE = "save_state"  # save_weights
    SAVE_SAMPLER = "save_sampler"  # save_weights_for_sampler
    LOAD_STATE = "load_state"  # load_weights into an existing model (the SDK's deprecated load_state)
    PROMPT_LOGPROBS = "prompt_lp"  # a sample request's prompt logprobs
    REFUSED = "noop"  # a refused request: its place in its model's order


@dataclass(eq=False)
class Item:
    kind: Kind
    request_id: str | None  # its future (None: the handler answers elsewhere)
    model: object = None  # registry.Model, or None (a request of no model)
    seq: int = 0
    args: dict = field(default_factory=dict)
    merge: tuple | None = None  # forward_backward chunks with equal keys run as one batch


class Sequencer:
    """`futures`: the service's FutureStore; `handlers`: {Kind: handler}; `registry`: its `touched` and `expire`
    are called (a request came; sessions quiet too long end); `batch_models`: how many models' forward_backward
    requests may run together (1: each model's alone)."""

    def __init__(self, futures, handlers: dict, registry, batch_models: int = 1):
        missing = set(Kind) - set(handlers)
        if missing:
            raise ValueError(f"tinker sequencer: no handler for {sorted(k.name for k in missing)}")
        self.futures, self.handlers, self.registry = futures, dict(handlers), registry
        self.batch_models = max(1, int(batch_models))
        self.busy: dict[Kind, list] = {}  # kind -> [requests, seconds the worker spent on them]
        self.batched = [0, 0]  # groups of several models' requests that ran, and those models
        self._cv = threading.Condition()
        self._work: deque[Item] = deque()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="tinker-learner", daemon=True)
        self._thread.start()

    def enqueue(self, item: Item) -> None:
        """A request of no model's order (a create, a sample's prompt logprobs): run after what is queued."""
        with self._cv:
            self._work.append(item)
            self._cv.notify_all()

    def submit(self, m, seq, kind: Kind, args: dict, merge: tuple | None = None, error: str | None = None) -> dict:
        """Queue a request of model `m` as its `seq`-th -> {request_id, model_id}. A seq_id submitted again (a
        retry) gets the same future. `error`: the request is refused (its future fails now) but holds its place."""
        if not isinstance(seq, int) or isinstance(seq, bool) or seq < 0:
            raise UserError("seq_id must be a non-negative integer")
        self.registry.touched(m)
        with self._cv:
            if seq in m.seen:
                return {"request_id": m.seen[seq], "model_id": m.id}
            rec = self.futures.create(kind.value, m.id)
            m.seen[seq] = rec.id
            if seq < m.next_seq:
                self.futures.fail(rec.id, f"request seq_id {seq} of model {m.id} arrived after the requests behind it "
                                  f"ran (the server waited {GAP_S:.0f} s for it)")
            else:
                if error is not None:
                    self.futures.fail(rec.id, error, "user")
                    kind, args, merge = Kind.REFUSED, {}, None
                m.pending[seq] = Item(kind, rec.id, m, seq, args, merge)
                self._release_locked(m)
        return {"request_id": rec.id, "model_id": m.id}

    def _release_locked(self, m) -> None:
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
        with self.registry.lock:
            models = list(self.registry.models.values())
        for m in models:
            if m.pending and m.blocked_since is not None and now - m.blocked_since > GAP_S:
                first = min(m.pending)
                print(f"nemo-jax serve (tinker): model {m.id}: request seq_id {m.next_seq} never arrived in "
                      f"{GAP_S:.0f} s; running seq_id {first} on", flush=True)
                m.next_seq, m.blocked_since = first, None
                self._release_locked(m)

    # ------------------------------------------------------------------ the worker
    def _next_group(self) -> list[Item]:
        """The next request, with the forward_backward chunks that merge with it and those of other models that
        join it (module docstring), in queue order (under the lock)."""
        head = self._work.popleft()
        if head.merge is None:
            return [head]
        group, last, closed, rest = [head], {head.model: head}, set(), deque()
        while self._work:
            it = self._work.popleft()
            prev = last.get(it.model)
            joins = it.model not in closed and it.merge == head.merge and (
                it.seq == prev.seq + 1 if prev is not None else len(last) < self.batch_models)
            if joins:
                group.append(it)
                last[it.model] = it
            else:
                rest.append(it)
                if it.model is not None:  # (nothing after it of its model may run before it)
                    closed.add(it.model)
        self._work.extendleft(reversed(rest))
        return group

    def _run(self) -> None:
        last_sweep = time.time()
        while True:
            with self._cv:
                while True:
                    if time.time() - last_sweep > SWEEP_S:
                        self._gaps_locked()
                        self.registry.expire()
                        last_sweep = time.time()
                    if self._work or self._closed:
                        break
                    self._cv.wait(timeout=SWEEP_S)
                if self._closed:
                    return
                group = self._next_group()
            self._execute(group)

    def _execute(self, group: list[Item]) -> None:
        kind, t0 = group[0].kind, time.perf_counter()
        try:
            out = self.handlers[kind](group)
            if group[0].request_id is not None and out is not None:
                self.futures.complete(group[0].request_id, out)
        except (UserError, ValueError) as e:  # the request's own fault (ValueError: a shape or value it gave)
            for it in group:
                if it.request_id is not None:
                    self.futures.fail(it.request_id, str(e), "user")
        except Exception as e:  # this server's fault: logged, that request fails, the server and others go on
            traceback.print_exc()
            for it in group:
                if it.request_id is not None:
                    self.futures.fail(it.request_id, f"{type(e).__name__}: {e}"[:2000], "server")
        finally:
            with self._cv:
                b = self.busy.setdefault(kind, [0, 0.0])
                b[0] += len(group)
                b[1] += time.perf_counter() - t0
                models = len({id(it.model) for it in group})
                if models > 1:
                    self.batched[0] += 1
                    self.batched[1] += models

    def stats(self) -> dict:
        with self._cv:
            return {"queued": len(self._work),
                    "worker": {k.value: {"requests": n, "seconds": round(t, 6)} for k, (n, t) in self.busy.items()},
                    "batched": {"calls": self.batched[0], "models": self.batched[1]}}

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        self._thread.join(timeout=30)
