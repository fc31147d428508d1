"""GRPO-family RL for LoRA experts, in three rooms:

  envs/        the environments: the episode protocol (`envs.episode`), the registry (`make_env`), one module or
               package per built-in environment (arithmetic, constraints, inbox, jsonl, mcp, gui, swe, chart)
  transport/   what moves between the learner and the samplers: policy versions out (`policy`), the request board
               with leases (`board`), rollout files in (`rollouts`), the in-process producer (`producer`) and the
               rollout worker for external engines (`worker`)
  the learner  here: losses and advantages (`loss`), the learner step (`learner`), the training client (`client`),
               rollouts and learner batches (`rollout`), the pool (`pool`), the curriculum (`curriculum`), image
               ablations (`ablation`) and `nemo-jax grpo` (`grpo`)
"""

from nemo_jax.moved import alias

# where the modules of the flat layout went (their old import paths and `python -m` names keep working)
alias(__name__, {"episode": "nemo_jax.rl.envs.episode", "code_tools": "nemo_jax.rl.envs.code_tools",
                 "mcp_env": "nemo_jax.rl.envs.mcp", "mcp_tiny_server": "nemo_jax.rl.envs.mcp_tiny_server",
                 "gui_env": "nemo_jax.rl.envs.gui", "chart_env": "nemo_jax.rl.envs.chart",
                 "swe_env": "nemo_jax.rl.envs.swe", "swe_runner": "nemo_jax.rl.envs.swe.runner",
                 "producer": "nemo_jax.rl.transport.producer", "worker": "nemo_jax.rl.transport.worker",
                 "spool": "nemo_jax.rl.transport"})


def __getattr__(name):  # `from nemo_jax.rl import TrainingClient`, imported on first use (tool servers stay light)
    if name == "TrainingClient":
        from nemo_jax.rl.client import TrainingClient

        return TrainingClient
    raise AttributeError(f"module 'nemo_jax.rl' has no attribute {name!r}")
