"""`nemo-jax plan`: loop-aware FLOP counting against an unrolled compile, per-device bytes against the sharded
leaves, collectives, the JSON keys, and mesh search."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from nemo_jax.config.model import NemotronHConfig, parse_pattern
from nemo_jax.config.train import MeshSection, SFTConfig
from nemo_jax.model import Options, abstract_params
from nemo_jax.plan import hlo as H
from nemo_jax.plan.plan import DEVICE_KINDS, candidate_meshes, plan_sft, roofline
from nemo_jax.train.step import token_loss

H100 = DEVICE_KINDS["h100"]


def _cfg(pattern="MEM*E-MEM*E-"):
    return NemotronHConfig(vocab_size=512, hidden_size=128, layer_kinds=parse_pattern(pattern), num_attention_heads=4,
                           num_key_value_heads=2, head_dim=32, intermediate_size=256, mamba_num_heads=8,
                           mamba_head_dim=16, ssm_state_size=16, n_groups=2, chunk_size=32, n_routed_experts=8,
                           num_experts_per_tok=2, moe_intermediate_size=64, moe_shared_expert_intermediate_size=128)


def _device(target):
    """A device to compile for: the CPU, or one compile-only GPU / TPU device (skipped without its plugin)."""
    if target == "cpu":
        return jax.devices("cpu")[0]
    from nemo_jax.plan.targets import get_topology, plugin_installed

    if not plugin_installed(target):
        pytest.skip(f"the {target} plugin is not installed (nemo_jax[plan-{target}])")
    return get_topology(target, "h100" if target == "gpu" else "tpu-v5p", 1)[0]


def _on(tree, device):
    sh = jax.sharding.SingleDeviceSharding(device)
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh), tree)


@pytest.mark.parametrize("target", ["cpu", "gpu", "tpu"])
def test_loops_are_counted_by_trip_count(target):
    """A scanned program counts its body trip-count times: equal to XLA's own count of the unrolled program, on
    each backend's HLO (XLA:GPU's cuBLAS custom calls and async forms; libtpu's convolutions and loops without a
    trip-count annotation)."""
    def f(w, x, unroll):
        h, _ = jax.lax.scan(lambda h, wi: (jnp.tanh(h @ wi) * 2.0, None), x, w, unroll=unroll)
        return jnp.sum(h)

    dev = _device(target)
    w, x = _on((jax.ShapeDtypeStruct((6, 128, 128), jnp.float32), jax.ShapeDtypeStruct((32, 128), jnp.float32)), dev)
    scanned = jax.jit(lambda w, x: f(w, x, 1)).lower(w, x).compile()
    unrolled = jax.jit(lambda w, x: f(w, x, True)).lower(w, x).compile()
    assert " while(" in scanned.as_text() and " while(" not in unrolled.as_text()
    ours = H.analyse(scanned.as_text(), 1)
    assert ours.unknown_trip_counts == 0
    matmuls = 6 * 2 * 32 * 128 * 128
    assert H.cost_analysis_flops(scanned) < 0.5 * ours.flops or target != "cpu"  # XLA:CPU counts the body once
    flat = H.analyse(unrolled.as_text(), 1).flops
    np.testing.assert_allclose(ours.flops, flat, rtol=1e-3)  # the loop counted 6 times = the 6 unrolled bodies
    np.testing.assert_allclose(flat, matmuls, rtol=0.05)  # + the elementwise work each backend fuses its own way
    if target == "cpu":
        np.testing.assert_allclose(flat, H.cost_analysis_flops(unrolled), rtol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("target", ["cpu", "gpu"])
def test_model_step_flops_match_an_unrolled_compile(monkeypatch, target):
    """The SFT step of a small scanned config (periodic scan, CE chunks, 2 micro-batches: all loops) counts
    within 5% of the same step compiled without any loop (XLA:CPU's own cost analysis; on the GPU target our
    count of the loop-free program, whose every GEMM is a cuBLAS custom call)."""
    import nemo_jax.model.model

    monkeypatch.setattr(nemo_jax.model.model, "INLINE_UNITS", 0)  # scan this small stack
    cfg = _cfg()
    tx = optax.adamw(1e-4)
    dev = _device(target)
    params = _on(abstract_params(cfg), dev)
    opt = _on(jax.eval_shape(tx.init, abstract_params(cfg)), dev)
    B, T = 4, 64

    def compiled(opts, accum, chunk_rows):
        batch = {k: jax.ShapeDtypeStruct((B, T), jnp.int32) for k in ("tokens", "targets", "segment_ids")}
        batch["loss_mask"] = jax.ShapeDtypeStruct((B, T), bool)
        batch = _on(batch, dev)

        def step(p, o, b):
            def loss(p):
                total = 0.0
                for i in range(accum) if accum == 1 else []:
                    total = token_loss(p, b, cfg, opts)[0]
                if accum > 1:
                    mb = jax.tree.map(lambda x: x.reshape(accum, B // accum, T), b)
                    total = jax.lax.map(lambda m: token_loss(p, m, cfg, opts)[0], mb).sum()
                return total
            g = jax.grad(loss)(p)
            u, o = tx.update(g, o, p)
            return optax.apply_updates(p, u), o

        import nemo_jax.model.layers as L
        orig = L.cross_entropy
        L_ce = lambda *a, **k: orig(*a, **dict(k, chunk=chunk_rows))  # noqa: E731
        import nemo_jax.train.step as S
        S.cross_entropy = L_ce
        try:
            # XLA:CPU's own fusion emitters, whatever the test process's flags (helpers.FAST_COMPILE's older
            # emitters run scatters as loops, and the reference must have none)
            return jax.jit(step).lower(params, opt, batch).compile(
                {"xla_cpu_use_fusion_emitters": True} if target == "cpu" else None)
        finally:
            S.cross_entropy = orig

    looped = compiled(Options(kernels="reference"), 2, 32)  # 2 micro-batches, CE in chunks, scanned layers
    flat = compiled(Options(scan=False, kernels="reference"), 1, B * T)  # one CE chunk, unrolled layers
    loops = [line for line in flat.as_text().splitlines() if " while(" in line]
    # the reference may keep only the MoE layout's searchsorted loops (integer work, no FLOPs to speak of)
    assert all("searchsorted" in line for line in loops), "the reference must be free of model loops"
    ours = H.analyse(looped.as_text(), 1).flops
    ref = H.cost_analysis_flops(flat) if target == "cpu" else H.analyse(flat.as_text(), 1).flops
    assert abs(ours / ref - 1) < 0.05, (ours, ref)
    if target == "cpu":
        assert H.cost_analysis_flops(looped) < 0.8 * ref  # what counting each body once would report
    else:
        assert "__cublas$" in looped.as_text()  # the GEMMs are library calls there


@pytest.mark.parametrize("target", ["cpu", "gpu"])
def test_kernels_are_costed_one_by_one(target):
    """The per-kernel view of a scanned program: its matmul FLOPs add up to the loop's (each body kernel runs 6
    times), a kernel inside the loop reads the one weight slice it takes, not the stacked weights (bytes), and
    the roofline times each kernel at the largest of its compute, memory and launch times."""
    from nemo_jax.plan import roofline as R

    def f(w, x):
        h, _ = jax.lax.scan(lambda h, wi: (jnp.tanh(h @ wi) * 2.0, None), x, w)
        return jnp.sum(h)

    dev = _device(target)
    w, x = _on((jax.ShapeDtypeStruct((6, 128, 128), jnp.float32), jax.ShapeDtypeStruct((32, 128), jnp.float32)), dev)
    ks = H.kernels(jax.jit(f).lower(w, x).compile().as_text())
    matmuls = 6 * 2 * 32 * 128 * 128
    np.testing.assert_allclose(sum(k.matmul_flops * k.count for k in ks), matmuls, rtol=0.01)
    assert any(k.count == 6 and k.matmul_flops for k in ks)
    stack = 6 * 128 * 128 * 4
    # each of the 6 iterations reads its slice of the stacked weights (1/6 of them) and small activations; reading
    # the whole stack in each would alone come to 6 x stack
    assert sum(k.bytes * k.count for k in ks) < 6 * stack
    kind = DEVICE_KINDS["h100"]
    a = R.ACHIEVABLE["h100"]
    t = lambda **kw: R.kernel_time(H.Kernel("k", "gemm", **kw), kind, a)  # noqa: E731
    assert t() == a.launch_s
    np.testing.assert_allclose(t(bytes=1e9), 1e9 / (kind.hbm * a.hbm))
    np.testing.assert_allclose(t(matmul_flops=1e12), 1e12 / (kind.peak * a.mma))
    np.testing.assert_allclose(t(matmul_flops=1e12, precision="tf32"), 2e12 / (kind.peak * a.mma))
    np.testing.assert_allclose(R.kernel_time(H.Kernel("k", "pallas", matmul_flops=1e12), kind, a),
                               1e12 / (kind.peak * a.pallas))
    slow = R.fit_share([H.Kernel("k", "gemm", matmul_flops=1e12)], kind, a, "mma", 2e12 / kind.peak)
    np.testing.assert_allclose(slow, 0.5, rtol=1e-3)  # a GEMM measured at half the peak fits mma = 0.5


def test_replica_groups_forms():
    assert H.replica_groups("replica_groups={{0,1},{2,3}}, x", 4) == [[0, 1], [2, 3]]
    assert H.replica_groups("replica_groups=[2,4]<=[8]", 8) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert H.replica_groups("replica_groups=[4,2]<=[2,4]T(1,0)", 8) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert H.replica_groups("channel_id=1", 4) == [[0, 1, 2, 3]]
    mesh_form = "replica_groups=mesh['axis_0'=4,'axis_1'=2] {'axis_0'}, dimensions={0}"
    assert H.replica_groups(mesh_form, 8) == [[0, 2, 4, 6], [1, 3, 5, 7]]
    permuted = "replica_groups=mesh['axis_0'=4,'axis_1'=2] device_ids=([2,4]T(1,0)) {'axis_1'}"
    assert H.replica_groups(permuted, 8) == [[0, 4], [1, 5], [2, 6], [3, 7]]


def test_roofline_uses_inter_node_bandwidth_across_nodes():
    inside = H.Collective("all-reduce", 10 ** 9, 8, [list(range(8))], 1)
    across = H.Collective("all-reduce", 10 ** 9, 8, [list(range(0, 64, 8))], 1)
    a, b = roofline(0, [inside], H100)["collectives"], roofline(0, [across], H100)["collectives"]
    np.testing.assert_allclose(a, 2 * 7 / 8 * 1e9 / H100.intra_bw)
    np.testing.assert_allclose(b, 2 * 7 / 8 * 1e9 / H100.inter_bw)


@pytest.fixture(scope="module")
def fsdp_plan():
    c = SFTConfig(mesh=MeshSection(fsdp=8), steps=10)
    return c, plan_sft(c, 8, H100)


def test_plan_bytes_are_the_sharded_leaves(fsdp_plan):
    """Per-device bytes of params / optimiser / batch are the sums over their shards, and together they are
    the compiled program's argument bytes; params and Adam moments are split 8 ways."""
    from nemo_jax.model.spec import param_specs
    from nemo_jax.train.sft import model_config_path

    c, r = fsdp_plan
    b = r["per_device_bytes"]
    cfg = NemotronHConfig.from_file(model_config_path(c.model.config))
    whole = sum(int(np.prod(s.shape)) * 4 for s in jax.tree.leaves(param_specs(cfg), is_leaf=lambda x: hasattr(x, "axes")))
    assert whole / 8 <= b["params"] < whole / 8 * 1.1  # a few small leaves do not divide by 8
    assert 2 * b["params"] <= b["optimizer"] < 2 * b["params"] + 4096  # mu, nu + counters
    assert b["params"] + b["optimizer"] + b["batch"] <= b["arguments"] <= b["params"] + b["optimizer"] + b["batch"] + 64
    assert b["total"] >= b["arguments"] and r["fits"]
    assert r["collective_bytes"].get("all-gather", 0) > 0  # FSDP gathers weights
    assert 0.9 < r["flops_ratio"] < 2.0, r["flops_ratio"]  # 8 devices together ~ the model's FLOPs, not 8x


def test_plan_cli_json_keys(capsys):
    from nemo_jax import cli

    # bf16 with the sequence split (context=2): the context shard_maps' gradient sums must compile on CPU
    cli.main(["plan", "--devices", "8", "--device-kind", "h200", "--mesh", "fsdp=2,expert=2,context=2", "--json",
              "--sampler", "--rollout-batch", "8", "--context", "96", "steps=10", "model.dtype=bfloat16"])
    out = json.loads(capsys.readouterr().out)
    assert [p["program"] for p in out["programs"]] == ["sft_step", "sampler_prefill", "sampler_decode"]
    prefill, decode = out["programs"][1:]
    assert prefill["per_device_bytes"]["decode_state"] == decode["per_device_bytes"]["decode_state"] > 0
    assert prefill["model_flops_per_step"] == 96 * decode["model_flops_per_step"]
    assert out["fits_all"]
    for k in ("fits", "per_device_bytes", "flops_per_step", "model_flops_per_step", "collective_bytes",
              "step_time_s", "mfu"):
        assert k in out, k
    assert out["programs"][0]["mesh"] == {"data": 1, "fsdp": 2, "tensor": 1, "expert": 2, "context": 2}
    assert set(out["step_time_s"]) >= {"compute", "collectives", "with_overlap", "without_overlap"}
    k = out["programs"][0]["kernel_costs"]  # the step's kernels, costed one by one (the compute time is theirs)
    assert k["count"] > 0 and k["bytes"] > 0
    np.testing.assert_allclose(sum(k["seconds_by_kind"].values()), out["step_time_s"]["compute"], rtol=1e-6)
    assert out["step_time_s"]["without_overlap"] >= out["step_time_s"]["with_overlap"] > 0


def test_plan_of_the_tinker_server(capsys):
    """`plan --tinker-clients 4 --sampler` on a LoRA config: the learner step, 3 more clients' adapters and Adam
    moments, and the sampler's decode state and temporaries, the base weights counted once; a round of 4 clients
    takes 4 learner steps. A config without LoRA is refused before anything compiles."""
    from nemo_jax import cli

    args = ["plan", "--devices", "8", "--device-kind", "h100", "--mesh", "fsdp=8", "--target", "cpu", "--json",
            "--sampler", "--rollout-batch", "8", "--context", "96", "--no-lora-ratio", "--tinker-clients", "4"]
    cli.main(args + ["steps=10", "lora.targets=[attention,mamba,experts]", "lora.rank=8"])
    out = json.loads(capsys.readouterr().out)
    learner, prefill, decode = out["programs"]
    t, per = out["tinker"], learner["per_device_bytes"]
    assert learner["program"] == "lora_sft_step" and t["clients"] == 4 and per["adapters"] > 0
    b = t["per_device_bytes"]
    assert b["more_clients"] == 3 * (per["adapters"] + per["optimizer"]) > 0
    assert b["sampler_state_and_temporaries"] == max(p["per_device_bytes"]["decode_state"] +
                                                     p["per_device_bytes"]["temporaries"] for p in (prefill, decode))
    assert b["total"] == per["total"] + b["more_clients"] + b["sampler_state_and_temporaries"]
    assert t["fits"] == (b["total"] <= 0.9 * H100.memory) and out["fits_all"] == (t["fits"] and learner["fits"])
    assert t["round_time_s"] == 4 * t["step_time_s"] == 4 * learner["step_time_s"]["with_overlap"]
    with pytest.raises(SystemExit):
        cli.main(args + ["steps=10"])
    assert "give the config lora.targets" in capsys.readouterr().err


def test_plan_asks_for_a_fresh_process_when_short_of_devices():
    with pytest.raises(RuntimeError, match="fresh process"):
        plan_sft(SFTConfig(), 16, H100)


def test_candidate_meshes_respect_nodes_and_experts():
    ms = candidate_meshes(64, H100, 512)
    assert ms and all(m["data"] * m["fsdp"] * m["tensor"] * m["expert"] == 64 for m in ms)
    assert all(m["tensor"] <= 8 for m in ms)
    assert {m["data"] for m in ms} == {1, 8}
    assert all(m["expert"] == 1 for m in candidate_meshes(8, H100, 0))  # a dense model has no expert axis
    assert dataclasses.asdict(MeshSection(**ms[0]))  # each is a valid mesh section


SMALL_DIMS = {"vocab_size": 512, "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
              "intermediate_size": 64, "mamba_num_heads": 8, "mamba_head_dim": 8, "ssm_state_size": 16, "n_groups": 2,
              "chunk_size": 128, "n_routed_experts": 16, "num_experts_per_tok": 4, "moe_intermediate_size": 32,
              "moe_shared_expert_intermediate_size": 32, "moe_latent_size": 16}


@pytest.mark.slow
@pytest.mark.parametrize("target", ["cpu", "gpu"])
def test_the_super_preset_plans_on_each_target(tmp_path, monkeypatch, capsys, target):
    """configs/sft/super-120b.yaml as shipped (all-to-all experts in chunks, layer remat, MTP) on Super's own layer
    order, every width cut small: it answers `fits` on the CPU target and on XLA:GPU. Super's periodic order (scans
    of runs inside a scan) with the GPU's grouped-matmul kernel used to fail to lower ("No constant handler for
    type: DynamicJaxprTracer": the group sizes were closed over by a custom_jvp)."""
    import os

    from nemo_jax import cli

    if target == "gpu":
        _device("gpu")  # (skipped without the plugin)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(root, "nemo_jax", "assets", "models", "super-120b-a12b.json")) as f:
        small = dict(json.load(f), **SMALL_DIMS)
    (tmp_path / "super-small.json").write_text(json.dumps(small))
    monkeypatch.setenv("NEMO_JAX_PLAN_CACHE", str(tmp_path / "cache"))
    cli.main(["plan", "--config", os.path.join(root, "configs", "sft", "super-120b.yaml"), "--devices", "8",
              "--device-kind", "h100", "--target", target, "--json", f"model.config={tmp_path / 'super-small.json'}",
              "data.seq_len=256", "data.batch_size=16", "model.moe_chunk_tokens=128"])
    out = json.loads(capsys.readouterr().out)
    assert out["fits_all"], out
