"""`nemo-jax serve`'s vLLM token-in / token-out routes (`/inference/v1/generate`, `/inference/v1/abort_requests`,
nemo_jax.serve.tokens) on a real server process over raw HTTP, checked against the same server's OpenAI routes and
the learner's forward: vLLM 0.32's response shape, greedy tokens and logprobs, the top alternatives as vLLM lists
them, stop reasons, the adapter by name and its weight version, min-p applied, the accepted no-op fields and the
refused ones, and an abort that answers what was drawn. (Against a real vLLM: tests/test_vllm.py, `-m vllm`.)"""

import re
import threading
import time

import httpx
import numpy as np
import pytest

pytest.importorskip("openai", reason="serving tests call the server with the openai client")
pytest.importorskip("fastapi", reason="nemo-jax serve needs fastapi + uvicorn (pip install -e '.[serve]')")

from test_serve import MESSAGES, _learner_logprobs, _tok, served  # noqa: E402,F401  (the module's server)

PROMPT = [5, 6, 7, 8, 9]


def _generate(srv, sampling, **body):
    r = srv.post("/inference/v1/generate", dict({"model": "tiny", "token_ids": PROMPT, "sampling_params": sampling},
                                                **body))
    assert r.status_code == 200, r.text
    return r.json()


def test_greedy_generate_is_the_completions_route_and_the_learner(served):
    srv, _, cfg, params, ad = served
    out = _generate(srv, {"max_tokens": 8, "temperature": 0, "logprobs": 3, "ignore_eos": True},
                    request_id="abc", return_token_ids=True, cache_salt="salt-7")
    assert out["request_id"] == "generate-tokens-abc" and out["model"] == "tiny" and out["output_mode"] == "tokens"
    assert out["prompt_token_ids"] == PROMPT
    assert out["usage"] == {"prompt_tokens": 5, "completion_tokens": 8, "total_tokens": 13,
                            "prompt_tokens_details": None, "completion_tokens_details": None}
    (ch,) = out["choices"]
    assert ch["index"] == 0 and ch["finish_reason"] == "length" and ch["stop_reason"] is None
    assert ch["weight_versions"] == [{"version": "tiny:0", "start": 0, "end": 8}]
    ref = srv.client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0, logprobs=1,
                                        extra_body={"return_token_ids": True, "ignore_eos": True}).choices[0]
    assert ch["token_ids"] == ref.model_extra["token_ids"]
    content = ch["logprobs"]["content"]
    lps = [e["logprob"] for e in content]
    np.testing.assert_allclose(lps, ref.logprobs.token_logprobs, atol=1e-6)
    np.testing.assert_allclose(lps, _learner_logprobs(cfg, params, PROMPT, ch["token_ids"], 1.0), atol=2e-4)
    for t, e in zip(ch["token_ids"], content):
        # vLLM's entry (+ the "token" verifiers' renderer client reads); greedy: rank 1, the sampled token first
        assert e["token_id"] == t and e["token"] == f"token_id:{t}" and e["rank"] == 1
        tops = e["top_logprobs"]
        assert len(tops) == 3 and tops[0]["token_id"] == t and tops[0]["logprob"] == e["logprob"]
        assert [x["rank"] for x in tops] == [1, 2, 3] and len({x["token_id"] for x in tops}) == 3
        assert tops[1]["logprob"] >= tops[2]["logprob"]
    # the header's request id wins, as vLLM's; logprobs 0: the sampled token alone
    r = httpx.post(srv.url + "/inference/v1/generate", json={"token_ids": PROMPT, "sampling_params": {
        "max_tokens": 2, "logprobs": 0}}, headers={**srv.headers, "X-Request-Id": "hdr"}, timeout=300)
    assert r.json()["request_id"] == "generate-tokens-hdr"
    assert [len(e["top_logprobs"]) for e in r.json()["choices"][0]["logprobs"]["content"]] == [1, 1]
    # the adapter by name: its own tokens (as on the OpenAI route) and its weight version
    out = _generate(srv, {"max_tokens": 8, "temperature": 0, "logprobs": 0, "ignore_eos": True}, model="a1")
    ref = srv.client.completions.create(model="a1", prompt=PROMPT, max_tokens=8, temperature=0,
                                        extra_body={"return_token_ids": True, "ignore_eos": True}).choices[0]
    assert out["model"] == "a1" and out["choices"][0]["token_ids"] == ref.model_extra["token_ids"]
    version = out["choices"][0]["weight_versions"][0]["version"]
    assert version.startswith("a1:") and version != "a1:0"


def test_stop_reasons_text_mode_n_and_min_p(served):
    srv = served[0]
    free = _generate(srv, {"max_tokens": 10, "temperature": 0, "ignore_eos": True})["choices"][0]["token_ids"]
    stop_id = free[3]
    cut = free[: free.index(stop_id) + 1]
    ch = _generate(srv, {"max_tokens": 10, "temperature": 0, "ignore_eos": True,
                         "stop_token_ids": [stop_id]})["choices"][0]
    assert ch["token_ids"] == cut and ch["finish_reason"] == "stop" and ch["stop_reason"] == stop_id
    tok = _tok()
    text = tok.tokenizer.decode(free, skip_special_tokens=True)
    stop = text[4:7]
    out = _generate(srv, {"max_tokens": 10, "temperature": 0, "ignore_eos": True, "stop": [stop], "logprobs": 2},
                    output_mode="text")
    ch = out["choices"][0]
    assert out["output_mode"] == "text" and ch["finish_reason"] == "stop" and ch["stop_reason"] == stop
    assert ch["text"] == text[: text.find(stop)]
    assert [e["top_logprobs"] for e in ch["logprobs"]["content"]][0][0]["bytes"]  # (OpenAI shapes in text mode)
    # n samples at temperature 1, seeded; min_p 1 keeps only the likeliest token: greedy
    out = _generate(srv, {"max_tokens": 6, "temperature": 1.0, "n": 3, "seed": 3, "ignore_eos": True})
    assert [c["index"] for c in out["choices"]] == [0, 1, 2] and out["usage"]["completion_tokens"] == 18
    assert len({tuple(c["token_ids"]) for c in out["choices"]}) > 1
    greedy = _generate(srv, {"max_tokens": 6, "temperature": 1.0, "min_p": 1.0, "seed": 3, "logprobs": 0,
                             "ignore_eos": True})["choices"][0]
    assert greedy["token_ids"] == free[:6]
    assert all(e["logprob"] == pytest.approx(0.0, abs=1e-6) for e in greedy["logprobs"]["content"])


def test_accepted_and_refused_fields(served):
    srv = served[0]
    ok = {"max_tokens": 2, "flat_logprobs": True, "extra_args": {"x": 1}, "detokenize": False,
          "skip_special_tokens": False, "spaces_between_special_tokens": True, "prompt_logprobs": None}
    assert _generate(srv, ok, priority=0, cache_salt="s")["choices"][0]["token_ids"]
    bad = [({"sampling_params": {"max_tokens": 2, "bogus": 1}}, "sampling_params.bogus"),
           ({"sampling_params": {"max_tokens": 2, "prompt_logprobs": 1}}, "sampling_params.prompt_logprobs"),
           ({"sampling_params": {"max_tokens": 2, "logprobs": 21}}, "sampling_params.logprobs"),
           ({"sampling_params": {"temperature": -1}}, "sampling_params.temperature"),
           ({"sampling_params": {"max_tokens": 2}, "stream": True}, "stream"),
           ({"sampling_params": {"max_tokens": 2}, "priority": 1}, "priority"),
           ({"sampling_params": {"max_tokens": 2}, "features": {"mm_hashes": {}}}, "features"),
           ({"sampling_params": {"max_tokens": 2}, "token_ids": []}, "token_ids"),
           ({"sampling_params": {"max_tokens": 2}, "token_ids": [10 ** 9]}, "token_ids"),
           ({"sampling_params": {"max_tokens": 10 ** 6}}, "sampling_params.max_tokens"),
           ({"sampling_params": {"max_tokens": 2}, "what": 1}, "what"),
           ({"sampling_params": {"max_tokens": 2}, "model": "nope"}, "model")]
    for body, param in bad:
        r = srv.post("/inference/v1/generate", {"token_ids": PROMPT, **body})
        assert r.status_code in (400, 404), (body, r.text)
        assert r.json()["error"]["param"] == param or param == "model", (body, r.json())
    # the chat route takes cache_salt and reasoning_effort (the bundled templates do not read it)
    r = srv.client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2, reasoning_effort="low",
                                           extra_body={"cache_salt": "s"})
    assert r.choices
    assert srv.post("/v1/chat/completions", {"messages": MESSAGES, "reasoning_effort": "max"}).status_code == 400
    assert srv.post("/inference/v1/abort_requests", {"ids": ["x"]}).status_code == 400


def test_abort_answers_what_was_drawn(served):
    srv = served[0]
    got = {}

    def long():
        got["r"] = srv.post("/inference/v1/generate", {"model": "tiny", "token_ids": PROMPT, "request_id": "long",
                                                       "sampling_params": {"max_tokens": 400, "ignore_eos": True,
                                                                           "logprobs": 0}})
    t = threading.Thread(target=long)

    def sampled() -> float:
        return float(re.search(r"^nemo_jax_generation_tokens_total (\S+)$", srv.get("/metrics").text, re.M).group(1))
    before, deadline = sampled(), time.time() + 120
    t.start()
    while time.time() < deadline and sampled() < before + 8:  # (the request is under way)
        time.sleep(0.05)
    assert srv.post("/inference/v1/abort_requests", {"request_ids": ["generate-tokens-long", "gone"]}).status_code \
        == 200
    t.join(120)
    ch = got["r"].json()["choices"][0]
    assert ch["finish_reason"] == "abort" and ch["stop_reason"] is None
    assert 0 < len(ch["token_ids"]) < 400 and len(ch["logprobs"]["content"]) == len(ch["token_ids"])
    # the rows are free again: the next request runs
    assert _generate(srv, {"max_tokens": 2})["choices"][0]["token_ids"]
