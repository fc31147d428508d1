"""The OpenAI API's request and response shapes (as vLLM serves them), over token ids: pure functions, no HTTP.

Requests become a `Prompt` (token ids, pictures, the sampling parameters of each of its `n` samples, and what the
response should carry); finished samples become the response JSON, or, streamed, `ChoiceStream`s turn the tokens
of each step into chunks. Token ids and behaviour logprobs come back as vLLM returns them, so one worker reads
both servers:

* `logprobs` / `top_logprobs` (chat) or `logprobs: k` (completions): the logprob of each sampled token under the
  distribution it was drawn from (penalties, logit bias, temperature, top-k and top-p applied: vLLM's
  `--logprobs-mode processed_logprobs`; greedy: the untempered one), and the k most likely tokens of that
  distribution, from the decode step itself;
* `return_token_ids: true`: `prompt_token_ids` at the top and `token_ids` in each choice (vLLM >= 0.10.2);
* `return_tokens_as_token_ids: true` (or `nemo-jax serve --return-tokens-as-token-ids`): each logprob entry's
  token is spelled `token_id:<id>`.

The rule for fields (`check_fields`): a field this server does not know is refused (400, "Unrecognized request
argument supplied", as OpenAI answers); a known field is either implemented, or accepted only at the value that
changes nothing (`echo: false`, `best_of` = n, ...), or has no effect on what is sampled (`user`, `metadata`, ...).
"""

from __future__ import annotations

import json
import os
import stat
import time
import uuid
from dataclasses import dataclass, field

from nemo_jax.fields import Fields
from nemo_jax.generate import SamplingParams
from nemo_jax.generate.sampling import request_sampling

ERROR_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError", 413: "RequestTooLargeError",
               422: "UnprocessableEntityError", 429: "RateLimitError", 500: "InternalServerError",
               503: "ServiceUnavailableError"}


class APIError(ValueError):
    """A request the server refuses: HTTP `status` with OpenAI's error JSON (`type` as the openai client names the
    error class it raises), and `headers` (e.g. Retry-After)."""

    def __init__(self, message: str, status: int = 400, param: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.param, self.headers = status, param, dict(headers or {})

    def body(self) -> dict:
        return {"error": {"message": str(self), "type": ERROR_TYPES.get(self.status, "InternalServerError"),
                          "param": self.param, "code": self.status}}


@dataclass
class Prompt:
    """One prompt of a request and everything its samples need."""
    tokens: list[int]
    images: list = field(default_factory=list)  # PIL images, in the order of their placeholders
    samples: list[SamplingParams] = field(default_factory=list)  # one per choice (n; seeds seed, seed + 1, ...)
    stop: list[str] = field(default_factory=list)  # stop strings (cut from the text, as vLLM does)


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
    stream: bool = False
    include_usage: bool = False  # stream_options.include_usage: a last chunk with the usage
    continuous_usage: bool = False  # stream_options.continuous_usage_stats (vLLM): usage in every chunk


# ----------------------------------------------------------------------------- which fields a request may carry
_SAMPLING = {"model", "max_tokens", "temperature", "top_p", "top_k", "min_p", "n", "stop", "stop_token_ids", "seed",
             "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "min_tokens", "stream",
             "stream_options", "ignore_eos", "include_stop_str_in_output", "skip_special_tokens", "return_token_ids",
             "return_tokens_as_token_ids", "logprobs"}
IMPLEMENTED = {
    "chat": _SAMPLING | {"messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice",
                         "chat_template_kwargs", "continue_final_message", "add_generation_prompt", "reasoning_effort"},
    "completions": _SAMPLING | {"prompt"},
}
# accepted only at the value that changes nothing (null is always fine)
_NEUTRAL = {"best_of": "n", "use_beam_search": False, "prompt_logprobs": 0, "priority": 0,
            "response_format": {"type": "text"}, "spaces_between_special_tokens": True}
NEUTRAL = {"chat": {**_NEUTRAL, "parallel_tool_calls": True, "modalities": ["text"]},
           "completions": {**_NEUTRAL, "echo": False, "suffix": ""}}
# accepted and without effect: `cache_salt` salts a prefix cache across requests, which this server does not keep
INERT = {"user", "metadata", "store", "service_tier", "prompt_cache_key", "safety_identifier", "request_id",
         "cache_salt"}
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")
_HINTS = {"functions": " (use 'tools')", "function_call": " (use 'tool_choice')"}


def _same(v, ok) -> bool:
    if isinstance(ok, bool) or isinstance(v, bool):
        return v is ok
    if isinstance(ok, (int, float)):
        return isinstance(v, (int, float)) and v == ok
    return v == ok


def check_fields(body: dict, endpoint: str) -> None:
    """The rule for fields (module docstring): unknown -> 400, known but not implemented -> 400 unless neutral."""
    for k, v in body.items():
        if k in IMPLEMENTED[endpoint] or k in INERT or v is None:
            continue
        if k not in NEUTRAL[endpoint]:
            raise APIError(f"Unrecognized request argument supplied: {k}{_HINTS.get(k, '')}", param=k)
        ok = NEUTRAL[endpoint][k]
        if not _same(v, body.get("n", 1) if ok == "n" else ok):
            raise APIError(f"'{k}'={json.dumps(v)[:80]} is not supported by nemo-jax serve (only the value that "
                           "changes nothing is accepted)", param=k)


def fields(body: dict, prefix: str = "") -> Fields:
    """The request's fields, read with checks: a wrong one is a 400 naming it (`param`)."""
    return Fields(body, lambda message, key: APIError(message, param=key), prefix)


# ----------------------------------------------------------------------------- requests -> sampling parameters
def sampling(body: dict, prompt_len: int, max_len: int, bucket: int, stop_ids: tuple[int, ...], vocab: int,
             top_logprobs: int = 0, *, prefix: str = "", prompt_field: str | None = None) -> tuple[list, list]:
    """The request's sampling fields (`body`, or the object of them named `prefix`), every number bounded ->
    (SamplingParams of each of its n samples, stop strings)."""
    room = max_len - -(-prompt_len // bucket) * bucket
    if room < 1:
        raise APIError(f"This model's maximum context length is {max_len} tokens; the prompt has {prompt_len}",
                       param=prompt_field or ("messages" if "messages" in body else "prompt"))
    f = fields(body, prefix)
    return request_sampling(f, vocab=vocab, stop_ids=stop_ids, context=(max_len, prompt_len), room=room,
                            max_keys=("max_completion_tokens", "max_tokens"), n=f.integer("n", 1, 1, 64),
                            top_logprobs=top_logprobs)


def options(body: dict, *, chat: bool, tokens_as_ids: bool) -> Options:
    if chat:
        lp = body.get("logprobs")
        if lp is not None and not isinstance(lp, bool):
            raise APIError(f"'logprobs' must be a boolean, got {json.dumps(lp)[:40]}", param="logprobs")
        lp = bool(lp)
        top = fields(body).integer("top_logprobs", 0, 0, 20)
        if top and not lp:
            raise APIError("'top_logprobs' needs 'logprobs': true", param="top_logprobs")
    else:
        k = fields(body).integer("logprobs", None, 0, 20)
        lp, top = k is not None, k or 0
    choice = body.get("tool_choice")
    tools = body.get("tools") if chat else None
    if choice not in (None, "auto", "none"):
        raise APIError("tool_choice 'required' or a named tool is not supported by nemo-jax serve (use auto)",
                       param="tool_choice")
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise APIError("'stream' must be a boolean", param="stream")
    so = body.get("stream_options")
    if so is not None and (not isinstance(so, dict) or not set(so) <= {"include_usage", "continuous_usage_stats"}):
        raise APIError("'stream_options' takes include_usage and continuous_usage_stats", param="stream_options")
    if so and not stream:
        raise APIError("'stream_options' needs 'stream': true", param="stream_options")
    so = so or {}
    return Options(logprobs=lp, top_logprobs=top, token_ids=bool(body.get("return_token_ids")),
                   tokens_as_ids=bool(body.get("return_tokens_as_token_ids", tokens_as_ids)),
                   include_stop=bool(body.get("include_stop_str_in_output")),
                   skip_special=bool(body.get("skip_special_tokens", True)),
                   tools=tools if tools and choice != "none" else None, stream=bool(stream),
                   include_usage=bool(so.get("include_usage")), continuous_usage=bool(so.get("continuous_usage_stats")))


# ----------------------------------------------------------------------------- chat messages -> template input
def template_messages(messages, vision: bool) -> tuple[list[dict], list[str]]:
    """OpenAI chat messages -> (messages the chat template renders, image references in order). Content parts
    become text with one `<img><image></img>` marker per image part (`image_url` with a data URL, a `file://`
    URL or a path); tool calls' JSON-string arguments become objects (what chat templates iterate)."""
    from nemo_jax.data.chat import ROLES, DataError, content_text

    if not isinstance(messages, list) or not messages:
        raise APIError("'messages' must be a non-empty list", param="messages")
    out, refs = [], []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise APIError(f"messages[{i}] needs a string 'role'", param="messages")
        if m["role"] not in ROLES:  # (as the data pipeline refuses it: a chat template may render it as anything)
            raise APIError(f"messages[{i}]: unknown role {m['role'][:40]!r} (expected one of {', '.join(ROLES)})",
                           param="messages")
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
        calls = m.get("tool_calls")
        if calls is not None:
            m["tool_calls"] = [_tool_call(c, f"messages[{i}].tool_calls[{j}]")
                               for j, c in enumerate(calls if isinstance(calls, list) else [calls])]
            if not isinstance(calls, list):
                raise APIError(f"messages[{i}].tool_calls must be a list", param="messages")
        out.append(m)
    return out, refs


def _tool_call(c, where: str) -> dict:
    f = c.get("function") if isinstance(c, dict) else None
    if not isinstance(f, dict) or not isinstance(f.get("name"), str):
        raise APIError(f"{where} needs a 'function' object with a string 'name'", param="messages")
    f, args = dict(f), f.get("arguments")
    if isinstance(args, str):
        try:
            f["arguments"] = json.loads(args) if args.strip() else {}
        except ValueError:
            raise APIError(f"{where}: arguments are not JSON: {args[:80]!r}", param="messages") from None
    elif args is not None and not isinstance(args, dict):
        raise APIError(f"{where}: arguments must be a JSON string", param="messages")
    if not isinstance(f.get("arguments", {}), dict):
        raise APIError(f"{where}: arguments must be a JSON object", param="messages")
    return {**c, "function": f}


def local_image(ref: str, roots: list[str]) -> str:
    """An image reference that is not a data URL: a `file://` URL or a path is read only under one of `roots`
    (`--allowed-local-media-path`, as vLLM's flag), `..` and links out of them refused -> the real path."""
    if ref.startswith(("http://", "https://")):
        raise APIError(f"{ref[:80]}: remote images are not fetched; send a data URL", param="messages")
    if not roots:
        raise APIError("local image paths and file:// URLs are refused (start the server with "
                       "--allowed-local-media-path DIR to read images under DIR); send a data URL",
                       param="messages")
    path = ref[len("file://"):] if ref.startswith("file://") else ref
    if ".." in path.replace("\\", "/").split("/") or not os.path.isabs(path):
        raise APIError(f"{ref[:120]}: an absolute path without '..' is needed", param="messages")
    real = os.path.realpath(path)
    if not any(os.path.commonpath([real, r]) == r for r in roots):
        raise APIError(f"{ref[:120]}: not under --allowed-local-media-path", param="messages")
    try:
        mode = os.stat(real).st_mode
    except OSError:
        raise APIError(f"{ref[:120]}: no such image file", param="messages") from None
    if not stat.S_ISREG(mode):  # a FIFO or device would never end: refused before it is opened
        raise APIError(f"{ref[:120]}: not a regular file", param="messages")
    return real


def check_text(body) -> None:
    """A request body's strings are valid Unicode: a lone surrogate escape ("\\ud800", which JSON allows) is a
    400 here, not an encoding error deep in the tokenizer."""
    try:
        json.dumps(body, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as e:
        bad = e.object[e.start:e.end].encode("utf-8", "backslashreplace").decode()
        raise APIError(f"the request holds a lone surrogate escape ({bad}): not valid Unicode text") from None


# ----------------------------------------------------------------------------- samples -> response JSON
def token_bytes(tokenizer) -> list[bytes]:
    """Each token id's text as bytes, so that decoding a sequence (special tokens skipped) is their concatenation,
    decoded: byte-level BPE vocabularies through their byte alphabet, others (sentencepiece style) as the decoded
    single token with `▁` a space and `<0xHH>` byte tokens their byte; special tokens none."""
    spec = json.loads(tokenizer.to_str())
    decoder = (spec.get("decoder") or {}).get("type")
    special = {t["id"] for t in spec.get("added_tokens", []) if t.get("special")}
    n = tokenizer.get_vocab_size(with_added_tokens=True)
    out = [b""] * n
    if decoder == "ByteLevel":
        bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
        cs, k = list(bs), 0
        for b in range(256):
            if b not in bs:
                bs.append(b)
                cs.append(256 + k)
                k += 1
        byte_of = {chr(c): b for b, c in zip(bs, cs)}
    for t in range(n):
        s = tokenizer.id_to_token(t)
        if s is None or t in special:
            continue
        if decoder == "ByteLevel" and all(ch in byte_of for ch in s):
            out[t] = bytes(byte_of[ch] for ch in s)
        elif len(s) == 6 and s.startswith("<0x") and s.endswith(">"):
            out[t] = bytes([int(s[3:5], 16)])
        else:
            out[t] = s.replace("▁", " ").encode()
    return out


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


def _lp(x) -> float:
    return max(float(x), -9999.0)  # (-inf, outside the sampled set, as vLLM writes it)


def chat_logprobs(tok, tokens, lps, tops, opt: Options) -> dict:
    def entry(t, lp):
        s = _token_str(tok, t, opt.tokens_as_ids)
        return {"token": s, "logprob": _lp(lp), "bytes": list(s.encode())}
    content = []
    for i, (t, lp) in enumerate(zip(tokens, lps)):
        e = entry(t, lp)
        e["top_logprobs"] = [entry(a, b) for a, b in tops[i][:opt.top_logprobs]] if tops else []
        content.append(e)
    return {"content": content}


def completion_logprobs(tok, tokens, lps, tops, opt: Options, offset: int) -> dict:
    strs = [_token_str(tok, t, opt.tokens_as_ids) for t in tokens]
    offsets, at = [], offset
    for s in strs:
        offsets.append(at)
        at += len(s)
    return {"tokens": strs, "token_logprobs": [_lp(x) for x in lps],
            "top_logprobs": [{_token_str(tok, a, opt.tokens_as_ids): _lp(b) for a, b in tops[i][:opt.top_logprobs]}
                             for i in range(len(tokens))] if tops else None,
            "text_offset": offsets}


@dataclass
class Sample:
    """One finished choice: the turn's tokens and logprobs, why it ended, and its top alternatives."""
    tokens: list[int]
    logprobs: list[float]
    finish_reason: str  # stop | length
    top: list | None = None  # per token [(id, logprob), ...] when top logprobs were asked for
    stop: str | None = None  # the stop string the engine ended it at


def _tool_calls_json(calls) -> list[dict]:
    return [{"id": f"chatcmpl-tool-{uuid.uuid4().hex[:24]}", "type": "function",
             "function": {"name": c["name"], "arguments": json.dumps(c["arguments"])}} for c in calls]


TOOL_START, TOOL_END = "<tool_call>", "</tool_call>"


def split_calls(text: str, tools) -> tuple[str | None, list[dict]]:
    """A chat turn's text -> (content, well-formed tool calls). With calls, the content is the text before the
    first well-formed one (trailing whitespace dropped; None when empty), as vLLM's tool parsers give it: what a
    stream sends before the call begins."""
    from nemo_jax.data.chat import split_tool_calls

    _, calls = split_tool_calls(text, tools)
    if not calls:
        return text, []
    at = text.find(TOOL_START)
    while at >= 0:
        end = text.find(TOOL_END, at)
        if end < 0 or split_tool_calls(text[at:end + len(TOOL_END)], tools)[1]:
            break
        at = text.find(TOOL_START, end)
    content = text[:at if at >= 0 else len(text)].rstrip()
    return content or None, calls


def choice(tok, index: int, s: Sample, prompt: Prompt, opt: Options, *, chat: bool) -> tuple[dict, int]:
    """-> (the choice JSON, completion tokens)."""
    tokens, lps, text, hit = cut_at_stop(tok, s.tokens, s.logprobs, prompt.stop, opt.include_stop, opt.skip_special)
    reason = "stop" if hit is not None else s.finish_reason
    tops = s.top[:len(tokens)] if s.top is not None else None
    out: dict = {"index": index, "finish_reason": reason, "stop_reason": hit}
    if chat:
        msg: dict = {"role": "assistant", "content": text, "tool_calls": []}
        if opt.tools:
            content, calls = split_calls(text, opt.tools)
            if calls:
                msg["content"] = content
                msg["tool_calls"] = _tool_calls_json(calls)
                out["finish_reason"] = "tool_calls"
        out["message"] = msg
        out["logprobs"] = chat_logprobs(tok, tokens, lps, tops, opt) if opt.logprobs else None
    else:
        out["text"] = text
        out["logprobs"] = completion_logprobs(tok, tokens, lps, tops, opt, 0) if opt.logprobs else None
    if opt.token_ids:
        out["token_ids"] = list(map(int, tokens))
        if not chat:  # (vLLM: per choice for completions, at the top for chat)
            out["prompt_token_ids"] = list(prompt.tokens)
    return out, len(tokens)


def usage(prompt_tokens: int, completion: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion, "total_tokens": prompt_tokens + completion}


def response(tok, model: str, prompts: list[Prompt], samples: list[list[Sample]], opt: Options, *,
             chat: bool) -> dict:
    """The whole response: choices of every prompt (completions: prompt i's j-th at index i * n + j), usage."""
    choices, completion = [], 0
    for i, (p, ss) in enumerate(zip(prompts, samples)):
        for j, s in enumerate(ss):
            c, k = choice(tok, i * len(ss) + j, s, p, opt, chat=chat)
            choices.append(c)
            completion += k
    out = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}",
           "object": "chat.completion" if chat else "text_completion", "created": int(time.time()), "model": model,
           "choices": choices, "usage": usage(sum(len(p.tokens) for p in prompts), completion)}
    if opt.token_ids and chat:
        out["prompt_token_ids"] = list(prompts[0].tokens)
    return out


# ----------------------------------------------------------------------------- streaming
def sse(obj) -> str:
    """One server-sent event (`data: <json>`)."""
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


SSE_DONE = "data: [DONE]\n\n"


class ChoiceStream:
    """One choice streamed: the tokens of each step -> the choice part of a chunk, holding back what is not final
    yet (an incomplete UTF-8 character, text that may begin a stop string, a tool call as it is written), so
    that the chunks' text adds up to the non-streamed text (`finish` sends what is left)."""

    def __init__(self, tok, index: int, prompt: Prompt, opt: Options, *, chat: bool):
        self.tok, self.index, self.prompt, self.opt, self.chat = tok, index, prompt, opt, chat
        self.tokens: list[int] = []
        self.sent = ""  # text sent so far
        self.sent_tokens = 0  # tokens whose logprobs (and ids) were sent
        self.offset = 0  # completions' text_offset of the next token
        self.hold = max((len(s) for s in prompt.stop), default=1) - 1
        self.completion_tokens = 0

    def _decode(self, tokens) -> str:
        return self.tok.tokenizer.decode(tokens, skip_special_tokens=self.opt.skip_special)

    def _safe(self, text: str) -> str:
        """The part of the text so far that no later token can change."""
        text = text.rstrip("\ufffd")
        hits = [(text.find(s), s) for s in self.prompt.stop if s in text]
        if hits:
            at, s = min(hits)
            return text[: at + (len(s) if self.opt.include_stop else 0)]
        text = text[: len(text) - self.hold] if self.hold else text
        if self.chat and self.opt.tools:
            at = text.find(TOOL_START)
            if at >= 0:
                text = text[:at]
            else:
                k = next((k for k in range(min(len(TOOL_START) - 1, len(text)), 0, -1)
                          if TOOL_START.startswith(text[-k:])), 0)
                text = text[: len(text) - k]
            text = text.rstrip()  # (whitespace before a tool call is not content)
        return text

    def _part(self, text: str, tokens, lps, tops) -> dict:
        """A chunk's choice: `text` added, the logprobs / ids of `tokens`."""
        opt = self.opt
        c: dict = {"index": self.index}
        if self.chat:
            c["delta"] = {"content": text} if text else {}
        else:
            c["text"] = text
        if opt.logprobs and tokens:
            if self.chat:
                c["logprobs"] = chat_logprobs(self.tok, tokens, lps, tops, opt)
            else:
                c["logprobs"] = completion_logprobs(self.tok, tokens, lps, tops, opt, self.offset)
                self.offset = c["logprobs"]["text_offset"][-1] + len(c["logprobs"]["tokens"][-1])
        else:
            c["logprobs"] = None
        c["finish_reason"] = None
        if opt.token_ids:
            c["token_ids"] = list(map(int, tokens))
        return c

    def first(self) -> dict | None:
        """Chat: the chunk opening the choice (the assistant role)."""
        return {"index": self.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                "finish_reason": None} if self.chat else None

    def add(self, tokens, lps, tops) -> dict | None:
        """New tokens -> the choice part of a chunk (None: nothing to send yet)."""
        self.tokens += tokens
        self.sent_tokens += len(tokens)
        safe = self._safe(self._decode(self.tokens))
        text = safe[len(self.sent):] if safe.startswith(self.sent) else ""
        self.sent += text
        if not text and not (self.opt.logprobs or self.opt.token_ids):
            return None
        return self._part(text, tokens, lps, tops)

    def finish(self, s: Sample) -> list[dict]:
        """The finished sample -> the last choice parts: the rest of the text (and of the tokens, when the engine
        ran past a stop string the text search found), the tool calls, the finish reason."""
        final, n = choice(self.tok, self.index, s, self.prompt, self.opt, chat=self.chat)
        self.completion_tokens = n
        if self.chat:
            content, calls = final["message"]["content"] or "", final["message"]["tool_calls"]
        else:
            content, calls = final["text"], []
        rest = content[len(self.sent):] if content.startswith(self.sent) else ""
        out = []
        left = s.tokens[self.sent_tokens:n] if n > self.sent_tokens else []
        if rest or left:
            tops = s.top[self.sent_tokens:n] if s.top is not None else None
            out.append(self._part(rest, left, s.logprobs[self.sent_tokens:n], tops))
            self.sent += rest
        if calls:
            out.append({"index": self.index, "delta": {"tool_calls": [dict(c, index=k) for k, c in enumerate(calls)]},
                        "logprobs": None, "finish_reason": None})
        end = {"index": self.index, "finish_reason": final["finish_reason"], "stop_reason": final["stop_reason"],
               "logprobs": None}
        if self.chat:
            end["delta"] = {}
        else:
            end["text"] = ""
        out.append(end)
        return out
