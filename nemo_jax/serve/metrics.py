"""`GET /metrics`: counters, gauges and histograms in the Prometheus text format (version 0.0.4), label values
escaped as the format says. Every label value comes from a fixed set (the server's routes, status codes, reasons),
so the exposition stays the same size whatever clients send."""

from __future__ import annotations

import bisect
import threading
import time
from collections import Counter, deque

# seconds: from a few decode steps to a long queue
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)


def escape(value) -> str:
    """A label value as the text format writes it: backslash, double quote and newline escaped."""
    return str(value).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _labels(labels: dict) -> str:
    return "{" + ",".join(f'{k}="{escape(v)}"' for k, v in labels.items()) + "}" if labels else ""


class Histogram:
    """Cumulative buckets, sum and count of observed values (thread-safe)."""

    def __init__(self, buckets=LATENCY_BUCKETS):
        self.buckets = tuple(buckets)
        self.counts = [0] * (len(self.buckets) + 1)
        self.sum = 0.0
        self._lock = threading.Lock()

    def observe(self, x: float) -> None:
        with self._lock:
            self.counts[bisect.bisect_left(self.buckets, x)] += 1
            self.sum += x

    def lines(self, name: str) -> list[str]:
        with self._lock:
            counts, total = list(self.counts), self.sum
        out, acc = [], 0
        for le, n in zip([*map(str, self.buckets), "+Inf"], counts):
            acc += n
            out.append(f'{name}_bucket{{le="{le}"}} {acc}')
        return out + [f"{name}_sum {round(total, 6)}", f"{name}_count {acc}"]


class Rate:
    """Events per second over the last `window` seconds (a gauge)."""

    def __init__(self, window: float = 10.0):
        self.window = window
        self._events: deque[tuple[float, int]] = deque()
        self._lock = threading.Lock()

    def add(self, n: int, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        with self._lock:
            self._events.append((now, n))
            self._trim(now)

    def _trim(self, now: float) -> None:
        while self._events and self._events[0][0] < now - self.window:
            self._events.popleft()

    def value(self, now: float | None = None) -> float:
        now = time.monotonic() if now is None else now
        with self._lock:
            self._trim(now)
            return sum(n for _, n in self._events) / self.window


class Metrics:
    """What the server measures. `render(gauges)` writes them all, with the gauges read at scrape time."""

    HISTOGRAMS = {
        "time_to_first_token_seconds": "seconds from a request's arrival to its first sampled token",
        "queue_time_seconds": "seconds a request waited before its first sequence was prefilled",
        "e2e_request_latency_seconds": "seconds from a request's arrival to its last token",
        "time_per_output_token_seconds": "seconds between a sequence's tokens after its first (per request)",
    }

    def __init__(self):
        self.requests = Counter()  # (endpoint, status) -> requests
        self.seconds = Counter()  # endpoint -> seconds serving it
        self.tokens = Counter()  # prompt / generation
        self.events = Counter()  # rejected (429), cancelled (client gone), timed_out, adapter_switches, ...
        self.hist = {name: Histogram() for name in self.HISTOGRAMS}
        self.rate = Rate()
        self._lock = threading.Lock()

    def request(self, endpoint: str, status: int, seconds: float) -> None:
        with self._lock:
            self.requests[(endpoint, int(status))] += 1
            self.seconds[endpoint] += seconds

    def render(self, gauges: dict[str, tuple[str, float]]) -> str:
        """`gauges`: name -> (help, value), read by the caller now."""
        lines = []

        def metric(name, kind, help_, samples):
            lines.append(f"# HELP nemo_jax_{name} {help_}")
            lines.append(f"# TYPE nemo_jax_{name} {kind}")
            lines.extend(f"nemo_jax_{name}{_labels(labels)} {value}" for labels, value in samples)
        with self._lock:
            requests, seconds = sorted(self.requests.items()), sorted(self.seconds.items())
            tokens, events = dict(self.tokens), dict(self.events)
        metric("requests_total", "counter", "HTTP requests by endpoint and status code (unknown paths: other)",
               [({"endpoint": e, "status": s}, n) for (e, s), n in requests])
        metric("request_seconds_total", "counter", "seconds spent serving requests, by endpoint",
               [({"endpoint": e}, round(v, 6)) for e, v in seconds])
        metric("prompt_tokens_total", "counter", "prompt tokens of admitted requests", [({}, tokens.get("prompt", 0))])
        metric("generation_tokens_total", "counter", "tokens sampled", [({}, tokens.get("generation", 0))])
        metric("generation_tokens_per_second", "gauge", "tokens sampled per second over the last 10 s",
               [({}, round(self.rate.value(), 3))])
        for name, (help_, v) in gauges.items():
            metric(name, "gauge", help_, [({}, v)])
        metric("requests_rejected_total", "counter", "requests refused by reason (queue_full: 429, draining or "
               "engine_dead: 503)", [({"reason": k[len("rejected/"):]}, n) for k, n in sorted(events.items())
                                     if k.startswith("rejected/")])
        for key, help_ in (("cancelled", "requests whose client went away before the end (rows freed at once)"),
                           ("disconnected", "connections the client closed before its request was read whole "
                                            "(counted here, never as a 500)"),
                           ("timed_out", "requests past --request-timeout (cancelled)"),
                           ("decode_steps", "engine decode steps (each samples a token in every busy row)"),
                           ("adapter_switches", "times the engine changed adapter set")):
            metric(f"{key}_total", "counter", help_, [({}, events.get(key, 0))])
        for name, help_ in self.HISTOGRAMS.items():
            lines.append(f"# HELP nemo_jax_{name} {help_}")
            lines.append(f"# TYPE nemo_jax_{name} histogram")
            lines.extend(self.hist[name].lines(f"nemo_jax_{name}"))
        return "\n".join(lines) + "\n"
