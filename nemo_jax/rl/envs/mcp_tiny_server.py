"""A tiny MCP server (stdio) for tests and the tiny recipe's MCP expert: a shop's price list and a calculator,
with the task set, the scorer and the expert that go with it.

    python -m nemo_jax.rl.envs.mcp_tiny_server          # serves over stdin/stdout (what `mcp` environments start)

Tools: `lookup(item)` -> "ITEM: P dollars" (an unknown item is a tool error), `multiply(a, b)` -> "a * b = c",
`add(a, b)` -> "a + b = c". Each number a tool answers stands after a space, as it does in the question and in a
tool call's JSON arguments (the tiny tokenizer's " 12" is one token, "12" another), so a number is copied token
for token along the chain.

Tasks (`tasks`), three families of growing length, the steps of the expert's plan in brackets:

  price   "What does one lemon cost?"                [lookup]                   -> the price
  total   "How much do 6 lemons cost?"               [lookup, multiply]         -> count x price
  pair    "How much do a lemon and a pear cost?"     [lookup, lookup, add]      -> the sum of the two prices

Counts run 2..9 and a `total` task's total stays at most `max_total` (38: every number of every task is then one
token of the tiny tokenizer). The train and eval splits share no task (`seed` draws the split).

Scorer (`score`), graded by progress: each step of the plan done earns an equal share of 0.5 (a `lookup` of the
right item; a `multiply` / `add` call whose result is the right number), and a final answer (a turn without a
tool call) whose last number is the right one earns the other 0.5. Success = reward 1: every step and the
answer. A turn with no tool call and no right number (a no-op) earns 0; wrong calls earn nothing.

`expert(task)` gives the expert's assistant turns (the demonstrations of the tiny VL recipe's agentic SFT:
`MCPEnv.demonstrations`).
"""

from __future__ import annotations

import json

PRICES = {"apple": 3, "pear": 4, "lemon": 2, "melon": 9, "bread": 5, "cheese": 8, "milk": 2, "tea": 6, "rice": 7,
          "soap": 3, "candle": 4, "pencil": 1}
FAMILIES = ("price", "total", "pair")
FINAL_SHARE = 0.5  # of the reward, for the right final answer; the steps of the plan share the rest


def _item(name) -> str:
    return str(name).strip().lower().rstrip("s")


def _one(item: str) -> str:
    return ("an " if item[0] in "aeiou" else "a ") + item


def serve() -> None:
    from mcp.server.mcpserver import MCPServer
    from mcp.server.mcpserver.exceptions import ToolError

    server = MCPServer("nemo-jax-tiny-shop", log_level="WARNING")  # (arguments a model got wrong are not news)

    @server.tool(description="The price of one item of the shop, in dollars.")
    def lookup(item: str) -> str:
        key = _item(item)
        if key not in PRICES:
            raise ToolError(f"no item {item!r} (items: {', '.join(sorted(PRICES))})")
        return f"{key}: {PRICES[key]} dollars"

    @server.tool(description="a times b.")
    def multiply(a: int, b: int) -> str:
        return f"{int(a)} * {int(b)} = {int(a) * int(b)}"

    @server.tool(description="a plus b.")
    def add(a: int, b: int) -> str:
        return f"{int(a)} + {int(b)} = {int(a) + int(b)}"

    server.run("stdio")


def _task(family: str, args: tuple):
    """A task of `family` -> (id, question, the plan's steps [{"name", "arguments", "value"}], the answer)."""
    if family == "price":
        (item,) = args
        return (f"price-{item}", f"What does one {item} cost?",
                [{"name": "lookup", "arguments": {"item": item}, "value": PRICES[item]}], PRICES[item])
    if family == "total":
        item, n = args
        p = PRICES[item]
        return (f"total-{item}-{n}", f"How much do {n} {item}s cost?",
                [{"name": "lookup", "arguments": {"item": item}, "value": p},
                 {"name": "multiply", "arguments": {"a": n, "b": p}, "value": n * p}], n * p)
    a, b = args
    pa, pb = PRICES[a], PRICES[b]
    return (f"pair-{a}-{b}", f"How much do {_one(a)} and {_one(b)} cost?",
            [{"name": "lookup", "arguments": {"item": a}, "value": pa},
             {"name": "lookup", "arguments": {"item": b}, "value": pb},
             {"name": "add", "arguments": {"a": pa, "b": pb}, "value": pa + pb}], pa + pb)


def tasks(split: str, n_train: int = 0, n_eval: int = 48, seed: int = 0, families=FAMILIES,
          max_total: int = 38) -> list:
    """The tasks of `families` (price, total, pair), split at random (`seed`) into `n_train` train and `n_eval`
    eval tasks that share none (n_train 0: every task the eval split leaves)."""
    import numpy as np

    from nemo_jax.rl.envs import Task

    unknown = set(families) - set(FAMILIES)
    if unknown or not families:
        raise ValueError(f"mcp tiny tasks: families {sorted(unknown) or '[]'} (known: {', '.join(FAMILIES)})")
    items = sorted(PRICES)
    keys = []
    for family in FAMILIES:  # (a fixed order, whatever order `families` names them in)
        if family not in families:
            continue
        if family == "price":
            keys += [(family, (i,)) for i in items]
        elif family == "total":
            keys += [(family, (i, n)) for i in items for n in range(2, 10) if n * PRICES[i] <= max_total]
        else:
            keys += [(family, (a, b)) for k, a in enumerate(items) for b in items[k + 1:]]
    n_train = n_train or len(keys) - n_eval
    if n_train < 0 or n_eval < 0 or n_train + n_eval > len(keys):
        raise ValueError(f"mcp tiny tasks: {len(keys)} distinct tasks of {', '.join(families)}; asked for "
                         f"{n_train} train + {n_eval} eval")
    order = np.random.default_rng(seed).permutation(len(keys))
    pick = order[n_eval:n_eval + n_train] if split == "train" else order[:n_eval]
    out = []
    for i in pick:
        family, args = keys[i]
        tid, question, steps, answer = _task(family, args)
        out.append(Task(tid, ({"role": "user", "content": question},), {"steps": steps, "answer": answer}, family))
    return out


def _number(text) -> float | None:
    from nemo_jax.rl.envs import last_number

    return last_number(str(text))


def _done(step: dict, call: dict) -> bool:
    """Does a logged call do a step of the plan? lookup: the right item; a calculator step: that tool, its result
    the right number."""
    if call["name"] != step["name"] or call.get("error") is not None:
        return False
    args = call["arguments"] if isinstance(call["arguments"], dict) else {}
    if step["name"] == "lookup":
        return _item(args.get("item", "")) == step["arguments"]["item"]
    return _number(call.get("result")) == step["value"]


def score(task, messages: list[dict], calls: list[dict]):
    """Graded by progress: an equal share of 0.5 per step of the plan done (each step matched by its own call),
    0.5 for a final answer whose last number is the answer; success = all of it."""
    from nemo_jax.data.chat import tool_calls
    from nemo_jax.rl.envs import Score

    d = task.data
    free = list(calls)
    steps_done = 0
    for step in d["steps"]:
        hit = next((c for c in free if _done(step, c)), None)
        if hit is not None:
            free.remove(hit)
            steps_done += 1
    last = messages[-1] if messages else {}
    text = last.get("content") if isinstance(last.get("content"), str) else ""
    final = (last.get("role") == "assistant" and not tool_calls(text) and _number(text) == d["answer"])
    reward = (1 - FINAL_SHARE) * steps_done / len(d["steps"]) + FINAL_SHARE * final
    return Score(reward, steps_done == len(d["steps"]) and final)


def call_text(name: str, arguments: dict) -> str:
    """A tool call as the tiny VL chat template writes one."""
    return "<tool_call>" + json.dumps({"name": name, "arguments": arguments}) + "</tool_call>"


def expert(task) -> list[str]:
    """The expert's assistant turns: each step of the plan as a tool call, then the answer."""
    d = task.data
    question = task.messages[-1]["content"]
    subject = question.removeprefix("What does ").removeprefix("How much do ").removesuffix(" cost?")
    verb = "costs" if task.family == "price" else "cost"
    return [call_text(s["name"], s["arguments"]) for s in d["steps"]] + [
        f"{subject[0].upper()}{subject[1:]} {verb} {d['answer']} dollars."]


if __name__ == "__main__":
    serve()
