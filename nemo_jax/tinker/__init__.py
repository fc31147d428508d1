"""The Tinker API, self-hosted: `nemo-jax serve --ckpt MODEL --tinker-root DIR` serves what the official `tinker`
SDK (0.38) and tinker-cookbook call, under /api/v1 beside the OpenAI routes (docs/tinker.md).

    wire.py      the SDK's protobuf and JSON bodies <-> numpy (pure)
    losses.py    Tinker's losses: plain sums, exactly as Tinker defines them
    learner.py   one frozen base, jitted forward / backward shared by every client's adapters; AdamW
    futures.py   request ids, long-polled results, the SDK's error categories
    store.py     tinker:// checkpoints as nemo-jax adapter checkpoints under --tinker-root
    service.py   sessions, training models (each model's requests in seq_id order), sampling sessions
    routes.py    the HTTP routes (FastAPI), mounted on serve's app
"""

from __future__ import annotations


def service_for(state, a, tokenizer_dir: str):
    """The Tinker API as a service of `nemo-jax serve` (a `nemo_jax.serve.app.Service`) over its `ServerState`,
    from the command's arguments (--tinker-root, --tinker-max-rank, --tinker-max-tokens, --tinker-batch-clients,
    --ckpt)."""
    from nemo_jax.extras import require
    from nemo_jax.serve.app import KeyHeader, Service
    from nemo_jax.tinker.routes import mount
    from nemo_jax.tinker.service import TinkerService

    require("tinker", "tinker", "nemo-jax serve --tinker-root (the Tinker API)")
    svc = TinkerService(state, a.tinker_root, ckpt=a.ckpt, tokenizer_dir=a.tokenizer or tokenizer_dir,
                        max_rank=a.tinker_max_rank, max_tokens=a.tinker_max_tokens,
                        batch_clients=a.tinker_batch_clients)
    if state.replica is not None:  # over several processes: its device work in the call log (tinker/replica.py)
        from nemo_jax.serve.replica import Leader
        from nemo_jax.tinker import replica

        if isinstance(state.replica, Leader):
            replica.leader(svc, state.replica)
        else:
            state.replica_targets[replica.TARGET] = replica.follower(svc, state.adapters)
    return Service(lambda app: mount(app, svc), KeyHeader("/api/v1/", b"x-api-key", (b"", b"tml-"),
                                                         "X-API-Key: tml-<key>"),
                   f"Tinker API on http://{a.host}:{a.port}/api/v1, state under {svc.store.root}")
