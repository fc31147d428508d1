"""Write nemo_jax/assets/tiny_vl_agent: the SFT data of the tiny VL recipe's agentic stage, the expert's
demonstrations on the two tiny agent environments:

  gui  screenshots of generated windows -> `click X,Y` / `type TEXT` / `key NAME` actions, each answered by the
       next screenshot (nemo_jax.rl.envs.gui; other screens than the RL tasks: seeds 100 and 101; pictures as PNG
       data URLs inside the JSONL): 3,072 one-button `click` screens (the grounding the GUI expert's RL starts
       from) and 1,024 `form` episodes (click the box, type the word, press Enter)
  mcp  the tiny MCP shop (nemo_jax.rl.envs.mcp_tiny_server: price, total and pair questions) answered with its tools,
       run through real episodes of the `mcp` environment (the tool definitions and answers are the server's own):
       the RL train split's tasks only (configs/grpo/tiny-vl-mcp.yaml's task_args: the held-out tasks stay
       unseen), each MCP_REPEAT times

    python tools/assets/make_tiny_agent_assets.py
"""

import json
import os
import random

from nemo_jax.rl.envs.gui import GUIEnv
from nemo_jax.rl.envs.mcp import MCPEnv

OUT = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "nemo_jax", "assets", "tiny_vl_agent")
MCP_TASKS = {"n_eval": 64}  # configs/grpo/tiny-vl-mcp.yaml's task_args
MCP_REPEAT = 8


def main():
    os.makedirs(OUT, exist_ok=True)
    shop = MCPEnv(task_args=MCP_TASKS, episodes_per_server=1000).demonstrations("train", concurrency=2)
    click = GUIEnv(families=("click",), n_train=3072, n_eval=32, seed=100, n_buttons=1)
    form = GUIEnv(families=("form",), n_train=1024, n_eval=16, seed=101, n_buttons=2)
    for split in ("train", "eval"):
        recs = click.demonstrations(split) + form.demonstrations(split)
        recs += shop * MCP_REPEAT if split == "train" else shop[:16]
        if split == "train":
            random.Random(0).shuffle(recs)
        with open(os.path.join(OUT, f"{split}.jsonl"), "w") as f:
            for r in recs:
                f.write(json.dumps(r) + "\n")
        print(f"{split}: {len(recs)} conversations")


if __name__ == "__main__":
    main()
