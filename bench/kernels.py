"""Kernel micro-bench on an accelerator: causal GQA attention with packed segments, the routed experts' grouped
matmuls and Mamba-2's chunked SSD scan, forward + backward, each implementation side by side (TFLOP/s of the
useful work), to choose `nemo_jax.kernels`' defaults (the flash kernel's block sizes, the experts' grouped-matmul
implementation, the SSD kernel's chunk).

    python bench/kernels.py            # on the GPU host (attention 4 x 4096, 16 heads of 128; experts 65,536 rows;
                                       # SSD 4 x 4096, 48 heads of 64, state 128 in 8 groups: the device bench's layer)
    python bench/kernels.py --tiny     # toy sizes, Pallas in interpret mode (CPU: checks the script runs)
"""
import os, sys, time
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import common  # noqa: F401  (process settings before jax: a CPU host with a GPU plugin runs quietly on the CPU)
import jax, jax.numpy as jnp, numpy as np
from nemo_jax.model import attention as A
from nemo_jax.kernels import flash as F
from nemo_jax.kernels.attention import _rows, unrows
from nemo_jax.kernels.gmm import grouped_matmul
from nemo_jax.model.layers import relu2
tiny = "--tiny" in sys.argv
def timeit(f, *a, n=5):
    out = f(*a); jax.block_until_ready(out)
    out = f(*a); jax.block_until_ready(out)
    ts = []
    for _ in range(n):
        t = time.perf_counter(); jax.block_until_ready(f(*a)); ts.append(time.perf_counter() - t)
    return sorted(ts)[n // 2]
b, l, kv, r, hd = (1, 128, 2, 2, 32) if tiny else (4, 4096, 2, 8, 128)
k0 = jax.random.split(jax.random.key(0), 4)
dt = jnp.bfloat16
q = jax.random.normal(k0[0], (b, l, kv, r, hd), dt); kk = jax.random.normal(k0[1], (b, l, kv, hd), dt)
vv = jax.random.normal(k0[2], (b, l, kv, hd), dt)
seg = jnp.asarray(np.repeat(np.arange(1, 5), l // 4)[None].repeat(b, 0), jnp.int32)
pos = jnp.broadcast_to(jnp.arange(l, dtype=jnp.int32), (b, l))
flops = 4 * b * kv * r * l * l * hd / 2 * 3.5  # causal fwd + bwd (~2.5x fwd)
def grad_of(fn):
    return jax.jit(jax.grad(lambda q, k, v: jnp.sum(fn(q, k, v).astype(jnp.float32) ** 2), argnums=(0, 1, 2)))
res = {}
res["attn reference blocked (ckpt)"] = grad_of(lambda q, k, v: A._attend_blocked(q, k, v, seg, dt, 128, True))
res["attn reference blocked"] = grad_of(lambda q, k, v: A._attend_blocked(q, k, v, seg, dt, 128, False))
rep = lambda a: jnp.repeat(a, r, axis=1)
for bq, bk in ((64, 64), (128, 64), (64, 128), (128, 128), (32, 64)):
    res[f"attn flash bq={bq} bk={bk}"] = grad_of(lambda q, k, v, bq=bq, bk=bk: unrows(F.flash_attention(
        _rows(q), k, v, rep(pos), pos, rep(seg), seg, scale=hd ** -0.5, block_q=bq, block_k=bk, interpret=tiny)[0], r))
if not tiny:
    res["attn cudnn (no segments)"] = grad_of(lambda q, k, v: jax.nn.dot_product_attention(
        q.reshape(b, l, kv * r, hd), k, v, is_causal=True, implementation="cudnn").reshape(b, l, -1))
for name, f in res.items():
    try:
        t = timeit(f, q, kk, vv)
        print(f"{name:34s} {t*1e3:8.2f} ms  {flops/t/1e12:7.1f} TFLOP/s", flush=True)
    except Exception as e:
        print(f"{name:34s} failed: {type(e).__name__}: {str(e)[:200]}", flush=True)
# experts
E, D, I, T = (4, 64, 32, 256) if tiny else (16, 1536, 768, 65536)
x = jax.random.normal(k0[3], (T, D), dt) * 0.1
wu = jax.random.normal(k0[0], (E, D, I), dt) * 0.02; wd = jax.random.normal(k0[1], (E, I, D), dt) * 0.02
gs = jnp.full((E,), T // E, jnp.int32)
eflops = 2 * T * D * I * 2 * 3
def experts(impl):
    def f(x, wu, wd):
        u = grouped_matmul(x, wu, gs, impl, interpret=tiny, out_dtype=dt)
        return grouped_matmul(relu2(u), wd, gs, impl, interpret=tiny)
    return jax.jit(jax.grad(lambda x, wu, wd: jnp.sum(f(x, wu, wd) ** 2), argnums=(0, 1, 2)))
from nemo_jax.model import moe as M
def sorted_ref():
    start = jnp.arange(E, dtype=jnp.int32) * (T // E); rows = gs
    sizes = M.window_sizes(T, E)
    return jax.jit(jax.grad(lambda x, wu, wd: jnp.sum(M.sorted_experts(x, wu, wd, start, rows, sizes) ** 2), argnums=(0, 1, 2)))
for name, f in (("experts triton gmm", experts("triton")), ("experts ragged_dot", experts("ragged_dot")),
                ("experts reference sorted", sorted_ref())):
    try:
        t = timeit(f, x, wu, wd)
        print(f"{name:34s} {t*1e3:8.2f} ms  {eflops/t/1e12:7.1f} TFLOP/s", flush=True)
    except Exception as e:
        print(f"{name:34s} failed: {type(e).__name__}: {str(e)[:200]}", flush=True)
# Mamba-2 SSD scan: the Pallas kernel (this platform's: Triton on GPU, Mosaic on TPU) at several kernel chunks
# against the jnp chunked scan the model runs without it (kernels: reference), packed documents, fwd + bwd, fp32
from nemo_jax.kernels import ssd as SSD
from nemo_jax.model import mamba2
sb, sl, sh, sp, sg, sn = (1, 128, 4, 16, 2, 16) if tiny else (4, 4096, 48, 64, 8, 128)
ks = jax.random.split(jax.random.key(7), 5)
sx = jax.random.normal(ks[0], (sb, sl, sh, sp)); sdt = jax.nn.softplus(jax.random.normal(ks[1], (sb, sl, sh)) - 2)
sA = -jnp.exp(jax.random.normal(ks[2], (sh,)) * 0.3)
sB, sC = (jax.random.normal(k, (sb, sl, sg, sn)) for k in ks[3:])
sseg = jnp.asarray(np.repeat(np.arange(1, 5), sl // 4)[None].repeat(sb, 0), jnp.int32)
impl = "mosaic" if jax.default_backend() == "tpu" else "triton"
def ssd_grad(scan):
    loss = lambda out: jnp.sum(out[0] ** 2) + jnp.sum(out[1] ** 2)  # noqa: E731  (y and the final state)
    return jax.jit(jax.grad(lambda *a: loss(scan(*a)), argnums=(0, 1, 2, 3, 4)))
sflops = lambda cs: 2 * sb * sh * sl * (cs * (4 * sn + 3 * sp) + 7 * sp * sn)  # fwd + bwd (nemo_jax.plan.hlo)
srows = {"ssd jnp chunked (reference)": (ssd_grad(lambda *a: mamba2.ssd_chunked(*a, chunk_size=128, segment_ids=sseg)), 128)}
for cs in (32, 64, 128):
    srows[f"ssd pallas {impl} chunk={cs}"] = (ssd_grad(lambda *a, cs=cs: SSD.ssd_scan(
        *a, sseg, impl=impl, interpret=tiny, chunk=cs)), cs)
for name, (f, cs) in srows.items():
    try:
        t = timeit(f, sx, sdt, sA, sB, sC)
        print(f"{name:34s} {t*1e3:8.2f} ms  {sflops(cs)/t/1e12:7.1f} TFLOP/s", flush=True)
    except Exception as e:
        print(f"{name:34s} failed: {type(e).__name__}: {str(e)[:200]}", flush=True)
