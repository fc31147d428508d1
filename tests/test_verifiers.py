"""`verifiers:<id>` environments (nemo_jax.rl.envs.verifiers_env) with REAL verifiers 0.4.0: an unchanged taskset
package with a tool (one written here, installed into the venv as a package; and verifiers' own `glossary` when a
verifiers source checkout is given), each episode run by verifiers itself (its null harness program in the
subprocess runtime, its MCP tool server, its reward methods) against nemo_jax's sampler through the bridge.

* scripted turns: the right tool call then the right answer earns what the task's @vf.reward says (1), a wrong
  answer 0; the tool's answer comes back as the next observation; a turn cut short cancels the episode;
* `nemo-jax eval --env verifiers:<id>` and three `nemo-jax grpo` steps on the taskset: every step's learner /
  sampler mismatch <= 1e-6 (nemo_jax's own token record) and rewards from verifiers;
* `nemo-jax serve`'s token-in route (`/inference/v1/generate`) as verifiers' train client reads it: renderers'
  own parser of the answer, the logprobs the learner computes.

Not in the default run: the `verifiers` marker opts in (tests/conftest.py), in a venv with verifiers 0.4.0 and uv
(its pins clash with nemo_jax's mcp / worker extras): `python tools/tiers/verifiers.py tier`.
$NEMO_JAX_VERIFIERS_EXAMPLES: a verifiers source checkout whose environments/glossary is installed too."""

import asyncio
import json
import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.verifiers
vf = pytest.importorskip("verifiers.v1", reason="the verifiers tier runs in a venv with verifiers 0.4.0 "
                                                "(python tools/tiers/verifiers.py tier)")

from helpers import FAST_COMPILE, micro_model  # noqa: E402

from nemo_jax.rl.envs import make_env  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.environ.get("NEMO_JAX_VERIFIERS_EXAMPLES")

def pyproject(name: str, version: str, modules: str) -> str:
    """The pyproject.toml of a test package that needs verifiers (setuptools; `modules`: its [tool.setuptools]
    line)."""
    return (f'[project]\nname = "{name}"\nversion = "{version}"\ndependencies = ["verifiers"]\n'
            '[build-system]\nrequires = ["setuptools>=61"]\nbuild-backend = "setuptools.build_meta"\n'
            f"[tool.setuptools]\n{modules}\n")


# a taskset package as a verifiers user writes one: tasks, a task-scoped tool (an MCP server verifiers launches per
# rollout), a reward on the final reply
PACKAGE = {
    "pyproject.toml": pyproject("nj-adder", "0.1.0", 'packages = ["nj_adder", "nj_adder.servers"]'),
    "nj_adder/__init__.py": """
        from nj_adder.taskset import AdderTaskset

        __all__ = ["AdderTaskset"]
        """,
    "nj_adder/servers/__init__.py": "",
    "nj_adder/servers/calc.py": """
        import verifiers.v1 as vf


        class AdderTools(vf.Toolset[vf.ToolsetConfig]):
            TOOL_PREFIX = "calc"

            @vf.tool
            def add(self, a: int, b: int) -> str:
                \"\"\"Add two integers.\"\"\"
                return str(int(a) + int(b))


        if __name__ == "__main__":  # (verifiers runs the tool server as this module)
            AdderTools.run()
        """,
    "nj_adder/taskset.py": """
        import verifiers.v1 as vf
        from nj_adder.servers.calc import AdderTools


        class AdderTaskConfig(vf.TaskConfig):
            tools: vf.ToolsetConfig = vf.ToolsetConfig()


        class AdderData(vf.TaskData):
            answer: int


        class AdderTask(vf.Task[AdderData, vf.State, AdderTaskConfig]):
            @classmethod
            def toolsets(cls, config):
                return [AdderTools(config.tools)]

            @vf.reward(weight=1.0)
            async def exact(self, trace: vf.Trace) -> float:
                return float(str(self.data.answer) in (trace.last_reply or ""))

            @vf.metric
            async def replied(self, trace: vf.Trace) -> float:
                return float(bool(trace.last_reply))


        class AdderConfig(vf.TasksetConfig):
            task: AdderTaskConfig = AdderTaskConfig()


        class AdderTaskset(vf.Taskset[AdderTask, AdderConfig]):
            def load(self):
                return [AdderTask(AdderData(idx=i, name=f"add-{a}-{b}", answer=a + b,
                                            prompt=f"Use the calc_add tool to add {a} and {b}, then reply with the sum."),
                                  self.config.task)
                        for i, (a, b) in enumerate([(2, 3), (10, 7), (21, 4), (8, 8), (5, 13), (30, 12)])]
        """,
}


# a classic environment package (verifiers 0.3's `load_environment()`): a ToolEnv over a Python function and a rubric
CLASSIC = {
    "pyproject.toml": pyproject("nj-classic-adder", "0.2.0", 'py-modules = ["nj_classic_adder"]'),
    "nj_classic_adder.py": """
        import verifiers as vf
        from datasets import Dataset


        def add(a: int, b: int) -> int:
            \"\"\"Add two integers.\"\"\"
            return int(a) + int(b)


        async def exact(completion, answer, **kwargs) -> float:
            text = completion[-1]["content"] if completion else ""
            return float(answer in (text or ""))


        async def tool_turns(completion, **kwargs) -> float:
            return float(sum(m["role"] == "tool" for m in completion))


        async def shortest(completions, **kwargs) -> list[float]:
            \"\"\"A group reward: 1 for the group's shortest final reply.\"\"\"
            lengths = [len(c[-1]["content"] or "") if c else 10 ** 9 for c in completions]
            return [float(n == min(lengths)) for n in lengths]


        def load_environment(group_reward: bool = False, **kwargs):
            pairs = [(2, 3), (10, 7), (21, 4), (8, 8), (5, 13), (30, 12)]
            rows = [{"question": f"Use the add tool to add {a} and {b}, then reply with the sum.", "answer": str(a + b)}
                    for a, b in pairs]
            funcs, weights = [exact, tool_turns], [1.0, 0.0]
            if group_reward:
                funcs, weights = funcs + [shortest], weights + [0.5]
            rubric = vf.Rubric(funcs=funcs, weights=weights)
            return vf.ToolEnv(dataset=Dataset.from_list(rows), tools=[add], rubric=rubric, max_turns=3, **kwargs)
        """,
}


def _install(directory, files) -> None:
    """Install the package `files` describe unless that version of it is installed already."""
    import importlib.metadata as md
    import re

    name, version = re.search(r'name = "(.+)"\s+version = "(.+)"', files["pyproject.toml"]).groups()
    try:
        if md.version(name) == version:
            return
    except md.PackageNotFoundError:
        pass
    for rel, text in files.items():
        path = directory / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text).lstrip())
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", str(directory)],
                   check=True, capture_output=True)


@pytest.fixture(scope="module")
def adder(tmp_path_factory):
    _install(tmp_path_factory.mktemp("nj-adder"), PACKAGE)
    env = make_env("verifiers:nj_adder", n_eval=2, max_turns=3)
    try:
        yield env
    finally:
        env.close()


def _call(tool: str, **arguments) -> dict:
    return {"role": "assistant", "content": "<tool_call>" + json.dumps({"name": tool, "arguments": arguments})
            + "</tool_call>"}


async def _play(env, task, turns: list[dict]):
    """An episode driven as nemo_jax's sampler drives it, with these assistant turns -> the observations."""
    ep = env.episode()
    obs = [await ep.start(task, "r")]
    try:
        for t in turns:
            if obs[-1].done:
                break
            obs.append(await ep.step(t))
    finally:
        await ep.close()
    return obs


CLASSIC_VERSION = getattr(sys.modules.get("verifiers"), "__version__", "") or ""


@pytest.mark.skipif(not CLASSIC_VERSION.startswith("0.3"), reason="classic environments: a venv with verifiers 0.3 "
                    "(python tools/tiers/verifiers.py tier --classic)")
def test_a_classic_environment_scored_by_its_rubric(tmp_path):
    """verifiers 0.3's classic ToolEnv (a Python function tool, a rubric of two functions) run by its own rollout
    loop against the bridge: the right tool call and answer earn the rubric's reward, a wrong one 0, the rubric's
    functions are logged as metrics; then eval and three on-policy grpo steps."""
    _install(tmp_path / "pkg", CLASSIC)
    env = make_env("verifiers:nj_classic_adder", n_eval=2, max_turns=3)
    try:
        tasks = env.tasks("train")
        assert len(tasks) == 4 and "add 2 and 3" in tasks[0].messages[-1]["content"]
        obs = asyncio.run(_play(env, tasks[0], [_call("add", a=2, b=3), {"role": "assistant", "content": "5"}]))
        assert [t["function"]["name"] for t in obs[0].tools] == ["add"]
        assert obs[1].messages[0]["role"] == "tool" and obs[1].messages[0]["content"].strip() == "5"
        assert obs[-1].done and obs[-1].reward == 1.0 and obs[-1].info["vf/tool_turns"] == 1.0
        wrong = asyncio.run(_play(env, tasks[0], [{"role": "assistant", "content": "It is 7."}]))
        assert wrong[-1].done and wrong[-1].reward == 0.0
    finally:
        env.close()
    _eval_and_grpo(tmp_path, "nj_classic_adder", n_eval=2, need_trained=0)


@pytest.mark.skipif(not CLASSIC_VERSION.startswith("0.3"), reason="classic environments: a venv with verifiers 0.3 "
                    "(python tools/tiers/verifiers.py tier --classic)")
def test_a_classic_group_rubric_scores_the_group_together(tmp_path):
    """A rubric with a group reward function (one that takes `completions`): each episode runs alone, then the
    group is scored together when all of it has ended, as verifiers' run_group scores it (its own score_group):
    the shortest right reply earns the group bonus."""
    _install(tmp_path / "pkg", CLASSIC)
    env = make_env("verifiers:nj_classic_adder", n_eval=2, max_turns=3, env_args={"group_reward": True})
    try:
        assert callable(getattr(env, "score_group", None))
        task = env.tasks("train")[0]
        call = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'
        got = _drive(env, task, {"a": [call, "The sum is 5."], "b": [call, "5"], "c": ["It is 7."]}, tmp_path)
        assert [r.reward for r in got] == [1.0, 1.5, 0.0]
        assert [r.info["vf/shortest"] for r in got] == [0.0, 1.0, 0.0] and got[1].info["vf/tool_turns"] == 1.0
    finally:
        env.close()


class Scripted:
    """A `Sampler` (nemo_jax.generate.sampler) whose turns are scripted: each rollout's next text from its own
    script (`scripts[rollout_id]`), ended by the tokenizer's end of turn, logprob -1 a token; what the episode
    driver samples through, without a model."""

    version, queued = 0, 0

    def __init__(self, tok, scripts: dict):
        self.tok, self.scripts, self.ready, self.tags, self.n = tok, {k: list(v) for k, v in scripts.items()}, [], {}, 0

    @property
    def busy(self):
        return len(self.ready)

    def submit(self, tokens, sp, *, images=None, tag=None):
        self.n += 1
        self.tags[self.n] = tag
        self.ready.append(self.n)
        return self.n

    def feed(self, seq_id, tokens, *, images=None):
        self.ready.append(seq_id)

    def room(self, seq_id):
        return 1 << 20

    def release(self, seq_id):
        self.tags.pop(seq_id, None)

    def step(self):
        from nemo_jax.generate.sampler import TurnEnd

        ends, self.ready = self.ready, []
        out = []
        for sid in ends:
            tag = self.tags[sid]
            text = self.scripts[tag.rollout_id].pop(0)
            ids = self.tok.tokenizer.encode(text, add_special_tokens=False).ids + [self.tok.eos_ids()[0]]
            out.append(TurnEnd(sid, ids, [-1.0] * len(ids), "stop", 0, tag, (0,)))
        return out


def _drive(env, task, scripts: dict, tmp_path) -> list:
    """Episodes of `task` (one group, a rollout per script) run by nemo_jax's episode driver with scripted turns
    -> their rollouts."""
    from nemo_jax.config.model import NemotronHConfig
    from nemo_jax.data.chat import ChatTokenizer
    from nemo_jax.generate import SamplingParams
    from nemo_jax.rl.transport.producer import EpisodeDriver

    tok = ChatTokenizer.load("builtin:tiny")
    cfg = NemotronHConfig.from_file(micro_model(tmp_path))
    d = EpisodeDriver(Scripted(tok, scripts), tok, cfg, env, SamplingParams(max_new_tokens=64))
    for rid in scripts:
        d.add(task, "g", rid)
    out = []
    try:
        while d.running:
            out += d.pump()
    finally:
        d.close()
    return sorted(out, key=lambda r: r.rollout_id)


def test_a_compacting_harness_trains_each_branch(tmp_path):
    """verifiers' own bash harness with context compaction (at 1 token: after the first tool result): the harness
    asks for a summary, then starts a new conversation from it. nemo_jax sees the new conversation as a branch
    (`Observation.restart`): one rollout, two branches, the second opening with the rebuilt conversation's own
    prompt; the reward is the task's, as verifiers scores the episode."""
    from nemo_jax.data.chat import ChatTokenizer
    from nemo_jax.rl.rollout import learner_batch

    _install(tmp_path / "pkg", PACKAGE)
    env = make_env("verifiers:nj_adder", harness="bash", max_turns=4,
                   harness_args={"edit": False, "compaction": {"summarize_at_tokens": 1}})
    try:
        task = env.tasks("train")[0]
        obs = asyncio.run(_play(env, task, [_call("calc_add", a=2, b=3),
                                            {"role": "assistant", "content": "I added 2 and 3 with the tool: 5."},
                                            {"role": "assistant", "content": "5"}]))
        assert [o.restart for o in obs] == [False, False, True, False]
        assert obs[1].messages[0]["role"] == "tool" and obs[1].messages[-1]["role"] == "user"  # (the checkpoint ask)
        assert "I added 2 and 3 with the tool: 5." in obs[2].messages[-1]["content"]  # (the rebuilt conversation)
        assert obs[-1].done and obs[-1].reward == 1.0 and obs[-1].info["vf/reward/exact"] == 1.0
        scripts = {"r0": ['<tool_call>{"name": "calc_add", "arguments": {"a": 2, "b": 3}}</tool_call>',
                          "The tool said 5.", "5"],
                   "r1": ["It is 6."]}
        r0, r1 = _drive(env, task, scripts, tmp_path)
        tok = ChatTokenizer.load("builtin:tiny")
        assert len(r0.branches) == 1 and r0.reward == 1.0 and r0.info["vf/reward/exact"] == 1.0
        second = tok.tokenizer.decode(r0.tokens[r0.branches[0]:], skip_special_tokens=True)
        assert "The tool said 5." in second and "calc_add" not in second.split("The tool said 5.")[1]
        assert r1.branches == [] and r1.reward == 0.0
        batch, counts = learner_batch([[r0, r1]], 4096)
        assert batch["segment_ids"][0].max() == 2 and counts["truncated"] == 0
        assert batch["loss_mask"][0].sum() == sum(r0.loss_mask)  # (every sampled token of both branches trained)
    finally:
        env.close()


def test_scripted_episodes_are_scored_by_the_tasks_own_rewards(adder):
    tasks = adder.tasks("train")
    assert len(tasks) == 4 and len(adder.tasks("eval")) == 2 and tasks[0].family == "nj_adder"
    a, b = 2, 3
    obs = asyncio.run(_play(adder, tasks[0], [_call("calc_add", a=a, b=b), {"role": "assistant", "content": "5"}]))
    first = obs[0]
    assert first.messages[-1]["role"] == "user" and "calc_add" in first.messages[-1]["content"]
    assert [t["function"]["name"] for t in first.tools] == ["calc_add"]
    tool = obs[1]
    assert not tool.done and tool.messages[0]["role"] == "tool" and tool.messages[0]["content"].strip() == "5"
    assert obs[2].done and obs[2].reward == 1.0 and obs[2].success
    assert obs[2].info["vf/reward/exact"] == 1.0 and obs[2].info["vf/replied"] == 1.0
    wrong = asyncio.run(_play(adder, tasks[0], [{"role": "assistant", "content": "It is 7."}]))
    assert wrong[-1].done and wrong[-1].reward == 0.0 and not wrong[-1].success
    # cut short after the tool call (nemo_jax's max_turns, a timeout): the verifiers episode is cancelled
    cut = asyncio.run(_play(adder, tasks[1], [_call("calc_add", a=10, b=7)]))
    assert not cut[-1].done


@pytest.mark.skipif(not EXAMPLES, reason="$NEMO_JAX_VERIFIERS_EXAMPLES: a verifiers checkout (environments/glossary)")
def test_verifiers_own_glossary_example(tmp_path):
    try:
        import glossary  # noqa: F401
    except ImportError:
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps",
                        os.path.join(EXAMPLES, "environments", "glossary")], check=True, capture_output=True)
    from glossary.servers.facts import FACTS

    env = make_env("verifiers:glossary", max_turns=3)
    try:
        task = env.tasks("train")[0]
        name = task.data["vf_task"].data.name
        obs = asyncio.run(_play(env, task, [_call("facts_lookup", name=name), {
            "role": "assistant", "content": f"<answer>{FACTS[name.lower()]}</answer>"}]))
        assert obs[1].messages[0]["content"].strip() == FACTS[name.lower()]
        assert obs[-1].done and obs[-1].reward == 1.0
    finally:
        env.close()


def _env():
    return dict(os.environ, PYTHONPATH=ROOT, XLA_FLAGS=FAST_COMPILE, JAX_PLATFORMS="cpu")


def test_eval_and_grpo_on_a_verifiers_taskset(tmp_path, adder):
    _eval_and_grpo(tmp_path, "nj_adder", n_eval=2, need_trained=1)


@pytest.mark.skipif(not EXAMPLES, reason="$NEMO_JAX_VERIFIERS_EXAMPLES: a verifiers checkout (environments/glossary)")
def test_eval_and_grpo_on_verifiers_own_glossary(tmp_path):
    _eval_and_grpo(tmp_path, "glossary", n_eval=2, need_trained=0)


def _eval_and_grpo(tmp_path, taskset: str, n_eval: int, need_trained: int):
    """Three on-policy `nemo-jax grpo` steps on the taskset (a random micro model: the loop, not learning), every
    step's mismatch <= 1e-6, then `nemo-jax eval` of the result on the held-out tasks."""
    import jax

    from nemo_jax.checkpoint import save_model
    from nemo_jax.config.model import NemotronHConfig
    from nemo_jax.data.chat import resolve
    from nemo_jax.model import init

    cfg = NemotronHConfig.from_file(micro_model(tmp_path))
    model = str(tmp_path / "model")
    save_model(model, cfg, init(cfg, jax.random.key(0)), tokenizer_dir=resolve("builtin:tiny"))
    args = json.dumps({"n_eval": n_eval, "max_turns": 2})
    grpo = subprocess.run(
        [sys.executable, "-m", "nemo_jax.cli", "grpo", "--config", os.path.join(ROOT, "configs/grpo/tiny-cpu.yaml"),
         f"run_dir={tmp_path / 'run'}", f"model.init={model}", "model.init_sft_config=null", "lora.init=null",
         f"rollout.env=verifiers:{taskset}", f"rollout.env_args={args}", "rollout.group_size=4",
         "rollout.groups_per_step=2", "rollout.in_flight_groups=2", "rollout.max_off_policy_steps=0",
         "rollout.seq_len=1024", "rollout.max_new_tokens=24",
         "steps=3", "logging.tensorboard=false", "eval_every=0", "checkpoint.every=0"],
        env=_env(), cwd=tmp_path, capture_output=True, text=True, timeout=1200)
    assert grpo.returncode == 0, grpo.stdout[-2000:] + grpo.stderr[-3000:]
    steps = [json.loads(x) for x in open(tmp_path / "run" / "metrics.jsonl")]
    assert max(s.get("step", 0) for s in steps) == 3 and any("reward_mean" in s for s in steps), steps
    trained = [s["mismatch_kl"] for s in steps if "mismatch_kl" in s]  # (a step without signal trains nothing)
    assert len(trained) >= need_trained, steps
    # on-policy, nemo_jax's own token record: the learner recomputes what the sampler drew
    assert all(abs(kl) <= 1e-6 for kl in trained), trained
    out = subprocess.run([sys.executable, "-m", "nemo_jax.cli", "eval", "--ckpt", model, "--adapters",
                          str(tmp_path / "run"), "--env", f"verifiers:{taskset}", "--env-args", args, "--attempts", "2",
                          "--max-new-tokens", "24", "--json", str(tmp_path / "eval.json")],
                         env=_env(), cwd=tmp_path, capture_output=True, text=True, timeout=1200)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.load(open(tmp_path / "eval.json"))
    assert got["tasks"] == n_eval and got["attempts"] == 2


def test_the_token_route_parses_in_the_train_clients_reader(tmp_path):
    """renderers (what verifiers 0.4's TrainClient and prime-rl sample through) parses nemo-jax serve's
    /inference/v1/generate answer: its token ids, and logprobs the learner's within 2e-4 (sampled, temperature 1)."""
    import jax
    import numpy as np
    from renderers.client import _parse_completion_logprobs, parse_generate_response

    from nemo_jax.checkpoint import save_model
    from nemo_jax.config.model import NemotronHConfig
    from nemo_jax.data.chat import resolve
    from nemo_jax.model import init
    from test_serve import Server, _learner_logprobs

    cfg = NemotronHConfig.from_file(micro_model(tmp_path))
    params = init(cfg, jax.random.key(0))
    save_model(str(tmp_path / "model"), cfg, params, tokenizer_dir=resolve("builtin:tiny"))
    srv = Server(tmp_path, ["--ckpt", str(tmp_path / "model"), "--served-model-name", "m", "--max-num-seqs", "2"])
    try:
        prompt = [5, 6, 7, 8]
        for sp in ({"max_tokens": 12, "temperature": 1.0, "seed": 3, "logprobs": 1, "ignore_eos": True},
                   {"max_tokens": 6, "temperature": 0, "logprobs": 1, "skip_special_tokens": False}):
            r = srv.post("/inference/v1/generate", {"model": "m", "token_ids": prompt, "sampling_params": sp,
                                                    "cache_salt": "v0"})
            data = parse_generate_response(r.content)
            ch = data["choices"][0]
            lps = _parse_completion_logprobs(ch, ch["token_ids"])
            assert data["request_id"] and ch["token_ids"] and len(lps) == len(ch["token_ids"])
            np.testing.assert_allclose(lps, _learner_logprobs(cfg, params, prompt, ch["token_ids"], 1.0), atol=2e-4)
    finally:
        srv.close()
