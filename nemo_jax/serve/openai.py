"""The OpenAI API's request and response shapes (as vLLM serves them), over token ids: pure functions, no HTTP.

Requests become a `Prompt` (token ids, pictures, the sampling parameters of each of its `n` samples, and what the
response should carry); finished samples (`generate.TurnEnd`) become the response JSON. Token ids and behaviour
logprobs come back as vLLM returns them, so one worker reads both servers:

* `logprobs` / `top_logprobs` (chat) or `logprobs: k` (completions): the logprob of each sampled token under the
  distribution it was drawn from (temperature, top-k and top-p applied: vLLM's `--logprobs-mode
  processed_logprobs`; greedy: the untempered one);
* `return_token_ids: true`: `prompt_token_ids` at the top and `token_ids` in each choice (vLLM >= 0.10.2);
* `return_tokens_as_token_ids: true` (or `nemo-jax serve --return-tokens-as-token-ids`): each logprob entry's
  token is spelled `token_id:<id>`.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field

from nemo_jax.generate import SamplingParams


class APIError(ValueError):
    """A request the server refuses: HTTP `status` with OpenAI's error JSON (`type` as the openai client maps it)."""

    def __init__(self, message: str, status: int = 400, param: str | None = None):
        super().__init__(message)
        self.status, self.param = status, param

    def body(self) -> dict:
        kind = {400: "BadRequestError", 404: "NotFoundError", 503: "ServiceUnavailableError"}.get(self.status,
                                                                                                  "InternalServerError")
        return {"object": "error", "message": str(self), "type": kind, "param": self.param, "code": self.status}


@dataclass
class Prompt:
    """One prompt of a request and everything its samples need."""
    tokens: list[int]
    images: list = field(default_factory=list)  # PIL images, in the order of their placeholders
    samples: list[SamplingParams] = field(default_factory=list)  # one per choice (n; seeds seed, seed + 1, ...)
    stop: list[str] = field(default_factory=list)  # stop strings (cut from the text, as vLLM does)
    top_logprobs: int = 0  # alternatives per token (0: none)


@dataclass
class Options:
    """What the response carries (the request's flags)."""
    logprobs: bool = False
    top_logprobs: int = 0
    token_ids: bool = False  # return_token_ids
    tokens_as_ids: bool = False  # return_tokens_as_token_ids
    include_stop: bool = False  # include_stop_str_in_output
    skip_special: bool = True
    tools: list | None = None  # parse tool calls back (chat, tool_choice != "none")


def _get(body: dict, key: str, kinds, default=None, check=None, what: str = ""):
    v = body.get(key, default)
    if v is None:
        return default
    if isinstance(v, bool) and bool not in (kinds if isinstance(kinds, tuple) else (kinds,)):
        raise APIError(f"'{key}' must be {what or kinds}, got {v!r}", param=key)
    if not isinstance(v, kinds):
        raise APIError(f"'{key}' must be {what or kinds}, got {v!r}", param=key)
    if check is not None and not check(v):
        raise APIError(f"'{key}': {what}, got {v!r}", param=key)
    return v


def _unsupported(body: dict) -> None:
    """Parameters whose non-default values this server does not implement: refused, never silently ignored."""
    neutral = {"presence_penalty": (0, 0.0), "frequency_penalty": (0, 0.0), "repetition_penalty": (1, 1.0),
               "min_tokens": (0,), "logit_bias": ({},), "stream": (False,), "echo": (False,), "suffix": ("",),
               "use_beam_search": (False,), "prompt_logprobs": (0,)}
    for k, ok in neutral.items():
        if body.get(k) is not None and body[k] not in ok:
            raise APIError(f"'{k}'={body[k]!r} is not supported by nemo-jax serve", param=k)
    rf = body.get("response_format")
    if rf is not None and rf != {"type": "text"}:
        raise APIError("'response_format' other than text is not supported by nemo-jax serve", param="response_format")


def sampling(body: dict, prompt_len: int, max_len: int, bucket: int, stop_ids: tuple[int, ...]) -> tuple[list, list]:
    """The request's sampling fields -> (SamplingParams of each of its n samples, stop strings)."""
    _unsupported(body)
    n = _get(body, "n", int, 1, lambda v: 1 <= v <= 64, "an integer in [1, 64]")
    best_of = body.get("best_of")
    if best_of is not None and best_of != n:
        raise APIError("'best_of' other than n is not supported by nemo-jax serve", param="best_of")
    temperature = float(_get(body, "temperature", (int, float), 1.0, lambda v: 0 <= v <= 100, "a number >= 0"))
    top_p = float(_get(body, "top_p", (int, float), 1.0, lambda v: 0 < v <= 1, "in (0, 1]"))
    top_k = _get(body, "top_k", int, 0, lambda v: v >= -1, "an integer (0 or -1: off)")
    room = max_len - -(-prompt_len // bucket) * bucket
    if room < 1:
        raise APIError(f"This model's maximum context length is {max_len} tokens; the prompt has {prompt_len}",
                       param="messages")
    limit = body.get("max_completion_tokens", body.get("max_tokens"))
    max_new = room if limit is None else _get({"max_tokens": limit}, "max_tokens", int, None, lambda v: v >= 1,
                                              "an integer >= 1")
    if max_new > room:
        raise APIError(f"This model's maximum context length is {max_len} tokens: {prompt_len} in the prompt "
                       f"(rounded up to {max_len - room}) + max_tokens={max_new} do not fit", param="max_tokens")
    seed = _get(body, "seed", int, None)
    stop = body.get("stop") or []
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise APIError("'stop' must be a string or a list of non-empty strings", param="stop")
    extra = _get(body, "stop_token_ids", list, [])
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in extra):
        raise APIError("'stop_token_ids' must be a list of integers", param="stop_token_ids")
    ids = tuple(sorted(set(extra) | (set() if body.get("ignore_eos") else set(stop_ids))))
    return [SamplingParams(max_new_tokens=max_new, temperature=temperature, top_k=max(top_k, 0), top_p=top_p,
                           stop_token_ids=ids, seed=None if seed is None else (seed + i) & 0xFFFFFFFF)
            for i in range(n)], stop


def options(body: dict, *, chat: bool, tokens_as_ids: bool) -> Options:
    if chat:
        lp = bool(_get(body, "logprobs", bool, False))
        top = _get(body, "top_logprobs", int, 0, lambda v: 0 <= v <= 20, "an integer in [0, 20]")
        if top and not lp:
            raise APIError("'top_logprobs' needs 'logprobs': true", param="top_logprobs")
    else:
        k = _get(body, "logprobs", int, None, lambda v: 0 <= v <= 20, "an integer in [0, 20]")
        lp, top = k is not None, k or 0
    choice = body.get("tool_choice")
    tools = body.get("tools") if chat else None
    if choice not in (None, "auto", "none"):
        raise APIError("tool_choice 'required' or a named tool is not supported by nemo-jax serve (use auto)",
                       param="tool_choice")
    return Options(logprobs=lp, top_logprobs=top, token_ids=bool(body.get("return_token_ids")),
                   tokens_as_ids=bool(body.get("return_tokens_as_token_ids", tokens_as_ids)),
                   include_stop=bool(body.get("include_stop_str_in_output")),
                   skip_special=bool(body.get("skip_special_tokens", True)),
                   tools=tools if tools and choice != "none" else None)


# ----------------------------------------------------------------------------- chat messages -> template input
def template_messages(messages, vision: bool) -> tuple[list[dict], list[str]]:
    """OpenAI chat messages -> (messages the chat template renders, image references in order). Content parts
    become text with one `<img><image></img>` marker per image part (`image_url` with a data URL, a `file://`
    URL or a path); tool calls' JSON-string arguments become objects (what chat templates iterate)."""
    from nemo_jax.data.chat import DataError, content_text

    if not isinstance(messages, list) or not messages:
        raise APIError("'messages' must be a non-empty list", param="messages")
    out, refs = [], []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise APIError(f"messages[{i}] needs a string 'role'", param="messages")
        m = dict(m)
        content = m.get("content")
        if content is not None:
            before = len(refs)
            try:
                m["content"] = content_text(content, f"messages[{i}]", refs)
            except DataError as e:
                raise APIError(str(e), param="messages") from None
            if len(refs) > before and not vision:
                raise APIError(f"messages[{i}] has an image part, but the model has no vision tower",
                               param="messages")
        calls = []
        for c in m.get("tool_calls") or []:
            f = dict(c.get("function") or {}) if isinstance(c, dict) else {}
            args = f.get("arguments")
            if isinstance(args, str):
                try:
                    f["arguments"] = json.loads(args) if args.strip() else {}
                except ValueError:
                    raise APIError(f"messages[{i}].tool_calls: arguments are not JSON: {args[:80]!r}",
                                   param="messages") from None
            calls.append({**c, "function": f})
        if calls:
            m["tool_calls"] = calls
        out.append(m)
    return out, refs


# ----------------------------------------------------------------------------- samples -> response JSON
def cut_at_stop(tok, tokens: list[int], logprobs: list[float], stop: list[str], include: bool, skip_special: bool):
    """A finished sample's tokens -> (tokens, logprobs, text, the stop string hit or None): cut after the token
    that completes the first stop string, the text before it (or through it with `include`)."""
    decode = lambda t: tok.tokenizer.decode(t, skip_special_tokens=skip_special)  # noqa: E731
    text = decode(tokens)
    hits = [(text.find(s), s) for s in stop if s in text]
    if not hits:
        return tokens, logprobs, text, None
    at, s = min(hits)
    lo, hi = 1, len(tokens)  # the fewest tokens whose text holds the stop string (it only grows with more)
    while lo < hi:
        mid = (lo + hi) // 2
        if s in decode(tokens[:mid]):
            hi = mid
        else:
            lo = mid + 1
    return tokens[:lo], logprobs[:lo], text[: at + (len(s) if include else 0)], s


def _token_str(tok, t: int, as_ids: bool) -> str:
    return f"token_id:{t}" if as_ids else tok.tokenizer.decode([t], skip_special_tokens=False)


def _chat_logprobs(tok, tokens, lps, tops, opt: Options) -> dict:
    def entry(t, lp):
        s = _token_str(tok, t, opt.tokens_as_ids)
        return {"token": s, "logprob": max(float(lp), -9999.0), "bytes": list(s.encode())}
    content = []
    for i, (t, lp) in enumerate(zip(tokens, lps)):
        e = entry(t, lp)
        e["top_logprobs"] = [entry(a, b) for a, b in tops[i]] if tops else []
        content.append(e)
    return {"content": content}


def _completion_logprobs(tok, tokens, lps, tops, opt: Options, offset: int) -> dict:
    strs = [_token_str(tok, t, opt.tokens_as_ids) for t in tokens]
    offsets, at = [], offset
    for s in strs:
        offsets.append(at)
        at += len(s)
    return {"tokens": strs, "token_logprobs": [max(float(x), -9999.0) for x in lps],
            "top_logprobs": [{_token_str(tok, a, opt.tokens_as_ids): max(float(b), -9999.0) for a, b in tops[i]}
                             for i in range(len(tokens))] if tops else None,
            "text_offset": offsets}


@dataclass
class Sample:
    """One finished choice: the turn's tokens and logprobs, why it ended, and its top alternatives."""
    tokens: list[int]
    logprobs: list[float]
    finish_reason: str  # stop | length
    top: list | None = None  # per token [(id, logprob), ...] when top logprobs were asked for


def choice(tok, index: int, s: Sample, prompt: Prompt, opt: Options, *, chat: bool) -> tuple[dict, int]:
    """-> (the choice JSON, completion tokens)."""
    tokens, lps, text, hit = cut_at_stop(tok, s.tokens, s.logprobs, prompt.stop, opt.include_stop, opt.skip_special)
    reason = "stop" if hit is not None else s.finish_reason
    tops = s.top[:len(tokens)] if s.top is not None else None
    out: dict = {"index": index, "finish_reason": reason, "stop_reason": hit}
    if chat:
        msg: dict = {"role": "assistant", "content": text, "tool_calls": []}
        if opt.tools:
            from nemo_jax.data.chat import split_tool_calls

            rest, calls = split_tool_calls(text, opt.tools)
            if calls:
                msg["content"] = rest
                msg["tool_calls"] = [{"id": f"chatcmpl-tool-{uuid.uuid4().hex[:24]}", "type": "function",
                                      "function": {"name": c["name"], "arguments": json.dumps(c["arguments"])}}
                                     for c in calls]
                out["finish_reason"] = "tool_calls"
        out["message"] = msg
        out["logprobs"] = _chat_logprobs(tok, tokens, lps, tops, opt) if opt.logprobs else None
    else:
        out["text"] = text
        out["logprobs"] = _completion_logprobs(tok, tokens, lps, tops, opt, 0) if opt.logprobs else None
    if opt.token_ids:
        out["token_ids"] = list(map(int, tokens))
        if not chat:  # (vLLM: per choice for completions, at the top for chat)
            out["prompt_token_ids"] = list(prompt.tokens)
    return out, len(tokens)


def response(tok, model: str, prompts: list[Prompt], samples: list[list[Sample]], opt: Options, *,
             chat: bool) -> dict:
    """The whole response: choices of every prompt (completions: prompt i's j-th at index i * n + j), usage."""
    choices, completion = [], 0
    for i, (p, ss) in enumerate(zip(prompts, samples)):
        for j, s in enumerate(ss):
            c, k = choice(tok, i * len(ss) + j, s, p, opt, chat=chat)
            choices.append(c)
            completion += k
    prompt_tokens = sum(len(p.tokens) for p in prompts)
    out = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}",
           "object": "chat.completion" if chat else "text_completion", "created": int(time.time()), "model": model,
           "choices": choices,
           "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
                     "total_tokens": prompt_tokens + completion}}
    if opt.token_ids and chat:
        out["prompt_token_ids"] = list(prompts[0].tokens)
    return out
