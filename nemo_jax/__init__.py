"""nemo_jax: a JAX training stack for NVIDIA's hybrid Mamba2-attention MoE family (Nemotron-H, Nemotron 3)."""

__version__ = "0.1.0"
