"""Adapter checkpoints: a small directory holding one adapter set in our layout.

    DIR/lora.json              {"model_config": <HF-style config>, "lora": {targets, rank, alpha, rslora, init_seed}}
    DIR/adapters.safetensors   one tensor per adapter leaf, named by its tree path ("layers/attention/mixer/q_proj/lora_a")

Written to a temporary directory and renamed into place. A LoRA SFT run dir keeps its latest adapters in
`RUN/adapters/` in this format, so both read with `load_adapter_checkpoint`.
"""

from __future__ import annotations

import dataclasses
import json
import os

import jax
import numpy as np

from nemo_jax.config.model import NemotronHConfig
from nemo_jax.fsutil import atomic_dir
from nemo_jax.lora.adapters import LoraConfig, adapter_specs
from nemo_jax.model.spec import PARAM_LAYOUT, ParamSpec, check_param_layout, path_str

META = "lora.json"
TENSORS = "adapters.safetensors"


def _host_numpy(x) -> np.ndarray:
    """A (possibly multi-process sharded) array as one host numpy array."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(x)


def save_adapter_checkpoint(path: str, cfg: NemotronHConfig, lora_cfg: LoraConfig, adapters, *,
                            overwrite: bool = False, extra: dict[str, bytes] | None = None) -> None:
    """Write the adapter set (every process must call this with sharded arrays; process 0 writes). An existing
    `path` is replaced only with `overwrite` and only when it is an earlier adapter checkpoint (a trainer's
    RUN/adapters is: it passes overwrite=True). `extra`: more files {name: bytes} written into the same folder
    (e.g. an optimiser state), in place together with the adapters or not at all."""
    from safetensors.numpy import save_file

    flat = {path_str(p): _host_numpy(x) for p, x in jax.tree_util.tree_flatten_with_path(adapters)[0]}
    if jax.process_index() != 0:
        return
    with atomic_dir(path, "adapter checkpoint", overwrite=overwrite, own_files=(META, TENSORS, *(extra or {}))) as tmp:
        for name, data in (extra or {}).items():
            with open(os.path.join(tmp, name), "wb") as f:
                f.write(data)
        save_file({k: np.asarray(v, order="C") for k, v in flat.items()}, os.path.join(tmp, TENSORS),  # 0-d kept
                  metadata={"format": "nemo_jax-lora"})
        with open(os.path.join(tmp, META), "w") as f:
            json.dump({"model_config": cfg.to_hf_dict(), "lora": dataclasses.asdict(lora_cfg),
                       "param_layout": PARAM_LAYOUT}, f, indent=1)


def is_adapter_checkpoint(path: str) -> bool:
    return os.path.exists(os.path.join(path, META)) and os.path.exists(os.path.join(path, TENSORS))


def load_adapter_checkpoint(path: str):
    """An adapter checkpoint dir or a LoRA SFT run dir -> (model cfg, LoraConfig, adapters as numpy).

    Every tensor is checked against the layout the config implies; a missing, extra or misshaped tensor is an
    error naming it."""
    from safetensors.numpy import load_file

    src = path
    if not is_adapter_checkpoint(src) and is_adapter_checkpoint(os.path.join(path, "adapters")):
        src = os.path.join(path, "adapters")
    if not is_adapter_checkpoint(src):
        raise FileNotFoundError(f"{path}: not an adapter checkpoint (needs {META} and {TENSORS}) nor a LoRA run "
                                f"dir with adapters/")
    with open(os.path.join(src, META)) as f:
        meta = json.load(f)
    cfg = NemotronHConfig.from_hf_dict(meta["model_config"])
    check_param_layout(meta.get("param_layout", 1), os.path.join(src, META), cfg)
    lc = dict(meta["lora"])
    lc["targets"] = tuple(lc["targets"])
    lora_cfg = LoraConfig(**lc)
    tensors = load_file(os.path.join(src, TENSORS))
    specs = adapter_specs(cfg, lora_cfg)
    flat = jax.tree_util.tree_flatten_with_path(specs, is_leaf=lambda x: isinstance(x, ParamSpec))[0]
    want = {path_str(p): s for p, s in flat}
    for k in sorted(set(tensors) - set(want)):
        raise ValueError(f"{src}/{TENSORS}: unexpected tensor {k!r} for targets {list(lora_cfg.targets)}")
    leaves = []
    for k, s in want.items():
        if k not in tensors:
            raise ValueError(f"{src}/{TENSORS}: missing tensor {k!r}")
        if s.shape == () and tensors[k].shape == (1,):  # a scalar scale written as [1] (np.ascontiguousarray)
            tensors[k] = tensors[k].reshape(())
        if tuple(tensors[k].shape) != tuple(s.shape):
            raise ValueError(f"{src}/{TENSORS}: tensor {k!r} has shape {tuple(tensors[k].shape)}, expected {s.shape}")
        leaves.append(tensors[k])
    return cfg, lora_cfg, jax.tree.unflatten(jax.tree.structure(specs, is_leaf=lambda x: isinstance(x, ParamSpec)),
                                             leaves)
