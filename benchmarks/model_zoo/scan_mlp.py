"""Scan over layers: a stack of equal `eqx.nn.Linear` layers built with `eqx.filter_vmap` and
applied one slice per step with `jax.lax.scan` (Equinox's pattern for deep, quickly compiled
models)."""

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int, PRNGKeyArray

from ..harness import Problem, digit_batches
from .losses import cross_entropy


class ScanMLP(eqx.Module):
    """`depth` tanh layers of width 64 as one stacked `Linear`, and a linear head."""

    stack: eqx.nn.Linear
    head: eqx.nn.Linear

    def __init__(self, key: PRNGKeyArray, depth: int = 4, width: int = 64):
        k1, k2 = jax.random.split(key)
        self.stack = eqx.filter_vmap(lambda k: eqx.nn.Linear(width, width, key=k))(
            jax.random.split(k1, depth)
        )
        self.head = eqx.nn.Linear(width, 10, key=k2)

    def __call__(self, x: Float[Array, " width"]) -> Float[Array, " 10"]:
        dynamic, static = eqx.partition(self.stack, eqx.is_array)

        def step(h, layer):
            return jnp.tanh(eqx.combine(layer, static)(h)), None

        h, _ = jax.lax.scan(step, x, dynamic)
        return self.head(h)


def loss(model: ScanMLP, batch: tuple[Float[Array, "n 64"], Int[Array, " n"]]) -> Float[Array, ""]:
    """Mean softmax cross-entropy."""
    x, labels = batch
    return cross_entropy(jax.vmap(model)(x), labels)


def problem(key: PRNGKeyArray, depth: int = 4, batch_size: int = 128) -> Problem:
    """The scan-over-layers MLP on the digits."""
    return Problem(
        name="scan_mlp",
        model=ScanMLP(key, depth),
        loss=loss,
        next_batch=digit_batches(batch_size),
        batch_size=batch_size,
    )
