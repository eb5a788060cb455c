"""The CNN of Equinox's "MNIST" example (`docs/examples/mnist.ipynb`), trained with AdamW.

As published: a 4x4 convolution to 3 channels, 2x2 max pooling (stride 1), ReLU, flattening, then
an MLP 1728-512-64-10 with a sigmoid and a ReLU, and log-softmax outputs; the mean negative
log-likelihood; batches of 64; `optax.adamw(3e-4)`. The data: scikit-learn's digits upsampled to
28x28 and normalised to [-1, 1] as the notebook normalises MNIST (`(x - 0.5) / 0.5`).
"""

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int, PRNGKeyArray

from ...harness import Method, Problem, digits, minibatches, upsampled_digits
from ..losses import cross_entropy

NOTEBOOK_OPTIMIZER = Method("adamw", 3e-4)


class CNN(eqx.Module):
    """The notebook's CNN on one 1x28x28 image: log-probabilities of the 10 classes."""

    layers: list

    def __init__(self, key: PRNGKeyArray):
        key1, key2, key3, key4 = jax.random.split(key, 4)
        self.layers = [
            eqx.nn.Conv2d(1, 3, kernel_size=4, key=key1),
            eqx.nn.MaxPool2d(kernel_size=2),
            jax.nn.relu,
            jnp.ravel,
            eqx.nn.Linear(1728, 512, key=key2),
            jax.nn.sigmoid,
            eqx.nn.Linear(512, 64, key=key3),
            jax.nn.relu,
            eqx.nn.Linear(64, 10, key=key4),
            jax.nn.log_softmax,
        ]

    def __call__(self, x: Float[Array, "1 28 28"]) -> Float[Array, " 10"]:
        for layer in self.layers:
            x = layer(x)
        return x


def loss(model: CNN, batch: tuple[Float[Array, "n 1 28 28"], Int[Array, " n"]]) -> Float[Array, ""]:
    """The mean negative log-likelihood (registered as softmax cross-entropy of the log-probabilities,
    whose log-softmax is themselves)."""
    images, labels = batch
    return cross_entropy(jax.vmap(model)(images), labels)


def problem(key: PRNGKeyArray, batch_size: int = 64) -> Problem:
    """The CNN on the upsampled digits."""
    images = (upsampled_digits(28) - 0.5) / 0.5
    return Problem(
        name="mnist_cnn",
        model=CNN(key),
        loss=loss,
        next_batch=minibatches((images, digits()[1]), batch_size, seed=0),
        batch_size=batch_size,
    )
