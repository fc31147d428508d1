"""Compile time of the SFT train step for a 4-unit and a 40-unit config (unit = Mamba, optional attention,
MoE, as in Nano 3), and for Super's release layer order (40 units in irregular periods, scanned as runs inside
repeated periods). Scanning keeps it flat in depth; goal: 40 units <= 1.5x 4 units.

    python bench/compile.py
"""

import time

import common  # noqa: F401
import jax
import jax.numpy as jnp
import optax

from nemo_jax.config.model import NemotronHConfig, parse_pattern
from nemo_jax.model import Options, abstract_params
from nemo_jax.train.step import token_loss


def pattern(units: int) -> str:
    return "".join("M*E" if i % 4 == 3 else "ME" for i in range(units))


# Nemotron 3 Super's hybrid_override_pattern (configs/model/super-120b-a12b.json)
SUPER = "MEMEMEM*EMEMEMEM*EMEMEMEM*EMEMEMEMEM*EMEMEMEMEM*EMEMEMEMEM*EMEMEMEMEM*EMEMEMEM*EMEMEMEME"


def compile_seconds(units: int | str, scan: bool = True) -> float:
    """units: a count (the synthetic pattern) or a pattern string."""
    pat = units if isinstance(units, str) else pattern(units)
    cfg = NemotronHConfig(vocab_size=1024, hidden_size=256, layer_kinds=parse_pattern(pat),
                          num_attention_heads=4, num_key_value_heads=2, head_dim=64, mamba_num_heads=8,
                          mamba_head_dim=32, ssm_state_size=32, n_groups=2, chunk_size=64, n_routed_experts=16,
                          num_experts_per_tok=4, moe_intermediate_size=128, moe_shared_expert_intermediate_size=256)
    tx = optax.adamw(1e-4)
    params = abstract_params(cfg)
    opt = jax.eval_shape(tx.init, params)
    B, T = 2, 256
    batch = {"tokens": jax.ShapeDtypeStruct((B, T), jnp.int32), "targets": jax.ShapeDtypeStruct((B, T), jnp.int32),
             "loss_mask": jax.ShapeDtypeStruct((B, T), bool), "segment_ids": jax.ShapeDtypeStruct((B, T), jnp.int32)}
    opts = Options(scan=scan)

    def step(p, o, b):
        (loss, _), g = jax.value_and_grad(lambda p: token_loss(p, b, cfg, opts), has_aux=True)(p)
        u, o = tx.update(g, o, p)
        return optax.apply_updates(p, u), o, loss

    t0 = time.perf_counter()
    jax.jit(step).lower(params, opt, batch).compile()
    return time.perf_counter() - t0


def main():
    rows = []
    res = {}
    for units in (4, 40):
        res[units] = compile_seconds(units)
        rows.append({"units": units, "layers": len(pattern(units)), "scan": True, "compile s": f"{res[units]:.1f}"})
    sup = compile_seconds(SUPER)
    rows.append({"units": 40, "layers": len(SUPER), "scan": "super order", "compile s": f"{sup:.1f}"})
    unrolled = compile_seconds(40, scan=False)
    rows.append({"units": 40, "layers": len(pattern(40)), "scan": False, "compile s": f"{unrolled:.1f}"})
    common.table(rows)
    print(f"40 units / 4 units (scan): {res[40] / res[4]:.2f}x, Super order / 4 units: {sup / res[4]:.2f}x "
          f"(goal <= 1.5x); unrolled 40 / scanned 40: {unrolled / res[40]:.2f}x")


if __name__ == "__main__":
    main()
