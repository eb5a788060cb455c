"""The model of Equinox's "Stateful operations" example (`docs/examples/stateful.ipynb`), trained
with Adam.

As published: `BatchNorm(3)`, a `SpectralNorm`-wrapped `Linear(3, 32)`, ReLU, `BatchNorm(32)`,
`Linear(32, 32)`, ReLU, `Linear(32, 3)`; the batch statistics and the spectral norm's power
iteration carried in an `eqx.nn.State`; mean squared error against `sin(x) + 1` on 10 standard
normal inputs, the full batch at every step; `optax.adam(3e-4)`.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, PRNGKeyArray

import eqx_kfac

from ...harness import Method, Problem, full_batch

NOTEBOOK_OPTIMIZER = Method("adam", 3e-4)


class Model(eqx.Module):
    """The notebook's mix of stateful and stateless layers, on one input of 3 numbers."""

    norm1: eqx.nn.BatchNorm
    spectral_linear: eqx.nn.SpectralNorm[eqx.nn.Linear]
    norm2: eqx.nn.BatchNorm
    linear1: eqx.nn.Linear
    linear2: eqx.nn.Linear

    def __init__(self, key: PRNGKeyArray):
        key1, key2, key3, key4 = jax.random.split(key, 4)
        self.norm1 = eqx.nn.BatchNorm(input_size=3, axis_name="batch")
        self.spectral_linear = eqx.nn.SpectralNorm(
            layer=eqx.nn.Linear(3, 32, key=key1), weight_name="weight", key=key2
        )
        self.norm2 = eqx.nn.BatchNorm(input_size=32, axis_name="batch")
        self.linear1 = eqx.nn.Linear(32, 32, key=key3)
        self.linear2 = eqx.nn.Linear(32, 3, key=key4)

    def __call__(self, x: Float[Array, " 3"], state: eqx.nn.State) -> tuple[Float[Array, " 3"], eqx.nn.State]:
        x, state = self.norm1(x, state)
        x, state = self.spectral_linear(x, state)
        x, state = self.norm2(jax.nn.relu(x), state)
        return self.linear2(jax.nn.relu(self.linear1(x))), state


def loss(
    model: Model, state: eqx.nn.State, batch: tuple[Float[Array, "n 3"], Float[Array, "n 3"]]
) -> tuple[Float[Array, ""], eqx.nn.State]:
    """Mean squared error over the batch and the 3 outputs, and the updated state."""
    xs, ys = batch
    predictions, state = jax.vmap(model, axis_name="batch", in_axes=(0, None), out_axes=(0, None))(xs, state)
    eqx_kfac.register_squared_error_loss(predictions, ys, weight=1.0 / ys.shape[-1])
    return jnp.mean((predictions - ys) ** 2), state


def problem(key: PRNGKeyArray, size: int = 10) -> Problem:
    """The model on the notebook's `size` inputs."""
    model_key, data_key = jax.random.split(key)
    model, state = eqx.nn.make_with_state(Model)(model_key)
    xs = jax.random.normal(data_key, (size, 3))
    return full_batch("stateful", model, loss, (xs, jnp.sin(xs) + 1), func_state=state)
