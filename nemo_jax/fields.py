"""Checked reads of a request's JSON fields, for every service that takes JSON from a client (the OpenAI routes of
`nemo-jax serve`, the Tinker API, the sampling settings of a rollout request): a wrong value is refused with one
line naming the field and what it must be, in the error type the service answers with.

    f = Fields(body, lambda message, field: APIError(message, param=field))
    n = f.integer("n", 1, 1, 64)
    temperature = f.number("temperature", 1.0, 0, 100)

`prefix` names where the body sits in the request (`Fields(body["sampling_params"], err, "sampling_params.")`).
A field that is absent or null takes its default."""

from __future__ import annotations

import json
import math


class Fields:
    def __init__(self, body: dict, error, prefix: str = ""):
        """error(message, field) -> the exception to raise (the field's full name: prefix + key)."""
        if not isinstance(body, dict):
            raise error(f"{prefix.rstrip('.') or 'the body'} must be an object", prefix.rstrip("."))
        self.body, self.error, self.prefix = body, error, prefix

    def get(self, key: str, default=None):
        v = self.body.get(key)
        return default if v is None else v

    def has(self, key: str) -> bool:
        return self.body.get(key) is not None

    def fail(self, key: str, must: str, value=None):
        """Raise the service's error: 'PREFIX.KEY' must MUST, got VALUE."""
        got = "" if value is None else f", got {json.dumps(value, default=str)[:80]}"
        raise self.error(f"'{self.prefix}{key}' must be {must}{got}", self.prefix + key)

    def number(self, key: str, default, lo: float, hi: float, *, integer: bool = False, lo_open: bool = False):
        """A JSON number (an integer where `integer`, never a boolean), finite, in [lo, hi] ((lo, hi] with
        `lo_open`)."""
        v = self.body.get(key)
        if v is None:
            return default
        kinds = int if integer else (int, float)
        if isinstance(v, bool) or not isinstance(v, kinds) or not math.isfinite(v) or not (
                lo < v <= hi if lo_open else lo <= v <= hi):
            self.fail(key, f"{'an integer' if integer else 'a number'} in {'(' if lo_open else '['}{lo}, {hi}]", v)
        return v

    def integer(self, key: str, default, lo: int, hi: int):
        return self.number(key, default, lo, hi, integer=True)

    def boolean(self, key: str, default: bool | None = None):
        v = self.body.get(key)
        if v is None:
            return default
        if not isinstance(v, bool):
            self.fail(key, "true or false", v)
        return v

    def string(self, key: str, default: str | None = None, *, max_len: int = 1 << 20):
        v = self.body.get(key)
        if v is None:
            return default
        if not isinstance(v, str) or not v or len(v) > max_len:
            self.fail(key, f"a non-empty string of at most {max_len} characters", v)
        return v

    def one_of(self, key: str, default, choices):
        v = self.body.get(key)
        if v is None:
            return default
        if v not in choices:
            self.fail(key, "one of " + ", ".join(json.dumps(c) for c in choices), v)
        return v

    def token_ids(self, key: str, vocab: int, *, most: int = 64) -> list[int]:
        """A list of at most `most` token ids in [0, vocab) (absent: [])."""
        v = self.get(key, [])
        if not isinstance(v, list) or len(v) > most or not all(
                isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in v):
            self.fail(key, f"a list of at most {most} token ids in [0, {vocab})", v)
        return v

    def strings(self, key: str, *, most: int = 64, max_bytes: int = 256) -> list[str]:
        """A string or a list of at most `most` strings of 1 to `max_bytes` UTF-8 bytes (absent: [])."""
        v = self.get(key, [])
        v = [v] if isinstance(v, str) else v
        if not isinstance(v, list) or len(v) > most or not all(
                isinstance(s, str) and 0 < len(s.encode()) <= max_bytes for s in v):
            self.fail(key, f"a string or a list of at most {most} strings of 1 to {max_bytes} bytes")
        return v

    def mapping(self, key: str, *, most: int = 1024) -> dict:
        v = self.get(key, {})
        if not isinstance(v, dict) or len(v) > most:
            self.fail(key, f"an object of at most {most} entries")
        return v
