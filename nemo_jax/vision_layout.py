"""Host-side image layout of the vision-language models (numpy only): where each image's patches, prefix tokens
and position-embedding taps sit in a row's vision sequence, and which sequence slots the pixel shuffle merges into
each language token. Shared by the data pipeline (`nemo_jax.data.images`) and the model (`nemo_jax.model.vision`),
so neither imports the other."""

from __future__ import annotations

import numpy as np

from nemo_jax.config.vision import VisionConfig

LAYOUT_KEYS = ("kind", "patch_src", "prefix_src", "pos_idx", "pos_w", "segment", "shuffle", "token_valid")


def bilinear_taps(n_in: int, n_out: int) -> tuple[np.ndarray, np.ndarray]:
    """torch's `F.interpolate(mode="bilinear", align_corners=False)` along one axis, n_in -> n_out:
    (indices [n_out, 2], weights [n_out, 2]) of the two source rows of each output row."""
    scale = n_in / n_out
    src = np.maximum((np.arange(n_out) + 0.5) * scale - 0.5, 0.0)
    i0 = np.minimum(np.floor(src).astype(np.int64), n_in - 1)
    i1 = np.minimum(i0 + 1, n_in - 1)
    frac = (src - i0).astype(np.float64)
    return np.stack([i0, i1], -1), np.stack([1 - frac, frac], -1)


def position_taps(v: VisionConfig, h: int, w: int) -> tuple[np.ndarray, np.ndarray]:
    """The position embedding of an h x w grid as 4 taps into the flattened [G*G] table per patch (row-major):
    RADIO resizes the G x G table to max(h, w) square (bilinear; up or down) and crops it to h x w."""
    g, side = v.max_grid, max(h, w)
    ri, rw = bilinear_taps(g, side)
    ci, cw = bilinear_taps(g, side)
    ri, rw, ci, cw = ri[:h], rw[:h], ci[:w], cw[:w]
    idx = ri[:, None, :, None] * g + ci[None, :, None, :]  # [h, w, 2, 2]
    wt = rw[:, None, :, None] * cw[None, :, None, :]
    return idx.reshape(h * w, 4).astype(np.int32), wt.reshape(h * w, 4).astype(np.float32)


def tokens_per_image(v: VisionConfig, grid_hw) -> list[int]:
    """Language tokens each image becomes (h * w / merge^2)."""
    return [int(h) * int(w) // v.merge ** 2 for h, w in np.asarray(grid_hw).reshape(-1, 2)]


def layout(v: VisionConfig, grid_hw, max_patches: int, max_images: int) -> dict[str, np.ndarray]:
    """Index arrays for one row holding images of `grid_hw` [n, 2] (their patches concatenated in
    `pixel_values`), padded to `max_patches` patches and `max_images` images:

    kind [S] (0 pad, 1 prefix token, 2 patch), patch_src [S], prefix_src [S], pos_idx / pos_w [S, 4],
    segment [S] (image number from 1; 0 pad), shuffle [N, merge^2] (the sequence slots merged into each
    language token, in transformers' pixel-shuffle order), token_valid [N];
    S = max_patches + max_images * n_prefix, N = max_patches // merge^2."""
    grid_hw = np.asarray(grid_hw, np.int64).reshape(-1, 2)
    m, npre = v.merge, v.n_prefix
    n_patches = int(grid_hw.prod(-1).sum()) if len(grid_hw) else 0
    if n_patches > max_patches or len(grid_hw) > max_images:
        raise ValueError(f"{len(grid_hw)} images of {n_patches} patches exceed the row budget of {max_images} images "
                         f"and {max_patches} patches")
    S, N = max_patches + max_images * npre, max_patches // m ** 2
    out = {"kind": np.zeros(S, np.int32), "patch_src": np.zeros(S, np.int32), "prefix_src": np.zeros(S, np.int32),
           "pos_idx": np.zeros((S, 4), np.int32), "pos_w": np.zeros((S, 4), np.float32),
           "segment": np.zeros(S, np.int32), "shuffle": np.zeros((N, m * m), np.int32),
           "token_valid": np.zeros(N, bool)}
    s = p = t = 0
    for i, (h, w) in enumerate(grid_hw.tolist()):
        if h % m or w % m:
            raise ValueError(f"image {i}: grid {h}x{w} is not a multiple of the pixel-shuffle merge {m}")
        out["kind"][s:s + npre] = 1
        out["prefix_src"][s:s + npre] = np.arange(npre)
        out["segment"][s:s + npre + h * w] = i + 1
        s += npre
        sl = slice(s, s + h * w)
        out["kind"][sl] = 2
        out["patch_src"][sl] = p + np.arange(h * w)
        out["pos_idx"][sl], out["pos_w"][sl] = position_taps(v, h, w)
        grid = (s + np.arange(h * w)).reshape(h // m, m, w // m, m)  # [y2, a, x2, b]
        n = h * w // m ** 2
        out["shuffle"][t:t + n] = grid.transpose(0, 2, 1, 3).reshape(n, m * m)
        out["token_valid"][t:t + n] = True
        s, p, t = s + h * w, p + h * w, t + n
    return out


def batch_layout(v: VisionConfig, rows_grid_hw: list, max_patches: int, max_images: int) -> dict[str, np.ndarray]:
    """`layout` for each row, stacked [B, ...]."""
    lays = [layout(v, g, max_patches, max_images) for g in rows_grid_hw]
    return {k: np.stack([lay[k] for lay in lays]) for k in LAYOUT_KEYS}


def pack_inputs(v: VisionConfig, tokens: np.ndarray, pixel_values, image_grid_hw, *, max_patches: int | None = None,
                max_images: int | None = None) -> dict[str, np.ndarray]:
    """transformers-style inputs (all images of the batch, in order: `pixel_values [P, C*p*p]`,
    `image_grid_hw [n, 2]`) -> the per-row image batch `encode` takes: {"pixel_values" [B, max_patches, C*p*p],
    **layout}. Images go to rows in order, each row taking as many as it has placeholder tokens for."""
    tokens = np.asarray(tokens)
    grid = np.asarray(image_grid_hw, np.int64).reshape(-1, 2)
    pix = np.asarray(pixel_values, np.float32)
    if pix.shape != (int(grid.prod(-1).sum()), v.patch_dim):
        raise ValueError(f"pixel_values has shape {pix.shape}; image_grid_hw describes "
                         f"{int(grid.prod(-1).sum())} patches of {v.patch_dim} values")
    per_image = tokens_per_image(v, grid)
    rows, img = [], 0
    for b, row in enumerate(tokens.reshape(tokens.shape[0], -1)):
        need, got = int((row == v.image_token_id).sum()), 0
        first = img
        while got < need and img < len(per_image):
            got += per_image[img]
            img += 1
        if got != need:
            raise ValueError(f"row {b}: {need} image placeholder tokens (id {v.image_token_id}) but the images "
                             f"given to it make {got}")
        rows.append((first, img))
    if img != len(per_image):
        raise ValueError(f"{len(per_image)} images given but the placeholders take {img}")
    offsets = np.concatenate([[0], np.cumsum(grid.prod(-1))])
    counts = [int(offsets[b] - offsets[a]) for a, b in rows]
    max_patches = max_patches or max(max(counts, default=0), v.merge ** 2)
    max_images = max_images or max(max((b - a for a, b in rows), default=0), 1)
    out = np.zeros((len(rows), max_patches, v.patch_dim), np.float32)
    for r, (a, b) in enumerate(rows):
        out[r, :counts[r]] = pix[offsets[a]:offsets[b]]
    lay = batch_layout(v, [grid[a:b] for a, b in rows], max_patches, max_images)
    return {"pixel_values": out, **lay}
