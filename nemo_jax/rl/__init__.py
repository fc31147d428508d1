"""GRPO-family RL for LoRA experts: losses and advantages (loss), the learner step (learner), the training client
(client), rollouts, pool, curriculum, spool transport, environments, the in-process producer and `nemo-jax grpo`."""

from nemo_jax.rl.client import TrainingClient  # noqa: F401  (the public entry point)
