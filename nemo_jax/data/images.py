"""Image loading and preprocessing for the vision tower, in numpy and Pillow (no torch at run time).

Does what transformers' `NemotronH_Omni_Reasoning_V3ImageProcessor` does: pick a patch grid near the
image's own (scaled into [min_num_patches, max_num_patches], both sides multiples of the pixel-shuffle
merge), resize to it with antialiased bicubic on float pixels (Pillow's "F" mode resampler is the one
torchvision's antialiased bicubic was written to match), rescale by 1/255 and normalise with the CLIP
mean/std, and cut row-major patches, each laid out channel-major `(C, p, p)`.
"""

from __future__ import annotations

import base64
import dataclasses
import io
import math
import os
import stat

import numpy as np

from nemo_jax.config.vision import VisionConfig
from nemo_jax.vision_layout import layout


class ImageError(ValueError):
    """An image that cannot be read (names the file or the data URL)."""


def grid_size(height: int, width: int, patch_size: int, merge: int, min_patches: int, max_patches: int):
    """The (rows, cols) patch grid an image of height x width pixels is resized to."""
    gh, gw = round(height / patch_size + 0.5), round(width / patch_size + 0.5)
    factor = min(math.sqrt(max_patches / (gh * gw)), 1.0)
    gh, gw = math.floor(factor * gh), math.floor(factor * gw)
    if max_patches > min_patches and gh * gw < min_patches:
        factor = math.sqrt(min_patches / (gh * gw))
        gh, gw = math.ceil(factor * gh), math.ceil(factor * gw)
    if r := gh % merge:
        gh = gh + merge - r if (gh + merge - r) * gw <= max_patches else max(merge, gh - r)
    if r := gw % merge:
        gw = gw + merge - r if gh * (gw + merge - r) <= max_patches else max(merge, gw - r)
    return gh, gw


def patch_budget(v: VisionConfig, n_images: int, max_model_len: int = 16384) -> int:
    """The per-image patch cap the processor uses for a call with n_images images."""
    n = max((max_model_len - 4) * v.merge ** 2, v.min_num_patches * n_images)
    if v.max_num_patches:
        n = min(n, v.max_num_patches)
    return max(n, v.min_num_patches)


def image_grid(v: VisionConfig, height: int, width: int, n_images: int = 1) -> tuple[int, int]:
    """The patch grid of one of `n_images` images processed together (the processor's budget depends on n)."""
    return grid_size(height, width, v.patch_size, v.merge, v.min_num_patches, patch_budget(v, n_images))


MAX_IMAGE_PIXELS = 1 << 26  # 67M pixels (8192 x 8192): a larger picture is refused before it is decoded
MAX_IMAGE_BYTES = 1 << 28  # 256 MiB: a larger image file is refused before it is read


def read_image_file(path: str, max_bytes: int = MAX_IMAGE_BYTES) -> bytes:
    """The bytes of the image file `path`: a regular file of at most `max_bytes`, else ImageError naming it.
    Opened without blocking and checked on the open file, so a FIFO, socket or device (one that never ends)
    is refused at once, never read."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOCTTY", 0))
    except OSError as e:
        raise ImageError(f"{path}: cannot read image ({e.strerror or e})") from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ImageError(f"{path}: not a regular file (a FIFO, socket or device is never read as an image)")
        if st.st_size > max_bytes:
            raise ImageError(f"{path}: {st.st_size:,} bytes, more than the {max_bytes:,} an image may have")
        os.set_blocking(fd, True)
        data = f.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise ImageError(f"{path}: more than the {max_bytes:,} bytes an image may have (it grew while read)")
    return data


def open_image(data: bytes, name: str):
    """Encoded image bytes -> RGB PIL image; ImageError naming `name` for bytes that are no image, or a picture
    of more than MAX_IMAGE_PIXELS pixels (a decompression bomb: refused from its header, before decoding)."""
    import warnings

    from PIL import Image, UnidentifiedImageError

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            img = Image.open(io.BytesIO(data))
        w, h = img.size
        if w * h > MAX_IMAGE_PIXELS:
            raise ImageError(f"{name}: {w} x {h} pixels, more than the {MAX_IMAGE_PIXELS:,} an image may have")
        img.load()
    except ImageError:
        raise
    except Image.DecompressionBombError as e:
        raise ImageError(f"{name}: more pixels than an image may have ({e})") from None
    except (OSError, UnidentifiedImageError, ValueError, SyntaxError, EOFError) as e:  # corrupt or truncated
        raise ImageError(f"{name}: cannot read image ({e})") from None
    return img.convert("RGB")


def load_image(src: str, base_dir: str | None = None):
    """A path (relative to base_dir), `file://` URL or `data:image/...;base64,` URL -> RGB PIL image (ImageError
    naming it when it cannot be read; see `read_image_file` and `open_image` for what is refused)."""
    if src.startswith("data:"):
        head, _, payload = src.partition(",")
        if ";base64" not in head:
            raise ImageError(f"{head}: only base64 data URLs are supported")
        try:
            data = base64.b64decode(payload, validate=True)
        except ValueError as e:
            raise ImageError(f"{head}: cannot read image ({e})") from None
        return open_image(data, head)
    path = src[len("file://"):] if src.startswith("file://") else src
    if "://" in path:
        raise ImageError(f"{src}: remote images are not fetched; download them and give a local path")
    where = path if os.path.isabs(path) or base_dir is None else os.path.join(base_dir, path)
    try:
        return open_image(read_image_file(where), src)
    except ImageError as e:
        raise ImageError(str(e).replace(where, src, 1) if where != src else str(e)) from None


def _resize(x: np.ndarray, height: int, width: int) -> np.ndarray:
    """[H, W, C] float32 -> [height, width, C], antialiased bicubic per channel (Pillow, 32-bit float)."""
    from PIL import Image

    return np.stack([np.asarray(Image.fromarray(np.ascontiguousarray(x[..., c]), mode="F").resize(
        (width, height), Image.Resampling.BICUBIC)) for c in range(x.shape[-1])], -1)


def preprocess(images, v: VisionConfig, max_model_len: int = 16384) -> tuple[np.ndarray, np.ndarray]:
    """PIL images (or [H, W, C] uint8 arrays) -> (pixel_values [patches, C*p*p] float32, image_grid_hw [n, 2])."""
    p = v.patch_size
    budget = patch_budget(v, len(images), max_model_len)
    out, grids = [], []
    mean = np.asarray(v.norm_mean, np.float32) * 255.0
    std = np.asarray(v.norm_std, np.float32) * 255.0
    for img in images:
        x = np.asarray(img.convert("RGB") if hasattr(img, "convert") else img, np.float32)
        if x.ndim != 3 or x.shape[-1] != v.num_channels:
            raise ImageError(f"image of shape {x.shape}: expected [H, W, {v.num_channels}]")
        gh, gw = grid_size(x.shape[0], x.shape[1], p, v.merge, v.min_num_patches, budget)
        if x.shape[:2] != (gh * p, gw * p):
            x = _resize(x, gh * p, gw * p)
        x = (x - mean) / std
        patches = x.reshape(gh, p, gw, p, -1).transpose(0, 2, 4, 1, 3).reshape(gh * gw, -1)
        out.append(patches.astype(np.float32))
        grids.append((gh, gw))
    if not out:
        return np.zeros((0, v.patch_dim), np.float32), np.zeros((0, 2), np.int64)
    return np.concatenate(out), np.asarray(grids, np.int64)


def doc_grids(v: VisionConfig, doc) -> list[tuple[int, int]]:
    """The patch grid of each of a document's images (from their sizes in pixels)."""
    n = len(doc.image_hw)
    return [image_grid(v, h, w, n) for h, w in doc.image_hw]


def widen_image_tokens(v: VisionConfig, doc):
    """The document with each `<image>` token (v.image_token_id) repeated to its image's token count, loss
    mask off there."""
    if not doc.image_hw:
        return doc
    reps = np.ones(len(doc.ids), np.int64)
    reps[np.flatnonzero(doc.ids == v.image_token_id)] = [h * w // v.merge ** 2 for h, w in doc_grids(v, doc)]
    ids = np.repeat(doc.ids, reps)
    return dataclasses.replace(doc, ids=ids, mask=np.repeat(doc.mask, reps) & (ids != v.image_token_id))


class RowImages:
    """What the data loader does with images (picklable, for its worker processes): widen each document's
    `<image>` tokens to its images' token counts, and give each packed row its pixel patches and vision layout
    (`nemo_jax.model.vision.layout`) within a budget of `max_patches` patches and `max_images` images per row.
    An image that cannot be read raises naming it, or (`on_error: skip`) drops its document."""

    def __init__(self, v: VisionConfig, max_patches: int, max_images: int, on_error: str = "raise"):
        if max_patches < v.merge ** 2 or max_images < 1:
            raise ValueError(f"data.max_image_patches ({max_patches}) / data.max_images ({max_images}) leave no room "
                             "for an image")
        self.v, self.max_patches, self.max_images = v, max_patches, max_images
        self.on_error = on_error

    def grids(self, doc) -> list[tuple[int, int]]:
        return doc_grids(self.v, doc)

    def expand(self, doc):
        return widen_image_tokens(self.v, doc)

    def size(self, doc) -> tuple[int, int]:
        """(patches, images) a document puts in its row."""
        return sum(h * w for h, w in self.grids(doc)), len(doc.image_hw)

    def fits(self, doc) -> bool:
        patches, n = self.size(doc)
        return patches <= self.max_patches and n <= self.max_images

    def load(self, doc) -> tuple[np.ndarray, list] | None:
        """(pixel patches, grids) of a document's images, or None when one cannot be read and errors are skipped."""
        try:
            pix, grid = preprocess([load_image(r) for r in doc.images], self.v)
        except ImageError as e:
            if self.on_error == "skip":
                return None
            raise ImageError(f"data: {e}") from None
        if [tuple(g) for g in grid.tolist()] != self.grids(doc):
            raise ImageError(f"data: {doc.images[0][:80]}...: an image changed size since the data was prepared")
        return pix, grid.tolist()

    def row(self, loaded: list) -> dict[str, np.ndarray]:
        """The row arrays for the (pixels, grids) of its documents, in row order."""
        pix = np.zeros((self.max_patches, self.v.patch_dim), np.float32)
        grids, n = [], 0
        for p, g in loaded:
            pix[n:n + len(p)] = p
            n += len(p)
            grids += g
        return {"pixel_values": pix, **layout(self.v, np.asarray(grids, np.int64).reshape(-1, 2), self.max_patches,
                                             self.max_images)}


def image_hw(img) -> tuple[int, int]:
    """(height, width) in pixels of a PIL image or an [H, W, C] array."""
    return (img.size[1], img.size[0]) if hasattr(img, "getbbox") else tuple(np.asarray(img).shape[:2])


def picture(v: VisionConfig, src) -> tuple[np.ndarray, tuple[int, int]]:
    """One image (PIL image, [H, W, C] uint8 array, path, file:// or data URL), processed alone as the RL sampler
    and learner both see it -> (pixel patches [h*w, C*p*p] float32, its patch grid (h, w))."""
    pix, grid = preprocess([load_image(src) if isinstance(src, str) else src], v)
    return pix, (int(grid[0, 0]), int(grid[0, 1]))


def picture_tokens(v: VisionConfig, img) -> int:
    """Language tokens an image becomes when processed alone (`picture`)."""
    h, w = image_grid(v, *image_hw(img), 1)
    return h * w // v.merge ** 2
