"""The persistent rollout pool: groups in flight, finished groups in a ready queue, stale groups dropped.

Producers (in-process samplers, or other engines through nemo_jax.rl.spool) are handed group ids with
`open_group`; each rollout they finish is `add`ed; a group whose G rollouts are all in moves to the ready queue.
The learner `take`s ready groups as they come, so it never waits for the slowest rollout of a batch; a group
whose oldest token was sampled more than `max_off_policy_steps` policy versions ago is dropped and counted, as is
an in-flight group with more than `max_failed` failed episodes. External groups dropped that way are kept in
`dropped` (id, reason) until the caller `drain_dropped`s them (to cancel their requests). Groups requested of
external producers (`external=True`) stay in flight across a restart (`state_dict`); in-process ones are lost with
their sampler.
"""

from __future__ import annotations

from collections import Counter, OrderedDict

from nemo_jax.rl.rollout import Rollout


class RolloutPool:
    def __init__(self, group_size: int, max_off_policy_steps: int, max_failed: int | None = None):
        if group_size < 2:
            raise ValueError(f"rollout pool: group_size >= 2 (advantages compare a group's rollouts), got {group_size}")
        self.group_size, self.max_off_policy_steps = group_size, max_off_policy_steps
        self.max_failed = group_size if max_failed is None else max_failed
        self.in_flight: OrderedDict[str, dict] = OrderedDict()  # group id -> {task_id, rollouts, external, failed}
        self.dropped: list[tuple[str, str]] = []  # in-flight groups dropped (stale, failed) not yet drained
        self.ready: OrderedDict[str, list[Rollout]] = OrderedDict()
        self.counts = Counter()  # groups opened / finished / trained / stale_dropped, rollouts added / rejected
        self.staleness = Counter()  # versions behind at training time -> rollouts
        self._next = 0
        self._opened: dict[str, int] = {}  # group id -> when it was opened (in open_group calls)

    def open_group(self, task_id: str, group_id: str | None = None, *, external: bool = False) -> str:
        gid = group_id or f"g{self._next}"
        self._opened[gid] = self._next  # (take: the oldest opened first)
        self._next += 1
        if gid in self.in_flight or gid in self.ready:
            raise ValueError(f"rollout pool: group {gid!r} already open")
        self.in_flight[gid] = {"task_id": str(task_id), "rollouts": [], "external": external, "failed": 0}
        self.counts["groups_opened"] += 1
        return gid

    def knows(self, group_id: str) -> bool:
        return group_id in self.in_flight

    def add(self, r: Rollout, unique: bool = False) -> str | None:
        """A finished rollout of an open group -> its group id when that group is now complete, else None;
        "unknown_group" for a rollout nobody asked for, "duplicate" (with `unique`) for one the group already
        holds (`Rollout.dedupe_key`): counted, not kept."""
        g = self.in_flight.get(r.group_id)
        if g is None or g["task_id"] != r.task_id:
            self.counts["rejected_unknown_group"] += 1
            return "unknown_group"
        if unique and r.dedupe_key() in {x.dedupe_key() for x in g["rollouts"]}:
            self.counts["rejected_duplicate"] += 1
            return "duplicate"
        g["rollouts"].append(r)
        self.counts["rollouts_added"] += 1
        if len(g["rollouts"]) < self.group_size:
            return None
        del self.in_flight[r.group_id]
        # the in-process sampler's rollouts (ids GROUP/J) in J order, not in arrival order (which environment threads
        # decide): a batch is then the same each run; others as they arrived
        self.ready[r.group_id] = sorted(g["rollouts"], key=lambda x: _index(x.rollout_id, r.group_id))
        self.counts["groups_finished"] += 1
        return r.group_id

    def fail(self, group_id: str) -> str:
        """An episode of an in-flight group failed (or its lease expired) -> "counted", "cancelled" (more than
        `max_failed` now: the group is dropped, see `dropped`) or "unknown_group"."""
        g = self.in_flight.get(group_id)
        if g is None:
            return "unknown_group"
        g["failed"] += 1
        self.counts["episodes_failed"] += 1
        if g["failed"] <= self.max_failed:
            return "counted"
        del self.in_flight[group_id]
        if g["external"]:
            self.dropped.append((group_id, "failed"))
        self.counts["groups_failed_dropped"] += 1
        return "cancelled"

    def drop_stale(self, version: int) -> int:
        """Drop ready and in-flight groups older than max_off_policy_steps at policy `version`; -> dropped."""
        stale = lambda rs: rs and version - min(r.version for r in rs) > self.max_off_policy_steps  # noqa: E731
        gone = [g for g, rs in self.ready.items() if stale(rs)]
        gone_in_flight = [g for g, v in self.in_flight.items() if stale(v["rollouts"])]
        for g in gone:
            del self.ready[g]
        for g in gone_in_flight:
            if self.in_flight.pop(g)["external"]:
                self.dropped.append((g, "stale"))
        self.counts["groups_stale_dropped"] += len(gone) + len(gone_in_flight)
        return len(gone) + len(gone_in_flight)

    def drain_dropped(self) -> list[tuple[str, str]]:
        """The in-flight groups dropped since the last call: (group id, "stale" | "failed")."""
        out, self.dropped = self.dropped, []
        return out

    def missing(self, group_id: str) -> int:
        """Rollouts an in-flight group still needs."""
        return self.group_size - len(self.in_flight[group_id]["rollouts"])

    def take(self, n_groups: int, version: int) -> list[list[Rollout]]:
        """Up to n_groups ready groups (oldest first, stale ones dropped first), staleness recorded."""
        self.drop_stale(version)
        out = []
        order = sorted(self.ready, key=lambda g: self._opened.get(g, float("inf")))  # opened first (then finished)
        for gid in order[:n_groups]:
            rs = self.ready.pop(gid)
            self._opened.pop(gid, None)
            for r in rs:
                self.staleness[version - r.version] += 1
            out.append(rs)
        self.counts["groups_trained"] += len(out)
        return out

    def state_dict(self) -> dict:
        """What a resumed run needs: the bookkeeping, groups already finished, and the groups in flight at external
        producers with the rollouts they have delivered so far (in-process groups die with their sampler)."""
        return {"counts": dict(self.counts), "staleness": {str(k): v for k, v in self.staleness.items()},
                "ready": {g: [r.to_json() for r in rs] for g, rs in self.ready.items()}, "next": self._next,
                "in_flight": {g: {"task_id": v["task_id"], "failed": v["failed"],
                                  "rollouts": [r.to_json() for r in v["rollouts"]]}
                              for g, v in self.in_flight.items() if v["external"]}}

    def load_state_dict(self, state: dict) -> None:
        self.counts = Counter(state["counts"])
        self.staleness = Counter({int(k): v for k, v in state["staleness"].items()})
        self.ready = OrderedDict((g, [Rollout(**r) for r in rs]) for g, rs in state["ready"].items())
        self.in_flight = OrderedDict(
            (g, {"task_id": v["task_id"], "rollouts": [Rollout(**r) for r in v["rollouts"]], "external": True,
                 "failed": v["failed"]}) for g, v in state.get("in_flight", {}).items())
        self.dropped = []
        self._next = state["next"]


def _index(rollout_id, group_id: str) -> int:
    """J of an in-process rollout id GROUP/J, else -1 (a stable sort keeps those in arrival order)."""
    head, _, j = (rollout_id or "").rpartition("/")
    return int(j) if head == group_id and j.isdigit() else -1
