"""LoRA adapters: the adapter tree (`nemo_jax.lora.adapters`), adapter checkpoints (`nemo_jax.lora.checkpoint`)
and PEFT / vLLM adapter directories (`nemo_jax.lora.peft`), their public names gathered here.

The submodules import `nemo_jax.lora.adapters`, never this package, so the package and its parts form no import
circle (tests/test_layering.py).
"""

from nemo_jax.lora.adapters import (CONSTANT_LEAVES, PRESETS, LoraConfig, adaptable_paths, adapter_shardings,
                                    adapter_specs, attach, delta, init_adapters, merge_adapters, selected_paths,
                                    summary_table)
from nemo_jax.lora.checkpoint import load_adapter_checkpoint, save_adapter_checkpoint
from nemo_jax.lora.peft import load_peft, save_peft

__all__ = ["CONSTANT_LEAVES", "PRESETS", "LoraConfig", "adaptable_paths", "adapter_shardings", "adapter_specs",
           "attach", "delta", "init_adapters", "load_adapter_checkpoint", "load_peft", "merge_adapters",
           "save_adapter_checkpoint", "save_peft", "selected_paths", "summary_table"]
