"""`nemo-jax serve`: the FastAPI app over a `Scheduler` and the command that runs it with uvicorn.

Endpoints (the OpenAI API as vLLM serves it):

    POST /v1/chat/completions     messages (text and image_url parts), tools, n, temperature, top_p, top_k,
                                  max_tokens, stop, seed, logprobs/top_logprobs, return_token_ids, ...
    POST /v1/completions          prompt (text, token ids, or a list of either), the same sampling fields
    GET  /v1/models               the base model and every loaded adapter (`model` = an adapter's name selects it)
    POST /v1/load_lora_adapter    {"lora_name", "lora_path", "load_inplace"?}: a PEFT dir (peft or vllm layout)
                                  or a nemo-jax adapter checkpoint, loaded under that name
    POST /v1/unload_lora_adapter  {"lora_name"}
    POST /tokenize, /detokenize   as vLLM's (prompt or messages -> tokens; tokens -> text)
    GET  /health                  200 while the engine runs, 503 after it failed
    GET  /metrics                 Prometheus text: requests, tokens, running / waiting sequences, decode steps
"""


import asyncio
import itertools
import os
import threading
import time
from collections import Counter

from nemo_jax.extras import require
from nemo_jax.serve.openai import APIError, Options, Prompt, options, response, sampling, template_messages
from nemo_jax.serve.scheduler import Adapter, Job, Scheduler


class ServerState:
    """Model, tokenizer, adapters by name, the scheduler, and the request counters."""

    def __init__(self, cfg, params, tok, engine, *, model_name: str, max_len: int, bucket: int,
                 tokens_as_ids: bool = False, mesh=None):
        self.cfg, self.params, self.tok, self.model_name = cfg, params, tok, model_name
        self.max_len, self.bucket, self.tokens_as_ids, self.mesh = max_len, bucket, tokens_as_ids, mesh
        self.scheduler = Scheduler(engine, params, cfg, bucket=bucket)
        self.adapters: dict[str, Adapter] = {}
        self._versions = itertools.count(1)
        self._lock = threading.Lock()
        self.requests = Counter()  # (endpoint, status) -> requests
        self.tokens = Counter()  # prompt / generation
        self.latency = Counter()  # (endpoint) -> seconds, summed
        self.stop_ids = tuple(sorted({*cfg.eos_ids, *tok.eos_ids()}))
        self.started = time.time()

    # ------------------------------------------------------------------ adapters
    def load_adapter(self, name: str, path: str, replace: bool = False) -> Adapter:
        import jax
        import jax.numpy as jnp

        from nemo_jax.lora.peft import load_adapters_any

        if not isinstance(name, str) or not name or not isinstance(path, str) or not path:
            raise APIError("load_lora_adapter needs 'lora_name' and 'lora_path' strings")
        if name == self.model_name:
            raise APIError(f"the adapter name {name!r} is the base model's")
        with self._lock:
            if name in self.adapters and not replace:
                raise APIError(f"The lora adapter '{name}' has already been loaded (unload it, or pass "
                               "\"load_inplace\": true).")
        if not os.path.exists(path):
            raise APIError(f"{path}: no such adapter directory", status=404)
        try:
            tree = load_adapters_any(path, self.cfg)
        except (ValueError, FileNotFoundError) as e:
            raise APIError(f"{path}: {e}") from None
        put = jnp.asarray if self.mesh is None else (lambda x: jax.device_put(x, jax.sharding.NamedSharding(
            self.mesh, jax.sharding.PartitionSpec())))
        ad = Adapter(name, os.path.abspath(path), jax.tree.map(put, tree), next(self._versions))
        with self._lock:
            self.adapters[name] = ad
        return ad

    def unload_adapter(self, name: str) -> None:
        with self._lock:
            if name not in self.adapters:
                raise APIError(f"The lora adapter '{name}' cannot be found.", status=404)
            del self.adapters[name]  # (requests already accepted keep their copy)

    def resolve(self, model) -> Adapter | None:
        if model in (None, "", self.model_name):
            return None
        with self._lock:
            if model in self.adapters:
                return self.adapters[model]
        raise APIError(f"The model '{model}' does not exist.", status=404, param="model")

    def models(self) -> dict:
        card = lambda i, root, parent: {"id": i, "object": "model", "created": int(self.started),  # noqa: E731
                                        "owned_by": "nemo-jax", "root": root, "parent": parent,
                                        "max_model_len": self.max_len}
        with self._lock:
            ads = list(self.adapters.values())
        return {"object": "list", "data": [card(self.model_name, self.model_name, None)]
                + [card(a.name, a.path, self.model_name) for a in ads]}

    # ------------------------------------------------------------------ prompts
    def encode(self, text: str) -> list[int]:
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
        if not isinstance(kwargs, dict):
            raise APIError("'chat_template_kwargs' must be an object", param="chat_template_kwargs")
        cont = bool(body.get("continue_final_message"))
        try:
            text = self.tok.render(msgs, tools=tools or None,
                                   add_generation_prompt=bool(body.get("add_generation_prompt", True)) and not cont,
                                   **kwargs)
        except (DataError, TypeError, ValueError) as e:
            raise APIError(f"chat template: {e}", param="messages") from None
        eos = self.tok.eos_token
        if cont and eos and eos in text:  # the last message stays open: the model continues it
            text = text[: text.rfind(eos)]
        ids = self.encode(text)
        if not refs:
            return ids, []
        try:
            return widen_images(self.cfg, ids, refs)
        except ValueError as e:
            raise APIError(str(e), param="messages") from None

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
                raise APIError(f"prompt token {bad[0]!r} is not a token id of this model "
                               f"(vocabulary {self.cfg.vocab_size})", param="prompt")
        return out

    def prompt(self, tokens: list[int], images: list, body: dict, opt: Options) -> Prompt:
        samples, stop = sampling(body, len(tokens), self.max_len, self.bucket, self.stop_ids)
        return Prompt(tokens, images, samples, stop, opt.top_logprobs)

    # ------------------------------------------------------------------ requests
    async def run(self, prompts: list[Prompt], adapter: Adapter | None) -> list[list]:
        """Every prompt through the scheduler, awaited together -> each prompt's samples."""
        loop = asyncio.get_running_loop()
        futures = []
        for p in prompts:
            fut = loop.create_future()

            def done(result, fut=fut):
                loop.call_soon_threadsafe(_settle, fut, result)
            self.scheduler.submit(Job(p, adapter, done))
            futures.append(fut)
        out = []
        for fut in futures:
            result = await fut
            if isinstance(result, BaseException):
                raise result
            out.append(result)
        return out

    async def complete(self, body: dict, *, chat: bool) -> dict:
        if not isinstance(body, dict):
            raise APIError("the request body must be a JSON object")
        adapter = self.resolve(body.get("model"))
        opt = options(body, chat=chat, tokens_as_ids=self.tokens_as_ids)

        def prepare():
            if chat:
                ids, pics = self.chat_tokens(body)
                return [self.prompt(ids, pics, body, opt)]
            return [self.prompt(ids, [], body, opt) for ids in self.completion_prompts(body)]
        prompts = await asyncio.to_thread(prepare)
        samples = await self.run(prompts, adapter)
        self.tokens["prompt"] += sum(len(p.tokens) for p in prompts)
        self.tokens["generation"] += sum(len(s.tokens) for ss in samples for s in ss)
        return await asyncio.to_thread(response, self.tok, body.get("model") or self.model_name, prompts, samples,
                                       opt, chat=chat)

    def tokenize(self, body: dict) -> dict:
        if "messages" in body:
            ids, _ = self.chat_tokens(body)
        else:
            ids = self.completion_prompts({"prompt": body.get("prompt")})[0]
        return {"count": len(ids), "max_model_len": self.max_len, "tokens": ids}

    def metrics_text(self) -> str:
        """Prometheus text exposition (version 0.0.4)."""
        c = self.scheduler.counts()
        lines = []

        def metric(name, kind, help_, samples):
            lines.append(f"# HELP nemo_jax_{name} {help_}")
            lines.append(f"# TYPE nemo_jax_{name} {kind}")
            for labels, v in samples:
                lab = ",".join(f'{k}="{x}"' for k, x in labels.items())
                lines.append(f"nemo_jax_{name}{{{lab}}} {v}" if lab else f"nemo_jax_{name} {v}")
        metric("requests_total", "counter", "HTTP requests by endpoint and status code",
               [({"endpoint": e, "status": str(s)}, n) for (e, s), n in sorted(self.requests.items())])
        metric("request_seconds_total", "counter", "seconds spent serving requests, by endpoint",
               [({"endpoint": e}, round(v, 6)) for e, v in sorted(self.latency.items())])
        metric("prompt_tokens_total", "counter", "prompt tokens of finished requests", [({}, self.tokens["prompt"])])
        metric("generation_tokens_total", "counter", "tokens sampled",
               [({}, self.scheduler.metrics["generation_tokens"])])
        metric("num_requests_running", "gauge", "sequences in decode rows (sampling or about to)",
               [({}, c["running"])])
        metric("num_requests_waiting", "gauge", "sequences waiting for a decode row or an adapter switch",
               [({}, c["waiting"])])
        metric("decode_steps_total", "counter", "decode steps of the engine (each samples one token per busy row)",
               [({}, c["decode_steps"])])
        metric("adapter_switches_total", "counter", "times the engine changed adapter set (rows drained first)",
               [({}, self.scheduler.metrics["adapter_switches"])])
        metric("lora_adapters_loaded", "gauge", "adapters loaded by name", [({}, len(self.adapters))])
        return "\n".join(lines) + "\n"


def _settle(fut, result):
    if not fut.done():  # (a client that went away cancelled it)
        fut.set_result(result)


def make_app(state: ServerState):
    """The FastAPI app serving `state`."""
    require("fastapi", "serve", "nemo-jax serve")
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, PlainTextResponse, Response

    app = FastAPI(title="nemo-jax serve")

    @app.exception_handler(APIError)
    async def api_error(request, e: APIError):
        return JSONResponse(e.body(), status_code=e.status)

    @app.middleware("http")
    async def count(request: Request, call_next):
        t0 = time.perf_counter()
        resp = await call_next(request)
        state.requests[(request.url.path, resp.status_code)] += 1
        state.latency[request.url.path] += time.perf_counter() - t0
        return resp

    async def body_of(request: Request) -> dict:
        try:
            body = await request.json()
        except ValueError:
            raise APIError("the request body is not JSON") from None
        if not isinstance(body, dict):
            raise APIError("the request body must be a JSON object")
        return body

    @app.get("/health")
    async def health():
        if not state.scheduler.alive:
            return Response(status_code=503)
        return Response(status_code=200)

    @app.get("/v1/models")
    async def models():
        return state.models()

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await state.complete(await body_of(request), chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await state.complete(await body_of(request), chat=False)

    @app.post("/v1/load_lora_adapter")
    async def load_lora(request: Request):
        b = await body_of(request)
        name = b.get("lora_name")
        await asyncio.to_thread(state.load_adapter, name, b.get("lora_path"), bool(b.get("load_inplace")))
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora(request: Request):
        name = (await body_of(request)).get("lora_name")
        state.unload_adapter(name)
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")

    @app.post("/tokenize")
    async def tokenize(request: Request):
        return await asyncio.to_thread(state.tokenize, await body_of(request))

    @app.post("/detokenize")
    async def detokenize(request: Request):
        b = await body_of(request)
        ids = b.get("tokens")
        if not isinstance(ids, list) or not all(isinstance(t, int) for t in ids):
            raise APIError("'tokens' must be a list of token ids", param="tokens")
        return {"prompt": state.tok.tokenizer.decode(ids, skip_special_tokens=False)}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(state.metrics_text(), media_type="text/plain; version=0.0.4")

    return app


# ----------------------------------------------------------------------------- the command
def cli_serve(a, adapters: dict[str, str]) -> None:
    """`nemo-jax serve` (arguments checked by the CLI; `adapters`: {name: dir} from --adapters)."""
    require("fastapi", "serve", "nemo-jax serve")
    require("uvicorn", "serve", "nemo-jax serve")
    import jax
    import uvicorn

    from nemo_jax.config.train import cast_dtype
    from nemo_jax.data.chat import ChatTokenizer
    from nemo_jax.generate import Engine, SamplingParams, load_for_generation

    mesh = None
    if a.mesh:
        from nemo_jax.parallel.mesh import make_mesh, read_mesh_sizes

        sizes = read_mesh_sizes(a.mesh)
        mesh = make_mesh(sizes, devices_per_node=sizes.pop("devices_per_node", 0))
    cfg, params, tok_dir = load_for_generation(a.ckpt, mesh=mesh, dtype=cast_dtype(a.dtype))
    tok = ChatTokenizer.load(a.tokenizer or tok_dir)
    engine = Engine(params, cfg, batch=a.max_num_seqs, max_len=a.max_model_len, bucket=a.bucket,
                    check_every=a.check_every, key=jax.random.key(a.seed))
    name = a.served_model_name or os.path.basename(os.path.normpath(a.ckpt))
    state = ServerState(cfg, params, tok, engine, model_name=name, max_len=a.max_model_len, bucket=a.bucket,
                        tokens_as_ids=a.return_tokens_as_token_ids, mesh=mesh)
    for n, path in adapters.items():
        state.load_adapter(n, path)
    # compile the common path once before the first request (a one-token greedy prompt)
    done = threading.Event()
    state.scheduler.submit(Job(Prompt([0], [], [SamplingParams(max_new_tokens=1, temperature=0.0)]), None,
                               lambda r: done.set()))
    done.wait()
    print(f"nemo-jax serve: {name} ({len(adapters)} adapter(s)) on http://{a.host}:{a.port}/v1 "
          f"({a.max_num_seqs} rows x {a.max_model_len} positions)", flush=True)
    uvicorn.run(make_app(state), host=a.host, port=a.port, log_level=a.log_level)
    state.scheduler.close()
