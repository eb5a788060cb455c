"""A small convolutional classifier: `Conv2d` + `MaxPool2d` twice, then `Linear`."""

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int, PRNGKeyArray

from ..harness import Problem, digit_batches
from .losses import cross_entropy


class CNN(eqx.Module):
    """Two 3x3 convolutions with ReLU and 2x2 max pooling, and a linear head (one 1x8x8 image)."""

    conv1: eqx.nn.Conv2d
    conv2: eqx.nn.Conv2d
    pool: eqx.nn.MaxPool2d
    head: eqx.nn.Linear

    def __init__(self, key: PRNGKeyArray):
        k1, k2, k3 = jax.random.split(key, 3)
        self.conv1 = eqx.nn.Conv2d(1, 8, 3, padding=1, key=k1)
        self.conv2 = eqx.nn.Conv2d(8, 16, 3, padding=1, key=k2)
        self.pool = eqx.nn.MaxPool2d(2, 2)
        self.head = eqx.nn.Linear(16 * 2 * 2, 10, key=k3)

    def __call__(self, x: Float[Array, "1 8 8"]) -> Float[Array, " 10"]:
        x = self.pool(jax.nn.relu(self.conv1(x)))
        x = self.pool(jax.nn.relu(self.conv2(x)))
        return self.head(jnp.ravel(x))


def loss(model: CNN, batch: tuple[Float[Array, "n 1 8 8"], Int[Array, " n"]]) -> Float[Array, ""]:
    """Mean softmax cross-entropy."""
    images, labels = batch
    return cross_entropy(jax.vmap(model)(images), labels)


def problem(key: PRNGKeyArray, batch_size: int = 128, batch_seed: int | None = None) -> Problem:
    """The CNN on the digits (`batch_seed`: see `digit_batches`)."""
    return Problem(
        name="cnn",
        model=CNN(key),
        loss=loss,
        next_batch=digit_batches(batch_size, lambda x: x.reshape(-1, 1, 8, 8), seed=batch_seed),
        batch_size=batch_size,
    )
