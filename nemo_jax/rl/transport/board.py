"""The work queue: the groups the learner wants sampled, claimed by external workers under leases.

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

A worker's life: `claim_request` -> Lease; sample `lease.request["rollouts"]` rollouts while `renew(lease)` is
True; `nemo_jax.rl.transport.rollouts.write_rollouts`; `complete(lease)`. The learner's side is `RequestBoard`.
"""

from __future__ import annotations

import json
import os
import re
import time
import uuid
from collections import Counter
from dataclasses import dataclass

from nemo_jax.fsutil import atomic_write_text as _atomic_write  # complete or not at all
from nemo_jax.rl.pool import RolloutPool


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
