"""Small configs shared by the tests. (conftest imports this before jax: nothing here may import jax at module
level, or XLA_FLAGS would be read before conftest sets the fake device count.)"""

from nemo_jax.config.model import NemotronHConfig, parse_pattern

# XLA flags for test processes (conftest, and the subprocesses tests start): no LLVM optimisation of CPU code,
# and XLA:CPU's older elemental fusion emitters, not the MLIR ones (compiling a tiny model's train step takes
# ~2.3x less CPU; it fuses a little differently: values equal to float rounding, temporary bytes and XLA's FLOP
# count within 0.2%). An XLA that no longer knows a flag stops at start naming it: drop it here then.
FAST_COMPILE = "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false"


def tiny_cfg(pattern="MEM*E-", **kw) -> NemotronHConfig:
    base = dict(vocab_size=97, hidden_size=32, layer_kinds=parse_pattern(pattern), num_attention_heads=4,
                num_key_value_heads=2, head_dim=8, intermediate_size=48, mamba_num_heads=4, mamba_head_dim=8,
                ssm_state_size=8, n_groups=2, chunk_size=8, n_routed_experts=8, num_experts_per_tok=2,
                moe_intermediate_size=16, moe_shared_expert_intermediate_size=24, routed_scaling_factor=2.5)
    base.update(kw)
    return NemotronHConfig(**base)


def micro_model(directory, base: str = "tiny", kinds=("full_attention", "mlp")) -> str:
    """A shipped model config (nemo_jax/assets/models/BASE.json) cut to the layers `kinds` (HF
    layers_block_type names), written into `directory` -> its path, for `model.config=`. For end-to-end tests of
    what does not depend on the layer kinds (processes, resume, recipes): the attention + MLP pair compiles its
    train step ~5x faster than the tiny model's Mamba / MoE stack (same vocabulary and tokenizer)."""
    import json
    import os

    with open(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "nemo_jax", "assets",
                           "models", f"{base}.json")) as f:
        cfg = json.load(f)
    text = cfg.get("text_config", cfg)  # a vision-language config: its language model
    text.update(layers_block_type=list(kinds), num_hidden_layers=len(kinds))
    path = os.path.join(str(directory), f"{base}-micro.json")
    with open(path, "w") as f:
        json.dump(cfg, f)
    return path


def log_tail(p, n: int | None = 4000) -> str:
    """The output so far of a process started with its output in the file object `p.log`."""
    p.log.flush()
    p.log.seek(0)
    text = p.log.read()
    return text if n is None else text[-n:]


def wait_until(cond, what: str, timeout: float, procs=(), poll_s: float = 0.2):
    """Poll `cond()` until it returns something true -> that value. Fails naming `what` after `timeout` seconds (a
    cap for a hang, not a bet on speed: loaded machines), or at once with its output when one of `procs`
    (processes with `.poll()` and their output in `.log`) has died."""
    import time

    deadline = time.time() + timeout
    while time.time() < deadline:
        got = cond()
        if got:
            return got
        for p in procs:
            assert p.poll() is None, f"{what}: a process died:\n{log_tail(p)}"
        time.sleep(poll_s)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
