"""`mcp`: an environment whose tools come from an MCP server started per episode (stdio), through the official
`mcp` Python client.

    env: mcp
    env_args:
      server: [python, -m, nemo_jax.rl.envs.mcp_tiny_server]      # the command that serves MCP over stdin/stdout
      tasks: nemo_jax.rl.envs.mcp_tiny_server:tasks                # module:function(split, **task_args) -> [Task]
      task_args: {n_train: 96, n_eval: 48}
      scorer: nemo_jax.rl.envs.mcp_tiny_server:score               # module:function(task, messages, calls) -> Score
      expert: nemo_jax.rl.envs.mcp_tiny_server:expert              # module:function(task) -> the assistant turns
      max_turns: 5
      episodes_per_server: 1                                  # N > 1: a process serves N episodes in turn

Each episode has a server process of its own while it runs (`start`: a fresh one, or with `episodes_per_server`
N > 1 one that served fewer than N earlier episodes, for servers that keep no state between episodes), lists its
tools into the chat template's tool format (OpenAI function definitions, rendered by the template's `tools`), then
at each assistant turn parses the tool calls in the text (`nemo_jax.data.chat.tool_calls`:
`<tool_call>{"name", "arguments"}</tool_call>` or the Nemotron 3 `<function=...>` form), calls them on the server
and answers with one tool message per call (text content; image results as image parts). A turn without a tool
call is the final answer: the episode is done. The scorer sees the task, the whole conversation and the tool log
[{"name", "arguments", "result" | "error"}] (reward in [0, 1], success); it is called after every turn. `close`
stops the server process (or hands it to the next episode). `demonstrations(split, n)` runs the expert's turns
through real episodes: SFT records with the server's own answers.
"""

from __future__ import annotations

import asyncio
import atexit
import importlib
import subprocess
import sys
import threading

from nemo_jax.data.chat import tool_calls
from nemo_jax.rl.envs.episode import Observation, Score, Task, demonstrations


def _function(spec: str, what: str):
    mod, _, name = spec.partition(":")
    try:
        fn = getattr(importlib.import_module(mod), name)
    except (ImportError, AttributeError, ValueError) as e:
        raise ValueError(f"mcp env: {what} {spec!r}: cannot import ({e})") from None
    if not callable(fn):
        raise ValueError(f"mcp env: {what} {spec!r} is not callable")
    return fn


def tool_definition(tool) -> dict:
    """An MCP tool (from tools/list) -> the OpenAI function definition chat templates render."""
    return {"type": "function", "function": {"name": tool.name, "description": tool.description or "",
                                             "parameters": dict(tool.input_schema or {"type": "object"})}}


def result_content(res) -> tuple[list | str, bool]:
    """A CallToolResult -> (message content: the text, or text and image parts; is_error)."""
    parts = []
    for block in res.content or []:
        kind = getattr(block, "type", None)
        if kind == "text":
            parts.append({"type": "text", "text": block.text})
        elif kind == "image":
            parts.append({"type": "image", "url": f"data:{block.mime_type};base64,{block.data}"})
        else:
            parts.append({"type": "text", "text": f"[{kind} content]"})
    if all(p["type"] == "text" for p in parts):
        return "".join(p["text"] for p in parts), bool(res.is_error)
    return parts, bool(res.is_error)


def server_stderr():
    """Where a server process's stderr goes: this process's `sys.stderr` when it is a file (it has a descriptor),
    else the interpreter's own stderr. (Not the `mcp` client's default: `sys.stderr` as it was when `mcp.client.stdio`
    was imported, bound once; a stream without a descriptor then, such as a capture buffer, failed every later
    server start with "fileno".)"""
    for stream in (sys.stderr, sys.__stderr__):
        try:
            stream.fileno()
            return stream
        except (AttributeError, OSError, ValueError):  # (io.UnsupportedOperation is an OSError and a ValueError)
            continue
    return subprocess.DEVNULL


class ServerSession:
    """One MCP server process and its client session, held by a task on the environment's event loop (the client's
    context is entered and left in that one task); calls reach it through a queue. Every method runs on that
    loop."""

    def __init__(self, command: list[str], name: str):
        self.command, self.served, self.idle_timer = command, 0, None
        self._requests: asyncio.Queue = asyncio.Queue()
        self._ready = asyncio.get_running_loop().create_future()
        self.runner = asyncio.create_task(self._serve(), name=name)

    async def _serve(self):
        from mcp import Client
        from mcp.client.stdio import StdioServerParameters, stdio_client

        cmd = self.command
        transport = stdio_client(StdioServerParameters(command=cmd[0], args=list(cmd[1:])), errlog=server_stderr())
        try:
            async with Client(transport, mode="legacy") as client:
                listed = await client.list_tools()
                if not self._ready.done():  # (a start cancelled while the server came up: no one waits for it)
                    self._ready.set_result([tool_definition(t) for t in listed.tools])
                while (item := await self._requests.get()) is not None:
                    name, args, fut = item
                    try:
                        res = await client.call_tool(name, args)
                    except Exception as e:  # a transport failure: the episode fails with it (named by step)
                        if not fut.done():
                            fut.set_exception(e)
                        continue
                    if not fut.done():  # (its episode may have been cancelled meanwhile)
                        fut.set_result(res)
        except BaseException as e:
            if not self._ready.done():
                self._ready.set_exception(e)
            raise

    async def tools(self) -> list[dict]:
        return await asyncio.shield(self._ready)

    def alive(self) -> bool:
        return not self.runner.done()

    async def call(self, name: str, args: dict):
        fut = asyncio.get_running_loop().create_future()
        await self._requests.put((name, args, fut))
        return await fut

    async def close(self, timeout_s: float) -> None:
        if not self.runner.done():
            await self._requests.put(None)
            try:
                await asyncio.wait_for(asyncio.shield(self.runner), timeout_s)
            except asyncio.TimeoutError:
                self.runner.cancel()
                await asyncio.gather(self.runner, return_exceptions=True)
        if not self.runner.cancelled() and self.runner.exception() is not None:
            raise self.runner.exception()


class MCPEpisode:
    """One episode: a server session of its own for the episode's lifetime (a fresh one, or with
    `episodes_per_server` > 1 one that served earlier episodes); `step` runs the turn's tool calls on it."""

    def __init__(self, env: "MCPEnv"):
        self.env = env
        self.session: ServerSession | None = None
        self._in_call = False

    async def start(self, task: Task, rollout_id: str) -> Observation:
        self.task, self.calls, self.messages = task, [], list(task.messages)
        self.session, tools = await self.env.on_loop(self.env.acquire(rollout_id))
        self.names = {t["function"]["name"] for t in tools}
        return Observation(list(task.messages), tools=tools)

    async def _call(self, name: str, args: dict):
        self._in_call = True
        res = await self.env.on_loop(self.session.call(name, args))
        self._in_call = False
        return res

    async def step(self, message: dict) -> Observation:
        self.messages.append(message)
        calls = tool_calls(message.get("content") or "")
        out = []
        for c in calls[:self.env.max_calls]:
            rec = {"name": c["name"], "arguments": c["arguments"]}
            if c["name"] not in self.names:
                rec["error"] = f"unknown tool {c['name']!r} (tools: {', '.join(sorted(self.names))})"
                content = rec["error"]
            else:
                content, is_error = result_content(await self._call(c["name"], c["arguments"]))
                rec["error" if is_error else "result"] = content if isinstance(content, str) else "[content]"
            self.calls.append(rec)
            out.append({"role": "tool", "content": content})
        s = self.env.score(self.task, self.messages, self.calls)
        self.messages += out
        return Observation(out, s.reward, not calls, s.success, {"tool_calls": len(calls)})

    async def close(self) -> None:
        session, self.session = self.session, None
        if session is not None:  # (a call cut short by a time limit: the session is not handed on)
            await self.env.on_loop(self.env.release(session, reuse=not self._in_call))


class MCPEnv:
    """Tasks from `tasks` (module:function), tools from the MCP server `server` (a command), reward from `scorer`,
    demonstrations from `expert` (module:function(task) -> the assistant turns; default: the `expert` function
    beside `tasks`).

    Server sessions live on an event loop of the environment's own (a daemon thread), so that they outlast the
    sampler that started them: with `episodes_per_server` = N > 1 a server process serves up to N episodes one
    after another (for servers that keep no state between episodes: a process start costs ~1 CPU-second with
    the `mcp` package's imports), and an idle one is stopped after `idle_close_s` seconds or at exit. At most
    `max_servers` processes are alive at once (an eval starts every attempt's episode at once): an episode
    beyond them waits in `start` for one (its time limit runs)."""
    name = "mcp"
    idle_close_s = 30.0

    def __init__(self, server=None, tasks: str = "nemo_jax.rl.envs.mcp_tiny_server:tasks", task_args: dict | None = None,
                 scorer: str = "nemo_jax.rl.envs.mcp_tiny_server:score", max_turns: int = 4, max_calls: int = 4,
                 timeout_s: float = 0.0, close_timeout_s: float = 10.0, episodes_per_server: int = 1,
                 max_servers: int = 32, expert: str | None = None):
        self.server = list(server) if server else [sys.executable, "-m", "nemo_jax.rl.envs.mcp_tiny_server"]
        if not self.server or not all(isinstance(x, str) for x in self.server):
            raise ValueError(f"mcp env: server must be a command (a list of strings), got {server!r}")
        for key, v in (("episodes_per_server", episodes_per_server), ("max_servers", max_servers)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"mcp env: {key} must be an integer >= 1, got {v!r}")
        try:
            import mcp  # noqa: F401
        except ImportError:
            raise ValueError("mcp env: the `mcp` package is not installed (pip install 'nemo-jax[mcp]')") from None
        self._tasks = _function(tasks, "tasks")
        self.task_args = dict(task_args or {})
        self._score = _function(scorer, "scorer")
        self._expert_spec = expert or f"{tasks.partition(':')[0]}:expert"
        self.max_turns, self.max_calls = int(max_turns), int(max_calls)
        self.timeout_s, self.close_timeout_s = float(timeout_s), float(close_timeout_s)
        self.episodes_per_server, self.max_servers = episodes_per_server, max_servers
        self._split = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._lock = threading.Lock()
        self._idle: list[ServerSession] = []  # (these and the rest: touched on the environment's loop only)
        self._live = 0  # server processes started and not yet stopped
        self._room: asyncio.Condition | None = None  # (made on the loop) an episode waits here for a server
        self.servers_started = 0

    def tasks(self, split: str) -> list[Task]:
        if split not in self._split:
            self._split[split] = list(self._tasks(split, **self.task_args))
        return self._split[split]

    def episode(self) -> MCPEpisode:
        return MCPEpisode(self)

    def score(self, task: Task, messages: list[dict], calls: list[dict]) -> Score:
        s = self._score(task, messages, calls)
        if isinstance(s, Score):
            return s
        if isinstance(s, tuple):
            return Score(float(s[0]), bool(s[1]))
        return Score(float(s), float(s) >= 1.0)

    # ------------------------------------------------------------------ server sessions (on the env's loop)
    def loop(self) -> asyncio.AbstractEventLoop:
        with self._lock:
            if self._loop is None:
                self._loop = asyncio.new_event_loop()
                threading.Thread(target=self._loop.run_forever, name="mcp-servers", daemon=True).start()
                atexit.register(self.close)
            return self._loop

    async def on_loop(self, coro):
        """Await `coro` on the environment's loop from any other loop (cancelling this cancels it there)."""
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self.loop()))

    async def acquire(self, rollout_id: str) -> tuple[ServerSession, list[dict]]:
        """An idle live session (episodes_per_server > 1), else a new server process once fewer than `max_servers`
        are alive (else it waits for one) -> (session, its tool definitions)."""
        async with self._condition():
            while True:
                while self._idle:
                    s = self._idle.pop()
                    if s.idle_timer is not None:
                        s.idle_timer.cancel()
                    if s.alive():
                        s.served += 1
                        return s, await s.tools()
                    self._live -= 1  # (its process ended on its own)
                if self._live < self.max_servers:
                    self._live += 1
                    break
                await self._room.wait()  # (a server closed or handed back)
        s = ServerSession(self.server, f"mcp-{rollout_id}")
        self.servers_started += 1
        try:
            tools = await s.tools()
        except BaseException:  # a start cancelled (stop the server it waited for) or failed (its error is raised)
            asyncio.ensure_future(self._retire(s)).add_done_callback(_retrieve)
            raise
        s.served = 1
        return s, tools

    async def release(self, s: ServerSession, reuse: bool = True) -> None:
        if reuse and s.alive() and s.served < self.episodes_per_server:
            s.idle_timer = asyncio.get_running_loop().call_later(self.idle_close_s, self._expire, s)
            self._idle.append(s)
            await self._notify()
            return
        await self._retire(s)

    async def _retire(self, s: ServerSession) -> None:
        """Stop a session's server; its place goes to an episode waiting for one."""
        try:
            await s.close(self.close_timeout_s)
        finally:
            self._live -= 1
            await self._notify()

    def _condition(self) -> asyncio.Condition:
        if self._room is None:
            self._room = asyncio.Condition()
        return self._room

    async def _notify(self) -> None:
        async with self._condition():
            self._room.notify()

    def _expire(self, s: ServerSession) -> None:
        if s in self._idle:
            self._idle.remove(s)
            asyncio.ensure_future(self._retire(s)).add_done_callback(_retrieve)

    def close(self) -> None:
        """Stop the idle servers (a finished run's; also at exit)."""
        if self._loop is None or not self._loop.is_running():
            return

        async def stop_idle():
            idle, self._idle = self._idle, []
            for s in idle:
                if s.idle_timer is not None:
                    s.idle_timer.cancel()
            await asyncio.gather(*(self._retire(s) for s in idle), return_exceptions=True)

        try:
            asyncio.run_coroutine_threadsafe(stop_idle(), self._loop).result(self.close_timeout_s + 5)
        except TimeoutError:
            pass  # (at exit: the server processes end on their closed stdin)

    # ------------------------------------------------------------------ demonstrations (SFT data)
    def expert(self, task: Task) -> list[str]:
        return list(_function(self._expert_spec, "expert")(task))

    def demonstrations(self, split: str, n: int | None = None, concurrency: int = 8) -> list[dict]:
        """The expert's conversations on the first `n` tasks of `split`, each run through a real episode (the
        server's answers as tool messages; the expert must reach success) -> SFT records {"tools", "messages"}."""
        return demonstrations(self, split, n, concurrency=concurrency)


def _retrieve(fut) -> None:
    """(a background close's outcome is not awaited: read it so that asyncio does not log it as unretrieved)"""
    if not fut.cancelled():
        fut.exception()
