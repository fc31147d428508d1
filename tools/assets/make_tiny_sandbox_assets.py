"""Write the SFT data of the tiny sandboxed-code experts (the starting models of configs/grpo/tiny-swe.yaml and
configs/grpo/tiny-vl-chart.yaml), the experts' demonstrations run through real episodes in bubblewrap sandboxes
(other tasks than the RL runs': seed 100; every demonstration scores 1):

  nemo_jax/assets/tiny_swe        `swe`: the issue and calc.py -> apply_patch with the fix -> "Fixed." (text)
  nemo_jax/assets/tiny_vl_chart   `chart`: a 64 x 64 bar chart -> python measuring the bar -> its value; a
                                  `--direct` share answers at a glance instead (the true value, no tool)

    python tools/assets/make_tiny_sandbox_assets.py [--only swe|chart]
"""

import argparse
import json
import os
import random

from nemo_jax.rl.envs.chart import ChartEnv
from nemo_jax.rl.envs.swe import SWEEnv

ASSETS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "nemo_jax", "assets")


def write(name: str, split: str, recs: list):
    os.makedirs(os.path.join(ASSETS, name), exist_ok=True)
    path = os.path.join(ASSETS, name, f"{split}.jsonl")
    with open(path + ".tmp", "w") as f:
        for r in recs:
            f.write(json.dumps(r) + "\n")
    os.replace(path + ".tmp", path)
    print(f"{path}: {len(recs)} conversations", flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", choices=("swe", "chart"), default=None)
    ap.add_argument("--n-train", type=int, default=1024)
    ap.add_argument("--n-eval", type=int, default=32)
    ap.add_argument("--direct", type=float, default=0.5, help="chart: share of glance answers")
    a = ap.parse_args()
    if a.only in (None, "swe"):
        env = SWEEnv(n_train=a.n_train, n_eval=a.n_eval, seed=100, max_turns=2, n_funcs=1)
        for split in ("train", "eval"):
            recs = env.demonstrations(split)
            random.Random(0).shuffle(recs)
            write("tiny_swe", split, recs)
    if a.only in (None, "chart"):
        env = ChartEnv(n_train=a.n_train, n_eval=a.n_eval, seed=100)
        for split in ("train", "eval"):
            write("tiny_vl_chart", split, env.demonstrations(split, direct=a.direct, seed=1))


if __name__ == "__main__":
    main()
