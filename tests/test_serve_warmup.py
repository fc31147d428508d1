"""`nemo-jax serve`'s warm-up and compilation cache: after ready, no first request of a common kind compiles; a
restart loads its programs from the persistent cache; the Engine's shapes are few."""

import json
import os
import re
import threading

import jax
import numpy as np
import pytest

pytest.importorskip("fastapi", reason="nemo-jax serve needs fastapi + uvicorn (pip install -e '.[serve]')")
pytest.importorskip("openai", reason="the tests call the server with the openai client")

from nemo_jax.serve.warmup import DEFAULT_CACHE, CompileCounter, cache_dir, row_counts, warm_up  # noqa: E402

from helpers import micro_model, tiny_cfg  # noqa: E402


def test_row_counts_and_cache_dir(monkeypatch):
    assert row_counts(1) == [1] and row_counts(5) == [1, 4, 5] and row_counts(16) == [1, 4, 16]
    assert row_counts(64) == [1, 4, 16, 64] and row_counts(20) == [1, 4, 16, 20]
    monkeypatch.delenv("NEMO_JAX_COMPILATION_CACHE", raising=False)
    assert cache_dir(None) == DEFAULT_CACHE and cache_dir("off") is None and cache_dir("") is None
    monkeypatch.setenv("NEMO_JAX_COMPILATION_CACHE", "none")
    assert cache_dir(None) is None and cache_dir("/tmp/x") == "/tmp/x"


@pytest.mark.slow
def test_a_warm_engine_compiles_nothing_for_any_kind_of_request():
    """In-process, a 2-row engine of a two-layer model: after `warm_up`, sequences of every kind (sampling,
    greedy, a long prompt of many pieces, top logprobs, stop strings, penalties and a logit bias, top-k / top-p,
    a chunk of a row count never run alone, a fed continuation) compile nothing, and sample as asked."""
    from nemo_jax.generate import Engine, SamplingParams
    from nemo_jax.model import init

    cfg = tiny_cfg("*-")
    engine = Engine(init(cfg, jax.random.key(0)), cfg, batch=2, max_len=96, bucket=8, check_every=3,
                    token_bytes=[b"%d " % i for i in range(cfg.vocab_size)])
    said = []
    w = warm_up(engine, say=said.append)
    assert w.items == len(said) == 3 and w.compiled > 0 and "2 rows, plain sampling" in said[1]
    assert engine.decode_steps == engine.tokens_sampled == 0 and not any(engine.rows)
    sp = lambda **kw: SamplingParams(max_new_tokens=5, **kw)  # noqa: E731
    kinds = [[sp()], [sp(temperature=0.0)], [sp(top_logprobs=3)], [sp(stop=("1 ",))], [sp(top_k=3, top_p=0.5)],
             [sp(presence_penalty=0.5, repetition_penalty=1.2, logit_bias=((3, 1.0),), min_tokens=2)],
             [sp(), sp(temperature=0.0, top_logprobs=1)]]
    with CompileCounter() as counter:
        for i, sps in enumerate(kinds):
            prompt = list(range(1, 60 if i == 0 else 5))  # (60 tokens: 8 pieces of the bucket)
            ids = {engine.submit(prompt, s, tag=j) for j, s in enumerate(sps)}
            ends = []
            while len(ends) < len(ids):
                ends += engine.step()
            for e in ends:
                want = sps[e.tag]
                assert len(e.tokens) == 5 or e.finish_reason == "stop"
                assert (e.top is not None) == bool(want.top_logprobs) and len(e.top or e.tokens) == len(e.tokens)
                if i == 0:  # a fed continuation: appended in place, another turn
                    engine.feed(e.seq_id, [7, 8, 9])
                    while not engine.step():
                        pass
                engine.release(e.seq_id)
    assert counter.compiled == 0, f"{counter.compiled} programs compiled after the warm-up"


@pytest.mark.slow
def test_a_warm_server_compiles_nothing_on_first_requests_and_restarts_from_its_cache(tmp_path):
    """A real `nemo-jax serve` (two-layer model, an adapter, 2 rows) with its warm-up on: it says its progress and
    warm-up time before ready; then the first request of each kind (sampling, greedy chat, logprobs with top
    logprobs, tools, stop strings, n=2 with penalties, the adapter, two at once) compiles nothing
    (`compiles_since_ready` in /metrics stays 0). Restarted on the same compilation cache it loads its programs
    from it."""
    from nemo_jax.checkpoint import save_model
    from nemo_jax.config.model import NemotronHConfig
    from nemo_jax.data.chat import resolve
    from nemo_jax.lora import LoraConfig, init_adapters
    from nemo_jax.lora.peft import save_peft
    from nemo_jax.model import init

    from test_serve import Server

    with open(micro_model(tmp_path)) as f:
        cfg = NemotronHConfig.from_hf_dict(json.load(f))
    save_model(str(tmp_path / "model"), cfg, init(cfg, jax.random.key(0)), tokenizer_dir=resolve("builtin:tiny"))
    lc = LoraConfig(targets=("attention",), rank=4, alpha=8.0)
    ad = jax.tree.map(lambda x: x + 0.1, init_adapters(cfg, lc))
    save_peft(cfg, jax.tree.map(np.asarray, ad), tmp_path / "adapter", format="vllm", lora_config=lc)
    args = ["--ckpt", str(tmp_path / "model"), "--adapters", f"a1={tmp_path / 'adapter'}", "--max-num-seqs", "2",
            "--max-model-len", "256", "--bucket", "16", "--served-model-name", "m", "--compilation-cache",
            str(tmp_path / "xla")]

    def compiles(srv) -> int:
        text = srv.get("/metrics").text
        return int(float(re.search(r"^nemo_jax_compiles_since_ready (\S+)$", text, re.M).group(1)))

    srv = Server(tmp_path, args, warm=True)
    try:
        out = srv.output()
        assert re.search(r"warm-up 1/6: base model, 1 row, plain sampling \(\d", out), out
        assert "warm-up 6/6: adapter structure 1, 1 row, every extra" in out, out
        first = re.search(r"warm-up done in [\d.]+ s \((\d+) programs compiled, (\d+) loaded", out)
        assert first and int(first.group(1)) > 0, out
        c = srv.client
        msg = [{"role": "user", "content": "Name a city."}]
        tools = [{"type": "function", "function": {"name": "weather", "description": "the weather in a city",
                                                    "parameters": {"type": "object", "properties": {
                                                        "city": {"type": "string"}}}}}]
        kinds = {
            "sampling": lambda: c.completions.create(model="m", prompt=[5, 6, 7], max_tokens=6, temperature=1.0),
            "greedy chat": lambda: c.chat.completions.create(model="m", messages=msg, max_tokens=6, temperature=0),
            "logprobs": lambda: c.chat.completions.create(model="m", messages=msg, max_tokens=6, logprobs=True,
                                                          top_logprobs=3),
            "tools": lambda: c.chat.completions.create(model="m", messages=msg, max_tokens=6, tools=tools),
            "stop strings": lambda: c.completions.create(model="m", prompt="Paris is", max_tokens=6,
                                                         stop=["e", "zz"]),
            "n=2, penalties": lambda: c.completions.create(model="m", prompt="Paris", max_tokens=6, n=2,
                                                           presence_penalty=0.5, frequency_penalty=0.2),
            "the adapter": lambda: c.chat.completions.create(model="a1", messages=msg, max_tokens=6),
        }
        for kind, call in kinds.items():
            r = call()
            assert r.choices, kind
            assert compiles(srv) == 0, f"the first {kind} request compiled"
        both = [threading.Thread(target=kinds["sampling"]) for _ in range(2)]
        for t in both:
            t.start()
        for t in both:
            t.join()
        assert compiles(srv) == 0, "two at once compiled"
    finally:
        srv.close()
    srv = Server(tmp_path, args, warm=True)  # the same cache: a restart loads every program
    try:
        again = re.search(r"warm-up done in [\d.]+ s \((\d+) programs compiled, (\d+) loaded", srv.output())
        # (most, not always all: one loaded run in four compiled 8 of 32 afresh on this shared host)
        assert again and int(again.group(2)) >= 0.75 * int(first.group(1)) > int(again.group(1)), srv.output()
        assert srv.client.completions.create(model="m", prompt=[5, 6], max_tokens=3).choices
        assert compiles(srv) == 0
    finally:
        srv.close()
    assert os.listdir(tmp_path / "xla")
