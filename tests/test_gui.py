"""The GUI environment's difficulty ladder and answers, the screen-dependence check (`nemo-jax eval --images`), and
the eval's standard error. No model: these run in well under a second each."""

import asyncio
import importlib.util

import numpy as np
import pytest

from nemo_jax.rl.ablation import ImageAblation, ablate
from nemo_jax.rl.envs import Observation, Task, make_env
from nemo_jax.rl.grpo import standard_error
from nemo_jax.rl.envs.gui import GUIEnv


def _picture(obs):
    return next(p["image"] for m in obs.messages for p in m["content"] if p["type"] == "image")


def test_button_count_ladder_and_families():
    env = GUIEnv(families=("click",), n_train=200, n_eval=8, seed=1, n_buttons=[1, 3])
    counts = [len(t.data["buttons"]) for t in env.tasks("train")]
    assert set(counts) == {1, 2, 3}
    assert all(t.family == f"click{len(t.data['buttons'])}" for t in env.tasks("train"))
    fixed = GUIEnv(families=("click",), n_train=5, n_eval=2, n_buttons=2)
    assert {t.family for t in fixed.tasks("train")} == {"click2"}
    for bad in (0, 7, [3, 1], [1, 2, 3], "2", True):
        with pytest.raises(ValueError, match="n_buttons"):
            GUIEnv(n_buttons=bad)


def test_typing_without_focus_says_so_and_types_nothing():
    env = GUIEnv(families=("form",), n_train=3, n_eval=1, seed=2)
    task = env.tasks("train")[0]
    ep = env.episode()
    ep.start(task, "r")
    o = ep.step({"role": "assistant", "content": "type " + task.data["word"]})
    said = [p["text"] for p in o.messages[0]["content"] if p["type"] == "text"]
    assert said == ["nothing typed: no text box has focus"] and o.reward == 0.0 and not o.done
    o = ep.step({"role": "assistant", "content": GUIEnv.expert(task)[0]})  # click the box
    o = ep.step({"role": "assistant", "content": "type " + task.data["word"]})
    assert [p["text"] for p in o.messages[0]["content"] if p["type"] == "text"] == ["ok"]


def test_blank_and_shuffled_screens():
    env = make_env("gui", families=["click"], n_train=6, n_eval=6, seed=4)
    real = {t.id: np.asarray(_picture(env.episode().start(t, "x"))) for t in env.tasks("eval")}
    assert ablate(env, "real") is env
    blank = ablate(env, "blank")
    for t in blank.tasks("eval"):
        ep = blank.episode()
        obs = ep.start(t, "x")
        pic = np.asarray(_picture(obs))
        assert pic.shape == real[t.id].shape and len(np.unique(pic.reshape(-1, 3), axis=0)) == 1
        o = ep.step({"role": "assistant", "content": GUIEnv.expert(t)[0]})  # still scored on the real screen
        assert o.reward == 1.0 and o.success
    shuffled = ablate(env, "shuffle", seed=3)
    seen = []
    for t in shuffled.tasks("eval"):
        pic = np.asarray(_picture(shuffled.episode().start(t, "x")))
        assert not np.array_equal(pic, real[t.id])
        donors = [k for k, v in real.items() if np.array_equal(v, pic)]
        assert len(donors) == 1 and donors[0] != t.id
        seen.append(donors[0])
    assert sorted(seen) == sorted(real)  # a permutation of the tasks' own screens
    with pytest.raises(ValueError, match="mode"):
        ImageAblation(env, "dark")


class _AsyncPictures:
    """An async environment whose opening messages are the task's own (shared) dicts."""
    name, max_turns = "async-pics", 1

    def __init__(self):
        from PIL import Image

        self._tasks = [Task(f"t{i}", ({"role": "user", "content": [
            {"type": "image", "image": Image.new("RGB", (16, 16), (40 * i, 0, 0))}, {"type": "text", "text": "?"}]},),
            {}) for i in range(3)]

    def tasks(self, split):
        return self._tasks

    def episode(self):
        return _AsyncEpisode()


class _AsyncEpisode:
    async def start(self, task, rollout_id):
        return Observation(list(task.messages))

    async def step(self, message):
        return Observation([], 1.0, True, True)

    def close(self):
        pass


def test_ablation_wraps_async_episodes_and_leaves_the_tasks_alone():
    env = _AsyncPictures()
    before = [t.messages[0]["content"][0]["image"] for t in env.tasks("eval")]
    wrapped = ablate(env, "shuffle")
    for t in wrapped.tasks("eval"):
        obs = asyncio.run(wrapped.episode().start(t, "x"))
        got = np.asarray(_picture(obs))
        own = np.asarray(t.messages[0]["content"][0]["image"])
        assert got.shape == own.shape and not np.array_equal(got, own)
    assert [t.messages[0]["content"][0]["image"] for t in env.tasks("eval")] == before  # not replaced in place


def test_standard_error_over_tasks():
    x = np.array([[1.0, 0.0], [1.0, 1.0], [0.0, 0.0], [0.5, 0.5]])
    per_task = x.mean(1)
    assert standard_error(x) == pytest.approx(per_task.std(ddof=1) / 2)
    assert standard_error(x[:1]) == 0.0


def test_an_ablation_of_a_text_environment_says_it_changed_nothing():
    """`eval --images blank` on a text environment: one line says nothing was replaced; on a picture environment
    nothing is said."""
    from nemo_jax.rl.ablation import ablation_note
    from nemo_jax.rl.envs import make_env

    text = ablate(make_env("arithmetic", n_train=2, n_eval=2), "blank")
    for t in text.tasks("eval"):
        text.episode().start(t, "x")
    note = ablation_note(text)
    assert note and "--images blank" in note and "no pictures" in note and "arithmetic" in note
    pics = ablate(_AsyncPictures(), "blank")
    for t in pics.tasks("eval"):
        asyncio.run(pics.episode().start(t, "x"))
    assert ablation_note(pics) is None and ablation_note(make_env("arithmetic")) is None


def test_eval_help_lists_every_builtin_environment_from_the_registry(capsys, tmp_path):
    """`eval --help` names each built-in environment (from `BUILTIN_ENVS`, the registry `make_env` builds from),
    and each name builds its class (with its required arguments: nemo_gym's rows, a server it does not call yet)."""
    from nemo_jax.cli import main
    from nemo_jax.rl.envs import make_env
    from nemo_jax.rl.envs.episode import BUILTIN_ENVS

    with pytest.raises(SystemExit):
        main(["eval", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert all(name in text for name in BUILTIN_ENVS) and {"gui", "mcp", "inbox"} <= set(BUILTIN_ENVS)
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"responses_create_params": {"input": "hi"}}\n')
    required = {"nemo_gym": {"data": str(rows), "url": "http://127.0.0.1:1"}}
    for name, where in BUILTIN_ENVS.items():
        if name != "mcp" or importlib.util.find_spec("mcp"):
            assert type(make_env(name, **required.get(name, {}))).__name__ == where.rpartition(":")[2]
