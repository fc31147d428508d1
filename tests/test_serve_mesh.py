"""`nemo-jax serve --mesh` on 8 host devices (real subprocesses, the official `openai` client): it starts with its
warm-up (base and adapter programs, every sampling extra), with and without `--tinker-root`, and answers each kind
of request as the same model served on one device does: the same greedy tokens, logprobs within 1e-4."""

import json

import jax
import numpy as np
import pytest

pytest.importorskip("openai", reason="serving tests call the server with the openai client")
pytest.importorskip("fastapi", reason="nemo-jax serve needs fastapi + uvicorn (pip install -e '.[serve]')")

from helpers import FAST_COMPILE, micro_model  # noqa: E402
from test_serve import Server  # noqa: E402

MESH = ["--mesh", "fsdp=4,tensor=2"]
EIGHT = "--xla_force_host_platform_device_count=8"


def _requests(c):
    """Greedy requests of every kind -> {kind: [(text, token ids, logprobs), ...]}."""
    msg = [{"role": "user", "content": "Name a city."}]
    ids = {"return_token_ids": True}
    kinds = {
        "completion, logprobs": lambda: c.completions.create(model="m", prompt=[5, 6, 7], max_tokens=8, temperature=0,
                                                             logprobs=3, extra_body=ids),
        "chat, top logprobs": lambda: c.chat.completions.create(model="m", messages=msg, max_tokens=8, temperature=0,
                                                                logprobs=True, top_logprobs=3, extra_body=ids),
        "stop strings": lambda: c.completions.create(model="m", prompt="Paris is", max_tokens=12, temperature=0,
                                                     stop=["e", "zz"], extra_body=ids),
        "n=2, penalties, bias": lambda: c.completions.create(
            model="m", prompt=[5, 6, 7], max_tokens=8, temperature=0, n=2, presence_penalty=0.5,
            frequency_penalty=0.3, logit_bias={"77": 3.0}, extra_body=dict(ids, repetition_penalty=1.3, min_tokens=2)),
        "the adapter": lambda: c.chat.completions.create(model="a1", messages=msg, max_tokens=8, temperature=0,
                                                         logprobs=True, extra_body=ids),
    }
    out = {}
    for kind, call in kinds.items():
        r = call()
        rows = []
        for ch in r.choices:
            text = ch.message.content if hasattr(ch, "message") else ch.text
            lp = ch.logprobs
            lps = ([t.logprob for t in lp.content] if hasattr(lp, "content") else list(lp.token_logprobs)) if lp else []
            rows.append((text, ch.model_extra.get("token_ids"), ch.finish_reason, lps))
        out[kind] = rows
    return out


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """The tiny model cut to a Mamba, an attention and an MoE layer (every kind the rules place), random weights, as
    an HF dir with its tokenizer, and a random attention adapter (vLLM layout)."""
    from nemo_jax.config.model import NemotronHConfig
    from nemo_jax.data.chat import resolve
    from nemo_jax.hf.io import save_pretrained
    from nemo_jax.lora import LoraConfig, init_adapters
    from nemo_jax.lora.peft import save_peft
    from nemo_jax.model import init

    tmp = tmp_path_factory.mktemp("mesh")
    with open(micro_model(tmp, kinds=("linear_attention", "full_attention", "moe"))) as f:
        cfg = NemotronHConfig.from_hf_dict(json.load(f))
    save_pretrained(cfg, init(cfg, jax.random.key(0)), str(tmp / "hf"), tokenizer_dir=resolve("builtin:tiny"))
    lc = LoraConfig(targets=("attention",), rank=4, alpha=8.0)
    ad = jax.tree.map(lambda x: x + 0.1, init_adapters(cfg, lc))
    save_peft(cfg, jax.tree.map(np.asarray, ad), tmp / "adapter", format="vllm", lora_config=lc)
    args = ["--ckpt", str(tmp / "hf"), "--adapters", f"a1={tmp / 'adapter'}", "--max-num-seqs", "2",
            "--max-model-len", "256", "--bucket", "16", "--served-model-name", "m"]
    srv = Server(tmp, args)  # one device: the reference
    try:
        want = _requests(srv.client)
    finally:
        srv.close()
    return tmp, args, want


@pytest.mark.slow
@pytest.mark.parametrize("tinker", [False, True], ids=["serve", "tinker-root"])
def test_serve_on_a_mesh_warms_up_and_answers_as_one_device(model_dir, tinker):
    tmp, args, want = model_dir
    extra = ["--tinker-root", str(tmp / f"root-{tinker}")] if tinker else []
    env = {"XLA_FLAGS": f"{FAST_COMPILE} {EIGHT}"}
    srv = Server(tmp, args + MESH + extra, warm=True, env=env)
    try:
        out = srv.output()
        assert "warm-up done" in out and "every extra" in out, out
        got = _requests(srv.client)
    finally:
        srv.close()
    for kind, rows in want.items():
        assert len(got[kind]) == len(rows), kind
        for (t0, ids0, fin0, lp0), (t1, ids1, fin1, lp1) in zip(rows, got[kind]):
            assert (t1, ids1, fin1) == (t0, ids0, fin0), kind
            np.testing.assert_allclose(lp1, lp0, atol=1e-4, err_msg=kind)
