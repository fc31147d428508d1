"""`nemo-jax serve`'s HTTP surface as a hostile client and an operator meet it, in-process (uvicorn on a thread,
real sockets) over a scripted engine (`FakeEngine`: no model, no compile; the scheduler, app and guard are the real
ones): every error in OpenAI's JSON shape with the connection kept, bounded numeric fields, the API key, the body
size limit, streaming chunks and [DONE], cancellation on disconnect and on timeout, the bounded queue (429 +
Retry-After), an engine that dies (503, the server exits 1), bounded and escaped metrics, runtime adapter loading
gated, confined and atomic, local images refused, and the streamed text holding back what is not final."""

import json
import os
import socket
import threading
import time
from collections import deque

import numpy as np
import pytest

pytest.importorskip("fastapi", reason="nemo-jax serve needs fastapi + uvicorn (pip install -e '.[serve]')")
pytest.importorskip("uvicorn", reason="nemo-jax serve needs fastapi + uvicorn (pip install -e '.[serve]')")
openai = pytest.importorskip("openai", reason="the tests call the server with the openai client")
import httpx  # noqa: E402

from nemo_jax.config.model import NemotronHConfig  # noqa: E402
from nemo_jax.data.chat import ChatTokenizer  # noqa: E402
from nemo_jax.generate import TurnEnd  # noqa: E402
from nemo_jax.serve.app import ServerState, make_app  # noqa: E402
from nemo_jax.serve.main import serve  # noqa: E402
from nemo_jax.serve.openai import APIError  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOK = ChatTokenizer.load("builtin:tiny")
SAID = TOK.tokenizer.encode("Paris is the capital of France. It is a large city.", add_special_tokens=False).ids
MSG = [{"role": "user", "content": "Name a city."}]


class FakeEngine:
    """The `Engine` interface the scheduler drives, scripted: each step every sequence in a row draws the next
    token of `SAID` (cycling), `delay` seconds a step; `fail`: the next step raises it."""

    def __init__(self, batch: int = 2, delay: float = 0.0, vocab: int = 512):
        self.batch, self.delay, self.vocab = batch, delay, vocab
        self.rows: list = [None] * batch
        self._queue: deque = deque()
        self._seqs: dict = {}
        self._next = 0
        self.decode_steps = self.tokens_sampled = 0
        self.progress: list[int] = []
        self.released: list[int] = []
        self.fail: BaseException | None = None
        self.params = None  # (serve keeps the engine's copy of the weights)
        self._lock = threading.RLock()

    @property
    def queued(self) -> int:
        return len(self._queue)

    def set_adapters(self, tree, version):
        pass

    def submit(self, tokens, sp, *, images=None, tag=None):
        if any(t >= self.vocab for t in sp.stop_token_ids):
            raise ValueError("a stop token id outside the vocabulary")
        with self._lock:
            sid, self._next = self._next, self._next + 1
            self._seqs[sid] = {"sp": sp, "tag": tag, "t": [], "l": [], "top": [], "row": None}
            self._queue.append(sid)
        return sid

    def release(self, sid):
        with self._lock:
            s = self._seqs.pop(sid, None)
            if s is None:
                return
            self.released.append(sid)
            if sid in self._queue:
                self._queue.remove(sid)
            if s["row"] is not None:
                self.rows[s["row"]] = None

    def turn_so_far(self, sid):
        s = self._seqs.get(sid)
        if s is None:
            return [], [], None
        return s["t"], s["l"], s["top"] if s["sp"].top_logprobs else None

    def step(self):
        if self.fail is not None:
            raise self.fail
        time.sleep(self.delay)
        with self._lock:
            for r in range(self.batch):
                if self.rows[r] is None and self._queue:
                    sid = self._queue.popleft()
                    self.rows[r], self._seqs[sid]["row"] = sid, r
            self.progress, ends = [], []
            for r, sid in enumerate(self.rows):
                s = self._seqs.get(sid) if sid is not None else None
                if s is None or s.get("ended"):
                    continue
                t = SAID[len(s["t"]) % len(SAID)]
                s["t"].append(t)
                s["l"].append(-0.5)
                s["top"].append([(t, -0.5), (t + 1, -1.5)][:s["sp"].top_logprobs])
                self.tokens_sampled += 1
                self.progress.append(sid)
                stop = t in s["sp"].stop_token_ids
                if stop or len(s["t"]) >= s["sp"].max_new_tokens:
                    s["ended"] = True
                    ends.append(TurnEnd(sid, list(s["t"]), list(s["l"]), "stop" if stop else "length", 0, s["tag"],
                                        (0,), list(s["top"]) if s["sp"].top_logprobs else None))
            self.decode_steps += 1
        return ends


def _cfg():
    with open(os.path.join(ROOT, "nemo_jax", "assets", "models", "tiny.json")) as f:
        return NemotronHConfig.from_hf_dict(json.load(f))


class Running:
    """A ServerState over a FakeEngine, served by uvicorn on a thread; `.url`, `.engine`, `.state`, `.code`."""

    def __init__(self, engine=None, *, api_key=None, max_body=1 << 20, cfg=None, tok=None, **kw):
        self.engine = engine or FakeEngine()
        kw.setdefault("max_len", 4096)
        self.state = ServerState(cfg or _cfg(), None, tok or TOK, self.engine, model_name="tiny", bucket=8, **kw)
        app = make_app(self.state, api_key=api_key, max_body=max_body)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        up = threading.Event()
        self.server, self.code = None, None

        def ready(server):
            self.server = server
            up.set()

        def run():
            self.code = serve(self.state, app, host="127.0.0.1", port=self.port, shutdown_timeout=5, ready=ready)
            up.set()
        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()
        assert up.wait(120), "the server did not start"
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key=api_key or "none", max_retries=0, timeout=120)

    def post(self, path, body, **kw):
        kw.setdefault("timeout", 120)
        return httpx.post(self.url + path, json=body, headers={**self.headers, **kw.pop("headers", {})}, **kw)

    def close(self):
        if self.server is not None:
            self.server.should_exit = True
        self.thread.join(30)


@pytest.fixture
def running():
    made = []

    def make(*a, **kw):
        made.append(Running(*a, **kw))
        return made[-1]
    yield make
    for r in made:
        r.close()


def _error(r, status):
    assert r.status_code == status, (r.status_code, r.text)
    e = r.json()["error"]
    assert set(e) == {"message", "type", "param", "code"} and e["code"] == status and isinstance(e["message"], str)
    return e


def _raw(port, requests: list[bytes]) -> list[bytes]:
    """Send HTTP/1.1 requests one after another on ONE connection -> each response (status line and body)."""
    out = []
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        f = s.makefile("rb")
        for req in requests:
            s.sendall(req)
            status = f.readline()
            assert status, "the connection was closed"
            length = 0
            while True:
                line = f.readline()
                if line in (b"\r\n", b""):
                    break
                k, _, v = line.decode().partition(":")
                if k.lower() == "content-length":
                    length = int(v)
            out.append(status + f.read(length))
    return out


def _post_raw(path: str, body: bytes) -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n"
            f"\r\n").encode() + body


# ----------------------------------------------------------------------------- errors
def test_bad_requests_are_400s_in_openai_shape_and_keep_the_connection(running):
    """Hostile bodies get one JSON error each (never a plain-text 500), numeric fields are bounded (2^31 top_k or
    stop id, NaN, huge seeds or budgets are 400s, and the engine runs on), unknown fields are refused, and the
    keep-alive connection that carried them serves the next request."""
    srv = running()
    chat = lambda **kw: httpx.post(srv.url + "/v1/chat/completions", content=json.dumps(  # noqa: E731
        {"messages": MSG, "max_tokens": 4, **kw}), headers={"Content-Type": "application/json"})  # (NaN: a literal)
    for bad, param in ((dict(top_k=2 ** 31), "top_k"), (dict(stop_token_ids=[2 ** 31]), "stop_token_ids"),
                       (dict(seed=2 ** 70), "seed"), (dict(max_tokens=2 ** 40), "max_tokens"), (dict(n=0), "n"),
                       (dict(temperature=float("nan")), "temperature"), (dict(logit_bias={"99999": 1}), "logit_bias"),
                       (dict(logit_bias={"5": 101}), "logit_bias"), (dict(presence_penalty=2.5), "presence_penalty"),
                       (dict(min_tokens=5), "min_tokens"), (dict(top_logprobs=3), "top_logprobs"),
                       (dict(foo=1), "foo"), (dict(functions=[{"name": "f"}]), "functions"), (dict(model=["a"]), "model"),
                       (dict(best_of=3), "best_of"), (dict(stop=["x" * 300]), "stop"),
                       (dict(stream_options={"include_usage": True}), "stream_options"),
                       (dict(messages=[{"role": "assistant", "tool_calls": "x"}]), "messages"),
                       (dict(messages=[{"role": "assistant", "tool_calls": [{"function": 3}]}]), "messages"),
                       (dict(messages=[{"role": "assistant", "tool_calls": [
                           {"function": {"name": "f", "arguments": "[1"}}]}]), "messages")):
        e = _error(chat(**bad), 400)
        assert e["param"] == param and e["type"] == "BadRequestError", (bad, e)
    assert "Unrecognized request argument supplied: foo" in _error(chat(foo=1), 400)["message"]
    assert _error(chat(model="nope"), 404)["type"] == "NotFoundError"
    for ids in ([-1], [10 ** 30], ["a"], "x"):
        assert _error(srv.post("/detokenize", {"tokens": ids}), 400)["param"] == "tokens"
    assert _error(httpx.post(srv.url + "/v1/completions", content=b"{not json"), 400)
    assert _error(srv.post("/v1/completions", [1, 2]), 422)["type"] == "UnprocessableEntityError"
    assert _error(httpx.get(srv.url + "/v1/nothing-here"), 404)
    # neutral values of unimplemented fields, and fields without effect, are accepted
    ok = srv.post("/v1/completions", {"prompt": "hi", "max_tokens": 2, "echo": False, "best_of": 1, "user": "u",
                                      "suffix": None, "n": 1})
    assert ok.status_code == 200, ok.text
    # one connection: malformed tool_calls, an unhashable model, bad token ids, then a good request
    bad = [json.dumps({"messages": [{"role": "assistant", "tool_calls": [1]}]}).encode(),
           json.dumps({"messages": MSG, "model": {"a": 1}}).encode()]
    got = _raw(srv.port, [_post_raw("/v1/chat/completions", b) for b in bad]
               + [_post_raw("/detokenize", b'{"tokens": [1e400]}'), _post_raw("/detokenize", b'{"tokens": [5, 6]}')])
    assert [g.split(b" ")[1] for g in got] == [b"400", b"400", b"400", b"200"], got
    assert json.loads(got[0].split(b"\r\n", 1)[1])["error"]["param"] == "messages"
    assert httpx.get(srv.url + "/health").status_code == 200 and srv.state.scheduler.alive
    assert srv.client.chat.completions.create(model="tiny", messages=MSG, max_tokens=3).choices[0].message.content


def test_api_key_on_every_route_but_health(running):
    srv = running(api_key="s3cret")
    for path in ("/v1/models", "/metrics"):
        r = httpx.get(srv.url + path)
        assert _error(r, 401)["type"] == "AuthenticationError" and r.headers["www-authenticate"] == "Bearer"
        assert httpx.get(srv.url + path, headers={"Authorization": "Bearer wrong"}).status_code == 401
        assert httpx.get(srv.url + path, headers=srv.headers).status_code == 200
    _error(httpx.post(srv.url + "/v1/completions", json={"prompt": "hi"}), 401)
    assert httpx.get(srv.url + "/health").status_code == 200
    bad = openai.OpenAI(base_url=srv.url + "/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    assert srv.client.completions.create(model="tiny", prompt="hi", max_tokens=2).choices[0].text


def test_request_body_limit_before_parsing(running):
    """A body over the limit is a 413 from its Content-Length alone (nothing read), or as soon as a chunked body
    passes the limit; the server goes on."""
    srv = running(max_body=4096)
    with socket.create_connection(("127.0.0.1", srv.port), timeout=10) as s:  # claims 1 GB, sends none of it
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 1000000000\r\n\r\n")
        head = s.recv(4096)
    assert head.split(b" ")[1] == b"413" and b"RequestTooLargeError" in head
    big = {"prompt": "x" * 10000, "max_tokens": 1}

    def chunked():
        data = json.dumps(big).encode()
        for i in range(0, len(data), 1000):
            yield data[i:i + 1000]
    assert _error(httpx.post(srv.url + "/v1/completions", content=chunked()), 413)
    assert _error(srv.post("/v1/completions", big), 413)
    assert srv.post("/v1/completions", {"prompt": "hi", "max_tokens": 1}).status_code == 200


def test_long_prompt_text_is_refused_before_tokenizing(running):
    srv = running(max_len=16, vocab_bytes=[b"abcd"] * 10)  # no 16 tokens of <= 4 bytes spell 70 kB
    e = _error(srv.post("/v1/completions", {"prompt": "x" * 70000, "max_tokens": 1}), 400)
    assert "maximum context length" in e["message"] and e["param"] == "prompt"


# ----------------------------------------------------------------------------- streaming and cancellation
def _sse(lines) -> list:
    """Raw SSE lines -> the JSON of each `data:` event, "[DONE]" kept as is."""
    out = []
    for line in lines:
        if line.startswith("data: "):
            data = line[len("data: "):]
            out.append(data if data == "[DONE]" else json.loads(data))
        else:
            assert line == "", line
    return out


def test_streamed_chunks_add_up_to_the_response(running):
    srv = running()
    kw = {"messages": MSG, "max_tokens": 9, "logprobs": True, "top_logprobs": 2, "n": 2,
          "return_token_ids": True}
    whole = srv.post("/v1/chat/completions", kw).json()
    with httpx.stream("POST", srv.url + "/v1/chat/completions", timeout=30,
                      json={**kw, "stream": True, "stream_options": {"include_usage": True}}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = _sse(r.iter_lines())
    assert events[-1] == "[DONE]" and events[-2]["choices"] == [] and events[-2]["usage"] == whole["usage"]
    assert events[0]["prompt_token_ids"] == whole["prompt_token_ids"]
    for i in range(2):
        mine = [c for e in events[:-2] for c in e["choices"] if c["index"] == i]
        assert mine[0]["delta"] == {"role": "assistant", "content": ""}
        assert "".join(c["delta"].get("content", "") for c in mine) == whole["choices"][i]["message"]["content"]
        assert [t for c in mine for t in c.get("token_ids") or []] == whole["choices"][i]["token_ids"]
        lps = [x for c in mine if c["logprobs"] for x in c["logprobs"]["content"]]
        assert lps == whole["choices"][i]["logprobs"]["content"] and len(lps[0]["top_logprobs"]) == 2
        assert mine[-1]["finish_reason"] == "length" and all(c["finish_reason"] is None for c in mine[:-1])
    # completions, through the official client's iterator
    text, usage = "", None
    for ch in srv.client.completions.create(model="tiny", prompt="hi", max_tokens=7, stream=True,
                                            stream_options={"include_usage": True}):
        text += "".join(c.text for c in ch.choices)
        usage = ch.usage or usage
    assert text == srv.client.completions.create(model="tiny", prompt="hi", max_tokens=7).choices[0].text
    assert usage.completion_tokens == 7


def test_clients_that_go_away_free_their_rows_at_once(running):
    """A raw SSE stream closed after two chunks, a request whose client timed out, and the official client's stream
    iterator closed are cancelled: their engine rows are released within a fraction of the time they would have
    taken (1000 tokens at 20 ms a step)."""
    srv = running(FakeEngine(batch=2, delay=0.02))
    body = {"messages": MSG, "max_tokens": 1000, "stream": True}
    with httpx.stream("POST", srv.url + "/v1/chat/completions", json=body, timeout=30) as r:
        it = r.iter_lines()
        got = [next(it) for _ in range(4)]
    assert any("content" in g for g in got)
    t0 = time.monotonic()
    while srv.engine.released != [0] and time.monotonic() - t0 < 5:
        time.sleep(0.02)
    assert srv.engine.released == [0] and srv.engine.rows == [None, None]
    with pytest.raises(httpx.ReadTimeout):
        srv.post("/v1/completions", {"prompt": "hi", "max_tokens": 1000}, timeout=0.5)
    while 1 not in srv.engine.released and time.monotonic() - t0 < 5:
        time.sleep(0.02)
    assert srv.engine.released == [0, 1] and time.monotonic() - t0 < 5
    stream = srv.client.chat.completions.create(model="tiny", messages=MSG, max_tokens=1000, stream=True)
    it = iter(stream)
    assert next(it).choices[0].delta.role == "assistant" and next(it).choices[0].delta.content
    stream.close()  # (the official client's iterator, given up)
    while 2 not in srv.engine.released and time.monotonic() - t0 < 10:
        time.sleep(0.02)
    assert srv.engine.released == [0, 1, 2]
    m = httpx.get(srv.url + "/metrics").text
    assert "nemo_jax_cancelled_total 3" in m and "nemo_jax_num_requests_running 0" in m


def _until(pred, what: str, timeout: float = 60.0):
    """Wait for an event (never for a guessed time): `pred()` true within `timeout` seconds."""
    t0 = time.monotonic()
    while not pred():
        assert time.monotonic() - t0 < timeout, f"not reached within {timeout} s: {what}"
        time.sleep(0.01)


def test_bounded_queue_timeout_and_draining(running):
    """Past its rows and waiting queue the server answers 429 with Retry-After; a request past --request-timeout
    is cancelled with a 503; once draining (SIGTERM), new requests get 503 and /health 503 while running requests
    finish, and the server stops with status 0. Each step waits for the state it needs (a row taken, a request
    waiting), never for a guessed time: it holds on a loaded machine."""
    srv = running(FakeEngine(batch=1, delay=0.02), max_waiting=1)
    long = {"prompt": "hi", "max_tokens": 40}
    counts = srv.state.scheduler.counts
    pool, futs = [], []
    for want in ({"running": 1, "waiting": 0}, {"running": 1, "waiting": 1}):  # one running, one waiting
        t = threading.Thread(target=lambda: futs.append(srv.post("/v1/completions", long, timeout=300)))
        t.start()
        pool.append(t)
        _until(lambda: counts() == want, f"scheduler counts {want}")
    r = srv.post("/v1/completions", long)
    e = _error(r, 429)
    assert e["type"] == "RateLimitError" and 1 <= int(r.headers["retry-after"]) <= 60
    for t in pool:
        t.join()
    assert [f.status_code for f in futs] == [200, 200]
    srv.state.runner.request_timeout = 1.0  # (a 1000-token request takes 20 s here)
    t0 = time.monotonic()
    e = _error(srv.post("/v1/completions", {"prompt": "hi", "max_tokens": 1000}, timeout=300), 503)
    assert "--request-timeout" in e["message"] and time.monotonic() - t0 < 15
    _until(lambda: srv.engine.rows == [None], "the timed-out request's row freed", 10)
    srv.state.runner.request_timeout = 0.0
    # draining: the one in flight finishes, new ones are refused
    done = []
    t = threading.Thread(target=lambda: done.append(srv.post("/v1/completions", {"prompt": "hi", "max_tokens": 30},
                                                             timeout=300)))
    t.start()
    _until(lambda: counts()["running"] == 1, "the request in its row")
    srv.state.scheduler.draining = True
    assert httpx.get(srv.url + "/health").status_code == 503
    assert _error(srv.post("/v1/completions", long), 503)["type"] == "ServiceUnavailableError"
    srv.server.handle_exit(15, None)
    t.join(120)
    srv.thread.join(60)
    assert done[0].status_code == 200 and srv.code == 0


def test_an_engine_that_dies_fails_requests_and_the_server_exits_1(running):
    """A request the engine refuses at submit fails alone (400) and the engine runs on; an exception out of the
    engine's step fails every request with a 503, /health turns 503 and the server exits with status 1."""
    srv = running()
    srv.engine.vocab = 100  # (the fake engine now refuses stop ids >= 100 at submit, as Engine does ids >= V)
    e = _error(srv.post("/v1/chat/completions", {"messages": MSG, "max_tokens": 2, "stop_token_ids": [300]}), 400)
    assert "outside the vocabulary" in e["message"]
    assert srv.post("/v1/chat/completions", {"messages": MSG, "max_tokens": 2}).status_code == 200
    srv.engine.fail = RuntimeError("XLA: device lost")
    e = _error(srv.post("/v1/chat/completions", {"messages": MSG, "max_tokens": 2}), 503)
    assert "device lost" in e["message"]
    srv.thread.join(15)
    assert srv.code == 1 and not srv.state.scheduler.alive


def test_metrics_stay_bounded_and_escaped(running):
    from nemo_jax.serve.metrics import escape

    srv = running()
    size = len(httpx.get(srv.url + "/metrics").text)
    with httpx.Client() as c:
        for i in range(300):
            c.get(f'{srv.url}/x{i}"y')
    text = httpx.get(srv.url + "/metrics").text
    assert 'nemo_jax_requests_total{endpoint="other",status="404"} 300' in text
    assert len(text) < size + 2000 and "x1" not in text
    assert escape('a"b\\c\nd') == 'a\\"b\\\\c\\nd'
    for name in ("time_to_first_token_seconds", "queue_time_seconds", "e2e_request_latency_seconds"):
        assert f"# TYPE nemo_jax_{name} histogram" in text
    assert "nemo_jax_generation_tokens_per_second" in text and "nemo_jax_num_requests_waiting 0" in text


# ----------------------------------------------------------------------------- adapters and local files
def _adapter(path, cfg):
    from nemo_jax.lora import LoraConfig, init_adapters
    from nemo_jax.lora.peft import save_peft
    import jax

    lc = LoraConfig(targets=("attention",), rank=2, alpha=4.0)
    save_peft(cfg, init_adapters(cfg, lc, jax.random.key(0)), path, format="vllm", lora_config=lc)


def test_runtime_adapter_loading_is_gated_confined_and_atomic(running, tmp_path):
    """Off by default (404); under --adapter-root only: a path outside, with '..', or a link out is one 400
    whether or not it exists, a missing one inside a 404; a FIFO adapter_config.json or a malformed one is a 400
    at once while chat goes on; ten concurrent loads of one name: one 200."""
    off = running()
    _error(off.post("/v1/load_lora_adapter", {"lora_name": "a", "lora_path": str(tmp_path)}), 404)
    root = tmp_path / "root"
    root.mkdir()
    _adapter(root / "good", _cfg())
    srv = running(adapter_roots=[str(root)])
    load = lambda name, path, **kw: srv.post("/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(path),  # noqa: E731
                                                                       **kw})
    (root / "out").symlink_to(tmp_path)
    outside = [_error(load("a", p), 400)["message"] for p in (tmp_path, "/nonexistent/x", root / "out",
                                                                root / "out" / "nothing")]
    assert len(set(outside)) == 1 and "--adapter-root" in outside[0]
    assert "'..'" in _error(load("a", f"{root}/../root/good"), 400)["message"]
    _error(load("a", root / "missing"), 404)
    fifo = root / "fifo"
    fifo.mkdir()
    os.mkfifo(fifo / "adapter_config.json")
    t0 = time.monotonic()
    assert "not a regular file" in _error(load("f", fifo), 400)["message"]
    assert time.monotonic() - t0 < 5
    assert srv.post("/v1/chat/completions", {"messages": MSG, "max_tokens": 2}).status_code == 200
    bad = root / "bad"
    bad.mkdir()
    (bad / "adapter_config.json").write_text("{not json")
    _error(load("b", bad), 400)
    (bad / "adapter_config.json").write_text('{"r": "four"}')
    _error(load("b", bad), 400)
    got = []
    pool = [threading.Thread(target=lambda: got.append(load("same", root / "good").status_code)) for _ in range(10)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    assert sorted(got) == [200] + [400] * 9
    assert load("same", root / "good", load_inplace=True).status_code == 200
    assert [m.id for m in srv.client.models.list().data] == ["tiny", "same"]
    assert srv.post("/v1/unload_lora_adapter", {"lora_name": "same"}).status_code == 200
    _error(srv.post("/v1/unload_lora_adapter", {"lora_name": "same"}), 404)


def test_local_images_only_under_the_allowed_media_path(tmp_path):
    from nemo_jax.serve.openai import local_image

    (tmp_path / "media").mkdir()
    (tmp_path / "media" / "a.png").write_bytes(b"x")
    (tmp_path / "secret.png").write_bytes(b"x")
    (tmp_path / "media" / "link.png").symlink_to(tmp_path / "secret.png")
    with pytest.raises(APIError, match="allowed-local-media-path"):
        local_image(str(tmp_path / "media" / "a.png"), [])
    with pytest.raises(APIError, match="allowed-local-media-path"):
        local_image("file:///etc/passwd", [])
    roots = [os.path.realpath(tmp_path / "media")]
    assert local_image(f"file://{tmp_path}/media/a.png", roots) == os.path.realpath(tmp_path / "media" / "a.png")
    for bad in (str(tmp_path / "secret.png"), f"{tmp_path}/media/../secret.png", str(tmp_path / "media" / "link.png"),
                "media/a.png", "http://example.com/a.png"):
        with pytest.raises(APIError):
            local_image(bad, roots)


def _vl_cfg():
    with open(os.path.join(ROOT, "nemo_jax", "assets", "models", "tiny-vl.json")) as f:
        return NemotronHConfig.from_hf_dict(json.load(f))


def _png_header(width: int, height: int) -> bytes:
    """A PNG that claims width x height pixels (a decompression bomb's header: tiny, huge once decoded)."""
    import struct
    import zlib

    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 1, 0, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b""))


@pytest.fixture
def logged(monkeypatch, caplog):
    """What the server logs: the Guard's tracebacks (a 500) and every log record of WARNING or above (uvicorn,
    asyncio) -> a list of lines. (Not capfd: the server threads outlive a failing test's capture.)"""
    import logging
    import traceback

    import nemo_jax.serve.app as app

    lines = []
    monkeypatch.setattr(app, "traceback", type("T", (), {"print_exc": staticmethod(
        lambda *a, **k: lines.append("Traceback: " + traceback.format_exc()))}))
    caplog.set_level(logging.WARNING)
    yield lambda: lines + [f"{r.name}: {r.getMessage()}" for r in caplog.records if r.levelno >= logging.WARNING]


def test_hostile_inputs_are_400s_never_500s_or_hangs(running, tmp_path, logged, monkeypatch):
    """A lone surrogate, an unknown role, a FIFO under --allowed-local-media-path, a decompression bomb: each one
    400 in OpenAI's shape, at once, with no traceback; a local image whose read never ends: a 503 after
    MEDIA_READ_TIMEOUT_S, while text requests and /health go on, and with more stuck reads than media threads."""
    import base64

    import nemo_jax.data.images as images
    import nemo_jax.serve.prompts as app

    media = tmp_path / "media"
    media.mkdir()
    os.mkfifo(media / "fifo.png")
    (media / "ok.png").write_bytes(_png_header(8, 8))
    srv = running(cfg=_vl_cfg(), tok=ChatTokenizer.load("builtin:tiny_vl"), media_roots=[str(media)])
    surrogate = b'{"messages": [{"role": "user", "content": "a \\ud800 b"}], "max_tokens": 2}'
    r = httpx.post(srv.url + "/v1/chat/completions", content=surrogate, headers={"content-type": "application/json"})
    assert "surrogate" in _error(r, 400)["message"]
    assert "unknown role 'wizard'" in _error(srv.post("/v1/chat/completions", {"messages": [
        {"role": "wizard", "content": "hi"}], "max_tokens": 2}), 400)["message"]

    def image(url):
        return srv.post("/v1/chat/completions", {"messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "What?"}]}], "max_tokens": 2})
    t0 = time.monotonic()
    assert "not a regular file" in _error(image(str(media / "fifo.png")), 400)["message"]
    assert time.monotonic() - t0 < 10
    bomb = "data:image/png;base64," + base64.b64encode(_png_header(30000, 30000)).decode()
    assert "more pixels than an image may have" in _error(image(bomb), 400)["message"]
    big = "data:image/png;base64," + base64.b64encode(_png_header(9000, 9000)).decode()  # (below PIL's own limit)
    assert "9000 x 9000 pixels, more than" in _error(image(big), 400)["message"]
    assert image(str(media / "ok.png")).status_code == 200
    # reads that never end: each a 503 after the read timeout, the media threads replaced, text goes on
    stuck = threading.Event()
    monkeypatch.setattr(images, "read_image_file", lambda path, max_bytes: stuck.wait() and b"")
    monkeypatch.setattr(app, "MEDIA_READ_TIMEOUT_S", 0.5)
    got = []
    pool = [threading.Thread(target=lambda: got.append(image(str(media / "ok.png")).status_code)) for _ in range(9)]
    for t in pool:
        t.start()
    for t in pool:
        t.join(60)
    assert got == [503] * 9
    assert srv.post("/v1/chat/completions", {"messages": MSG, "max_tokens": 2}).status_code == 200
    assert httpx.get(srv.url + "/health").status_code == 200
    stuck.set()
    assert not logged(), logged()


def test_health_says_503_when_requests_cannot_be_served_and_one_sigterm_stops_a_stuck_server(running, monkeypatch):
    """With every request thread held (calls that never end), /health is 503, not 200; one SIGTERM still stops
    the server (status 0), its stuck threads left behind."""
    import nemo_jax.serve.runner as app

    monkeypatch.setattr(app, "HEALTH_PROBE_S", 0.3)
    srv = running()
    assert httpx.get(srv.url + "/health").status_code == 200
    stuck = threading.Event()
    for _ in range(srv.state.runner.work.limit):
        srv.state.runner.work.submit(stuck.wait)
    assert httpx.get(srv.url + "/health").status_code == 503
    srv.server.handle_exit(15, None)
    srv.thread.join(30)
    assert not srv.thread.is_alive() and srv.code == 0
    stuck.set()


def test_dropped_connections_are_counted_not_500s_and_not_logged(running, logged):
    """Clients that close their connection mid-body, or right after sending a request: no status 500 in
    /metrics, no traceback and no log line per connection; counted as disconnected / cancelled."""
    srv = running(FakeEngine(batch=2, delay=0.01))
    body = json.dumps({"messages": MSG, "max_tokens": 50}).encode()
    for i in range(200):
        with socket.create_connection(("127.0.0.1", srv.port), timeout=10) as s:
            req = _post_raw("/v1/chat/completions", body)
            s.sendall(req[: len(req) - len(body) // 2] if i % 2 else req)  # half a body, or a whole request
    t0 = time.monotonic()
    while time.monotonic() - t0 < 30:
        m = httpx.get(srv.url + "/metrics").text
        if "nemo_jax_num_requests_running 0" in m and "nemo_jax_num_requests_waiting 0" in m:
            break
        time.sleep(0.1)
    assert srv.post("/v1/chat/completions", {"messages": MSG, "max_tokens": 2}).status_code == 200
    m = httpx.get(srv.url + "/metrics").text
    assert 'status="500"' not in m, [x for x in m.splitlines() if "500" in x]
    gone = sum(float(x.split()[-1]) for x in m.splitlines()
               if x.startswith(("nemo_jax_disconnected_total", "nemo_jax_cancelled_total")))
    assert gone >= 100, [x for x in m.splitlines() if "total" in x]
    lines = logged()
    assert not any("Traceback" in x or "never retrieved" in x for x in lines) and len(lines) < 20, lines[:5]


def test_serve_over_processes_needs_a_mesh(monkeypatch, capsys):
    """Started as one of several processes (launch/local/run.sh, srun with several tasks) without --mesh, or with
    runtime adapter loading, `nemo-jax serve` says what is missing in one line, before it binds or loads anything
    (tests/test_tinker_processes.py serves over two processes)."""
    from nemo_jax.cli import main

    monkeypatch.setenv("NEMO_JAX_COORDINATOR", "127.0.0.1:1")
    monkeypatch.setenv("NEMO_JAX_NUM_PROCESSES", "2")
    monkeypatch.setenv("NEMO_JAX_PROCESS_ID", "0")
    for extra, words in (([], "needs --mesh over all their devices"),
                         (["--mesh", "fsdp=2", "--enable-runtime-lora-updating", "--adapter-root", "/tmp"],
                          "not supported over several processes")):
        with pytest.raises(SystemExit) as e:
            main(["serve", "--ckpt", "x", "--tokenizer", "builtin:tiny", "--port", "1", *extra])
        err = capsys.readouterr().err
        assert e.value.code == 2 and words in err and len(err.strip().splitlines()) == 1, err


def test_serve_checks_the_port_before_loading_warns_on_every_interface_and_says_ready_once_it_accepts(
        monkeypatch, capsys):
    """`nemo-jax serve` on a taken port: one line naming it, before the model is loaded; on 0.0.0.0 without an
    API key: one warning line; the ready line is printed when the socket already accepts connections."""
    import nemo_jax.generate as generate
    import nemo_jax.serve.main as app
    from nemo_jax.cli import main

    loaded = []
    monkeypatch.setattr(generate, "load_for_generation", lambda *a, **k: loaded.append(1) or (_cfg(), None, None))
    monkeypatch.setattr(generate, "Engine", lambda *a, **k: FakeEngine())
    import uvicorn  # its logging dictConfig closes every handler: absl's, made in this thread, writes to capsys' file
    monkeypatch.setattr(uvicorn.Config, "configure_logging", lambda self: None)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(SystemExit) as e:
            main(["serve", "--ckpt", "x", "--tokenizer", "builtin:tiny", "--port", str(port)])
    err = capsys.readouterr().err
    assert e.value.code == 2 and not loaded and f"--port {port}" in err and len(err.strip().splitlines()) == 1, err
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    servers, said = [], []
    real_serve = app.serve

    def serve(*a, ready=None, **k):  # (keeps the server, to stop it)
        return real_serve(*a, ready=lambda server: (servers.append(server), ready(server)), **k)
    monkeypatch.setattr(app, "serve", serve)

    import io

    class Out(io.StringIO):  # the moment the ready line is written, a client connects
        def write(self, text):
            if "on http://" in text:
                try:
                    socket.create_connection(("127.0.0.1", port), timeout=5).close()
                    said.append("accepted")
                except OSError as err:
                    said.append(f"refused: {err}")
            return super().write(text)
    import contextlib

    with contextlib.redirect_stdout(Out()):  # (restored before the capture fixtures close theirs)
        t = threading.Thread(target=main, args=(["serve", "--ckpt", "x", "--tokenizer", "builtin:tiny", "--host",
                                                 "0.0.0.0", "--port", str(port), "--no-warmup"],),
                             daemon=True)
        t.start()
        t0 = time.monotonic()
        while not servers and t.is_alive() and time.monotonic() - t0 < 60:
            time.sleep(0.05)
        assert servers, capsys.readouterr().err[-2000:]
        servers[0].should_exit = True
        t.join(30)
    assert said == ["accepted"], said
    warn = [x for x in capsys.readouterr().err.splitlines() if "warning" in x]
    assert len(warn) == 1 and "every interface" in warn[0] and "--api-key" in warn[0], warn


# ----------------------------------------------------------------------------- the stream's text
def test_streamed_text_holds_back_stop_prefixes_broken_characters_and_tool_calls():
    """`ChoiceStream` fed one token at a time: the deltas never show a stop string or the start of a tool call,
    never split a UTF-8 character, and add up (with `finish`) to the non-streamed content; tool calls come as one
    tool_calls delta."""
    from nemo_jax.serve.openai import ChoiceStream, Options, Prompt, Sample, choice

    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}]
    cases = [("Checking é now.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
              "</function>\n</tool_call>", Options(tools=tools), []),
             ("Hello world. STOP here", Options(), ["STOP", "zzz"]),
             ("Hello <tool_ca and more", Options(tools=tools), []),
             ("naïve café", Options(include_stop=True), ["café"])]
    for text, opt, stop in cases:
        ids = TOK.tokenizer.encode(text, add_special_tokens=False).ids
        p = Prompt([1], stop=stop)
        cs = ChoiceStream(TOK, 0, p, opt, chat=True)
        deltas = []
        for t in ids:
            part = cs.add([t], [-0.1], None)
            if part is not None and part["delta"].get("content"):
                d = part["delta"]["content"]
                assert "\ufffd" not in d and "<tool_call" not in d and "STOP" not in d
                deltas.append(d)
        sample = Sample(ids, [-0.1] * len(ids), "stop")
        tail = cs.finish(sample)
        deltas += [x["delta"]["content"] for x in tail if x["delta"].get("content")]
        want = choice(TOK, 0, sample, p, opt, chat=True)[0]
        assert "".join(deltas) == (want["message"]["content"] or ""), text
        calls = [c for x in tail for c in x["delta"].get("tool_calls", [])]
        assert [c["function"]["name"] for c in calls] == [c["function"]["name"] for c in want["message"]["tool_calls"]]
        assert tail[-1]["finish_reason"] == want["finish_reason"]
    assert want["message"]["content"] == "naïve café"


def test_token_bytes_spell_the_decoded_text():
    """`token_bytes` of the shipped byte-level tokenizer: any id sequence's bytes, joined, decode to the tokenizer's
    own decoding (special tokens skipped), so stop strings matched on bytes are matched on the text."""
    from nemo_jax.serve.openai import token_bytes

    table = token_bytes(TOK.tokenizer)
    rng = np.random.default_rng(0)
    for _ in range(50):
        ids = rng.integers(0, len(table), rng.integers(1, 30)).tolist()
        assert b"".join(table[t] for t in ids).decode("utf-8", "replace") == \
            TOK.tokenizer.decode(ids, skip_special_tokens=True)


def test_fields_rule_and_bounds_as_pure_functions():
    from nemo_jax.serve.openai import check_fields, sampling

    check_fields({"messages": [], "user": "x", "metadata": {"a": 1}, "parallel_tool_calls": True, "min_p": 0.0,
                  "response_format": {"type": "text"}}, "chat")
    check_fields({"messages": [], "min_p": 0.1}, "chat")  # (applied by the sampler)
    for bad in ({"echo": False}, {"parallel_tool_calls": False}, {"best_of": 3}, {"guided_json": {}},
                {"response_format": {"type": "json_object"}}):
        with pytest.raises(APIError):
            check_fields(bad, "chat")
    sps, stop = sampling({"top_k": 10 ** 6, "stop": "ab", "logit_bias": {"3": -100}, "seed": -1, "n": 2,
                          "repetition_penalty": 1.2, "min_tokens": 2, "max_tokens": 5}, 3, 64, 8, (2,), 512, 4)
    assert sps[0].top_k == 0 and sps[0].stop == ("ab",) and sps[0].logit_bias == ((3, -100.0),)
    assert [sp.seed for sp in sps] == [0xFFFFFFFF, 0] and sps[0].top_logprobs == 4 and stop == ["ab"]
    assert sps[0].min_p == 0.0 and sampling({"min_p": 0.2}, 3, 64, 8, (2,), 512)[0][0].min_p == 0.2
    with pytest.raises(APIError, match="min_p"):
        sampling({"min_p": 1.5}, 3, 64, 8, (2,), 512)
