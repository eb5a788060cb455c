"""A transformer encoder: `Embedding` (tokens and positions), `MultiheadAttention`, `LayerNorm`, MLP.

The digits become sequences of 64 tokens (each pixel's intensity, 0 to 16); the encoder's mean
output over the sequence is classified.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int, PRNGKeyArray

from ..harness import Problem, digit_batches
from .losses import cross_entropy

_VOCABULARY, _LENGTH = 17, 64


class EncoderLayer(eqx.Module):
    """Pre-norm self-attention and MLP, each with a residual connection (one sequence)."""

    norm1: eqx.nn.LayerNorm
    attention: eqx.nn.MultiheadAttention
    norm2: eqx.nn.LayerNorm
    mlp: eqx.nn.MLP

    def __init__(self, size: int, heads: int, key: PRNGKeyArray):
        k1, k2 = jax.random.split(key)
        self.norm1 = eqx.nn.LayerNorm(size)
        self.attention = eqx.nn.MultiheadAttention(heads, size, key=k1)
        self.norm2 = eqx.nn.LayerNorm(size)
        self.mlp = eqx.nn.MLP(size, size, 2 * size, 1, activation=jax.nn.gelu, key=k2)

    def __call__(self, x: Float[Array, "seq size"]) -> Float[Array, "seq size"]:
        y = jax.vmap(self.norm1)(x)
        x = x + self.attention(y, y, y)
        return x + jax.vmap(self.mlp)(jax.vmap(self.norm2)(x))


class Transformer(eqx.Module):
    """Token and position embeddings, encoder layers, a final LayerNorm and a linear head."""

    tokens: eqx.nn.Embedding
    positions: eqx.nn.Embedding
    layers: tuple[EncoderLayer, ...]
    norm: eqx.nn.LayerNorm
    head: eqx.nn.Linear

    def __init__(self, key: PRNGKeyArray, size: int = 32, heads: int = 4, depth: int = 2):
        keys = jax.random.split(key, depth + 3)
        self.tokens = eqx.nn.Embedding(_VOCABULARY, size, key=keys[0])
        self.positions = eqx.nn.Embedding(_LENGTH, size, key=keys[1])
        self.layers = tuple(EncoderLayer(size, heads, k) for k in keys[2:-1])
        self.norm = eqx.nn.LayerNorm(size)
        self.head = eqx.nn.Linear(size, 10, key=keys[-1])

    def __call__(self, tokens: Int[Array, " seq"]) -> Float[Array, " 10"]:
        x = jax.vmap(self.tokens)(tokens) + jax.vmap(self.positions)(jnp.arange(tokens.shape[0]))
        for layer in self.layers:
            x = layer(x)
        return self.head(jnp.mean(jax.vmap(self.norm)(x), axis=0))


def loss(model: Transformer, batch: tuple[Int[Array, "n seq"], Int[Array, " n"]]) -> Float[Array, ""]:
    """Mean softmax cross-entropy."""
    tokens, labels = batch
    return cross_entropy(jax.vmap(model)(tokens), labels)


def _tokens(pixels: Array) -> Array:
    return jnp.round(pixels * (_VOCABULARY - 1)).astype(jnp.int32)


def problem(key: PRNGKeyArray, batch_size: int = 128) -> Problem:
    """The transformer on the digits as sequences of pixel-intensity tokens."""
    return Problem(
        name="transformer",
        model=Transformer(key),
        loss=loss,
        next_batch=digit_batches(batch_size, _tokens),
        batch_size=batch_size,
    )
