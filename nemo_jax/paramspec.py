"""`ParamSpec`: one tensor's shape, logical axis names and initializer. Its own module because both the model
(`nemo_jax.model.spec` builds the tree of them) and the sharding rules (`nemo_jax.parallel.rules` maps their axes
to a mesh) use it, and the model imports `nemo_jax.parallel`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import jax
import jax.numpy as jnp

Init = Callable[[jax.Array, tuple[int, ...], jnp.dtype], jax.Array]


@dataclass(frozen=True)
class ParamSpec:
    shape: tuple[int, ...]
    axes: tuple[str | None, ...]
    init: Init
    dtype: jnp.dtype = jnp.float32

    def __post_init__(self):
        if len(self.shape) != len(self.axes):
            raise ValueError(f"shape {self.shape} and axes {self.axes} differ in rank")

    def stacked(self, n: int) -> "ParamSpec":
        """The same tensor for n layers, stacked on a leading `layers` axis."""
        base = self.init

        def init(key, shape, dtype):
            return jax.vmap(lambda k: base(k, shape[1:], dtype))(jax.random.split(key, shape[0]))

        return ParamSpec((n, *self.shape), ("layers", *self.axes), init, self.dtype)
