"""Rule-driven merges, tensor by tensor over HF tensor names: streamed between checkpoint directories (HF
safetensors or native, mixed) or in memory between pytrees, through the same code (so the two agree bit for
bit).

Each output tensor is computed from row blocks of its inputs in HF layout (whole tensors for TIES and SLERP),
each input tensor read once, in fp32, rounded once to the base model's dtype for that tensor, and written by
`nemo_jax.hf.io.save_pretrained` into a temporary directory renamed into place when complete.
"""

from __future__ import annotations

import os
import re
import threading
from dataclasses import dataclass

import jax
import numpy as np

from nemo_jax.checkpoint import is_native
from nemo_jax.config.model import NemotronHConfig
from nemo_jax.hf.io import (ST_DTYPES, ArraySource, CheckpointError, HFReader, HFSource, check_against_config,
                             save_pretrained)
from nemo_jax.hf.mapping import Entry, build_table, hf_rows_from_ours, leaf_specs, ours_from_hf
from nemo_jax.merge import ops
from nemo_jax.merge.recipe import WHOLE_TENSOR, Recipe, RecipeError, Rule
from nemo_jax.sources import open_lazy, resolve, tokenizer_dir

ELEMENTWISE = ("take", "linear", "task_arithmetic", "dare")
SLICE = 1 << 18  # elements per cache-sized slice of an elementwise rule


# --------------------------------------------------------------------------- inputs
def _full_inner(region: tuple, ndim: int) -> tuple:
    return tuple(region) + (slice(None),) * (ndim - len(tuple(region)))


class Model:
    """One input model as HF tensors: `read_hf(entry, block)` (HF layout rows) plus the region-source
    interface over our leaves (`paths`, `[path]`, `chunks`, `read`) that `MergedSource` wraps."""

    def __init__(self, name: str, cfg: NemotronHConfig, *, hf: HFReader | None = None, leaves=None, where: str = ""):
        self.name, self.cfg, self.hf, self.leaves, self.where = name, cfg, hf, leaves, where
        self.specs = leaf_specs(cfg)
        self._hf_leaves = HFSource(hf, cfg) if hf is not None else None

    def dtype(self, e: Entry) -> np.dtype:
        if self.hf is not None:
            return ST_DTYPES[self.hf.tensors[e.hf_name][2]]
        return np.dtype(self.leaves[e.path].dtype)

    def prefetch_hf(self, e: Entry, block: tuple):
        if self.hf is not None:
            self.hf.prefetch(e.hf_name, tuple(block))

    def read_hf(self, e: Entry, block: tuple) -> np.ndarray:
        if self.hf is not None:
            return self.hf.read(e.hf_name, tuple(block))
        inner = tuple(self.specs[e.path].shape)[len(e.index):]
        return hf_rows_from_ours(e, lambda reg: self.leaves.read(e.path, reg), inner, block)

    # region source over our leaves
    def paths(self):
        return self.specs.keys()

    def __getitem__(self, path):
        if self.leaves is not None:
            return self.leaves[path]
        return jax.ShapeDtypeStruct(tuple(self.specs[path].shape), np.float32)

    def chunks(self, path) -> tuple:
        return tuple(self.specs[path].shape)

    def read(self, path, region=()) -> np.ndarray:
        return (self.leaves if self.leaves is not None else self._hf_leaves).read(path, region)


def open_model(name: str, path: str, cfg: NemotronHConfig | None = None) -> Model:
    """An HF safetensors directory, a native checkpoint or a run dir (anything `nemo_jax.sources` reads), checked
    against `cfg` (its own config if None): every tensor present with its shape."""
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise RecipeError(f"model {name!r}: {path} does not exist (or is not a directory)")
    try:
        src = resolve(path)
    except FileNotFoundError as e:
        raise RecipeError(f"model {name!r}: {e}") from None
    if not isinstance(src, str) or is_native(src):  # a native model or a run: read region by region
        own, leaves, _ = open_lazy(path)
        cfg = cfg or own
        specs = leaf_specs(cfg)
        extra = sorted(set(leaves.paths()) - set(specs))
        if extra:
            raise RecipeError(f"model {name!r} ({path}): has tensor {extra[0]!r} (and {len(extra) - 1} more) that the "
                              "base config does not describe")
        for p, s in specs.items():
            if p not in leaves.paths():
                raise RecipeError(f"model {name!r} ({path}): lacks tensor {p!r} required by the base config")
            if tuple(leaves[p].shape) != tuple(s.shape):
                raise RecipeError(f"model {name!r} ({path}): tensor {p!r} has shape {tuple(leaves[p].shape)}, "
                                  f"the base config implies {tuple(s.shape)}")
        return Model(name, cfg, leaves=leaves, where=path)
    if not os.path.exists(os.path.join(path, "config.json")):
        raise RecipeError(f"model {name!r}: {path} is neither an HF checkpoint nor a native model (no config.json)")
    cfg = cfg or NemotronHConfig.from_file(os.path.join(path, "config.json"))
    reader = HFReader(path)
    try:
        check_against_config(reader, cfg, build_table(cfg), ignore_unexpected=False)
    except CheckpointError as e:
        raise RecipeError(f"model {name!r}: {e}") from None
    return Model(name, cfg, hf=reader, where=path)


def array_model(name: str, cfg: NemotronHConfig, params) -> Model:
    """In-memory params (numpy or jax leaves) as a merge input."""
    src = ArraySource(params)
    specs = leaf_specs(cfg)
    for p, s in specs.items():
        if p not in src.paths():
            raise RecipeError(f"model {name!r}: params lack {p!r}")
        if tuple(src[p].shape) != tuple(s.shape):
            raise RecipeError(f"model {name!r}: {p!r} has shape {tuple(src[p].shape)}, the config implies {tuple(s.shape)}")
    return Model(name, cfg, leaves=src, where="<memory>")


# --------------------------------------------------------------------------- plan
def assign(rules, names: list[str]) -> dict[str, Rule]:
    """HF name -> the first rule whose regex matches it. A tensor no rule claims, or a rule that claims
    nothing, is an error naming it."""
    compiled = [(r, re.compile(r.match)) for r in rules]
    out: dict[str, Rule] = {}
    for n in names:
        hit = next((r for r, rx in compiled if rx.search(n)), None)
        if hit is None:
            raise RecipeError(f"tensor {n!r} is claimed by no rule (add a rule matching it, e.g. match: '.*')")
        out[n] = hit
    used = {r.index for r in out.values()}
    for r in rules:
        if r.index not in used:
            matched = [n for n in names if re.search(r.match, n)]
            why = f"(its tensors, e.g. {matched[0]!r}, are claimed by earlier rules)" if matched else "(no tensor name matches it)"
            raise RecipeError(f"{r.where} matches nothing {why}")
    return out


@dataclass
class TensorStat:
    name: str
    rule: int
    kind: str
    dtype: str
    change_sq: float = 0.0
    kept_sq: float = 0.0

    @property
    def change(self) -> float:
        return float(np.sqrt(self.change_sq))

    @property
    def survived(self) -> float:
        return float(np.sqrt(self.kept_sq / self.change_sq)) if self.change_sq > 0 else 1.0


class MergeSource:
    """The merged model as a region source for `save_pretrained` (HF rows via `read_hf`), computing each
    output tensor from its inputs on demand; per-tensor statistics accumulate in `stats`."""

    def __init__(self, cfg, models: dict[str, Model], base: str, assignment: dict[str, Rule], adapters: dict):
        from nemo_jax.lora.peft import MergedSource

        self.cfg, self.models, self.base = cfg, models, base
        self.table = build_table(cfg)
        self.specs = leaf_specs(cfg)
        self.assignment = assignment
        self.entries = {e.hf_name: e for e in self.table}
        self.whole_leaves = {e.path for e in self.table if assignment[e.hf_name].kind in WHOLE_TENSOR}
        self.adapted = {r.index: MergedSource(models[base], cfg, [(adapters[a], w) for a, w in r.weights.items()])
                        for r in {r.index: r for r in assignment.values()}.values() if r.kind == "add_adapters"}
        self.stats = {e.hf_name: TensorStat(e.hf_name, assignment[e.hf_name].index, assignment[e.hf_name].kind,
                                            models[base].dtype(e).name) for e in self.table}
        self._lock = threading.Lock()
        self._by_index = {(e.path, e.index): e for e in self.table}
        self._lead = {e.path: len(e.index) for e in self.table}

    def out_dtypes(self) -> dict[str, np.dtype]:
        return {e.hf_name: self.models[self.base].dtype(e) for e in self.table}

    def paths(self):
        return self.specs.keys()

    def __getitem__(self, path):
        return jax.ShapeDtypeStruct(tuple(self.specs[path].shape), np.float32)

    def chunks(self, path) -> tuple:
        """Whole leaves for TIES/SLERP, else row blocks (elementwise ops compute the same on any block)."""
        shape = tuple(self.specs[path].shape)
        return shape if path in self.whole_leaves else (1,) * len(shape)

    def read(self, path, region=()) -> np.ndarray:
        ndim = len(self.specs[path].shape)
        region = _full_inner(region, ndim)
        lead = self._lead[path]
        e = self._by_index[(path, tuple(int(i) for i in region[:lead]))]
        return ours_from_hf(e, lambda sl: self.read_hf(e, sl[:1])[(slice(None),) + tuple(sl[1:])],
                            tuple(self.specs[path].shape)[lead:], region[lead:])

    def prefetch_hf(self, e: Entry, block: tuple):
        """Read-ahead hints for the input rows `read_hf(e, block)` will read."""
        for name in self.assignment[e.hf_name].inputs(self.base):
            self.models[name].prefetch_hf(e, block)

    def read_hf(self, e: Entry, block: tuple) -> np.ndarray:
        rule = self.assignment[e.hf_name]
        cache: dict[str, np.ndarray] = {}

        def get(name):  # each input's rows read once per block
            if name not in cache:
                cache[name] = self.models[name].read_hf(e, block)
            return cache[name]

        ref = get(self.base)
        dtype = self.models[self.base].dtype(e)
        if rule.kind in ELEMENTWISE:
            out, change, kept = self._sliced(rule, e, block, get, ref, dtype)
        else:
            out, change, kept = ops.finish(self._whole(rule, e, block, get, ref), ref, dtype)
        with self._lock:
            st = self.stats[e.hf_name]
            st.change_sq += change
            st.kept_sq += kept
        return out

    def _sliced(self, rule: Rule, e: Entry, block: tuple, get, ref, dtype):
        """An elementwise rule over flat slices that fit in cache (computing, rounding and measuring each
        slice in one go keeps memory traffic to the inputs and the output)."""
        names = [rule.model] if rule.kind == "take" else list(rule.weights)
        xs = [get(n).reshape(-1) for n in names]
        w = list(rule.weights.values())
        r_all = ref.reshape(-1)
        start = (block[0].start or 0) * int(np.prod(ref.shape[1:])) if block else 0
        out = np.empty(r_all.shape, dtype)
        change = kept = 0.0
        for i in range(0, r_all.size, SLICE):
            sl = slice(i, i + SLICE)
            xi, ri = [x[sl] for x in xs], ops.f32(r_all[sl])  # the base in fp32 once per slice
            if rule.kind == "take":
                m = ops.f32(xi[0])
            elif rule.kind == "linear":
                m = ops.linear(xi, w)
            elif rule.kind == "task_arithmetic":
                m = ops.task_arithmetic(ri, xi, w)
            else:  # dare: the mask of these elements of the whole tensor
                masks = [ops.dare_keep(rule.seed, f"{e.hf_name}#{n}", start + i, (ri.size,), rule.density) for n in names]
                m = ops.dare(ri, xi, w, rule.density, masks)
            o, c, k = ops.finish(m, ri, dtype)
            out[sl] = o
            change += c
            kept += k
        return out.reshape(ref.shape), change, kept

    def _whole(self, rule: Rule, e: Entry, block: tuple, get, ref) -> np.ndarray:
        k = rule.kind
        if k == "ties":
            return ops.ties(ref, [get(n) for n in rule.weights], list(rule.weights.values()), rule.density)
        if k == "slerp":
            return ops.slerp(get(rule.a), get(rule.b), rule.t)
        if k == "add_adapters":
            inner = tuple(self.specs[e.path].shape)[len(e.index):]
            return ops.f32(hf_rows_from_ours(e, lambda reg: ops.f32(self.adapted[rule.index].read(e.path, reg)), inner,
                                             block))
        raise RecipeError(f"{rule.where}: unknown rule kind {k!r}")


def _check_rules(recipe_or_rules, models: dict, base: str):
    for r in recipe_or_rules:
        for n in r.inputs(base):
            if n not in models:
                raise RecipeError(f"{r.where}: model {n!r} is not given")


def build_source(cfg, models: dict[str, Model], rules, base: str, adapters: dict | None = None) -> MergeSource:
    """Validate the rules against the base's HF names and the inputs -> the merged model as a source."""
    if base not in models:
        raise RecipeError(f"base model {base!r} is not given (models: {', '.join(models)})")
    _check_rules(rules, models, base)
    adapters = adapters or {}
    for r in rules:
        for a in (r.weights if r.kind == "add_adapters" else ()):
            if a not in adapters:
                raise RecipeError(f"{r.where}: adapter {a!r} is not given")
    assignment = assign(rules, [e.hf_name for e in build_table(cfg)])
    return MergeSource(cfg, models, base, assignment, adapters)


# --------------------------------------------------------------------------- entry points
def merge_params(cfg, params: dict, rules, base: str = "base", adapters: dict | None = None):
    """In memory: {name: params} -> (merged params in the base's leaf dtypes, stats). Leaves come back as
    numpy arrays (or, for jax inputs, jax arrays in the base leaf's sharding)."""
    models = {n: array_model(n, cfg, p) for n, p in params.items()}
    src = build_source(cfg, models, rules, base, adapters)
    base_src = models[base].leaves
    out = {}
    for path, spec in src.specs.items():
        out[path] = np.empty(tuple(spec.shape), base_src[path].dtype)
    for e in src.table:
        x = src.read_hf(e, (slice(0, e.hf_shape[0]),) if e.hf_shape else ())
        out[e.path][e.index] = ours_from_hf(e, lambda sl: x[sl], tuple(out[e.path].shape)[len(e.index):])
    for path, x in out.items():
        like = base_src[path]
        if isinstance(like, jax.Array):
            out[path] = jax.device_put(x, like.sharding)
    from nemo_jax.model.spec import unflatten_paths

    return unflatten_paths(out), src.stats


def open_recipe(recipe: Recipe) -> tuple[NemotronHConfig, MergeSource]:
    """Open and check every input of a recipe (nothing is written)."""
    from nemo_jax.sources import load_adapters

    base = open_model(recipe.base, recipe.models[recipe.base])
    models = {recipe.base: base}
    for name, path in recipe.models.items():
        if name != recipe.base:
            models[name] = open_model(name, path, base.cfg)
    adapters = {}
    for name, path in recipe.adapters.items():
        if not os.path.isdir(path):
            raise RecipeError(f"adapter {name!r}: {path} does not exist (or is not a directory)")
        if any(name in r.weights for r in recipe.rules if r.kind == "add_adapters"):
            adapters[name] = load_adapters(path, base.cfg)
    return base.cfg, build_source(base.cfg, models, recipe.rules, recipe.base, adapters)


def run_recipe(recipe: Recipe, progress: bool = False) -> MergeSource:
    """Stream the merge into `recipe.output` (written whole or not at all; an existing output is replaced only
    with `recipe.overwrite` and only when it is an earlier HF checkpoint written here; every tensor checked to be
    finite unless `recipe.allow_nonfinite`) -> the source, with its stats."""
    from nemo_jax.fsutil import check_not_input, check_output

    out = os.path.abspath(recipe.output)
    check_not_input(out, list(recipe.models.values()) + list(recipe.adapters.values()), "output")
    check_output(out, "HF checkpoint", recipe.overwrite)  # refused before any input is opened
    cfg, src = open_recipe(recipe)
    save_pretrained(cfg, src, recipe.output, max_shard_size=recipe.max_shard_size, dtypes=src.out_dtypes(),
                    tokenizer_dir=tokenizer_dir(recipe.models[recipe.base]), progress=progress,
                    overwrite=recipe.overwrite, allow_nonfinite=recipe.allow_nonfinite)
    return src


def summary(stats: dict[str, TensorStat], worst: int = 10) -> str:
    """Per rule: tensors, dtypes, norm of the change, and the share of it that survived the final rounding;
    then the tensors whose change survived least."""
    by_rule: dict[int, list[TensorStat]] = {}
    for s in stats.values():
        by_rule.setdefault(s.rule, []).append(s)
    lines = [f"{'rule':<5} {'kind':<15} {'tensors':>7} {'dtypes':<16} {'|change|':>12} {'survived':>9}"]
    for r, ss in sorted(by_rule.items()):
        ch = sum(s.change_sq for s in ss)
        kept = sum(s.kept_sq for s in ss)
        surv = f"{np.sqrt(kept / ch):.4f}" if ch > 0 else "-"
        lines.append(f"{r:<5} {ss[0].kind:<15} {len(ss):>7} {','.join(sorted({s.dtype for s in ss})):<16} "
                     f"{np.sqrt(ch):>12.4g} {surv:>9}")
    changed = sorted((s for s in stats.values() if s.change_sq > 0), key=lambda s: s.survived)[:worst]
    if changed:
        width = max(len(s.name) for s in changed)
        lines += ["", f"{'least surviving tensors':<{width}} {'dtype':<9} {'|change|':>12} {'survived':>9}"]
        lines += [f"{s.name:<{width}} {s.dtype:<9} {s.change:>12.4g} {s.survived:>9.4f}" for s in changed]
    return "\n".join(lines)


def stats_table(stats: dict[str, TensorStat]) -> str:
    """Every tensor: name, rule, kind, dtype, norm of the change, share surviving the rounding (TSV)."""
    rows = ["tensor\trule\tkind\tdtype\tchange_norm\tsurvived"]
    rows += [f"{s.name}\t{s.rule}\t{s.kind}\t{s.dtype}\t{s.change:.6g}\t{s.survived:.6f}" for s in stats.values()]
    return "\n".join(rows) + "\n"
