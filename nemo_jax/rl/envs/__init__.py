"""RL environments: the registry (`make_env`), one module (or package) per built-in environment, and the episode
protocol every environment speaks (`tasks(split)` and `episode()` with `start` / `step` / `close`, or the
synchronous `tasks` / `respond` / `score`) in `nemo_jax.rl.envs.episode`, re-exported here.

Built in (`make_env(name, **args)`), each in its module here:
  arithmetic    single turn, "What is A plus B?" (plus / minus / times), exact integer answer
  constraints   single turn, a request with several checkable constraints on the answer's form;
                reward = share satisfied, success = all
  inbox         multi-turn with tools: a simulated company (emails, chat, calendar); the right action depends
                on information the agent looks up first; reward = share of checks passed minus violations
  mcp           multi-turn with the tools of an MCP server (`mcp`; the shipped tiny shop: `mcp_tiny_server`)
  gui           screenshots of generated windows and forms; click / type / key actions (`gui`)
  swe           a repository, an issue, hidden tests; run / python / apply_patch in a sandbox (`swe`)
  chart         a chart drawn with known values; a number to read off it with python / crop / zoom (`chart`)
  nemo_gym      a NeMo-Gym resources server (its JSONL rows, tool routes and /verify) over HTTP (`nemo_gym`)
  verifiers:ID  an installed verifiers 0.4 environment package (its Taskset), run by verifiers (`verifiers_env`)
  jsonl:PATH    a user task set: one JSON object per line, {"id", "prompt" | "messages", "answer",
                "verifier": "exact" | "regex" | "numeric", "tolerance" (numeric), "split" (train | eval)}
  pkg.mod:Class a user environment (either form), built with the config's `env_args`
"""

from __future__ import annotations

import importlib

from nemo_jax.rl.envs.arithmetic import Arithmetic  # noqa: F401 (the built-in environments, by their old path)
from nemo_jax.rl.envs.constraints import Constraints  # noqa: F401
from nemo_jax.rl.envs.episode import (BUILTIN_ENVS, Environment, Episode, HistoryEnv, HistoryEpisode,  # noqa: F401
                                      Observation, Score, SingleTurn, SyncForm, Task, ademonstrate, as_environment,
                                      demonstrate, demonstrations, env_forms, last_assistant, last_number, portable)
from nemo_jax.rl.envs.inbox import Inbox  # noqa: F401
from nemo_jax.rl.envs.jsonl import JsonlTasks


def make_env(spec: str, **args) -> Environment:
    """A built-in environment's name (`BUILTIN_ENVS`) | 'jsonl:PATH' | 'package.module:Class' (built with **args)
    -> an environment with `tasks` and `episode` (a user class of the synchronous form is wrapped)."""
    if spec in BUILTIN_ENVS:
        mod, _, cls = BUILTIN_ENVS[spec].partition(":")
        return getattr(importlib.import_module(mod), cls)(**args)
    if spec.startswith("jsonl:"):
        return JsonlTasks(spec[len("jsonl:"):], **args)
    if spec.startswith("verifiers:"):  # (before the plug-in form: `verifiers:<id>` names a taskset package)
        from nemo_jax.rl.envs.verifiers_env import VerifiersEnv

        return VerifiersEnv(spec[len("verifiers:"):], **args)
    if ":" in spec:
        mod, _, cls = spec.partition(":")
        try:
            env = getattr(importlib.import_module(mod), cls)(**args)
        except (ImportError, AttributeError) as e:
            raise ValueError(f"rl.env {spec!r}: cannot import ({e})") from None
        if not callable(getattr(env, "tasks", None)):
            raise ValueError(f"rl.env {spec!r}: the environment has no tasks() method")
        try:
            return as_environment(env)
        except ValueError as e:
            raise ValueError(f"rl.env {spec!r}: {e}") from None
    raise ValueError(f"rl.env: {spec!r} (expected {env_forms(', ')})")
