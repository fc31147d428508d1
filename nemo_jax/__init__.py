"""nemo_jax: a JAX training stack for NVIDIA's hybrid Mamba2-attention MoE family (Nemotron-H, Nemotron 3)."""

__version__ = "0.1.0"

# On a CPU-only host with a GPU plugin installed (e.g. the `plan-gpu` extra), the plugin's CUDA driver lines are kept
# out of stderr when jax is imported after nemo_jax: for library users (`from nemo_jax.sources import load_any`)
# as for the `nemo-jax` command and its child processes (`nemo_jax.hostmem.quiet_plugin_noise`; it changes
# nothing where jax is already imported, will use an accelerator, or no GPU plugin is installed).
from nemo_jax.hostmem import quiet_plugin_noise as _quiet_plugin_noise

_quiet_plugin_noise()
