"""Small configs shared by the tests. (conftest imports this before jax: nothing here may import jax at module
level, or XLA_FLAGS would be read before conftest sets the fake device count.)"""

from nemo_jax.config.model import NemotronHConfig, parse_pattern

# XLA flag for test processes (conftest, and the subprocesses tests start): no LLVM optimisation of CPU code
FAST_COMPILE = "--xla_backend_optimization_level=0"


def tiny_cfg(pattern="MEM*E-", **kw) -> NemotronHConfig:
    base = dict(vocab_size=97, hidden_size=32, layer_kinds=parse_pattern(pattern), num_attention_heads=4,
                num_key_value_heads=2, head_dim=8, intermediate_size=48, mamba_num_heads=4, mamba_head_dim=8,
                ssm_state_size=8, n_groups=2, chunk_size=8, n_routed_experts=8, num_experts_per_tok=2,
                moe_intermediate_size=16, moe_shared_expert_intermediate_size=24, routed_scaling_factor=2.5)
    base.update(kw)
    return NemotronHConfig(**base)
