"""LoRA adapters by name: the ones the operator names at start (`--adapters`), and, with
`--enable-runtime-lora-updating`, those clients load and unload (`/v1/load_lora_adapter`), confined to the
`--adapter-root` folders, one load per name at a time, their file I/O on a thread of its own."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import stat
import threading
import weakref
from concurrent.futures import ThreadPoolExecutor

from nemo_jax.serve.openai import APIError
from nemo_jax.serve.scheduler import Adapter

ADAPTER_LOAD_TIMEOUT_S = 300.0


class AdapterRegistry:
    """`adapter_roots`: folders runtime loading may read (None: runtime loading is off)."""

    def __init__(self, cfg, model_name: str, *, mesh=None, adapter_roots=None):
        self.cfg, self.model_name, self.mesh = cfg, model_name, mesh
        self.roots = None if adapter_roots is None else [os.path.realpath(r) for r in adapter_roots]
        self.by_name: dict[str, Adapter] = {}
        self._loading: set[str] = set()  # names being loaded now (a second load of one name is refused)
        self._versions = itertools.count(1)
        self._made: weakref.WeakValueDictionary = weakref.WeakValueDictionary()  # version -> Adapter, while held
        self._lock = threading.Lock()
        self._io = ThreadPoolExecutor(1, thread_name_prefix="adapter-io")  # never the shared executor

    def __len__(self) -> int:
        return len(self.by_name)

    def loaded(self) -> list[Adapter]:
        with self._lock:
            return list(self.by_name.values())

    def next_version(self) -> int:
        """A new adapter version (the scheduler tells adapter sets apart by it): also for adapters of other
        services over the same engine."""
        with self._lock:
            return next(self._versions)

    def make(self, name: str, path: str, tree) -> Adapter:
        """An Adapter of a new version over `tree` (on the device), findable by it while something holds it."""
        a = Adapter(name, path, tree, self.next_version())
        with self._lock:
            self._made[a.version] = a
        return a

    def made(self, version: int) -> Adapter:
        """The Adapter of `version` (made by `make`, still held)."""
        with self._lock:
            return self._made[version]

    def tree_of(self, version: int):
        """The tree of the adapters of `version` (0: the base alone, None)."""
        return None if not version else self.made(version).tree

    def _confine(self, path) -> str:
        """A runtime-loaded adapter's path -> its real path under an --adapter-root (the same answer whether or
        not the path exists)."""
        if self.roots is None:
            raise APIError("runtime LoRA updating is off (start the server with --enable-runtime-lora-updating "
                           "and --adapter-root DIR)", status=404)
        if not isinstance(path, str) or not path or "\0" in path:
            raise APIError("'lora_path' must be a non-empty string", param="lora_path")
        if ".." in path.replace("\\", "/").split("/"):
            raise APIError("'lora_path' may not contain '..'", param="lora_path")
        real = os.path.realpath(os.path.abspath(path))
        if not self._inside(real):
            raise APIError("'lora_path' is not under an --adapter-root of this server", param="lora_path")
        return real

    def _inside(self, real: str) -> bool:
        return any(os.path.commonpath([real, r]) == r for r in self.roots)

    def _check_tree(self, real: str) -> None:
        """The adapter dir holds only regular files and folders inside the roots (no FIFO, socket or device to
        block on, no link out)."""
        if not os.path.isdir(real):
            raise APIError("no adapter directory at 'lora_path'", status=404, param="lora_path")
        seen = 0
        for top, dirs, files in os.walk(real):
            for name in dirs + files:
                seen += 1
                p = os.path.join(top, name)
                r = os.path.realpath(p)
                if self.roots is not None and not self._inside(r):
                    raise APIError(f"{os.path.relpath(p, real)}: a link out of the --adapter-root", param="lora_path")
                mode = os.stat(r).st_mode
                if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
                    raise APIError(f"{os.path.relpath(p, real)}: not a regular file", param="lora_path")
            if seen > 10000:
                raise APIError("the adapter directory holds more than 10000 entries", param="lora_path")

    def _read(self, name: str, path: str, root_checked: bool) -> Adapter:
        import jax
        import jax.numpy as jnp
        from safetensors import SafetensorError

        from nemo_jax.lora.peft import load_adapters_any

        if root_checked:
            self._check_tree(path)
        elif not os.path.exists(path):
            raise APIError(f"{path}: no such adapter directory", status=404)
        try:
            tree = load_adapters_any(path, self.cfg)
        except (ValueError, KeyError, TypeError, AttributeError, IndexError, OSError, SafetensorError) as e:
            where = path if not root_checked else "'lora_path'"
            raise APIError(f"{where}: not an adapter this server can load ({type(e).__name__}: {e})"[:500],
                           param="lora_path") from None
        put = jnp.asarray if self.mesh is None else (lambda x: jax.device_put(x, jax.sharding.NamedSharding(
            self.mesh, jax.sharding.PartitionSpec())))
        return self.make(name, path, jax.tree.map(put, tree))

    @contextlib.contextmanager
    def _reserving(self, name, replace: bool):
        """The name held for one load (a second load of it is refused) while the block runs."""
        if not isinstance(name, str) or not name or len(name) > 256:
            raise APIError("'lora_name' must be a non-empty string (at most 256 characters)", param="lora_name")
        if name == self.model_name:
            raise APIError(f"the adapter name {name!r} is the base model's", param="lora_name")
        with self._lock:
            if name in self._loading:
                raise APIError(f"The lora adapter '{name}' is being loaded by another request.", param="lora_name")
            if name in self.by_name and not replace:
                raise APIError(f"The lora adapter '{name}' has already been loaded (unload it, or pass "
                               "\"load_inplace\": true).", param="lora_name")
            self._loading.add(name)
        try:
            yield
        finally:
            with self._lock:
                self._loading.discard(name)

    def _keep(self, ad: Adapter) -> Adapter:
        with self._lock:
            self.by_name[ad.name] = ad
        return ad

    def load(self, name: str, path: str) -> Adapter:
        """An adapter the operator named (--adapters): loaded now, from anywhere."""
        with self._reserving(name, False):
            return self._keep(self._read(name, os.path.abspath(path), False))

    async def load_at_runtime(self, name, path, replace: bool) -> Adapter:
        """POST /v1/load_lora_adapter: gated, confined to the roots, one load per name at a time, the file I/O on
        its own thread (a stuck read holds up adapter loads, never chat)."""
        real = self._confine(path)
        with self._reserving(name, replace):
            loop = asyncio.get_running_loop()
            try:
                ad = await asyncio.wait_for(loop.run_in_executor(self._io, self._read, name, real, True),
                                            ADAPTER_LOAD_TIMEOUT_S)
            except asyncio.TimeoutError:
                raise APIError(f"loading the adapter did not finish within {ADAPTER_LOAD_TIMEOUT_S:.0f} s",
                               status=503) from None
            return self._keep(ad)

    def unload(self, name) -> None:
        if self.roots is None:
            raise APIError("runtime LoRA updating is off (start the server with --enable-runtime-lora-updating)",
                           status=404)
        if not isinstance(name, str):
            raise APIError("'lora_name' must be a string", param="lora_name")
        with self._lock:
            if name not in self.by_name:
                raise APIError(f"The lora adapter '{name}' cannot be found.", status=404, param="lora_name")
            del self.by_name[name]  # (requests already accepted keep their copy)

    def resolve(self, model) -> Adapter | None:
        """A request's `model` -> its adapter (None: the base model); 404 for a name nobody loaded."""
        if model is not None and not isinstance(model, str):
            raise APIError("'model' must be a string", param="model")
        if model in (None, "", self.model_name):
            return None
        with self._lock:
            if model in self.by_name:
                return self.by_name[model]
        raise APIError(f"The model '{model[:200]}' does not exist.", status=404, param="model")
