"""`nemo-jax serve`: the FastAPI app over a `Scheduler`, the ASGI guard in front of it, and the command that runs
them with uvicorn.

Endpoints (the OpenAI API as vLLM serves it):

    POST /v1/chat/completions     messages (text and image_url parts), tools, n, sampling fields, penalties,
                                  logprobs/top_logprobs, return_token_ids, stream (server-sent events), ...
    POST /v1/completions          prompt (text, token ids, or a list of either), the same sampling fields
    GET  /v1/models               the base model and every loaded adapter (`model` = an adapter's name selects it)
    POST /v1/load_lora_adapter    {"lora_name", "lora_path", "load_inplace"?}: a PEFT dir (peft or vllm layout)
                                  or a nemo-jax adapter checkpoint under an --adapter-root, loaded under that name
                                  (only with --enable-runtime-lora-updating)
    POST /v1/unload_lora_adapter  {"lora_name"}
    POST /tokenize, /detokenize   as vLLM's (prompt or messages -> tokens; tokens -> text)
    GET  /health                  200 while the engine runs and the server takes requests, else 503 (no API key)
    GET  /metrics                 Prometheus text (nemo_jax.serve.metrics)

`Guard`, in front of everything: the API key (a bearer token on every route but /health), the request size limit
(before a byte of the body is parsed), the request counts by route, and a JSON 500 for whatever escapes a route
(the connection stays usable).
"""


import asyncio
import functools
import hmac
import itertools
import os
import signal
import stat
import sys
import threading
import time
import traceback
from concurrent.futures import ThreadPoolExecutor

from nemo_jax.extras import require
from nemo_jax.serve.metrics import Metrics
from nemo_jax.serve.openai import (SSE_DONE, APIError, ChoiceStream, Prompt, check_fields, check_text, local_image,
                                   options, response, sampling, sse, template_messages, token_bytes, usage)
from nemo_jax.serve.scheduler import Adapter, Job, Scheduler
from nemo_jax.threads import DaemonPool

ADAPTER_LOAD_TIMEOUT_S = 300.0
MEDIA_READ_TIMEOUT_S = 30.0  # one local image file read, at most (a slow or stuck file: 503, its thread replaced)
HEALTH_PROBE_S = 2.0  # /health is 503 when the request threads cannot take a call within this


class ServerState:
    """Model, tokenizer, adapters by name, the scheduler, and the server's limits.

    `adapter_roots`: folders runtime adapter loading may read (None: runtime loading is off); `media_roots`:
    folders local images may be read from (`--allowed-local-media-path`); `request_timeout`: seconds a request may
    take (0: no limit)."""

    def __init__(self, cfg, params, tok, engine, *, model_name: str, max_len: int, bucket: int,
                 tokens_as_ids: bool = False, mesh=None, max_waiting: int = 256, adapter_roots=None,
                 media_roots=(), request_timeout: float = 0.0, vocab_bytes=None, max_media_bytes: int = 32 << 20):
        self.cfg, self.params, self.tok, self.model_name = cfg, params, tok, model_name
        self.max_len, self.bucket, self.tokens_as_ids, self.mesh = max_len, bucket, tokens_as_ids, mesh
        self.metrics = Metrics()
        self.fatal: BaseException | None = None
        self.on_fatal = None  # (exception) -> None: set by `serve` (the process exits)
        self.scheduler = Scheduler(engine, max_waiting=max_waiting, metrics=self.metrics, on_fatal=self._fatal)
        self.adapters: dict[str, Adapter] = {}
        self._loading: set[str] = set()  # names being loaded now (a second load of one name is refused)
        self._versions = itertools.count(1)
        self._lock = threading.Lock()
        self.adapter_roots = None if adapter_roots is None else [os.path.realpath(r) for r in adapter_roots]
        self.media_roots = [os.path.realpath(r) for r in media_roots]
        self.request_timeout = request_timeout
        self._adapter_io = ThreadPoolExecutor(1, thread_name_prefix="adapter-io")  # never the shared executor
        # requests' CPU work off the event loop (templates, tokenising, pictures, responses) and local image reads,
        # on daemon threads (nemo_jax.threads: a stuck call never keeps a stopped server alive); a read past
        # MEDIA_READ_TIMEOUT_S is given up and its thread replaced, so stuck files never take the request threads
        self.work = DaemonPool(16, "serve")
        self.media_io = DaemonPool(4, "media-io")
        self.max_media_bytes = max_media_bytes
        self.stop_ids = tuple(sorted({*cfg.eos_ids, *tok.eos_ids()}))
        longest = max((len(b) for b in vocab_bytes), default=1) if vocab_bytes else 64
        self.max_prompt_bytes = max_len * max(longest, 1) + 4096  # more text than this cannot fit max_len tokens
        self.started = time.time()
        self.compiles = None  # a warmup.CompileCounter from ready on (serve): compiles on a request's path

    def next_version(self) -> int:
        """A new adapter version (the scheduler tells adapter sets apart by it): for adapters of other services."""
        with self._lock:
            return next(self._versions)

    def _fatal(self, e: BaseException) -> None:
        self.fatal = e
        if self.on_fatal is not None:
            self.on_fatal(e)

    # ------------------------------------------------------------------ adapters
    def _confine(self, path) -> str:
        """A runtime-loaded adapter's path -> its real path under an --adapter-root (the same answer whether or
        not the path exists)."""
        if self.adapter_roots is None:
            raise APIError("runtime LoRA updating is off (start the server with --enable-runtime-lora-updating "
                           "and --adapter-root DIR)", status=404)
        if not isinstance(path, str) or not path or "\0" in path:
            raise APIError("'lora_path' must be a non-empty string", param="lora_path")
        if ".." in path.replace("\\", "/").split("/"):
            raise APIError("'lora_path' may not contain '..'", param="lora_path")
        real = os.path.realpath(os.path.abspath(path))
        if not any(os.path.commonpath([real, r]) == r for r in self.adapter_roots):
            raise APIError("'lora_path' is not under an --adapter-root of this server", param="lora_path")
        return real

    def _check_tree(self, real: str) -> None:
        """The adapter dir holds only regular files and folders inside the roots (no FIFO, socket or device to
        block on, no link out)."""
        if not os.path.isdir(real):
            raise APIError("no adapter directory at 'lora_path'", status=404, param="lora_path")
        seen = 0
        for top, dirs, files in os.walk(real):
            for name in dirs + files:
                seen += 1
                p = os.path.join(top, name)
                r = os.path.realpath(p)
                if self.adapter_roots is not None and not any(os.path.commonpath([r, x]) == x
                                                              for x in self.adapter_roots):
                    raise APIError(f"{os.path.relpath(p, real)}: a link out of the --adapter-root", param="lora_path")
                mode = os.stat(r).st_mode
                if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
                    raise APIError(f"{os.path.relpath(p, real)}: not a regular file", param="lora_path")
            if seen > 10000:
                raise APIError("the adapter directory holds more than 10000 entries", param="lora_path")

    def _read_adapter(self, name: str, path: str, root_checked: bool) -> Adapter:
        import jax
        import jax.numpy as jnp
        from safetensors import SafetensorError

        from nemo_jax.lora.peft import load_adapters_any

        if root_checked:
            self._check_tree(path)
        elif not os.path.exists(path):
            raise APIError(f"{path}: no such adapter directory", status=404)
        try:
            tree = load_adapters_any(path, self.cfg)
        except (ValueError, KeyError, TypeError, AttributeError, IndexError, OSError, SafetensorError) as e:
            where = path if not root_checked else "'lora_path'"
            raise APIError(f"{where}: not an adapter this server can load ({type(e).__name__}: {e})"[:500],
                           param="lora_path") from None
        put = jnp.asarray if self.mesh is None else (lambda x: jax.device_put(x, jax.sharding.NamedSharding(
            self.mesh, jax.sharding.PartitionSpec())))
        return Adapter(name, path, jax.tree.map(put, tree), next(self._versions))

    def _reserve(self, name, replace: bool) -> None:
        if not isinstance(name, str) or not name or len(name) > 256:
            raise APIError("'lora_name' must be a non-empty string (at most 256 characters)", param="lora_name")
        if name == self.model_name:
            raise APIError(f"the adapter name {name!r} is the base model's", param="lora_name")
        with self._lock:
            if name in self._loading:
                raise APIError(f"The lora adapter '{name}' is being loaded by another request.", param="lora_name")
            if name in self.adapters and not replace:
                raise APIError(f"The lora adapter '{name}' has already been loaded (unload it, or pass "
                               "\"load_inplace\": true).", param="lora_name")
            self._loading.add(name)

    def load_adapter(self, name: str, path: str) -> Adapter:
        """An adapter the operator named (--adapters): loaded now, from anywhere."""
        self._reserve(name, False)
        try:
            ad = self._read_adapter(name, os.path.abspath(path), False)
            with self._lock:
                self.adapters[name] = ad
            return ad
        finally:
            with self._lock:
                self._loading.discard(name)

    async def load_adapter_at_runtime(self, name, path, replace: bool) -> Adapter:
        """POST /v1/load_lora_adapter: gated, confined to the roots, one load per name at a time, the file I/O on
        its own thread (a stuck read holds up adapter loads, never chat)."""
        real = self._confine(path)
        self._reserve(name, replace)
        try:
            loop = asyncio.get_running_loop()
            try:
                ad = await asyncio.wait_for(loop.run_in_executor(self._adapter_io, self._read_adapter, name, real,
                                                                 True), ADAPTER_LOAD_TIMEOUT_S)
            except asyncio.TimeoutError:
                raise APIError(f"loading the adapter did not finish within {ADAPTER_LOAD_TIMEOUT_S:.0f} s",
                               status=503) from None
            with self._lock:
                self.adapters[name] = ad
            return ad
        finally:
            with self._lock:
                self._loading.discard(name)

    def unload_adapter(self, name) -> None:
        if self.adapter_roots is None:
            raise APIError("runtime LoRA updating is off (start the server with --enable-runtime-lora-updating)",
                           status=404)
        if not isinstance(name, str):
            raise APIError("'lora_name' must be a string", param="lora_name")
        with self._lock:
            if name not in self.adapters:
                raise APIError(f"The lora adapter '{name}' cannot be found.", status=404, param="lora_name")
            del self.adapters[name]  # (requests already accepted keep their copy)

    def resolve(self, model) -> Adapter | None:
        if model is not None and not isinstance(model, str):
            raise APIError("'model' must be a string", param="model")
        if model in (None, "", self.model_name):
            return None
        with self._lock:
            if model in self.adapters:
                return self.adapters[model]
        raise APIError(f"The model '{model[:200]}' does not exist.", status=404, param="model")

    def models(self) -> dict:
        card = lambda i, root, parent: {"id": i, "object": "model", "created": int(self.started),  # noqa: E731
                                        "owned_by": "nemo-jax", "root": root, "parent": parent,
                                        "max_model_len": self.max_len}
        with self._lock:
            ads = list(self.adapters.values())
        return {"object": "list", "data": [card(self.model_name, self.model_name, None)]
                + [card(a.name, a.path, self.model_name) for a in ads]}

    # ------------------------------------------------------------------ prompts
    def encode(self, text: str, what: str = "prompt") -> list[int]:
        if len(text) > self.max_prompt_bytes or len(text.encode()) > self.max_prompt_bytes:
            raise APIError(f"This model's maximum context length is {self.max_len} tokens; the {what} text is longer "
                           f"than any {self.max_len} tokens can spell", param=what)
        return self.tok.tokenizer.encode(text, add_special_tokens=False).ids

    def chat_tokens(self, body: dict) -> tuple[list[int], list]:
        """A chat request's messages (and tools) through the chat template -> (token ids, pictures)."""
        from nemo_jax.data.chat import DataError
        from nemo_jax.generate import widen_images

        msgs, refs = template_messages(body.get("messages"), self.cfg.vision is not None)
        tools = body.get("tools")
        if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
            raise APIError("'tools' must be a list of tool definitions", param="tools")
        kwargs = body.get("chat_template_kwargs") or {}
        if not isinstance(kwargs, dict) or not all(isinstance(k, str) and k.isidentifier() for k in kwargs):
            raise APIError("'chat_template_kwargs' must be an object of names", param="chat_template_kwargs")
        cont = bool(body.get("continue_final_message"))
        text_len = sum(len(m["content"]) for m in msgs if isinstance(m.get("content"), str))
        if text_len > self.max_prompt_bytes:
            raise APIError(f"This model's maximum context length is {self.max_len} tokens; the messages are longer "
                           f"than any {self.max_len} tokens can spell", param="messages")
        try:
            text = self.tok.render(msgs, tools=tools or None,
                                   add_generation_prompt=bool(body.get("add_generation_prompt", True)) and not cont,
                                   **kwargs)
        except (DataError, TypeError, ValueError, KeyError, AttributeError) as e:
            raise APIError(f"chat template: {e}", param="messages") from None
        eos = self.tok.eos_token
        if cont and eos and eos in text:  # the last message stays open: the model continues it
            text = text[: text.rfind(eos)]
        ids = self.encode(text, "messages")
        if not refs:
            return ids, []
        pics = [self.picture(r) for r in refs]
        try:
            return widen_images(self.cfg, ids, pics)
        except ValueError as e:
            raise APIError(str(e), param="messages") from None

    def picture(self, ref: str):
        """An image part's reference -> RGB PIL image. A local file: only under --allowed-local-media-path, a
        regular file (a FIFO is refused, never opened), at most --max-request-mb, read within
        MEDIA_READ_TIMEOUT_S; any picture of more than `MAX_IMAGE_PIXELS` is refused from its header."""
        import concurrent.futures

        from nemo_jax.data.images import ImageError, load_image, open_image, read_image_file

        try:
            if ref.startswith("data:"):
                return load_image(ref)
            real = local_image(ref, self.media_roots)
            fut = self.media_io.submit(read_image_file, real, self.max_media_bytes)
            try:
                data = fut.result(timeout=MEDIA_READ_TIMEOUT_S)
            except concurrent.futures.TimeoutError:
                if not fut.cancel():
                    self.media_io.add_thread()  # (the stuck read keeps its thread)
                raise APIError(f"{ref[:120]}: reading the image did not finish within {MEDIA_READ_TIMEOUT_S:g} s",
                               status=503, param="messages") from None
            return open_image(data, ref[:120])
        except ImageError as e:
            raise APIError(str(e)[:500], param="messages") from None

    async def off_loop(self, fn, *args):
        """fn(*args) on the request threads, within --request-timeout (503 past it)."""
        fut = asyncio.get_running_loop().run_in_executor(self.work, fn, *args)
        try:
            return await asyncio.wait_for(fut, self.request_timeout or None)
        except asyncio.TimeoutError:
            raise APIError(f"the request did not finish within {self.request_timeout:g} s (--request-timeout)",
                           status=503) from None

    async def serving(self) -> bool:
        """Whether requests can be served now: the engine runs, the server is not draining, and the request
        threads take a call within HEALTH_PROBE_S."""
        if not self.scheduler.alive or self.scheduler.draining:
            return False
        try:
            await asyncio.wait_for(asyncio.get_running_loop().run_in_executor(self.work, int), HEALTH_PROBE_S)
            return True
        except asyncio.TimeoutError:
            return False

    def completion_prompts(self, body: dict) -> list[list[int]]:
        p = body.get("prompt")
        if isinstance(p, str):
            out = [self.encode(p)]
        elif isinstance(p, list) and p and all(isinstance(x, int) and not isinstance(x, bool) for x in p):
            out = [list(p)]
        elif isinstance(p, list) and p and all(isinstance(x, str) for x in p):
            out = [self.encode(x) for x in p]
        elif isinstance(p, list) and p and all(isinstance(x, list) for x in p):
            out = [list(x) for x in p]
        else:
            raise APIError("'prompt' must be a string, a list of token ids, or a list of either", param="prompt")
        for x in out:
            if not x:
                raise APIError("a prompt is empty", param="prompt")
            bad = [t for t in x if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < self.cfg.vocab_size]
            if bad:
                raise APIError(f"prompt token {bad[0]!r:.40} is not a token id of this model "
                               f"(vocabulary {self.cfg.vocab_size})", param="prompt")
        return out

    def prompt(self, tokens: list[int], images: list, body: dict, top_logprobs: int) -> Prompt:
        samples, stop = sampling(body, len(tokens), self.max_len, self.bucket, self.stop_ids, self.cfg.vocab_size,
                                 top_logprobs)
        return Prompt(tokens, images, samples, stop)

    # ------------------------------------------------------------------ requests
    async def complete(self, request, body: dict, *, chat: bool):
        check_fields(body, "chat" if chat else "completions")
        adapter = self.resolve(body.get("model"))
        opt = options(body, chat=chat, tokens_as_ids=self.tokens_as_ids)

        def prepare():
            if chat:
                ids, pics = self.chat_tokens(body)
                return [self.prompt(ids, pics, body, opt.top_logprobs)]
            return [self.prompt(ids, [], body, opt.top_logprobs) for ids in self.completion_prompts(body)]
        prompts = await self.off_loop(prepare)
        model = body.get("model") or self.model_name
        if opt.stream:
            return self._stream(request, prompts, adapter, opt, chat, model)
        samples = await self._run(request, prompts, adapter)
        return await self.off_loop(functools.partial(response, self.tok, model, prompts, samples, opt, chat=chat))

    def _jobs(self, prompts: list[Prompt], adapter, progress=None) -> tuple[list[Job], list]:
        """Jobs of the prompts, submitted together (all or none), each with a future its result settles."""
        loop = asyncio.get_running_loop()
        jobs, futures = [], []
        for k, p in enumerate(prompts):
            fut = loop.create_future()

            def done(result, fut=fut):
                loop.call_soon_threadsafe(_settle, fut, result)
            jobs.append(Job(p, adapter, done, None if progress is None else
                            (lambda i, t, lp, top, k=k: loop.call_soon_threadsafe(progress, k, i, t, lp, top))))
            futures.append(fut)
        self.scheduler.submit(*jobs)
        return jobs, futures

    def _cancel(self, jobs: list[Job], why: str) -> None:
        if any([self.scheduler.cancel(j) for j in jobs]):
            self.metrics.events[why] += 1

    async def _run(self, request, prompts: list[Prompt], adapter) -> list[list]:
        """Every prompt through the scheduler -> each prompt's samples. A client that goes away, or the request
        timeout, cancels them (their rows are freed at once)."""
        jobs, futures = self._jobs(prompts, adapter)
        results = asyncio.gather(*futures, return_exceptions=True)  # (a cancelled one: no unretrieved exception)
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            done, _ = await asyncio.wait([results, gone], timeout=self.request_timeout or None,
                                         return_when=asyncio.FIRST_COMPLETED)
            if results in done:
                out = results.result()
                for r in out:
                    if isinstance(r, asyncio.CancelledError):
                        raise _ClientGone()
                    if isinstance(r, BaseException):
                        raise r
                return out
            if gone in done:
                self._cancel(jobs, "cancelled")
                raise _ClientGone()
            self._cancel(jobs, "timed_out")
            raise APIError(f"the request did not finish within {self.request_timeout:g} s (--request-timeout)",
                           status=503)
        finally:
            gone.cancel()
            for f in futures:  # (the gather then ends with their CancelledErrors as results, nothing unretrieved)
                f.cancel()
            self._cancel(jobs, "cancelled")

    def _stream(self, request, prompts: list[Prompt], adapter, opt, chat: bool, model: str):
        """A streamed request: its jobs submitted now (a 429 is an HTTP error, not a stream), the chunks as the
        engine samples them."""
        events: asyncio.Queue = asyncio.Queue()
        jobs, futures = self._jobs(prompts, adapter, progress=lambda *a: events.put_nowait(("tokens",) + a))
        for k, fut in enumerate(futures):
            fut.add_done_callback(lambda f, k=k: events.put_nowait(("done", k, f)))
        timeout = self.request_timeout

        async def chunks():
            n = len(prompts[0].samples)
            streams = [[ChoiceStream(self.tok, k * n + i, p, opt, chat=chat) for i in range(n)]
                       for k, p in enumerate(prompts)]
            rid = f"{'chatcmpl' if chat else 'cmpl'}-{os.urandom(16).hex()}"
            created, prompt_tokens = int(time.time()), sum(len(p.tokens) for p in prompts)

            def chunk(choices, **extra):
                c = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
                     "created": created, "model": model, "choices": choices}
                if opt.include_usage or opt.continuous_usage:
                    c["usage"] = None
                if opt.continuous_usage and choices:
                    c["usage"] = usage(prompt_tokens, sum(s.sent_tokens for ss in streams for s in ss))
                c.update(extra)
                return sse(c)
            for k, ss in enumerate(streams):
                for s in ss:
                    first = s.first()
                    if first is not None:
                        extra = {"prompt_token_ids": list(prompts[k].tokens)} if opt.token_ids and k == 0 else {}
                        yield chunk([first], **extra)
            left = len(prompts)
            deadline = time.monotonic() + timeout if timeout else None
            try:
                while left:
                    wait = None if deadline is None else max(deadline - time.monotonic(), 0.0)
                    try:
                        item = await asyncio.wait_for(events.get(), wait)
                    except asyncio.TimeoutError:
                        self._cancel(jobs, "timed_out")
                        raise APIError(f"the request did not finish within {timeout:g} s (--request-timeout)",
                                       status=503) from None
                    if item[0] == "tokens":
                        _, k, i, toks, lps, top = item
                        part = streams[k][i].add(toks, lps, top)
                        if part is not None:
                            yield chunk([part])
                        continue
                    _, k, fut = item
                    left -= 1
                    result = fut.result()
                    if isinstance(result, BaseException):
                        raise result
                    for s, sample in zip(streams[k], result):
                        for part in s.finish(sample):
                            yield chunk([part])
                if opt.include_usage:
                    yield chunk([], usage=usage(prompt_tokens, sum(s.completion_tokens for ss in streams
                                                                   for s in ss)))
            except APIError as e:
                yield sse(e.body())
            yield SSE_DONE

        return _closing_stream()(chunks(), on_close=lambda: self._cancel(jobs, "cancelled"),
                                 media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    def tokenize(self, body: dict) -> dict:
        if "messages" in body:
            ids, _ = self.chat_tokens(body)
        else:
            ids = self.completion_prompts({"prompt": body.get("prompt")})[0]
        return {"count": len(ids), "max_model_len": self.max_len, "tokens": ids}

    def detokenize(self, body: dict) -> dict:
        ids = body.get("tokens")
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool)
                                                and 0 <= t < self.cfg.vocab_size for t in ids):
            raise APIError(f"'tokens' must be a list of token ids in [0, {self.cfg.vocab_size})", param="tokens")
        return {"prompt": self.tok.tokenizer.decode(ids, skip_special_tokens=False)}

    def metrics_text(self) -> str:
        c = self.scheduler.counts()
        return self.metrics.render({
            "num_requests_running": ("sequences in decode rows (sampling or about to)", c["running"]),
            "num_requests_waiting": ("sequences waiting for a decode row or an adapter switch", c["waiting"]),
            "lora_adapters_loaded": ("adapters loaded by name", len(self.adapters)),
            "engine_alive": ("1 while the engine runs", int(self.scheduler.alive)),
            "compiles_since_ready": ("XLA programs compiled since the server said ready (a request met a shape or "
                                     "adapter structure the warm-up did not compile)",
                                     self.compiles.compiled if self.compiles is not None else 0)})


class _ClientGone(Exception):
    """The client closed the connection before its response."""


def _settle(fut, result):
    if not fut.done():  # (a client that went away cancelled it)
        fut.set_result(result)


async def _disconnected(request) -> None:
    """Returns when the client disconnects (the body has been read: the next message is the disconnect)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


@functools.cache
def _closing_stream():
    """A StreamingResponse that runs `on_close` however it ends (done, client gone, cancelled): a stream that
    never started still frees its jobs."""
    from starlette.responses import StreamingResponse

    class ClosingStream(StreamingResponse):
        def __init__(self, content, *, on_close, **kw):
            super().__init__(content, **kw)
            self.on_close = on_close

        async def __call__(self, scope, receive, send):
            try:
                await super().__call__(scope, receive, send)
            finally:
                self.on_close()
    return ClosingStream


# ----------------------------------------------------------------------------- the app and its guard
class _TooLarge(APIError):
    """A body that grew past the limit as it was read."""

    def __init__(self, limit: int):
        super().__init__(f"the request body is larger than {limit} bytes (--max-request-mb)", status=413)


class Guard:
    """The outermost ASGI layer (see the module docstring)."""

    def __init__(self, app, state: ServerState, *, api_key: str | None, max_body: int, routes: set[str]):
        from starlette.requests import ClientDisconnect

        self.app, self.state, self.max_body, self.routes = app, state, max_body, routes
        self.key = api_key.encode() if api_key else None
        self.gone = (ClientDisconnect, _ClientGone, ConnectionError)  # a client that left: counted, not logged

    async def _send_error(self, send, e: APIError) -> None:
        import json

        body = json.dumps(e.body()).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        headers += [(k.lower().encode(), str(v).encode()) for k, v in e.headers.items()]
        await send({"type": "http.response.start", "status": e.status, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    def _authorized(self, scope) -> bool:
        if scope.get("path", "").startswith("/api/v1/"):  # the Tinker API: X-API-Key, as the SDK sends it
            key = next((v for k, v in scope.get("headers", ()) if k == b"x-api-key"), b"")
            return hmac.compare_digest(key, self.key) or hmac.compare_digest(key, b"tml-" + self.key)
        for k, v in scope.get("headers", ()):
            if k == b"authorization":
                scheme, _, token = v.partition(b" ")
                return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.key)
        return False

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope.get("path", "")
        endpoint = path if path in self.routes else "other"
        t0, status, started = time.perf_counter(), [500], [False]

        async def sending(message):
            if message["type"] == "http.response.start":
                started[0], status[0] = True, message["status"]
            await send(message)
        try:
            if self.key is not None and path != "/health" and not self._authorized(scope):
                how = "X-API-Key: tml-<key>" if path.startswith("/api/v1/") else "Authorization: Bearer <key>"
                return await self._send_error(sending, APIError(
                    f"Unauthorized: a valid API key is needed ({how})", status=401,
                    headers={"WWW-Authenticate": "Bearer"}))
            length = next((v for k, v in scope.get("headers", ()) if k == b"content-length"), None)
            if length is not None and (not length.isdigit() or int(length) > self.max_body):
                return await self._send_error(sending, _TooLarge(self.max_body))
            got = [0]

            async def receiving():
                message = await receive()
                if message["type"] == "http.request":
                    got[0] += len(message.get("body", b""))
                    if got[0] > self.max_body:
                        raise _TooLarge(self.max_body)
                return message
            await self.app(scope, receiving, sending)
        except _TooLarge as e:
            if not started[0]:
                await self._send_error(sending, e)
        except self.gone:  # nobody to answer: counted as nginx counts a client that left (499)
            status[0] = 499
            self.state.metrics.events["disconnected"] += 1
        except Exception:  # a bug: logged, answered in OpenAI's shape, the connection kept
            traceback.print_exc()
            if not started[0]:
                await self._send_error(sending, APIError("internal server error", status=500))
        finally:
            self.state.metrics.request(endpoint, status[0], time.perf_counter() - t0)


def make_app(state: ServerState, *, api_key: str | None = None, max_body: int = 32 << 20, mount=None):
    """The ASGI app serving `state`: the FastAPI routes behind a `Guard`; `mount(app)` adds another service's
    routes (the Tinker API)."""
    require("fastapi", "serve", "nemo-jax serve")
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, PlainTextResponse, Response
    from starlette.exceptions import HTTPException

    app = FastAPI(title="nemo-jax serve", docs_url=None, redoc_url=None, openapi_url=None)

    def error(e: APIError):
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(APIError)
    async def api_error(request, e: APIError):
        return error(e)

    @app.exception_handler(HTTPException)
    async def http_error(request, e: HTTPException):
        return error(APIError(f"{e.detail}: {request.method} {request.url.path[:200]}", status=e.status_code))

    @app.exception_handler(_ClientGone)
    async def client_gone(request, e):
        return Response(status_code=499)  # (nobody reads it: counted as nginx counts a client that left)

    from starlette.requests import ClientDisconnect

    @app.exception_handler(ClientDisconnect)
    async def disconnected(request, e):  # the client left while its body was read: no log line, no 500
        state.metrics.events["disconnected"] += 1
        return Response(status_code=499)

    @app.exception_handler(Exception)
    async def internal(request, e: Exception):  # (Starlette re-raises it after: the Guard logs it)
        return error(APIError("internal server error", status=500))

    async def body_of(request: Request) -> dict:
        import json

        raw = await request.body()
        try:
            body = json.loads(raw)
        except (ValueError, RecursionError):
            raise APIError("the request body is not JSON") from None
        if not isinstance(body, dict):
            raise APIError("the request body must be a JSON object", status=422)
        check_text(body)
        return body

    @app.get("/health")
    async def health():
        return Response(status_code=200 if await state.serving() else 503)

    @app.get("/v1/models")
    async def models():
        return state.models()

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await state.complete(request, await body_of(request), chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await state.complete(request, await body_of(request), chat=False)

    @app.post("/v1/load_lora_adapter")
    async def load_lora(request: Request):
        b = await body_of(request)
        name = b.get("lora_name")
        await state.load_adapter_at_runtime(name, b.get("lora_path"), b.get("load_inplace") is True)
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora(request: Request):
        name = (await body_of(request)).get("lora_name")
        state.unload_adapter(name)
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")

    @app.post("/tokenize")
    async def tokenize(request: Request):
        return await state.off_loop(state.tokenize, await body_of(request))

    @app.post("/detokenize")
    async def detokenize(request: Request):
        return state.detokenize(await body_of(request))

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(state.metrics_text(), media_type="text/plain; version=0.0.4")

    if mount is not None:
        mount(app)
    routes = {r.path for r in app.routes}
    return Guard(app, state, api_key=api_key, max_body=max_body, routes=routes)


def bind(host: str, port: int):
    """The server's socket, bound now (not yet listening: a client is refused until the server is ready) -> a
    socket; ValueError naming the address when it is taken or not this host's. `nemo-jax serve` binds before it
    loads the model, so a taken port fails in a second, not after the load and the compiles."""
    import socket

    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise ValueError(f"--host {host}: {e.strerror or e}") from None
    family, kind, proto, _, addr = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # (as uvicorn: a restart reuses the port at once)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        sock.bind(addr)
    except OSError as e:
        sock.close()
        raise ValueError(f"--host {host} --port {port}: cannot listen there ({e.strerror or e}; is another server "
                         "on that port?)") from None
    sock.set_inheritable(True)
    return sock


def serve(state: ServerState, app, *, host: str, port: int, log_level: str = "warning",
          shutdown_timeout: float = 30.0, ready=None, sock=None) -> int:
    """Run the app with uvicorn until SIGTERM / SIGINT (-> 0: stop accepting, let running requests finish for up to
    `shutdown_timeout` seconds, cancel the rest) or the engine dies (-> 1: a supervisor restarts the server).
    `sock`: a socket from `bind` (default: uvicorn binds host:port); `ready(server)` is called once it accepts
    connections."""
    import uvicorn

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame):  # (draining; not re-raised at the end: the process exits 0)
            state.scheduler.draining = True
            if self.should_exit and sig == signal.SIGINT:
                self.force_exit = True
            self.should_exit = True

        async def startup(self, sockets=None):
            await super().startup(sockets)
            if ready is not None and not self.should_exit:
                ready(self)

    server = Server(uvicorn.Config(app, host=host, port=port, log_level=log_level,
                                   timeout_graceful_shutdown=shutdown_timeout))

    def fatal(e):
        state.scheduler.draining = True
        server.should_exit = True
    state.on_fatal = fatal
    if state.fatal is not None:
        return 1
    server.run(sockets=[sock] if sock is not None else None)
    state.scheduler.close()
    state.work.shutdown()
    state.media_io.shutdown()
    return 1 if state.fatal is not None else 0


# ----------------------------------------------------------------------------- the command
def cli_serve(a, adapters: dict[str, str]) -> None:
    """`nemo-jax serve` (arguments checked by the CLI; `adapters`: {name: dir} from --adapters)."""
    require("fastapi", "serve", "nemo-jax serve")
    require("uvicorn", "serve", "nemo-jax serve")
    sock = bind(a.host, a.port)  # a taken port fails now, before the model is loaded
    if a.host in ("0.0.0.0", "::", "") and not a.api_key:
        print(f"nemo-jax serve: warning: listening on every interface (--host {a.host}) without --api-key: anyone "
              "who can reach this port can use the model (set --api-key or NEMO_JAX_API_KEY)", file=sys.stderr,
              flush=True)
    import jax

    from nemo_jax.config.train import cast_dtype
    from nemo_jax.data.chat import ChatTokenizer
    from nemo_jax.generate import Engine, load_for_generation
    from nemo_jax.serve.warmup import cache_dir, compilation_cache

    cache = cache_dir(a.compilation_cache)
    compilation_cache(cache)  # (before the first compile)
    mesh = None
    if a.mesh:
        from nemo_jax.parallel.mesh import make_mesh, read_mesh_sizes

        sizes = read_mesh_sizes(a.mesh)
        mesh = make_mesh(sizes, devices_per_node=sizes.pop("devices_per_node", 0))
    cfg, params, tok_dir = load_for_generation(a.ckpt, mesh=mesh, dtype=cast_dtype(a.dtype))
    tok = ChatTokenizer.load(a.tokenizer or tok_dir)
    vocab = token_bytes(tok.tokenizer)
    engine = Engine(params, cfg, batch=a.max_num_seqs, max_len=a.max_model_len, bucket=a.bucket,
                    check_every=a.check_every, key=jax.random.key(a.seed), token_bytes=vocab)
    params = engine.params  # (the engine's copy, its layers one by one: the loaded stack can be freed)
    name = a.served_model_name or os.path.basename(os.path.normpath(a.ckpt))
    state = ServerState(cfg, params, tok, engine, model_name=name, max_len=a.max_model_len, bucket=a.bucket,
                        tokens_as_ids=a.return_tokens_as_token_ids, mesh=mesh, max_waiting=a.max_waiting_queue_length,
                        adapter_roots=a.adapter_root if a.enable_runtime_lora_updating else None,
                        media_roots=a.allowed_local_media_path, request_timeout=a.request_timeout, vocab_bytes=vocab,
                        max_media_bytes=int(a.max_request_mb * 2 ** 20))
    for n, path in adapters.items():
        try:
            state.load_adapter(n, path)
        except APIError as e:
            raise ValueError(f"--adapters {n}={path}: {e}") from None
    if not a.no_warmup:  # every program a request can run, compiled (or loaded from the cache) before ready
        from nemo_jax.serve.warmup import warm_up

        w = warm_up(engine, [ad.tree for ad in state.adapters.values()])
        print(f"nemo-jax serve: warm-up done in {w.seconds:.1f} s ({w.compiled} programs compiled, {w.loaded} loaded "
              f"from the compilation cache{' at ' + cache if cache else ': off'})", flush=True)
    from nemo_jax.serve.warmup import CompileCounter

    state.compiles = CompileCounter().__enter__()  # (for the server's life)
    tinker = None
    if getattr(a, "tinker_root", None):  # the Tinker API under /api/v1 (nemo_jax.tinker)
        from nemo_jax.tinker import start

        tinker = start(state, a, tok_dir)
    app = make_app(state, api_key=a.api_key, max_body=int(a.max_request_mb * 2 ** 20),
                   mount=None if tinker is None else tinker.mount)
    gates = [f"API key {'on' if a.api_key else 'off'}",
             f"runtime adapters {'under ' + ', '.join(a.adapter_root) if state.adapter_roots is not None else 'off'}"]
    if tinker is not None:
        gates.append(f"Tinker API on http://{a.host}:{a.port}/api/v1, state under {tinker.service.store.root}")
    line = (f"nemo-jax serve: {name} ({len(adapters)} adapter(s)) on http://{a.host}:{a.port}/v1 "
            f"({a.max_num_seqs} rows x {a.max_model_len} positions; {'; '.join(gates)})")
    code = serve(state, app, host=a.host, port=a.port, log_level=a.log_level, shutdown_timeout=a.shutdown_timeout,
                 sock=sock, ready=lambda server: print(line, flush=True))  # (said once the socket accepts)
    if code:
        e = state.fatal
        print(f"nemo-jax serve: the engine failed ({type(e).__name__}: {e}); exiting with status 1 so that a "
              "supervisor restarts the server", file=sys.stderr, flush=True)
        raise SystemExit(1)
    print("nemo-jax serve: stopped", flush=True)
