"""What a path holds: the one resolver every command reads models and adapters through.

    native model dir     config.json + params/ (nemo_jax.checkpoint)
    HF checkpoint dir    config.json + model.safetensors[.index.json] (nemo_jax.hf.io)
    run dir              RUN/checkpoints/N... of `nemo-jax sft` (full or LoRA) or `nemo-jax grpo`: its latest good
                         checkpoint (`nemo_jax.checkpoint.latest_good_step`: a damaged newest step is named and
                         passed over, the run dir is left as it is)
    RUN/checkpoints/N    that step (an error if it is damaged); RUN/checkpoints: the latest good one

A full SFT run holds the model's params. A LoRA SFT or GRPO run holds adapters over its `model.init`: read as a
model it is that base (resolved the same way) with the adapters merged in; read as adapters (`load_adapters`)
it is the adapters. A run's tokenizer is its config's (`data.tokenizer`, GRPO `tokenizer`).

Models load placed on a mesh (`load_any`, `load_for_generation`) or as streaming region sources (`open_lazy`:
export-hf and merge read them region by region, never the whole model).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from nemo_jax.checkpoint import (is_native, latest_good_step, lazy_model, load_model, step_damage, target_tree,
                                 _dicts, _lists)
from nemo_jax.config.model import NemotronHConfig


@dataclass(frozen=True)
class Run:
    """A run checkpoint step as a source."""
    run_dir: str  # the run dir (or where its checkpoints folder sits)
    step: int
    step_dir: str  # RUN/checkpoints/N
    meta: dict  # the step's meta item: config, model_config, lora, ...

    @property
    def config(self) -> dict:
        return self.meta.get("config") or {}

    @property
    def lora(self) -> dict | None:
        """The LoRA settings when the run trains adapters (LoRA SFT, GRPO), else None."""
        lora = self.config.get("lora") or self.meta.get("lora")
        return lora if lora and lora.get("targets") else None

    @property
    def base(self) -> str | None:
        """A LoRA run's base model (its `model.init`)."""
        init = (self.config.get("model") or {}).get("init")
        return None if init in (None, "random") else init

    @property
    def tokenizer(self) -> str | None:
        from nemo_jax.data.chat import resolve as resolve_asset

        c = self.config
        tok = (c.get("data") or {}).get("tokenizer") if "data" in c else c.get("tokenizer")
        return resolve_asset(tok) if tok else None

    def model_config(self) -> NemotronHConfig:
        if self.meta.get("model_config"):
            return NemotronHConfig.from_hf_dict(self.meta["model_config"])
        return model_config_of(self._base_path())

    def _base_path(self) -> str:
        base = self.base
        if not base or not os.path.exists(base):
            raise FileNotFoundError(f"{self.run_dir}: a LoRA run holds adapters only, and its base model.init="
                                    f"{base!r} is not a readable model (run from the directory it was trained from, "
                                    "or read its adapters over a base you name)")
        return base


def resolve(path: str) -> str | Run:
    """A path -> a Run (run dir, RUN/checkpoints or RUN/checkpoints/N) or the path itself (a native or HF model
    dir). A run with no readable checkpoint, or a path that holds none of these, is a FileNotFoundError."""
    path = os.path.abspath(os.fspath(path))
    if os.path.islink(path) and not os.path.exists(path):
        raise FileNotFoundError(f"{path}: a symbolic link that leads nowhere (a loop, or its target is gone)")
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path}: no such model, checkpoint or run dir")
    head, tail = os.path.split(path)
    if tail.isdigit() and os.path.basename(head) == "checkpoints":  # RUN/checkpoints/N: exactly that step
        damage = step_damage(path)
        if damage is not None:
            raise FileNotFoundError(f"{path} is damaged: {damage.file}: {damage.reason} (name the run dir to read "
                                    "its latest good step)")
        return _run(os.path.dirname(head), path, int(tail))
    ckpts = path if tail == "checkpoints" else os.path.join(path, "checkpoints")
    if os.path.isdir(ckpts) and not is_native(path):
        step = latest_good_step(ckpts)  # readers never heal: the run's own trainer does
        if step is None:
            raise FileNotFoundError(f"{ckpts}: no readable checkpoint (none saved yet, or every one damaged: see "
                                    "the warnings above)")
        return _run(os.path.dirname(ckpts), os.path.join(ckpts, str(step)), step)
    if not os.path.exists(os.path.join(path, "config.json")):
        raise FileNotFoundError(f"{path}: not a model (no config.json), nor a run dir (no checkpoints/)")
    return path


def _run(run_dir: str, step_dir: str, step: int) -> Run:
    fp = os.path.join(step_dir, "meta", "metadata")
    try:
        with open(fp) as f:
            meta = json.load(f)
    except (OSError, ValueError) as e:
        raise FileNotFoundError(f"{fp}: the checkpoint's record is unreadable ({type(e).__name__})") from None
    return Run(run_dir, step, step_dir, meta)


def model_config_of(path: str) -> NemotronHConfig:
    """The model config of anything `resolve` reads (nothing else is read)."""
    src = resolve(path)
    if isinstance(src, Run):
        return src.model_config()
    return NemotronHConfig.from_file(os.path.join(src, "config.json"))


def tokenizer_dir(path: str) -> str | None:
    """Where the tokenizer of a model or run is (a model dir itself; a run's configured tokenizer)."""
    src = resolve(path)
    if isinstance(src, Run):
        return src.tokenizer or (tokenizer_dir(src._base_path()) if src.lora is not None else None)
    return src


# --------------------------------------------------------------------------- models placed on devices
def load_any(path: str, dtype=None, mesh=None, rules=None):
    """Anything `resolve` reads -> (cfg, params), each leaf in its sharding on `mesh` (one device if None) and in
    `dtype` (None: as stored)."""
    cfg, params, _ = load_for_generation(path, mesh=mesh, rules=rules, dtype=dtype)
    return cfg, params


def load_for_generation(path: str, mesh=None, rules=None, dtype=None):
    """Anything `resolve` reads -> (cfg, params, tokenizer dir).

    From a run only the `params` of the train state are read (orbax partial restore): the optimiser state is
    never read nor materialised. A LoRA run's adapters are merged into its base."""
    src = resolve(path)
    if isinstance(src, Run):
        if src.lora is not None:
            from nemo_jax.lora import merge_adapters

            cfg, base, base_tok = load_for_generation(src._base_path(), mesh=mesh, rules=rules, dtype=dtype)
            return cfg, merge_adapters(base, run_adapters(src)), src.tokenizer or base_tok
        cfg = src.model_config()
        return cfg, restore_run_params(os.path.join(src.step_dir, "state"), target_tree(cfg, mesh, rules, dtype)), \
            src.tokenizer
    if is_native(src):
        cfg, params = load_model(src, mesh=mesh, rules=rules, dtype=dtype)
    else:
        from nemo_jax.hf.io import load_pretrained

        cfg, params = load_pretrained(src, dtype=dtype, mesh=mesh, rules=rules)
    return cfg, params, src


def restore_run_params(state_dir: str, target=None):
    """The `params` subtree of a run checkpoint's train state (an orbax PyTree item), restored into `target`
    (a ShapeDtypeStruct tree with shardings and dtypes; None: as stored, on one device) by orbax partial restore:
    the optimiser state, step and RNG are not read."""
    import jax
    import numpy as np
    import orbax.checkpoint as ocp

    from nemo_jax.tensorio import tree_metadata

    ckptr = ocp.PyTreeCheckpointer()
    if target is None:
        dev = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        target = jax.tree.map(lambda m: jax.ShapeDtypeStruct(tuple(m.shape), np.dtype(m.dtype), sharding=dev),
                              tree_metadata(state_dir)["params"])
    item = {"params": _dicts(target)}
    out = ckptr.restore(state_dir, args=ocp.args.PyTreeRestore(
        item=item, restore_args=ocp.checkpoint_utils.construct_restore_args(item), partial_restore=True))
    return _lists(out["params"])


# --------------------------------------------------------------------------- streaming
def open_lazy(path: str):
    """Anything `resolve` reads -> (cfg, region source over our leaves, tokenizer dir), reading region by region
    as asked (`nemo_jax.tensorio.NativeReader`, `nemo_jax.hf.io.HFSource`); a LoRA run is its base's source with
    the adapters added per region (`nemo_jax.lora.peft.MergedSource`)."""
    src = resolve(path)
    if isinstance(src, Run):
        if src.lora is not None:
            from nemo_jax.lora.peft import MergedSource

            cfg, base, base_tok = open_lazy(src._base_path())
            return cfg, MergedSource(base, cfg, [(run_adapters(src), 1.0)]), src.tokenizer or base_tok
        from nemo_jax.tensorio import NativeReader

        return src.model_config(), NativeReader(os.path.join(src.step_dir, "state"), prefix="params"), src.tokenizer
    if is_native(src):
        cfg, reader = lazy_model(src)
        return cfg, reader, src
    from nemo_jax.hf.io import HFSource

    hf = HFSource.open(src)
    return hf.cfg, hf, src


# --------------------------------------------------------------------------- adapters
def run_adapters(run: Run) -> dict:
    """A LoRA / GRPO run step's adapters (the trainable tree of its train state) as host numpy arrays; a step
    without a train state: the run's RUN/adapters."""
    import jax
    import numpy as np

    state = os.path.join(run.step_dir, "state")
    if not os.path.isdir(state):
        from nemo_jax.lora import load_adapter_checkpoint

        return load_adapter_checkpoint(run.run_dir)[2]
    return jax.tree.map(np.asarray, restore_run_params(state))


def load_adapter_set(path: str):
    """An adapter checkpoint, or a LoRA / GRPO run (its latest good checkpoint, else its RUN/adapters) ->
    (model cfg, LoraConfig, adapters as numpy)."""
    from nemo_jax.lora import LoraConfig, load_adapter_checkpoint

    run = _maybe_run(path)
    if run is None or run.lora is None or (not run.meta.get("model_config") and not run.base):
        return load_adapter_checkpoint(path)
    lc = {k: v for k, v in run.lora.items() if k in ("targets", "rank", "alpha", "rslora", "init_seed")}
    lc["targets"] = tuple(lc["targets"])
    return run.model_config(), LoraConfig(**lc), run_adapters(run)


def load_adapters(path: str, cfg) -> dict:
    """A PEFT dir, an adapter checkpoint, or a LoRA / GRPO run dir (its latest good checkpoint's adapters) ->
    adapters for a model of config `cfg` (a set for another model shape is an error naming where it differs)."""
    from nemo_jax.lora.peft import check_adapters_fit, load_adapters_any

    run = _maybe_run(path)
    if run is None or run.lora is None:
        return load_adapters_any(path, cfg)
    acfg, _, adapters = load_adapter_set(path)
    check_adapters_fit(acfg, cfg, path)
    return adapters


def _maybe_run(path: str) -> Run | None:
    path = os.path.abspath(os.fspath(path))
    if not (os.path.isdir(os.path.join(path, "checkpoints")) or os.path.basename(path) == "checkpoints"
            or (os.path.basename(path).isdigit() and os.path.basename(os.path.dirname(path)) == "checkpoints")):
        return None
    src = resolve(path)
    return src if isinstance(src, Run) else None
