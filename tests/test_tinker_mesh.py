"""The Tinker API on a sharded server: `nemo-jax serve --tinker-root --mesh fsdp=4,tensor=2` on 8 host devices,
driven by the official SDK through the same checks tests/test_tinker.py runs on one device (imported from it: the
SL loop with step-0 logprobs equal to the unsharded model's within 1e-4, sampling, logprobs and importance
sampling, two clients at once, four clients batched equal to one at a time), against this module's sharded
server."""

import os

import jax
import pytest

pytest.importorskip("tinker", reason="the Tinker API tests drive the official SDK (pip install 'nemo_jax[tinker]')")
pytest.importorskip("fastapi", reason="nemo-jax serve needs fastapi + uvicorn")

from helpers import FAST_COMPILE  # noqa: E402
from test_tinker import BATCH, Server, _tiny_cfg, shared_checks  # noqa: E402

globals().update(shared_checks())  # test_tinker's SDK checks, against this module's `served`

MESH = ["--mesh", "fsdp=4,tensor=2", *BATCH]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """test_tinker's model and server, on a mesh of 8 host devices (its checks compare with the unsharded
    params, computed in this process on one device)."""
    from nemo_jax.data.chat import resolve
    from nemo_jax.hf.io import save_pretrained
    from nemo_jax.model import init

    tmp = tmp_path_factory.mktemp("tinker-mesh")
    cfg = _tiny_cfg(("full_attention", "mlp"))
    params = init(cfg, jax.random.key(0))
    hf = str(tmp / "tiny-hf")
    save_pretrained(cfg, params, hf, tokenizer_dir=resolve("builtin:tiny"))
    srv = Server(tmp, hf, str(tmp / "root"), extra=MESH,
                 env={"XLA_FLAGS": f"{FAST_COMPILE} --xla_force_host_platform_device_count=8"})
    srv.hf, srv.root, srv.cfg, srv.params, srv.tmp = hf, str(tmp / "root"), cfg, params, tmp
    try:
        yield srv
    finally:
        srv.close()


def test_the_learner_on_a_mesh_equals_one_device():
    """In-process: the Tinker learner over the base placed by the sharding rules on fsdp=4 x tensor=2 (held one
    layer at a time, the serving engine's copy the service shares; and stacked) and adapters placed by the same
    rules gives the unsharded learner's logprobs, loss and gradients (1e-5), with each device holding a quarter of
    the embedding or less, and gradients that stay sharded; so do two clients' batches run as one call
    (`run_many`)."""
    import numpy as np

    from nemo_jax.lora import LoraConfig, adapter_shardings
    from nemo_jax.model import init
    from nemo_jax.model.model import stack_layers, unstack_layers
    from nemo_jax.model.spec import param_specs
    from nemo_jax.parallel.mesh import make_mesh
    from nemo_jax.parallel.rules import param_shardings
    from nemo_jax.tinker.learner import Learner, new_adapters

    cfg = _tiny_cfg(("linear_attention", "full_attention", "moe"))
    params = init(cfg, jax.random.key(0))
    mesh = make_mesh({"fsdp": 4, "tensor": 2})
    sharded = jax.device_put(params, param_shardings(param_specs(cfg), mesh))
    lora = LoraConfig(rank=8, targets=("all",))
    ad = jax.tree.map(lambda x: x + 0.01, new_adapters(cfg, lora))
    rng = np.random.default_rng(0)
    rows = [{"tokens": rng.integers(3, 500, n), "targets": rng.integers(3, 500, n), "weights": rng.random(n)}
            for n in (12, 30, 7)]
    one = Learner(cfg, params).run(ad, rows, "cross_entropy", {}, backward=True)
    mesh_ad = jax.device_put(ad, adapter_shardings(cfg, lora, mesh))
    # the service's base: the serving engine's own per-layer copy (no stacked second copy); and a stacked one
    for base in (jax.jit(unstack_layers)(sharded), stack_layers(jax.jit(unstack_layers)(sharded))):
        got = Learner(cfg, base).run(mesh_ad, rows, "cross_entropy", {}, backward=True)
        for a, b in zip(one[0], got[0]):
            np.testing.assert_allclose(a, b, atol=1e-5)
        np.testing.assert_allclose(one[1], got[1], rtol=1e-5)
        assert jax.tree.structure(got[2]) == jax.tree.structure(one[2])  # (gradients of the stacked adapters)
        for a, b in zip(jax.tree.leaves(one[2]), jax.tree.leaves(got[2])):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)
    emb = sharded["embeddings"]["embedding"]
    assert emb.addressable_shards[0].data.size * 4 <= emb.size
    assert any(len(set(x.sharding.spec) - {None}) for x in jax.tree.leaves(got[2]) if hasattr(x.sharding, "spec"))
    # two clients' batches as one call on the mesh (`run_many`): each as the unsharded learner gives it alone
    ad2 = jax.tree.map(lambda x: x - 0.02, ad)
    rows2 = [{k: v[::-1].copy() for k, v in r.items()} for r in rows[:2]]
    many = Learner(cfg, jax.jit(unstack_layers)(sharded)).run_many(
        [(mesh_ad, rows), (jax.device_put(ad2, adapter_shardings(cfg, lora, mesh)), rows2)], "cross_entropy", {},
        backward=True)
    for want, got in zip((one, Learner(cfg, params).run(ad2, rows2, "cross_entropy", {}, backward=True)), many):
        for a, b in zip(want[0], got[0]):
            np.testing.assert_allclose(a, b, atol=1e-5)
        np.testing.assert_allclose(want[1], got[1], rtol=1e-5)
        for a, b in zip(jax.tree.leaves(want[2]), jax.tree.leaves(got[2])):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)
