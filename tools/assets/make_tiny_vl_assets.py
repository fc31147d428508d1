"""Regenerate the embedded tiny vision-language assets (nemo_jax/assets): the `tiny_vl` tokenizer (the tiny
tokenizer plus the `<img>`, `</img>`, `<image>` tokens of nemotron_h_omni) and the `tiny_vl_chat` dataset of
generated pictures (one or two coloured shapes on a plain background, several sizes and aspect ratios) with
questions whose answers need the picture. The eval split is drawn from another seed. Deterministic.

    python tools/assets/make_tiny_vl_assets.py
"""

import json
import os
import random
import shutil

from PIL import Image, ImageDraw
from tokenizers import AddedToken, Tokenizer

ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "nemo_jax", "assets")
COLORS = {"red": (220, 30, 30), "green": (30, 170, 50), "blue": (40, 70, 220), "yellow": (235, 210, 20),
          "purple": (140, 40, 180), "black": (10, 10, 10)}
SHAPES = ("circle", "square", "triangle")
SIZES = ((64, 64), (48, 64), (64, 40), (80, 80), (56, 96))  # (height, width) in pixels
BACKGROUNDS = {"white": (250, 250, 250), "gray": (190, 190, 190)}


def picture(rng, path):
    """Draw one shape; -> (colour, shape, background, side) of what was drawn."""
    h, w = rng.choice(SIZES)
    bg = rng.choice(sorted(BACKGROUNDS))
    img = Image.new("RGB", (w, h), BACKGROUNDS[bg])
    d = ImageDraw.Draw(img)
    color, shape = rng.choice(sorted(COLORS)), rng.choice(SHAPES)
    r = rng.randint(min(h, w) // 5, min(h, w) // 3)
    left = rng.random() < 0.5
    cx = rng.randint(r, w // 2 - 1) if left else rng.randint(w // 2 + 1, w - r)
    cy = rng.randint(r, h - r)
    box = (cx - r, cy - r, cx + r, cy + r)
    if shape == "circle":
        d.ellipse(box, fill=COLORS[color])
    elif shape == "square":
        d.rectangle(box, fill=COLORS[color])
    else:
        d.polygon([(cx, cy - r), (cx - r, cy + r), (cx + r, cy + r)], fill=COLORS[color])
    img.save(path, optimize=True)
    return color, shape, bg, "left" if left else "right"


def qa(rng, info):
    color, shape, bg, side = info
    kind = rng.randrange(4)
    if kind == 0:
        return "What shape is in the image?", f"It is a {shape}."
    if kind == 1:
        return f"What color is the {shape}?", f"The {shape} is {color}."
    if kind == 2:
        return "Describe the image.", f"A {color} {shape} on a {bg} background."
    return "Is the shape on the left or the right?", f"The {shape} is on the {side}."


def record(rng, images_dir, n):
    """One conversation about one picture, or (one in four) comparing two."""
    names, infos = [], []
    for _ in range(2 if rng.random() < 0.25 else 1):
        name = f"img{n + len(names):05d}.png"
        infos.append(picture(rng, os.path.join(images_dir, name)))
        names.append(name)
    parts = [{"type": "image", "path": f"images/{name}"} for name in names]
    if len(names) == 2:
        (c1, s1, _, _), (c2, s2, _, _) = infos
        same = "Yes, both are" if c1 == c2 else f"No, the first is {c1} and the second is"
        q, a = "Are the two shapes the same color?", f"{same} {c2}."
    else:
        q, a = qa(rng, infos[0])
    msgs = [{"role": "user", "content": parts + [{"type": "text", "text": "\n" + q}]},
            {"role": "assistant", "content": a}]
    if len(names) == 1 and rng.random() < 0.5:  # a follow-up turn about the same picture
        q2, a2 = qa(rng, infos[0])
        msgs += [{"role": "user", "content": q2}, {"role": "assistant", "content": a2}]
    return {"messages": msgs}, len(names)


def main():
    src, dst = os.path.join(ROOT, "tiny"), os.path.join(ROOT, "tiny_vl")
    os.makedirs(dst, exist_ok=True)
    tok = Tokenizer.from_file(os.path.join(src, "tokenizer.json"))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in ("<img>", "</img>", "<image>")])
    assert tok.token_to_id("<image>") == 502, tok.token_to_id("<image>")
    tok.save(os.path.join(dst, "tokenizer.json"))
    shutil.copy(os.path.join(src, "tokenizer_config.json"), os.path.join(dst, "tokenizer_config.json"))
    data = os.path.join(ROOT, "tiny_vl_chat")
    shutil.rmtree(data, ignore_errors=True)
    os.makedirs(os.path.join(data, "images"))
    n = 0
    for split, seed, count in (("train", 0, 600), ("eval", 1, 64)):
        rng = random.Random(seed)
        with open(os.path.join(data, f"{split}.jsonl"), "w") as f:
            for _ in range(count):
                rec, k = record(rng, os.path.join(data, "images"), n)
                n += k
                f.write(json.dumps(rec) + "\n")
    print(f"wrote {dst} and {data} ({n} images)")


if __name__ == "__main__":
    main()
