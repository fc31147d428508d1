"""Loader bench: tokens/s delivered, start-up time vs dataset size, packing efficiency (FFD vs greedy).

    python bench/data.py                       # synthetic 100 MB and 1 GB prepared datasets under --dir
    python bench/data.py --sizes-mb 100,1000 --workers 0,2 --seq-len 4096 --rows 8

The datasets are written once (ArrayRecord shards + manifest, as `nemo-jax data prepare` writes them) with
long-tailed (lognormal) document lengths, some longer than a row; later runs reuse them. Start-up = building
the reader and the iterator and getting the first batch, in a fresh process each time (nothing cached).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

from nemo_jax.data.chat import Document  # noqa: E402
from nemo_jax.data.prepared import MANIFEST, ShardWriter, is_prepared, write_manifest  # noqa: E402

DOCS_PER_SHARD = 20_000


def make_dataset(out: str, megabytes: int, seed: int = 0, vocab: int = 131072) -> dict:
    """A prepared dataset of ~`megabytes` of records: lengths 2 + lognormal(6.2, 1.0) tokens (median ~500, a
    tail past 8k), loss on the second half of each document."""
    if is_prepared(out):
        with open(os.path.join(out, MANIFEST)) as f:
            return json.load(f)
    rng = np.random.default_rng(seed)
    os.makedirs(os.path.join(out, "shards"), exist_ok=True)
    shards, written, k = [], 0, 0
    while written < megabytes << 20:
        w = ShardWriter(out, f"synthetic-{k:05d}")
        lengths = np.minimum(2 + rng.lognormal(6.2, 1.0, DOCS_PER_SHARD).astype(int), 65536)
        ids = rng.integers(0, vocab, int(lengths.sum()), dtype=np.int32)
        at = 0
        for n in lengths:
            w.add(Document(ids[at:at + n], np.arange(n) >= n // 2))
            at += n
            written += 5 * int(n) + 8
            if written >= megabytes << 20:
                break
        shards.append(w.finish())
        k += 1
    return write_manifest(out, shards, "synthetic", vocab)


def startup(path: str, seq_len: int, rows: int) -> float:
    """Seconds from nothing to the first batch, in a fresh process (imports excluded)."""
    code = (f"import sys, time; sys.path.insert(0, {os.path.dirname(os.path.dirname(os.path.abspath(__file__)))!r})\n"
            "from nemo_jax.data.prepared import PreparedDocuments\nfrom nemo_jax.data.loader import PackedIterator\n"
            f"t = time.perf_counter(); it = PackedIterator(PreparedDocuments([{path!r}]), {seq_len}, {rows}, 0)\n"
            "next(it); print(time.perf_counter() - t)")
    return float(subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
                 .stdout.split()[-1])


def throughput(path: str, seq_len: int, rows: int, workers: int, batches: int) -> tuple[float, float]:
    """(real tokens per second delivered, packing efficiency) over `batches` batches after the first."""
    from nemo_jax.data.loader import PackedIterator
    from nemo_jax.data.prepared import PreparedDocuments

    it = PackedIterator(PreparedDocuments([path]), seq_len, rows, 0, workers=workers)
    next(it)
    t, real = time.perf_counter(), 0
    for _ in range(batches):
        real += int((next(it)["segment_ids"] > 0).sum())
    dt = time.perf_counter() - t
    it.close()
    return real / dt, real / (batches * rows * seq_len)


def packing(path: str, seq_len: int, rows: int, batches: int) -> dict:
    from nemo_jax.data.loader import PackedIterator
    from nemo_jax.data.prepared import PreparedDocuments

    out = {}
    for policy in ("ffd", "greedy"):
        it = PackedIterator(PreparedDocuments([path]), seq_len, rows, 0, packing=policy)
        real = sum(int((next(it)["segment_ids"] > 0).sum()) for _ in range(batches))
        out[policy] = real / (batches * rows * seq_len)
        it.close()
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default="/tmp/nemo_jax_bench_data")
    ap.add_argument("--sizes-mb", default="100,1000")
    ap.add_argument("--workers", default="0,2")
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--batches", type=int, default=30)
    a = ap.parse_args()
    sizes = [int(x) for x in a.sizes_mb.split(",")]
    paths = {}
    for mb in sizes:
        t = time.perf_counter()
        m = make_dataset(os.path.join(a.dir, f"synthetic_{mb}mb"), mb)
        paths[mb] = os.path.join(a.dir, f"synthetic_{mb}mb")
        print(f"{mb} MB: {m['documents']:,} documents, {m['tokens']:,} tokens, {len(m['shards'])} shards "
              f"(ready in {time.perf_counter() - t:.1f} s)")
    print("\n| dataset | start-up to first batch s |\n| --- | --- |")
    ups = {mb: min(startup(paths[mb], a.seq_len, a.rows) for _ in range(3)) for mb in sizes}
    for mb in sizes:
        print(f"| {mb} MB | {ups[mb]:.2f} |")
    print(f"start-up ratio {max(sizes)} MB / {min(sizes)} MB: {ups[max(sizes)] / ups[min(sizes)]:.2f}x (goal <= 2x)")
    big = paths[max(sizes)]
    print(f"\n| loader workers | tokens/s delivered (seq {a.seq_len} x {a.rows} rows) |\n| --- | --- |")
    for w in (int(x) for x in a.workers.split(",")):
        tps, _ = throughput(big, a.seq_len, a.rows, w, a.batches)
        print(f"| {w} | {tps:,.0f} |")
    eff = packing(big, a.seq_len, a.rows, a.batches)
    print(f"\npacking efficiency (real / row tokens), long-tailed lengths: ffd {eff['ffd']:.3f}, greedy "
          f"{eff['greedy']:.3f}")


if __name__ == "__main__":
    main()
