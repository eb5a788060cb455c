"""A model with a frozen part, the way Equinox's FAQ freezes layers: `eqx.partition` with a filter
spec, the trainable half as the parameters and the frozen half passed in the batch."""

import equinox as eqx
import jax
from jaxtyping import Array, Float, Int, PRNGKeyArray

from ..harness import Problem, digit_batches
from .losses import cross_entropy


def _split(key: PRNGKeyArray) -> tuple[eqx.nn.MLP, eqx.nn.MLP]:
    model = eqx.nn.MLP(64, 10, 64, 3, activation=jax.nn.tanh, key=key)
    # The first layer is frozen (e.g. pretrained features); the others train.
    spec = jax.tree.map(eqx.is_inexact_array, model)
    spec = eqx.tree_at(lambda m: (m.layers[0].weight, m.layers[0].bias), spec, (False, False))
    return eqx.partition(model, spec)


def loss(
    trainable: eqx.nn.MLP, batch: tuple[eqx.nn.MLP, Float[Array, "n 64"], Int[Array, " n"]]
) -> Float[Array, ""]:
    """Mean softmax cross-entropy of the recombined model."""
    frozen, x, labels = batch
    model = eqx.combine(trainable, frozen)
    return cross_entropy(jax.vmap(model)(x), labels)


def problem(key: PRNGKeyArray, batch_size: int = 128) -> Problem:
    """The MLP with its first layer frozen, on the digits."""
    trainable, frozen = _split(key)
    next_digits = digit_batches(batch_size)

    def next_batch(model, step, key, previous=None):
        x, labels = next_digits(model, step, key, previous)
        return frozen, x, labels

    return Problem(
        name="frozen_part",
        model=trainable,
        loss=loss,
        next_batch=next_batch,
        batch_size=batch_size,
    )
