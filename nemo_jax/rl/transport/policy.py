"""Weights out: the learner publishes each policy version as an adapter dir that any engine hot-loading LoRA can read.

    RUN/policy/<version>/   each published adapter version (`rollout.publish_format`: peft or vllm; written to a
                            temp dir and renamed), the newest `publish_keep` kept (and every `publish_keep_every`-th)
    RUN/policy/LATEST       the newest version number (a small file replaced atomically)

`PolicyPublisher` writes from a background thread (the learner never waits on the disk); a worker reads
`latest_policy` and loads that dir.
"""

from __future__ import annotations

import os
import re
import shutil
import threading
import time

from nemo_jax.fsutil import atomic_write_text as _atomic_write  # complete or not at all


def publish_policy(run_dir: str, version: int, cfg, adapters, *, format: str = "peft", keep: int = 0,
                   keep_every: int = 0, **peft_kw) -> str:
    """Publish adapters (a tree of host or device arrays, in the dtype to write) as policy `version` (a PEFT dir
    in `format`), point LATEST at it, then delete older versions beyond the newest `keep` (0: keep all) that are
    not multiples of `keep_every`. -> the version's dir."""
    from nemo_jax.lora.peft import save_peft

    path = os.path.join(run_dir, "policy", str(version))
    save_peft(cfg, adapters, path, format=format, overwrite=True, **peft_kw)  # a resumed run publishes its version again
    _atomic_write(os.path.join(run_dir, "policy", "LATEST"), f"{version}\n")
    if keep:
        prune_policies(run_dir, keep, keep_every)
    return path


class PolicyPublisher:
    """Publishes policy versions from a background thread, so the learner never waits on the disk.

    `submit(version, adapters)` takes a snapshot the caller will not touch again (device arrays are fine: the
    thread copies them to the host) and returns at once; the thread writes it with `publish_policy`. When the
    disk is slower than the learner, a newer snapshot replaces the one still waiting (counted in `skipped`):
    workers want the newest policy, and at most two snapshots are alive. A failed write is raised by the next
    `submit` or by `flush` (which waits until everything submitted is written)."""

    def __init__(self, run_dir: str, cfg, *, format: str = "vllm", keep: int = 0, keep_every: int = 0, **peft_kw):
        self.run_dir, self.cfg, self.format = run_dir, cfg, format
        self.keep, self.keep_every, self.peft_kw = keep, keep_every, peft_kw
        self.skipped = 0
        self.written: list[int] = []
        self.write_s = 0.0  # seconds the thread spent copying to the host and writing, in all
        self._pending = None
        self._busy = False
        self._error: BaseException | None = None
        self._closed = False
        self._cv = threading.Condition()
        clean_policy_temps(run_dir)
        self._thread = threading.Thread(target=self._run, name="policy-publisher", daemon=True)
        self._thread.start()

    def _raise(self):
        if self._error is not None:
            e, self._error = self._error, None
            raise RuntimeError(f"publishing a policy version under {self.run_dir}/policy failed: "
                               f"{type(e).__name__}: {e}") from e

    def submit(self, version: int, adapters) -> None:
        with self._cv:
            self._raise()
            if self._pending is not None:
                self.skipped += 1
            self._pending = (version, adapters)
            self._cv.notify_all()

    def flush(self) -> None:
        with self._cv:
            while (self._pending is not None or self._busy) and self._error is None:
                self._cv.wait(0.1)
            self._raise()

    def close(self) -> None:
        try:
            self.flush()
        finally:
            with self._cv:
                self._closed = True
                self._cv.notify_all()
            self._thread.join()

    def _run(self):
        import jax

        if hasattr(os, "setpriority") and hasattr(threading, "get_native_id"):
            # this thread only (Linux threads have their own nice value): the learner's threads go first on a
            # host with few cores
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
        while True:
            with self._cv:
                while self._pending is None and not self._closed:
                    self._cv.wait()
                if self._pending is None:
                    return
                (version, adapters), self._pending = self._pending, None
                self._busy = True
            t0 = time.perf_counter()
            try:
                publish_policy(self.run_dir, version, self.cfg, jax.device_get(adapters), format=self.format,
                               keep=self.keep, keep_every=self.keep_every, **self.peft_kw)
                self.written.append(version)
            except BaseException as e:  # surfaced to the learner by the next submit / flush
                self._error = e
            finally:
                del adapters
                self.write_s += time.perf_counter() - t0
                with self._cv:
                    self._busy = False
                    self._cv.notify_all()


def published_versions(run_dir: str) -> list[int]:
    d = os.path.join(run_dir, "policy")
    try:
        return sorted(int(n) for n in os.listdir(d) if n.isdigit() and os.path.isdir(os.path.join(d, n)))
    except FileNotFoundError:
        return []


def prune_policies(run_dir: str, keep: int, keep_every: int = 0) -> list[int]:
    """Delete published versions other than the newest `keep`, multiples of `keep_every` and LATEST -> deleted.
    (A worker that finds its version gone reads LATEST again: keep >= 2 leaves it a version's time to load.)"""
    versions = published_versions(run_dir)
    latest = latest_policy(run_dir)
    kept = set(versions[-keep:]) | {v for v in versions if keep_every and v % keep_every == 0}
    if latest is not None:
        kept.add(latest[0])
    gone = [v for v in versions if v not in kept]
    for v in gone:
        shutil.rmtree(os.path.join(run_dir, "policy", str(v)), ignore_errors=True)
    return gone


def clean_policy_temps(run_dir: str) -> None:
    """Remove the half-written version dirs a killed publisher left (`<version>.tmp-*`, `<version>.old-*`)."""
    d = os.path.join(run_dir, "policy")
    if os.path.isdir(d):
        for n in os.listdir(d):
            if re.fullmatch(r"\d+\.(tmp|old)-.+", n):
                shutil.rmtree(os.path.join(d, n), ignore_errors=True)


def latest_policy(run_dir: str) -> tuple[int, str] | None:
    """(version, PEFT dir) of the newest published policy, or None before the first."""
    try:
        with open(os.path.join(run_dir, "policy", "LATEST")) as f:
            v = int(f.read().strip())
    except (FileNotFoundError, ValueError):
        return None
    return v, os.path.join(run_dir, "policy", str(v))
