"""`mcp`: an environment whose tools come from an MCP server started per episode (stdio), through the official
`mcp` Python client.

    env: mcp
    env_args:
      server: [python, -m, nemo_jax.rl.mcp_tiny_server]      # the command that serves MCP over stdin/stdout
      tasks: nemo_jax.rl.mcp_tiny_server:tasks                # module:function(split, **task_args) -> [Task]
      task_args: {n_train: 128, n_eval: 32}
      scorer: nemo_jax.rl.mcp_tiny_server:score               # module:function(task, messages, calls) -> Score
      max_turns: 4

Each episode starts its own server process (`start`), lists its tools into the chat template's tool format
(OpenAI function definitions, rendered by the template's `tools`), then at each assistant turn parses the tool
calls in the text (`nemo_jax.data.chat.tool_calls`: `<tool_call>{"name", "arguments"}</tool_call>` or the
Nemotron 3 `<function=...>` form), calls them on the server and answers with one tool message per call (text
content; image results as image parts). A turn without a tool call is the final answer: the episode is done.
The scorer sees the task, the whole conversation and the tool log [{"name", "arguments", "result" | "error"}]
(reward in [0, 1], success); it is called after every turn. `close` stops the server process.
"""

from __future__ import annotations

import asyncio
import importlib
import sys

from nemo_jax.data.chat import tool_calls
from nemo_jax.rl.episode import Observation, Score, Task


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


class MCPEpisode:
    """One episode: its own MCP server process and client session, held by a task on the event loop (the client's
    context is entered and left in that one task); `step` hands it tool calls through a queue."""

    def __init__(self, env: "MCPEnv"):
        self.env = env
        self._runner = None

    async def start(self, task: Task, rollout_id: str) -> Observation:
        loop = asyncio.get_running_loop()
        self.task, self.calls, self.messages = task, [], list(task.messages)
        self._requests: asyncio.Queue = asyncio.Queue()
        self._ready = loop.create_future()
        self._runner = asyncio.create_task(self._serve(), name=f"mcp-{rollout_id}")
        tools = await self._ready
        self.names = {t["function"]["name"] for t in tools}
        return Observation(list(task.messages), tools=tools)

    async def _serve(self):
        from mcp import Client
        from mcp.client.stdio import StdioServerParameters

        cmd = self.env.server
        try:
            async with Client(StdioServerParameters(command=cmd[0], args=list(cmd[1:])), mode="legacy") as client:
                listed = await client.list_tools()
                if not self._ready.done():  # (a start cancelled while the server came up: no one waits for it)
                    self._ready.set_result([tool_definition(t) for t in listed.tools])
                while (item := await self._requests.get()) is not None:
                    name, args, fut = item
                    try:
                        res = await client.call_tool(name, args)
                    except Exception as e:  # a transport failure: the episode fails with it (named by step)
                        fut.set_exception(e)
                        continue
                    fut.set_result(res)
        except BaseException as e:
            if not self._ready.done():
                self._ready.set_exception(e)
            raise

    async def _call(self, name: str, args: dict):
        fut = asyncio.get_running_loop().create_future()
        await self._requests.put((name, args, fut))
        return await fut

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
        if self._runner is None:
            return
        if not self._runner.done():
            await self._requests.put(None)
            try:
                await asyncio.wait_for(asyncio.shield(self._runner), self.env.close_timeout_s)
            except asyncio.TimeoutError:
                self._runner.cancel()
        if not self._runner.cancelled() and self._runner.exception() is not None:
            raise self._runner.exception()


class MCPEnv:
    """Tasks from `tasks` (module:function), tools from the MCP server `server` (a command), reward from `scorer`."""
    name = "mcp"

    def __init__(self, server=None, tasks: str = "nemo_jax.rl.mcp_tiny_server:tasks", task_args: dict | None = None,
                 scorer: str = "nemo_jax.rl.mcp_tiny_server:score", max_turns: int = 4, max_calls: int = 4,
                 timeout_s: float = 0.0, close_timeout_s: float = 10.0):
        self.server = list(server) if server else [sys.executable, "-m", "nemo_jax.rl.mcp_tiny_server"]
        if not self.server or not all(isinstance(x, str) for x in self.server):
            raise ValueError(f"mcp env: server must be a command (a list of strings), got {server!r}")
        try:
            import mcp  # noqa: F401
        except ImportError:
            raise ValueError("mcp env: the `mcp` package is not installed (pip install 'nemo-jax[mcp]')") from None
        self._tasks = _function(tasks, "tasks")
        self.task_args = dict(task_args or {})
        self._score = _function(scorer, "scorer")
        self.max_turns, self.max_calls = int(max_turns), int(max_calls)
        self.timeout_s, self.close_timeout_s = float(timeout_s), float(close_timeout_s)
        self._split = {}

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
