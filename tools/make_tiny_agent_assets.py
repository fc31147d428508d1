"""Write nemo_jax/assets/tiny_vl_agent: the SFT data of the tiny VL recipe's agentic stage, the expert's
demonstrations on the two tiny agent environments:

  gui  screenshots of generated windows -> `click X,Y` / `type TEXT` / `key NAME` actions, each answered by the
       next screenshot (nemo_jax.rl.gui_env; other screens than the RL tasks: seeds 100 and 101; pictures as PNG
       data URLs inside the JSONL): 3,072 one-button `click` screens (the grounding the GUI expert's RL starts
       from) and 1,024 `form` episodes (click the box, type the word, press Enter)
  mcp  "How much do N ITEMs cost?" with the tiny MCP shop's tools (their definitions listed from the running
       server, as the `mcp` environment lists them): lookup, multiply, then the answer (the RL train split's tasks
       only: the held-out tasks stay unseen)

    python tools/make_tiny_agent_assets.py
"""

import asyncio
import json
import os
import random
import sys

from nemo_jax.rl.gui_env import GUIEnv
from nemo_jax.rl.mcp_env import tool_definition
from nemo_jax.rl.mcp_tiny_server import PRICES, tasks

OUT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "nemo_jax", "assets", "tiny_vl_agent")


async def listed_tools() -> list[dict]:
    from mcp import Client
    from mcp.client.stdio import StdioServerParameters

    params = StdioServerParameters(command=sys.executable, args=["-m", "nemo_jax.rl.mcp_tiny_server"])
    async with Client(params, mode="legacy") as client:
        return [tool_definition(t) for t in (await client.list_tools()).tools]


def call(name: str, **arguments) -> str:
    return "<tool_call>" + json.dumps({"name": name, "arguments": arguments}) + "</tool_call>"


def mcp_demo(task, tools) -> dict:
    d = task.data
    price = PRICES[d["item"]]
    return {"tools": tools, "messages": [
        *task.messages,
        {"role": "assistant", "content": call("lookup", item=d["item"])},
        {"role": "tool", "content": str(price)},
        {"role": "assistant", "content": call("multiply", a=d["count"], b=price)},
        {"role": "tool", "content": str(d["total"])},
        {"role": "assistant", "content": f"{d['count']} {d['item']}s cost {d['total']} dollars."}]}


def main():
    os.makedirs(OUT, exist_ok=True)
    tools = asyncio.run(listed_tools())
    click = GUIEnv(families=("click",), n_train=3072, n_eval=32, seed=100, n_buttons=1)
    form = GUIEnv(families=("form",), n_train=1024, n_eval=16, seed=101, n_buttons=2)
    for split in ("train", "eval"):
        recs = click.demonstrations(split) + form.demonstrations(split)
        shop = [mcp_demo(t, tools) for t in tasks("train")]
        recs += shop * 2 if split == "train" else shop[:8]
        if split == "train":
            random.Random(0).shuffle(recs)
        with open(os.path.join(OUT, f"{split}.jsonl"), "w") as f:
            for r in recs:
                f.write(json.dumps(r) + "\n")
        print(f"{split}: {len(recs)} conversations")


if __name__ == "__main__":
    main()
