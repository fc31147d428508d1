"""`verifiers:<id>`: an installed verifiers environment package as an environment, unchanged: a v1 `Taskset`
(verifiers 0.4) or a classic `load_environment()` environment (verifiers 0.3).

    env: verifiers:glossary            # <id>: the package's module name, as `vf.load_taskset` / `load_environment`
    env_args:
      harness: null                    # v1: the agent program verifiers runs (default: the null harness, a chat loop)
      harness_args: {}                 # v1: its config's fields (e.g. bash: {compaction: {summarize_at_tokens: N}})
      taskset: {}                      # v1: more fields of the taskset's config (its TasksetConfig)
      env_args: {}                     # classic: the arguments of the package's load_environment()
      n_eval: 0                        # the last n_eval tasks are held out (classic: its eval dataset when it has
                                       # one; else both splits are every task)
      max_turns: 8                     # model turns per episode
      success_reward: 1.0              # success: a reward of at least this

verifiers runs each episode as it would for its own eval or for prime-rl: v1, the taskset's task, its tool servers,
the harness program (in the `subprocess` runtime, on this machine: it needs `uv`, which the verifiers venv has) and
the task's `@vf.reward` methods; classic, the environment's own rollout loop (`env_response`, tools, stop
conditions) and its rubric (`score_rollout`). The model is nemo_jax's own sampler: the episode's model calls reach
a chat-completions endpoint this module serves on localhost (each episode's calls name it by the `model` they
send), each call becomes the nemo_jax episode's next observation, and the turn nemo_jax samples is the call's
answer (its tool calls parsed from the text into OpenAI `tool_calls`). nemo_jax keeps its own token record through
its chat template, so the learner trains on exactly the tokens and behaviour logprobs it sampled. When the
episode ends, the reward is verifiers' own and its metrics are logged with the rollout.

One training sample per trace branch: a model call whose conversation does not extend the one answered last (a
rewritten or compacted history, a sub-agent's call) starts a new branch of the rollout (`Observation.restart`):
its token record goes on with the branch's own prompt, and the learner trains each branch as a segment of the
rollout's row, with the episode's reward. Group rubrics (classic environments whose rubric has group reward
functions) score each group together when all its episodes have ended (`score_group`). Needs verifiers (0.4.0:
its pins clash with nemo_jax's `mcp` and `worker` extras; 0.3.1: its `mcp<2` does; each in a venv of its own,
`python tools/tiers/verifiers.py venv`)."""

from __future__ import annotations

import asyncio
import atexit
import json
import os
import socket
import sys
import threading
import time
import uuid

from nemo_jax.data.chat import split_tool_calls
from nemo_jax.rl.envs.episode import Observation, Task

API_KEY_VAR = "NEMO_JAX_VERIFIERS_KEY"  # the bridge takes any key; verifiers' client reads one from the environment


def _need_verifiers():
    """verifiers' v1 API and aiohttp (a dependency of verifiers: the bridge's server) -> (vf, aiohttp.web)."""
    try:
        import verifiers.v1 as vf
        from aiohttp import web
    except ImportError as e:
        raise ValueError(f"rl.env verifiers:<id> needs verifiers installed ({e}): python tools/tiers/verifiers.py "
                         "venv builds a venv with it") from None
    return vf, web


def _text(content) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    return "".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")


def chat_message(m: dict) -> dict:
    """An OpenAI chat message from the harness -> the message nemo_jax's chat template takes (text content; image
    parts kept as OpenAI image_url parts)."""
    role = m.get("role")
    if role == "developer":
        role = "system"
    content = m.get("content")
    if isinstance(content, list) and any(isinstance(p, dict) and p.get("type") == "image_url" for p in content):
        return {"role": role, "content": [p for p in content if isinstance(p, dict) and p.get("type") in
                                          ("text", "image_url")]}
    return {"role": role, "content": _text(content)}


def extends(msgs: list[dict], seen: list[dict]) -> bool:
    """Whether a model call's conversation `msgs` goes on from the one answered last (`seen`, its answer last):
    longer, the same roles, the same text in every message but the assistant's (which a harness may re-serialise)."""
    return len(msgs) > len(seen) and all(
        m["role"] == s["role"] and (m["role"] == "assistant" or m["content"] == s["content"])
        for m, s in zip(msgs, seen))


def completion(text: str, tools, model: str) -> tuple[dict, dict]:
    """An assistant turn nemo_jax sampled -> (the chat.completion answer, the assistant message as the harness will
    send it back)."""
    content, calls = split_tool_calls(text, tools)
    tool_calls = [{"id": f"call_{uuid.uuid4().hex[:16]}", "type": "function",
                   "function": {"name": c["name"], "arguments": json.dumps(c["arguments"])}} for c in calls]
    message = {"role": "assistant", "content": content}
    if tool_calls:
        message["tool_calls"] = tool_calls
    reason = "tool_calls" if tool_calls else "stop"  # (a turn cut at max_new_tokens ends the nemo_jax episode)
    return ({"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
             "model": model, "choices": [{"index": 0, "message": message, "finish_reason": reason}],
             "usage": {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}}, message)


def stream_chunks(reply: dict, usage: bool) -> list[dict]:
    """A chat.completion -> the chat.completion.chunk events of a streamed answer (the whole turn in one delta)."""
    ch = reply["choices"][0]
    delta = {"role": "assistant", "content": ch["message"]["content"]}
    if ch["message"].get("tool_calls"):
        delta["tool_calls"] = [dict(c, index=i) for i, c in enumerate(ch["message"]["tool_calls"])]
    head = {k: reply[k] for k in ("id", "created", "model")}
    out = [dict(head, object="chat.completion.chunk", choices=[{"index": 0, "delta": delta, "finish_reason": None}]),
           dict(head, object="chat.completion.chunk", choices=[{"index": 0, "delta": {},
                                                                "finish_reason": ch["finish_reason"]}])]
    if usage:
        out.append(dict(head, object="chat.completion.chunk", choices=[], usage=reply["usage"]))
    return out


class _Bridge:
    """The chat-completions endpoint on localhost the harnesses' model calls reach, on the environment's loop: a
    call is queued for the episode its `model` names and answered when that episode's turn is sampled."""

    def __init__(self):
        self.queues: dict[str, asyncio.Queue] = {}
        self.url = ""

    async def start(self) -> None:
        _, web = _need_verifiers()
        app = web.Application(client_max_size=64 << 20)
        app.router.add_post("/v1/chat/completions", self._chat)
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))  # (a free port, known before the site starts)
        await web.SockSite(self.runner, sock).start()
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}/v1"

    async def _chat(self, request):
        _, web = _need_verifiers()
        body = await request.json()
        q = self.queues.get(body.get("model"))
        if q is None:
            return web.json_response({"error": {"message": f"no episode named {body.get('model')!r}"}}, status=404)
        answer = asyncio.get_running_loop().create_future()
        await q.put(("call", (body, answer)))
        status, reply = await answer
        if status != 200 or not body.get("stream"):
            return web.json_response(reply, status=status)
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await out.prepare(request)
        for chunk in stream_chunks(reply, bool((body.get("stream_options") or {}).get("include_usage"))):
            await out.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        await out.write(b"data: [DONE]\n\n")
        await out.write_eof()
        return out


class VerifiersEpisode:
    def __init__(self, env: "VerifiersEnv"):
        self.env = env
        self.key = None

    def _on_loop(self, coro):
        return asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self.env.loop))

    async def start(self, task: Task, rollout_id: str) -> Observation:
        env = self.env
        self.key, self.seen, self.tools, self.answer, self.turns = f"nemo-jax-{uuid.uuid4().hex}", [], None, None, 0
        self.queue = await self._on_loop(_make_queue())
        env.bridge.queues[self.key] = self.queue
        self.run = asyncio.run_coroutine_threadsafe(self._episode(task.data["vf_task"]), env.loop)
        return await self._next()

    async def _episode(self, vf_task):
        try:
            out = await self.env.engine.run(vf_task, self.key, self.env.bridge.url)
            await self.queue.put(("done", out))
        except BaseException as e:
            await self.queue.put(("failed", e))
            raise

    async def _next(self) -> Observation:
        kind, payload = await self._on_loop(self.queue.get())
        if kind == "call":
            body, self.answer = payload
            msgs = [chat_message(m) for m in body.get("messages") or []]
            tools = body.get("tools") or []
            if not extends(msgs, self.seen):  # a branch: a conversation of its own
                self.seen, self.tools = msgs, tools
                return Observation(list(msgs), 0.0, False, False, tools=tools or None, restart=True)
            new, self.seen = msgs[len(self.seen):], msgs
            if self.tools is None:
                self.tools = tools
            return Observation(new, 0.0, False, False, tools=self.tools or None)
        if kind == "failed":
            raise RuntimeError(f"verifiers:{self.env.id}: the episode failed: {payload!r}")
        self.out = payload
        if self.env.engine.grouped:  # (scored with its group: VerifiersEnv.score_group)
            return Observation([], 0.0, True, False)
        return self.env.observation(payload)

    def _answer(self, status: int, reply: dict) -> None:
        answer, self.answer = self.answer, None
        if answer is not None and not answer.done():
            self.env.loop.call_soon_threadsafe(lambda: answer.done() or answer.set_result((status, reply)))

    async def step(self, message: dict) -> Observation:
        self.turns += 1
        reply, back = completion(message.get("content") or "", self.tools, self.key)
        self.seen.append(chat_message(back))
        self._answer(200, reply)
        return await self._next()

    async def close(self) -> None:
        """Cut short (the sampler ended it first): the harness's pending call fails, the verifiers episode is
        cancelled."""
        if self.key is None:
            return
        self._answer(503, {"error": {"message": "nemo-jax ended the episode"}})
        self.env.bridge.queues.pop(self.key, None)
        if not self.run.done():
            self.run.cancel()
        self.key = None


async def _make_queue() -> asyncio.Queue:
    return asyncio.Queue()


def _failed(env_id: str, errors: list[str]) -> RuntimeError:
    return RuntimeError(f"verifiers:{env_id}: the episode failed: " + "; ".join(errors)[:2000])


class _Taskset:
    """A v1 taskset (verifiers 0.4): each episode is verifiers' `run_episode` of a `SingleAgentEnv` (v1 has no
    group rewards: each episode is scored alone)."""
    grouped = False

    def __init__(self, id: str, harness: str, harness_args: dict, taskset: dict, max_turns: int):
        vf, _ = _need_verifiers()
        try:
            from verifiers.v1.utils.loaders import harness_config_type
        except ImportError as e:
            raise ValueError(f"verifiers {e}: a v1 taskset needs verifiers 0.4") from None
        self.id = id
        config = vf.SingleAgentEnvConfig(
            taskset=vf.TasksetConfig.model_validate({**taskset, "id": id}),
            agent=vf.AgentConfig(harness=harness_config_type(harness).model_validate({**harness_args, "id": harness}),
                                 runtime=vf.SubprocessConfig(), max_turns=max_turns))
        self.vf_env = vf.SingleAgentEnv(config)
        tasks = [Task(f"{id}:{i}", _prompt(t.data.prompt, t.data.system_prompt), {"vf_task": t}, family=id)
                 for i, t in enumerate(self.vf_env.taskset)]
        self.split = {"train": tasks, "eval": []}

    async def start(self) -> None:
        await self.vf_env.start()

    async def stop(self) -> None:
        await self.vf_env.stop()

    async def run(self, task, key: str, url: str):
        vf, _ = _need_verifiers()
        ctx = vf.ModelContext(model=key, client=vf.EvalClientConfig(base_url=url, api_key_var=API_KEY_VAR))
        return await self.vf_env.run_episode(task, ctx)

    def result(self, ep) -> tuple[float, dict]:
        errors = list(ep.errors) + [e for t in ep.traces for e in t.errors]
        if errors or not ep.traces:
            raise _failed(self.id, [f"{e.type}: {e.message}" for e in errors] or ["no trace"])
        trace = ep.traces[0]
        info = {f"vf/{k}": float(v) for k, v in trace.metrics.items() if isinstance(v, (int, float))}
        info.update({f"vf/reward/{k}": float(r.value) for k, r in trace.rewards.items() if r is not None})
        return float(trace.reward), info


class _Classic:
    """A classic environment (verifiers 0.3's `load_environment()`: SingleTurnEnv, ToolEnv, MultiTurnEnv ...): each
    episode is the environment's own `run_rollout` of a dataset row, scored by its rubric."""

    def __init__(self, id: str, env_args: dict, max_turns: int):
        try:
            from verifiers import load_environment
        except ImportError as e:
            raise ValueError(f"a classic environment needs verifiers 0.3 ({e})") from None
        self.id = id
        self.vf_env = load_environment(id, **env_args)
        # a rubric with group reward functions scores a group's episodes together, as verifiers' run_group does
        self.grouped = bool(getattr(self.vf_env.rubric, "has_group_rewards", False) and self.vf_env.score_rollouts)
        if isinstance(getattr(self.vf_env, "max_turns", None), int) and self.vf_env.max_turns > max_turns:
            self.vf_env.max_turns = max_turns
        self.split = {name: [Task(f"{id}:{name}:{row.get('example_id', i)}", _prompt(row["prompt"], None),
                                  {"vf_task": dict(row)}, family=id) for i, row in enumerate(rows)]
                      for name, rows in (("train", self._rows("get_dataset")),
                                         ("eval", self._rows("get_eval_dataset")))}

    def _rows(self, method: str) -> list:
        try:
            return list(getattr(self.vf_env, method)())
        except (ValueError, AttributeError, TypeError):
            return []  # (no such dataset: the environment declares only the other one)

    async def start(self) -> None:
        return None

    async def stop(self) -> None:
        return None

    async def run(self, row, key: str, url: str):
        """The episode's rollout: scored (its output record), or, `grouped`, its state left for `score_group`."""
        try:
            from verifiers.clients import resolve_client
            from verifiers.types import ClientConfig
        except ImportError as e:
            raise ValueError(f"verifiers {e}: a classic environment needs verifiers 0.3") from None
        client = ClientConfig(api_base_url=url, api_key_var=API_KEY_VAR)
        if self.grouped:
            return await self.vf_env.rollout(row, resolve_client(client), key, {})
        return await self.vf_env.run_rollout(row, client, key, {})

    async def score_group(self, states: list) -> list:
        """A group's rollout states -> their output records, scored together by the rubric (its group reward
        functions see the whole group), then cleaned up: what verifiers' `run_group` does after its rollouts."""
        try:
            from verifiers.utils.save_utils import state_to_output
        except ImportError as e:
            raise ValueError(f"verifiers {e}: a classic environment needs verifiers 0.3") from None
        await self.vf_env.rubric.score_group(states)
        for st in states:
            await self.vf_env.rubric.cleanup(st)
        return [state_to_output(st, []) for st in states]

    def result(self, out) -> tuple[float, dict]:
        if out.get("error"):
            raise _failed(self.id, [str(out["error"])])
        info = {f"vf/{k}": float(v) for k, v in (out.get("metrics") or {}).items() if isinstance(v, (int, float))}
        return float(out["reward"]), info


def _prompt(prompt, system_prompt) -> tuple:
    """A task's prompt (a string or chat messages) as the opening chat messages (what the episode's first model
    call holds, before any system prompt a harness adds)."""
    msgs = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else [
        chat_message(m if isinstance(m, dict) else m.model_dump()) for m in (prompt or [])]
    if system_prompt:
        msgs.insert(0, {"role": "system", "content": system_prompt})
    return tuple(msgs)


class VerifiersEnv:
    """An installed verifiers environment package, its episodes run by verifiers against nemo_jax's sampler (module
    docstring): a v1 taskset, or a classic environment when the package has `load_environment()`."""

    def __init__(self, id: str, harness: str = "null", taskset: dict | None = None, env_args: dict | None = None,
                 harness_args: dict | None = None, n_eval: int = 0, max_turns: int = 8, success_reward: float = 1.0,
                 runtime: str = "subprocess"):
        import importlib

        _need_verifiers()
        if max_turns < 1 or n_eval < 0:
            raise ValueError("verifiers env: max_turns >= 1 and n_eval >= 0")
        if runtime != "subprocess":
            raise ValueError(f"verifiers env: runtime {runtime!r}: only 'subprocess' runs here (the harness on this "
                             "machine)")
        self.id, self.name = id, f"verifiers:{id}"
        self.max_turns, self.success_reward = int(max_turns), float(success_reward)
        os.environ.setdefault(API_KEY_VAR, "nemo-jax")
        bindir = os.path.dirname(sys.executable)  # (uv, installed beside verifiers, runs the harness program)
        if bindir not in os.environ.get("PATH", "").split(os.pathsep):
            os.environ["PATH"] = bindir + os.pathsep + os.environ.get("PATH", "")
        try:
            module = importlib.import_module(id.replace("-", "_"))
            classic = callable(getattr(module, "load_environment", None))
            self.engine = _Classic(id, env_args or {}, self.max_turns) if classic else \
                _Taskset(id, harness, harness_args or {}, taskset or {}, self.max_turns)
        except (ImportError, ValueError, TypeError, AttributeError) as e:
            raise ValueError(f"rl.env verifiers:{id}: {e}") from None
        train, held = self.engine.split["train"], self.engine.split["eval"]
        if not train and not held:
            raise ValueError(f"rl.env verifiers:{id}: the environment has no tasks")
        if n_eval:
            if n_eval >= len(train):
                raise ValueError(f"verifiers env: n_eval {n_eval} leaves no train tasks of {len(train)}")
            train, held = train[:len(train) - n_eval], train[len(train) - n_eval:]
        self._split = {"train": train or held, "eval": held}
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, name=f"verifiers-{id}", daemon=True).start()
        self.bridge = _Bridge()
        asyncio.run_coroutine_threadsafe(self.bridge.start(), self.loop).result(60)
        asyncio.run_coroutine_threadsafe(self.engine.start(), self.loop).result(600)
        atexit.register(self.close)

        if self.engine.grouped:
            self.score_group = self._score_group  # (the driver scores a group together when the env has one)

    def observation(self, out) -> Observation:
        """An episode's scored result -> the observation that ends it (verifiers' reward and metrics)."""
        reward, info = self.engine.result(out)
        return Observation([], reward, True, reward >= self.success_reward, info)

    async def _score_group(self, episodes: list[VerifiersEpisode]) -> list[Observation]:
        """`score_group` of the episode protocol: a group's finished episodes scored together by the rubric."""
        outs = await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(
            self.engine.score_group([ep.out for ep in episodes]), self.loop))
        return [self.observation(o) for o in outs]

    def tasks(self, split: str) -> list[Task]:
        return self._split.get(split) or self._split["train"]

    def episode(self) -> VerifiersEpisode:
        return VerifiersEpisode(self)

    def close(self) -> None:
        loop, self.loop = getattr(self, "loop", None), None
        if loop is None or not loop.is_running():
            return
        try:
            asyncio.run_coroutine_threadsafe(self.engine.stop(), loop).result(60)
            asyncio.run_coroutine_threadsafe(self.bridge.runner.cleanup(), loop).result(30)
        except (RuntimeError, TimeoutError, OSError):
            pass  # (at exit: the loop's thread may be gone with the interpreter)
        loop.call_soon_threadsafe(loop.stop)
