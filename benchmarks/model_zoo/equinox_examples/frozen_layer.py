"""The model of Equinox's "Freezing parameters" example (`docs/examples/frozen_layer.ipynb`),
trained with SGD.

As published: an `eqx.nn.MLP(1, 1, 8, 1)` of which only the last layer trains (`eqx.partition` with
a filter spec; the frozen part is passed beside the data), fitted to `y = 5x - 2` on 10,000
standard normal inputs; mean squared error; batches of 256; `optax.sgd(3e-3)`.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, PRNGKeyArray

import eqx_kfac

from ...harness import Method, Problem, minibatches

NOTEBOOK_OPTIMIZER = Method("sgd", 3e-3)


def loss(
    trainable: eqx.nn.MLP, batch: tuple[eqx.nn.MLP, Float[Array, "n 1"], Float[Array, "n 1"]]
) -> Float[Array, ""]:
    """Mean squared error of the recombined model."""
    frozen, x, y = batch
    predictions = jax.vmap(eqx.combine(trainable, frozen))(x)
    eqx_kfac.register_squared_error_loss(predictions, y)
    return jnp.mean((y - predictions) ** 2)


def problem(key: PRNGKeyArray, batch_size: int = 256) -> Problem:
    """The MLP with all but its last layer frozen, on the notebook's line."""
    data_key, model_key = jax.random.split(key)
    model = eqx.nn.MLP(in_size=1, out_size=1, width_size=8, depth=1, key=model_key)
    spec = jax.tree.map(lambda _: False, model)
    spec = eqx.tree_at(lambda m: (m.layers[-1].weight, m.layers[-1].bias), spec, replace=(True, True))
    trainable, frozen = eqx.partition(model, spec)
    x = jax.random.normal(data_key, (10_000, 1))
    next_data = minibatches((x, 5 * x - 2), batch_size, seed=0)

    def next_batch(model, step, key, previous=None):
        return (frozen, *next_data(model, step, key, previous))

    return Problem(name="frozen_layer", model=trainable, loss=loss, next_batch=next_batch, batch_size=batch_size)
