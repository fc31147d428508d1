"""RL environments: the built-in task sets, user environments and the registry (`make_env`). The episode protocol
(`tasks(split)` and `episode()` with `start` / `step` / `close`, or the synchronous `tasks` / `respond` / `score`)
and its types are in `nemo_jax.rl.episode`, re-exported here.

Built in (`make_env(name, **args)`):
  arithmetic    single turn, "What is A plus B?" (plus / minus / times), exact integer answer
  constraints   single turn, a request with several checkable constraints on the answer's form;
                reward = share satisfied, success = all
  inbox         multi-turn with tools: a simulated company (emails, chat, calendar); the right action depends
                on information the agent looks up first; reward = share of checks passed minus violations
  mcp           multi-turn with the tools of an MCP server started per episode (nemo_jax.rl.mcp_env)
  gui           screenshots of generated windows and forms; click / type / key actions (nemo_jax.rl.gui_env)
  swe           a repository, an issue, hidden tests; run / python / apply_patch in a sandbox (nemo_jax.rl.swe_env)
  chart         a chart drawn with known values; a number to read off it with python / crop / zoom
                (nemo_jax.rl.chart_env)
  jsonl:PATH    a user task set: one JSON object per line, {"id", "prompt" | "messages", "answer",
                "verifier": "exact" | "regex" | "numeric", "tolerance" (numeric), "split" (train | eval)}
  pkg.mod:Class a user environment (either form), built with the config's `env_args`
"""

from __future__ import annotations

import importlib
import json
import math
import re

import numpy as np

from nemo_jax.data.chat import tool_calls
from nemo_jax.rl.episode import (BUILTIN_ENVS, Environment, Episode, HistoryEnv, HistoryEpisode,  # noqa: F401
                                 Observation, Score, SyncForm, Task, as_environment, env_forms,
                                 last_number)


def last_assistant(history: list[dict]) -> str:
    return next((m["content"] for m in reversed(history) if m["role"] == "assistant"), "")




class SingleTurn(HistoryEnv):
    """Base for single-turn environments: no follow-up turns."""
    max_turns = 1

    def respond(self, task: Task, history: list[dict]) -> list[dict] | None:
        return None


# ----------------------------------------------------------------------------- arithmetic
class Arithmetic(SingleTurn):
    """'What is A op B?' with A, B drawn from [lo, hi]; reward 1 when the answer's last number is A op B.
    `n_train` / `n_eval` tasks, disjoint, fixed by `seed`."""
    name = "arithmetic"
    OPS = {"plus": lambda a, b: a + b, "minus": lambda a, b: a - b, "times": lambda a, b: a * b}

    def __init__(self, ops=("plus", "minus"), lo: int = 0, hi: int = 30, n_train: int = 256, n_eval: int = 64,
                 seed: int = 0, template: str = "What is {a} {op} {b}?"):
        unknown = set(ops) - set(self.OPS)
        if unknown:
            raise ValueError(f"arithmetic: unknown ops {sorted(unknown)} (known: {sorted(self.OPS)})")
        rng = np.random.default_rng(seed)
        triples = {(op, int(a), int(b)) for op in ops for a in range(lo, hi + 1) for b in range(lo, hi + 1)
                   if op != "minus" or a >= b}  # non-negative differences
        triples = sorted(triples)
        if len(triples) < n_train + n_eval:
            raise ValueError(f"arithmetic: only {len(triples)} distinct problems for {n_train} + {n_eval} tasks")
        order = rng.permutation(len(triples))
        self._split = {"train": [triples[i] for i in order[:n_train]],
                       "eval": [triples[i] for i in order[n_train:n_train + n_eval]]}
        self.template = template

    def tasks(self, split: str) -> list[Task]:
        return [Task(f"{op}-{a}-{b}", ({"role": "user", "content": self.template.format(a=a, op=op, b=b)},),
                     {"answer": self.OPS[op](a, b)}, op) for op, a, b in self._split[split]]

    def score(self, task: Task, history: list[dict]) -> Score:
        x = last_number(last_assistant(history))
        ok = x is not None and x == task.data["answer"]
        return Score(float(ok), ok)


# ----------------------------------------------------------------------------- constraints
TOPICS = ("the sea", "a city", "winter", "a cat", "music", "the moon", "a garden", "trains", "coffee", "a river")
WORDS = ("blue", "quiet", "bright", "small", "green", "cold", "warm", "old")


def _check(kind: str, arg, text: str) -> bool:
    words = re.findall(r"[A-Za-z']+", text)
    if kind == "max_words":
        return 0 < len(words) <= arg
    if kind == "min_words":
        return len(words) >= arg
    if kind == "include":
        return arg.lower() in (w.lower() for w in words)
    if kind == "exclude":
        return arg.lower() not in (w.lower() for w in words)
    if kind == "lowercase":
        return text.strip() != "" and text == text.lower()
    if kind == "end_with":
        return text.rstrip().endswith(arg)
    if kind == "no_digits":
        return not any(ch.isdigit() for ch in text)
    raise ValueError(f"constraints: unknown check {kind!r}")


_PHRASES = {"max_words": "use at most {} words", "min_words": "use at least {} words", "include": "use the word '{}'",
            "exclude": "do not use the word '{}'", "lowercase": "write only lowercase letters",
            "end_with": "end with '{}'", "no_digits": "use no digits"}


class Constraints(SingleTurn):
    """'Write a sentence about TOPIC. Rules: ...' with `k` checkable rules (drawn from `rules`, default every kind:
    max_words, min_words, include, exclude, lowercase, end_with, no_digits); reward = share of rules met."""
    name = "constraints"

    def __init__(self, k: int = 3, n_train: int = 256, n_eval: int = 64, seed: int = 0, rules=None):
        rng = np.random.default_rng(seed)
        unknown = set(rules or ()) - set(_PHRASES)
        if unknown or (rules is not None and len(rules) < k):
            raise ValueError(f"constraints: rules {sorted(rules)} must name at least k={k} of {sorted(_PHRASES)}")
        self._split = {}
        for split, n in (("train", n_train), ("eval", n_eval)):
            out = []
            for i in range(n):
                pool = [("max_words", int(rng.integers(5, 15))), ("min_words", int(rng.integers(2, 5))),
                        ("include", str(rng.choice(WORDS))), ("exclude", "the"), ("lowercase", None),
                        ("end_with", str(rng.choice([".", "!"]))), ("no_digits", None)]
                pool = [x for x in pool if rules is None or x[0] in rules]  # (drawn all the same: fixed tasks)
                chosen = [pool[j] for j in sorted(rng.choice(len(pool), size=min(k, len(pool)), replace=False))]
                topic = str(rng.choice(TOPICS))
                said = "; ".join(_PHRASES[c].format(a) for c, a in chosen)
                out.append(Task(f"{split}-{i}", ({"role": "user", "content": f"Write a sentence about {topic}. "
                                                                            f"Rules: {said}."},),
                                {"checks": chosen}, "constraints"))
            self._split[split] = out

    def tasks(self, split: str) -> list[Task]:
        return self._split[split]

    def score(self, task: Task, history: list[dict]) -> Score:
        text = last_assistant(history)
        met = [_check(c, a, text) for c, a in task.data["checks"]]
        return Score(sum(met) / len(met), all(met))


# ----------------------------------------------------------------------------- inbox (multi-turn, tools)
PEOPLE = ("alice", "bruno", "chen", "dana", "emeka", "farah", "goran", "hana")
TOPICS_WORK = ("the budget review", "the launch plan", "hiring", "the vendor contract", "the offsite", "Q3 goals")
VENDORS = ("Acme Corp", "Globex", "Initech", "Umbrella Ltd")

_INBOX_SYSTEM = (
    "You are an assistant at a company, with tools to read and act on the user's mail, chat and calendar. "
    "Call a tool by writing <tool_call>{\"name\": TOOL, \"arguments\": {...}}</tool_call>; its result comes back "
    "as a tool message. Tools: search_email(query), read_email(id), read_chat(channel), list_calendar(date), "
    "send_email(to, subject, body), create_event(title, date, time, attendees), post_chat(channel, text). "
    "Look up what you need before acting; only email people inside the company (@corp.example). "
    "When the request is done, answer without a tool call.")


class Inbox(HistoryEnv):
    """A simulated company: emails, chat channels and a calendar, seven tools, and requests whose right action
    depends on information the agent must look up first (a colleague's proposed meeting time, a vendor's
    invoice amount, a fact to post in a channel). Multi-turn: each assistant turn's <tool_call>{json}</tool_call>
    blocks are executed and answered with tool messages until the assistant answers without one (or `max_turns`).
    reward = share of the task's required checks that pass, minus `penalty` per guardrail violation (mail to an
    address outside the company), floored at 0; success = every check and no violation."""
    name = "inbox"

    def __init__(self, n_train: int = 256, n_eval: int = 64, seed: int = 0, max_turns: int = 6,
                 penalty: float = 0.5):
        self.max_turns, self.penalty = max_turns, penalty
        rng = np.random.default_rng(seed)
        self._split = {s: [self._make(f"{s}-{i}", rng) for i in range(n)]
                       for s, n in (("train", n_train), ("eval", n_eval))}

    # a world per task: what the mailbox holds and what the request is
    def _make(self, tid: str, rng) -> Task:
        kind = ("meeting", "invoice", "relay")[int(rng.integers(3))]
        who, other = (str(x) for x in rng.choice(PEOPLE, 2, replace=False))
        day, hour = f"2026-12-{int(rng.integers(2, 28)):02d}", f"{int(rng.integers(9, 17)):02d}:00"
        topic, vendor = str(rng.choice(TOPICS_WORK)), str(rng.choice(VENDORS))
        amount = f"{int(rng.integers(100, 9999))}.{int(rng.integers(0, 99)):02d}"
        emails = [  # the one that matters, and distractors
            {"id": "e1", "from": f"{who}@corp.example", "subject": f"About {topic}",
             "body": f"Could we meet about {topic} on {day} at {hour}?"},
            {"id": "e2", "from": f"billing@{vendor.split()[0].lower()}.example", "subject": f"Invoice from {vendor}",
             "body": f"Please pay {amount} USD for services."},
            {"id": "e3", "from": f"{other}@corp.example", "subject": "Lunch",
             "body": f"Lunch on {day}? Maybe 12:00."},
        ]
        chat = {"general": [f"{other}: has anyone seen the {vendor} invoice?"], "team": [f"{who}: see my email"]}
        if kind == "meeting":
            ask = f"{who.title()} emailed me about {topic}. Put the meeting in my calendar at the time they proposed."
            checks = [("event_date", day), ("event_time", hour), ("event_attendee", f"{who}@corp.example")]
        elif kind == "invoice":
            ask = f"Email {other.title()} the amount of the {vendor} invoice."
            checks = [("email_to", f"{other}@corp.example"), ("email_contains", amount)]
        else:
            ask = f"Answer the question about the {vendor} invoice in the #general channel."
            checks = [("chat_in", "general"), ("chat_contains", amount)]
        world = {"emails": emails, "chat": chat, "calendar": {day: [{"title": "Standup", "time": "09:00"}]}}
        return Task(tid, ({"role": "system", "content": _INBOX_SYSTEM}, {"role": "user", "content": ask}),
                    {"world": world, "checks": checks}, f"inbox-{kind}")

    def tasks(self, split: str) -> list[Task]:
        return self._split[split]

    @staticmethod
    def calls(text: str) -> list[dict]:
        return tool_calls(text)

    def _run(self, task: Task, history: list[dict]):
        """Replay every tool call of the conversation on a fresh copy of the task's world -> (results of the last
        turn's calls, actions taken, violations)."""
        w = task.data["world"]
        actions, violations, last = [], 0, []
        for m in history:
            if m["role"] != "assistant":
                continue
            last = []
            for c in self.calls(m["content"]):
                name, a = c.get("name"), c.get("arguments") or {}
                a = a if isinstance(a, dict) else {}
                if name == "search_email":
                    q = str(a.get("query", "")).lower()
                    r = [{k: e[k] for k in ("id", "from", "subject")} for e in w["emails"]
                         if q in (e["subject"] + e["body"] + e["from"]).lower()]
                elif name == "read_email":
                    r = next((e for e in w["emails"] if e["id"] == a.get("id")), {"error": "no such email"})
                elif name == "read_chat":
                    r = w["chat"].get(str(a.get("channel", "")).lstrip("#"), {"error": "no such channel"})
                elif name == "list_calendar":
                    r = w["calendar"].get(str(a.get("date", "")), [])
                elif name in ("send_email", "create_event", "post_chat"):
                    actions.append((name, a))
                    if name == "send_email" and not str(a.get("to", "")).endswith("@corp.example"):
                        violations += 1
                    r = {"ok": True}
                else:
                    r = {"error": f"unknown tool {name!r}"}
                last.append({"role": "tool", "content": json.dumps({"name": name, "result": r})})
        return last, actions, violations

    def respond(self, task: Task, history: list[dict]) -> list[dict] | None:
        results, _, _ = self._run(task, history)
        return results or None

    def score(self, task: Task, history: list[dict]) -> Score:
        _, actions, violations = self._run(task, history)
        by = {}
        for name, a in actions:
            by.setdefault(name, []).append(a)
        ev, mail, chat = by.get("create_event", []), by.get("send_email", []), by.get("post_chat", [])
        passed = 0
        for check, want in task.data["checks"]:
            passed += {
                "event_date": any(str(e.get("date")) == want for e in ev),
                "event_time": any(str(e.get("time")) == want for e in ev),
                "event_attendee": any(want in (e.get("attendees") if isinstance(e.get("attendees"), list)
                                               else [e.get("attendees")]) for e in ev),
                "email_to": any(str(m.get("to")) == want for m in mail),
                "email_contains": any(want in str(m.get("body", "")) + str(m.get("subject", "")) for m in mail),
                "chat_in": any(str(c.get("channel", "")).lstrip("#") == want for c in chat),
                "chat_contains": any(want in str(c.get("text", "")) for c in chat),
            }[check]
        n = len(task.data["checks"])
        return Score(max(0.0, passed / n - self.penalty * violations), passed == n and violations == 0)


# ----------------------------------------------------------------------------- user task sets
class JsonlTasks(SingleTurn):
    """Tasks from a JSONL file with built-in verifiers (exact, regex, numeric with tolerance)."""
    VERIFIERS = ("exact", "regex", "numeric")

    def __init__(self, path: str):
        self.name = f"jsonl:{path}"
        self._split = {"train": [], "eval": []}
        with open(path, encoding="utf-8-sig") as f:  # (a UTF-8 BOM at the start is not data)
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                where = f"{path}:{n}"
                try:
                    d = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{where}: invalid JSON ({e.msg})") from None
                if "answer" not in d or not ("prompt" in d or "messages" in d):
                    raise ValueError(f"{where}: a task needs 'answer' and 'prompt' or 'messages'")
                v = d.get("verifier", "exact")
                if v not in self.VERIFIERS:
                    raise ValueError(f"{where}: verifier {v!r} (expected one of {', '.join(self.VERIFIERS)})")
                if v == "regex":
                    try:
                        re.compile(d["answer"])
                    except re.error as e:
                        raise ValueError(f"{where}: answer is not a valid regex ({e})") from None
                split = d.get("split", "train")
                if split not in self._split:
                    raise ValueError(f"{where}: split {split!r} (expected train or eval)")
                msgs = tuple(d["messages"]) if "messages" in d else ({"role": "user", "content": str(d["prompt"])},)
                self._split[split].append(Task(str(d.get("id", f"line{n}")), msgs,
                                               {"answer": d["answer"], "verifier": v,
                                                "tolerance": float(d.get("tolerance", 1e-6))},
                                               str(d.get("family", "default"))))
        if not self._split["train"] and not self._split["eval"]:
            raise ValueError(f"{path}: no tasks")

    def tasks(self, split: str) -> list[Task]:
        return self._split[split] or self._split["train"]  # no eval split: evaluate on the train tasks

    def score(self, task: Task, history: list[dict]) -> Score:
        text = last_assistant(history).strip()
        d = task.data
        if d["verifier"] == "exact":
            ok = text == str(d["answer"]).strip()
        elif d["verifier"] == "regex":
            ok = re.search(d["answer"], text) is not None
        else:
            x = last_number(text)
            ok = x is not None and math.isclose(x, float(d["answer"]), rel_tol=0, abs_tol=d["tolerance"])
        return Score(float(ok), ok)


def make_env(spec: str, **args) -> Environment:
    """A built-in environment's name (`BUILTIN_ENVS`) | 'jsonl:PATH' | 'package.module:Class' (built with **args)
    -> an environment with `tasks` and `episode` (a user class of the synchronous form is wrapped)."""
    if spec in BUILTIN_ENVS:
        mod, _, cls = BUILTIN_ENVS[spec].partition(":")
        return getattr(importlib.import_module(mod), cls)(**args)
    if spec.startswith("jsonl:"):
        return JsonlTasks(spec[len("jsonl:"):], **args)
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
