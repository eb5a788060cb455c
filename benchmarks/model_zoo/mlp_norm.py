"""An MLP with `eqx.nn.LayerNorm` and `eqx.nn.Dropout` (its randomness through the loss's key)."""

import equinox as eqx
import jax
from jaxtyping import Array, Float, Int, PRNGKeyArray

from ..harness import Problem, digit_batches
from .losses import cross_entropy


class NormMLP(eqx.Module):
    """`Linear -> LayerNorm -> tanh -> Dropout`, twice, then a linear head (one example)."""

    layers: tuple[eqx.nn.Linear, ...]
    norms: tuple[eqx.nn.LayerNorm, ...]
    dropout: eqx.nn.Dropout
    head: eqx.nn.Linear

    def __init__(self, key: PRNGKeyArray, width: int = 64, p: float = 0.1):
        keys = jax.random.split(key, 3)
        self.layers = (eqx.nn.Linear(64, width, key=keys[0]), eqx.nn.Linear(width, width, key=keys[1]))
        self.norms = (eqx.nn.LayerNorm(width), eqx.nn.LayerNorm(width))
        self.dropout = eqx.nn.Dropout(p)
        self.head = eqx.nn.Linear(width, 10, key=keys[2])

    def __call__(self, x: Float[Array, " 64"], key: PRNGKeyArray) -> Float[Array, " 10"]:
        for layer, norm, k in zip(self.layers, self.norms, jax.random.split(key, len(self.layers))):
            x = self.dropout(jax.nn.tanh(norm(layer(x))), key=k)
        return self.head(x)


def loss(
    model: NormMLP, key: PRNGKeyArray, batch: tuple[Float[Array, "n 64"], Int[Array, " n"]]
) -> Float[Array, ""]:
    """Mean softmax cross-entropy, with dropout drawn from `key`."""
    x, labels = batch
    logits = jax.vmap(model)(x, jax.random.split(key, x.shape[0]))
    return cross_entropy(logits, labels)


def problem(key: PRNGKeyArray, batch_size: int = 128) -> Problem:
    """The normalised MLP on the digits, with dropout."""
    return Problem(
        name="mlp_norm_dropout",
        model=NormMLP(key),
        loss=loss,
        next_batch=digit_batches(batch_size),
        has_rng=True,
        batch_size=batch_size,
    )
