"""LoRA adapters as a pytree beside the params: which tensors to adapt, initial values, shardings, merging.

An adapter tree mirrors the parameter tree down to the adapted tensors:

* a dense kernel `X/kernel [n?, in, out]` (`n` = the layer stack, absent for e.g. `lm_head`) gets
  `X/lora_a [n?, in, r]`, `X/lora_b [n?, r, out]` and `X/lora_scale [n?]` beside it;
* routed experts `.../experts/up_proj [n, E, in, I]` (and `down_proj`) get a dict `.../experts/up_proj_lora`
  holding `lora_a [n, E, in, r]`, `lora_b [n, E, r, I]`, `lora_scale [n]` (one adapter per expert, applied
  inside every MoE dispatch path).

`attach(params, adapters)` places them next to the weights, so the model computes
`x W + scale * (x A) B` unmerged; `merge_adapters` folds `W + weight * scale * A @ B` into the weights
(fp32 math). The scale is alpha / r (rsLoRA: alpha / sqrt(r)); A is drawn uniformly in +-1/sqrt(in) (as
peft's default Kaiming init), B is zero, so a fresh adapter leaves the model unchanged.

The scale is a constant, not a parameter: it rides in the tree (per layer, so imported PEFT adapters with an
`alpha_pattern` keep their scales) but `attach` stops its gradient and trainers give the leaves matching
`CONSTANT_LEAVES` no update and no optimiser state (`nemo_jax.train.optimizer.make_optimizer(frozen=...)`), so
training moves A and B only and an export's lora_alpha stays the configured one.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from nemo_jax.model.spec import ParamSpec, param_specs, path_str

# Target presets (regexes over parameter paths). MTP layers are left out of the presets (their loss is off by
# default and vLLM skips `mtp.*`); a regex of your own may adapt them.
PRESETS = {
    "attention": r"^layers/attention/mixer/[qkvo]_proj/kernel$",
    "mamba": r"^layers/mamba/mixer/(in|out)_proj/kernel$",
    "mlp": r"^layers/(mlp/mixer|moe/mixer/shared_experts)/(up|down)_proj/kernel$",
    "experts": r"^layers/moe/mixer/(experts/(up|down)_proj|fc[12]_latent_proj/kernel)$",
    "lm_head": r"^lm_head/kernel$",
    # vision-language models: the projector (mlp1) and the vision tower's attention and MLP
    "projector": r"^projector/linear_[12]/kernel$",
    "vision": r"^vision/layers/(attn/(qkv|proj)|mlp/(fc1|fc2|gate_proj|up_proj|down_proj))/kernel$",
}
# `all`: every language-model preset (the vision side is opt-in: name `projector` / `vision` beside it)
PRESETS["all"] = "|".join(f"({v})" for k, v in PRESETS.items() if k not in ("lm_head", "projector", "vision"))

# Adapter leaves that are constants: never differentiated, never updated, no optimiser state (a regex over paths).
CONSTANT_LEAVES = r"(^|/)lora_scale$"

# Tensors that can carry an adapter: every dense kernel except the depthwise conv and the router, plus the
# stacked routed experts.
_ADAPTABLE = re.compile(r"(/kernel$|/experts/(up|down)_proj$)")
_NOT_ADAPTABLE = re.compile(r"(conv1d|/gate)/kernel$")


@dataclass(frozen=True)
class LoraConfig:
    targets: tuple[str, ...] = ("all",)  # preset names or path regexes
    rank: int = 8
    alpha: float = 16.0
    rslora: bool = False
    init_seed: int = 0

    def __post_init__(self):
        if self.rank < 1:
            raise ValueError(f"lora.rank must be >= 1, got {self.rank}")
        if isinstance(self.targets, str):
            object.__setattr__(self, "targets", (self.targets,))
        if not self.targets:
            raise ValueError("lora.targets is empty: name presets (" + ", ".join(PRESETS) + ") or path regexes")

    @property
    def scale(self) -> float:
        return self.alpha / (math.sqrt(self.rank) if self.rslora else self.rank)

    def patterns(self) -> list[tuple[str, re.Pattern]]:
        out = []
        for t in self.targets:
            try:
                out.append((t, re.compile(PRESETS.get(t, t))))
            except re.error as e:
                raise ValueError(f"lora.targets: {t!r} is not a preset ({', '.join(PRESETS)}) nor a valid regex: {e}")
        return out


def adaptable_paths(cfg) -> dict[str, ParamSpec]:
    """Every parameter path that can carry an adapter -> its spec."""
    flat = jax.tree_util.tree_flatten_with_path(param_specs(cfg), is_leaf=lambda x: isinstance(x, ParamSpec))[0]
    return {path_str(p): s for p, s in flat
            if _ADAPTABLE.search(path_str(p)) and not _NOT_ADAPTABLE.search(path_str(p))}


def selected_paths(cfg, lora_cfg: LoraConfig) -> dict[str, ParamSpec]:
    """Adaptable paths matched by any target. A target that matches nothing is an error naming it."""
    cand = adaptable_paths(cfg)
    chosen = {}
    for name, rx in lora_cfg.patterns():
        hit = {p: s for p, s in cand.items() if rx.search(p)}
        if not hit:
            raise ValueError(f"lora.targets: {name!r} matches no adaptable tensor of this model "
                             f"(pattern {rx.pattern!r}; e.g. {', '.join(list(cand)[:4])}, ...)")
        chosen.update(hit)
    return dict(sorted(chosen.items()))


def _is_expert(path: str) -> bool:
    return not path.endswith("/kernel")


def _uniform_init(bound: float):
    return lambda key, shape, dtype: jax.random.uniform(key, shape, jnp.float32, -bound, bound).astype(dtype)


def _lead_init(value: float):
    return lambda key, shape, dtype: jnp.full(shape, value, dtype)


def _adapter_spec(spec: ParamSpec, rank: int, scale: float) -> dict:
    """ParamSpecs of one adapter: lead axes (layers, experts) as the kernel's; A [.., in, r], B [.., r, out].
    The scale has only the layer axis (one per adapted layer)."""
    *lead, d_in, d_out = spec.shape
    *lead_ax, in_ax, out_ax = spec.axes
    n_scale = 1 if lead_ax[:1] == ["layers"] else 0
    return {
        "lora_a": ParamSpec((*lead, d_in, rank), (*lead_ax, in_ax, None), _uniform_init(1.0 / math.sqrt(d_in))),
        "lora_b": ParamSpec((*lead, rank, d_out), (*lead_ax, None, out_ax), _lead_init(0.0)),
        "lora_scale": ParamSpec(tuple(lead[:n_scale]), tuple(lead_ax[:n_scale]), _lead_init(scale)),
    }


def adapter_specs(cfg, lora_cfg: LoraConfig) -> dict:
    """The adapter tree as ParamSpecs (shapes, logical axes, initializers): the one source of adapter layout."""
    tree: dict = {}
    for path, spec in selected_paths(cfg, lora_cfg).items():
        parts = path.split("/")
        if _is_expert(path):  # .../experts/up_proj -> .../experts/up_proj_lora/{lora_a, ...}
            parts[-1] = parts[-1] + "_lora"
        else:  # .../X/kernel -> .../X/{lora_a, ...}
            parts = parts[:-1]
        node = tree
        for k in parts:
            node = node.setdefault(k, {})
        node.update(_adapter_spec(spec, lora_cfg.rank, lora_cfg.scale))
    return _lists_for_mtp(tree)


def _lists_for_mtp(tree: dict) -> dict:
    """The params hold `mtp` as a list of blocks: mirror that (keys "0", "1", ... -> list)."""
    if "mtp" in tree:
        n = max(int(k) for k in tree["mtp"]) + 1
        tree["mtp"] = [tree["mtp"].get(str(i), {}) for i in range(n)]
    return tree


def _is_spec(x) -> bool:
    return isinstance(x, ParamSpec)


def init_adapters(cfg, lora_cfg: LoraConfig, key=None, shardings=None) -> dict:
    """A random, B zero, scale alpha/r. `key` defaults to `lora_cfg.init_seed`; `shardings` (a tree like the
    adapters, e.g. from `adapter_shardings`) places each leaf directly where it belongs."""
    specs = adapter_specs(cfg, lora_cfg)
    leaves, treedef = jax.tree.flatten(specs, is_leaf=_is_spec)
    key = jax.random.key(lora_cfg.init_seed) if key is None else key

    def make(key):
        keys = jax.random.split(key, len(leaves))
        return jax.tree.unflatten(treedef, [s.init(k, s.shape, s.dtype) for s, k in zip(leaves, keys)])

    return jax.jit(make, out_shardings=shardings)(key)


def adapter_shardings(cfg, lora_cfg: LoraConfig, mesh, rules=None):
    """NamedShardings of the adapter leaves, read off their logical axes like the params' (expert axis on
    `expert`, in/out dims as the adapted kernel's)."""
    from nemo_jax.parallel.rules import param_shardings

    return param_shardings(adapter_specs(cfg, lora_cfg), mesh, rules)


def summary_table(cfg, lora_cfg: LoraConfig) -> str:
    """What is adapted: one row per adapted tensor (MTP blocks folded) with the count of adapted matrices
    (layers x experts) and of adapter parameters."""
    rows: dict[str, list[int]] = {}
    for path, spec in selected_paths(cfg, lora_cfg).items():
        *lead, d_in, d_out = spec.shape
        n = int(np.prod(lead)) if lead else 1
        r = rows.setdefault(re.sub(r"^mtp/\d+/", "mtp/", path), [0, 0])
        r[0] += n
        r[1] += n * lora_cfg.rank * (d_in + d_out)
    width = max(len(k) for k in rows)
    lines = [f"{'adapted tensor':<{width}}  {'matrices':>8}  {'adapter params':>14}"]
    lines += [f"{k:<{width}}  {n:>8,}  {p:>14,}" for k, (n, p) in rows.items()]
    total_n, total_p = sum(v[0] for v in rows.values()), sum(v[1] for v in rows.values())
    lines.append(f"{'total':<{width}}  {total_n:>8,}  {total_p:>14,}   "
                 f"(rank {lora_cfg.rank}, scale {lora_cfg.scale:g})")
    return "\n".join(lines)


# --------------------------------------------------------------------------- applying and merging
def attach(params, adapters):
    """Params with adapter leaves merged in beside their weights (a tree union; no weights are changed)."""
    if not adapters:
        return params
    return _union(params, adapters, "")


def _union(p, a, where):
    if isinstance(p, list):
        if not isinstance(a, (list, dict)):
            raise ValueError(f"adapter tree: expected a list at {where or '/'}")
        if isinstance(a, dict) and any(not str(k).isdigit() for k in a):  # (stacked adapters met unstacked layers)
            raise ValueError(f"adapter tree: {where or '/'} holds its layers one by one (unstack_layers), the "
                             f"adapters there are stacked (keys {sorted(a)[:3]}): unstack them alike")
        get = (lambda i: a[i] if i < len(a) else None) if isinstance(a, list) else (lambda i: a.get(str(i)))
        return [_union(p[i], get(i), f"{where}/{i}") if get(i) else p[i] for i in range(len(p))]
    if not isinstance(a, dict):
        raise ValueError(f"adapter tree: expected a mapping at {where or '/'}")
    out = dict(p)
    for k, v in a.items():
        if k.startswith("lora_"):
            if "kernel" not in p:
                raise ValueError(f"adapter {where}/{k}: no kernel to adapt at {where}")
            out[k] = _constant(k, v)
        elif k.endswith("_lora") and k[: -len("_lora")] in p and not isinstance(p[k[: -len("_lora")]], dict):
            out[k] = {n: _constant(n, x) for n, x in v.items()}  # routed experts: beside the stacked expert tensor
        elif k not in p:
            raise ValueError(f"adapter path {where}/{k} does not exist in the params")
        elif v:
            out[k] = _union(p[k], v, f"{where}/{k}")
    return out


def _constant(name: str, x):
    """The scale enters the model as a constant (no gradient flows to it); A and B as they are."""
    return jax.lax.stop_gradient(x) if name == "lora_scale" else x


def delta(lora: dict) -> jax.Array:
    """scale * A @ B in fp32, over any lead axes: A [..., in, r], B [..., r, out], scale [n?] -> [..., in, out]."""
    a, b = lora["lora_a"].astype(jnp.float32), lora["lora_b"].astype(jnp.float32)
    s = jnp.asarray(lora["lora_scale"], jnp.float32)
    d = jnp.einsum("...ir,...ro->...io", a, b)
    return d * s.reshape(s.shape + (1,) * (d.ndim - s.ndim))


def merge_adapters(params, adapters, weight: float = 1.0):
    """W + weight * scale * A @ B, in fp32 and rounded once to each weight's dtype; every other leaf is
    returned as it is. Routed experts are merged per expert."""
    if not adapters:
        return params
    return _merge(params, adapters, weight, "")


def _merge(p, a, weight, where):
    if isinstance(p, list):
        get = (lambda i: a[i] if i < len(a) else None) if isinstance(a, list) else (lambda i: a.get(str(i)))
        return [_merge(p[i], get(i), weight, f"{where}/{i}") if get(i) else p[i] for i in range(len(p))]
    out = dict(p)
    if "lora_a" in a:
        if "kernel" not in p:
            raise ValueError(f"adapter at {where}: no kernel to merge into")
        out["kernel"] = _merged(p["kernel"], a, weight, f"{where}/kernel")
    for k, v in a.items():
        if k.startswith("lora_") or not v:
            continue
        if k.endswith("_lora") and k[: -len("_lora")] in p:
            base = k[: -len("_lora")]
            out[base] = _merged(p[base], v, weight, f"{where}/{base}")
        elif k in p:
            out[k] = _merge(p[k], v, weight, f"{where}/{k}")
        else:
            raise ValueError(f"adapter path {where}/{k} does not exist in the params")
    return out


def _merged(w, lora, weight, where):
    d = delta(lora)
    if d.shape != w.shape:
        raise ValueError(f"adapter for {where}: delta shape {tuple(d.shape)} != weight shape {tuple(w.shape)}")
    return (w.astype(jnp.float32) + weight * d).astype(w.dtype)

