"""`DaemonPool`: a thread pool whose threads never keep the process alive, and which can grow by a thread.

`concurrent.futures.ThreadPoolExecutor` (and asyncio's default executor, `asyncio.to_thread`) joins its threads
when the interpreter exits and when `asyncio.run` ends: one call that never returns (a read of a FIFO, a plug-in
environment's `start()` that hangs) then keeps a finished process alive until it is killed. A `DaemonPool` runs
the same kind of calls on daemon threads, and `add_thread` lets its owner replace a thread that a call it gave up
on still holds (nemo_jax.rl.transport.producer.EnvCalls, nemo_jax.serve.app)."""

from __future__ import annotations

import queue
import threading
from concurrent.futures import Executor, Future


class DaemonPool(Executor):
    """Up to `threads` daemon threads (started as calls come), plus those `add_thread` added."""

    def __init__(self, threads: int, name: str = "pool"):
        self.limit, self.name = max(1, threads), name
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        self._threads = self._idle = self._queued = 0  # threads, those waiting for a call, calls not yet taken
        self._closed = False
        self._lock = threading.Lock()

    def _work(self):
        while True:
            with self._lock:
                self._idle += 1
            item = self._calls.get()
            with self._lock:
                self._idle -= 1
                self._queued -= item is not None
            if item is None:
                return
            fut, fn, args, kwargs = item
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn(*args, **kwargs))
            except BaseException as e:  # the caller reads it from the future
                fut.set_exception(e)

    def _spawn(self):  # (under the lock)
        self._threads += 1
        threading.Thread(target=self._work, name=f"{self.name}-{self._threads}", daemon=True).start()

    def submit(self, fn, /, *args, **kwargs) -> Future:
        fut = Future()
        with self._lock:
            if self._closed:
                fut.cancel()  # (after shutdown: never runs)
                return fut
            self._calls.put((fut, fn, args, kwargs))
            self._queued += 1
            # a thread for each call no idle thread will take (an idle count alone missed calls queued behind
            # another one an idle thread had not yet taken: fewer threads ran than the pool allows)
            if self._queued > self._idle and self._threads < self.limit:
                self._spawn()
        return fut

    def add_thread(self) -> None:
        """One more thread, for good (in place of one a hung call holds)."""
        with self._lock:
            self.limit += 1
            self._spawn()

    @property
    def busy(self) -> int:
        """Threads running a call now."""
        with self._lock:
            return self._threads - self._idle

    def shutdown(self, wait: bool = False, *, cancel_futures: bool = True) -> None:
        """Calls not started are cancelled; running ones finish on their own (never waited for: `wait` is
        accepted for the Executor interface and ignored)."""
        with self._lock:
            self._closed = True
            n = self._threads
        while True:
            try:
                item = self._calls.get_nowait()
            except queue.Empty:
                break
            if item is not None:
                item[0].cancel()
        for _ in range(n):
            self._calls.put(None)
