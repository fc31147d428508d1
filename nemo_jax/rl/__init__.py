"""GRPO-family RL for LoRA experts: losses and advantages (loss), the learner step (learner), the training client
(client), rollouts, pool, curriculum, spool transport, environments, the in-process producer and `nemo-jax grpo`."""


def __getattr__(name):  # `from nemo_jax.rl import TrainingClient`, imported on first use (tool servers stay light)
    if name == "TrainingClient":
        from nemo_jax.rl.client import TrainingClient

        return TrainingClient
    raise AttributeError(f"module 'nemo_jax.rl' has no attribute {name!r}")
