"""What `nemo-jax serve` does before it says ready: compile every program its requests will run, and keep the
compiled programs in a persistent compilation cache so that a restart loads them instead.

The Engine's shapes are few by design (nemo_jax.generate.Engine): prompts are prefilled `bucket` tokens at a time
in chunks of a power-of-four number of rows (1, 4, 16, ... up to the decode rows), and the decode step has two
variants (rows that sample with temperature or greedily, and one step that serves every extra: top-k / top-p,
penalties, logit_bias, min_tokens, stop strings, top logprobs). `warm_up` drives the engine itself through those: for every
adapter structure the server holds (the base model's, and each distinct one of --adapters), a chunk of every row
count with two-piece prompts sampling plainly, then a row asking for every extra. So the first request of any
common kind (sampling, greedy, logprobs, top logprobs, penalties, stop strings, tools: longer prompts are more
pieces of the same shape) runs programs compiled already. Adapters loaded at run time with a structure no
adapter had at start (other targets or rank) compile on first use.

`compilation_cache(dir)` points JAX's persistent compilation cache at `dir` (every program, however quick to
compile): a restart with the same model shapes, flags and jax version loads the programs from it.
`CompileCounter` counts the XLA compiles (and cache loads) that happen while it is active.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass

DEFAULT_CACHE = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"),
                             "nemo_jax", "xla")
CACHE_ENV = "NEMO_JAX_COMPILATION_CACHE"


def cache_dir(arg: str | None) -> str | None:
    """--compilation-cache's value (else $NEMO_JAX_COMPILATION_CACHE, else DEFAULT_CACHE) -> the folder, or None when
    it is "off" / "none" / empty."""
    d = arg if arg is not None else os.environ.get(CACHE_ENV, DEFAULT_CACHE)
    return None if d.strip().lower() in ("", "off", "none") else os.path.abspath(os.path.expanduser(d))


def compilation_cache(path: str | None) -> None:
    """Use (and fill) JAX's persistent compilation cache at `path` (None: leave JAX's setting alone). Call it
    before the first compile."""
    if path is None:
        return
    import jax

    os.makedirs(path, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)  # the small programs cost a restart too
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


class CompileCounter:
    """Counts XLA compiles while active (`with counter:`): `compiled` (every backend compile, persistent cache
    loads included) and `loaded` (those served from the persistent cache). One process-wide listener."""

    _lock = threading.Lock()
    _active: list["CompileCounter"] = []
    _registered = False

    def __init__(self):
        self.compiled = 0
        self.loaded = 0

    @classmethod
    def _listen(cls) -> None:
        with cls._lock:
            if cls._registered:
                return
            from jax import monitoring

            def on_duration(event: str, duration: float, **kw) -> None:
                if event == "/jax/core/compile/backend_compile_duration":
                    for c in list(cls._active):
                        c.compiled += 1

            def on_event(event: str, **kw) -> None:
                if event == "/jax/compilation_cache/cache_hits":
                    for c in list(cls._active):
                        c.loaded += 1
            monitoring.register_event_duration_secs_listener(on_duration)
            monitoring.register_event_listener(on_event)
            cls._registered = True

    def __enter__(self):
        self._listen()
        with self._lock:
            self._active.append(self)
        return self

    def __exit__(self, *exc):
        with self._lock:
            self._active.remove(self)
        return False

    @property
    def fresh(self) -> int:
        """Programs compiled (not loaded from the persistent cache)."""
        return self.compiled - self.loaded


@dataclass
class WarmUp:
    seconds: float
    compiled: int  # programs compiled afresh
    loaded: int  # programs loaded from the persistent compilation cache
    items: int  # warm-up chunks run


def _structure(tree) -> tuple:
    import jax

    return (jax.tree.structure(tree), tuple((x.shape, str(x.dtype)) for x in jax.tree.leaves(tree)))


def row_counts(batch: int) -> list[int]:
    """The row counts the engine prefills chunks of (`generate.chunk_rows`): powers of 4 below `batch`, and it."""
    from nemo_jax.generate import chunk_rows

    return sorted({chunk_rows(n, batch) for n in range(1, batch + 1)})


def warm_up(engine, adapters=(), *, say=lambda line: print(line, flush=True)) -> WarmUp:
    """Run `engine` (idle: nothing submitted, no other thread stepping it) through every program a request can
    meet (see the module docstring), for the base model and each distinct adapter structure of `adapters` (trees
    as `Engine.set_adapters` takes them); say a progress line per chunk. The engine is left as it was: the base
    model (version 0), no sequence, its counters at zero."""
    from nemo_jax.generate import SamplingParams

    t0 = time.perf_counter()
    sets, seen = [None], set()
    for tree in adapters:
        key = _structure(tree)
        if key not in seen:
            seen.add(key)
            sets.append(tree)
    counts = row_counts(engine.batch)
    total = len(sets) * (len(counts) + 1)
    V = engine.cfg.vocab_size
    prompt = [(i % (V - 1)) + 1 for i in range(engine.bucket + 1)]  # two pieces: the first mostly padding
    n_new = min(engine.check_every + 1, max(1, engine.max_len - 2 * engine.bucket))
    if 2 * engine.bucket + n_new > engine.max_len:
        prompt, n_new = prompt[:1], 1
    plain = SamplingParams(max_new_tokens=n_new, temperature=1.0, seed=0)
    if not engine._room(len(prompt), plain):  # (no prompt fits at all: nothing a request could run either)
        say(f"nemo-jax serve: warm-up skipped: {engine.max_len} positions per row hold no {engine.bucket}-token "
            "piece and a token")
        return WarmUp(time.perf_counter() - t0, 0, 0, 0)
    extras = dict(top_k=4, top_p=0.9, min_p=0.01, top_logprobs=2, presence_penalty=0.1, frequency_penalty=0.1,
                  repetition_penalty=1.1, logit_bias=((1, 0.5),), min_tokens=1)
    if engine._token_bytes is not None:
        extras["stop"] = ("\x00\x01",)
    every = SamplingParams(max_new_tokens=n_new, temperature=1.0, seed=0, **extras)
    done = 0
    with CompileCounter() as counter:
        for i, tree in enumerate(sets):
            engine.set_adapters(tree, 0)
            what = "base model" if tree is None else f"adapter structure {i}"
            for k, sp in [(k, plain) for k in counts] + [(1, every)]:
                t = time.perf_counter()
                _run(engine, [prompt] * k, sp)
                done += 1
                kind = "every extra" if sp is every else "plain sampling"
                say(f"nemo-jax serve: warm-up {done}/{total}: {what}, {k} row{'s' * (k > 1)}, {kind} "
                    f"({time.perf_counter() - t:.1f} s)")
        engine.set_adapters(None, 0)
    engine.decode_steps = engine.tokens_sampled = 0
    return WarmUp(time.perf_counter() - t0, counter.fresh, counter.loaded, done)


def _run(engine, prompts, sp) -> None:
    """Submit the prompts at once (one chunk), step until every turn ended, release them."""
    left = {engine.submit(p, sp) for p in prompts}
    while left:
        for end in engine.step():
            left.discard(end.seq_id)
            engine.release(end.seq_id)
