"""The one declarative name/shape table between our parameter tree and HF `nemotron_h` tensors.

Each `Entry` says: HF tensor `hf_name` (HF shape `hf_shape`) is `ours[path][index]` after `transform`.
Loading reads the table forwards, saving backwards; nothing else knows HF names.

Transforms:  "id" same layout; "T" Linear `[out, in]` <-> kernel `[in, out]`; "conv" `[C, 1, K]` <-> `[K, C]`.

Row order: an entry's `runs` permute the HF tensor's rows (its first axis) into ours, piece by contiguous piece.
The Mamba in_proj and conv are stored grouped (`mamba_group_runs`), so that a tensor-parallel shard of whole
B/C groups holds every column its heads need; every other tensor keeps HF's order (no runs).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import jax
import numpy as np

from nemo_jax.model.mamba2 import group_widths
from nemo_jax.model.spec import ParamSpec, param_specs, path_str


@dataclass(frozen=True)
class Entry:
    hf_name: str
    path: str  # our leaf path, e.g. layers/moe/mixer/experts/up_proj
    index: tuple[int, ...]  # leading indices into our leaf (layer in stack, expert)
    transform: str  # "id" | "T" | "conv"
    hf_shape: tuple[int, ...]
    runs: tuple[tuple[int, int, int], ...] = ()  # (HF row, our row, count) in HF order; () = the same order

    def pieces(self, lo: int, hi: int, ours: bool = False) -> list[tuple[slice, slice]]:
        """HF rows [lo, hi) (`ours`: our rows [lo, hi)) -> their contiguous pieces [(HF rows, our rows)], in the
        order of the rows asked for."""
        if not self.runs:
            return [(slice(lo, hi), slice(lo, hi))]
        out = []
        for h, o, n in sorted(self.runs, key=lambda r: r[1] if ours else r[0]):
            start = o if ours else h
            a, b = max(lo, start), min(hi, start + n)
            if a < b:
                out.append((slice(h + a - start, h + b - start), slice(o + a - start, o + b - start)))
        return out


def our_rows(runs: tuple, n: int) -> np.ndarray:
    """For each of n HF rows, its row in our layout under `runs` (`x_hf = x_ours[our_rows(runs, n)]` along
    that axis; `x_ours = x_hf[np.argsort(...)]`)."""
    out = np.arange(n)
    for h, o, k in runs:
        out[h:h + k] = np.arange(o, o + k)
    return out


def transpose2d(x: np.ndarray, block: int = 256) -> np.ndarray:
    """A contiguous `x.T`, copied in cache-sized tiles over the raw bits (numpy's strided copy of
    ml_dtypes' bfloat16 runs at a fraction of memory speed)."""
    bits = x.view(np.dtype(f"u{x.dtype.itemsize}")) if x.dtype.itemsize in (1, 2, 4, 8) else x
    out = np.empty(x.shape[::-1], bits.dtype)
    for i in range(0, x.shape[0], block):
        for j in range(0, x.shape[1], block):
            out[j:j + block, i:i + block] = bits[i:i + block, j:j + block].T
    return out.view(x.dtype)


def to_hf_layout(x: np.ndarray, transform: str) -> np.ndarray:
    """Our layout -> HF's, contiguous: [in, out] -> [out, in]; conv [K, C] -> [C, 1, K]."""
    if transform == "T":
        return transpose2d(x)
    if transform == "conv":
        return transpose2d(x)[:, None, :]
    return x


def from_hf_layout(x: np.ndarray, transform: str) -> np.ndarray:
    """HF's layout -> ours, contiguous (inverse of `to_hf_layout`)."""
    if transform == "T":
        return transpose2d(x)
    if transform == "conv":
        return transpose2d(x[:, 0, :])
    return x


def mamba_group_runs(cfg, parts: tuple[str, ...]) -> tuple[tuple[int, int, int], ...]:
    """Runs from HF's part-major Mamba layout (`z|x|B|C|dt` for in_proj, `x|B|C` for the conv) to our
    group-major one: for each B/C group g its heads' z, x, then B_g, C_g and its heads' dt, so that a shard of
    whole groups is a contiguous block (the mixer then splits with no communication)."""
    G, width = cfg.n_groups, group_widths(cfg)
    per_group = sum(width[p] for p in parts)
    runs, hf = [], 0
    for part in parts:
        inside = sum(width[p] for p in parts[:parts.index(part)])
        for g in range(G):
            runs.append((hf, g * per_group + inside, width[part]))
            hf += width[part]
    return tuple(runs)


MAMBA_IN_PROJ_PARTS = ("z", "x", "B", "C", "dt")
MAMBA_CONV_PARTS = ("x", "B", "C")


def _runs_for(sub: str, cfg) -> tuple:
    """The row runs of a layer's leaf (sub-path inside the layer): the Mamba mixer's in_proj and conv."""
    if re.search(r"(^|/)mixer/in_proj/kernel$", sub):
        return mamba_group_runs(cfg, MAMBA_IN_PROJ_PARTS)
    if re.search(r"(^|/)mixer/conv1d/(kernel|bias)$", sub):
        return mamba_group_runs(cfg, MAMBA_CONV_PARTS)
    return ()


def hf_rows_from_ours(e: Entry, read, inner: tuple, block: tuple = ()) -> np.ndarray:
    """HF rows `block` (a slice of the HF tensor's first axis; () = all) of entry e in HF layout, from
    `read(region)` reads of our leaf (whose inner dims are `inner`): one read per piece the rows cross."""
    if not inner:
        return to_hf_layout(read(e.index), e.transform)
    axis = row_axis(e.transform, len(inner))
    lo, hi, _ = (block[0] if block else slice(None)).indices(inner[axis])
    parts = [to_hf_layout(read(e.index + (slice(None),) * axis + (ours,)), e.transform) for _, ours in e.pieces(lo, hi)]
    return parts[0] if len(parts) == 1 else np.concatenate(parts, axis=0)


def ours_from_hf(e: Entry, read_hf, inner: tuple, region: tuple = ()) -> np.ndarray:
    """Our-layout `region` (slices of our leaf's inner dims `inner`; () = all) of entry e, from
    `read_hf(slices of the HF tensor)` reads: one read per piece the region crosses."""
    if not inner:
        return from_hf_layout(read_hf(()), e.transform)
    region = tuple(region) + (slice(None),) * (len(inner) - len(tuple(region)))
    region = tuple(slice(*sl.indices(n)[:2]) for sl, n in zip(region, inner))
    axis = row_axis(e.transform, len(inner))
    parts = [from_hf_layout(read_hf(hf_slices(region[:axis] + (hf,) + region[axis + 1:], e.transform)), e.transform)
             for hf, _ in e.pieces(region[axis].start, region[axis].stop, ours=True)]
    return parts[0] if len(parts) == 1 else np.concatenate(parts, axis=axis)


def hf_slices(inner: tuple, transform: str) -> tuple:
    """Our inner-dims slices -> the same values' slices of the HF tensor (rows first)."""
    if transform == "T":
        return tuple(reversed(inner))
    if transform == "conv":
        return (inner[1], slice(None), inner[0])
    return inner


def row_axis(transform: str, inner_ndim: int) -> int:
    """The axis of our (inner) leaf layout that runs along the HF tensor's first axis, so that HF row blocks
    (contiguous on disk) are regions of ours: the last axis for transposed layouts, else the first."""
    return inner_ndim - 1 if transform in ("T", "conv") else 0


def _hf_leaf_name(sub: str) -> tuple[str, str]:
    """Our sub-path inside a layer (e.g. 'mixer/in_proj/kernel') -> (HF suffix, transform)."""
    parts = sub.split("/")
    last = parts[-1]
    if parts[-2:] == ["conv1d", "kernel"]:
        return ".".join(parts[:-1]) + ".weight", "conv"
    if parts[-2:] == ["gate", "correction_bias"]:
        return ".".join(parts[:-1]) + ".e_score_correction_bias", "id"
    if last == "kernel":
        return ".".join(parts[:-1]) + ".weight", "T"
    if last in ("scale", "embedding"):
        return ".".join(parts[:-1]) + ".weight", "id"
    return ".".join(parts), "id"


def _hf_shape(shape: tuple[int, ...], transform: str) -> tuple[int, ...]:
    if transform == "T":
        return tuple(reversed(shape))
    if transform == "conv":
        return (shape[1], 1, shape[0])
    return tuple(shape)


def _layer_entries(stacks: dict, kinds: tuple[str, ...], prefix: str, our_prefix: str, cfg, layer_offset: int = 0):
    out = []
    seen: dict[str, int] = {}
    for li, kind in enumerate(kinds):
        k = seen.get(kind, 0)
        seen[kind] = k + 1
        leaves = jax.tree_util.tree_flatten_with_path(stacks[kind], is_leaf=lambda x: isinstance(x, ParamSpec))[0]
        for p, spec in leaves:
            sub = path_str(p)
            ours = f"{our_prefix}/{kind}/{sub}"
            shape = spec.shape[1:]
            base = f"{prefix}.{li + layer_offset}."
            if sub.startswith("mixer/experts/"):
                proj = sub.split("/")[-1]
                for j in range(shape[0]):
                    out.append(Entry(f"{base}mixer.experts.{j}.{proj}.weight", ours, (k, j), "T", _hf_shape(shape[1:], "T")))
                continue
            suffix, tr = _hf_leaf_name(sub)
            out.append(Entry(base + suffix, ours, (k,), tr, _hf_shape(shape, tr), _runs_for(sub, cfg)))
    return out


def build_table(cfg) -> list[Entry]:
    """Every HF tensor of this config, in HF order (embeddings, layers, norm_f, lm_head, mtp; then, for an
    omni model, whose language model tensors sit under `language_model.`, the vision tower and projector)."""
    specs = param_specs(cfg)
    V, D = cfg.vocab_size, cfg.hidden_size
    lm = "language_model." if cfg.vision is not None else ""
    table = [Entry(f"{lm}backbone.embeddings.weight", "embeddings/embedding", (), "id", (V, D))]
    table += _layer_entries(specs["layers"], cfg.layer_kinds, f"{lm}backbone.layers", "layers", cfg)
    table.append(Entry(f"{lm}backbone.norm_f.weight", "norm_f/scale", (), "id", (D,)))
    table.append(Entry(f"{lm}lm_head.weight", "lm_head/kernel", (), "T", (V, D)))
    n = len(cfg.mtp_layer_kinds)
    for d in range(cfg.num_nextn_predict_layers):
        first, last = f"{lm}mtp.layers.{d * n}.", f"{lm}mtp.layers.{d * n + n - 1}."
        table.append(Entry(first + "enorm.weight", f"mtp/{d}/enorm/scale", (), "id", (D,)))
        table.append(Entry(first + "hnorm.weight", f"mtp/{d}/hnorm/scale", (), "id", (D,)))
        table.append(Entry(first + "eh_proj.weight", f"mtp/{d}/eh_proj/kernel", (), "T", (D, 2 * D)))
        table += _layer_entries(specs["mtp"][d]["layers"], cfg.mtp_layer_kinds, f"{lm}mtp.layers", f"mtp/{d}/layers",
                                cfg, d * n)
        table.append(Entry(last + "final_layernorm.weight", f"mtp/{d}/final_layernorm/scale", (), "id", (D,)))
    if cfg.vision is not None:
        table += _vision_entries(specs)
    return table


# the vision tower's HF names (transformers' save_pretrained writes the original RADIO names)
_RADIO = "vision_model.radio_model."
_VISION_NAMES = {
    "vision/embeddings/patch_projection/kernel": "model.patch_generator.embedder.weight",
    "vision/embeddings/video_patch_projection/kernel": "model.patch_generator.video_embedder.weight",
    "vision/embeddings/position_embedding": "model.patch_generator.pos_embed",
    "vision/embeddings/cls_register_token": "model.patch_generator.cls_token.token",
}
_OMNI_NAMES = {"vision/final_layernorm": "vision_final_layernorm", "projector/norm": "mlp1.0",
               "projector/linear_1": "mlp1.1", "projector/linear_2": "mlp1.3"}


def _vision_entries(specs: dict) -> list[Entry]:
    out = []
    flat = jax.tree_util.tree_flatten_with_path({"vision": specs["vision"], "projector": specs["projector"]},
                                                is_leaf=lambda x: isinstance(x, ParamSpec))[0]
    for p, spec in flat:
        ours = path_str(p)
        if ours in _VISION_NAMES:
            tr = "T" if ours.endswith("kernel") else "id"
            out.append(Entry(_RADIO + _VISION_NAMES[ours], ours, (), tr, _hf_shape(spec.shape, tr)))
        elif ours.startswith("vision/layers/"):
            suffix, tr = _hf_leaf_name(ours[len("vision/layers/"):])
            for i in range(spec.shape[0]):
                out.append(Entry(f"{_RADIO}model.blocks.{i}.{suffix}", ours, (i,), tr, _hf_shape(spec.shape[1:], tr)))
        else:
            module, leaf = ours.rsplit("/", 1)
            suffix, tr = _hf_leaf_name(leaf if leaf != "scale" else "norm/scale")
            out.append(Entry(f"{_OMNI_NAMES[module]}.{suffix.rsplit('.', 1)[-1]}", ours, (), tr,
                             _hf_shape(spec.shape, tr)))
    return out


def hf_constants(cfg) -> dict[str, np.ndarray]:
    """Non-parameter tensors an HF checkpoint of this config carries (buffers), written on export and
    checked on import: the RADIO summary token indices."""
    if cfg.vision is None:
        return {}
    return {_RADIO + "summary_idxs": np.asarray(cfg.vision.summary_idxs, np.int64)}


def hf_ignored(name: str) -> bool:
    """HF tensors that are not ours to read: the RADIO input conditioner (the image processor normalises)
    and an omni checkpoint's audio tower (not supported)."""
    return name.startswith((_RADIO + "input_conditioner.", "sound_encoder.", "sound_projection.", "audio_tower.",
                            "embed_audio."))


def leaf_specs(cfg) -> dict[str, ParamSpec]:
    """Our leaves by path."""
    flat = jax.tree_util.tree_flatten_with_path(param_specs(cfg), is_leaf=lambda x: isinstance(x, ParamSpec))[0]
    return {path_str(p): s for p, s in flat}
