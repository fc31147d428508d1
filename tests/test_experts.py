"""Experts that can learn (issue 62): the start gate and the end verdict, rows that hold the episode, warm starts
(lora.init / lora.init_sft_config, SFT data an environment makes), the arithmetic expert and `nemo-jax demos`."""

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from nemo_jax.data.chat import ChatTokenizer
from nemo_jax.rl.envs import make_env

from helpers import FAST_COMPILE, micro_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOK = ChatTokenizer.load("builtin:tiny")


def test_arithmetic_expert_and_partial_credit():
    env = make_env("arithmetic", hi=19, partial=5, n_train=64, n_eval=16)
    t = env.tasks("train")[0]
    d = t.data
    assert env.expert(t) == [f"{d['a']} {d['op']} {d['b']} is {d['answer']}."]
    say = lambda text: env.score(t, [*t.messages, {"role": "assistant", "content": text}])  # noqa: E731
    assert say(env.expert(t)[0]).reward == 1.0 and say(env.expert(t)[0]).success
    assert say(f"It is {d['answer'] + 2}.").reward == pytest.approx(0.6) and not say(f"{d['answer'] + 2}").success
    assert say(f"{d['answer'] + 9}").reward == 0.0 and say("no idea").reward == 0.0
    assert make_env("arithmetic").score(t, [{"role": "assistant", "content": f"{d['answer'] + 1}"}]).reward == 0.0
    assert max(x.data["answer"] for x in env.tasks("train") + env.tasks("eval")) <= 38  # (one token each)
    recs = env.demonstrations("eval", 3)
    assert [r["messages"][-1]["content"] for r in recs] == [env.expert(x)[0] for x in env.tasks("eval")[:3]]


def test_demos_command_writes_train_and_eval_and_refuses_what_it_cannot(tmp_path, capsys):
    from nemo_jax.cli import main

    out = tmp_path / "demos"
    main(["demos", "--env", "arithmetic", "--out", str(out), "--n-train", "5", "--n-eval", "2",
          "--env-args", '{"hi": 19}'])
    train = [json.loads(x) for x in open(out / "train.jsonl")]
    assert len(train) == 5 and len([1 for _ in open(out / "eval.jsonl")]) == 2
    env = make_env("arithmetic", hi=19, n_train=5, n_eval=2, seed=100)  # (--seed 100: other tasks than an RL run's)
    assert train == env.demonstrations("train")
    for argv, words in ((["--env", "arithmetic", "--out", str(out)], "not empty"),
                        (["--env", "constraints", "--out", str(tmp_path / "c")], "no demonstrations"),
                        (["--env", "arithmetic", "--out", str(tmp_path / "j"), "--env-args", "{"], "--env-args")):
        with pytest.raises(SystemExit) as e:
            main(["demos", *argv])
        assert e.value.code == 2 and words in capsys.readouterr().err
    assert not (tmp_path / "c").exists() and not (tmp_path / "j").exists()


def test_start_gate_and_end_verdict():
    from nemo_jax.rl.grpo import start_gate, verdict

    ok = start_gate({"pass@1": 0.2, "pass@4": 0.45}, 4, 0.05)
    assert ok == ["grpo: start: held-out pass@1 0.200, pass@4 0.450"]
    flat = start_gate({"pass@1": 0.36, "pass@2": 0.375}, 2, 0.05)
    assert len(flat) == 2 and "pass@2 - pass@1 = 0.015 < eval_min_headroom 0.05" in flat[1]
    assert "not measured" in start_gate({"pass@1": 0.3}, 1, 0.05)[0]
    solved = start_gate({"pass@1": 0.953, "pass@2": 1.0}, 2, 0.05)  # a warm start at the ceiling: nothing to warm
    assert len(solved) == 2 and "already succeeds in 0.953" in solved[1] and "warm-start" not in solved[1]
    rose = verdict([(0, 0.2), (10, 0.3), (20, 0.45)], 2, 20)
    assert rose == ["held-out pass@1 0.200 at step 0 -> 0.450 at step 20"]
    stuck = verdict([(0, 0.363), (60, 0.363)], 36, 60)
    assert any("did not rise" in x for x in stuck) and any("36 of 60 steps had no signal" in x for x in stuck)


EXPERT_ENV = textwrap.dedent('''
    """An environment whose expert writes long answers: its demonstrations need more tokens than a short row."""
    from nemo_jax.rl.envs import Score, SingleTurn, Task, demonstrations


    class Long(SingleTurn):
        name = "long"

        def __init__(self, words=40):
            self.words = words

        def tasks(self, split):
            return [Task(f"{split}{i}", ({"role": "user", "content": "Count."},)) for i in range(4)]

        def expert(self, task):
            return [" ".join(["one"] * self.words)]

        def score(self, task, history):
            ok = history[-1]["content"].count("one") >= self.words
            return Score(float(ok), ok)

        def demonstrations(self, split, n=None):
            return demonstrations(self, split, n)
''')


def test_demonstration_tokens_count_what_a_learner_row_holds(tmp_path, monkeypatch):
    from nemo_jax.config.model import NemotronHConfig
    from nemo_jax.data.chat import parse_record
    from nemo_jax.rl.grpo import demonstration_tokens

    (tmp_path / "long_env.py").write_text(EXPERT_ENV)
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = NemotronHConfig.from_file(micro_model(tmp_path))
    env = make_env("long_env:Long", words=40)
    rec = env.demonstrations("train", 1)[0]
    assert demonstration_tokens(env, TOK, cfg) == len(parse_record(rec, TOK, cfg.vocab_size).ids) > 40
    assert demonstration_tokens(make_env("constraints"), TOK, cfg) == 0  # no expert: nothing to check


def _grpo(tmp_path, *extra):
    model = micro_model(tmp_path)
    return [sys.executable, "-m", "nemo_jax.cli", "grpo", "--config", os.path.join(ROOT, "configs/grpo/tiny-cpu.yaml"),
            f"run_dir={tmp_path / 'run'}", "model.init=random", "model.init_sft_config=null", "lora.init=null",
            f"model.config={model}",
            "rollout.group_size=4", "rollout.groups_per_step=2", "rollout.in_flight_groups=2",
            "logging.tensorboard=false", "eval_every=0", "checkpoint.every=0", *extra]


def _env(tmp_path):
    return dict(os.environ, PYTHONPATH=f"{tmp_path}{os.pathsep}{ROOT}", XLA_FLAGS=FAST_COMPILE, JAX_PLATFORMS="cpu")


@pytest.mark.slow
def test_grpo_refuses_rows_that_would_cut_the_expert_demonstrations(tmp_path):
    """The learner trains on seq_len + 1 tokens of a rollout: a config whose rows cannot hold the expert's
    demonstrations is refused before any sampling, naming rollout.seq_len and the length needed."""
    (tmp_path / "long_env.py").write_text(EXPERT_ENV)
    out = subprocess.run(_grpo(tmp_path, "rollout.env=long_env:Long", "rollout.env_args={words: 40}",
                               "rollout.seq_len=24", "steps=1"),
                         env=_env(tmp_path), cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert out.returncode == 2, out.stdout[-2000:] + out.stderr[-2000:]
    err = out.stderr.strip().splitlines()
    assert len(err) == 1 and "rollout.seq_len=24 is too short" in err[0] and "demonstrations need" in err[0], err
    assert not (tmp_path / "run").exists()  # (nothing left behind)


WARM_SFT = textwrap.dedent('''
    # a LoRA SFT on the arithmetic expert's demonstrations (the GRPO run sets its base model, tokenizer and lora)
    name: warm
    steps: 4
    log_every: 2
    eval_every: 0
    model: {config: tiny, init: random, dtype: float32}
    data:
      sources: [{env: arithmetic, env_args: {hi: 19, n_train: 32, n_eval: 8}, make: demonstrations, tasks: 16}]
      eval: null
      seq_len: 64
      batch_size: 4
    lora: {targets: [all], rank: 4, alpha: 8}
    optim: {lr: 1.0e-2, warmup_steps: 0}
    checkpoint: {every: 0}
    logging: {tensorboard: false}
''')


@pytest.mark.slow
def test_a_warm_start_is_trained_when_missing_and_the_expert_starts_from_it(tmp_path):
    """`lora.init` missing and `lora.init_sft_config` given: the LoRA SFT runs first (on the same base, with the GRPO
    run's LoRA layout), its data made by the environment (RUN/data/env-0.jsonl: the expert's demonstrations); the
    GRPO run starts from its adapters (lr 0: they come out unchanged), and a warm start of another layout is
    refused in one line."""
    from nemo_jax.lora.checkpoint import load_adapter_checkpoint

    (tmp_path / "warm.yaml").write_text(WARM_SFT)
    warm = tmp_path / "warm"
    cmd = _grpo(tmp_path, "rollout.env=arithmetic", "rollout.env_args={hi: 19, n_train: 32, n_eval: 8}",
                "rollout.max_new_tokens=8", "rollout.seq_len=48", "steps=1", "optim.lr=0.0", "lora.rank=4",
                "lora.alpha=8", f"lora.init={warm}", f"lora.init_sft_config={tmp_path / 'warm.yaml'}")
    out = subprocess.run(cmd, env=_env(tmp_path), cwd=tmp_path, capture_output=True, text=True, timeout=1200)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert f"lora.init {warm} does not exist yet" in out.stdout
    made = [json.loads(x) for x in open(warm / "data" / "env-0.jsonl")]
    env = make_env("arithmetic", hi=19, n_train=32, n_eval=8)
    assert made == env.demonstrations("train", 16)
    _, lc, trained = load_adapter_checkpoint(str(warm / "adapters"))
    _, _, final = load_adapter_checkpoint(str(tmp_path / "run" / "adapters"))
    assert lc.rank == 4 and lc.alpha == 8
    flat = lambda t: np.concatenate([np.ravel(x) for x in jax_leaves(t)])  # noqa: E731
    assert np.abs(flat(trained)).sum() > 0 and np.array_equal(flat(trained), flat(final))
    bad = subprocess.run(_grpo(tmp_path, "rollout.env=arithmetic", "rollout.env_args={hi: 19, n_train: 32, n_eval: 8}",
                               "rollout.seq_len=48", "steps=1", "lora.rank=8", f"lora.init={warm}",
                               f"run_dir={tmp_path / 'run2'}"),
                         env=_env(tmp_path), cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert bad.returncode == 2 and "lora.init" in bad.stderr and "lora.rank 8" in bad.stderr, bad.stderr[-2000:]


def jax_leaves(tree):
    import jax

    return jax.tree.leaves(tree)


class _Always:
    """A text environment whose every answer succeeds, two tasks."""
    name = "always"
    max_turns = 1

    def tasks(self, split):
        from nemo_jax.rl.envs import Task

        return [Task(f"t{i}", ({"role": "user", "content": f"Say anything {i}."},)) for i in range(2)]

    def respond(self, task, history):
        return None

    def score(self, task, history):
        from nemo_jax.rl.envs import Score

        return Score(1.0, True)


def test_rejection_sampling_keeps_each_distinct_success_once(tmp_path):
    """One round of rejection sampling: every attempt of every task sampled from the start model, the successes
    kept as chat records (the task's messages and the answer), each distinct conversation once, at most per_task."""
    import jax

    from nemo_jax.config.model import NemotronHConfig
    from nemo_jax.model.spec import init
    from nemo_jax.rl.envs import as_environment
    from nemo_jax.rl.warmstart import rejection_sampling

    cfg = NemotronHConfig.from_file(micro_model(tmp_path))
    params = init(cfg, jax.random.key(0))
    env = as_environment(_Always())
    recs = rejection_sampling(env, (cfg, params, TOK), "data.sources[0]", None, attempts=6, max_new_tokens=1,
                              temperature=1.0, seed=0, per_task=None, rows=8, max_len=64)
    assert recs and all(r["messages"][0]["content"].startswith("Say anything") for r in recs)
    assert len({json.dumps(r, sort_keys=True) for r in recs}) == len(recs) <= 12
    capped = rejection_sampling(env, (cfg, params, TOK), "data.sources[0]", None, attempts=6, max_new_tokens=1,
                                temperature=1.0, seed=0, per_task=1, rows=8, max_len=64)
    assert len(capped) == 2 and capped == [recs[0], next(r for r in recs if "1." in r["messages"][0]["content"])]


class _Picture:
    """Two tasks whose prompt shows a picture; every answer succeeds."""
    name, max_turns = "picture", 1

    def tasks(self, split):
        from PIL import Image

        from nemo_jax.rl.envs import Task

        return [Task(f"p{i}", ({"role": "user", "content": [
            {"type": "image", "image": Image.new("RGB", (16, 16), (40 * i, 90, 200))},
            {"type": "text", "text": f"What colour is picture {i}?"}]},)) for i in range(2)]

    def respond(self, task, history):
        return None

    def score(self, task, history):
        from nemo_jax.rl.envs import Score

        return Score(1.0, True)


def test_rejection_sampling_keeps_pictures_as_the_chat_data_reads_them(tmp_path):
    """A vision-language environment's successes are kept with their pictures as PNG data URLs: records the chat
    data parser reads back into the same image tokens and pixels the sampler saw."""
    import jax
    import numpy as np

    from nemo_jax.config.model import NemotronHConfig
    from nemo_jax.data.chat import ChatTokenizer, parse_record
    from nemo_jax.data.images import load_image
    from nemo_jax.model.spec import init
    from nemo_jax.rl.envs import as_environment
    from nemo_jax.rl.warmstart import rejection_sampling

    cfg = NemotronHConfig.from_file(micro_model(tmp_path, base="tiny-vl"))
    params = init(cfg, jax.random.key(0))
    tok = ChatTokenizer.load("builtin:tiny_vl")
    recs = rejection_sampling(as_environment(_Picture()), (cfg, params, tok), "data.sources[0]", None, attempts=3,
                              max_new_tokens=2, temperature=1.0, seed=0, per_task=1, rows=4, max_len=256)
    assert len(recs) == 2
    for i, rec in enumerate(recs):
        parts = rec["messages"][0]["content"]
        assert parts[0]["type"] == "image_url" and parts[0]["image_url"]["url"].startswith("data:image/png;base64,")
        doc = parse_record(json.dumps(rec), tok, cfg.vocab_size)
        assert len(doc.images) == 1 and doc.mask.any() and list(doc.image_hw[0]) == [16, 16]
        assert np.asarray(load_image(doc.images[0])).reshape(-1, 3)[0].tolist() == [40 * i, 90, 200]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["tiny-swe", "tiny-vl-chart", "tiny-vl-mcp", "tiny-vl-gui", "tiny-arithmetic"])
def test_shipped_configs_rows_hold_their_expert_demonstrations(name):
    """Every shipped config of an environment with an expert: a learner row (seq_len + 1 tokens) holds its
    demonstrations whole (the swe and chart configs once cut the tokens that decide the reward)."""
    from nemo_jax.config.model import NemotronHConfig
    from nemo_jax.config.train import load_grpo_config
    from nemo_jax.rl.grpo import demonstration_tokens
    from nemo_jax.train.sft import model_config_path

    c = load_grpo_config(os.path.join(ROOT, "configs/grpo", f"{name}.yaml"))
    cfg = NemotronHConfig.from_file(model_config_path(c.model.config))
    env = make_env(c.rollout.env, **c.rollout.env_args)
    need = demonstration_tokens(env, ChatTokenizer.load(c.tokenizer), cfg, n=16)
    assert 0 < need <= c.rollout.seq_len + 1, (name, need, c.rollout.seq_len)


def test_eval_refuses_a_bad_environment_before_loading_the_model(tmp_path):
    """`nemo-jax eval` checks --env and --env-args before JAX loads (a model path that does not exist is never
    reached): one line naming the flag, exit 2, in well under the time a model takes to load."""
    import time

    for argv, words in ((["--env", "constraints", "--env-args", '{"k": 3,}'], "--env-args: not valid JSON"),
                        (["--env", "constrains"], "--env constrains"),
                        (["--env", "constraints", "--env-args", '{"kk": 3}'], "--env-args: ")):
        t0 = time.monotonic()
        out = subprocess.run([sys.executable, "-m", "nemo_jax.cli", "eval", "--ckpt", str(tmp_path / "nothing"), *argv],
                             capture_output=True, text=True, timeout=120)
        err = out.stderr.strip().splitlines()
        assert out.returncode == 2 and len(err) == 1 and words in err[0], err
        assert time.monotonic() - t0 < 30


def test_a_warm_start_trained_from_another_base_is_refused(tmp_path):
    """lora.init names a LoRA run trained from another model.init (its config.yaml says which): refused in one line,
    never loaded onto a base it was not fitted to (a first-hour run from runs/sft must not take a warm start that a
    run from runs/tiny-cpu made)."""
    from types import SimpleNamespace

    from nemo_jax.train.sft import initial_adapters

    warm = tmp_path / "warm"
    warm.mkdir()
    (warm / "config.yaml").write_text("model:\n  init: runs/other-base\n")
    c = SimpleNamespace(lora=SimpleNamespace(init=str(warm), init_sft_config=None),
                        model=SimpleNamespace(init="runs/sft", config="tiny", seed=0))
    with pytest.raises(ValueError, match=r"lora.init .*warm was trained from model.init runs/other-base; this run "
                                         r"starts from runs/sft"):
        initial_adapters(c, None, None, tokenizer="builtin:tiny")
