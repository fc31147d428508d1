"""The Tinker API's HTTP routes under /api/v1, mounted on `nemo-jax serve`'s FastAPI app (`mount`), each written with
its full path.

Every endpoint SDK 0.38's training and sampling clients, RestClient lookups and the cookbook call (docs/tinker.md
lists them). Bodies are JSON except forward_backward's request and the ForwardBackwardOutput / SampleResponse
results (protobuf). A request's bad input is a 400 (or, for requests that hold a place in a model's seq_id order,
a failed future with category "user"); the API key (`X-API-Key`) is checked by serve's guard.
"""


import asyncio
import json

from nemo_jax.extras import require
from nemo_jax.fields import Fields
from nemo_jax.serve.openai import APIError
from nemo_jax.tinker import wire
from nemo_jax.tinker.losses import loss_config, refusal
from nemo_jax.tinker.sequencer import Kind
from nemo_jax.tinker.service import TinkerService
from nemo_jax.tinker.store import check_name
from nemo_jax.tinker.wire import UserError

CLIENT_CONFIG = {
    "pjwt_auth_enabled": False,  # the API key itself on every request (no JWT exchange)
    "use_pyqwest_transport": False,  # plain httpx
    "proto_compress_fwdbwd": False,
    "parallel_fwdbwd_chunks": True,
    "fwdbwd_max_chunk_len": 1024,
    "fwdbwd_max_chunk_bytes_count": 5_000_000,
    "sample_use_retrieve_futures": False,
    "sample_join_sampling_session": False,
    "custom_loss_server_side": False,  # forward_backward_custom runs the loss client-side
}
DYNAMIC_CONFIG = {"refresh_interval_sec": 300, "sample_cancel_enabled": False, "sample_cancel_max_batch_size": 64}
ADAM = {"learning_rate": 1e-4, "beta1": 0.9, "beta2": 0.95, "eps": 1e-12, "weight_decay": 0.0,
        "grad_clip_norm": 0.0}  # the SDK's AdamParams defaults


def _fields(body: dict, prefix: str = "") -> Fields:
    return Fields(body, lambda message, key: UserError(message), prefix)


def adam_params(body: dict) -> dict:
    """optim_step's parameters -> {name: float}, each checked."""
    p = body.get("adam_params") or body.get("optim_params")
    if p is None and body.get("optimizer_params") is not None:
        kind = body["optimizer_params"].get("type") if isinstance(body["optimizer_params"], dict) else None
        raise UserError(f"optimizer {str(kind)[:40]!r} is not supported by nemo-jax serve: use AdamParams")
    if not isinstance(p, dict):
        raise UserError("optim_step needs adam_params")
    f = _fields(p, "adam_params.")
    for k in ADAM:  # (JSON has no infinity or NaN: the SDK sends them as null, which is no default here)
        if k in p and p[k] is None:
            f.fail(k, "a finite number", p[k])
    out = {k: float(f.number(k, default, 0, float("inf"))) for k, default in ADAM.items()}  # finite, >= 0
    if out["beta1"] >= 1 or out["beta2"] >= 1:
        raise UserError(f"adam_params: betas in [0, 1) (got {out['beta1']}, {out['beta2']})")
    return out


def _ttl(body: dict):
    return _fields(body).integer("ttl_seconds", None, 1, 2 ** 63 - 1)


def _meta(body: dict) -> dict:
    m = _fields(body).mapping("user_metadata", most=256)
    return {str(k)[:256]: str(v)[:4096] for k, v in m.items()}


def mount(app, svc: TinkerService) -> None:
    """Add the /api/v1 routes to `app` (serve's FastAPI app)."""
    require("fastapi", "tinker", "the Tinker API (nemo-jax serve --tinker-root)")
    from fastapi import Request
    from fastapi.responses import JSONResponse, Response

    @app.exception_handler(UserError)
    async def user_error(request, e: UserError):  # (a client of another SDK version is told which one this is)
        hint = wire.version_hint(request.headers.get("x-sdk-version")) if "x-sdk-version" in request.headers else ""
        return JSONResponse(APIError(str(e) + hint).body(), status_code=400)

    async def body_of(request: Request) -> dict:
        raw = await request.body()
        try:
            body = json.loads(raw or b"{}")
        except (ValueError, RecursionError):
            raise UserError("the request body is not JSON") from None
        if not isinstance(body, dict):
            raise UserError("the request body must be a JSON object")
        return body

    def answer(x):
        return Response(x, media_type=wire.PROTO) if isinstance(x, bytes) else JSONResponse(x)

    # ---------------------------------------------------------------- client and session
    @app.post("/api/v1/client/config")
    async def client_config(request: Request):
        await body_of(request)
        return CLIENT_CONFIG

    @app.post("/api/v1/client/dynamic_config")
    async def dynamic_config(request: Request):
        return DYNAMIC_CONFIG

    @app.get("/api/v1/healthz")
    async def healthz():
        return {"status": "ok"}

    @app.get("/api/v1/stats")  # (nemo-jax's own: not an SDK call)
    async def stats():
        return svc.stats()

    @app.get("/api/v1/get_server_capabilities")
    async def capabilities():
        return svc.capabilities()

    @app.post("/api/v1/create_session")
    async def create_session(request: Request):
        return svc.create_session(await body_of(request))

    @app.post("/api/v1/session_heartbeat")
    async def heartbeat(request: Request):
        state = svc.heartbeat((await body_of(request)).get("session_id"))
        if state != "ok":
            raise APIError(f"session {state}", status=410 if state == "finished" else 404)
        return {"type": "session_heartbeat"}

    @app.post("/api/v1/telemetry")
    async def telemetry(request: Request):
        await request.body()
        return {"status": "accepted"}

    @app.post("/api/v1/sessions/{sid}/finish")
    async def finish(sid: str, request: Request):
        await request.body()
        svc.finish(sid)
        return {}

    # ---------------------------------------------------------------- training
    @app.post("/api/v1/create_model")
    async def create_model(request: Request):
        return await asyncio.to_thread(svc.create_model, await body_of(request))

    @app.post("/api/v1/get_info")
    async def get_info(request: Request):
        return svc.info((await body_of(request)).get("model_id"))

    @app.post("/api/v1/unload_model")
    async def unload_model(request: Request):
        return svc.unload((await body_of(request)).get("model_id"))

    @app.post("/api/v1/forward_backward")
    async def forward_backward(request: Request):
        if "protobuf" not in request.headers.get("content-type", ""):
            raise UserError(f"forward_backward takes a protobuf ForwardBackwardRequest (Content-Type: {wire.PROTO})")
        if request.headers.get("content-encoding"):
            raise UserError("forward_backward: compressed bodies are not taken (this server's client/config says "
                            "proto_compress_fwdbwd false)")
        body = await request.body()
        req = (wire.decode_forward_backward(body) if len(body) < 1 << 18 else  # (a big one off the loop)
               await asyncio.to_thread(wire.decode_forward_backward, body))
        why = refusal(req.loss_fn)
        cfg = None
        if why is None:
            try:
                cfg = loss_config(req.loss_fn, req.config)
            except ValueError as e:
                why = str(e)
        args = dict(data=req.data, loss_fn=req.loss_fn, config=cfg, forward_only=req.forward_only)
        merge = (req.loss_fn, tuple(sorted((cfg or {}).items())), req.forward_only)
        return svc.submit(req.model_id, req.seq_id, Kind.FORWARD_BACKWARD, args, merge,
                          error=None if why is None else f"loss_fn {req.loss_fn[:80]!r}: {why}")

    @app.post("/api/v1/optim_step")
    async def optim_step(request: Request):
        body = await body_of(request)
        return _ordered(svc, body, Kind.OPTIM, lambda: {"hp": adam_params(body)})

    @app.post("/api/v1/save_weights")
    async def save_weights(request: Request):
        body = await body_of(request)
        return _ordered(svc, body, Kind.SAVE_STATE, lambda: {
            "name": None if body.get("path") is None else check_name(body.get("path")), "ttl": _ttl(body),
            "overwrite": bool(body.get("overwrite")), "meta": _meta(body)})

    @app.post("/api/v1/save_weights_for_sampler")
    async def save_weights_for_sampler(request: Request):
        body = await body_of(request)

        def args():
            name = body.get("path")
            seq = body.get("sampling_session_seq_id")
            if name is None and (not isinstance(seq, int) or isinstance(seq, bool) or seq < 0):
                raise UserError("save_weights_for_sampler needs a path (a name) or a sampling_session_seq_id")
            kind = body.get("kind", "snapshot")
            if kind not in ("snapshot", "inflight"):
                raise UserError(f"kind must be 'snapshot' or 'inflight', got {str(kind)[:40]!r}")
            return {"name": None if name is None else check_name(name), "sampling_seq": seq, "kind": kind,
                    "ttl": _ttl(body), "meta": _meta(body)}
        return _ordered(svc, body, Kind.SAVE_SAMPLER, args)

    @app.post("/api/v1/load_weights")
    async def load_weights(request: Request):
        return svc.load_weights(await body_of(request))

    # ---------------------------------------------------------------- sampling
    @app.post("/api/v1/create_sampling_session")
    async def create_sampling_session(request: Request):
        return await asyncio.to_thread(svc.create_sampling_session, await body_of(request))

    @app.get("/api/v1/samplers/{sid}")
    async def get_sampler(sid: str):
        sp = svc.sampler(sid)
        return {"sampler_id": sp.id, "base_model": sp.base_model, "model_path": sp.model_path}

    @app.post("/api/v1/asample")
    async def asample(request: Request):  # (APIError 429 when the scheduler is full)
        body = await body_of(request)
        chunks = (body.get("prompt") or {}).get("chunks") if isinstance(body.get("prompt"), dict) else None
        if isinstance(chunks, list) and all(isinstance(c, dict) and c.get("type") == "encoded_text" for c in chunks):
            return svc.sample(body)  # token ids only: quick, answered on the loop (no thread hop per sample)
        return await asyncio.to_thread(svc.sample, body)  # pictures to decode: off the loop

    @app.post("/api/v1/cancel_future")
    async def cancel_future(request: Request):
        await request.body()
        return {}

    @app.post("/api/v1/retrieve_future")
    async def retrieve_future(request: Request):
        return answer(await svc.futures.retrieve((await body_of(request)).get("request_id")))

    # ---------------------------------------------------------------- checkpoints and runs (RestClient)
    @app.get("/api/v1/training_runs")
    async def training_runs(limit: int = 20, offset: int = 0):
        runs = await asyncio.to_thread(svc.store.runs)
        page = runs[max(offset, 0):max(offset, 0) + max(min(limit, 1000), 0)]
        return {"training_runs": [await asyncio.to_thread(svc.training_run, r["training_run_id"]) for r in page],
                "cursor": {"offset": offset, "limit": limit, "total_count": len(runs)}}

    @app.get("/api/v1/training_runs/{run_id}")
    async def training_run(run_id: str):
        return await asyncio.to_thread(svc.training_run, run_id)

    @app.get("/api/v1/training_runs/{run_id}/checkpoints")
    async def checkpoints(run_id: str):
        svc.store.run_dir(run_id)
        return {"checkpoints": await asyncio.to_thread(svc.store.checkpoints, run_id)}

    @app.delete("/api/v1/training_runs/{run_id}/checkpoints/{kind}/{name}")
    async def delete_checkpoint(run_id: str, kind: str, name: str):
        await asyncio.to_thread(svc.delete_checkpoint, run_id, kind, name)
        return {}

    @app.post("/api/v1/weights_info")
    async def weights_info(request: Request):
        return await asyncio.to_thread(svc.weights_info, (await body_of(request)).get("tinker_path"))


def _ordered(svc: TinkerService, body: dict, kind: Kind, args) -> dict:
    """A request that holds a place in its model's seq_id order: its bad input fails its future, and the requests
    after it still run."""
    try:
        a, error = args(), None
    except UserError as e:
        a, error = {}, str(e)
    return svc.submit(body.get("model_id"), body.get("seq_id"), kind, a, error=error)
