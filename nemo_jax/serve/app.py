"""The FastAPI app of `nemo-jax serve` and the ASGI guard in front of it, over a `ServerState`.

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
    POST /inference/v1/generate   vLLM's token-in / token-out route (nemo_jax.serve.tokens), and
    POST /inference/v1/abort_requests
    GET  /health                  200 while the engine runs and the server takes requests, else 503 (no API key)
    GET  /metrics                 Prometheus text (nemo_jax.serve.metrics)

`Guard`, in front of everything: the API key (a bearer token on every route but /health, or the header a mounted
service names for its routes), the request size limit (before a byte of the body is parsed), the request counts by
route, and a JSON 500 for whatever escapes a route (the connection stays usable). Other services over the same
engine (the Tinker API) add their routes through `make_app(services=...)`.
"""

import hmac
import time
import traceback
from typing import NamedTuple

from nemo_jax.extras import require
from nemo_jax.serve.adapters import AdapterRegistry
from nemo_jax.serve.metrics import Metrics
from nemo_jax.serve.openai import APIError, check_text
from nemo_jax.serve.prompts import PromptBuilder
from nemo_jax.serve.runner import ClientGone, CompletionRunner
from nemo_jax.serve.scheduler import Scheduler
from nemo_jax.serve.tokens import TokenRoutes


class ServerState:
    """What a served model is: its config, params and name, the scheduler over its engine, and the three parts
    requests go through: `adapters` (by name), `prompts` (requests -> prompts) and `runner` (prompts -> answers).

    `adapter_roots`: folders runtime adapter loading may read (None: runtime loading is off); `media_roots`:
    folders local images may be read from (`--allowed-local-media-path`); `request_timeout`: seconds a request may
    take (0: no limit)."""

    def __init__(self, cfg, params, tok, engine, *, model_name: str, max_len: int, bucket: int,
                 tokens_as_ids: bool = False, mesh=None, max_waiting: int = 256, adapter_roots=None,
                 media_roots=(), request_timeout: float = 0.0, vocab_bytes=None, max_media_bytes: int = 32 << 20):
        self.cfg, self.params, self.tok, self.model_name = cfg, params, tok, model_name
        self.max_len, self.bucket, self.mesh = max_len, bucket, mesh
        self.metrics = Metrics()
        self.fatal: BaseException | None = None
        self.on_fatal = None  # (exception) -> None: set by `serve` (the process exits)
        self.scheduler = Scheduler(engine, max_waiting=max_waiting, metrics=self.metrics, on_fatal=self._fatal)
        self.adapters = AdapterRegistry(cfg, model_name, mesh=mesh, adapter_roots=adapter_roots)
        self.prompts = PromptBuilder(cfg, tok, max_len=max_len, bucket=bucket, media_roots=media_roots,
                                     max_media_bytes=max_media_bytes, vocab_bytes=vocab_bytes)
        self.runner = CompletionRunner(self.scheduler, self.metrics, self.prompts, self.adapters,
                                       model_name=model_name, tokens_as_ids=tokens_as_ids,
                                       request_timeout=request_timeout)
        self.tokens = TokenRoutes(self)
        self.started = time.time()
        self.compiles = None  # a warmup.CompileCounter from ready on (serve): compiles on a request's path
        # over several processes (serve.replica): the Leader (process 0) or a Follower, and the followers' replays
        # of the services' units ({target: replay(method, args)}, filled by the services)
        self.replica = None
        self.replica_targets: dict = {}

    def _fatal(self, e: BaseException) -> None:
        self.fatal = e
        if self.on_fatal is not None:
            self.on_fatal(e)

    def models(self) -> dict:
        card = lambda i, root, parent: {"id": i, "object": "model", "created": int(self.started),  # noqa: E731
                                        "owned_by": "nemo-jax", "root": root, "parent": parent,
                                        "max_model_len": self.max_len}
        return {"object": "list", "data": [card(self.model_name, self.model_name, None)]
                + [card(a.name, a.path, self.model_name) for a in self.adapters.loaded()]}

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

    def close(self) -> None:
        self.scheduler.close()
        self.runner.close()
        self.prompts.close()


class KeyHeader(NamedTuple):
    """How a mounted service's clients send the API key: on paths under `prefix`, header `name` holding the key,
    after one of `value_prefixes` (e.g. the Tinker SDK's X-API-Key: tml-<key>)."""
    prefix: str
    name: bytes
    value_prefixes: tuple[bytes, ...] = (b"",)
    hint: str = ""


# ----------------------------------------------------------------------------- the app and its guard
class _TooLarge(APIError):
    """A body that grew past the limit as it was read."""

    def __init__(self, limit: int):
        super().__init__(f"the request body is larger than {limit} bytes (--max-request-mb)", status=413)


class Guard:
    """The outermost ASGI layer (see the module docstring)."""

    def __init__(self, app, state: ServerState, *, api_key: str | None, max_body: int, routes: set[str],
                 key_headers=()):
        from starlette.requests import ClientDisconnect

        self.app, self.state, self.max_body, self.routes = app, state, max_body, routes
        self.key = api_key.encode() if api_key else None
        self.key_headers = tuple(key_headers)
        self.gone = (ClientDisconnect, ClientGone, ConnectionError)  # a client that left: counted, not logged

    async def _send_error(self, send, e: APIError) -> None:
        import json

        body = json.dumps(e.body()).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        headers += [(k.lower().encode(), str(v).encode()) for k, v in e.headers.items()]
        await send({"type": "http.response.start", "status": e.status, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    def _key_header(self, path: str) -> KeyHeader | None:
        return next((h for h in self.key_headers if path.startswith(h.prefix)), None)

    def _authorized(self, scope) -> bool:
        h = self._key_header(scope.get("path", ""))
        if h is not None:  # a mounted service's own header
            key = next((v for k, v in scope.get("headers", ()) if k == h.name), b"")
            return any(hmac.compare_digest(key, p + self.key) for p in h.value_prefixes)
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
                h = self._key_header(path)
                how = h.hint if h is not None else "Authorization: Bearer <key>"
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


class Service(NamedTuple):
    """Another service over the served model (the Tinker API): `mount(app)` adds its routes; `key_header`: how its
    clients send the API key (None: a bearer token, as OpenAI clients); `line`: what the ready line says of it."""
    mount: object
    key_header: KeyHeader | None = None
    line: str = ""


def make_app(state: ServerState, *, api_key: str | None = None, max_body: int = 32 << 20, services=()):
    """The ASGI app serving `state`: the FastAPI routes behind a `Guard`, and each of `services`' routes."""
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

    @app.exception_handler(ClientGone)
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
        return Response(status_code=200 if await state.runner.serving() else 503)

    @app.get("/v1/models")
    async def models():
        return state.models()

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await state.runner.complete(request, await body_of(request), chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await state.runner.complete(request, await body_of(request), chat=False)

    @app.post("/v1/load_lora_adapter")
    async def load_lora(request: Request):
        b = await body_of(request)
        name = b.get("lora_name")
        await state.adapters.load_at_runtime(name, b.get("lora_path"), b.get("load_inplace") is True)
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora(request: Request):
        name = (await body_of(request)).get("lora_name")
        state.adapters.unload(name)
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")

    @app.post("/tokenize")
    async def tokenize(request: Request):
        return await state.runner.off_loop(state.prompts.tokenize, await body_of(request))

    @app.post("/detokenize")
    async def detokenize(request: Request):
        return state.prompts.detokenize(await body_of(request))

    @app.post("/inference/v1/generate")
    async def generate(request: Request):
        return await state.tokens.generate(request, await body_of(request))

    @app.post("/inference/v1/abort_requests")
    async def abort_requests(request: Request):
        state.tokens.abort(await body_of(request))
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(state.metrics_text(), media_type="text/plain; version=0.0.4")

    for svc in services:
        svc.mount(app)
    routes = {r.path for r in app.routes}
    return Guard(app, state, api_key=api_key, max_body=max_body, routes=routes,
                 key_headers=[svc.key_header for svc in services if svc.key_header is not None])
