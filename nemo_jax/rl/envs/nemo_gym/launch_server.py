"""Serve one NeMo-Gym resources server class on localhost, for `nemo_jax.rl.envs.nemo_gym`. Runs with the Python of
NeMo-Gym's own venv (NeMo-Gym needs Python >= 3.12 and pins of its own), so it imports nothing of nemo_jax: the
environment starts it by this file's path.

    python launch_server.py MODULE:CLASS PORT_FILE

It binds a free port on 127.0.0.1, writes the port to PORT_FILE (through a temporary file, renamed: the reader never
sees half a number) once the socket listens, and serves until it is terminated. The server gets a head-server
address of its own making (a standalone resources server never calls one)."""

import os
import socket
import sys
from importlib import import_module


def main() -> None:
    if len(sys.argv) != 3 or ":" not in sys.argv[1]:
        raise SystemExit("usage: launch_server.py MODULE:CLASS PORT_FILE")
    try:  # (NeMo-Gym's venv has these; nemo_jax's need not)
        import uvicorn
        from nemo_gym.config_types import BaseServerConfig
        from nemo_gym.server_utils import ServerClient
        from omegaconf import OmegaConf
    except ImportError as e:
        raise SystemExit(f"launch_server.py: run it with NeMo-Gym's Python ({e})") from None

    module, _, name = sys.argv[1].partition(":")
    cls = getattr(import_module(module), name)
    host = "127.0.0.1"
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, 0))
    port = sock.getsockname()[1]
    config = cls.model_fields["config"].annotation(name=module.split(".")[-2] if module.count(".") else module,
                                                   host=host, port=port, entrypoint="app.py")
    server = cls(config=config, server_client=ServerClient(
        head_server_config=BaseServerConfig(host=host, port=1), global_config_dict=OmegaConf.create({})))
    app = server.setup_webserver()
    for extra in ("setup_liveness", "setup_exception_middleware"):
        if hasattr(server, extra):
            getattr(server, extra)(app)
    sock.listen(64)
    tmp = sys.argv[2] + ".tmp"
    with open(tmp, "w") as f:
        f.write(str(port))
    os.replace(tmp, sys.argv[2])
    uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning")).run(sockets=[sock])


if __name__ == "__main__":
    main()
