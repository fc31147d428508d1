"""LoRA SFT: only adapters train and are checkpointed, exact resume, a bf16 frozen base, adapter checkpoints;
optimiser state sharded like the params."""

import json
import os

import jax
import numpy as np
import pytest

from nemo_jax.config.load import load_config
from nemo_jax.config.train import SFTConfig
from nemo_jax.lora import load_adapter_checkpoint
from nemo_jax.model.spec import flatten_with_paths
from nemo_jax.train.sft import Trainer

BASE = ["data.seq_len=64", "data.batch_size=4", "log_every=1", "eval_every=0", "data.eval=null",
        "checkpoint.async_save=false", "optim.warmup_steps=1", "model.config=tiny", "optim.lr=1e-2",
        "lora.targets=[all]", "lora.rank=4"]


def cfg_for(tmp, *extra):
    return load_config(SFTConfig, None, BASE + [f"run_dir={tmp}", *extra])


def losses(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [r["loss"] for r in map(json.loads, f) if "loss" in r]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    d = tmp_path_factory.mktemp("lora") / "run"
    tr = Trainer(cfg_for(d, "steps=4", "checkpoint.every=2"), quiet=True, devices=jax.devices()[:1])
    base_before = [np.asarray(x) for x in jax.tree.leaves(tr.frozen)]
    tr.run()
    return d, tr, base_before


@pytest.mark.slow
def test_only_adapters_train(trained):
    d, tr, base_before = trained
    flat = flatten_with_paths(tr.state.params)
    assert flat and all(k.split("/")[-1] in ("lora_a", "lora_b", "lora_scale") for k in flat)
    # the optimiser state mirrors the adapters, never the base
    n_adapter = sum(x.size for x in jax.tree.leaves(tr.state.params))
    n_opt = sum(x.size for x in jax.tree.leaves(tr.state.opt_state))
    assert n_opt <= 2 * n_adapter + 16
    # the base is untouched, the adapters moved (B starts at zero)
    for a, b in zip(base_before, jax.tree.leaves(tr.frozen)):
        np.testing.assert_array_equal(a, np.asarray(b))
    b = tr.state.params["layers"]["attention"]["mixer"]["q_proj"]["lora_b"]
    assert float(np.abs(np.asarray(b)).max()) > 0
    ls = losses(d)
    assert len(ls) == 4 and ls[-1] < ls[0]
    # the scale is a constant: unchanged after training at lr 1e-2, and the optimiser holds nothing for it
    scales = [np.asarray(x) for k, x in flat.items() if k.endswith("lora_scale")]
    assert scales and all(np.array_equal(x, np.full(x.shape, tr.lora_cfg.scale, np.float32)) for x in scales)
    assert not [k for k in flatten_with_paths(tr.state.opt_state) if "lora_scale" in k]


@pytest.mark.slow
def test_checkpoint_holds_adapters_and_resume_is_exact(trained, tmp_path):
    d, tr, _ = trained
    # the run checkpoint is small: adapters + their optimiser state, not the base
    state_dir = os.path.join(d, "checkpoints", "4", "state")
    size = sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(state_dir) for f in fs)
    base_bytes = sum(x.nbytes for x in jax.tree.leaves(tr.frozen))
    assert size < base_bytes
    # the standalone adapters equal the trained ones
    cfg, lcfg, adapters = load_adapter_checkpoint(str(d))
    assert lcfg.rank == 4 and cfg.pattern == tr.cfg.pattern
    for a, b in zip(jax.tree.leaves(adapters), jax.tree.leaves(tr.state.params)):
        np.testing.assert_array_equal(a, np.asarray(b))
    # a run stopped at step 2 and restarted ends where the uninterrupted run did
    r = tmp_path / "resumed"
    Trainer(cfg_for(r, "steps=2", "checkpoint.every=2"), quiet=True, devices=jax.devices()[:1]).run()
    t2 = Trainer(cfg_for(r, "steps=4", "checkpoint.every=2"), quiet=True, devices=jax.devices()[:1])
    t2.run()
    # to float rounding: the test processes' older XLA:CPU emitters (helpers.FAST_COMPILE) round a recompiled step
    # differently by an ulp or so (under XLA's default emitters the two are bit-equal), and Adam's normalised
    # update can grow an ulp in a near-zero gradient to ~1e-5 in one element; so each adapter is compared as a
    # whole (relative norm of the difference). A resume that lost any state (step count, optimiser moments, data
    # position) is off by orders of magnitude more
    np.testing.assert_allclose(losses(r), losses(d), rtol=1e-6)
    for a, b in zip(jax.tree.leaves(t2.state.params), jax.tree.leaves(tr.state.params)):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        assert np.linalg.norm(a - b) <= 1e-5 * np.linalg.norm(b) + 1e-7, np.linalg.norm(a - b) / np.linalg.norm(b)


@pytest.mark.slow
def test_bf16_base_and_sharded_adapters(tmp_path):
    tr = Trainer(cfg_for(tmp_path / "bf16", "steps=2", "lora.base_dtype=bfloat16", "mesh.fsdp=2", "mesh.tensor=2",
                         "mesh.expert=2", "data.batch_size=4"), quiet=True)
    assert all(x.dtype == jax.numpy.bfloat16 for x in jax.tree.leaves(tr.frozen))
    up_a = tr.state.params["layers"]["moe"]["mixer"]["experts"]["up_proj_lora"]["lora_a"]
    assert up_a.sharding.spec[1] == "expert"
    out = tr.run()
    assert np.isfinite(out["loss"])


def test_optimizer_state_sharded_like_params(tmp_path):
    """ZeRO-3: every Adam moment has its parameter's sharding (at fsdp=8: 1/8 of its bytes per device)."""
    tr = Trainer(load_config(SFTConfig, None, BASE[:-2] + [f"run_dir={tmp_path}", "steps=1", "mesh.fsdp=8",
                                                           "data.batch_size=8"]), quiet=True)
    params = flatten_with_paths(tr.state.params)
    opt = flatten_with_paths(tr.state.opt_state)
    moments = {k: v for k, v in opt.items() if any(k.endswith(p) for p in params)}
    assert len(moments) >= 2 * len(params)
    for k, v in moments.items():
        p = next(params[q] for q in params if k.endswith(q))
        assert v.sharding.is_equivalent_to(p.sharding, v.ndim), k
        if "fsdp" in str(p.sharding.spec):
            assert v.addressable_shards[0].data.nbytes * 8 == v.nbytes, k
    assert sum("fsdp" in str(p.sharding.spec) for p in params.values()) >= len(params) // 2
