"""The Tinker API on a server over two processes: `launch/local/run.sh --processes 2 --devices-per-process 4 --
nemo-jax serve --tinker-root --mesh fsdp=4,tensor=2` (8 host devices, gloo between the processes; process 0
answers HTTP, process 1 replays its call log: `nemo_jax.serve.replica`), driven by the official SDK through the
checks tests/test_tinker.py runs on one device (imported from it: the SL loop with step-0 logprobs equal to the
unsharded model's within 1e-4, sampling, logprobs and importance sampling, two clients at once, four clients batched
equal to one at a time); and a killed follower ends the server with a line naming it."""

import os
import signal
import time

import jax
import pytest

pytest.importorskip("tinker", reason="the Tinker API tests drive the official SDK (pip install 'nemo_jax[tinker]')")
pytest.importorskip("fastapi", reason="nemo-jax serve needs fastapi + uvicorn")

from helpers import FAST_COMPILE  # noqa: E402
from test_tinker import BATCH, Server, _tiny_cfg, shared_checks  # noqa: E402

globals().update(shared_checks())  # test_tinker's SDK checks, against this module's `served`

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAUNCH = [os.path.join(ROOT, "launch", "local", "run.sh"), "--processes", "2", "--devices-per-process", "4",
          "--grace", "30", "--"]
MESH = ["--mesh", "fsdp=4,tensor=2", *BATCH]

pytestmark = pytest.mark.slow


def _start(tmp, hf):
    return Server(tmp, hf, str(tmp / "root"), extra=MESH, launcher=LAUNCH,
                  env={"XLA_FLAGS": FAST_COMPILE, "PYTHONUNBUFFERED": "1"})


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """test_tinker's model and server, over two processes of 4 host devices each (its checks compare with the
    unsharded params, computed in this process on one device)."""
    from nemo_jax.data.chat import resolve
    from nemo_jax.hf.io import save_pretrained
    from nemo_jax.model import init

    tmp = tmp_path_factory.mktemp("tinker-processes")
    cfg = _tiny_cfg(("full_attention", "mlp"))
    params = init(cfg, jax.random.key(0))
    hf = str(tmp / "tiny-hf")
    save_pretrained(cfg, params, hf, tokenizer_dir=resolve("builtin:tiny"))
    srv = _start(tmp, hf)
    srv.hf, srv.root, srv.cfg, srv.params, srv.tmp = hf, str(tmp / "root"), cfg, params, tmp
    try:
        yield srv
    finally:
        srv.close()


def _is_follower(pid: str, port: int) -> bool:
    """Process `pid` is process 1 of the server on `port` (its Python, not run.sh or its output filters)."""
    try:
        cmd = open(f"/proc/{pid}/cmdline").read().split("\0")
        env = open(f"/proc/{pid}/environ").read().split("\0")
    except OSError:
        return False
    return "nemo_jax.cli" in cmd and str(port) in cmd and "NEMO_JAX_PROCESS_ID=1" in env


def test_both_processes_serve_and_a_killed_follower_ends_the_server(served, tmp_path):
    """The served server says it runs over 2 processes and 8 devices and answers the OpenAI route with sampling
    extras; a second one, whose follower (process 1) is SIGKILLed, ends (non-zero) within the heartbeat timeout with
    a line naming the lost process."""
    out = served.output()
    assert "2 processes, 8 devices" in out, out
    # the OpenAI route over both processes, with sampling extras (the engine's calls are in the log too)
    r = served.client.completions.create(model="tiny", prompt=[5, 6, 7, 8], max_tokens=6, seed=3, logprobs=2,
                                         frequency_penalty=0.5, logit_bias={"9": 5.0}, stop=["zz"],
                                         extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 6 and len(r.choices[0].logprobs.top_logprobs) == 6
    other = _start(tmp_path, served.hf)
    try:
        follower = [p for p in os.listdir("/proc") if p.isdigit() and _is_follower(p, other.port)]
        assert follower, other.output()
        os.kill(int(follower[0]), signal.SIGKILL)
        t0 = time.time()
        while other.proc.poll() is None and time.time() - t0 < 120:
            time.sleep(0.5)
        assert other.proc.poll() not in (None, 0), other.output()
        assert "lost process(es) 1" in other.output() or "lost follower process 1" in other.output(), other.output()
    finally:
        other.close()
