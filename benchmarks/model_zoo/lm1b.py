"""Flax's lm1b transformer (`benchmarks/flax_suite/models.py`, as `examples/lm1b/models.py` writes
it in Linen) on the same text, splits and batches as the GPT of `gpt.py`, for
`benchmarks/language_model.py --model lm1b`.

lm1b's model shifts its inputs right itself and predicts every position of a window, so a window
of `length` characters is `length` predictions (ids from 1: lm1b reserves 0 for padding, which
its loss masks out; the text has none). Its config's proportions at this width: 4 heads, an MLP
4x the width, no tied head. The loss is the example's: the mean cross-entropy over the
non-padding positions, registered with `mean_over="all"`.
"""

import equinox as eqx
import jax.numpy as jnp
import optax
from jaxtyping import Array, Float, Int, PRNGKeyArray

import eqx_kfac

from ..flax_suite.models import TransformerLM
from ..harness import Problem
from . import gpt


class LM1B(eqx.Module):
    """lm1b's Linen module (a static field: Linen modules hash by their settings) and its
    parameters; called on a batch of windows, the logits of every position."""

    module: TransformerLM = eqx.field(static=True)
    params: dict

    def __call__(self, batch: Int[Array, "n length"]) -> Float[Array, "n length vocabulary"]:
        return self.module.apply({"params": self.params}, batch)


def _masked_mean(logits: Float[Array, "n length vocabulary"], batch: Int[Array, "n length"]) -> Float[Array, ""]:
    """The mean cross-entropy of `logits` against `batch` over its non-padding positions."""
    per_token = optax.softmax_cross_entropy_with_integer_labels(logits, batch)
    weights = (batch > 0).astype(per_token.dtype)
    return jnp.sum(per_token * weights) / jnp.sum(weights)


def mean_cross_entropy(model: LM1B, batch: Int[Array, "n length"]) -> Float[Array, ""]:
    """The mean next-character cross-entropy over the non-padding positions (no registration)."""
    return _masked_mean(model(batch), batch)


def loss(model: LM1B, batch: Int[Array, "n length"]) -> Float[Array, ""]:
    """`mean_cross_entropy`, its loss registered as the mean over the non-padding positions."""
    logits = model(batch)
    mask = (batch > 0).astype(logits.dtype)
    eqx_kfac.register_softmax_cross_entropy_loss(logits, batch, mask=mask, mean_over="all")
    return _masked_mean(logits, batch)


def validation_batch(length: int, count: int = 256, corpus: str = "topics") -> Int[Array, "count length"]:
    """`count` evenly spaced windows of `length` characters of the held-out text (the GPT's
    windows, ids shifted by one)."""
    return gpt.validation_batch(length - 1, count, corpus) + 1


def problem(
    key: PRNGKeyArray, *, width: int = 128, depth: int = 2, length: int = 64, batch_size: int = 32,
    corpus: str = "topics",
) -> Problem:
    """lm1b's `Problem` (`name` `"lm1b"`, its `model` an `LM1B`; see the module docstring).

    **Arguments:**

    - `key`: the initial parameters' key.
    - `width`, `depth`: the embedding width and the number of blocks.
    - `length`: characters per window (each one predicted).
    - `batch_size`: windows per batch.
    - `corpus`: a key of `gpt.CORPORA`.
    """
    module = TransformerLM(gpt.vocabulary_size(corpus) + 1, width, 4, 4 * width, depth)
    train = gpt.train_ids(corpus) + 1
    model = LM1B(module, module.init(key, train[None, :length])["params"])
    return Problem(
        name="lm1b",
        model=model,
        loss=loss,
        next_batch=lambda model, step, key, previous: gpt.windows(train, key, batch_size, length),
        batch_size=batch_size,
    )
