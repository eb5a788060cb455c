"""Recurrent classifiers: an `eqx.nn.GRUCell` or `eqx.nn.LSTMCell` applied with `jax.lax.scan`.

Each digit is read as a sequence of its 8 rows of 8 pixels; the last hidden state is classified.
The cell's weights are the same at every step of the scan.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int, PRNGKeyArray

from ..harness import Problem, digit_batches
from .losses import cross_entropy


class RNN(eqx.Module):
    """A recurrent cell scanned over the rows of one image, and a linear head."""

    cell: eqx.nn.GRUCell | eqx.nn.LSTMCell
    head: eqx.nn.Linear

    def __init__(self, key: PRNGKeyArray, cell: str = "gru", hidden: int = 32):
        k1, k2 = jax.random.split(key)
        cls = {"gru": eqx.nn.GRUCell, "lstm": eqx.nn.LSTMCell}[cell]
        self.cell = cls(8, hidden, key=k1)
        self.head = eqx.nn.Linear(hidden, 10, key=k2)

    def __call__(self, rows: Float[Array, "8 8"]) -> Float[Array, " 10"]:
        hidden = jnp.zeros(self.cell.hidden_size, rows.dtype)
        init = (hidden, hidden) if isinstance(self.cell, eqx.nn.LSTMCell) else hidden

        def step(carry, row):
            return self.cell(row, carry), None

        final, _ = jax.lax.scan(step, init, rows)
        return self.head(final[0] if isinstance(final, tuple) else final)


def loss(model: RNN, batch: tuple[Float[Array, "n 8 8"], Int[Array, " n"]]) -> Float[Array, ""]:
    """Mean softmax cross-entropy."""
    rows, labels = batch
    return cross_entropy(jax.vmap(model)(rows), labels)


def problem(key: PRNGKeyArray, cell: str = "gru", batch_size: int = 128) -> Problem:
    """The GRU (`cell="gru"`) or LSTM (`cell="lstm"`) classifier on the digits' rows."""
    return Problem(
        name=cell,
        model=RNN(key, cell),
        loss=loss,
        next_batch=digit_batches(batch_size, lambda x: x.reshape(-1, 8, 8)),
        batch_size=batch_size,
    )
