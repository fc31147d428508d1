"""Rollouts in: finished rollouts written by external producers as files the learner reads into its pool.

    RUN/spool/*.jsonl       rollouts, one JSON object per line (`Rollout.to_json` keys; see nemo_jax.rl.rollout),
                            written to a dot-prefixed temp name and renamed, so a reader never sees half a file; a
                            line {"group_id", "task_id", "failed": reason} reports a failed episode
    RUN/spool/consumed/     files the learner has read, every record accepted (kept for inspection; delete freely)
    RUN/spool/rejected/     files with a rejected record or unreadable as a whole, each with a `<name>.reason`
                            file naming the reason (per line where the file was read)

Every record passes `rollout.validate` and then the pool (its group must be one the learner opened and requested,
a rollout may not come twice): a rejected record is counted by reason and never trained on. The reader never
parses a file inside spool/: it first moves it out (a file that crashes a parser is never read twice), and it never
opens what is not a regular file (a FIFO would block).
"""

from __future__ import annotations

import json
import os
import stat
import uuid
from collections import Counter

from nemo_jax.fsutil import atomic_write_text as _atomic_write  # complete or not at all
from nemo_jax.rl.pool import RolloutPool
from nemo_jax.rl.rollout import MIN_LOGPROB, Rollout, validate
from nemo_jax.rl.transport.board import Lease


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


def report_failure(lease: Lease, reason: str, name: str | None = None) -> str:
    """Report a failed episode of the lease's group (the learner counts it; too many cancel the group)."""
    rec = {"group_id": lease.group_id, "task_id": lease.request["task_id"], "failed": str(reason)[:500],
           "worker": lease.worker}
    spool = os.path.join(lease.run_dir, "spool")
    path = os.path.join(spool, (name or f"{lease.worker}-failed-{uuid.uuid4().hex[:12]}") + ".jsonl")
    _atomic_write(path, json.dumps(rec) + "\n")
    return path


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
