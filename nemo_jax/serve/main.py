"""`nemo-jax serve`: the command. The socket is bound before the model loads (a taken port fails in a second), the
model and its `Engine` are loaded, every program a request can run is compiled before ready (`warmup`), and the
app (`nemo_jax.serve.app`) runs under uvicorn until SIGTERM / SIGINT or the engine dies. Services over the same
model (the Tinker API) are handed in by the caller: serve knows none of them."""

import os
import signal
import sys

from nemo_jax.extras import require
from nemo_jax.serve.app import ServerState, make_app
from nemo_jax.serve.openai import APIError, token_bytes


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
    state.close()
    return 1 if state.fatal is not None else 0


# ----------------------------------------------------------------------------- the command
def cli_serve(a, adapters: dict[str, str], services=None) -> None:
    """`nemo-jax serve` (arguments checked by the CLI; `adapters`: {name: dir} from --adapters). `services(state,
    tokenizer_dir)` -> the other services to mount over the served model (`app.Service`s: the Tinker API). Over
    several processes (`nemo_jax.parallel.distributed`'s layout), process 0 serves and the others follow it
    (`nemo_jax.serve.replica`)."""
    from nemo_jax.parallel import distributed

    layout = distributed.initialize(None)
    if not layout.multi:
        return _serve(a, adapters, services)
    with distributed.failure_guard("serve"):
        _serve(a, adapters, services, process=distributed.process())


def _serve(a, adapters: dict[str, str], services=None, process: tuple[int, int] = (0, 1)) -> None:
    require("fastapi", "serve", "nemo-jax serve")
    require("uvicorn", "serve", "nemo-jax serve")
    me, n = process
    sock = bind(a.host, a.port) if me == 0 else None  # a taken port fails now, before the model is loaded
    if me == 0 and a.host in ("0.0.0.0", "::", "") and not a.api_key:
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
    for n_, path in adapters.items():
        try:
            state.adapters.load(n_, path)
        except APIError as e:
            raise ValueError(f"--adapters {n_}={path}: {e}") from None
    if not a.no_warmup:  # every program a request can run, compiled (or loaded from the cache) before ready
        from nemo_jax.serve.warmup import warm_up

        w = warm_up(engine, [ad.tree for ad in state.adapters.loaded()])
        print(f"nemo-jax serve: warm-up done in {w.seconds:.1f} s ({w.compiled} programs compiled, {w.loaded} loaded "
              f"from the compilation cache{' at ' + cache if cache else ': off'})", flush=True)
    if n > 1:  # the call log from here on: process 0 leads, the others replay (every process built the same)
        from nemo_jax.serve import replica

        state.replica = replica.Leader(n - 1) if me == 0 else replica.Follower(me)
        if me == 0:
            replica.replicate_engine(engine, state.replica)
    from nemo_jax.serve.warmup import CompileCounter

    state.compiles = CompileCounter().__enter__()  # (for the server's life)
    extra = list(services(state, tok_dir)) if services is not None else []
    if me != 0:  # (a SIGTERM the launcher sends every process: the leader drains, then closes the log)
        signal.signal(signal.SIGTERM, lambda *_: None)
        state.replica.serve({"engine": replica.engine_target(engine, state.adapters), **state.replica_targets})
        print(f"nemo-jax serve: process {me} of {n}: the leader closed the log; stopping", flush=True)
        state.close()
        return
    app = make_app(state, api_key=a.api_key, max_body=int(a.max_request_mb * 2 ** 20), services=extra)
    roots = state.adapters.roots
    gates = [f"API key {'on' if a.api_key else 'off'}",
             f"runtime adapters {'under ' + ', '.join(a.adapter_root) if roots is not None else 'off'}"]
    gates += [svc.line for svc in extra if svc.line]
    over = f"; {n} processes, {jax.device_count()} devices" if n > 1 else ""
    line = (f"nemo-jax serve: {name} ({len(adapters)} adapter(s)) on http://{a.host}:{a.port}/v1 "
            f"({a.max_num_seqs} rows x {a.max_model_len} positions{over}; {'; '.join(gates)})")
    code = serve(state, app, host=a.host, port=a.port, log_level=a.log_level, shutdown_timeout=a.shutdown_timeout,
                 sock=sock, ready=lambda server: print(line, flush=True))  # (said once the socket accepts)
    if state.replica is not None:
        state.replica.close()
    if code:
        e = state.fatal
        print(f"nemo-jax serve: the engine failed ({type(e).__name__}: {e}); exiting with status 1 so that a "
              "supervisor restarts the server", file=sys.stderr, flush=True)
        raise SystemExit(1)
    print("nemo-jax serve: stopped", flush=True)
