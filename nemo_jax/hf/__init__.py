"""Hugging Face `nemotron_h` checkpoints in and out."""

from nemo_jax.hf.io import CheckpointError, import_pretrained, load_pretrained, read_dtypes, save_pretrained

__all__ = ["CheckpointError", "import_pretrained", "load_pretrained", "read_dtypes", "save_pretrained"]
