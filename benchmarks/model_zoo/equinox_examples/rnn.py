"""The RNN of Equinox's "Train RNN" example (`docs/examples/train_rnn.ipynb`), trained with Adam.

As published: 10,000 generated sequences of 16 steps, `(sin, cos)` of a random phase decaying as
`1/(1 + t)`, the first coordinate negated in half of them (class 0); a `GRUCell` of width 16
scanned over the sequence, a `Linear` without bias plus a separate bias, a sigmoid; binary
cross-entropy; batches of 32; `optax.adam(3e-3)`. The model returns the logit and the loss applies
the sigmoid (`log sigmoid` form, the same function), so that the logit can be registered.
"""

import math

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, PRNGKeyArray

import eqx_kfac

from ...harness import Method, Problem, minibatches

NOTEBOOK_OPTIMIZER = Method("adam", 3e-3)


def sequences(size: int, key: PRNGKeyArray) -> tuple[Float[Array, "n 16 2"], Float[Array, "n 1"]]:
    """The notebook's data: `size` sequences and their labels (half 0, half 1)."""
    t = jnp.linspace(0, 2 * math.pi, 16)
    offset = jax.random.uniform(key, (size, 1), minval=0, maxval=2 * math.pi)
    x1 = jnp.sin(t + offset) / (1 + t)
    x2 = jnp.cos(t + offset) / (1 + t)
    half = size // 2
    x1 = x1.at[:half].multiply(-1)
    y = jnp.ones((size, 1)).at[:half].set(0)
    return jnp.stack([x1, x2], axis=-1), y


class RNN(eqx.Module):
    """A GRU cell scanned over one sequence; the last hidden state's logit."""

    cell: eqx.nn.GRUCell
    linear: eqx.nn.Linear
    bias: Array

    def __init__(self, key: PRNGKeyArray, in_size: int = 2, out_size: int = 1, hidden: int = 16):
        cell_key, linear_key = jax.random.split(key)
        self.cell = eqx.nn.GRUCell(in_size, hidden, key=cell_key)
        self.linear = eqx.nn.Linear(hidden, out_size, use_bias=False, key=linear_key)
        self.bias = jnp.zeros(out_size)

    def __call__(self, inputs: Float[Array, "steps in"]) -> Float[Array, " out"]:
        def step(hidden, x):
            return self.cell(x, hidden), None

        out, _ = jax.lax.scan(step, jnp.zeros(self.cell.hidden_size, inputs.dtype), inputs)
        return self.linear(out) + self.bias


def loss(model: RNN, batch: tuple[Float[Array, "n 16 2"], Float[Array, "n 1"]]) -> Float[Array, ""]:
    """Mean binary cross-entropy of the sigmoid of the logits."""
    x, y = batch
    logits = jax.vmap(model)(x)
    eqx_kfac.register_sigmoid_cross_entropy_loss(logits, y)
    return -jnp.mean(y * jax.nn.log_sigmoid(logits) + (1 - y) * jax.nn.log_sigmoid(-logits))


def problem(key: PRNGKeyArray, batch_size: int = 32) -> Problem:
    """The RNN on the notebook's generated sequences."""
    data_key, model_key = jax.random.split(key)
    return Problem(
        name="rnn",
        model=RNN(model_key),
        loss=loss,
        next_batch=minibatches(sequences(10_000, data_key), batch_size, seed=0),
        batch_size=batch_size,
    )
