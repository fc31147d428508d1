"""The sampling math: `SamplingParams` (what a request asks for), the logprobs of the distribution sampled from,
`sample_token` (draws from softmax(logits / temperature) restricted to the top-k / top-p set and returns the
logprob of the drawn token under exactly that renormalised distribution: untruncated sampling at temperature T
gives the learner's temperature-scaled logprob, the number importance weights compare to), and the Engine's
per-row sampling in its decode step (`RowSampling`, `process_logits`: logit bias, penalties, stop strings)."""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np



@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 64
    temperature: float = 1.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    min_p: float = 0.0  # 0 = off; else tokens less likely than min_p x the most likely one's probability are cut
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None  # the Engine: a sequence's draws depend only on it (and the tokens), not on its batch
    # the Engine only (`generate` refuses them), as vLLM applies them, in this order: logit_bias and min_tokens,
    # then the penalties, then temperature / top-k / top-p (`process_logits`)
    presence_penalty: float = 0.0  # minus this on every token the turn has sampled
    frequency_penalty: float = 0.0  # minus this times the times the turn has sampled the token
    repetition_penalty: float = 1.0  # tokens of the prompt or the turn: logits > 0 divided by it, < 0 multiplied
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit) pairs
    min_tokens: int = 0  # stop ids (and stop strings) are held off until the turn has this many tokens
    stop: tuple[str, ...] = ()  # stop strings: the turn ends at the token completing one (the Engine's token_bytes)
    top_logprobs: int = 0  # the Engine returns this many most likely tokens at each step (TurnEnd.top)

    def __post_init__(self):
        if not 1 <= self.max_new_tokens < _I32:
            raise ValueError(f"max_new_tokens must be >= 1 (got {self.max_new_tokens})")
        if not (0 <= self.temperature < float("inf") and 0 < self.top_p <= 1 and 0 <= self.top_k < _I32
                and 0 <= self.min_p <= 1):
            raise ValueError(f"sampling: temperature >= 0, 0 < top_p <= 1, 0 <= top_k < 2^31, 0 <= min_p <= 1 (got "
                             f"{self.temperature}, {self.top_p}, {self.top_k}, {self.min_p})")
        bad = [t for t in self.stop_token_ids if not 0 <= t < _I32]
        if bad:
            raise ValueError(f"sampling: stop token id {bad[0]} is not in [0, 2^31)")
        pen = (self.presence_penalty, self.frequency_penalty, self.repetition_penalty)
        if not all(abs(x) < float("inf") for x in pen) or not self.repetition_penalty > 0:
            raise ValueError(f"sampling: finite presence / frequency penalties and a repetition penalty > 0 (got {pen})")
        if any(not 0 <= t < _I32 or not abs(b) < float("inf") for t, b in self.logit_bias):
            raise ValueError("sampling: logit_bias takes token ids in [0, 2^31) and finite biases")
        if not 0 <= self.min_tokens <= self.max_new_tokens:
            raise ValueError(f"sampling: 0 <= min_tokens <= max_new_tokens (got {self.min_tokens}, "
                             f"{self.max_new_tokens})")
        if not 0 <= self.top_logprobs <= 1024:
            raise ValueError(f"sampling: 0 <= top_logprobs <= 1024 (got {self.top_logprobs})")
        if any(not isinstance(x, str) or not 0 < len(x.encode()) <= MAX_STOP_BYTES for x in self.stop):
            raise ValueError(f"sampling: stop strings of 1 to {MAX_STOP_BYTES} UTF-8 bytes (got {self.stop!r:.200})")

    @property
    def processed(self) -> bool:
        """Does it ask for more than temperature / top-k / top-p (what only the Engine samples)?"""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.logit_bias or self.min_tokens or self.stop or self.top_logprobs)


_I32 = 2 ** 31


MAX_STOP_BYTES = 256  # the longest stop string the Engine matches in its decode step


TOP_LOGPROBS = 20  # the Engine's step with extras returns this many alternatives (more when a row asks for more)


# the least widths of the Engine's per-row arrays (rounded up to powers of two beyond): few compiled shapes
MIN_WIDTHS = {"stops": 8, "bias": 16, "stop_strings": 4, "stop_bytes": 32, "prompt": 256}


def sampling_logprobs(logits: jax.Array, temperature: float, top_k: int = 0, top_p: float = 1.0,
                      min_p: float = 0.0) -> jax.Array:
    """[..., V] fp32 logits -> log-probabilities of the distribution sampled from (-inf outside the kept set): the
    logits over the temperature, then (as vLLM) min-p, top-k, top-p."""
    x = logits.astype(jnp.float32) / max(temperature, 1e-6)
    V = x.shape[-1]
    if min_p > 0:
        x = _min_p_cut(x, jnp.float32(min_p))
    if top_k and top_k < V:
        kth = jax.lax.top_k(x, top_k)[0][..., -1:]
        x = jnp.where(x >= kth, x, -jnp.inf)
    if top_p < 1.0:
        order = jnp.argsort(-x, axis=-1)
        sorted_x = jnp.take_along_axis(x, order, axis=-1)
        p = jax.nn.softmax(sorted_x, axis=-1)
        before = jnp.cumsum(p, axis=-1) - p  # mass strictly before each token
        keep_sorted = before < top_p
        keep = jnp.take_along_axis(keep_sorted, jnp.argsort(order, axis=-1), axis=-1)
        x = jnp.where(keep, x, -jnp.inf)
    return jax.nn.log_softmax(x, axis=-1)


def sample_token(logits: jax.Array, key, sp: SamplingParams):
    """logits [b, V] -> (token [b] int32, logprob [b] fp32)."""
    if sp.temperature == 0.0:
        tok = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        lp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
        return tok, jnp.take_along_axis(lp, tok[:, None], axis=-1)[:, 0]
    lp = sampling_logprobs(logits, sp.temperature, sp.top_k, sp.top_p, sp.min_p)
    tok = _inverse_cdf_draw(key, lp)
    return tok, jnp.take_along_axis(lp, tok[:, None], axis=-1)[:, 0]


def _min_p_cut(x: jax.Array, min_p: jax.Array) -> jax.Array:
    """x [..., V] tempered logits, min_p [...] -> x with -inf on tokens whose probability is below min_p times the
    most likely token's (x - max < log min_p; min_p 0 cuts nothing)."""
    top = jnp.max(x, axis=-1, keepdims=True)
    return jnp.where(x - top < jnp.log(min_p)[..., None], -jnp.inf, x)


def _inverse_cdf_draw(key, lp: jax.Array) -> jax.Array:
    """One draw per row from exp(lp) [b, V] by inverting its CDF with one uniform per row: the same
    distribution as `jax.random.categorical` (Gumbel-max), which draws b x V random numbers, a quarter of a
    decode step on CPU at V = 8k. Zero-probability tokens own empty CDF intervals and are never drawn."""
    return _draw(jax.random.uniform(key, (lp.shape[0], 1), jnp.float32), lp)


def _draw(u: jax.Array, lp: jax.Array) -> jax.Array:
    """`_inverse_cdf_draw` with the uniforms u [b, 1] in [0, 1) given."""
    p = jnp.exp(lp - jnp.max(lp, axis=-1, keepdims=True))
    cdf = jnp.cumsum(p, axis=-1)
    u = u * cdf[:, -1:]
    last = lp.shape[-1] - 1 - jnp.argmax((p > 0)[:, ::-1], axis=-1)  # rounding never reaches past it
    return jnp.minimum(jnp.sum(cdf <= u, axis=-1), last).astype(jnp.int32)


def row_sampling_logprobs(logits: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array, *,
                          k_max: int = 0, nucleus: bool = False, min_p: jax.Array | None = None) -> jax.Array:
    """`sampling_logprobs` with per-row parameters: logits [b, V], temperature / top_k / top_p / min_p [b] (a row with
    temperature 0 is greedy: its distribution is the untempered one, as `sample_token` gives). Static `k_max` >=
    every row's top_k (0: no row truncates to its top k; >= V: any top k, read off the sort the nucleus uses) and
    `nucleus` (some row has top_p < 1) leave the truncations out of the compiled step when no row asks for them, as
    `min_p` None does min-p."""
    t = jnp.where(temperature > 0, temperature, 1.0).astype(jnp.float32)
    x = logits.astype(jnp.float32) / t[:, None]
    V = x.shape[-1]
    if min_p is not None:
        x = _min_p_cut(x, min_p.astype(jnp.float32))
    order = sorted_x = None
    if nucleus or k_max >= V:  # one sort serves both truncations (k_max >= V: any row's top k, read off it)
        order = jnp.argsort(-x, axis=-1)
        sorted_x = jnp.take_along_axis(x, order, axis=-1)
    if k_max:
        top = sorted_x if k_max >= V else jax.lax.top_k(x, k_max)[0]
        kth = jnp.take_along_axis(top, jnp.clip(top_k - 1, 0, min(k_max, V) - 1)[:, None], axis=-1)
        cut = (top_k[:, None] > 0)
        x = jnp.where(cut & (x < kth), -jnp.inf, x)
        if sorted_x is not None:  # (the same order: the cut entries are the sorted tail)
            sorted_x = jnp.where(cut & (sorted_x < kth), -jnp.inf, sorted_x)
    if nucleus:
        p = jax.nn.softmax(sorted_x, axis=-1)
        before = jnp.cumsum(p, axis=-1) - p  # mass strictly before each token
        keep_sorted = (before < top_p[:, None]) | (top_p[:, None] >= 1.0)
        keep = jnp.take_along_axis(keep_sorted, jnp.argsort(order, axis=-1), axis=-1)
        x = jnp.where(keep, x, -jnp.inf)
    return jax.nn.log_softmax(x, axis=-1)


def sample_rows(logits: jax.Array, u: jax.Array, temperature, top_k, top_p, *, k_max: int = 0,
                nucleus: bool = False):
    """One token per row with per-row parameters (`row_sampling_logprobs`) and per-row uniforms u [b] ->
    (token [b] int32, its logprob [b] under the distribution drawn from; greedy rows: argmax)."""
    lp = row_sampling_logprobs(logits, temperature, top_k, top_p, k_max=k_max, nucleus=nucleus)
    tok = jnp.where(temperature > 0, _draw(u[:, None], lp), jnp.argmax(logits, axis=-1).astype(jnp.int32))
    return tok, jnp.take_along_axis(lp, tok[:, None], axis=-1)[:, 0]


@dataclass(frozen=True)
class RowSampling:
    """What the rows sampling now ask for: the static shape of the Engine's decode step (each combination compiles
    once; rows asking for none of the extras sample exactly as `sample_rows`)."""
    k_max: int = 0  # >= every row's top_k (0: no row truncates to its top k)
    nucleus: bool = False  # some row has top_p < 1
    adjust: bool = False  # some row has penalties, a logit_bias or min_tokens (one variant for the three: few
    # compiled steps; rows without them carry neutral values)
    top_n: int = 0  # alternatives returned per row and step (>= every row's top_logprobs)
    stop_strings: bool = False  # some row has stop strings


def process_logits(logits: jax.Array, rows: dict, how: RowSampling) -> jax.Array:
    """logits [b, V] -> the logits each row samples from before temperature, top-k and top-p, built as vLLM's
    sampler builds them: `bias` [b, B] added at `bias_ids` [b, B] (ids >= V pad); the row's stop ids `stops` [b, S]
    (-1 pads) at -inf while its turn has fewer than `min_tokens` [b] tokens (`count` - `turn0`); then the
    repetition penalty on tokens of the prompt (`seen` [b, V]) or of the turn (`counts` [b, V] > 0): logits > 0
    divided by it, the others multiplied; then minus `frequency` x counts and `presence` x (counts > 0).
    Unless `how.adjust` the logits come back untouched."""
    if not how.adjust:
        return logits
    x = logits.astype(jnp.float32)
    b, V = x.shape
    r = jnp.arange(b)[:, None]
    x = x.at[r, rows["bias_ids"]].add(rows["bias"], mode="drop")
    held = (rows["count"] - rows["turn0"] < rows["min_tokens"])[:, None] & (rows["stops"] >= 0)
    x = x.at[r, jnp.where(held, rows["stops"], V)].set(-jnp.inf, mode="drop")
    counts = rows["counts"]
    out = counts > 0
    rep = jnp.where(rows["seen"] | out, rows["repetition"][:, None], 1.0)
    x = jnp.where(x > 0, x / rep, x * rep)
    return x - rows["frequency"][:, None] * counts - rows["presence"][:, None] * out


def stop_string_hits(tail: jax.Array, new: jax.Array, n: jax.Array, stop_bytes: jax.Array, stop_lens: jax.Array):
    """Stop strings matched on the bytes of each row's turn text, across token boundaries.

    tail [b, T]: the last T bytes of the text so far (-1 where there is none); new [b, L]: the sampled token's
    bytes, the first n [b] of them valid; stop_bytes [b, S, W] (W <= T): each stop string's UTF-8 bytes
    right-aligned, stop_lens [b, S] their lengths (0: no string). -> (hit [b]: a stop string ends inside the new
    bytes, the new tail [b, T]). Stop strings that ended earlier were seen then: only matches ending in the new
    bytes count."""
    b, T = tail.shape
    L, W = new.shape[1], stop_bytes.shape[-1]
    at = jnp.arange(L)
    new = jnp.where(at[None] < n[:, None], new.astype(jnp.int32), -1)
    cat = jnp.concatenate([tail, new], axis=1)  # [b, T + L]: the tail, the n new bytes, padding
    src = jnp.arange(T + L)[None] - (L - n)[:, None]  # right-aligned: the last new byte at T + L - 1
    out = jnp.where(src >= 0, jnp.take_along_axis(cat, jnp.maximum(src, 0), axis=1), -1)
    ends = T + L - at  # [L] the match ending after the k-th last byte (valid for k < n)
    win = out[:, ends[:, None] - W + jnp.arange(W)[None, :]]  # [b, L, W]
    mine = jnp.arange(W)[None, None] >= W - stop_lens[..., None]  # [b, S, W] the string's own bytes
    eq = (win[:, None] == stop_bytes[:, :, None, :]) | ~mine[:, :, None, :]  # [b, S, L, W]
    ok = jnp.all(eq, axis=-1) & (stop_lens[..., None] > 0) & (at[None, None] < n[:, None, None])
    return jnp.any(ok, axis=(1, 2)), out[:, L:]


def token_table(token_bytes, vocab_size: int, width: int = 128) -> tuple[np.ndarray, np.ndarray]:
    """Each token's text as bytes (ids beyond the list: none) -> (bytes [V, L] uint8, lengths [V] int32), L the
    longest token's length rounded up to a power of 2 (at most `width`: a longer token keeps its last L bytes)."""
    longest = max((len(x) for x in token_bytes), default=1)
    L = min(_pow2(max(longest, 1)), width)
    tb, tl = np.zeros((vocab_size, L), np.uint8), np.zeros(vocab_size, np.int32)
    for i, x in enumerate(token_bytes[:vocab_size]):
        x = x[-L:]
        tb[i, :len(x)] = np.frombuffer(x, np.uint8)
        tl[i] = len(x)
    return tb, tl


def sample_step(logits: jax.Array, u: jax.Array, rows: dict, hist: dict, tables: dict, active: jax.Array,
                how: RowSampling):
    """The Engine's sampling of one decode step: `process_logits`, then one token per row from its
    temperature / top-k / top-p distribution (`sample_rows`; greedy rows: the argmax of the processed logits).
    `hist`: the rows' running arrays (`counts` [b, V] of the turn's tokens and `seen` [b, V] prompt tokens for the
    penalties, `tail` [b, T] for stop strings); `tables`: the token byte table (`token_table`) for stop strings.
    -> (token [b], its logprob [b], stop-string hit [b], updated hist, top (ids, logprobs) [b, top_n] or None)."""
    b = logits.shape[0]
    rows = {**rows, **hist}
    x = process_logits(logits, rows, how)
    lp = row_sampling_logprobs(x, rows["temperature"], rows["top_k"], rows["top_p"], k_max=how.k_max,
                               nucleus=how.nucleus, min_p=rows.get("min_p"))
    tok = jnp.where(rows["temperature"] > 0, _draw(u[:, None], lp), jnp.argmax(x, axis=-1).astype(jnp.int32))
    hist = dict(hist)
    if how.adjust:
        hist["counts"] = hist["counts"].at[jnp.arange(b), tok].add(active.astype(jnp.int32))
    hit = jnp.zeros((b,), bool)
    if how.stop_strings:
        new, n = tables["bytes"][tok], tables["lens"][tok]
        hit, tail = stop_string_hits(hist["tail"], new, n, rows["stop_bytes"], rows["stop_lens"])
        if how.adjust:  # (vLLM: stop strings count once the turn has more than min_tokens tokens)
            hit = hit & (rows["count"] - rows["turn0"] + 1 > rows["min_tokens"])
        hist["tail"] = jnp.where(active[:, None], tail, hist["tail"])
    top = None
    if how.top_n:
        vals, ids = jax.lax.top_k(lp, how.top_n)
        top = (ids, vals)
    return tok, jnp.take_along_axis(lp, tok[:, None], axis=-1)[:, 0], hit & active, hist, top


def _pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def request_sampling(f, *, vocab: int, stop_ids=(), context: tuple[int, int] | None = None, room: int | None = None,
                     max_keys=("max_tokens",), default_max: int | None = None, n: int = 1, top_logprobs: int = 0,
                     ids_in_stop: bool = False) -> tuple[list[SamplingParams], list[str]]:
    """A request's sampling fields (`f`: a `nemo_jax.fields.Fields` over them; OpenAI's names, as vLLM takes them)
    -> (the SamplingParams of each of its `n` samples, seeds seed, seed + 1, ...; its stop strings). The one
    translation of every caller: the OpenAI routes, the Tinker API, rollout requests and the in-process producer.

    temperature, top_p, top_k (-1, 0 or the vocabulary's size and beyond: off), min_p, seed, min_tokens, the penalties and
    logit_bias as vLLM reads them. The first of `max_keys` given (default: `room`, else `default_max`) may not
    exceed `room`, the tokens the prompt leaves (`context`: (max_len, prompt_len), named when it does not fit).
    `stop` strings end a turn besides `stop_ids` and `stop_token_ids`; `ignore_eos` drops `stop_ids`; with
    `ids_in_stop` (the Tinker SDK's form) `stop` may hold token ids instead, and either form replaces `stop_ids`."""
    temperature = float(f.number("temperature", 1.0, 0, 100))
    top_p = float(f.number("top_p", 1.0, 0, 1, lo_open=True))
    top_k = f.integer("top_k", 0, -1, _I32 - 1)
    top_k = 0 if top_k >= vocab else max(top_k, 0)  # (at least the vocabulary: no truncation, as vLLM)
    min_p = float(f.number("min_p", 0.0, 0, 1))
    key = next((k for k in max_keys if f.has(k)), max_keys[-1])
    max_new = f.integer(key, room if room is not None else default_max, 1, _I32 - 1)
    if room is not None and max_new > room:
        max_len, prompt_len = context or (room, 0)
        raise f.error(f"This model's maximum context length is {max_len} tokens: {prompt_len} in the prompt "
                      f"(rounded up to {max_len - room}) + {f.prefix}{key}={max_new} do not fit", f.prefix + key)
    stop = f.get("stop", [])
    if ids_in_stop and isinstance(stop, list) and stop and all(isinstance(x, int) and not isinstance(x, bool)
                                                               for x in stop):
        strings, ids = [], set(f.token_ids("stop", vocab))
    else:
        strings = f.strings("stop", max_bytes=MAX_STOP_BYTES)
        ids = set() if (ids_in_stop and f.has("stop")) or f.boolean("ignore_eos") else set(stop_ids)
    ids |= set(f.token_ids("stop_token_ids", vocab))
    seed = f.integer("seed", None, -2 ** 63, 2 ** 64 - 1)
    penalties = dict(presence_penalty=float(f.number("presence_penalty", 0.0, -2, 2)),
                     frequency_penalty=float(f.number("frequency_penalty", 0.0, -2, 2)),
                     repetition_penalty=float(f.number("repetition_penalty", 1.0, 0, 10, lo_open=True)))
    bias = []
    for k, v in f.mapping("logit_bias").items():
        try:
            t = int(k)
        except ValueError:
            raise f.error(f"'{f.prefix}logit_bias' key {k!r:.40} is not a token id", f.prefix + "logit_bias") from None
        if not 0 <= t < vocab or isinstance(v, bool) or not isinstance(v, (int, float)) or not -100 <= v <= 100:
            raise f.error(f"'{f.prefix}logit_bias' {k!r:.40}: token ids in [0, {vocab}), biases in [-100, 100]",
                          f.prefix + "logit_bias")
        bias.append((t, float(v)))
    min_tokens = f.integer("min_tokens", 0, 0, max_new)
    return [SamplingParams(max_new_tokens=max_new, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                           stop_token_ids=tuple(sorted(ids)), seed=None if seed is None else (seed + i) & 0xFFFFFFFF,
                           min_tokens=min_tokens, logit_bias=tuple(sorted(bias)), stop=tuple(strings),
                           top_logprobs=top_logprobs, **penalties) for i in range(n)], list(strings)
