"""`inbox`: multi-turn with tools, a simulated company (emails, chat, calendar); the right action depends on
information the agent looks up first; reward = share of checks passed minus violations."""

from __future__ import annotations

import json

import numpy as np

from nemo_jax.data.chat import tool_calls
from nemo_jax.rl.envs.episode import HistoryEnv, Score, Task


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
