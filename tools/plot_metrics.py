"""Write PNG curves of a run's metrics.jsonl (loss, eval_loss, grad_norm, lr, tokens_per_sec, ...).

    python tools/plot_metrics.py RUN_DIR [--keys loss,eval_loss]  ->  RUN_DIR/plots/<key>.png

Self-contained (numpy + zlib): no plotting library needed.
"""

import argparse
import json
import os
import struct
import zlib

import numpy as np

W, H, M = 640, 360, 40
# 5x7 digits for axis labels
FONT = {c: [int(r, 2) for r in rows.split()] for c, rows in {
    "0": "01110 10001 10011 10101 11001 10001 01110", "1": "00100 01100 00100 00100 00100 00100 01110",
    "2": "01110 10001 00001 00010 00100 01000 11111", "3": "11110 00001 00001 01110 00001 00001 11110",
    "4": "00010 00110 01010 10010 11111 00010 00010", "5": "11111 10000 11110 00001 00001 10001 01110",
    "6": "00110 01000 10000 11110 10001 10001 01110", "7": "11111 00001 00010 00100 01000 01000 01000",
    "8": "01110 10001 10001 01110 10001 10001 01110", "9": "01110 10001 10001 01111 00001 00010 01100",
    ".": "00000 00000 00000 00000 00000 01100 01100", "-": "00000 00000 00000 11111 00000 00000 00000",
    "e": "00000 00000 01110 10001 11111 10000 01110", "+": "00000 00100 00100 11111 00100 00100 00000"}.items()}


def png(path, img):
    raw = b"".join(b"\x00" + img[y].tobytes() for y in range(img.shape[0]))

    def chunk(t, d):
        return struct.pack(">I", len(d)) + t + d + struct.pack(">I", zlib.crc32(t + d) & 0xFFFFFFFF)

    hdr = struct.pack(">IIBBBBB", img.shape[1], img.shape[0], 8, 2, 0, 0, 0)
    with open(path, "wb") as f:
        f.write(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", hdr) + chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b""))


def text(img, x, y, s, color=(0, 0, 0)):
    for c in s:
        for r, bits in enumerate(FONT.get(c, [0] * 7)):
            for b in range(5):
                if bits >> (4 - b) & 1 and 0 <= y + r < img.shape[0] and 0 <= x + b < img.shape[1]:
                    img[y + r, x + b] = color
        x += 6


def line(img, x0, y0, x1, y1, color):
    n = int(max(abs(x1 - x0), abs(y1 - y0), 1))
    for t in np.linspace(0, 1, n + 1):
        x, y = int(round(x0 + (x1 - x0) * t)), int(round(y0 + (y1 - y0) * t))
        img[max(0, y - 1):y + 1, max(0, x - 1):x + 1] = color


def plot(xs, ys, path):
    img = np.full((H, W, 3), 255, np.uint8)
    img[H - M, M:W - M] = 0
    img[M:H - M, M] = 0
    x0, x1 = min(xs), max(xs) if max(xs) > min(xs) else min(xs) + 1
    y0, y1 = min(ys), max(ys) if max(ys) > min(ys) else min(ys) + 1
    px = lambda x: M + (x - x0) / (x1 - x0) * (W - 2 * M)
    py = lambda y: H - M - (y - y0) / (y1 - y0) * (H - 2 * M)
    for (a, b), (c, d) in zip(zip(xs, ys), list(zip(xs, ys))[1:]):
        line(img, px(a), py(b), px(c), py(d), (31, 119, 180))
    text(img, 2, M - 10, f"{y1:.3g}")
    text(img, 2, H - M - 3, f"{y0:.3g}")
    text(img, M, H - M + 8, f"{x0:g}")
    text(img, W - M - 30, H - M + 8, f"{x1:g}")
    png(path, img)


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("run_dir")
    ap.add_argument("--keys", default=None, help="comma-separated metric names (default: all scalar ones)")
    a = ap.parse_args(argv)
    path = os.path.join(a.run_dir, "metrics.jsonl")
    if not os.path.exists(path):
        raise SystemExit(f"{path}: no metrics.jsonl in the run directory")
    series: dict[str, list] = {}
    with open(path) as f:
        for n, line_ in enumerate(f, 1):
            try:
                rec = json.loads(line_)
            except json.JSONDecodeError:
                raise SystemExit(f"{path}:{n}: not valid JSON") from None
            for k, v in rec.items():
                if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool):
                    series.setdefault(k, []).append((rec["step"], v))
    keys = a.keys.split(",") if a.keys else sorted(series)
    out = os.path.join(a.run_dir, "plots")
    os.makedirs(out, exist_ok=True)
    for k in keys:
        if k not in series:
            raise SystemExit(f"{path}: no metric {k!r} (have {', '.join(sorted(series))})")
        xs, ys = zip(*series[k])
        plot(list(xs), list(ys), os.path.join(out, f"{k}.png"))
        print(os.path.join(out, f"{k}.png"))


if __name__ == "__main__":
    main()
