"""A decoder-only transformer (a small GPT) on the characters of Python's own help topics (or of
its standard library's sources).

The model is written as Equinox users write one: token and position `eqx.nn.Embedding`s, pre-norm
blocks (`eqx.nn.RMSNorm`, causal `eqx.nn.MultiheadAttention`, a 4x GELU MLP of two
`eqx.nn.Linear`s), a final `RMSNorm` and an output head, untied (its own `Linear`) or tied (the
token table's transpose). `__call__` maps one sequence of ids to its next-character logits.

The text (`benchmarks.harness.topics_text`, 465 thousand characters; with `corpus="stdlib"`,
`stdlib_text`, 12.1 million) is split in order: the last tenth is held out. A training batch is
`batch_size` windows of `length + 1` characters at random offsets of the first nine tenths
(drawn from the step's key, so every method of a seed sees the same batches); `validation_batch`
is evenly spaced windows of the held-out tenth. The loss is the mean cross-entropy over every
predicted character, registered with `mean_over="all"`.
"""

import functools

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jaxtyping import Array, Float, Int, PRNGKeyArray

import eqx_kfac

from ..harness import Problem, stdlib_text, topics_text

HELD_OUT = 0.1


# The corpora (`problem(corpus=...)`): Python's help topics, or its standard library's sources.
CORPORA = {"topics": topics_text, "stdlib": stdlib_text}


@functools.cache
def _splits(corpus: str) -> tuple[np.ndarray, np.ndarray, int]:
    # Ids in code point order (as `sorted(set(text))`).
    code_points = np.frombuffer(CORPORA[corpus]().encode("utf-32-le"), np.uint32)
    characters, ids = np.unique(code_points, return_inverse=True)
    ids = ids.astype(np.int32)
    cut = int(len(ids) * (1 - HELD_OUT))
    return ids[:cut], ids[cut:], len(characters)


def train_ids(corpus: str = "topics") -> Int[Array, " characters"]:
    """The first nine tenths of the corpus, as character ids from 0."""
    return jnp.asarray(_splits(corpus)[0])


def vocabulary_size(corpus: str = "topics") -> int:
    """The number of distinct characters of the corpus (103 for the help topics)."""
    return _splits(corpus)[2]


class Block(eqx.Module):
    """A pre-norm transformer block: causal self-attention and a 4x MLP, each with a residual."""

    norm1: eqx.nn.RMSNorm
    attention: eqx.nn.MultiheadAttention
    norm2: eqx.nn.RMSNorm
    up: eqx.nn.Linear
    down: eqx.nn.Linear

    def __init__(self, width: int, heads: int, key: PRNGKeyArray):
        k1, k2, k3 = jax.random.split(key, 3)
        self.norm1 = eqx.nn.RMSNorm(width)
        self.attention = eqx.nn.MultiheadAttention(heads, width, key=k1)
        self.norm2 = eqx.nn.RMSNorm(width)
        self.up = eqx.nn.Linear(width, 4 * width, key=k2)
        self.down = eqx.nn.Linear(4 * width, width, key=k3)

    def __call__(self, x: Float[Array, "seq width"]) -> Float[Array, "seq width"]:
        causal = jnp.tril(jnp.ones((x.shape[0], x.shape[0]), bool))
        y = jax.vmap(self.norm1)(x)
        x = x + self.attention(y, y, y, mask=causal)
        y = jax.vmap(self.norm2)(x)
        return x + jax.vmap(self.down)(jax.nn.gelu(jax.vmap(self.up)(y)))


class GPT(eqx.Module):
    """Token and position embeddings, `depth` blocks, a final RMSNorm and the output head
    (`head=None`: tied to the token table)."""

    tokens: eqx.nn.Embedding
    positions: eqx.nn.Embedding
    blocks: tuple[Block, ...]
    norm: eqx.nn.RMSNorm
    head: eqx.nn.Linear | None

    def __init__(
        self, key: PRNGKeyArray, vocabulary: int, length: int, width: int = 128, depth: int = 2,
        heads: int = 4, tied: bool = False,
    ):
        keys = jax.random.split(key, depth + 3)
        self.tokens = eqx.nn.Embedding(vocabulary, width, key=keys[0])
        self.positions = eqx.nn.Embedding(length, width, key=keys[1])
        self.blocks = tuple(Block(width, heads, k) for k in keys[2:-1])
        self.norm = eqx.nn.RMSNorm(width)
        self.head = None if tied else eqx.nn.Linear(width, vocabulary, use_bias=False, key=keys[-1])

    def __call__(self, ids: Int[Array, " seq"]) -> Float[Array, "seq vocabulary"]:
        x = jax.vmap(self.tokens)(ids) + jax.vmap(self.positions)(jnp.arange(ids.shape[0]))
        for block in self.blocks:
            x = block(x)
        x = jax.vmap(self.norm)(x)
        return x @ self.tokens.weight.T if self.head is None else jax.vmap(self.head)(x)


def mean_cross_entropy(model: GPT, batch: Int[Array, "n length_plus_one"]) -> Float[Array, ""]:
    """The mean next-character cross-entropy over every position of `batch` (no registration)."""
    logits = jax.vmap(model)(batch[:, :-1])
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]))


def loss(model: GPT, batch: Int[Array, "n length_plus_one"]) -> Float[Array, ""]:
    """`mean_cross_entropy`, its loss registered as a mean over batch and positions."""
    inputs, targets = batch[:, :-1], batch[:, 1:]
    logits = jax.vmap(model)(inputs)
    eqx_kfac.register_softmax_cross_entropy_loss(logits, targets, mean_over="all")
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, targets))


@functools.partial(jax.jit, static_argnums=(2, 3))
def windows(ids: Int[Array, " characters"], key: PRNGKeyArray, count: int, length: int) -> Int[Array, "count length"]:
    """`count` windows of `length` ids of `ids` at random offsets drawn from `key`."""
    starts = jax.random.randint(key, (count,), 0, ids.shape[0] - length)
    return ids[starts[:, None] + jnp.arange(length)]


def validation_batch(length: int, count: int = 256, corpus: str = "topics") -> Int[Array, "count length_plus_one"]:
    """`count` evenly spaced windows of `length + 1` characters of the held-out text."""
    held_out = _splits(corpus)[1]
    starts = np.linspace(0, len(held_out) - length - 1, count).astype(int)
    return jnp.asarray(np.stack([held_out[s : s + length + 1] for s in starts]))


def problem(
    key: PRNGKeyArray, *, width: int = 128, depth: int = 2, heads: int = 4, length: int = 64,
    batch_size: int = 32, tied: bool = False, corpus: str = "topics",
) -> Problem:
    """The language model's `Problem` (see the module docstring).

    **Arguments:**

    - `key`: the initial parameters' key.
    - `width`, `depth`, `heads`: the model's width, number of blocks and attention heads.
    - `length`: the context (characters predicted per window).
    - `batch_size`: windows per batch.
    - `tied`: tie the output head to the token table.
    - `corpus`: a key of `CORPORA`.

    **Returns:**

    The `Problem` (`name` `"gpt"`).
    """
    train = train_ids(corpus)
    model = GPT(key, vocabulary_size(corpus), length, width, depth, heads, tied)
    return Problem(
        name="gpt",
        model=model,
        loss=loss,
        next_batch=lambda model, step, key, previous: windows(train, key, batch_size, length + 1),
        batch_size=batch_size,
    )
