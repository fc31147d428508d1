"""The `nemo_gym` environment against REAL NeMo-Gym resources servers (nemo-gym 0.4.0 in a Python >= 3.12 venv of
its own, started by the environment; the example servers and rows NeMo-Gym ships): sessions kept by cookie, tool
routes, /verify's reward and metrics, two episodes at once kept apart, and `nemo-jax eval` / `nemo-jax grpo` on a
Gym server end to end.

Not in the default run: tests marked `nemo_gym` run only when the -m expression names the marker (tests/conftest.py),
and are skipped without the Gym venv ($NEMO_JAX_NEMO_GYM_PYTHON, else ~/.cache/nemo_jax/nemo-gym/bin/python).
`python tools/tiers/nemo_gym.py tier` builds the venv when it is missing and runs this module."""

import json
import os
import subprocess
import sys

import pytest

from helpers import FAST_COMPILE, micro_model

pytestmark = pytest.mark.nemo_gym

from nemo_jax.rl.envs.nemo_gym import DEFAULT_PYTHON, NeMoGymEnv  # noqa: E402

PYTHON = os.environ.get("NEMO_JAX_NEMO_GYM_PYTHON") or DEFAULT_PYTHON
if not os.path.exists(PYTHON):
    pytest.skip(f"the nemo_gym tier needs NeMo-Gym's venv ({PYTHON}: python tools/tiers/nemo_gym.py venv)",
                allow_module_level=True)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SERVERS = subprocess.run([PYTHON, "-c", "import resources_servers as r; print(list(r.__path__)[0])"],
                         capture_output=True, text=True, check=True).stdout.strip()
COUNTER = "resources_servers.example_session_state_mgmt.app:StatefulCounterResourcesServer"
COUNTER_ROWS = os.path.join(SERVERS, "example_session_state_mgmt", "data", "example.jsonl")
MULTI = "resources_servers.example_multi_step.app:ExampleMultiStepResourcesServer"


def _call(name: str, **arguments) -> dict:
    return {"role": "assistant", "content": "<tool_call>" + json.dumps({"name": name, "arguments": arguments})
            + "</tool_call>"}


@pytest.fixture(scope="module")
def counter():
    env = NeMoGymEnv(COUNTER_ROWS, server=COUNTER, python=PYTHON, max_turns=6)
    try:
        yield env
    finally:
        env.close()


def _plan(task) -> list[int]:
    """The increments the row's request asks for ("add 1 then add 2 then get the count")."""
    words = task.messages[-1]["content"].split()
    return [int(w) for w, before in zip(words[1:], words) if before == "add"]


def test_an_expert_transcript_is_scored_by_the_servers_verify_and_sessions_stay_apart(counter):
    """Two episodes of the stateful counter at once, interleaved call by call: each one's increments reach its own
    session (the cookies of its /seed_session), so both earn /verify's reward 1; one that adds the wrong amount
    earns 0; an unknown tool and arguments the route refuses are answered as tool messages, the episode goes on."""
    tasks = counter.tasks("train")
    assert len(tasks) >= 2 and counter.tasks("eval") == tasks  # (no held-out rows given: the train rows)
    a, b = counter.episode(), counter.episode()
    oa, ob = a.start(tasks[0], "r0"), b.start(tasks[1], "r1")
    assert oa.messages == list(tasks[0].messages) and {t["function"]["name"] for t in oa.tools} == \
        {"increment_counter", "get_counter_value"} and ob.tools == oa.tools
    for x, y in zip(_plan(tasks[0]), _plan(tasks[1])):
        ra, rb = a.step(_call("increment_counter", count=x)), b.step(_call("increment_counter", count=y))
        assert not ra.done and json.loads(ra.messages[0]["content"]) == {"success": True} and not rb.done
    r = a.step(_call("get_counter_value"))
    assert json.loads(r.messages[0]["content"])["count"] == tasks[0].data["row"]["expected_count"]
    done_a, done_b = a.step({"role": "assistant", "content": "Done."}), b.step({"role": "assistant", "content": "ok"})
    assert (done_a.done, done_a.reward, done_a.success) == (True, 1.0, True)
    assert (done_b.done, done_b.reward, done_b.success) == (True, 1.0, True)
    c = counter.episode()
    c.start(tasks[0], "r2")
    bad = c.step(_call("nope"))
    assert not bad.done and "unknown tool" in json.loads(bad.messages[0]["content"])["error"]
    bad = c.step(_call("increment_counter", count="many"))  # (the route's own validation: a 422)
    assert not bad.done and json.loads(bad.messages[0]["content"])["error"] == "HTTP 422"
    wrong = c.step({"role": "assistant", "content": "I added nothing."})
    assert wrong.done and wrong.reward == 0.0 and not wrong.success


def test_bad_rows_and_settings_are_one_clear_line(tmp_path):
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"responses_create_params": {"input": "hi"}}\n{"responses_create_params": {"input": 3}}\n')
    with pytest.raises(ValueError, match=r"rows.jsonl:2: 'responses_create_params.input' must be"):
        NeMoGymEnv(str(rows), url="http://127.0.0.1:1")
    with pytest.raises(ValueError, match="exactly one of 'server'"):
        NeMoGymEnv(COUNTER_ROWS)
    env = NeMoGymEnv(COUNTER_ROWS, server="no_such_module:Server", python=PYTHON, start_timeout_s=60)
    with pytest.raises(RuntimeError, match="exited"):
        env.episode().start(env.tasks("train")[0], "x")


def _env():
    return dict(os.environ, PYTHONPATH=ROOT, XLA_FLAGS=FAST_COMPILE, JAX_PLATFORMS="cpu",
                NEMO_JAX_NEMO_GYM_PYTHON=PYTHON)


def test_eval_and_grpo_run_on_a_gym_server(tmp_path):
    """`nemo-jax eval --env nemo_gym` and three `nemo-jax grpo` steps on the stateful counter (a random micro model:
    the point is the loop, each reward from the server's /verify, not learning)."""
    import jax

    from nemo_jax.checkpoint import save_model
    from nemo_jax.config.model import NemotronHConfig
    from nemo_jax.data.chat import resolve
    from nemo_jax.model import init

    args = {"data": COUNTER_ROWS, "server": COUNTER, "max_turns": 3}
    cfg = NemotronHConfig.from_file(micro_model(tmp_path))
    model = str(tmp_path / "model")
    save_model(model, cfg, init(cfg, jax.random.key(0)), tokenizer_dir=resolve("builtin:tiny"))
    grpo = subprocess.run(
        [sys.executable, "-m", "nemo_jax.cli", "grpo", "--config", os.path.join(ROOT, "configs/grpo/tiny-cpu.yaml"),
         f"run_dir={tmp_path / 'run'}", f"model.init={model}", "model.init_sft_config=null", "lora.init=null",
         "rollout.env=nemo_gym", f"rollout.env_args={json.dumps(args)}",
         "rollout.group_size=4", "rollout.groups_per_step=2", "rollout.in_flight_groups=2", "rollout.seq_len=512",
         "rollout.max_new_tokens=24", "steps=3", "logging.tensorboard=false", "eval_every=0", "checkpoint.every=0"],
        env=_env(), cwd=tmp_path, capture_output=True, text=True, timeout=900)
    assert grpo.returncode == 0, grpo.stdout[-2000:] + grpo.stderr[-3000:]
    steps = [json.loads(x) for x in open(tmp_path / "run" / "metrics.jsonl")]
    assert max(s.get("step", 0) for s in steps) == 3 and any("reward_mean" in s for s in steps), steps
    out = subprocess.run([sys.executable, "-m", "nemo_jax.cli", "eval", "--ckpt", model, "--adapters",
                          str(tmp_path / "run"), "--env",
                          "nemo_gym", "--env-args", json.dumps(args), "--attempts", "2", "--max-new-tokens", "24",
                          "--json", str(tmp_path / "eval.json")],
                         env=_env(), cwd=tmp_path, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.load(open(tmp_path / "eval.json"))
    assert got["tasks"] == len(NeMoGymEnv(COUNTER_ROWS, url="http://127.0.0.1:1").tasks("eval"))
    assert got["attempts"] == 2 and 0.0 <= got["reward_mean"] <= 1.0
