"""How much of what a vision-language model's image tokens carry depends on the picture?

Renders N screens of the tiny GUI environment, runs them through the model's vision tower and projector, and
prints the mean norm of the image tokens the language model receives and the screen-dependent share of it
(mean over tokens of |x - mean over screens| / |x|). A tower and projector that still see report tens of percent;
one collapsed onto a constant vector reports ~1% (docs/grpo.md: the tiny GUI task).

    python tools/probes/vision_probe.py runs/tiny-vl-agent-cpu [--screens 64]
"""

import argparse

import jax.numpy as jnp
import numpy as np

from nemo_jax.data.images import preprocess
from nemo_jax.model.vision import encode, pack_inputs
from nemo_jax.rl.envs.gui import GUIEnv, Screen
from nemo_jax.sources import load_for_generation


def image_tokens(cfg, params, pictures) -> np.ndarray:
    """[N pictures] -> the language-side image tokens [N, tokens, D] (each picture alone, as the sampler sees it)."""
    v = cfg.vision
    out = []
    for img in pictures:
        pix, grid = preprocess([img], v)
        n = int(grid[0, 0] * grid[0, 1]) // v.merge ** 2
        batch = pack_inputs(v, np.full((1, n), v.image_token_id), pix, grid, max_patches=len(pix), max_images=1)
        out.append(np.asarray(encode(params, {k: jnp.asarray(x) for k, x in batch.items()}, cfg))[0, :n])
    return np.stack(out)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("ckpt", help="a VL model: native dir, HF dir or run dir")
    ap.add_argument("--screens", type=int, default=64)
    ap.add_argument("--seed", type=int, default=5)
    a = ap.parse_args()
    cfg, params, _ = load_for_generation(a.ckpt, dtype=jnp.float32)
    if cfg.vision is None:
        raise SystemExit(f"vision_probe: {a.ckpt} is a text model")
    env = GUIEnv(families=("click",), n_train=a.screens, n_eval=1, seed=a.seed, n_buttons=[1, 4])
    x = image_tokens(cfg, params, [Screen(t.data, env.size).render() for t in env.tasks("train")])
    norm = np.linalg.norm(x, axis=-1)
    share = np.linalg.norm(x - x.mean(0), axis=-1).mean() / norm.mean()
    print(f"{a.ckpt}: image-token norm {norm.mean():.3f}, screen-dependent share {share:.1%} "
          f"({a.screens} screens x {x.shape[1]} tokens)")


if __name__ == "__main__":
    main()
