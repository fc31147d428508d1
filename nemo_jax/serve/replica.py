"""`nemo-jax serve` over several processes (hosts): every process holds its share of the model's weights, and every
device call runs on every process, in one order (a multi-controller JAX program: each call's collectives need all of
them).

Process 0 (the leader) answers HTTP. Each unit of device work it does, an engine method of the scheduler's or a
request of a service's worker (the Tinker API's), is sent to the other processes (followers) before it runs there,
under one lock: the call log. Followers replay it on objects built the same way (the same load, warm-up and
services), so their state moves as the leader's does. What a unit carries refers to device state by name, never
holds it: an adapter set by its version, a training model by its id.

    Leader(n)         listens, publishes its address in the coordination service, takes the followers' connections;
                      `run(target, method, args, fn)` sends the unit, then runs fn() here; `close()` ends the log
    Follower()        connects; `serve(targets)` replays each unit with targets[target](method, args) until the log
                      ends (the leader's close) or breaks (the leader is gone: one line, exit 3)
    replicate_engine  the engine's methods the scheduler calls, logged on the leader; `engine_target` replays them

A follower that dies breaks the leader's sends: the unit fails naming it, and `distributed.failure_guard`'s watchdog
ends the server with the lost process named, as in training.
"""

from __future__ import annotations

import pickle
import socket
import struct
import sys
import threading
import traceback

from nemo_jax.generate.sampling import SamplingParams
from nemo_jax.parallel.distributed import coordination_client

KEY = "nemo-jax serve: the call log"
ENGINE_METHODS = ("submit", "feed", "release", "step", "set_adapters")


def _send(sock: socket.socket, obj) -> None:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    sock.sendall(struct.pack("<Q", len(data)) + data)


def _recv_exact(sock: socket.socket, n: int) -> bytes | None:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(min(n - len(buf), 1 << 20))
        if not chunk:
            return None
        buf += chunk
    return bytes(buf)


def _recv(sock: socket.socket):
    head = _recv_exact(sock, 8)
    if head is None:
        return None
    body = _recv_exact(sock, struct.unpack("<Q", head)[0])
    return None if body is None else pickle.loads(body)


class Leader:
    def __init__(self, followers: int, timeout_s: float = 300.0):
        """Listen on a free port of this host, publish host:port, and take `followers` connections (each says its
        process id)."""
        self._lock = threading.Lock()
        srv = socket.socket()
        srv.bind(("0.0.0.0", 0))
        srv.listen(followers)
        srv.settimeout(timeout_s)
        coordination_client().key_value_set(KEY, f"{socket.gethostname()}:{srv.getsockname()[1]}")
        self._socks: dict[int, socket.socket] = {}
        try:
            while len(self._socks) < followers:
                conn, _ = srv.accept()
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                self._socks[_recv(conn)] = conn
        except socket.timeout:
            raise RuntimeError(f"nemo-jax serve: {followers - len(self._socks)} follower process(es) did not "
                               f"connect within {timeout_s:g} s") from None
        finally:
            srv.close()

    def run(self, target: str, method: str, args: tuple, fn):
        """Send the unit (target, method, args) to every follower, then fn() here -> its result; in one order."""
        with self._lock:
            for pid, s in self._socks.items():
                try:
                    _send(s, (target, method, args))
                except OSError as e:
                    raise RuntimeError(f"nemo-jax serve: lost follower process {pid} ({e})") from None
            return fn()

    def close(self) -> None:
        with self._lock:
            for s in self._socks.values():
                try:
                    _send(s, ("", "close", ()))
                    s.close()
                except OSError:
                    pass
            self._socks = {}


class Follower:
    def __init__(self, process_id: int, timeout_s: float = 300.0):
        host, port = coordination_client().blocking_key_value_get(KEY, int(timeout_s * 1000)).rsplit(":", 1)
        self.sock = socket.create_connection((host, int(port)), timeout=timeout_s)
        self.sock.settimeout(None)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        _send(self.sock, process_id)
        self.process_id = process_id

    def serve(self, targets: dict) -> None:
        """Replay the log: targets[target](method, args) for each unit (an error is printed and the log goes on, as
        the leader's own goes on), until the leader closes it. A log that breaks: the leader is gone (exit 3)."""
        while True:
            unit = _recv(self.sock)
            if unit is None:
                print(f"nemo-jax serve: process {self.process_id}: lost the leader (process 0); stopping",
                      file=sys.stderr, flush=True)
                raise SystemExit(3)
            target, method, args = unit
            if method == "close":
                return
            try:
                targets[target](method, args)
            except Exception:  # the leader's own call failed alike (its request fails; the server goes on)
                traceback.print_exc()


def replicate_engine(engine, leader: Leader) -> None:
    """The engine's methods the scheduler calls (ENGINE_METHODS), logged before they run. An adapter set goes by its
    version (`set_adapters`), a sequence's tag stays here."""
    for name in ENGINE_METHODS:
        fn = getattr(engine, name)

        def logged(*args, _fn=fn, _name=name, **kw):
            if _name == "set_adapters":
                sent = (args[1] if len(args) > 1 else kw["version"],)
            elif _name == "submit":
                sent = (args[0], args[1] if len(args) > 1 else kw.get("sp", SamplingParams()), kw.get("images"))
            elif _name == "feed":
                sent = (args[0], args[1], kw.get("images"))
            else:
                sent = args
            return leader.run("engine", _name, sent, lambda: _fn(*args, **kw))
        setattr(engine, name, logged)


def engine_target(engine, adapters):
    """A follower's replay of the engine's units; `adapters`: serve's AdapterRegistry (versions -> trees)."""
    def replay(method: str, args: tuple):
        if method == "set_adapters":
            engine.set_adapters(adapters.tree_of(args[0]), args[0])
        elif method == "submit":
            engine.submit(args[0], args[1], images=args[2])
        elif method == "feed":
            engine.feed(args[0], args[1], images=args[2])
        else:
            getattr(engine, method)(*args)
    return replay
