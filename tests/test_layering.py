"""The package's imports keep docs/design.md's layering: no import circle among nemo_jax modules, and every arrow
between areas points down the layer table below. Static analysis of the source (ast): every `import` and
`from ... import` of a nemo_jax module, at module level or inside a function (a deferred import still ties the
two modules together), each edge remembered with its file:line and kind. Pure text: well under a second.
"""

from __future__ import annotations

import ast
import functools
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# docs/design.md's layers, bottom first: an area may import its own layer's areas and the layers below, never one
# above (config <- model <- (lora, hf, checkpoint) <- train / generate <- rl / merge / plan <- cli).
LAYERS = (
    ("config", "paramspec", "vision_layout", "fsutil", "runlock", "extras", "hostmem", "threads", "sandbox", "moved",
     "fields"),
    ("parallel", "data"),  # the data pipeline needs no model; parallel does not import the model
    ("kernels",),
    ("model",),
    ("lora", "hf", "checkpoint", "tensorio"),
    ("sources",),  # what a path holds: above the native, HF and adapter readers
    ("train", "generate"),
    ("rl", "merge", "plan", "serve", "plot"),
    ("tinker",),  # the Tinker API builds on serve (its scheduler, its adapters); serve never names it
    ("recipe",),
    ("cli",),
)
RANK = {area: i for i, layer in enumerate(LAYERS) for area in layer}
# the floors inside an area, bottom first, by the module or package under it (nemo_jax.AREA.ROOM...): an arrow
# between two rooms of one area points down too
ROOMS = {
    # rl: the environments know nothing of how they are sampled or trained; the rollout record, its pool and the
    # loss are what the transports carry and fill; the learner drives the transports
    "rl": (("envs",), ("rollout", "pool", "loss"), ("transport",),
           ("learner", "client", "curriculum", "ablation", "warmstart", "grpo")),
    # generate: the sampling math, the model's prefill / decode programs, the Engine over them (and the interface
    # it implements), the command
    "generate": (("sampling",), ("decode",), ("sampler", "engine"), ("cli",)),
}
# arrows that the layers alone would allow but the design rules out
FORBIDDEN = {
    ("checkpoint", "hf"): "the native checkpoint layer knows no HF names",
    ("tensorio", "hf"): "the native checkpoint layer knows no HF names",
}


def module_files(root: str, package: str = "nemo_jax") -> dict[str, str]:
    """{dotted module name: file} of every module under ROOT/PACKAGE (a package is its __init__)."""
    out = {}
    for d, _, files in os.walk(os.path.join(root, package)):
        for f in files:
            if f.endswith(".py"):
                parts = os.path.relpath(os.path.join(d, f[:-3]), root).split(os.sep)
                out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = os.path.join(d, f)
    return out


def import_edges(root: str, package: str = "nemo_jax") -> dict[str, dict[str, list[tuple[str, str]]]]:
    """{importer: {imported: [(kind, "file:line"), ...]}} among PACKAGE's modules; kind "module" (runs on import)
    or "function" (inside a def: runs when called). `from a.b import c` names the module a.b.c when there is
    one, else a.b."""
    mods = module_files(root, package)

    def owner(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    edges: dict = {}
    for mod, path in mods.items():
        pkg = mod if path.endswith("__init__.py") else mod.rpartition(".")[0]
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), path)

        def add(target, node, kind):
            if target and target != mod:
                where = f"{os.path.relpath(path, root)}:{node.lineno}"
                uses = edges.setdefault(mod, {}).setdefault(target, [])
                if (kind, where) not in uses:
                    uses.append((kind, where))

        def visit(node, kind):
            for child in ast.iter_child_nodes(node):
                if isinstance(child, ast.Import):
                    for a in child.names:
                        add(owner(a.name), child, kind)
                elif isinstance(child, ast.ImportFrom):
                    base = child.module or ""
                    if child.level:  # relative: from the importing module's package upwards
                        up = pkg.split(".")[:len(pkg.split(".")) - (child.level - 1)]
                        base = ".".join(up + ([child.module] if child.module else []))
                    for a in child.names:
                        full = f"{base}.{a.name}"
                        add(full if full in mods else owner(base), child, kind)
                visit(child, "function" if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef,
                                                             ast.Lambda)) else kind)

        visit(tree, "module")
    return edges


def import_cycles(edges) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative), each sorted."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []
    nodes = sorted(set(edges) | {b for bs in edges.values() for b in bs})
    for start in nodes:
        if start in index:
            continue
        work = [(start, iter(sorted(edges.get(start, {}))))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(edges.get(w, {})))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def describe_cycle(comp: list[str], edges) -> str:
    lines = [" <-> ".join(comp)]
    for a in comp:
        for b, uses in sorted(edges.get(a, {}).items()):
            if b in comp:
                kinds = "/".join(sorted({k for k, _ in uses}))
                lines.append(f"    {a} -> {b} ({kinds}-level: {', '.join(w for _, w in uses)})")
    return "\n".join(lines)


def area(mod: str) -> str:
    parts = mod.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def room(mod: str) -> str | None:
    """The room of a module inside its area (`ROOMS`), or None (the area's own package, or an area without rooms)."""
    parts = mod.split(".")
    return parts[2] if len(parts) > 2 and parts[1] in ROOMS else None


def room_rank(mod: str) -> int | None:
    r = room(mod)
    return next((i for i, floor in enumerate(ROOMS[area(mod)]) if r in floor), None) if r else None


def layering_violations(edges) -> list[str]:
    out = []
    for a, targets in sorted(edges.items()):
        for b, uses in sorted(targets.items()):
            src, dst = area(a), area(b)
            if src == dst and room(a) and room(b) and room(a) != room(b):
                lo, hi = room_rank(a), room_rank(b)
                why = (f"{room(a) if lo is None else room(b)} has no floor in ROOMS[{src!r}] (tests/test_layering.py)"
                       if lo is None or hi is None else
                       f"{src}.{room(b)} sits above {src}.{room(a)} (docs/design.md)" if hi > lo else None)
                if why:
                    out.append(f"{a} -> {b} at {', '.join(w for _, w in uses)}: {why}")
                continue
            if src == dst or src == "nemo_jax" or dst == "nemo_jax":
                continue
            why = FORBIDDEN.get((src, dst))
            if why is None and (src not in RANK or dst not in RANK):
                why = f"{src if src not in RANK else dst} has no place in LAYERS (tests/test_layering.py, docs/design.md)"
            elif why is None and RANK[dst] > RANK[src]:
                why = f"{dst} sits above {src} (docs/design.md: Layout and layering)"
            if why:
                out.append(f"{a} -> {b} at {', '.join(w for _, w in uses)}: {why}")
    return out


@functools.lru_cache(maxsize=None)
def package_edges():
    return import_edges(ROOT)


def test_no_import_cycles():
    edges = package_edges()
    assert len(edges) > 50  # the walk found the package
    cycles = import_cycles(edges)
    assert not cycles, "import circles among nemo_jax modules:\n" + "\n".join(describe_cycle(c, edges)
                                                                             for c in cycles)


def test_arrows_point_down_the_layers():
    bad = layering_violations(package_edges())
    assert not bad, "imports against the layering:\n" + "\n".join(bad)


@pytest.fixture
def planted(tmp_path):
    """A small package with a function-level circle (a <-> b), a three-module module-level circle through a
    relative import and a package re-export (p.c -> p.d -> p -> p.c), an upward arrow (config -> cli), an
    area with no layer (p) and an upward arrow between the rooms of one area (rl.envs -> rl.grpo)."""
    files = {
        "__init__.py": "",
        "a.py": "import os\n\ndef f():\n    from nemo_jax.b import g\n    return g\n",
        "b.py": "def g():\n    import nemo_jax.a\n",
        "p/__init__.py": "from nemo_jax.p.c import x\n",
        "p/c.py": "from . import d\nx = 1\n",
        "p/d.py": "from nemo_jax import p\n",
        "config/__init__.py": "",
        "config/load.py": "def f():\n    from nemo_jax.cli import main\n",
        "cli.py": "import nemo_jax.config\nimport nemo_jax.p\n",
        "rl/__init__.py": "",
        "rl/envs/__init__.py": "",
        "rl/envs/e.py": "def f():\n    from nemo_jax.rl.grpo import run\n",
        "rl/grpo.py": "run = None\n",
        "rl/client.py": "from nemo_jax.rl.envs import e\n",
    }
    for name, text in files.items():
        path = tmp_path / "nemo_jax" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return str(tmp_path)


def test_the_analysis_finds_planted_cycles_and_upward_arrows(planted):
    edges = import_edges(planted)
    assert edges["nemo_jax.a"]["nemo_jax.b"][0][0] == "function"
    assert edges["nemo_jax.p.c"]["nemo_jax.p.d"] == [("module", os.path.join("nemo_jax", "p", "c.py") + ":1")]
    cycles = import_cycles(edges)
    assert sorted(cycles) == [["nemo_jax.a", "nemo_jax.b"], ["nemo_jax.p", "nemo_jax.p.c", "nemo_jax.p.d"]]
    text = describe_cycle(cycles[0], edges)
    assert "nemo_jax.a -> nemo_jax.b (function-level: nemo_jax/a.py:4)" in text.replace(os.sep, "/")
    bad = layering_violations(edges)
    assert any(v.startswith("nemo_jax.config.load -> nemo_jax.cli at") and "cli sits above config" in v for v in bad)
    assert any("p has no place in LAYERS" in v for v in bad)
    assert any(v.startswith("nemo_jax.rl.envs.e -> nemo_jax.rl.grpo at") and "rl.grpo sits above rl.envs" in v
               for v in bad)
    assert not any(v.startswith("nemo_jax.rl.client ->") for v in bad)  # (down a floor)


def test_the_repository_tracks_no_symlink_but_configs_model():
    """A tracked link out of the tree (a sandbox experiment's `-> /` once was) sends `pip install .`'s package
    discovery walking the whole machine: it never finished."""
    import shutil
    import subprocess

    if shutil.which("git") is None or not os.path.isdir(os.path.join(ROOT, ".git")):
        pytest.skip("not a git checkout")
    out = subprocess.run(["git", "ls-files", "-s"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    links = [line.split("\t", 1)[1] for line in out.splitlines() if line.startswith("120000 ")]
    assert links == ["configs/model"], links
