"""The Tinker API's checkpoints: `tinker://` paths are folders under `--tinker-root` that every nemo-jax command
reads, and that outlive the server (a training client resumes from them after a restart).

    ROOT/<run>/run.json                  the training run: id, base model, LoRA settings, user metadata, times
    ROOT/<run>/weights/<name>/           save_state: an adapter checkpoint (lora.json + adapters.safetensors),
                                         optimizer.safetensors (Adam's moments and step) and tinker.json
    ROOT/<run>/sampler_weights/<name>/   save_weights_for_sampler: an adapter checkpoint and tinker.json

`tinker://<run id>/weights/<name>` is ROOT/<run>/weights/<name>, the run id's colons written as underscores
(`s1a2b3c4:train:0` -> `s1a2b3c4_train_0`). Run ids and names are checked against a strict pattern (letters,
digits, `.`, `_`, `-`; no `/`, no `..`), so nothing outside the root is ever read, written or deleted. Every
folder is written whole or not at all (`fsutil.atomic_dir`); a delete removes only a checkpoint this server wrote.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time

import jax
import numpy as np

from nemo_jax.fsutil import atomic_write_text, read_marker
from nemo_jax.model.spec import path_str
from nemo_jax.parallel.mesh import fetch
from nemo_jax.tinker.wire import UserError

RUN_ID = re.compile(r"^[a-z0-9]{1,32}:train:[0-9]{1,9}$")
NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._-]{0,127}$")
KINDS = {"weights": "training", "sampler_weights": "sampler"}  # path segment -> the SDK's checkpoint_type
OPTIMIZER = "optimizer.safetensors"
META = "tinker.json"
RUN = "run.json"
MARKER_KIND = "adapter checkpoint"  # (nemo_jax.lora.checkpoint writes it)


def check_run_id(run_id: str) -> str:
    if not isinstance(run_id, str) or not RUN_ID.match(run_id):
        raise UserError(f"unknown training run {str(run_id)[:80]!r} (run ids look like 's1a2b3c4:train:0')")
    return run_id


def check_name(name) -> str:
    if not isinstance(name, str) or not NAME.match(name):
        raise UserError(f"checkpoint name {str(name)[:80]!r}: use 1 to 128 letters, digits, '.', '_' or '-' (no '/', "
                        "not starting with '.')")
    return name


def parse_path(path) -> tuple[str, str, str]:
    """tinker://<run id>/<weights|sampler_weights>/<name> -> (run id, kind, name); anything else is a UserError."""
    if not isinstance(path, str) or not path.startswith("tinker://"):
        raise UserError(f"{str(path)[:120]!r} is not a tinker:// path (tinker://<run id>/weights/<name>)")
    parts = path[len("tinker://"):].split("/")
    if len(parts) != 3 or parts[1] not in KINDS:
        raise UserError(f"{path[:120]!r}: expected tinker://<run id>/weights/<name> or "
                        "tinker://<run id>/sampler_weights/<name>")
    return check_run_id(parts[0]), parts[1], check_name(parts[2])


def tinker_path(run_id: str, kind: str, name: str) -> str:
    return f"tinker://{run_id}/{kind}/{name}"


def iso_time(t: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))


class Store:
    def __init__(self, root: str):
        self.root = os.path.realpath(root)
        os.makedirs(self.root, exist_ok=True)
        self.read_only = False  # (a follower process of a server over several: it reads, the leader writes)

    def run_dir(self, run_id: str) -> str:
        return os.path.join(self.root, check_run_id(run_id).replace(":", "_"))

    def dir(self, run_id: str, kind: str, name: str) -> str:
        if kind not in KINDS:
            raise UserError(f"checkpoint kind {kind[:40]!r}: expected weights or sampler_weights")
        return os.path.join(self.run_dir(run_id), kind, check_name(name))

    # ------------------------------------------------------------------ runs
    def write_run(self, run_id: str, record: dict) -> None:
        if self.read_only:
            return
        os.makedirs(self.run_dir(run_id), exist_ok=True)
        atomic_write_text(os.path.join(self.run_dir(run_id), RUN), json.dumps(record, indent=1))

    def run(self, run_id: str) -> dict:
        fp = os.path.join(self.run_dir(run_id), RUN)
        try:
            with open(fp) as f:
                return json.load(f)
        except FileNotFoundError:
            raise UserError(f"no training run {run_id!r} under this server's --tinker-root") from None
        except (OSError, ValueError) as e:
            raise UserError(f"training run {run_id!r}: its record is unreadable ({type(e).__name__})") from None

    def runs(self) -> list[dict]:
        out = []
        for d in sorted(os.listdir(self.root)):
            fp = os.path.join(self.root, d, RUN)
            if os.path.isfile(fp):
                try:
                    with open(fp) as f:
                        out.append(json.load(f))
                except (OSError, ValueError):
                    continue
        return sorted(out, key=lambda r: r.get("created", 0))

    # ------------------------------------------------------------------ checkpoints
    def save(self, run_id: str, kind: str, name: str, cfg, lora_cfg, adapters, *, meta: dict,
             optimizer: tuple | None = None, overwrite: bool = False) -> str:
        """Write a checkpoint (adapters, and for `weights` the optimiser state (m, v, step)) -> its tinker path."""
        from safetensors.numpy import save as st_save

        from nemo_jax.fsutil import OutputExistsError
        from nemo_jax.lora import save_adapter_checkpoint

        path = self.dir(run_id, kind, name)
        now = time.time()
        ttl = meta.get("ttl_seconds")
        record = {**meta, "tinker_path": tinker_path(run_id, kind, name), "checkpoint_type": KINDS[kind],
                  "created": now, "expires_at": None if not ttl else now + ttl}
        extra = {META: json.dumps(record, indent=1).encode()}
        adapters = fetch(adapters)
        if optimizer is not None:
            m, v, step = optimizer
            m, v = fetch(m), fetch(v)
            flat = {}
            for tag, tree in (("m", m), ("v", v)):
                for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]:
                    if np.size(x):
                        flat[f"{tag}/{path_str(p)}"] = np.ascontiguousarray(np.asarray(x, np.float32))
            extra[OPTIMIZER] = st_save(flat, metadata={"step": str(int(step)), "format": "nemo_jax-tinker-adamw"})
        if self.read_only:  # (a follower process: the leader writes what every process gathered)
            return record["tinker_path"]
        try:
            save_adapter_checkpoint(path, cfg, lora_cfg, adapters, overwrite=overwrite, extra=extra)
        except OutputExistsError:
            raise UserError(f"checkpoint {tinker_path(run_id, kind, name)} exists (pass overwrite=True to replace "
                            "it)") from None
        return record["tinker_path"]

    def load(self, path: str, cfg, *, optimizer: bool):
        """A tinker path -> (LoraConfig, adapters (numpy), (m, v, step) or None, its tinker.json). The adapters
        must fit the served model (`cfg`); `optimizer` asks for the optimiser state (only `weights` have one)."""
        from safetensors import SafetensorError, safe_open

        from nemo_jax.lora import load_adapter_checkpoint
        from nemo_jax.lora.peft import PeftFormatError, check_adapters_fit

        run_id, kind, name = parse_path(path)
        d = self.dir(run_id, kind, name)
        if not os.path.isdir(d):
            raise UserError(f"no checkpoint {path} under this server's --tinker-root")
        try:
            acfg, lora_cfg, adapters = load_adapter_checkpoint(d)
            check_adapters_fit(acfg, cfg, path)
            with open(os.path.join(d, META)) as f:
                meta = json.load(f)
        except (OSError, ValueError, KeyError, PeftFormatError, SafetensorError) as e:
            raise UserError(f"{path}: not a checkpoint this server can load ({type(e).__name__}: {e})"[:600]) from None
        opt = None
        if optimizer:
            if kind != "weights":
                raise UserError(f"{path} is sampler weights (no optimiser state): resume from a save_state path "
                                "(tinker://.../weights/<name>), or load the weights only")
            fp = os.path.join(d, OPTIMIZER)
            try:
                with safe_open(fp, "numpy") as f:  # (the step rides in the header's metadata)
                    step = int(f.metadata()["step"])
                    flat = {k: f.get_tensor(k) for k in f.keys()}
            except (OSError, ValueError, KeyError, TypeError, SafetensorError) as e:
                raise UserError(f"{path}: its optimiser state is unreadable ({type(e).__name__})") from None

            def moments(tag):
                def one(p, x):
                    k = f"{tag}/{path_str(p)}"
                    if k not in flat:
                        return np.zeros((0,), np.float32)
                    if flat[k].shape != np.shape(x):
                        raise UserError(f"{path}: optimiser tensor {k!r} has shape {flat[k].shape}, expected "
                                        f"{np.shape(x)}")
                    return flat[k]
                return jax.tree_util.tree_map_with_path(one, adapters)
            opt = (moments("m"), moments("v"), step)
        return lora_cfg, adapters, opt, meta

    def checkpoints(self, run_id: str) -> list[dict]:
        """The run's checkpoints as the SDK's `Checkpoint` JSON, oldest first."""
        out = []
        for kind in KINDS:
            base = os.path.join(self.run_dir(run_id), kind)
            for name in sorted(os.listdir(base)) if os.path.isdir(base) else ():
                fp = os.path.join(base, name, META)
                if not NAME.match(name) or not os.path.isfile(fp):
                    continue
                try:
                    with open(fp) as f:
                        meta = json.load(f)
                except (OSError, ValueError):
                    continue
                size = sum(os.path.getsize(os.path.join(base, name, x)) for x in os.listdir(os.path.join(base, name)))
                out.append({"checkpoint_id": f"{kind}/{name}", "checkpoint_type": KINDS[kind],
                            "time": iso_time(meta.get("created", 0)), "tinker_path": tinker_path(run_id, kind, name),
                            "size_bytes": size, "public": False, "user_metadata": meta.get("user_metadata") or None,
                            "expires_at": iso_time(meta["expires_at"]) if meta.get("expires_at") else None,
                            "_created": meta.get("created", 0)})
        out.sort(key=lambda c: c.pop("_created"))
        return out

    def delete(self, run_id: str, kind: str, name: str) -> None:
        d = self.dir(run_id, kind, name)
        if not os.path.isdir(d):
            raise UserError(f"no checkpoint {tinker_path(run_id, kind, name)}")
        marker = read_marker(d)
        if not marker or marker.get("kind") != MARKER_KIND or not os.path.isfile(os.path.join(d, META)):
            raise UserError(f"{tinker_path(run_id, kind, name)}: not a checkpoint this server wrote; not deleted")
        shutil.rmtree(d)
