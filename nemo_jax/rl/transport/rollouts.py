"""The filesystem transport between the learner and external rollout producers (any engine that hot-loads LoRA).

    RUN/policy/<version>/   each published adapter version (`rollout.publish_format`: peft or vllm; written to a
                            temp dir and renamed), the newest `publish_keep` kept (and every `publish_keep_every`-th)
    RUN/policy/LATEST       the newest version number (a small file replaced atomically)
    RUN/requests/<gid>.json the groups the learner wants sampled: {group_id, task_id, messages, group_size,
                            rollouts (how many it still needs), policy_version, sampling {temperature, top_p,
                            top_k, max_tokens, stop}, lease_s}
    RUN/requests/claimed/<worker>--<gid>.json
                            a claim: the request renamed there by the one worker whose rename won. It is a lease:
                            the worker renews it (`renew`: touches the file) at least every lease_s / 3; a claim
                            whose modification time stays unchanged for lease_s (measured on the learner's clock)
                            has expired: the learner removes it and posts the request again
    RUN/requests/cancelled/<gid>
                            groups the learner gave up (stale beyond max_off_policy_steps, too many failed
                            episodes, or unknown to a restarted learner): their workers stop (`renew` says so)
    RUN/requests/CLOSED     the learner finished the run (`RequestBoard.close`): workers stop and exit (`closed`);
                            a learner that starts (or resumes) the run removes it
    RUN/spool/*.jsonl       rollouts, one JSON object per line (`Rollout.to_json` keys; see nemo_jax.rl.rollout),
                            written to a dot-prefixed temp name and renamed, so a reader never sees half a file; a
                            line {"group_id", "task_id", "failed": reason} reports a failed episode
    RUN/spool/consumed/     files the learner has read, every record accepted (kept for inspection; delete freely)
    RUN/spool/rejected/     files with a rejected record or unreadable as a whole, each with a `<name>.reason`
                            file naming the reason (per line where the file was read)

A worker's life: `claim_request` -> Lease; sample `lease.request["rollouts"]` rollouts while `renew(lease)` is
True; `write_rollouts`; `complete(lease)`. Every record passes `rollout.validate` and then the pool (its group
must be one the learner opened and requested, a rollout may not come twice): a rejected record is counted by
reason and never trained on. The reader never parses a file inside spool/: it first moves it out (a file that
crashes a parser is never read twice), and it never opens what is not a regular file (a FIFO would block).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
import threading
import time
import uuid
from collections import Counter
from dataclasses import dataclass

from nemo_jax.fsutil import atomic_write_text as _atomic_write  # complete or not at all
from nemo_jax.rl.pool import RolloutPool
from nemo_jax.rl.rollout import MIN_LOGPROB, Rollout, validate


def write_rollouts(spool_dir: str, rollouts: list[Rollout], name: str) -> str:
    """Write rollouts as `spool_dir/<name>.jsonl`, complete or not at all. A rollout without a `rollout_id` gets
    a fresh one (so two identical samples of a group are two rollouts, while a file copied twice is a duplicate)."""
    path = os.path.join(spool_dir, name + ".jsonl")
    lines = []
    for r in rollouts:
        d = r.to_json()
        if not d.get("rollout_id"):
            d["rollout_id"] = uuid.uuid4().hex
        lines.append(json.dumps(d) + "\n")
    _atomic_write(path, "".join(lines))
    return path


# ----------------------------------------------------------------------------- published policies
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


# ----------------------------------------------------------------------------- requests and leases: the worker side
_WORKER = re.compile(r"[A-Za-z0-9_.@+-]+")


@dataclass
class Lease:
    """A claimed request: `request` (the posted JSON), held as the claim file `path` that `renew` touches."""
    run_dir: str
    worker: str
    request: dict
    path: str

    @property
    def group_id(self) -> str:
        return self.request["group_id"]


def _requests(run_dir: str, *parts: str) -> str:
    return os.path.join(run_dir, "requests", *parts)


def post_request(run_dir: str, group_id: str, task, group_size: int, version: int, *, sampling: dict | None = None,
                 rollouts: int | None = None, lease_s: float = 120.0) -> str:
    """Ask external producers for `rollouts` (default group_size) rollouts of one group of `task` (an rl.envs.Task)."""
    req = {"group_id": group_id, "task_id": task.id, "messages": list(task.messages), "group_size": group_size,
           "rollouts": group_size if rollouts is None else rollouts, "policy_version": version,
           "sampling": dict(sampling or {}), "lease_s": lease_s}
    path = _requests(run_dir, f"{group_id}.json")
    _atomic_write(path, json.dumps(req))
    return path


def claim_request(run_dir: str, worker: str) -> Lease | None:
    """Take the oldest open request that is not cancelled (atomically: one worker wins each) -> its Lease, or None
    when there is none."""
    if not _WORKER.fullmatch(worker):
        raise ValueError(f"worker name {worker!r}: use letters, digits and _.@+- only")
    d = _requests(run_dir)
    try:
        names = sorted((n for n in os.listdir(d) if n.endswith(".json") and not n.startswith(".")),
                       key=lambda n: _mtime(os.path.join(d, n)))
    except FileNotFoundError:
        return None
    os.makedirs(os.path.join(d, "claimed"), exist_ok=True)
    for n in names:
        if cancelled(run_dir, n[: -len(".json")]):
            continue
        dst = os.path.join(d, "claimed", f"{worker}--{n}")
        try:
            os.rename(os.path.join(d, n), dst)
        except FileNotFoundError:  # another worker claimed it first
            continue
        os.utime(dst)  # the lease starts now
        try:
            with open(dst) as f:
                req = json.load(f)
        except (OSError, ValueError):  # not a request the learner wrote: leave it to expire
            continue
        return Lease(run_dir, worker, req, dst)
    return None


def _mtime(path: str) -> float:
    try:
        return os.stat(path).st_mtime
    except FileNotFoundError:
        return float("inf")


def renew(lease: Lease) -> bool:
    """Heartbeat: extend the lease -> False when it is lost (expired and reposted, or the group was cancelled):
    stop working on it."""
    if cancelled(lease.run_dir, lease.group_id):
        return False
    try:
        os.utime(lease.path)
    except FileNotFoundError:
        return False
    return True


def complete(lease: Lease) -> None:
    """The group's rollouts are written (`write_rollouts`): end the lease."""
    try:
        os.unlink(lease.path)
    except FileNotFoundError:
        pass


def release(lease: Lease, rollouts: int | None = None) -> bool:
    """Give the request back unfinished (e.g. a worker shutting down) -> whether it was still held. `rollouts`:
    how many the group still needs, when the worker delivered some (the request is posted again asking for those).

    One rename moves the claim back to an open request; the new count is first written over the claim itself
    (atomically): a worker killed between the two leaves a claim, which expires and is posted again."""
    dst = _requests(lease.run_dir, f"{lease.group_id}.json")
    if rollouts is not None:
        if not os.path.exists(lease.path):
            return False
        _atomic_write(lease.path, json.dumps(dict(lease.request, rollouts=int(rollouts))))
    try:
        os.rename(lease.path, dst)
    except FileNotFoundError:
        return False
    return True


def closed(run_dir: str) -> dict | None:
    """The learner has finished the run (RUN/requests/CLOSED) -> what it wrote there ({"step", ...}), else None."""
    try:
        with open(_requests(run_dir, CLOSED)) as f:
            return json.loads(f.read() or "{}")
    except FileNotFoundError:
        return None
    except ValueError:
        return {}


CLOSED = "CLOSED"


def cancelled(run_dir: str, group_id: str) -> bool:
    """Has the learner given up this group (its workers should stop)?"""
    return os.path.exists(_requests(run_dir, "cancelled", group_id))


def report_failure(lease: Lease, reason: str, name: str | None = None) -> str:
    """Report a failed episode of the lease's group (the learner counts it; too many cancel the group)."""
    rec = {"group_id": lease.group_id, "task_id": lease.request["task_id"], "failed": str(reason)[:500],
           "worker": lease.worker}
    spool = os.path.join(lease.run_dir, "spool")
    path = os.path.join(spool, (name or f"{lease.worker}-failed-{uuid.uuid4().hex[:12]}") + ".jsonl")
    _atomic_write(path, json.dumps(rec) + "\n")
    return path


# ----------------------------------------------------------------------------- requests and leases: the learner side
class RequestBoard:
    """The learner's view of RUN/requests: posts requests, reposts expired leases, cancels groups, and after a
    restart reconciles the files with the restored pool. `lease_s` is measured on this process's monotonic
    clock from the last change of a claim's modification time (no clock is compared across machines)."""

    def __init__(self, run_dir: str, lease_s: float):
        self.run_dir, self.lease_s = run_dir, lease_s
        self.seen: dict[str, tuple[int, float]] = {}  # claim file -> (mtime_ns, when that mtime was first seen)
        self.counts = Counter()  # requests_posted, leases_expired, groups_cancelled/<reason>
        # this learner process's name in its group ids: ids of a restarted learner never repeat the crashed one's
        # (whose requests `reconcile` cancels)
        self.incarnation = uuid.uuid4().hex[:8]
        self._opened = 0
        self._orphan_since: dict[str, float] = {}  # in-flight groups seen off the board -> since when
        for sub in ("claimed", "cancelled"):
            os.makedirs(_requests(run_dir, sub), exist_ok=True)
        try:
            os.unlink(_requests(run_dir, CLOSED))  # (the run goes on)
        except FileNotFoundError:
            pass

    def group_id(self, step: int) -> str:
        """A new group's id, `s<step>-<incarnation>-<n>`: unique across the learner's restarts."""
        self._opened += 1
        return f"s{step}-{self.incarnation}-{self._opened}"

    def close(self, step: int) -> None:
        """The run is finished: RUN/requests/CLOSED tells workers to stop; open requests and claims are removed."""
        _atomic_write(_requests(self.run_dir, CLOSED), json.dumps({"step": step}) + "\n")
        open_, claimed = self._files()
        for path in [*open_.values(), *claimed.values()]:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass

    def post(self, group_id: str, task, group_size: int, version: int, sampling: dict, rollouts: int | None = None):
        post_request(self.run_dir, group_id, task, group_size, version, sampling=sampling, rollouts=rollouts,
                     lease_s=self.lease_s)
        self.counts["requests_posted"] += 1

    def _files(self) -> tuple[dict[str, str], dict[str, str]]:
        """-> ({group id: open request file}, {group id: claim file})."""
        d = _requests(self.run_dir)
        open_, claimed = {}, {}
        for n in os.listdir(d):
            if n.endswith(".json") and not n.startswith("."):
                open_[n[: -len(".json")]] = os.path.join(d, n)
        for n in os.listdir(os.path.join(d, "claimed")):
            for ext in (".json", ".releasing"):  # (.releasing: what an older release killed midway left)
                if n.endswith(ext) and "--" in n and not n.startswith("."):
                    claimed[n[: -len(ext)].rsplit("--", 1)[1]] = os.path.join(d, "claimed", n)
        return open_, claimed

    def expired(self, now: float | None = None) -> list[str]:
        """Claims whose lease ran out: removed -> their group ids (the caller reposts what the group still needs)."""
        now = time.monotonic() if now is None else now
        _, claimed = self._files()
        out = []
        for gid, path in claimed.items():
            try:
                m = os.stat(path).st_mtime_ns
            except FileNotFoundError:
                continue
            last = self.seen.get(path)
            if last is None or last[0] != m:
                self.seen[path] = (m, now)
                continue
            if now - last[1] > self.lease_s:
                try:
                    os.unlink(path)
                except FileNotFoundError:  # completed meanwhile
                    continue
                out.append(gid)
                self.counts["leases_expired"] += 1
        for path in [p for p in self.seen if p not in claimed.values()]:
            del self.seen[path]
        return out

    def cancel(self, group_id: str, reason: str) -> None:
        """Give a group up: workers see requests/cancelled/<gid> (`renew` -> False); its request and claim go.
        Markers older than max(1 hour, 10 leases) are removed (their workers have long lost their leases)."""
        d = _requests(self.run_dir, "cancelled")
        _atomic_write(os.path.join(d, group_id), json.dumps({"reason": reason}) + "\n")
        self.done(group_id)
        self.counts[f"groups_cancelled/{reason}"] += 1
        old = time.time() - max(3600.0, 10 * self.lease_s)
        for n in os.listdir(d):
            if not n.startswith(".") and _mtime(os.path.join(d, n)) < old:
                try:
                    os.unlink(os.path.join(d, n))
                except FileNotFoundError:
                    pass

    def done(self, group_id: str) -> None:
        """A group needs nothing more: remove its request and any claim left on it."""
        open_, claimed = self._files()
        for path in (open_.get(group_id), claimed.get(group_id)):
            if path is not None:
                try:
                    os.unlink(path)
                except FileNotFoundError:
                    pass

    def on_board(self) -> set[str]:
        """Ids of the groups with an open request or a claim. (Listed before the spool is read, this tells which
        groups nobody samples: a worker writes a group's last rollouts before it ends the claim.)"""
        open_, claimed = self._files()
        return set(open_) | set(claimed)

    def orphans(self, pool: RolloutPool, on_board: set[str], grace_s: float = 1.0, now: float | None = None) -> list[str]:
        """In-flight external groups with neither a request nor a claim in `on_board` (`on_board()` taken before
        the spool was last read), for longer than `grace_s` (a request being given back is a claim again or a
        request a moment later) -> their ids, to post again for the rollouts they miss. Nobody samples such a
        group: a worker completed its claim after writing what the request asked for, but the learner did not keep
        them all. After a learner restart: rollouts the crashed learner had read after its checkpoint are gone, and
        rollouts sampled meanwhile with its newer published versions are rejected (`bad_version`); without this
        the group stays in flight forever (with every in-flight slot taken by such groups the run stops)."""
        now = time.monotonic() if now is None else now
        seen, self._orphan_since = self._orphan_since, {}
        out = []
        for gid, g in pool.in_flight.items():
            if g["external"] and gid not in on_board:
                self._orphan_since[gid] = since = seen.get(gid, now)
                if now - since > grace_s:
                    out.append(gid)
        for gid in out:
            del self._orphan_since[gid]
        self.counts["groups_reposted"] += len(out)
        return out

    def reconcile(self, pool: RolloutPool) -> tuple[list[str], list[str]]:
        """After a (re)start: requests and claims of groups the pool does not hold in flight are cancelled (a
        restarted learner never opened them, or they finished); in-flight external groups with neither a request
        nor a claim are returned for reposting. -> (cancelled ids, ids to repost)."""
        open_, claimed = self._files()
        mine = {g for g, v in pool.in_flight.items() if v["external"]}
        gone = sorted((set(open_) | set(claimed)) - mine)
        for gid in gone:
            self.cancel(gid, "unknown")
        return gone, sorted(mine - set(open_) - set(claimed))


# ----------------------------------------------------------------------------- the reader
def _unique(d: str, name: str) -> str:
    """A path in `d` for `name` that does not exist yet (`name`, `name.1`, ...)."""
    path, i = os.path.join(d, name), 0
    while os.path.lexists(path):
        i += 1
        path = os.path.join(d, f"{name}.{i}")
    return path


class SpoolReader:
    """Reads finished rollout files from `spool_dir` into a RolloutPool; survives any file.

    Each `*.jsonl` entry is checked with lstat (never followed, never opened unless a regular file), moved out
    of the spool, then read (at most `max_file_bytes`), decoded (UTF-8) and parsed line by line. Whole-file
    faults (`not_a_file`, `too_large`, `bad_encoding`, `unreadable`) move it to rejected/ unread; rejected
    records (`rollout.REJECT_REASONS`, `too_deep` for nesting the parser cannot follow) are counted and their
    file goes to rejected/ too, its `.reason` file naming each line. `rejected` counts reasons (files for
    whole-file faults, records otherwise). A failed-episode report goes to `pool.fail`."""

    def __init__(self, spool_dir: str, vocab_size: int, max_len: int | None = None, *,
                 max_file_bytes: int = 256 << 20, reward_range: tuple[float, float] | None = None,
                 min_logprob: float = MIN_LOGPROB, temperature: float | None = None, vision=None,
                 image_root: str | None = None):
        self.dir, self.vocab_size, self.max_len = spool_dir, vocab_size, max_len
        self.vision, self.image_root = vision, image_root  # pictures: checked against files under image_root
        self.max_file_bytes, self.reward_range, self.min_logprob = max_file_bytes, reward_range, min_logprob
        self.temperature = temperature
        self.rejected = Counter()  # reason -> records (or files, for whole-file faults)
        self.accepted = 0
        self.stuck: set[str] = set()  # names that could not be moved out of the spool (counted once)
        for sub in ("consumed", "rejected"):
            os.makedirs(os.path.join(spool_dir, sub), exist_ok=True)

    def _reject_file(self, path: str, name: str, reason: str, detail: str = "", count: bool = True) -> None:
        """Move a file to rejected/ with a `.reason` beside it (`count`: one more `reason`)."""
        dst = _unique(os.path.join(self.dir, "rejected"), name)
        if count:
            self.rejected[reason] += 1
        try:
            os.rename(path, dst)
        except OSError as e:
            self.stuck.add(name)  # left where it is, never read again by this reader
            print(f"spool: cannot move {path} to {dst} ({e}); skipped", flush=True)
            return
        _atomic_write(dst + ".reason", f"{reason}{': ' + detail if detail else ''}\n")

    def _read(self, name: str) -> tuple[str, bytes] | None:
        """Move spool/<name> out of the spool and read it -> (its new path, bytes); None when it was rejected."""
        src = os.path.join(self.dir, name)
        try:
            st = os.lstat(src)
        except FileNotFoundError:
            return None
        if not stat.S_ISREG(st.st_mode):
            self._reject_file(src, name, "not_a_file", f"a {_kind(st.st_mode)}, not a regular file")
            return None
        if st.st_size > self.max_file_bytes:
            self._reject_file(src, name, "too_large", f"{st.st_size} bytes > {self.max_file_bytes}")
            return None
        path = _unique(os.path.join(self.dir, "consumed"), name)
        try:
            os.rename(src, path)
        except OSError as e:
            if name not in self.stuck:
                self.stuck.add(name)
                self.rejected["unreadable"] += 1
                print(f"spool: cannot move {src} out of the spool ({e}); skipped", flush=True)
            return None
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0))
        except OSError as e:
            self._reject_file(path, name, "unreadable", str(e))
            return None
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):  # swapped between lstat and rename
                self._reject_file(path, name, "not_a_file", "not a regular file when opened")
                return None
            chunks, size = [], 0
            while size <= self.max_file_bytes:
                b = os.read(fd, min(1 << 20, self.max_file_bytes + 1 - size))
                if not b:
                    break
                chunks.append(b)
                size += len(b)
        except OSError as e:
            self._reject_file(path, name, "unreadable", str(e))
            return None
        finally:
            os.close(fd)
        if size > self.max_file_bytes:  # grew after the lstat
            self._reject_file(path, name, "too_large", f"more than {self.max_file_bytes} bytes")
            return None
        return path, b"".join(chunks)

    def poll(self, pool: RolloutPool, version: int) -> list[str]:
        """Read every complete file now in the spool (policy `version` is the newest a rollout may name) -> ids
        of the groups that finished."""
        try:
            names = sorted(n for n in os.listdir(self.dir) if n.endswith(".jsonl") and not n.startswith(".")
                           and n not in self.stuck)
        except FileNotFoundError:
            os.makedirs(os.path.join(self.dir, "consumed"), exist_ok=True)
            os.makedirs(os.path.join(self.dir, "rejected"), exist_ok=True)
            return []
        finished = []
        for name in names:
            got = self._read(name)
            if got is None:
                continue
            path, raw = got
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                self._reject_file(path, name, "bad_encoding", f"not UTF-8 at byte {e.start}")
                continue
            bad = []
            for lineno, line in enumerate(text.splitlines(), 1):
                if not line.strip():
                    continue
                reason, gid = self._record(line, pool, version)
                if reason is not None:
                    self.rejected[reason] += 1
                    bad.append(f"line {lineno}: {reason}")
                elif gid is not None:
                    finished.append(gid)
            if bad:  # (the records were counted one by one)
                self._reject_file(path, name, "rejected records", "\n".join(bad), count=False)
        return finished

    def _record(self, line: str, pool: RolloutPool, version: int) -> tuple[str | None, str | None]:
        """One JSON line -> (rejection reason or None, id of a group it completed or None)."""
        try:
            d = json.loads(line)
        except RecursionError:
            return "too_deep", None
        except ValueError:
            return "malformed", None
        if isinstance(d, dict) and "failed" in d:  # a failed-episode report
            if not (isinstance(d.get("group_id"), str) and isinstance(d.get("failed"), str)):
                return "malformed", None
            if pool.fail(d["group_id"]) == "unknown_group":
                return "unknown_group", None
            return None, None
        r = validate(d, self.vocab_size, self.max_len, version=version, reward_range=self.reward_range,
                     min_logprob=self.min_logprob, temperature=self.temperature, vision=self.vision,
                     image_root=self.image_root)
        if isinstance(r, str):
            return r, None
        done = pool.add(r, unique=True)
        if done in ("unknown_group", "duplicate"):
            return done, None
        self.accepted += 1
        return None, done


def _kind(mode: int) -> str:
    for test, what in ((stat.S_ISDIR, "directory"), (stat.S_ISFIFO, "FIFO"), (stat.S_ISLNK, "symbolic link"),
                       (stat.S_ISSOCK, "socket"), (stat.S_ISCHR, "character device"), (stat.S_ISBLK, "block device")):
        if test(mode):
            return what
    return "special file"
