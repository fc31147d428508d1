"""Old import paths of modules that moved: `import nemo_jax.rl.mcp_env`, a plug-in spec `nemo_jax.rl.mcp_env:MCPEnv`
and `python -m nemo_jax.rl.mcp_tiny_server` keep working, and give the module at its new place (the same object:
one module, two names), without a file left behind at the old place.

A package that moved some of its modules calls `alias(__name__, {"old_name": "new.dotted.path", ...})` in its
`__init__`: the table is also the record of where each module went."""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys

_MOVED: dict[str, str] = {}  # old dotted name -> new dotted name


class _Alias(importlib.abc.MetaPathFinder, importlib.abc.InspectLoader):
    """Finds an old name and loads the module of its new name in its place (`get_code` serves `python -m OLD`)."""

    def find_spec(self, name, path=None, target=None):
        if name not in _MOVED:
            return None
        origin = importlib.util.find_spec(_MOVED[name]).origin  # (`python -m OLD` names it in sys.argv[0])
        return importlib.util.spec_from_loader(name, self, origin=origin, is_package=False)

    def create_module(self, spec):
        return importlib.import_module(_MOVED[spec.name])

    def exec_module(self, module):
        pass  # (the module at its new name has run already)

    def get_code(self, fullname):
        new = _MOVED[fullname]
        return importlib.util.find_spec(new).loader.get_code(new)

    def get_source(self, fullname):
        new = _MOVED[fullname]
        return importlib.util.find_spec(new).loader.get_source(new)


def alias(package: str, table: dict[str, str]) -> None:
    """Serve `package.OLD` as the module `table[OLD]` for every OLD in `table`."""
    _MOVED.update({f"{package}.{old}": new for old, new in table.items()})
    if not any(isinstance(f, _Alias) for f in sys.meta_path):
        sys.meta_path.append(_Alias())
