"""The model of the timing benchmarks: `eqx.nn.Linear` layers with tanh between them.

Equinox's default initialisation (unlike `_problems.TanhNet`, which reproduces Haiku's): timings
do not depend on the initial values, so the benchmarks keep the simplest model.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, PRNGKeyArray


class TanhMLP(eqx.Module):
    """Linear layers of widths `sizes`, tanh after each but the last (one example at a time)."""

    layers: tuple[eqx.nn.Linear, ...]

    def __init__(self, sizes: tuple[int, ...], key: PRNGKeyArray):
        keys = jax.random.split(key, len(sizes) - 1)
        self.layers = tuple(
            eqx.nn.Linear(a, b, key=k) for a, b, k in zip(sizes[:-1], sizes[1:], keys)
        )

    def __call__(self, x: Float[Array, " in"]) -> Float[Array, " out"]:
        for layer in self.layers[:-1]:
            x = jnp.tanh(layer(x))
        return self.layers[-1](x)
