"""A tiny MCP server (stdio) for tests and the tiny recipe's MCP expert: a shop's price list and a calculator,
with the task set and the scorer that go with it.

    python -m nemo_jax.rl.mcp_tiny_server          # serves over stdin/stdout (what `mcp` environments start)

Tools: `lookup(item)` -> the item's price (whole dollars; an unknown item is a tool error), `multiply(a, b)`,
`add(a, b)`. Tasks (`tasks`): "How much do N ITEMs cost?" - look the price up, multiply, answer with the total.
Scorer (`score`): 0.25 for looking the right item up, 0.25 for a multiply (or add) call giving the total, 0.5 for a
final answer whose last number is the total; success = the right total in the final answer.
"""

from __future__ import annotations

PRICES = {"apple": 3, "pear": 4, "lemon": 2, "melon": 9, "bread": 5, "cheese": 8, "milk": 2, "tea": 6, "rice": 7,
          "soap": 3, "candle": 4, "pencil": 1}


def serve() -> None:
    from mcp.server.mcpserver import MCPServer
    from mcp.server.mcpserver.exceptions import ToolError

    server = MCPServer("nemo-jax-tiny-shop")

    @server.tool(description="The price of one item of the shop, in dollars.")
    def lookup(item: str) -> int:
        key = item.strip().lower().rstrip("s")
        if key not in PRICES:
            raise ToolError(f"no item {item!r} (items: {', '.join(sorted(PRICES))})")
        return PRICES[key]

    @server.tool(description="a times b.")
    def multiply(a: int, b: int) -> int:
        return int(a) * int(b)

    @server.tool(description="a plus b.")
    def add(a: int, b: int) -> int:
        return int(a) + int(b)

    server.run("stdio")


def tasks(split: str, n_train: int = 64, n_eval: int = 32, seed: int = 0) -> list:
    """"How much do N ITEMs cost?" tasks; the train and eval splits share no (item, count) pair."""
    import numpy as np

    from nemo_jax.rl.envs import Task

    pairs = [(item, n) for item in sorted(PRICES) for n in range(2, 10)]
    order = np.random.default_rng(seed).permutation(len(pairs))
    if n_train + n_eval > len(pairs):
        raise ValueError(f"mcp tiny tasks: only {len(pairs)} distinct tasks for {n_train} + {n_eval}")
    pick = order[:n_train] if split == "train" else order[n_train:n_train + n_eval]
    out = []
    for i in pick:
        item, n = pairs[i]
        out.append(Task(f"{item}-{n}", ({"role": "user", "content": f"How much do {n} {item}s cost?"},),
                        {"item": item, "count": n, "total": n * PRICES[item]}, "shop"))
    return out


def score(task, messages: list[dict], calls: list[dict]):
    """Partial credit for the right lookup, the right product, and the right final answer."""
    from nemo_jax.rl.envs import Score, last_assistant, last_number

    d = task.data
    looked = any(c["name"] == "lookup" and str(c["arguments"].get("item", "")).lower().rstrip("s") == d["item"]
                 for c in calls)
    computed = any(c["name"] in ("multiply", "add") and not c.get("error") and str(c.get("result")) == str(d["total"])
                   for c in calls)
    final = messages[-1]["role"] == "assistant" and last_number(last_assistant(messages)) == d["total"]
    return Score(0.25 * looked + 0.25 * computed + 0.5 * final, final)


if __name__ == "__main__":
    serve()
