"""The loss the zoo's classifiers share: softmax cross-entropy, registered with eqx_kfac."""

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

import eqx_kfac


def cross_entropy(logits: Float[Array, "n k"], labels: Int[Array, " n"]) -> Float[Array, ""]:
    """Registers softmax cross-entropy with eqx_kfac and returns its mean over the batch.

    **Arguments:**

    - `logits`: `(batch, classes)` (log-probabilities too: their log-softmax is themselves).
    - `labels`: `(batch,)` integer labels.

    **Returns:**

    The mean negative log-likelihood.
    """
    eqx_kfac.register_softmax_cross_entropy_loss(logits, labels)
    log_p = jax.nn.log_softmax(logits)
    return -jnp.mean(jnp.take_along_axis(log_p, labels[:, None], axis=1))
