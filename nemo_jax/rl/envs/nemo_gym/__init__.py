"""`nemo_gym`: a NeMo-Gym resources server as an environment, over its plain HTTP API (nothing of NeMo-Gym is
imported here: it lives in a venv of its own, Python >= 3.12, and nemo_jax speaks HTTP to it).

    env: nemo_gym
    env_args:
      data: path/to/rows.jsonl          # NeMo-Gym rows: {"responses_create_params": {"input", "tools", ...}, ...}
      eval_data: path/to/eval.jsonl     # the held-out rows (else the last `n_eval` rows of `data`; else `data`)
      server: resources_servers.example_multi_step.app:ExampleMultiStepResourcesServer   # started here, or
      url: http://127.0.0.1:8000        # a server already running
      python: ~/.cache/nemo_jax/nemo-gym/bin/python   # the Gym venv's Python (default: $NEMO_JAX_NEMO_GYM_PYTHON,
                                        # else that path; `python tools/tiers/nemo_gym.py venv` builds it)
      max_turns: 8                      # assistant turns per episode
      max_calls: 8                      # tool calls answered per turn

A task is a row: its `responses_create_params.input` (a string, or Responses input messages: `developer` is the
system role) is the opening conversation, its function `tools` the tools the chat template lists. An episode does
what NeMo-Gym's simple agent does: `POST /seed_session` with the row (the session's cookies kept for the episode),
then each assistant turn's tool calls (parsed from the text, `nemo_jax.data.chat.tool_calls`) as `POST /<tool>`
with the JSON arguments, each answer a tool message (an error status: its body, and the episode goes on); a turn
without a call, or the last turn, ends the episode with `POST /verify` of the row and the episode as a Responses
object (the assistant's text as `message` items, its calls as `function_call` items, the answers as
`function_call_output`). The reward is /verify's `reward`; its other numeric fields are logged with the rollout;
success is a reward of at least `success_reward` (1.0).

`server`: the class is served by `launch_server.py` (beside this file) with the Gym venv's Python, one process per
environment object (a server's sessions are separate by cookie), stopped when the environment closes or at exit."""

from __future__ import annotations

import atexit
import http.cookiejar
import json
import os
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.request

from nemo_jax.data.chat import split_tool_calls, tool_calls
from nemo_jax.rl.envs.episode import Observation, Task
from nemo_jax.rl.envs.jsonl import json_objects

DEFAULT_PYTHON = os.path.join(os.path.expanduser("~"), ".cache", "nemo_jax", "nemo-gym", "bin", "python")
LAUNCHER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "launch_server.py")


class GymError(RuntimeError):
    """A resources server call that failed where the episode cannot go on (seed_session, verify)."""


class _Http:
    """POSTs of JSON to one server, with the cookies of one session."""

    def __init__(self, url: str, timeout_s: float, headers: dict):
        self.url, self.timeout_s, self.headers = url.rstrip("/"), timeout_s, dict(headers)
        self.opener = urllib.request.build_opener(urllib.request.HTTPCookieProcessor(http.cookiejar.CookieJar()))

    def post(self, path: str, body) -> tuple[int, str]:
        req = urllib.request.Request(f"{self.url}/{path}", data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json", **self.headers})
        try:
            with self.opener.open(req, timeout=self.timeout_s) as r:
                return r.status, r.read().decode("utf-8", "replace")
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode("utf-8", "replace")

    def json(self, path: str, body) -> dict:
        """POST where the episode depends on the answer: anything but a 200 with a JSON object is a GymError."""
        try:
            status, text = self.post(path, body)
        except (urllib.error.URLError, OSError) as e:
            raise GymError(f"nemo_gym env: POST {self.url}/{path}: {e}") from None
        if status != 200:
            raise GymError(f"nemo_gym env: POST {self.url}/{path}: HTTP {status}: {text[:300]}")
        try:
            out = json.loads(text) if text.strip() else {}
        except ValueError:
            raise GymError(f"nemo_gym env: POST {self.url}/{path}: not JSON: {text[:200]!r}") from None
        if not isinstance(out, dict):
            raise GymError(f"nemo_gym env: POST {self.url}/{path}: expected a JSON object, got {text[:200]!r}")
        return out


def _text(content, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)  # (input_text / output_text parts)
    raise ValueError(f"{where}: content must be a string or a list of text parts (pictures are not supported)")


def row_messages(row: dict, where: str) -> list[dict]:
    """A row's `responses_create_params.input` -> chat messages (developer -> system)."""
    params = row.get("responses_create_params")
    if not isinstance(params, dict):
        raise ValueError(f"{where}: no 'responses_create_params' object")
    items = params.get("input")
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise ValueError(f"{where}: 'responses_create_params.input' must be a string or a list of messages")
    out = []
    for i, m in enumerate(items):
        if not isinstance(m, dict) or m.get("type", "message") != "message" or \
                m.get("role") not in ("developer", "system", "user", "assistant"):
            raise ValueError(f"{where}: input[{i}] is not a developer / system / user / assistant message")
        role = "system" if m["role"] == "developer" else m["role"]
        out.append({"role": role, "content": _text(m.get("content"), f"{where}: input[{i}]")})
    return out


def row_tools(row: dict, where: str) -> list[dict]:
    """A row's Responses function tools -> the OpenAI chat tool definitions the chat template renders."""
    out = []
    for i, t in enumerate(row["responses_create_params"].get("tools") or []):
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(t.get("name"), str):
            raise ValueError(f"{where}: tools[{i}] is not a function tool with a name (only those are supported)")
        out.append({"type": "function", "function": {"name": t["name"], "description": t.get("description") or "",
                                                     "parameters": t.get("parameters") or {"type": "object"}}})
    return out


def load_rows(path: str, split: str) -> list[Task]:
    """A JSONL file of NeMo-Gym rows -> tasks (a bad line: one error naming the file and line)."""
    path = os.path.abspath(os.path.expanduser(path))
    stem = os.path.splitext(os.path.basename(path))[0]
    tasks = []
    try:
        for n, where, row in json_objects(path):
            msgs = row_messages(row, where)
            row_tools(row, where)
            tasks.append(Task(f"{stem}:{n}", tuple(msgs), {"row": row, "where": where}, family=stem))
    except OSError as e:
        raise ValueError(f"nemo_gym env: {split} rows {path}: {e.strerror}") from None
    if not tasks:
        raise ValueError(f"nemo_gym env: {split} rows {path}: no rows")
    return tasks


class NeMoGymEpisode:
    def __init__(self, env: "NeMoGymEnv"):
        self.env = env

    def start(self, task: Task, rollout_id: str) -> Observation:
        self.task, self.rollout_id, self.turns, self.output = task, rollout_id, 0, []
        self.tools = row_tools(task.data["row"], task.data["where"])
        self.names = {t["function"]["name"] for t in self.tools}
        self.http = _Http(self.env.server_url(), self.env.timeout_s, self.env.headers)
        self.http.json("seed_session", task.data["row"])
        return Observation(list(task.messages), tools=self.tools)

    def _call(self, c: dict) -> str:
        """One tool call -> its answer's text (an unknown tool, a malformed call or an error status: the error)."""
        if c["name"] not in self.names:
            return json.dumps({"error": f"unknown tool {c['name']!r} (tools: {', '.join(sorted(self.names))})"})
        try:
            status, text = self.http.post(c["name"], c["arguments"])
        except (urllib.error.URLError, OSError) as e:
            return json.dumps({"error": f"the tool call failed: {e}"})
        return text if status == 200 else json.dumps({"error": f"HTTP {status}", "detail": text[:2000]})

    def step(self, message: dict) -> Observation:
        self.turns += 1
        text = message.get("content") or ""
        content, _ = split_tool_calls(text, self.tools)
        calls = tool_calls(text, self.tools)[:self.env.max_calls]
        if content:
            self.output.append({"id": f"msg_{self.rollout_id}_{len(self.output)}", "type": "message",
                                "role": "assistant", "status": "completed",
                                "content": [{"type": "output_text", "text": content, "annotations": []}]})
        answers = []
        for c in calls:
            call_id = f"call_{self.rollout_id}_{len(self.output)}"
            self.output.append({"type": "function_call", "call_id": call_id, "name": c["name"],
                                "arguments": json.dumps(c["arguments"])})
            result = self._call(c)
            self.output.append({"type": "function_call_output", "call_id": call_id, "output": result})
            answers.append({"role": "tool", "content": result})
        if calls and self.turns < self.env.max_turns:
            return Observation(answers, 0.0, False, False, {"tool_calls": len(calls)})
        return self._verify(len(calls))

    def _verify(self, n_calls: int) -> Observation:
        row = self.task.data["row"]
        params = row["responses_create_params"]
        response = {"id": f"resp_{self.rollout_id}", "created_at": int(time.time()), "object": "response",
                    "model": str(params.get("model") or "nemo-jax"), "output": self.output, "status": "completed",
                    "parallel_tool_calls": params.get("parallel_tool_calls", True),
                    "tool_choice": params.get("tool_choice", "auto"), "tools": params.get("tools") or []}
        out = self.http.json("verify", {**row, "response": response})
        if not isinstance(out.get("reward"), (int, float)) or isinstance(out.get("reward"), bool):
            raise GymError(f"nemo_gym env: /verify of {self.task.data['where']} answered no numeric 'reward'")
        reward = float(out["reward"])
        info = {k: float(v) for k, v in out.items() if k != "reward" and isinstance(v, (bool, int, float))}
        info["tool_calls"] = n_calls
        return Observation([], reward, True, reward >= self.env.success_reward, info)

    def close(self) -> None:
        self.output = []


class NeMoGymEnv:
    """Tasks from NeMo-Gym JSONL rows, episodes against one resources server (module docstring)."""
    name = "nemo_gym"

    def __init__(self, data: str, server: str | None = None, url: str | None = None, python: str | None = None,
                 eval_data: str | None = None, n_eval: int = 0, max_turns: int = 8, max_calls: int = 8,
                 timeout_s: float = 60.0, start_timeout_s: float = 180.0, success_reward: float = 1.0,
                 headers: dict | None = None):
        if (server is None) == (url is None):
            raise ValueError("nemo_gym env: give exactly one of 'server' (module:Class, started here) and 'url'")
        if server is not None and (not isinstance(server, str) or ":" not in server):
            raise ValueError(f"nemo_gym env: server {server!r} must be 'module:Class' of a resources server")
        if max_turns < 1 or max_calls < 1 or timeout_s <= 0 or n_eval < 0:
            raise ValueError("nemo_gym env: max_turns, max_calls and timeout_s must be positive, n_eval >= 0")
        self.max_turns, self.max_calls, self.timeout_s = int(max_turns), int(max_calls), float(timeout_s)
        self.success_reward, self.headers = float(success_reward), dict(headers or {})
        train = load_rows(data, "train")
        if eval_data is not None:
            held = load_rows(eval_data, "eval")
        elif n_eval:
            if n_eval >= len(train):
                raise ValueError(f"nemo_gym env: n_eval {n_eval} leaves no train rows of {len(train)} in {data}")
            train, held = train[:-n_eval], train[-n_eval:]
        else:
            held = []
        self._split = {"train": train, "eval": held}
        self.server, self.python, self.start_timeout_s = server, python, float(start_timeout_s)
        self.url = url.rstrip("/") if url else None
        self._proc = None
        self._lock = threading.Lock()

    def tasks(self, split: str) -> list[Task]:
        return self._split.get(split) or self._split["train"]

    def episode(self) -> NeMoGymEpisode:
        return NeMoGymEpisode(self)

    def server_url(self) -> str:
        """The server's URL; the first call starts the server when the environment serves it."""
        with self._lock:
            if self.url is None:
                self.url = self._start()
            return self.url

    def _start(self) -> str:
        python = self.python or os.environ.get("NEMO_JAX_NEMO_GYM_PYTHON") or DEFAULT_PYTHON
        if not os.path.exists(python):
            raise GymError(f"nemo_gym env: no NeMo-Gym Python at {python} (build the venv: python "
                           "tools/tiers/nemo_gym.py venv; or set env_args.python / $NEMO_JAX_NEMO_GYM_PYTHON)")
        folder = tempfile.mkdtemp(prefix="nemo-gym-")
        port_file, log = os.path.join(folder, "port"), open(os.path.join(folder, "server.log"), "w+")
        self._proc = subprocess.Popen([python, LAUNCHER, self.server, port_file], stdout=log,
                                      stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        atexit.register(self.close)
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                log.seek(0)
                raise GymError(f"nemo_gym env: the server {self.server} exited ({self._proc.returncode}) at start:\n"
                               + log.read()[-2000:])
            if os.path.exists(port_file):
                with open(port_file) as f:
                    return f"http://127.0.0.1:{int(f.read())}"
            time.sleep(0.2)
        self.close()
        raise GymError(f"nemo_gym env: the server {self.server} did not start within {self.start_timeout_s:g} s "
                       f"(its log: {log.name})")

    def close(self) -> None:
        """Stop the server this environment started (a given `url` is left alone)."""
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            self.url = None
