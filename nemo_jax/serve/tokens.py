"""vLLM's token-in / token-out routes (its `--enable-scale-out` API, vLLM 0.32), over the same scheduler as the
OpenAI routes: what prime-rl's and verifiers' train clients sample through (the client renders the prompt itself).

    POST /inference/v1/generate        {model?, token_ids, sampling_params{...}, request_id?, cache_salt?,
                                       priority?, return_token_ids?, output_mode?: tokens | text, stream?: false}
        -> {request_id, model, created, usage, prompt_token_ids?, output_mode, choices[{index, token_ids,
            finish_reason, stop_reason, logprobs{content[{token_id, logprob, rank, top_logprobs[...]}]},
            weight_versions[{version, start, end}]}], ...}
    POST /inference/v1/abort_requests  {request_ids: [...]}: those requests end now; each answers what it had
                                       sampled, finish_reason "abort"

`model` is the served name or a loaded adapter's name (as on the OpenAI routes). Logprobs are those of the
distribution each token was drawn from (the tempered, truncated one: vLLM's `--logprobs-mode processed_logprobs`;
equal to its default raw logprobs for greedy requests and at temperature 1 without truncation); `top_logprobs` holds
the sampled token first, then the most likely others, `max(logprobs, 1)` in all, as vLLM lists them. Each entry
also carries `token` = "token_id:<id>" (what verifiers' renderer client reads). `weight_versions` names the weights
that sampled the span: "<model>:<load>" (the base: load 0; an adapter: the count of adapter loads when it was
loaded, new on every reload), one span per choice (the scheduler never switches adapters inside a request).

Accepted and without effect here (documented in docs/serving.md): `cache_salt` (this server keeps no prefix cache
across requests: nothing to salt), `priority` 0, `flat_logprobs`, `extra_args`, `detokenize`. Refused with a 400
naming the field: streaming, multimodal `features` / `content_parts`, prompt logprobs, and any other field."""

from __future__ import annotations

import asyncio
import os
import time

from nemo_jax.serve.openai import APIError, Options as ChatOptions, Prompt, Sample, chat_logprobs, cut_at_stop, fields

# sampling_params of vLLM's SamplingParams this server applies (`openai.sampling` reads the sampling ones)
_SAMPLING = {"n", "temperature", "top_p", "top_k", "min_p", "seed", "max_tokens", "min_tokens", "stop",
             "stop_token_ids", "ignore_eos", "presence_penalty", "frequency_penalty", "repetition_penalty",
             "logit_bias", "logprobs", "skip_special_tokens", "include_stop_str_in_output"}
# accepted only at the value that changes nothing (None is always fine)
_NEUTRAL = {"prompt_logprobs": 0, "spaces_between_special_tokens": True, "bad_words": [], "allowed_token_ids": [],
            "truncate_prompt_tokens": -1}
_INERT = {"flat_logprobs", "extra_args", "detokenize", "output_kind"}
_BODY = {"model", "token_ids", "sampling_params", "request_id", "cache_salt", "priority", "return_token_ids",
         "output_mode", "stream", "stream_options", "features", "content_parts", "kv_transfer_params",
         "ec_transfer_params", "reasoning_ended", "reasoning_parser_kwargs", "token_offsets"}
_REFUSED = {"stream": "streaming (stream: true) is not served on this route; use /v1/completions with token ids",
            "stream_options": "stream_options need streaming, which this route does not serve",
            "features": "multimodal features are not served on this route; send images to /v1/chat/completions",
            "content_parts": "multimodal content_parts are not served on this route; send images to "
                             "/v1/chat/completions",
            "kv_transfer_params": "disaggregated serving (kv_transfer_params) is not supported",
            "ec_transfer_params": "disaggregated serving (ec_transfer_params) is not supported"}
MAX_LOGPROBS = 20  # vLLM's default --max-logprobs
PREFIX = "generate-tokens-"  # vLLM's request ids on this route


def _error(message: str, key: str) -> APIError:
    return APIError(message, param=key)


def check_body(body: dict) -> None:
    """The rule for fields: unknown -> 400; known but not served -> 400 saying why; neutral values pass."""
    for k, v in body.items():
        if k not in _BODY:
            raise _error(f"Unrecognized request argument supplied: {k}", k)
        if k in _REFUSED and v not in (None, False, [], {}):
            raise _error(_REFUSED[k], k)
    sp = body.get("sampling_params")
    if not isinstance(sp, dict):
        raise _error("'sampling_params' must be an object (vLLM's SamplingParams)", "sampling_params")
    for k, v in sp.items():
        if k in _SAMPLING or k in _INERT or v is None:
            continue
        if k not in _NEUTRAL:
            raise _error(f"Unrecognized sampling parameter supplied: sampling_params.{k}", f"sampling_params.{k}")
        if v != _NEUTRAL[k]:
            raise _error(f"'sampling_params.{k}'={v!r:.60} is not supported by nemo-jax serve (only the value that "
                         "changes nothing is accepted)", f"sampling_params.{k}")
    f = fields(body)
    if f.integer("priority", 0, -2 ** 63, 2 ** 63 - 1) != 0:
        raise _error("'priority' other than 0 needs priority scheduling, which nemo-jax serve does not do", "priority")
    salt = body.get("cache_salt")
    if salt is not None and not (isinstance(salt, str) and 1 <= len(salt) <= 1024):
        raise _error("'cache_salt' must be a string of 1 to 1024 characters", "cache_salt")
    if body.get("output_mode", "tokens") not in ("tokens", "text"):
        raise _error("'output_mode' must be 'tokens' or 'text'", "output_mode")
    rid = body.get("request_id")
    if rid is not None and not (isinstance(rid, str) and 0 < len(rid) <= 256):
        raise _error("'request_id' must be a string of 1 to 256 characters", "request_id")
    ids = body.get("token_ids")
    if not isinstance(ids, list) or not ids:
        raise _error("'token_ids' must be a non-empty list of token ids", "token_ids")


class Options:
    """What one generate request's response carries."""

    def __init__(self, body: dict):
        sp = fields(body["sampling_params"], "sampling_params.")
        self.logprobs = sp.integer("logprobs", None, 0, MAX_LOGPROBS)
        self.skip_special = sp.boolean("skip_special_tokens", True)
        self.include_stop = sp.boolean("include_stop_str_in_output", False)
        ids = sp.get("stop_token_ids")
        self.stop_token_ids = set(ids) if isinstance(ids, list) and all(isinstance(t, int) for t in ids) else set()
        self.ignore_eos = bool(sp.get("ignore_eos"))
        self.prompt_ids = bool(body.get("return_token_ids"))
        self.text = body.get("output_mode", "tokens") == "text"


def weight_version(model: str, adapter) -> str:
    """The label of the weights a request samples with: "<name>:<load>" (module docstring)."""
    return f"{model}:{adapter.version if adapter is not None else 0}"


def _entry(token: int, lp: float, rank: int | None) -> dict:
    return {"token_id": int(token), "token": f"token_id:{int(token)}", "logprob": max(float(lp), -9999.0),
            "rank": rank}


def token_logprobs(tokens: list[int], lps: list[float], tops, k: int) -> dict:
    """vLLM's generate-shaped logprobs of a turn: per token its entry (rank: 1-based among the step's
    alternatives, None beyond them) and `top_logprobs` = the sampled token, then the likeliest others, max(k, 1)
    in all. `tops`: per token [(id, logprob), ...] most likely first."""
    content = []
    for i, (t, lp) in enumerate(zip(tokens, lps)):
        top = list(tops[i]) if tops is not None and tops[i] is not None else []
        ids = [a for a, _ in top]
        head = _entry(t, lp, ids.index(t) + 1 if t in ids else None)
        others = [_entry(a, b, j + 1) for j, (a, b) in enumerate(top) if a != t]
        content.append(dict(head, top_logprobs=[head] + others[:max(k, 1) - 1]))
    return {"content": content}


def choice(tok, index: int, s: Sample, prompt: Prompt, opt: Options, version: str) -> tuple[dict, int]:
    """-> (one choice of the response, its completion tokens). `token_ids` keep every sampled token (a stop
    string's too); `text` (output_mode text) is cut at the stop string unless include_stop_str_in_output;
    stop_reason: the stop string or the request's stop token id that ended it (None on EOS, length, abort)."""
    _, _, text, hit = cut_at_stop(tok, s.tokens, s.logprobs, prompt.stop, opt.include_stop, opt.skip_special)
    tokens = [int(t) for t in s.tokens]
    reason, stop_reason = s.finish_reason, None
    if reason != "abort" and hit is not None:
        reason, stop_reason = "stop", hit
    elif reason == "stop" and tokens and tokens[-1] in opt.stop_token_ids and not (
            tokens[-1] in tok.eos_ids() and not opt.ignore_eos):  # (vLLM: the tokenizer's EOS first, reason None)
        stop_reason = tokens[-1]
    out = {"index": index, "finish_reason": reason, "stop_reason": stop_reason, "token_ids": tokens,
           "logprobs": None, "routed_experts": None, "sampling_mask": None,
           "weight_versions": [{"version": version, "start": 0, "end": len(tokens)}] if tokens else None}
    if opt.logprobs is not None and opt.text:
        out["logprobs"] = chat_logprobs(tok, tokens, s.logprobs, s.top,
                                        ChatOptions(logprobs=True, top_logprobs=opt.logprobs))
    elif opt.logprobs is not None:
        out["logprobs"] = token_logprobs(tokens, s.logprobs, s.top, opt.logprobs)
    if opt.text:
        out["text"] = text
    return out, len(tokens)


class TokenRoutes:
    """The two routes over a `ServerState` (its prompts, adapters and runner)."""

    def __init__(self, state):
        self.state = state
        self._running: dict[str, list[asyncio.Event]] = {}  # request id -> the abort events of its requests

    async def generate(self, request, body: dict) -> dict:
        state, runner = self.state, self.state.runner
        check_body(body)
        opt = Options(body)
        adapter = state.adapters.resolve(body.get("model"))
        model = body.get("model") or state.model_name
        prompt = await runner.off_loop(state.prompts.token_prompt, body["token_ids"], body["sampling_params"],
                                       MAX_LOGPROBS if opt.logprobs is not None else 0)
        rid = PREFIX + (request.headers.get("x-request-id") or body.get("request_id") or os.urandom(16).hex())
        so_far = [([], [], []) for _ in prompt.samples]  # per sample: tokens, logprobs, alternatives

        def progress(_k, i, toks, lps, top):
            so_far[i][0].extend(toks)
            so_far[i][1].extend(lps)
            so_far[i][2].extend(top if top is not None else [None] * len(toks))
        aborted = asyncio.Event()
        self._running.setdefault(rid, []).append(aborted)
        try:
            samples = await runner.run(request, [prompt], adapter, progress=progress, abort=aborted)
        finally:
            self._running[rid].remove(aborted)
            if not self._running[rid]:
                del self._running[rid]
        if samples is None:  # aborted: what each sample had drawn
            samples = [Sample(t, lp, "abort", tp if opt.logprobs is not None else None) for t, lp, tp in so_far]
        else:
            samples = samples[0]
        version = weight_version(model, adapter)
        choices, completion = [], 0
        for i, s in enumerate(samples):
            c, k = choice(state.prompts.tok, i, s, prompt, opt, version)
            choices.append(c)
            completion += k
        return {"request_id": rid, "model": model, "created": int(time.time()),
                "usage": {"prompt_tokens": len(prompt.tokens), "completion_tokens": completion,
                          "total_tokens": len(prompt.tokens) + completion, "prompt_tokens_details": None,
                          "completion_tokens_details": None},
                "prompt_logprobs": None, "prompt_token_id_logprobs": None,
                "prompt_token_ids": list(prompt.tokens) if opt.prompt_ids else None, "mm_placeholders": None,
                "metrics": None, "kv_transfer_params": None, "ec_transfer_params": None,
                "output_mode": "text" if opt.text else "tokens", "choices": choices}

    def abort(self, body: dict) -> None:
        """End the running requests of these ids (as given, or as this route names them); unknown ids are
        ignored (a request that finished meanwhile), as vLLM does."""
        ids = body.get("request_ids")
        if not isinstance(ids, list) or not all(isinstance(x, str) for x in ids):
            raise _error("Missing 'request_ids' in request body (a list of request ids)", "request_ids")
        for x in ids:
            for event in self._running.get(x, []) + self._running.get(PREFIX + x, []):
                event.set()
