"""The vision tower's share of the train step on the tiny vision-language config, measured side by side.

    python bench/vision.py [--config tiny-vl --seq 256 --batch 8 --max-image-patches 384 --max-images 6 --iters 10]

One batch of the shipped picture dataset (`tiny_vl_chat`, packed as `configs/sft/tiny-vl-cpu.yaml` packs it) is
timed through the jitted loss + gradients three ways: with its images (the tower, pixel shuffle and projector
run, forward and backward), with the tower frozen (`model.freeze_vision`: no gradient through it), and with
the same tokens but no images (the placeholders stay plain token embeddings). The tower's share of the step is
1 - t(no images) / t(images). Median of `--iters` steps after warm-up.
"""

import argparse

import common
import jax
import numpy as np

from nemo_jax.config.model import NemotronHConfig
from nemo_jax.data.chat import ChatTokenizer, read_chat_jsonl
from nemo_jax.data.images import RowImages
from nemo_jax.data.loader import PackedIterator
from nemo_jax.model import Options, init
from nemo_jax.model.vision import LAYOUT_KEYS
from nemo_jax.train.sft import model_config_path
from nemo_jax.train.step import token_loss


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="tiny-vl")
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--max-image-patches", type=int, default=384)
    ap.add_argument("--max-images", type=int, default=6)
    ap.add_argument("--iters", type=int, default=10)
    a = ap.parse_args()
    cfg = NemotronHConfig.from_file(model_config_path(a.config))
    tok = ChatTokenizer.load("builtin:tiny_vl")
    docs, _ = read_chat_jsonl("builtin:tiny_vl_chat/train.jsonl", tok, cfg.vocab_size)
    rows = RowImages(cfg.vision, a.max_image_patches, a.max_images)
    batch = next(PackedIterator(docs, a.seq, a.batch, seed=0, images=rows))
    batch = jax.device_put(batch)
    text_only = {k: v for k, v in batch.items() if k != "pixel_values" and k not in LAYOUT_KEYS}
    params = jax.jit(init, static_argnums=0)(cfg, jax.random.key(0))
    opts = Options()

    def grads(frozen: bool):
        def loss(p, b):
            if frozen:
                p = {**p, "vision": jax.lax.stop_gradient(p["vision"])}
            return token_loss(p, b, cfg, opts)[0]
        return jax.jit(jax.grad(loss))

    cases = [("images", grads(False), batch), ("images, tower frozen", grads(True), batch),
             ("same tokens, no images", grads(False), text_only)]
    times = {}
    for name, f, b in cases:
        run = lambda f=f, b=b: jax.block_until_ready(f(params, b))
        times[name] = common.timeit(run, warmup=2, iters=a.iters)
    n_img = int(batch["token_valid"].sum())
    patches = int((np.asarray(batch["kind"]) == 2).sum())
    print(f"{a.config}: batch {a.batch} x {a.seq} tokens, {n_img} image tokens from {patches} patches "
          f"(ViT sequence {batch['kind'].shape[1]} slots per row)")
    print(f"{'step (loss + gradients)':<28} {'ms':>8}")
    for name, t in times.items():
        print(f"{name:<28} {t * 1e3:8.1f}")
    base = times["same tokens, no images"]
    print(f"vision share of the step: {1 - base / times['images']:.1%} "
          f"(frozen tower: {1 - base / times['images, tower frozen']:.1%})")


if __name__ == "__main__":
    main()
