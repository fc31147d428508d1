"""LoRA adapters <-> PEFT / vLLM adapter directories, and base weights with adapters merged for HF export.

A PEFT directory is `adapter_config.json` + `adapter_model.safetensors`. Names come from the one HF name table
(`nemo_jax.hf.mapping.build_table`): our kernel `X/kernel` at HF tensor `M.weight` gets
`base_model.model.M.lora_A.weight` `[r, in]` (= A.T) and `...lora_B.weight` `[out, r]` (= B.T), since
HF Linear weights are `[out, in]`: delta_hf = scale * (A @ B).T = scale * B.T @ A.T. The scale is not stored:
`adapter_config.json` holds `r`, `lora_alpha`, `use_rslora` (scale alpha/r or alpha/sqrt(r)) and, where
modules differ, peft's `rank_pattern` / `alpha_pattern`; import recomputes `lora_scale` bit-exactly.

Module names use the HF checkpoint spelling `backbone.layers.{i}.mixer.<module>` (what vLLM reads). transformers
>= 5 names the module `model.layers` and peft (>= 0.19) renames `backbone.` on load; `load_peft` accepts both.

Routed experts (transformers >= 5 fuses them into 3D parameters `mixer.experts.up_proj [E, I, in]` and
`down_proj [E, in, I]`):

* `format="peft"`: peft's `target_parameters` form (`peft/tuners/lora/layer.py`, `ParamWrapper`). Each targeted
  parameter of a module gets one wrapper; wrappers nest in the module's parameter order (up_proj, then
  down_proj), the last one outermost, so with both targeted the keys are
  `...mixer.experts.base_layer.lora_A.weight` (up_proj) and `...mixer.experts.lora_A.weight` (down_proj); with
  one targeted it is `...mixer.experts.lora_A.weight`. `lora_A.weight` is `[E*r, in]` (expert-major rows:
  reshape `(E, r, in)`), `lora_B.weight` is `[out, r*E]` (expert-minor columns: reshape `(out, r, E)`), and the
  delta of expert e is `scale * B[:, :, e] @ A[e]` (`ParamWrapper.get_delta_weight`).
* `format="vllm"`: one module per expert, `...mixer.experts.{j}.up_proj.lora_A.weight` `[r, in]` etc. (the
  pre-fusion layout vLLM's nemotron_h LoRA loader reads; vLLM's own 3D loader assumes a gated gate_up_proj).

MTP layers (`mtp.layers.{k}...`): transformers drops `mtp.*` and vLLM skips it. `format="peft"` still writes
them (so our own round trip is lossless; peft ignores keys of modules the model lacks) and warns;
`format="vllm"` leaves them out and warns.

Mamba `out_proj`: peft refuses LoRA on `out_proj` / `conv1d` for `model_type: nemotron_h` (its fused Mamba
kernel reads `out_proj.weight` directly), so `PeftModel.from_pretrained` raises on such an adapter. Export
writes it (lossless) and, in format "peft", warns; vLLM reads it (format "vllm"); or serve it merged:
`nemo-jax export-hf BASE DST --adapters DIR`.
"""

from __future__ import annotations

import json
import math
import os
import re
import warnings
from collections import Counter, defaultdict
from dataclasses import dataclass

import numpy as np

from nemo_jax.fsutil import atomic_dir, read_json
from nemo_jax.hf.mapping import our_rows
from nemo_jax.model.spec import unflatten_paths

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PREFIX = "base_model.model."
EXPERT_PARAMS = ("up_proj", "down_proj")  # registration order in transformers' NemotronHExperts
from nemo_jax.config.train import PUBLISH_FORMATS as FORMATS  # noqa: E402  ("peft", "vllm")


class PeftFormatError(ValueError):
    """An adapter directory or adapter tree that does not fit the model."""


# --------------------------------------------------------------------------- the name map
@dataclass(frozen=True)
class Site:
    """One adapted matrix family: our adapter dict at `path` (index `index` into its stack) <-> HF `module`.

    Dense: module is the HF Linear (e.g. 'backbone.layers.3.mixer.q_proj'), in/out its dims.
    Experts: module is the fused expert module ('backbone.layers.1.mixer.experts'), `param` up_proj/down_proj,
    in/out the per-expert dims, `n_experts` E."""
    path: str
    index: tuple[int, ...]
    module: str
    d_in: int
    d_out: int
    param: str | None = None
    n_experts: int = 0
    runs: tuple = ()  # our output rows in HF order (`nemo_jax.hf.mapping.Entry.runs`): the grouped Mamba in_proj

    @property
    def key(self) -> str:
        """The name peft matches rank/alpha patterns against (module, or module.param for experts)."""
        return f"{self.module}.{self.param}" if self.param else self.module

    @property
    def mtp(self) -> bool:
        return self.module.startswith("mtp.")


def sites(cfg) -> dict[str, list[Site]]:
    """Adapter dict path -> its sites, one per layer of the stack (or one for an unstacked kernel)."""
    from nemo_jax.hf.mapping import build_table

    out: dict[str, list[Site]] = defaultdict(list)
    experts: dict[tuple[str, tuple[int, ...]], list] = {}
    for e in build_table(cfg):
        if e.transform != "T" or e.path.endswith("/gate/kernel"):  # the router is no nn.Linear in transformers
            continue
        if e.path.endswith("/kernel"):
            out_dim, in_dim = e.hf_shape
            out[e.path[: -len("/kernel")]].append(Site(e.path[: -len("/kernel")], e.index, e.hf_name[: -len(".weight")],
                                                         in_dim, out_dim, runs=e.runs))
        elif re.search(r"/experts/(up|down)_proj$", e.path):
            m = re.match(r"^(.*\.mixer\.experts)\.(\d+)\.(up_proj|down_proj)\.weight$", e.hf_name)
            if m is None:
                raise AssertionError(f"unexpected expert tensor name {e.hf_name!r} in the HF table")
            k = (e.path, e.index[:1])
            if k not in experts:
                experts[k] = [m.group(1), m.group(3), e.hf_shape, 0]
            experts[k][3] += 1
    for (path, index), (module, param, (out_dim, in_dim), n) in experts.items():
        out[path + "_lora"].append(Site(path + "_lora", index, module, in_dim, out_dim, param, n))
    for path, ss in out.items():  # stacked sites in stack order
        ss.sort(key=lambda s: s.index)
        if ss[0].index and [s.index[0] for s in ss] != list(range(len(ss))):
            raise AssertionError(f"HF table: layers of {path} are not a full stack")
    return dict(out)


def _canonical(module: str) -> str:
    """transformers >= 5 spells the backbone `model.`; the checkpoint (and vLLM) `backbone.`."""
    return "backbone." + module[len("model."):] if module.startswith("model.") else module


def _pattern_for(site: Site, any_expert: bool = False) -> str:
    """A peft rank/alpha pattern matching exactly this site under both the `backbone.` and `model.` spelling
    (`any_expert`: every per-expert module `<module>.<j>.<param>` of a fused site)."""
    key = site.key
    if key.startswith("backbone."):
        key = key[len("backbone."):]
        head = r"(backbone|model)\."
    else:
        head = ""
    if any_expert:
        return head + re.escape(key[: -len(site.param) - 1]) + r"\.\d+\." + re.escape(site.param)
    return head + re.escape(key)


def _pattern_lookup(patterns: dict, key: str, default):
    """peft's `get_pattern_key`: the first pattern p with re.match(rf'(.*\\.)?({p})$', key)."""
    for p, v in (patterns or {}).items():
        if re.match(rf"(.*\.)?({p})$", key):
            return v
    return default


def _denominator(r: int, rslora: bool) -> float:
    return math.sqrt(r) if rslora else float(r)


def _scale(alpha, r: int, rslora: bool) -> np.float32:
    """The fp32 scale peft's (alpha, r, use_rslora) stands for; export and import both use this expression."""
    return np.float32(float(alpha) / _denominator(r, rslora))


def _alpha_for(r: int, s: np.float32, rslora: bool, preferred=None):
    """An alpha whose `_scale` is exactly s (the configured alpha where it is, so configs read naturally)."""
    if preferred is not None and _scale(preferred, r, rslora) == s:
        return preferred
    alpha = float(s) * _denominator(r, rslora)
    if alpha == int(alpha) and abs(alpha) < 2**53:
        alpha = int(alpha)
    if _scale(alpha, r, rslora) != s:
        raise PeftFormatError(f"LoRA scale {float(s)!r} at rank {r} has no alpha that reproduces it exactly")
    return alpha


# --------------------------------------------------------------------------- adapter trees
def _group(adapters) -> dict[str, dict[str, np.ndarray]]:
    """Adapter tree -> {adapter dict path: {lora_a, lora_b, lora_scale} as host numpy arrays}."""
    import jax

    from nemo_jax.model.spec import path_str

    groups: dict[str, dict] = defaultdict(dict)
    for p, v in jax.tree_util.tree_flatten_with_path(adapters)[0]:
        s = path_str(p)
        head, _, leaf = s.rpartition("/")
        if leaf not in ("lora_a", "lora_b", "lora_scale"):
            raise PeftFormatError(f"adapter tree: unexpected leaf {s!r} (expected lora_a, lora_b, lora_scale)")
        groups[head][leaf] = np.asarray(jax.device_get(v))
    for head, g in groups.items():
        missing = {"lora_a", "lora_b", "lora_scale"} - set(g)
        if missing:
            raise PeftFormatError(f"adapter tree: {head} lacks {sorted(missing)}")
    return dict(groups)


def _check_group(path: str, g: dict, site_list: list[Site]):
    a, b, s = g["lora_a"], g["lora_b"], g["lora_scale"]
    s0 = site_list[0]
    lead = (len(site_list),) if site_list[0].index else ()
    lead_e = lead + ((s0.n_experts,) if s0.param else ())
    r = a.shape[-1] if a.ndim else 0
    want = {"lora_a": lead_e + (s0.d_in, r), "lora_b": lead_e + (r, s0.d_out), "lora_scale": lead}
    for k, shape in want.items():
        if tuple(g[k].shape) != shape:
            raise PeftFormatError(f"adapter {path}/{k}: shape {tuple(g[k].shape)}, the model implies {shape}")
    if r < 1:
        raise PeftFormatError(f"adapter {path}: rank 0")
    return a, b, s.astype(np.float32), r


# --------------------------------------------------------------------------- what a format can hold
def unservable(cfg, adapted_paths, format: str) -> dict[str, str]:
    """Adapted kernel paths (e.g. `nemo_jax.lora.selected_paths`) that an adapter directory in `format` cannot
    carry to its consumer -> {path: why}. peft: Mamba `out_proj` (peft refuses LoRA there for nemotron_h) and
    MTP layers (transformers drops them); vllm: MTP layers (vLLM skips `mtp.*` adapters)."""
    if format not in FORMATS:
        raise ValueError(f"format must be one of {FORMATS}, got {format!r}")
    out = {}
    for p in adapted_paths:
        if p.startswith("mtp/"):
            out[p] = "vLLM skips mtp.* adapters" if format == "vllm" else "transformers drops the MTP layers"
        elif format == "peft" and re.search(r"(^|/)layers/mamba/mixer/out_proj(/kernel)?$", p):
            out[p] = "peft refuses LoRA on Mamba out_proj for nemotron_h"
    return out


def check_servable(cfg, lora_config, format: str, what: str = "rollout.publish_format") -> None:
    """Refuse (one ValueError naming them) LoRA targets that adapter directories in `format` cannot hold."""
    from nemo_jax.lora.adapters import selected_paths

    bad = unservable(cfg, selected_paths(cfg, lora_config), format)
    if bad:
        why = "; ".join(sorted({f"{w} ({', '.join(p for p in bad if bad[p] == w)})" for w in bad.values()}))
        hint = f"use {what}=vllm, or " if format == "peft" and not any(p.startswith("mtp/") for p in bad) else ""
        raise ValueError(f"{what}={format} cannot hold the adapters on {len(bad)} target(s): {why}; {hint}leave "
                         "them out of lora.targets")


# --------------------------------------------------------------------------- export
def save_peft(cfg, adapters, path, *, format: str = "peft", base_model_name_or_path: str | None = None,
              lora_config=None, overwrite: bool = False) -> str:
    """Write `adapters` (our tree) as a PEFT adapter directory at `path` (atomically: temp dir + rename; an
    existing `path` is replaced only with `overwrite` and only when it is an earlier PEFT dir written here).

    format "peft": routed experts in peft's `target_parameters` form (transformers >= 5); "vllm": per-expert
    modules, MTP left out. `lora_config` (optional, with `.alpha` and `.rslora`) picks the alpha / rsLoRA
    spelling written where it reproduces the stored scales exactly; otherwise alpha = scale * r.
    Tensors keep their stored dtype. Returns the absolute path."""
    if format not in FORMATS:
        raise ValueError(f"format must be one of {FORMATS}, got {format!r}")
    from safetensors.numpy import save_file

    table = sites(cfg)
    groups = _group(adapters)
    if not groups:
        raise PeftFormatError("no adapters to export (the adapter tree is empty)")
    unknown = sorted(set(groups) - set(table))
    if unknown:
        raise PeftFormatError(f"adapter {unknown[0]!r} adapts no kernel of this model that has an HF name "
                              f"(adaptable: {', '.join(sorted(table)[:6])}, ...)")

    expert_params = sorted({s.param for p in groups for s in table[p] if s.param and not s.mtp},
                           key=EXPERT_PARAMS.index)
    mtp_expert_params = sorted({s.param for p in groups for s in table[p] if s.param and s.mtp},
                               key=EXPERT_PARAMS.index)
    if format == "peft" and mtp_expert_params and expert_params and mtp_expert_params != expert_params:
        raise PeftFormatError(f"routed-expert adapters on {expert_params} in the main layers but {mtp_expert_params} "
                              "in the MTP layers: peft's target_parameters naming needs the same set")
    targeted = expert_params or mtp_expert_params

    tensors: dict[str, np.ndarray] = {}
    scales: dict[tuple, tuple[int, np.float32]] = {}  # (site, expert or None) -> (r, scale)
    target_modules: set[str] = set()
    skipped_mtp, out_proj = [], []
    for apath in sorted(groups):
        site_list = table[apath]
        a, b, s, r = _check_group(apath, groups[apath], site_list)
        if any(x.mtp for x in site_list) and format == "vllm":
            skipped_mtp.append(apath)
            continue
        if format == "peft" and re.search(r"(^|/)layers/mamba/mixer/out_proj$", apath):
            out_proj.append(apath)  # (vLLM reads it: MambaMixer2.out_proj is a RowParallelLinear)
        for i, site in enumerate(site_list):
            idx = site.index[:1]
            ai, bi, si = a[idx], b[idx], s[idx]
            short = re.sub(r"^(backbone|mtp)\.layers\.\d+\.", "", site.module)
            if site.param is None:
                tensors[f"{PREFIX}{site.module}.lora_A.weight"] = np.ascontiguousarray(ai.T)
                tensors[f"{PREFIX}{site.module}.lora_B.weight"] = np.ascontiguousarray(bi.T[our_rows(site.runs, site.d_out)])
                scales[(site, None)] = (r, si)
                target_modules.add(short if format == "peft" else short.rsplit(".", 1)[-1])
            elif format == "peft":
                E = site.n_experts
                nest = ".base_layer" * (len(targeted) - 1 - targeted.index(site.param))
                stem = f"{PREFIX}{site.module}{nest}"
                tensors[f"{stem}.lora_A.weight"] = np.ascontiguousarray(ai.transpose(0, 2, 1).reshape(E * r, site.d_in))
                tensors[f"{stem}.lora_B.weight"] = np.ascontiguousarray(bi.transpose(2, 1, 0).reshape(site.d_out, r * E))
                scales[(site, None)] = (r, si)
            else:
                for j in range(site.n_experts):
                    m = f"{PREFIX}{site.module}.{j}.{site.param}"
                    tensors[f"{m}.lora_A.weight"] = np.ascontiguousarray(ai[j].T)
                    tensors[f"{m}.lora_B.weight"] = np.ascontiguousarray(bi[j].T)
                scales[(site, "*")] = (r, si)
                target_modules.add(site.param)
    if not tensors:
        raise PeftFormatError("nothing left to export: every adapter is on an MTP layer, which format 'vllm' omits")
    if skipped_mtp:
        warnings.warn(f"format 'vllm': left out {len(skipped_mtp)} MTP adapter(s) ({skipped_mtp[0]}, ...): vLLM "
                      "skips mtp.* (use format 'peft' to keep them in the file)", stacklevel=2)
    mtp_kept = [p for p in groups if p.startswith("mtp/") and p not in skipped_mtp]
    if mtp_kept:
        warnings.warn(f"{len(mtp_kept)} MTP adapter(s) ({sorted(mtp_kept)[0]}, ...) are written under mtp.layers.*: "
                      "transformers and vLLM drop the MTP layers, so only nemo-jax reads them back", stacklevel=2)
    if out_proj:
        warnings.warn(f"the adapters adapt Mamba out_proj ({', '.join(out_proj)}): peft refuses LoRA on out_proj for "
                      "nemotron_h (PeftModel.from_pretrained raises on this adapter). Serve these adapters merged: "
                      f"`nemo-jax export-hf BASE DST --adapters {os.fspath(path)}`, or train without out_proj",
                      stacklevel=2)

    rslora = bool(getattr(lora_config, "rslora", False))
    preferred = getattr(lora_config, "alpha", None)
    (r0, s0), _ = Counter(scales.values()).most_common(1)[0]
    if lora_config is not None and _scale(preferred, r0, rslora) != s0:
        rslora, preferred = False, None  # the given config does not describe these scales
    alpha0 = _alpha_for(r0, s0, rslora, preferred)
    rank_pattern, alpha_pattern = {}, {}
    for (site, expert), (r, s) in scales.items():
        if (r, s) == (r0, s0):
            continue
        pat = _pattern_for(site, any_expert=expert is not None)
        if r != r0:
            rank_pattern[pat] = r
        alpha = _alpha_for(r, s, rslora, preferred)
        if alpha != alpha0 or r != r0:
            alpha_pattern[pat] = alpha
    config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model_name_or_path,
        "r": r0, "lora_alpha": alpha0, "use_rslora": rslora, "lora_dropout": 0.0, "bias": "none",
        "fan_in_fan_out": False, "init_lora_weights": True, "inference_mode": True, "use_dora": False,
        "lora_bias": False, "modules_to_save": None, "layers_to_transform": None,
        # [] rather than None: peft fills None with its default modules for nemotron_h (q/k/v/o_proj)
        "target_modules": sorted(target_modules),
        "target_parameters": [f"mixer.experts.{p}" for p in targeted] if format == "peft" and targeted else None,
        "rank_pattern": rank_pattern, "alpha_pattern": alpha_pattern,
    }
    with atomic_dir(path, "PEFT adapter dir", overwrite=overwrite, own_files=(ADAPTER_WEIGHTS, ADAPTER_CONFIG)) as tmp:
        save_file(tensors, os.path.join(tmp, ADAPTER_WEIGHTS), metadata={"format": "pt"})
        with open(os.path.join(tmp, ADAPTER_CONFIG), "w") as f:
            json.dump(config, f, indent=2)
    return os.path.abspath(path)


# --------------------------------------------------------------------------- import
_FUSED = re.compile(r"^(?P<module>.*\.mixer\.experts)(?P<nest>(\.base_layer)*)$")
_PER_EXPERT = re.compile(r"^(?P<module>.*\.mixer\.experts)\.(?P<j>\d+)\.(?P<param>up_proj|down_proj)$")


def read_peft_config(path) -> dict:
    fp = os.path.join(os.fspath(path), ADAPTER_CONFIG)
    conf = read_json(fp, f"no {ADAPTER_CONFIG} (not a PEFT adapter directory)", error=PeftFormatError,
                     where=os.fspath(path))
    if conf.get("peft_type", "LORA") != "LORA":
        raise PeftFormatError(f"{fp}: peft_type {conf.get('peft_type')!r}, only LORA adapters are supported")
    for k in ("use_dora", "lora_bias"):
        if conf.get(k):
            raise PeftFormatError(f"{fp}: {k}=true is not supported")
    if conf.get("bias", "none") != "none":
        raise PeftFormatError(f"{fp}: bias={conf['bias']!r} is not supported (only 'none')")
    if not isinstance(conf.get("r"), int) or conf["r"] < 1 or "lora_alpha" not in conf:
        raise PeftFormatError(f"{fp}: needs an integer r >= 1 and lora_alpha")
    return conf


def load_peft(path, cfg, *, dtype=None) -> dict:
    """Read a PEFT adapter directory (either format, either `backbone.`/`model.` spelling) -> our adapter tree
    of numpy arrays (stored dtype unless `dtype`; lora_scale fp32). Layers of a stack the file does not adapt
    get zero A and B (no change), as in peft."""
    from safetensors import SafetensorError, safe_open

    path = os.fspath(path)
    conf = read_peft_config(path)
    wfile = os.path.join(path, ADAPTER_WEIGHTS)
    if not os.path.exists(wfile):
        legacy = os.path.join(path, "adapter_model.bin")
        hint = " (adapter_model.bin is pickled and refused: re-save it with safetensors)" if os.path.exists(legacy) else ""
        raise FileNotFoundError(f"{path}: no {ADAPTER_WEIGHTS}{hint}")
    try:
        with safe_open(wfile, framework="np") as f:
            raw = {k: f.get_tensor(k) for k in f.keys()}
    except (SafetensorError, OSError) as e:
        raise PeftFormatError(f"{wfile}: corrupt or truncated safetensors file ({e})") from None

    r_default, alpha_default, rslora = conf["r"], conf["lora_alpha"], bool(conf.get("use_rslora", False))
    rank_pat, alpha_pat = conf.get("rank_pattern") or {}, conf.get("alpha_pattern") or {}
    tparams = conf.get("target_parameters") or []

    table = sites(cfg)
    dense = {s.module: s for ss in table.values() for s in ss if s.param is None}
    expert_sites = {(s.module, s.param): s for ss in table.values() for s in ss if s.param}

    def targeted_params(module: str) -> list[str]:
        names = {module, "model." + module[len("backbone."):]} if module.startswith("backbone.") else {module}
        return [p for p in EXPERT_PARAMS
                if any(f"{n}.{p}" == t or f"{n}.{p}".endswith("." + t) for n in names for t in tparams)]

    # (site) -> {"A": .., "B": ..} dense/fused; (site, j) per expert
    parts: dict[tuple, dict[str, tuple[str, np.ndarray]]] = defaultdict(dict)
    for name, x in raw.items():
        m = re.match(r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<ab>[AB])\.weight$", name)
        if m is None:
            raise PeftFormatError(f"{wfile}: tensor {name!r} is not a LoRA A/B weight this loader understands")
        module, ab = _canonical(m.group("module")), m.group("ab")
        if module in dense:
            key = (dense[module], None)
        elif (fm := _FUSED.match(module)) and any(k[0] == fm.group("module") for k in expert_sites):
            targeted = targeted_params(fm.group("module"))
            depth = len(fm.group("nest")) // len(".base_layer")
            if depth >= len(targeted):
                raise PeftFormatError(f"{wfile}: tensor {name!r}: fused expert adapter at nesting depth {depth}, but "
                                      f"{ADAPTER_CONFIG} target_parameters {tparams} target {len(targeted)} expert "
                                      "parameter(s) of this layer")
            key = (expert_sites[(fm.group("module"), targeted[len(targeted) - 1 - depth])], None)
        elif (pm := _PER_EXPERT.match(module)) and (pm.group("module"), pm.group("param")) in expert_sites:
            site = expert_sites[(pm.group("module"), pm.group("param"))]
            j = int(pm.group("j"))
            if j >= site.n_experts:
                raise PeftFormatError(f"{wfile}: tensor {name!r}: expert {j} but the model has {site.n_experts}")
            key = (site, j)
        else:
            raise PeftFormatError(f"{wfile}: tensor {name!r}: no module {module!r} in this model config")
        if ab in parts[key]:
            raise PeftFormatError(f"{wfile}: tensor {name!r} duplicates {parts[key][ab][0]!r}")
        parts[key][ab] = (name, x)

    def rank_alpha(site: Site, j) -> tuple[int, float]:
        k = site.key if j is None else f"{site.module}.{j}.{site.param}"
        keys = [k] + (["model." + k[len("backbone."):]] if k.startswith("backbone.") else [])
        r = next((v for kk in keys if (v := _pattern_lookup(rank_pat, kk, None)) is not None), r_default)
        a = next((v for kk in keys if (v := _pattern_lookup(alpha_pat, kk, None)) is not None), alpha_default)
        return r, a

    # per site: (A ours, B ours, scale) ; per-expert pieces are stacked
    per_site: dict[Site, tuple[np.ndarray, np.ndarray, np.float32]] = {}
    per_expert: dict[Site, dict[int, tuple]] = defaultdict(dict)
    for (site, j), ab in parts.items():
        for need in "AB":
            if need not in ab:
                other = next(iter(ab.values()))[0]
                raise PeftFormatError(f"{wfile}: {other!r} has no matching lora_{need}.weight")
        (na, A), (nb, B) = ab["A"], ab["B"]
        r, alpha = rank_alpha(site, j)
        fused = site.param is not None and j is None
        E = site.n_experts if fused else 1
        want_a, want_b = (r * E, site.d_in), (site.d_out, r * E)
        if tuple(A.shape) != want_a:
            raise PeftFormatError(f"{wfile}: tensor {na!r} has shape {list(A.shape)}, expected {list(want_a)} "
                                  f"(r={r}{f', {E} experts' if fused else ''}, in={site.d_in})")
        if tuple(B.shape) != want_b:
            raise PeftFormatError(f"{wfile}: tensor {nb!r} has shape {list(B.shape)}, expected {list(want_b)} "
                                  f"(out={site.d_out}, r={r}{f', {E} experts' if fused else ''})")
        s = _scale(alpha, r, rslora)
        if fused:
            per_site[site] = (A.reshape(E, r, site.d_in).transpose(0, 2, 1), B.reshape(site.d_out, r, E).transpose(2, 1, 0), s)
        elif j is None:
            per_site[site] = (A.T, B.T[:, np.argsort(our_rows(site.runs, site.d_out))], s)
        else:
            per_expert[site][j] = (A.T, B.T, s)
    for site, by_j in per_expert.items():
        if site in per_site:
            raise PeftFormatError(f"{wfile}: {site.module} has both fused and per-expert {site.param} adapters")
        missing = [j for j in range(site.n_experts) if j not in by_j]
        if missing:
            raise PeftFormatError(f"{wfile}: per-expert adapters of {site.module}.*.{site.param} lack expert(s) {missing}")
        ss = {v[2] for v in by_j.values()}
        if len(ss) != 1:
            raise PeftFormatError(f"{wfile}: experts of {site.module}.*.{site.param} have different LoRA scales; "
                                  "nemo-jax keeps one scale per layer")
        ranks = {v[0].shape[-1] for v in by_j.values()}
        if len(ranks) != 1:
            raise PeftFormatError(f"{wfile}: experts of {site.module}.*.{site.param} have different ranks {sorted(ranks)}")
        per_site[site] = (np.stack([by_j[j][0] for j in range(site.n_experts)]),
                          np.stack([by_j[j][1] for j in range(site.n_experts)]), ss.pop())
    if not per_site:
        raise PeftFormatError(f"{wfile}: holds no LoRA tensors")

    flat: dict[str, np.ndarray] = {}
    for apath, site_list in table.items():
        present = [s for s in site_list if s in per_site]
        if not present:
            continue
        ranks = {per_site[s][0].shape[-1] for s in present}
        if len(ranks) != 1:
            raise PeftFormatError(f"{wfile}: the layers of {apath} have different ranks {sorted(ranks)}; a stacked "
                                  "adapter needs one rank")
        r = ranks.pop()
        dt = np.dtype(dtype) if dtype is not None else np.result_type(*[per_site[s][k].dtype for s in present for k in (0, 1)])
        A_parts, B_parts, S_parts = [], [], []
        for s in site_list:
            if s in per_site:
                a, b, sc = per_site[s]
            else:  # a layer the file does not adapt: zero delta
                lead = (s.n_experts,) if s.param else ()
                a, b = np.zeros(lead + (s.d_in, r), dt), np.zeros(lead + (r, s.d_out), dt)
                sc = _scale(rank_alpha(s, None)[1], r, rslora)
            A_parts.append(np.ascontiguousarray(a, dtype=dt))
            B_parts.append(np.ascontiguousarray(b, dtype=dt))
            S_parts.append(np.float32(sc))
        stacked = bool(site_list[0].index)
        flat[f"{apath}/lora_a"] = np.stack(A_parts) if stacked else A_parts[0]
        flat[f"{apath}/lora_b"] = np.stack(B_parts) if stacked else B_parts[0]
        flat[f"{apath}/lora_scale"] = np.array(S_parts, np.float32) if stacked else np.array(S_parts[0], np.float32)
    return unflatten_paths(flat)


def lora_config_of(path, adapters):
    """A `nemo_jax.lora.LoraConfig` describing an imported PEFT adapter (exact path regexes as targets)."""
    from nemo_jax.lora.adapters import LoraConfig

    conf = read_peft_config(path)
    if conf.get("rank_pattern"):
        raise PeftFormatError(f"{os.path.join(os.fspath(path), ADAPTER_CONFIG)}: rank_pattern {conf['rank_pattern']} "
                              "gives modules different ranks; a nemo-jax LoraConfig has one rank")
    targets = []
    for head in sorted(_group(adapters)):
        targets.append("^" + re.escape(head[: -len("_lora")] if head.endswith("_lora") else head + "/kernel") + "$")
    return LoraConfig(targets=tuple(targets), rank=conf["r"], alpha=conf["lora_alpha"],
                      rslora=bool(conf.get("use_rslora", False)))


# --------------------------------------------------------------------------- merged export
class MergedSource:
    """A region source (as `save_pretrained` reads: `paths`, `[path]` shape/dtype, `chunks`, `read`) that adds
    `sum_i weight_i * scale * A @ B` to every adapted leaf region in fp32; `save_pretrained` rounds each HF
    tensor once to its output dtype. `[path]` reports the base dtype, so exports keep the base's dtypes."""

    def __init__(self, base, cfg, adapter_sets: list[tuple[dict, float]]):
        from nemo_jax.hf.mapping import leaf_specs

        self.base = base
        specs = leaf_specs(cfg)
        self.loras: dict[str, list[tuple[dict, float]]] = defaultdict(list)
        for adapters, weight in adapter_sets:
            for head, g in _group(adapters).items():
                leaf = head[: -len("_lora")] if head.endswith("_lora") else head + "/kernel"
                if leaf not in specs:
                    raise PeftFormatError(f"adapter {head!r} adapts {leaf!r}, which this model does not have")
                want = tuple(specs[leaf].shape)
                got = tuple(g["lora_a"].shape[:-1]) + tuple(g["lora_b"].shape[-1:])
                if got != want or g["lora_a"].shape[-1] != g["lora_b"].shape[-2]:
                    raise PeftFormatError(f"adapter {head!r}: A {g['lora_a'].shape} @ B {g['lora_b'].shape} does not "
                                          f"give {leaf!r}'s shape {want}")
                self.loras[leaf].append((g, float(weight)))

    def paths(self):
        return self.base.paths()

    def __getitem__(self, path):
        return self.base[path]

    def chunks(self, path) -> tuple:
        return self.base.chunks(path)

    def read(self, path, region=()) -> np.ndarray:
        x = self.base.read(path, region)
        if path not in self.loras:
            return x
        ndim = len(self.base[path].shape)
        region = tuple(region) + (slice(None),) * (ndim - len(tuple(region)))
        lead, rows, cols = region[:-2], region[-2], region[-1]
        out = np.array(x, dtype=np.float32)  # a fresh fp32 copy
        for g, weight in self.loras[path]:
            a = g["lora_a"][lead + (rows, slice(None))].astype(np.float32)
            b = g["lora_b"][lead + (slice(None), cols)].astype(np.float32)
            d = np.matmul(a, b)
            s = g["lora_scale"].astype(np.float32)
            s = s[lead[0]] if s.ndim else s
            s = np.asarray(s, np.float32)
            out += np.float32(weight) * s.reshape(s.shape + (1,) * (d.ndim - s.ndim)) * d
        return out


def load_adapters_any(src, cfg) -> dict:
    """A PEFT directory (has adapter_config.json) or a nemo-jax adapter checkpoint / LoRA SFT run dir -> adapters."""
    src = os.fspath(src)
    if os.path.exists(os.path.join(src, ADAPTER_CONFIG)):
        return load_peft(src, cfg)
    from nemo_jax.lora.checkpoint import load_adapter_checkpoint

    acfg, _, adapters = load_adapter_checkpoint(src)
    check_adapters_fit(acfg, cfg, src)
    return adapters


def check_adapters_fit(acfg, cfg, where: str):
    """Adapters made for a model of config `acfg` fit one of config `cfg` (same leaves, same shapes)."""
    from nemo_jax.hf.mapping import leaf_specs

    mine, theirs = leaf_specs(cfg), leaf_specs(acfg)
    diff = sorted(k for k in set(mine) | set(theirs) if k not in mine or k not in theirs or mine[k].shape != theirs[k].shape)
    if diff:
        raise PeftFormatError(f"{where}: adapters belong to a model of another shape (differs at {diff[0]!r} and "
                              f"{len(diff) - 1} more parameters)")


def parse_adapter_arg(arg: str) -> tuple[str, float]:
    """'DIR' or 'DIR:WEIGHT' -> (dir, weight)."""
    head, sep, tail = arg.rpartition(":")
    if sep:
        try:
            return head, float(tail)
        except ValueError:
            pass
    return arg, 1.0
