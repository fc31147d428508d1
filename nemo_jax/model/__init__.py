"""Pure functions over a parameter pytree: init, abstract_params, logical_axes, forward."""

from nemo_jax.model.cache import DecodeState, init_decode_state
from nemo_jax.model.model import Options, forward, forward_cached, hidden_states, mtp_hidden, units
from nemo_jax.model.spec import abstract_params, count_params, init, logical_axes, param_specs

__all__ = [
    "DecodeState", "Options", "abstract_params", "count_params", "forward", "forward_cached", "hidden_states",
    "init", "init_decode_state", "logical_axes", "mtp_hidden", "param_specs", "units",
]
