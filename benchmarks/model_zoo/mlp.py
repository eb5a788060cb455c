"""The plain classifier of Equinox's examples: `eqx.nn.MLP` on the flattened digits."""

import equinox as eqx
import jax
from jaxtyping import Array, Float, Int, PRNGKeyArray

from ..harness import Problem, digit_batches
from .losses import cross_entropy


def loss(model: eqx.nn.MLP, batch: tuple[Float[Array, "n 64"], Int[Array, " n"]]) -> Float[Array, ""]:
    """Mean softmax cross-entropy."""
    images, labels = batch
    return cross_entropy(jax.vmap(model)(images), labels)


def problem(
    key: PRNGKeyArray, batch_size: int = 64, batch_seed: int | None = None, width: int = 64, depth: int = 2
) -> Problem:
    """`eqx.nn.MLP(64, 10, width, depth)` (ReLU) on the digits (`batch_seed`: see `digit_batches`)."""
    return Problem(
        name="mlp",
        model=eqx.nn.MLP(64, 10, width, depth, key=key),
        loss=loss,
        next_batch=digit_batches(batch_size, seed=batch_seed),
        batch_size=batch_size,
    )
