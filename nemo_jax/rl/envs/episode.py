"""The episode protocol every RL environment speaks (the built-in ones under `nemo_jax.rl.envs` and user
environments): its types, the wrapper of the synchronous form, the bases of single-turn environments, and
`demonstrate` (an expert's turns through a real episode). A base module: it imports no environment, so the
registry (`nemo_jax.rl.envs.make_env`) and the environments can all import it.

An environment hands out `Task`s (`tasks(split)`) and runs one EPISODE per rollout (`episode()` -> an object with):

    start(task, rollout_id) -> Observation      the opening messages (and tool definitions); allocate what the
                                                rollout needs (a VM, a tool server) here
    step(assistant_message) -> Observation      messages to append (tool results, the next user turn), the reward
                                                of the conversation so far, done, success, info; with
                                                `restart`, a new conversation (a branch) instead
    close()                                     ALWAYS called once the rollout ends (done, cut, timed out, failed)

An environment may also score a group's episodes together (a reward relative to the group's: a ranking, a
pairwise judge): `score_group(episodes) -> [Observation]`, called once no episode of a group (the rollouts of one
task sampled together) still runs, with the episodes that ran to their end (a timed-out one scores 0 alone), in
order, before their `close()`; each answer's reward, success and info replace those of its episode's last
observation.

Each method may be a plain function or `async def`. The sampler runs them on a worker pool (plain ones on
threads, async ones on an event loop) while it keeps decoding the other rollouts; an episode may end at any step
(`done`, `max_turns`, a cut turn, a full context, its time limit): the last observation's `reward` and `success`
are the rollout's. Rewards are binary or partial credit in [0, 1]. A timed-out episode scores 0.

Messages are chat dicts; `content` is a string or a list of parts: {"type": "text", "text"} and image parts
({"type": "image", "image": PIL image | path | data URL}, or "path" / "url" keys, or OpenAI's "image_url"), the
format SFT chat data uses.

The earlier synchronous form still works for user environments: `tasks(split)`, `respond(task, history)` -> the
messages to append or None when the episode is over, and `score(task, history)` -> Score(reward, success)
(`HistoryEpisode` runs it as an episode).
"""

from __future__ import annotations

import inspect
import re
from dataclasses import dataclass, field
from typing import Protocol


# The built-in environments by name (`rollout.env`, `nemo-jax eval --env`): where each class lives, imported only
# when one is made (`nemo_jax.rl.envs.make_env`); the CLI's help lists them from here.
BUILTIN_ENVS = {"arithmetic": "nemo_jax.rl.envs.arithmetic:Arithmetic",
                "constraints": "nemo_jax.rl.envs.constraints:Constraints", "inbox": "nemo_jax.rl.envs.inbox:Inbox",
                "mcp": "nemo_jax.rl.envs.mcp:MCPEnv", "gui": "nemo_jax.rl.envs.gui:GUIEnv",
                "swe": "nemo_jax.rl.envs.swe:SWEEnv", "chart": "nemo_jax.rl.envs.chart:ChartEnv",
                "nemo_gym": "nemo_jax.rl.envs.nemo_gym:NeMoGymEnv"}


def env_forms(sep: str = " | ") -> str:
    """Every form an environment name may take (the built-in names, jsonl:PATH, package.module:Class)."""
    return sep.join([*BUILTIN_ENVS, "jsonl:PATH", "verifiers:ID", "package.module:Class"])


class EnvironmentFailed(RuntimeError):
    """An environment's method raised: the message names the environment, the episode, the method and the
    environment author's own file and line (`where`); `author_traceback` holds only the author's frames (what
    the CLI prints, instead of the sampler's internals)."""

    def __init__(self, message: str, where: str | None = None, author_traceback: str = ""):
        super().__init__(message)
        self.where, self.author_traceback = where, author_traceback


def author_frames(e: BaseException) -> list:
    """The frames of `e`'s traceback outside nemo_jax and the standard library (the environment author's code),
    innermost last."""
    import os
    import sysconfig
    import traceback

    pkg = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))) + os.sep  # nemo_jax/
    stdlib = tuple(os.path.realpath(sysconfig.get_paths()[k]) + os.sep for k in ("stdlib", "platstdlib"))
    return [f for f in traceback.extract_tb(e.__traceback__)
            if not os.path.realpath(f.filename).startswith((pkg, *stdlib)) and not f.filename.startswith("<frozen")]


def environment_failed(env_name: str, rollout_id: str, method: str, e: BaseException) -> EnvironmentFailed:
    """The EnvironmentFailed for `e` raised by an episode's `method`: its message opens with the author's file and
    line where there is one."""
    import traceback

    frames = author_frames(e)
    where = f"{frames[-1].filename}:{frames[-1].lineno}" if frames else None
    at = f" at {where} (in {frames[-1].name})" if frames else ""
    tb = "".join(traceback.format_list(frames)) if frames else ""
    return EnvironmentFailed(f"environment {env_name}: episode {rollout_id}: {method}() failed{at}: "
                             f"{type(e).__name__}: {e}", where, tb)


@dataclass(frozen=True)
class Task:
    id: str
    messages: tuple  # the opening conversation (dicts with role / content)
    data: dict = field(default_factory=dict, hash=False, compare=False)  # what the verifier needs
    family: str = "default"  # rewards are also logged per family (reward_mean/<family>)


@dataclass(frozen=True)
class Score:
    reward: float
    success: bool


@dataclass
class Observation:
    """What an episode answers: `start` -> the opening conversation; `step` -> what follows the assistant's turn."""
    messages: list = field(default_factory=list)  # messages to append (roles user / tool / system)
    reward: float = 0.0  # the conversation's reward so far: the rollout's if the episode ends here
    done: bool = False  # the episode is over (the assistant's last turn was its final answer)
    success: bool = False  # full success (logged; pass@k and consistency in evals)
    info: dict = field(default_factory=dict)  # anything to log with the rollout (JSON values)
    tools: list | None = None  # (from start) tool definitions for the chat template (OpenAI function format)
    # (from step) `messages` are a whole new conversation, not a continuation of this one (a BRANCH: a rewritten
    # history, a sub-agent's call): the rollout's token record starts a new branch (`Rollout.branches`; trained as
    # a segment of its own, with the episode's reward); `tools`, when given, are the branch's
    restart: bool = False


class Episode(Protocol):
    def start(self, task: Task, rollout_id: str) -> Observation: ...

    def step(self, message: dict) -> Observation: ...

    def close(self) -> None: ...


class Environment(Protocol):
    name: str
    max_turns: int  # assistant turns per episode at most

    def tasks(self, split: str) -> list[Task]: ...

    def episode(self) -> Episode: ...


class HistoryEpisode:
    """The synchronous form (`respond` / `score` over the whole history) as an episode: each step appends the
    assistant's message, asks `respond` what follows (None: done) and scores the conversation so far."""

    def __init__(self, env):
        self.env = env

    def start(self, task: Task, rollout_id: str) -> Observation:
        self.task, self.history = task, list(task.messages)
        return Observation(list(task.messages))

    def step(self, message: dict) -> Observation:
        self.history.append(message)
        follow = self.env.respond(self.task, self.history)
        s = self.env.score(self.task, self.history)
        self.history += list(follow or [])
        return Observation(list(follow or []), float(s.reward), not follow, bool(s.success))

    def close(self) -> None:
        self.history = []


class HistoryEnv:
    """Base of environments written in the synchronous form: `episode()` runs them through `HistoryEpisode`."""
    max_turns = 1

    def episode(self) -> HistoryEpisode:
        return HistoryEpisode(self)


class SyncForm:
    """A user environment of the synchronous form (tasks / respond / score) as a protocol environment."""

    def __init__(self, env):
        self.env = env
        self.name = getattr(env, "name", type(env).__name__)
        self.max_turns = int(getattr(env, "max_turns", 1))
        self.timeout_s = float(getattr(env, "timeout_s", 0) or 0)

    def tasks(self, split: str) -> list[Task]:
        return self.env.tasks(split)

    def episode(self) -> HistoryEpisode:
        return HistoryEpisode(self.env)

    def score(self, task: Task, history: list[dict]) -> Score:
        return self.env.score(task, history)

    def respond(self, task: Task, history: list[dict]):
        return self.env.respond(task, history)


def last_assistant(history: list[dict]) -> str:
    return next((m["content"] for m in reversed(history) if m["role"] == "assistant"), "")


class SingleTurn(HistoryEnv):
    """Base for single-turn environments: no follow-up turns."""
    max_turns = 1

    def respond(self, task: Task, history: list[dict]) -> list[dict] | None:
        return None


_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def last_number(text: str) -> float | None:
    """The last number in a text (commas dropped), or None."""
    found = _NUMBER.findall(text.replace(",", ""))
    return float(found[-1]) if found else None


def _demo_calls(task: Task, turns: list[str], rollout_id: str, message):
    """An expert's episode as the calls it makes: yields (method, *args), is sent each call's result; returns (the
    last observation, the conversation, the tool definitions). `demonstrate` and `ademonstrate` drive it."""
    obs = yield ("start", task, rollout_id)
    tools, msgs = obs.tools, [message(m) for m in obs.messages]
    for turn in turns:
        msgs.append({"role": "assistant", "content": turn})
        obs = yield ("step", msgs[-1])
        msgs += [message(m) for m in obs.messages]
    return obs, msgs, tools


def demonstrate(env, task: Task, turns: list[str], rollout_id: str,
                message=dict) -> tuple[Observation, list[dict], list[dict] | None]:
    """Run the assistant `turns` through a real episode of a synchronous environment (closed afterwards) -> (the
    last observation, the conversation: the task's messages, each turn and the environment's answers, every
    message passed through `message`; the tool definitions the episode offered). What an expert's demonstrations
    are made of."""
    ep, calls = env.episode(), _demo_calls(task, turns, rollout_id, message)
    try:
        call = next(calls)
        while True:
            call = calls.send(getattr(ep, call[0])(*call[1:]))
    except StopIteration as done:
        return done.value
    finally:
        ep.close()


async def ademonstrate(env, task: Task, turns: list[str], rollout_id: str,
                       message=dict) -> tuple[Observation, list[dict], list[dict] | None]:
    """`demonstrate` for an environment whose episode methods are `async def` (the MCP environment's)."""
    ep, calls = env.episode(), _demo_calls(task, turns, rollout_id, message)
    try:
        call = next(calls)
        while True:
            call = calls.send(await _awaited(getattr(ep, call[0])(*call[1:])))
    except StopIteration as done:
        return done.value
    finally:
        await _awaited(ep.close())


async def _awaited(x):
    return await x if inspect.isawaitable(x) else x


def demonstrations(env, split: str, n: int | None = None, *, turns_of=None, message=dict,
                   concurrency: int = 8) -> list[dict]:
    """The expert's conversations on the first `n` tasks of `split`, each run through a real episode of `env` ->
    SFT records {"messages", "tools" (when the episode offered tools)}. `turns_of(task)` -> the assistant turns
    (default: `env.expert`); `message` maps every message (`portable`: pictures as PNG data URLs). An episode whose
    methods are `async def` runs `concurrency` at a time. Every demonstration must end the episode with success:
    RuntimeError naming the task otherwise."""
    import asyncio

    turns_of = turns_of or env.expert
    todo = list(env.tasks(split)[:n])
    name = getattr(env, "name", type(env).__name__)

    def record(task, out) -> dict:
        obs, msgs, tools = out
        if not (obs.done and obs.success):
            raise RuntimeError(f"{name} env: the expert failed task {task.id} (reward {obs.reward}, {obs.info})")
        return {"messages": msgs, **({} if tools is None else {"tools": tools})}

    if not inspect.iscoroutinefunction(env.episode().start):
        return [record(t, demonstrate(env, t, turns_of(t), f"demo-{t.id}", message)) for t in todo]

    async def run():
        gate = asyncio.Semaphore(max(1, concurrency))

        async def one(task):
            async with gate:
                return record(task, await ademonstrate(env, task, turns_of(task), f"demo-{task.id}", message))
        return await asyncio.gather(*(one(t) for t in todo))
    return list(asyncio.run(run()))


def png_data_url(img) -> str:
    """A PIL image as a PNG data URL."""
    import base64
    import io

    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def portable(message: dict) -> dict:
    """A message whose pictures are PIL images (image parts) -> one whose pictures are PNG data URLs (image_url
    parts): a record that stands alone, as SFT data."""
    c = message["content"]
    if isinstance(c, str):
        return dict(message)

    def url(img) -> str:  # (a picture given as a path or URL already stands alone)
        return img if isinstance(img, str) else png_data_url(img)
    return dict(message, content=[{"type": "image_url", "image_url": {"url": url(p["image"])}}
                                  if p["type"] == "image" else p for p in c])


def as_environment(env) -> Environment:
    """An environment object of either form -> one with `tasks` and `episode` (the synchronous form wrapped)."""
    if callable(getattr(env, "episode", None)):
        return env
    for attr in ("tasks", "respond", "score"):
        if not callable(getattr(env, attr, None)):
            raise ValueError(f"environment {type(env).__name__}: neither episode() nor {attr}() (give tasks() and "
                             "episode(), or tasks(), respond() and score())")
    return SyncForm(env)
