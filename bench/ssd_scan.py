"""Chunked SSD scan vs the sequential recurrence (ours) and vs transformers' torch chunk scan.

Forward+backward, fp32, B=1, L=2048, H=16, P=64, N=128, G=2, chunk 128 (override with --L etc.).
    python bench/ssd_scan.py
"""

import argparse

import common  # noqa: F401  (sys.path)
import jax
import jax.numpy as jnp
import numpy as np

from nemo_jax.model import mamba2


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--B", type=int, default=1)
    ap.add_argument("--L", type=int, default=2048)
    ap.add_argument("--H", type=int, default=16)
    ap.add_argument("--P", type=int, default=64)
    ap.add_argument("--N", type=int, default=128)
    ap.add_argument("--G", type=int, default=2)
    ap.add_argument("--chunk", type=int, default=128)
    ap.add_argument("--iters", type=int, default=5)
    a = ap.parse_args()
    B, L, H, P, N, G = a.B, a.L, a.H, a.P, a.N, a.G
    ks = jax.random.split(jax.random.key(0), 5)
    x = jax.random.normal(ks[0], (B, L, H, P))
    dt = jax.nn.softplus(jax.random.normal(ks[1], (B, L, H)) - 2)
    A = -jnp.exp(jax.random.normal(ks[2], (H,)) * 0.3)
    Bm = jax.random.normal(ks[3], (B, L, G, N))
    Cm = jax.random.normal(ks[4], (B, L, G, N))

    def loss(fn):
        return lambda *args: jnp.sum(fn(*args)[0] ** 2)

    chunked = jax.jit(jax.value_and_grad(loss(lambda *z: mamba2.ssd_chunked(*z, chunk_size=a.chunk)), argnums=(0, 1, 3, 4)))
    seq = jax.jit(jax.value_and_grad(loss(mamba2.ssd_sequential), argnums=(0, 1, 3, 4)))
    args = (x, dt, A, Bm, Cm)
    rows = []
    for name, f in (("ours: chunked SSD", chunked), ("ours: sequential recurrence", seq)):
        st = common.compiled_stats(f, *args)
        t = common.timeit(lambda: jax.block_until_ready(f(*args)), iters=a.iters)
        rows.append({"path": name, "fwd+bwd ms": f"{t * 1e3:.1f}", "temp": common.mib(st["temp_bytes"])})
    t_ours = float(rows[0]["fwd+bwd ms"])
    try:
        import torch
        from transformers.models.nemotron_h import modeling_nemotron_h as hf

        torch.set_num_threads(max(1, torch.get_num_threads()))
        tx = [torch.tensor(np.asarray(v), requires_grad=True) for v in (x, dt, Bm, Cm)]
        tA = torch.tensor(np.asarray(A))

        def torch_step():
            y = hf.mamba2_chunk_scan(tx[0], tx[1], tA, tx[2], tx[3], chunk_size=a.chunk)
            (y ** 2).sum().backward()
            for t in tx:
                t.grad = None

        tt = common.timeit(torch_step, iters=a.iters)
        rows.append({"path": "transformers torch chunk scan", "fwd+bwd ms": f"{tt * 1e3:.1f}", "temp": "n/a"})
        ratio = f"{t_ours / (tt * 1e3):.2f}x"
    except ImportError:
        ratio = "n/a (torch/transformers not installed)"
    print(f"SSD scan fwd+bwd, fp32, B={B} L={L} H={H} P={P} N={N} G={G} chunk={a.chunk}, {jax.devices()[0].device_kind}")
    common.table(rows)
    print(f"ours chunked / sequential time: {t_ours / float(rows[1]['fwd+bwd ms']):.3f}x")
    print(f"ours chunked / transformers torch time: {ratio}  (goal <= 1.0x)")


if __name__ == "__main__":
    main()
