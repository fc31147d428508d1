"""`nemo-jax rollout-worker` against `nemo-jax serve` over real HTTP on localhost (one server subprocess for the
module), feeding `nemo-jax grpo` runs that sample nothing themselves (rollout.producer=none, rollout.spool=true):
the run trains with behaviour logprobs equal to the learner's (mismatch KL < 1e-6 in fp32, at every step: the
run keeps no stale group, so every step after the first trains on turns a newer published adapter sampled); a
worker SIGKILLed mid-episode loses only its lease (its request is reposted and finished by another worker); the
learner SIGKILLed and restarted keeps its in-flight groups (their requests and claims survive and complete); the
server wants an API key (the workers take it from the environment) and loads adapters only under the run's
folder; a finished run stops its workers (exit 0)."""

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

pytest.importorskip("openai", reason="the rollout worker calls the server with the openai client")
pytest.importorskip("fastapi", reason="nemo-jax serve needs fastapi + uvicorn (pip install -e '.[serve]')")

from test_serve import ROOT, Server  # noqa: E402

from helpers import FAST_COMPILE, log_tail, wait_until  # noqa: E402

ENV = '''
import os, time
from nemo_jax.rl.envs import Observation, Task


class Turns:
    """Up to two turns: a request, then "Again."; reward from the answers' lengths (a random model's rollouts of
    a group differ). Each step takes `sleep` seconds; `marks`: a dir where start() and close() leave a file;
    `fail_nth`: the n-th episode this process starts raises in its first step."""
    name, max_turns = "turns", 2
    started = 0

    def __init__(self, sleep=0.0, marks=None, fail_nth=0):
        self.sleep, self.marks, self.fail_nth = sleep, marks, fail_nth
        self._tasks = [Task(f"t{i}", ({"role": "user", "content": f"Count to {i}, slowly."},)) for i in range(16)]

    def tasks(self, split):
        return self._tasks

    def episode(self):
        return Episode(self)


class Episode:
    def __init__(self, env):
        self.env, self.turns, self.reward = env, 0, 0.0

    def _mark(self, what):
        if self.env.marks:
            open(os.path.join(self.env.marks, self.rid.replace("/", "_") + "." + what), "w").close()

    def start(self, task, rollout_id):
        self.rid = rollout_id
        Turns.started += 1
        self.nth = Turns.started
        self._mark("start")
        return Observation(messages=list(task.messages))

    def step(self, message):
        time.sleep(self.env.sleep)
        if self.nth == self.env.fail_nth:
            raise RuntimeError("the tool server went away")
        self.turns += 1
        self.reward += (len(message["content"]) % 3) / 4
        if self.turns == 2:
            return Observation(reward=self.reward, done=True)
        return Observation(messages=[{"role": "user", "content": "Again."}], reward=self.reward)

    def close(self):
        self._mark("close")
'''


KEY = "worker-test-key"  # the server wants it; workers take it from $NEMO_JAX_API_KEY


def _env(tmp):
    return dict(os.environ, PYTHONPATH=f"{tmp}{os.pathsep}{ROOT}", XLA_FLAGS=FAST_COMPILE, JAX_PLATFORMS="cpu",
                NEMO_JAX_API_KEY=KEY)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """A tiny random model (two layers: Mamba, attention) saved and served in fp32."""
    import jax

    from nemo_jax.checkpoint import save_model
    from nemo_jax.config.model import NemotronHConfig
    from nemo_jax.data.chat import resolve
    from nemo_jax.model import init

    tmp = tmp_path_factory.mktemp("worker")
    with open(os.path.join(ROOT, "nemo_jax", "assets", "models", "tiny.json")) as f:
        hf = json.load(f)
    hf.update(layers_block_type=["linear_attention", "full_attention"], num_hidden_layers=2)
    cfg = NemotronHConfig.from_hf_dict(hf)
    save_model(str(tmp / "model"), cfg, init(cfg, jax.random.key(3)), tokenizer_dir=resolve("builtin:tiny"))
    (tmp / "wenv.py").write_text(ENV)
    srv = Server(tmp, ["--ckpt", str(tmp / "model"), "--tokenizer", "builtin:tiny", "--max-num-seqs", "8",
                       "--max-model-len", "160", "--bucket", "32", "--served-model-name", "tiny",
                       "--enable-runtime-lora-updating", "--adapter-root", str(tmp)], api_key=KEY)
    try:
        yield srv, tmp
    finally:
        srv.close()


def _grpo(tmp, run, steps, *extra):
    return [sys.executable, "-m", "nemo_jax.cli", "grpo", "--config", os.path.join(ROOT, "configs/grpo/tiny-cpu.yaml"),
            f"run_dir={run}", f"steps={steps}", f"model.init={tmp / 'model'}", "model.init_sft_config=null",
            "lora.init=null",
            "tokenizer=builtin:tiny", "rollout.env=wenv:Turns", "rollout.env_args={}", "rollout.producer=none",
            "rollout.spool=true", "rollout.group_size=4", "rollout.groups_per_step=2", "rollout.max_new_tokens=8",
            "rollout.seq_len=96", "rollout.stop=[e]", "lora.targets=[all]", "lora.rank=4", "eval_every=0",
            "log_every=1", "logging.tensorboard=false", "optim.lr=0.05", *extra]


def _worker(srv, tmp, run, name, *extra):
    log = open(tmp / f"{name}.log", "w+")
    p = subprocess.Popen([sys.executable, "-m", "nemo_jax.cli", "rollout-worker", "--run", str(run), "--server",
                          srv.url, "--worker-id", name, *extra], env=_env(tmp), stdout=log, stderr=subprocess.STDOUT)
    p.log = log
    return p


def _stop(*procs):
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in procs:
        try:
            p.wait(60)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def _records(run) -> list[dict]:
    path = os.path.join(run, "metrics.jsonl")
    return [json.loads(x) for x in open(path)] if os.path.exists(path) else []


def _spool(run, sub) -> dict[str, list[dict]]:
    """spool/<sub> files -> their records."""
    d = os.path.join(run, "spool", sub)
    return {n: [json.loads(x) for x in open(os.path.join(d, n)) if x.strip()] for n in sorted(os.listdir(d))
            if n.endswith(".jsonl")}


@pytest.mark.slow
def test_grpo_fed_by_rollout_workers_trains_on_policy(served):
    """Two workers feed a 3-step run; every step's mismatch KL
    is < 1e-6 and its rollouts are of the current policy (max_off_policy_steps=0: older groups are cancelled and
    their workers abandon them), so steps 2 and 3 train on turns sampled by adapters v1 and v2 loaded at run time;
    two-turn rollouts (a stop string ends the first turn) are token-exact continuations; an episode whose
    environment fails is reported (the learner counts it) and replaced."""
    srv, tmp = served
    run = tmp / "run-a"
    learner = subprocess.Popen(_grpo(tmp, run, 3, "rollout.max_off_policy_steps=0", "rollout.in_flight_groups=4",
                                     "rollout.env_args={fail_nth: 3}"),
                               env=_env(tmp), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    workers = [_worker(srv, tmp, run, "wa", "--concurrency", "2"),
               _worker(srv, tmp, run, "wb", "--concurrency", "2")]
    try:
        out, _ = learner.communicate(timeout=900)
        for w in workers:  # the learner closed the run: the workers stop by themselves
            w.wait(60)
    finally:
        if learner.poll() is None:
            learner.kill()
        _stop(*workers)
    logs = "\n".join(log_tail(w, None) for w in workers)
    assert learner.returncode == 0, out[-3000:] + logs[-4000:]
    for w in workers:
        assert w.returncode == 0 and "the learner finished the run at step 3" in log_tail(w), log_tail(w)
    recs = [r for r in _records(run) if "mismatch_kl" in r]
    assert [r["step"] for r in recs] == [1, 2, 3], out[-2000:]
    for r in recs:
        assert r["mismatch_kl"] < 1e-6, r
        assert r["staleness_max"] == 0 and r["policy_version"] == r["step"], r
    consumed = [x for xs in _spool(run, "consumed").values() for x in xs if "tokens" in x]
    _only_unknown_groups_rejected(run)  # (rollouts a worker wrote as their group was cancelled as stale)
    assert {v for x in consumed for v in x["policy_versions"]} >= {0, 1, 2}
    assert all(x["temperature"] == 1.0 for x in consumed)
    two = [x for x in consumed if sum(a < b for a, b in zip(x["loss_mask"], x["loss_mask"][1:])) == 2]
    assert two, "no two-turn rollout"
    assert "policy 2 loaded into the server" in logs
    assert "failed: environment turns: episode" in logs and "the tool server went away" in logs
    assert any(r.get("episodes_failed", 0) >= 1 for r in recs)
    assert any("failed" in x for xs in _spool(run, "consumed").values() for x in xs)


def _only_unknown_groups_rejected(run, resumed_at: int | None = None) -> dict:
    """{file: {reason: its records rejected for it}} of spool/rejected, every one rejected as unknown_group. A file
    moves there whole when any of its records is rejected: its .reason names those by line (the others were
    accepted: a worker's file may hold rollouts of several groups). With `resumed_at` (a learner restarted from
    that step's checkpoint), rollouts sampled with a version the crashed learner had published after it are
    `bad_version` too (the restarted learner's versions start again from there, by design)."""
    out = {}
    allowed = {"unknown_group"} | ({"bad_version"} if resumed_at is not None else set())
    for n, records in _spool(run, "rejected").items():
        reason = open(run / "spool" / "rejected" / (n + ".reason")).read()
        bad = {int(m.group(1)): m.group(2) for m in re.finditer(r"line (\d+): (\w+)", reason)}
        assert bad and set(bad.values()) <= allowed, (n, reason)
        for i, x in enumerate(records, 1):
            if i in bad:
                out.setdefault(bad[i], []).append(x)
    for x in out.get("bad_version", []):
        assert max(x["policy_versions"]) > resumed_at, x["policy_versions"]
    return out


@pytest.mark.slow
def test_killed_worker_loses_its_lease_and_a_restarted_learner_keeps_its_groups(served):
    """(b) a worker SIGKILLed mid-episode: its claims expire, the requests are reposted, another worker (this one
    through chat completions) finishes them and the run continues; (c) the learner SIGKILLed after a checkpoint
    and restarted: the groups it had in flight keep their requests and claims (not cancelled) and complete; the
    run reaches its last step."""
    srv, tmp = served
    run, marks = tmp / "run-b", tmp / "marks"
    marks.mkdir()
    # lease_s: a live worker renews every lease_s / 3, so 20 s tolerates ~13 s of a starved worker (a loaded
    # machine) before its claims would expire under it; the killed one's expire 20 s after its last renewal
    cmd = _grpo(tmp, run, 6, f"rollout.env_args={{sleep: 0.4, marks: {marks}}}", "rollout.in_flight_groups=4",
                "rollout.lease_s=20", "rollout.max_off_policy_steps=20", "checkpoint.every=1")
    learner = subprocess.Popen(cmd, env=_env(tmp), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               start_new_session=True)
    a = _worker(srv, tmp, run, "wa", "--concurrency", "2")
    b = None
    try:
        claimed = run / "requests" / "claimed"

        def a_mid_episode():  # a claim of a's, one of its episodes started and not closed
            held = [n.split("--")[1][:-5] for n in os.listdir(claimed) if n.startswith("wa--")] if claimed.is_dir() \
                else []
            names = os.listdir(marks)
            busy = [g for g in held if any(n.startswith(g + "_") and n.endswith(".start")
                                           and n[:-6] + ".close" not in names for n in names)]
            return busy and held
        held = wait_until(a_mid_episode, "worker a mid-episode", 1800, procs=[a])
        a.kill()
        a.wait()
        # b starts once a's claims have expired (the learner reposts them): started at once, b could finish every
        # step the run needs before a's leases ran out on a fast machine, and no lease would ever expire
        wait_until(lambda: not any(n.startswith("wa--") for n in os.listdir(claimed)), "a's claims to expire", 1800,
                   procs=[learner])
        b = _worker(srv, tmp, run, "wb", "--concurrency", "3", "--api", "chat")
        wait_until(lambda: any(r.get("leases_expired", 0) >= 1 for r in _records(run)), "an expired lease", 1800,
                   procs=[b])

        def checkpoint_with_claims():  # a checkpoint, and claims of groups opened before it
            ck = run / "checkpoints"
            steps = [int(d) for d in os.listdir(ck) if d.isdigit()] if ck.is_dir() else []
            k = max(steps, default=0)
            gids = [n.split("--")[1][:-5] for n in os.listdir(claimed)]
            old = [g for g in gids if int(g[1:].split("-")[0]) < k]
            return k >= 2 and old and (k, old)
        k, in_flight = wait_until(checkpoint_with_claims, "a checkpoint with groups in flight", 1800,
                                   procs=[b])
        os.killpg(learner.pid, signal.SIGKILL)
        learner.wait()
        first = learner.stdout.read()
        restarted = subprocess.run(cmd, env=_env(tmp), capture_output=True, text=True, timeout=1800)
        assert restarted.returncode == 0, restarted.stdout[-3000:] + restarted.stderr[-3000:] + log_tail(b)
        assert "resumed at step" in restarted.stdout, restarted.stdout[-2000:]
    finally:
        if learner.poll() is None:
            os.killpg(learner.pid, signal.SIGKILL)
        _stop(*[p for p in (a, b) if p is not None])
    recs = _records(run)
    assert max(r["step"] for r in recs) == 6 and os.path.isdir(run / "adapters"), first[-2000:]
    consumed = [x for xs in _spool(run, "consumed").values() for x in xs if "tokens" in x]
    by_group = {}
    for x in consumed:
        by_group.setdefault(x["group_id"], []).append(x)
    # (b) the killed worker's groups: reposted, finished by b; (c) the groups in flight at the checkpoint the
    # learner restarted from: kept, never cancelled and none of their rollouts rejected (below: only groups opened
    # after that checkpoint are unknown to the restarted learner). They need not be complete: the run may reach its
    # last step first, and closing the run removes the requests and claims still open.
    for gid in held + in_flight:
        assert not (req := run / "requests" / "cancelled" / gid).exists(), req
        assert len(by_group.get(gid, [])) >= 4 or gid in in_flight, (gid, by_group.get(gid))
    assert any(x["rollout_id"] and n.startswith("wb-") for n, xs in _spool(run, "consumed").items() for x in xs)
    # only groups opened after that checkpoint, or rollouts sampled with the crashed learner's later versions
    rejected = _only_unknown_groups_rejected(run, resumed_at=k)
    assert all(int(x["group_id"][1:].split("-")[0]) >= k for x in rejected.get("unknown_group", [])), rejected


def test_turn_parsing_chat_messages_and_server_kinds(tmp_path):
    """What the worker reads of a response: the token ids as returned (`token_ids`, or logprob entries spelled
    token_id:<id>), a turn that stopped without its end-of-turn token and a response without ids are errors;
    pictures of a conversation become image_url data URLs of the stored PNGs; SGLang gets the adapter as
    `lora_path`, vLLM as `model`."""
    import base64

    import numpy as np
    from openai.types import Completion
    from openai.types.chat import ChatCompletion

    from nemo_jax.rl.rollout import ImageStore
    from nemo_jax.generate import SamplingParams
    from nemo_jax.rl.transport.worker import InferenceClient, TurnFailed, WorkerError, chat_messages, parse_turn

    sp = SamplingParams(stop_token_ids=(2, 4))

    def completion(ids, strs, lps, reason="stop", **extra):
        return Completion.model_validate({"id": "x", "object": "text_completion", "created": 0, "model": "m",
                                          "choices": [{"index": 0, "text": "", "finish_reason": reason,
                                                       "logprobs": {"tokens": strs, "token_logprobs": lps},
                                                       **({"token_ids": ids} if ids is not None else {}), **extra}]})
    assert parse_turn("completions", completion([7, 4], ["a", "b"], [-0.5, -0.25]), sp) == \
        ([7, 4], [-0.5, -0.25], "stop", None)
    assert parse_turn("completions", completion(None, ["token_id:7", "token_id:9"], [-1.0, -2.0], "length"), sp)[:3] \
        == ([7, 9], [-1.0, -2.0], "length")
    with pytest.raises(WorkerError, match="neither token ids"):
        parse_turn("completions", completion(None, ["a"], [-1.0]), sp)
    with pytest.raises(WorkerError, match="without an end-of-turn token"):
        parse_turn("completions", completion([7, 9], ["a", "b"], [-1.0, -1.0]), sp)
    with pytest.raises(TurnFailed, match="2 token ids but 1 logprobs"):
        parse_turn("completions", completion([7, 4], ["a"], [-1.0]), sp)
    chat = ChatCompletion.model_validate({
        "id": "x", "object": "chat.completion", "created": 0, "model": "m", "prompt_token_ids": [1, 2],
        "choices": [{"index": 0, "finish_reason": "tool_calls", "token_ids": [5, 2],
                     "message": {"role": "assistant", "content": "hi"},
                     "logprobs": {"content": [{"token": "h", "logprob": -0.1, "bytes": [], "top_logprobs": []},
                                              {"token": "i", "logprob": -0.2, "bytes": [], "top_logprobs": []}]}}]})
    assert parse_turn("chat", chat, sp) == ([5, 2], [-0.1, -0.2], "stop", [1, 2])

    store = ImageStore(str(tmp_path))
    pics = [store.put(np.full((8, 8, 3), c, np.uint8)) for c in (10, 200)]

    class Live:  # (the fields of a running rollout chat_messages reads)
        text = [{"role": "user", "content": "look <img><image></img> and <img><image></img>"},
                {"role": "assistant", "content": "ok"}]
        images, tools = pics, [{"type": "function", "function": {"name": "f"}}]
    msgs, tools = chat_messages(Live(), store)
    parts = msgs[0]["content"]
    assert [p["type"] for p in parts] == ["text", "image_url", "text", "image_url"] and msgs[1] == Live.text[1]
    with open(store.path(pics[1]), "rb") as f:
        assert parts[3]["image_url"]["url"] == "data:image/png;base64," + base64.b64encode(f.read()).decode()
    assert tools == Live.tools

    srv = object.__new__(InferenceClient)
    srv.model, srv.kind = "base", "sglang"
    assert srv.select("run-v3") == ("base", {"lora_path": "run-v3"}) and srv.select(None) == ("base", {})
    srv.kind = "vllm"
    assert srv.select("run-v3") == ("run-v3", {})


# ----------------------------------------------------------------------------- a worker as an operator meets it
def _models_json(owner="nemo-jax"):
    return {"object": "list", "data": [{"id": "tiny", "owned_by": owner, "max_model_len": 256}]}


def test_server_calls_outlast_a_restart_and_send_the_key(monkeypatch, capsys):
    """The worker's calls to the server (/v1/models, adapter loads) retry refused connections and 503s with
    backoff, saying so at least every 10 s, and give up with one error line after --wait-s; the API key comes from
    --api-key or $NEMO_JAX_API_KEY as a bearer token."""
    import httpx

    from nemo_jax.rl.transport.worker import InferenceClient, WorkerError

    monkeypatch.setenv("NEMO_JAX_API_KEY", "k1")
    seen, down = [], [3]

    def handler(req: httpx.Request):
        seen.append((req.url.path, req.headers.get("authorization")))
        if req.url.path.endswith("load_lora_adapter") and down[0] > 0:
            down[0] -= 1
            if down[0] == 1:
                return httpx.Response(503)
            raise httpx.ConnectError("Connection refused")
        if req.headers.get("authorization") != "Bearer k1":
            return httpx.Response(401, json={"error": {"message": "Unauthorized"}})
        if req.url.path == "/v1/models":
            return httpx.Response(200, json=_models_json())
        return httpx.Response(200, text="Success")
    monkeypatch.setattr(InferenceClient, "QUIET_S", 0.05)
    srv = InferenceClient("http://engine:8000/v1", wait_s=5.0, transport=httpx.MockTransport(handler))
    assert srv.kind == "nemo-jax" and srv.load_adapter("run-v1", "/runs/r/policy/1")
    out = capsys.readouterr().out
    assert "ConnectError" in out and "HTTP 503" in out and "answers again" in out
    assert seen[-1] == ("/v1/load_lora_adapter", "Bearer k1")
    down[0] = 10 ** 9  # never comes back
    srv.wait_s = 0.3
    with pytest.raises(WorkerError, match="no answer within"):
        srv.load_adapter("run-v2", "/runs/r/policy/2")
    with pytest.raises(WorkerError, match="give --api-key"):
        InferenceClient("http://engine:8000", api_key="wrong", wait_s=1.0, transport=httpx.MockTransport(handler))
    off = lambda req: httpx.Response(404, json={"error": {"message": "runtime LoRA updating is off (start ...)"}}) \
        if "lora" in req.url.path else httpx.Response(200, json=_models_json())  # noqa: E731
    with pytest.raises(WorkerError, match="does not load adapters at run time"):
        InferenceClient("http://engine:8000", wait_s=1.0, transport=httpx.MockTransport(off)).load_adapter("a", "/x")
    busy = [2]  # another worker on the same server is loading this version: wait for it, then "already loaded"

    def racing(req):
        if "lora" not in req.url.path:
            return httpx.Response(200, json=_models_json())
        busy[0] -= 1
        word = "is being loaded by another request" if busy[0] > 0 else "has already been loaded"
        return httpx.Response(400, json={"error": {"message": f"The lora adapter 'a' {word}."}})
    assert InferenceClient("http://engine:8000", wait_s=5.0, transport=httpx.MockTransport(racing)).load_adapter("a", "/x")
    assert busy[0] == 0


def test_workers_exit_when_the_learner_closes_the_run(tmp_path, capsys):
    """The learner's last step closes RUN/requests (`RequestBoard.close`): a running worker stops with a line and
    gives nothing back; a worker started on a finished run exits at once."""
    import argparse

    import httpx

    from nemo_jax.config.model import NemotronHConfig
    from nemo_jax.data.chat import ChatTokenizer
    from nemo_jax.rl.transport.board import RequestBoard
    from nemo_jax.rl.envs import make_env
    from nemo_jax.rl.transport.worker import InferenceClient, RolloutWorker, cli_worker

    run = tmp_path / "run"
    (run / "policy" / "1").mkdir(parents=True)
    (run / "policy" / "LATEST").write_text("1\n")
    board = RequestBoard(str(run), lease_s=30.0)
    handler = lambda req: httpx.Response(200, json=_models_json()) if req.url.path == "/v1/models" \
        else httpx.Response(200, text="Success")  # noqa: E731
    srv = InferenceClient("http://engine:8000", wait_s=2.0, transport=httpx.MockTransport(handler))
    with open(os.path.join(ROOT, "nemo_jax", "assets", "models", "tiny.json")) as f:
        cfg = NemotronHConfig.from_hf_dict(json.load(f))
    w = RolloutWorker(str(run), srv, ChatTokenizer.load("builtin:tiny"), cfg, make_env("arithmetic"),
                      worker_id="w1", env_workers=1)
    threading.Timer(1.0, board.close, args=(7,)).start()
    t0 = time.time()
    counts = w.run()
    assert time.time() - t0 < 20 and counts.get("groups_released", 0) == 0
    assert "the learner finished the run at step 7" in capsys.readouterr().out
    a = argparse.Namespace(run=str(run), server="http://engine:8000", env=None, env_args=None, model=None,
                           tokenizer=None, concurrency=1, lease_s=None, worker_id="w2", api="auto", server_run_dir=None,
                           api_key=None, request_timeout=5.0, wait_s=2.0, max_groups=0)
    assert cli_worker(a) == {}  # (before it would contact the server or wait for the learner)
    assert "nothing to sample" in capsys.readouterr().out


def test_turns_outlast_a_server_restart_that_lost_the_adapters(monkeypatch):
    """A vLLM restart as the worker meets it: the turns in flight cannot connect and are sent again (backoff) more
    than twice while the server is away; the new server does not know the adapter (404): the current adapter is
    loaded again, once for all those turns, and every turn completes (none fails: "nothing lost"). Unloading an old
    adapter while the server is away returns at once (the worker asks again later) instead of holding the worker's
    loop for --wait-s; the restarted server's answer (unknown adapter) counts as unloaded."""
    import httpx

    from nemo_jax.generate import SamplingParams
    from nemo_jax.rl.transport.worker import InferenceClient, ServerSampler

    monkeypatch.setattr(ServerSampler, "RETRY_S", (0.01, 0.05))
    monkeypatch.setattr(InferenceClient, "CLIENT_RETRIES", 0)
    state = {"down": 0, "loaded": {"run-v1"}, "loads": [], "sent": 0}

    def control(req: httpx.Request):  # /v1/models, adapter loads and unloads
        if req.url.path == "/v1/models":
            return httpx.Response(200, json=_models_json("vllm"))
        if state["down"] > 0:
            raise httpx.ConnectError("Connection refused")
        name = json.loads(req.content)["lora_name"]
        if req.url.path.endswith("/unload_lora_adapter"):
            return httpx.Response(200 if name in state["loaded"] else 404, text="")
        state["loaded"].add(name)
        state["loads"].append(name)
        return httpx.Response(200, text="Success")

    def completions(req: httpx.Request):
        state["sent"] += 1
        if state["down"] > 0:
            state["down"] -= 1
            if state["down"] == 0:
                state["loaded"] = set()  # (the server came back: a new process, no adapter loaded)
            raise httpx.ConnectError("Connection refused")
        model = json.loads(req.content)["model"]
        if model not in state["loaded"]:
            return httpx.Response(404, json={"error": {"message": f"The model `{model}` does not exist.",
                                                       "type": "NotFoundError", "code": 404}})
        return httpx.Response(200, json={"id": "c", "object": "text_completion", "created": 0, "model": model,
                                         "choices": [{"index": 0, "text": "", "finish_reason": "stop", "token_ids": [7, 2],
                                                      "logprobs": {"tokens": ["a", "b"], "token_logprobs": [-0.5, -0.1]}}]})
    srv = InferenceClient("http://engine:8000", wait_s=600.0, transport=httpx.MockTransport(control),
                 async_transport=httpx.MockTransport(completions))
    sampler = ServerSampler(srv, poll_s=0.01)
    try:
        sampler.set_adapter("run-v1", 1, "/runs/r/policy/1")
        state["down"] = 8  # the server goes away: 8 attempts fail (4 per turn) before it is back
        sp = SamplingParams(max_new_tokens=4, stop_token_ids=(2,))
        ids = [sampler.submit([1, 5, 6], sp, tag=i) for i in range(2)]
        t0 = time.monotonic()
        assert srv.unload_adapter("run-v0") is False and time.monotonic() - t0 < 5  # away: not waited for
        ends = []
        while len(ends) < 2 and time.monotonic() - t0 < 30:
            ends += sampler.step()
        assert sampler.take_failed() == []
        assert sorted(e.seq_id for e in ends) == ids and all(e.tokens == [7, 2] and e.version == 1 for e in ends)
        assert sampler.counts["turns_resent"] >= 8 and sampler.counts["adapter_reloads"] >= 1
        assert state["loads"] and set(state["loads"]) == {"run-v1"} and len(state["loads"]) <= 2
        assert srv.unload_adapter("run-v0") is True  # (unknown to the restarted server: nothing to unload)
    finally:
        sampler.close()
