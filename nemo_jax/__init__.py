"""nemo_jax: a JAX training stack for NVIDIA's hybrid Mamba2-attention MoE family (Nemotron-H, Nemotron 3)."""

__version__ = "0.1.0"

# The `nemo-jax` command on a CPU-only host with a GPU plugin installed asks its child processes (data loader
# workers, tokenising pools: they inherit the environment and import nemo_jax first) to keep the plugin's CUDA
# driver lines out of stderr too (`nemo_jax.hostmem.quiet_plugin_noise`).
import os as _os

if _os.environ.get("NEMO_JAX_QUIET_PLUGINS") == "1":
    from nemo_jax.hostmem import quiet_plugin_noise

    quiet_plugin_noise()
