"""`nemo-jax serve` on localhost (a real subprocess, real HTTP) with the official `openai` client as the caller:
chat with logprobs and token ids (the learner's logprobs), n, seeds, stop strings, greedy == `nemo-jax generate`,
tools, LoRA adapters loaded and unloaded by name, completions, metrics, and images (the served model is a tiny
vision-language one)."""

import base64
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

openai = pytest.importorskip("openai", reason="serving tests call the server with the openai client")
pytest.importorskip("fastapi", reason="nemo-jax serve needs fastapi + uvicorn (pip install -e '.[serve]')")
pytest.importorskip("uvicorn", reason="nemo-jax serve needs fastapi + uvicorn (pip install -e '.[serve]')")
import httpx  # noqa: E402  (the openai client's HTTP library)

from helpers import FAST_COMPILE  # noqa: E402

from nemo_jax.config.model import NemotronHConfig  # noqa: E402
from nemo_jax.data.chat import ChatTokenizer, resolve  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ASSETS = os.path.join(ROOT, "nemo_jax", "assets")
TOKENIZER = "builtin:tiny_vl"
MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a city in France."}]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather of a city",
                                           "parameters": {"type": "object", "properties": {
                                               "city": {"type": "string"}, "days": {"type": "integer"}}}}}]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env():
    return dict(os.environ, PYTHONPATH=ROOT, XLA_FLAGS=FAST_COMPILE, JAX_PLATFORMS="cpu",
                NEMO_JAX_COMPILATION_CACHE="off")


class Server:
    """`nemo-jax serve ...` in a subprocess on a free port; `.client` is an openai.OpenAI on it (with `api_key`:
    the server is started with it, every request sends it). `env`: more environment variables (over the tests');
    `launcher`: the command it runs under (launch/local/run.sh ... --: several processes)."""

    def __init__(self, tmp, args, api_key: str | None = None, warm: bool = False, env: dict | None = None,
                 launcher=()):
        self.key = api_key
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(tmp / f"serve-{self.port}.log", "w+")
        env = dict(_env(), **(env or {}), **({"NEMO_JAX_API_KEY": api_key} if api_key else {}))
        args = list(args) + ([] if warm else ["--no-warmup"])  # (tests compile what they use, as they use it)
        self.proc = subprocess.Popen([*launcher, sys.executable, "-m", "nemo_jax.cli", "serve", *args, "--port",
                                      str(self.port)], env=env, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.time() + 600
        while time.time() < deadline:
            assert self.proc.poll() is None, self.output()
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        else:
            raise AssertionError("server did not come up:\n" + self.output())
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key=api_key or "none", max_retries=0, timeout=300)

    def output(self) -> str:
        self.log.flush()
        self.log.seek(0)
        return self.log.read()[-4000:]

    def post(self, path, body, **kw):
        return httpx.post(self.url + path, json=body, timeout=300, headers=self.headers, **kw)

    def get(self, path, **kw):
        return httpx.get(self.url + path, timeout=300, headers=self.headers, **kw)

    def close(self):
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """The shipped tiny vision-language config cut to two language layers (Mamba, attention: fast compiles),
    random weights (+ a random attention adapter set, vLLM layout), served."""
    from nemo_jax.checkpoint import save_model
    from nemo_jax.lora import LoraConfig, adapter_specs
    from nemo_jax.lora.peft import save_peft
    from nemo_jax.model import init
    from nemo_jax.model.spec import ParamSpec

    tmp = tmp_path_factory.mktemp("serve")
    with open(os.path.join(ASSETS, "models", "tiny-vl.json")) as f:
        hf = json.load(f)
    hf["text_config"].update(layers_block_type=["linear_attention", "full_attention"], num_hidden_layers=2)
    cfg = NemotronHConfig.from_hf_dict(hf)
    params = init(cfg, jax.random.key(0))
    save_model(str(tmp / "model"), cfg, params, tokenizer_dir=resolve(TOKENIZER))
    lc = LoraConfig(targets=("attention",), rank=4, alpha=8.0)
    rng = np.random.RandomState(0)
    ad = jax.tree_util.tree_map_with_path(
        lambda p, sp: np.full(sp.shape, lc.scale, np.float32) if p[-1].key == "lora_scale"
        else (0.5 * rng.randn(*sp.shape)).astype(np.float32), adapter_specs(cfg, lc),
        is_leaf=lambda x: isinstance(x, ParamSpec))
    save_peft(cfg, ad, tmp / "adapter", format="vllm", lora_config=lc)
    srv = Server(tmp, ["--ckpt", str(tmp / "model"), "--adapters", f"a1={tmp / 'adapter'}", "--max-num-seqs", "4",
                       "--max-model-len", "640", "--bucket", "64", "--served-model-name", "tiny",
                       "--enable-runtime-lora-updating", "--adapter-root", str(tmp),
                       "--allowed-local-media-path", os.path.join(ASSETS, "tiny_vl_chat"),
                       "--max-waiting-queue-length", "4"], api_key="sekrit")
    try:
        yield srv, tmp, cfg, params, ad
    finally:
        srv.close()


def _tok():
    return ChatTokenizer.load(TOKENIZER)


def _learner_logprobs(cfg, params, prompt, completion, temperature, adapters=None):
    """What the learner computes for a sampled completion: log softmax(logits / T) at each sampled token."""
    from nemo_jax.lora import attach
    from nemo_jax.model import forward

    seq = jnp.asarray([prompt + completion])
    logits = forward(attach(params, adapters), seq, cfg)[0][0, len(prompt) - 1:-1]
    lp = jax.nn.log_softmax(logits.astype(jnp.float32) / temperature, axis=-1)
    return np.asarray(jnp.take_along_axis(lp, jnp.asarray(completion)[:, None], axis=-1)[:, 0])


# ----------------------------------------------------------------------------- chat
@pytest.mark.slow
def test_chat_logprobs_token_ids_n_and_seeds(served):
    srv, _, cfg, params, _ = served
    c = srv.client
    kw = dict(model="tiny", messages=MESSAGES, max_tokens=10, temperature=1.0, n=3, logprobs=True,
              extra_body={"return_token_ids": True, "return_tokens_as_token_ids": True, "ignore_eos": True})
    r = c.chat.completions.create(seed=7, **kw)
    tok = _tok()
    want_prompt = tok.tokenizer.encode(tok.render(MESSAGES, add_generation_prompt=True), add_special_tokens=False).ids
    assert r.model_extra["prompt_token_ids"] == want_prompt and r.usage.prompt_tokens == len(want_prompt)
    assert [ch.index for ch in r.choices] == [0, 1, 2] and r.usage.completion_tokens == 30
    ids = [ch.model_extra["token_ids"] for ch in r.choices]
    for ch, t in zip(r.choices, ids):
        assert len(t) == 10 and ch.finish_reason == "length"
        assert [e.token for e in ch.logprobs.content] == [f"token_id:{i}" for i in t]
        assert ch.message.content == tok.tokenizer.decode(t, skip_special_tokens=True)
    assert len({tuple(t) for t in ids}) == 3  # n samples, not one repeated
    # behaviour logprobs are the learner's (temperature 1, no truncation): what GRPO's importance ratios need
    got = [e.logprob for e in r.choices[0].logprobs.content]
    np.testing.assert_allclose(got, _learner_logprobs(cfg, params, want_prompt, ids[0], 1.0), atol=2e-4)
    # seeds: the same request samples the same tokens; another seed other tokens
    again = c.chat.completions.create(seed=7, **kw)
    assert [ch.model_extra["token_ids"] for ch in again.choices] == ids
    other = c.chat.completions.create(seed=8, **kw)
    assert [ch.model_extra["token_ids"] for ch in other.choices] != ids


def test_greedy_equals_generate_and_top_logprobs(served, capsys):
    from nemo_jax.cli import main

    srv, tmp, _, _, _ = served
    prompt = "Say something about Paris."
    capsys.readouterr()
    main(["generate", "--ckpt", str(tmp / "model"), "--prompt", prompt, "--temperature", "0", "--max-new-tokens", "12"])
    said = capsys.readouterr().out
    r = srv.client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": prompt}], max_tokens=12,
                                           temperature=0, logprobs=True, top_logprobs=5)
    assert r.choices[0].message.content == said[:-1]  # (generate ends its output with a newline)
    for e in r.choices[0].logprobs.content:  # greedy: the sampled token is the top alternative, same logprob
        assert len(e.top_logprobs) == 5 and e.top_logprobs[0].token == e.token
        assert e.top_logprobs[0].logprob == pytest.approx(e.logprob, abs=1e-4)
        assert [a.logprob for a in e.top_logprobs] == sorted((a.logprob for a in e.top_logprobs), reverse=True)


def test_stop_strings(served):
    srv = served[0]
    kw = dict(model="tiny", messages=MESSAGES, max_tokens=16, temperature=0, extra_body={"ignore_eos": True})
    full = srv.client.chat.completions.create(**kw).choices[0].message.content
    stop = full[5:8]
    cut = full[: full.find(stop)]
    r = srv.client.chat.completions.create(stop=[stop, "never-there"], **kw).choices[0]
    assert r.message.content == cut and r.finish_reason == "stop" and r.model_extra["stop_reason"] == stop
    kw["extra_body"] = {"ignore_eos": True, "include_stop_str_in_output": True}
    assert srv.client.chat.completions.create(stop=stop, **kw).choices[0].message.content == cut + stop


def test_tools_render_and_parse(served):
    from nemo_jax.serve.openai import Options, Prompt, Sample, choice

    srv = served[0]
    convo = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function", "function": {
            "name": "get_weather", "arguments": json.dumps({"city": "Paris", "days": 2})}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny, 21 C"}]
    t = srv.post("/tokenize", {"model": "tiny", "messages": convo, "tools": TOOLS}).json()
    text = _tok().tokenizer.decode(t["tokens"], skip_special_tokens=False)
    assert "get_weather(city, days): The weather of a city" in text  # the tool, rendered by the chat template
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}</tool_call>' in text
    assert "sunny, 21 C" in text
    r = srv.client.chat.completions.create(model="tiny", messages=convo, tools=TOOLS, max_tokens=4, temperature=0)
    assert r.usage.prompt_tokens == t["count"] and r.choices[0].message.tool_calls == []
    # a sampled tool call comes back as `tool_calls` (what the model writes, parsed with the tools' types)
    tok = _tok()
    said = "Checking.\n<tool_call>\n<function=get_weather>\n<parameter=city>\n42\n</parameter>\n<parameter=days>\n3\n" \
           "</parameter>\n</function>\n</tool_call><|im_end|>"
    ids = tok.tokenizer.encode(said, add_special_tokens=False).ids
    out, n = choice(tok, 0, Sample(ids, [-0.1] * len(ids), "stop"), Prompt([1]), Options(tools=TOOLS), chat=True)
    assert out["finish_reason"] == "tool_calls" and out["message"]["content"] == "Checking." and n == len(ids)
    (call,) = out["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "42", "days": 3}  # city is a string in the schema


def test_adapters_by_name(served):
    srv, tmp, cfg, params, ad = served
    c = srv.client
    models = {m.id: m for m in c.models.list().data}
    assert set(models) == {"tiny", "a1"} and models["a1"].model_extra["parent"] == "tiny"
    kw = dict(messages=MESSAGES, max_tokens=10, temperature=1.0, seed=3, logprobs=True,
              extra_body={"return_token_ids": True, "ignore_eos": True})
    base = c.chat.completions.create(model="tiny", **kw).choices[0]
    a1 = c.chat.completions.create(model="a1", **kw).choices[0]
    tok = _tok()
    prompt = tok.tokenizer.encode(tok.render(MESSAGES, add_generation_prompt=True), add_special_tokens=False).ids
    lp = [e.logprob for e in a1.logprobs.content]
    np.testing.assert_allclose(lp, _learner_logprobs(cfg, params, prompt, a1.model_extra["token_ids"], 1.0,
                                                     jax.tree.map(jnp.asarray, ad)), atol=2e-4)
    assert not np.allclose([e.logprob for e in base.logprobs.content], lp, atol=1e-3)
    assert srv.post("/v1/unload_lora_adapter", {"lora_name": "a1"}).status_code == 200
    with pytest.raises(openai.NotFoundError):
        c.chat.completions.create(model="a1", **kw)
    r = srv.post("/v1/load_lora_adapter", {"lora_name": "a2", "lora_path": str(tmp / "adapter")})
    assert r.status_code == 200 and "a2" in r.text
    again = c.chat.completions.create(model="a2", **kw).choices[0]
    assert again.model_extra["token_ids"] == a1.model_extra["token_ids"]
    assert srv.post("/v1/load_lora_adapter", {"lora_name": "a2", "lora_path": str(tmp / "adapter")}).status_code == 400
    assert srv.post("/v1/load_lora_adapter", {"lora_name": "a2", "lora_path": str(tmp / "adapter"),
                                              "load_inplace": True}).status_code == 200
    assert srv.post("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": str(tmp / "nope")}).status_code == 404
    assert srv.post("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": str(tmp / "model")}).status_code == 400


def test_completions_errors_and_metrics(served):
    srv = served[0]
    c = srv.client
    r = c.completions.create(model="tiny", prompt=[5, 6, 7, 8], max_tokens=5, temperature=0, logprobs=2,
                             extra_body={"return_token_ids": True})
    ch = r.choices[0]
    assert ch.model_extra["prompt_token_ids"] == [5, 6, 7, 8] and len(ch.model_extra["token_ids"]) == 5
    assert len(ch.logprobs.tokens) == 5 and all(len(t) == 2 for t in ch.logprobs.top_logprobs)
    two = c.completions.create(model="tiny", prompt=["a b", "c d e"], max_tokens=3, temperature=0, n=2)
    assert [x.index for x in two.choices] == [0, 1, 2, 3]
    for bad in (dict(echo=True), dict(max_tokens=5000), dict(extra_body={"functions": []}),
                dict(extra_body={"foo": 1}), dict(extra_body={"top_k": 2 ** 31}), dict(presence_penalty=3.0)):
        with pytest.raises(openai.BadRequestError):
            c.completions.create(model="tiny", prompt="hi", **{"max_tokens": 3, **bad})
    with pytest.raises(openai.NotFoundError):
        c.completions.create(model="nope", prompt="hi", max_tokens=3)
    text = srv.get("/metrics").text
    m = {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines() if not line.startswith("#")}
    assert m['nemo_jax_requests_total{endpoint="/v1/completions",status="200"}'] >= 2
    assert m['nemo_jax_requests_total{endpoint="/v1/completions",status="404"}'] >= 1
    assert m["nemo_jax_generation_tokens_total"] >= 17 and m["nemo_jax_num_requests_running"] == 0
    assert m["nemo_jax_decode_steps_total"] > 0 and "nemo_jax_num_requests_waiting" in m


# ----------------------------------------------------------------------------- images (the model is a VL one)
@pytest.mark.slow
def test_image_requests(served):
    from PIL import Image

    from nemo_jax.data.images import picture_tokens

    srv, _, cfg, _, _ = served
    png = os.path.join(ASSETS, "tiny_vl_chat", "images", "img00001.png")
    with open(png, "rb") as f:
        url = "data:image/png;base64," + base64.b64encode(f.read()).decode()
    ask = lambda parts: srv.client.chat.completions.create(  # noqa: E731
        model="tiny", messages=[{"role": "user", "content": parts}], max_tokens=4, temperature=0, logprobs=True,
        extra_body={"return_token_ids": True})
    text = ask([{"type": "text", "text": "What is shown?"}])
    data = ask([{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "What is shown?"}])
    path = ask([{"type": "image_url", "image_url": {"url": png}}, {"type": "text", "text": "What is shown?"}])
    ids = data.model_extra["prompt_token_ids"]
    want = picture_tokens(cfg.vision, Image.open(png))  # the picture widened to its own number of image tokens
    assert ids.count(cfg.vision.image_token_id) == want
    assert data.usage.prompt_tokens == text.usage.prompt_tokens + want + 2  # (+ <img> and </img>)
    assert path.model_extra["prompt_token_ids"] == ids  # a data URL and a file path: the same prompt, same output
    assert path.choices[0].model_extra["token_ids"] == data.choices[0].model_extra["token_ids"]
    assert data.choices[0].logprobs.content[0].logprob != text.choices[0].logprobs.content[0].logprob
    with pytest.raises(openai.BadRequestError, match="cannot read image"):
        ask([{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}])


# ----------------------------------------------------------------------------- streaming, load, lifecycle
def _sse_events(lines) -> list:
    out = []
    for line in lines:
        if line.startswith("data: "):
            data = line[len("data: "):]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def test_streaming_equals_the_response_at_temperature_0(served):
    """Greedy chat streamed through the official client's iterator and completions parsed as raw SSE: the text,
    token ids and logprobs of the chunks are the non-streamed response's; usage comes in a last chunk; [DONE]."""
    srv = served[0]
    c = srv.client
    kw = dict(model="tiny", messages=MESSAGES, max_tokens=12, temperature=0, logprobs=True, top_logprobs=5,
              extra_body={"ignore_eos": True, "return_token_ids": True})
    whole = c.chat.completions.create(**kw)
    text, ids, lps, usage, reasons = "", [], [], None, []
    for ch in c.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw):
        for x in ch.choices:
            text += x.delta.content or ""
            ids += x.model_extra.get("token_ids") or []
            lps += x.logprobs.content if x.logprobs else []
            reasons.append(x.finish_reason)
        usage = ch.usage or usage
    w = whole.choices[0]
    assert text == w.message.content and ids == w.model_extra["token_ids"] and reasons[-1] == w.finish_reason
    assert [(e.token, e.logprob, [a.token for a in e.top_logprobs]) for e in lps] == \
        [(e.token, e.logprob, [a.token for a in e.top_logprobs]) for e in w.logprobs.content]
    assert usage.model_dump() == whole.usage.model_dump()
    body = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 9, "temperature": 0, "stop": ["zz"], "n": 2,
            "ignore_eos": True}
    plain = srv.post("/v1/completions", body).json()
    with httpx.stream("POST", srv.url + "/v1/completions", json={**body, "stream": True}, headers=srv.headers,
                      timeout=300) as r:
        events = _sse_events(r.iter_lines())
    assert events[-1] == "[DONE]" and all(e["object"] == "text_completion" for e in events[:-1])
    for i in range(2):
        assert "".join(x["text"] for e in events[:-1] for x in e["choices"] if x["index"] == i) == \
            plain["choices"][i]["text"]


def test_penalties_and_logit_bias_through_the_server(served):
    """A logit bias of +100 makes greedy sampling pick its token every time; a frequency penalty keeps a greedy
    turn from repeating itself as the unpenalised one does; min_tokens holds the end-of-turn token off."""
    srv = served[0]
    c = srv.client
    kw = dict(model="tiny", prompt=[5, 6, 7], max_tokens=8, temperature=0, extra_body={"return_token_ids": True})
    r = c.completions.create(logit_bias={"77": 100}, **kw)
    assert r.choices[0].model_extra["token_ids"] == [77] * 8
    free = c.completions.create(**kw).choices[0].model_extra["token_ids"]
    pen = c.completions.create(frequency_penalty=2.0, presence_penalty=2.0, **kw).choices[0].model_extra["token_ids"]
    assert len(set(pen)) >= len(set(free)) and len(set(pen)) == len(pen)
    eos = _tok().eos_ids()[0]
    r = c.completions.create(model="tiny", prompt=[5, 6, 7], max_tokens=6, temperature=0,
                             logit_bias={str(eos): 100}, extra_body={"min_tokens": 3, "return_token_ids": True})
    assert r.choices[0].model_extra["token_ids"] == r.choices[0].model_extra["token_ids"][:3] + [eos]
    assert eos not in r.choices[0].model_extra["token_ids"][:3] and r.choices[0].finish_reason == "stop"


def test_a_full_server_answers_429_and_a_closed_stream_frees_its_rows(served):
    """4 rows and a waiting queue of 4: a stream of n=8 fills both, another request is refused with 429 and
    Retry-After; closing the stream frees its rows at once (the next request is served long before its 8 x 500
    tokens would have been sampled)."""
    srv = served[0]
    body = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 500, "n": 8, "stream": True, "ignore_eos": True}
    small = {"model": "tiny", "prompt": "hi", "max_tokens": 2}
    steps = lambda m: int(re.search(r"nemo_jax_decode_steps_total (\d+)", m).group(1))  # noqa: E731
    before = steps(srv.get("/metrics").text)
    with httpx.Client(headers=srv.headers, timeout=300) as h:
        with h.stream("POST", srv.url + "/v1/completions", json=body) as first:
            assert first.status_code == 200
            r = h.post(srv.url + "/v1/completions", json=small)
            assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1
            assert r.json()["error"]["type"] == "RateLimitError"
            assert next(x for x in first.iter_lines() if x.startswith("data:"))
        t0, rejected = time.time(), 1
        while (r := h.post(srv.url + "/v1/completions", json=small)).status_code == 429 and time.time() - t0 < 120:
            rejected += 1  # (the close reaches the server a moment after the client made it: later on a busy host)
            time.sleep(0.05)
        assert r.status_code == 200, r.text
    deadline = time.time() + 120  # (the close reaches the server a moment later)
    while time.time() < deadline:
        m = srv.get("/metrics").text
        if "nemo_jax_cancelled_total 1" in m and "nemo_jax_num_requests_running 0" in m:
            break
        time.sleep(0.1)
    assert "nemo_jax_cancelled_total 1" in m
    assert f'nemo_jax_requests_rejected_total{{reason="queue_full"}} {rejected}' in m
    assert steps(m) - before < 500  # (8 x 500 tokens in 4 rows: 1000 steps)


def test_zz_sigterm_finishes_running_requests_and_exits_0(served):
    """(Last in the module: it stops the module's server.) SIGTERM while a request runs: the request finishes,
    new connections are refused, the process exits 0 within the grace period."""
    srv = served[0]
    out = []
    t = threading.Thread(target=lambda: out.append(srv.post("/v1/completions", {
        "model": "tiny", "prompt": [5, 6, 7], "max_tokens": 300, "ignore_eos": True})))
    t.start()
    deadline = time.time() + 60
    while "nemo_jax_num_requests_running 1" not in srv.get("/metrics").text and time.time() < deadline:
        time.sleep(0.05)
    srv.proc.send_signal(signal.SIGTERM)
    t.join(120)
    assert out and out[0].status_code == 200 and out[0].json()["usage"]["completion_tokens"] == 300
    assert srv.proc.wait(60) == 0, srv.output()
    assert "nemo-jax serve: stopped" in srv.output()
    with pytest.raises(httpx.ConnectError):
        httpx.get(srv.url + "/health", timeout=2)
