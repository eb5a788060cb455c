"""What every zoo model provides: `ZooProblem`, and the digits data they share.

A zoo problem is a model written the way Equinox's documentation writes models (per-example
`__call__`, `jax.vmap` over the batch), its loss registered with eqx_kfac (an identity at run time,
so Adam trains the same function), and a stream of batches.

The loss has the form `Optimizer` calls: `loss(model, [func_state], [key], batch)`, returning the
loss, or `(loss, func_state)` for a stateful model (BatchNorm). `next_batch(model, step, key,
previous)` returns the batch of a step: a minibatch of digits, or Monte Carlo samples of the current
wavefunction moved on from the previous step's (`None` at the first step) for the variational Monte
Carlo problem.
"""

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

import eqx_kfac


@dataclasses.dataclass(frozen=True)
class ZooProblem:
    """One model of the zoo and everything needed to train it.

    **Fields:**

    - `name`: the model's name in tables and test ids.
    - `model`: the initial model (an `eqx.Module`; its inexact arrays are the parameters).
    - `loss`: `loss(model, [func_state], [key], batch)`; registers its losses with eqx_kfac.
    - `next_batch`: `next_batch(model, step, key, previous) -> batch` (`previous` is the last
      step's batch, `None` at the first).
    - `func_state`: the initial `eqx.nn.State` when the model is stateful, else `None`.
    - `has_rng`: whether `loss` takes a PRNG key (dropout).
    - `batch_size`: the number of examples per batch.
    - `exact_loss`: the loss at the optimum when it is known (the ground-state energy of the
      variational Monte Carlo problem), else `None`.
    """

    name: str
    model: Any
    loss: Callable[..., Any]
    next_batch: Callable[[Any, int, Any, Any], Any]
    func_state: Any = None
    has_rng: bool = False
    batch_size: int = 128
    exact_loss: float | None = None

    @property
    def has_state(self) -> bool:
        """Whether the model carries an `eqx.nn.State` (its loss returns `(loss, state)`)."""
        return self.func_state is not None


@functools.cache
def _digits() -> tuple[np.ndarray, np.ndarray]:
    from sklearn.datasets import load_digits

    data = load_digits()
    return (data.data / 16.0).astype(np.float32), data.target.astype(np.int32)


def digits(dtype: Any = None) -> tuple[Float[Array, "n 64"], Int[Array, " n"]]:
    """scikit-learn's bundled 8x8 digits: pixels scaled to [0, 1], and labels (nothing downloaded).

    **Arguments:**

    - `dtype`: the pixels' dtype (default: JAX's default float, as the models' parameters).

    **Returns:**

    `(images, labels)` of shapes `(1797, 64)` and `(1797,)`.
    """
    images, labels = _digits()
    return jnp.asarray(images, dtype or jnp.result_type(float)), jnp.asarray(labels)


def digit_batches(
    batch_size: int,
    transform: Callable[[Array], Any] = lambda x: x,
    dtype: Any = None,
    seed: int | None = None,
) -> Callable[..., tuple[Any, Array]]:
    """`next_batch` for a digits classifier: minibatches without replacement.

    **Arguments:**

    - `batch_size`: examples per batch (the last incomplete batch of an epoch is dropped).
    - `transform`: maps a `(batch, 64)` block of pixels to the model's inputs (e.g. images).
    - `dtype`: the pixels' dtype (default: JAX's default float).
    - `seed`: `None` (default): one fixed permutation, cycled; an integer: a new permutation in
      every epoch, drawn from `(seed, epoch)`.

    **Returns:**

    `next_batch(model, step, key, previous) -> (inputs, labels)`, the same batch for the same
    step.
    """
    images, labels = digits(dtype)
    per_epoch = images.shape[0] // batch_size
    fixed = np.random.default_rng(0).permutation(images.shape[0])

    def next_batch(model: Any, step: int, key: Any, previous: Any = None) -> tuple[Any, Array]:
        del model, key, previous
        epoch, index = divmod(step, per_epoch)
        order = fixed if seed is None else np.random.default_rng((seed, epoch)).permutation(len(fixed))
        rows = order[index * batch_size : (index + 1) * batch_size]
        return transform(images[rows]), labels[rows]

    return next_batch


def cross_entropy(logits: Float[Array, "n k"], labels: Int[Array, " n"]) -> Float[Array, ""]:
    """Registers softmax cross-entropy with eqx_kfac and returns its mean over the batch.

    **Arguments:**

    - `logits`: `(batch, classes)`.
    - `labels`: `(batch,)` integer labels.

    **Returns:**

    The mean negative log-likelihood.
    """
    eqx_kfac.register_softmax_cross_entropy_loss(logits, labels)
    log_p = jax.nn.log_softmax(logits)
    return -jnp.mean(jnp.take_along_axis(log_p, labels[:, None], axis=1))
