"""The benchmark problems: scikit-learn's bundled digits, two Equinox models, their losses.

Everything here is local: `sklearn.datasets.load_digits` reads the 1,797 8x8 images that ship
with scikit-learn, so nothing is downloaded. Pixels (0..16) are scaled to [0, 1].

- `classifier`: MLP 64-128-128-10, tanh, softmax cross-entropy, averaged over the batch.
- `autoencoder`: 64-256-128-64-16-64-128-256-64, tanh on every hidden layer, linear output logits,
  sigmoid cross-entropy against the pixels, summed over the 64 outputs and averaged over the batch
  (the convention of the K-FAC paper's autoencoders).

Both data losses register themselves with eqx_kfac (an identity at run time, so the same
function serves Adam, SGD and K-FAC). The trained objective adds `l2_reg / 2 * |θ|²`, the
convention `Optimizer(l2_reg=...)` expects; K-FAC traces the whole objective (automatic registration
ignores uses of a parameter, such as the regulariser, that the registered losses do not depend on).
"""

import dataclasses
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int, PRNGKeyArray

import eqx_kfac


L2_REG = 1e-5
CLASSIFIER_SIZES = (64, 128, 128, 10)
AUTOENCODER_SIZES = (64, 256, 128, 64, 16, 64, 128, 256, 64)


class TanhNet(eqx.Module):
    """A stack of `eqx.nn.Linear` layers with tanh between them and a linear output (one example).

    Weights are drawn from a truncated normal with standard deviation `1/sqrt(fan_in)` and biases
    start at zero: Haiku's default initialisation, so the problem is the one kfac-jax users run.
    """

    layers: tuple[eqx.nn.Linear, ...]

    def __init__(self, sizes: tuple[int, ...], key: PRNGKeyArray):
        layers = []
        for n_in, n_out, k in zip(sizes[:-1], sizes[1:], jax.random.split(key, len(sizes) - 1)):
            layer = eqx.nn.Linear(n_in, n_out, key=k)
            # The truncation at two standard deviations shrinks the spread; rescale it back.
            std = 1.0 / (np.sqrt(n_in) * 0.87962566103423978)
            weight = std * jax.random.truncated_normal(k, -2.0, 2.0, (n_out, n_in))
            layers.append(eqx.tree_at(lambda m: (m.weight, m.bias), layer, (weight, jnp.zeros(n_out))))
        self.layers = tuple(layers)

    def __call__(self, x: Float[Array, " in"]) -> Float[Array, " out"]:
        for layer in self.layers[:-1]:
            x = jnp.tanh(layer(x))
        return self.layers[-1](x)


def l2_penalty(model: Any, l2_reg: float) -> Float[Array, ""]:
    """`l2_reg / 2` times the squared norm of the model's inexact arrays."""
    leaves = jax.tree.leaves(eqx.filter(model, eqx.is_inexact_array))
    return 0.5 * l2_reg * sum(jnp.sum(leaf**2) for leaf in leaves)


def classifier_loss(
    model: TanhNet, batch: tuple[Float[Array, "n 64"], Int[Array, " n"]]
) -> Float[Array, ""]:
    """Mean softmax cross-entropy of the digit labels."""
    x, labels = batch
    logits = jax.vmap(model)(x)
    eqx_kfac.register_softmax_cross_entropy_loss(logits, labels)
    log_p = jax.nn.log_softmax(logits)
    nll = -jnp.take_along_axis(log_p, labels[:, None], axis=1)[:, 0]
    return jnp.mean(nll)


def autoencoder_loss(model: TanhNet, batch: Float[Array, "n 64"]) -> Float[Array, ""]:
    """Sigmoid cross-entropy of the reconstruction, summed over pixels, averaged over the batch."""
    logits = jax.vmap(model)(batch)
    eqx_kfac.register_sigmoid_cross_entropy_loss(logits, batch)
    per_example = jnp.sum(jax.nn.softplus(logits) - batch * logits, axis=-1)
    return jnp.mean(per_example)


def with_l2(data_loss: Callable[[Any, Any], Array]) -> Callable[[Any, Any], Array]:
    """`data_loss` plus `L2_REG / 2 * |θ|²`."""

    def loss(model: Any, batch: Any) -> Float[Array, ""]:
        return data_loss(model, batch) + l2_penalty(model, L2_REG)

    return loss


# eq=False: hashed by identity, since the batch arrays are not hashable and jit treats the
# problem's functions as static.
@dataclasses.dataclass(frozen=True, eq=False)
class Problem:
    """A full-batch training problem and the learning-rate grids of its first-order baselines.

    **Fields:**

    - `name`: the problem's name on the command line and in the table.
    - `make_model`: `key -> model`.
    - `loss`: the trained objective, the data loss (which registers itself for K-FAC) plus
      `L2_REG / 2 * |θ|²`.
    - `batch`: the whole data set, as the losses take it.
    - `adam_lrs`, `sgd_lrs`: the learning rates tried for Adam and SGD with momentum 0.9 (the
      grids bracket the best rate: one step larger is unstable or no better, see
      docs/benchmarks.md).
    """

    name: str
    make_model: Callable[[PRNGKeyArray], Any]
    loss: Callable[[Any, Any], Array]
    batch: Any
    adam_lrs: tuple[float, ...]
    sgd_lrs: tuple[float, ...]


def load_digits(dtype: Any = jnp.float32) -> tuple[Float[Array, "1797 64"], Int[Array, " 1797"]]:
    """The digits images scaled to [0, 1] (from 0..16) and their labels, as JAX arrays.

    **Arguments:**

    - `dtype`: the floating dtype of the images.

    **Returns:**

    `(images, labels)` of shapes `(1797, 64)` and `(1797,)`.
    """
    # Imported here so that importing this module (e.g. for its models) does not need scikit-learn.
    from sklearn.datasets import load_digits as sklearn_load_digits

    digits = sklearn_load_digits()
    images = np.asarray(digits.data, np.float64) / 16.0
    return jnp.asarray(images, dtype), jnp.asarray(digits.target, jnp.int32)


def make_problems(dtype: Any = jnp.float32, num_examples: int | None = None) -> dict[str, Problem]:
    """The benchmark problems, by name.

    **Arguments:**

    - `dtype`: the floating dtype of the data and the models.
    - `num_examples`: use only the first `num_examples` images (tests); `None` for all 1,797.

    **Returns:**

    `{"classifier": Problem, "autoencoder": Problem}`.
    """
    images, labels = load_digits(dtype)
    images, labels = images[:num_examples], labels[:num_examples]

    def model_maker(sizes):
        def make(key):
            model = TanhNet(sizes, key)
            return jax.tree.map(
                lambda leaf: leaf.astype(dtype) if eqx.is_inexact_array(leaf) else leaf, model
            )

        return make

    return {
        "classifier": Problem(
            name="classifier",
            make_model=model_maker(CLASSIFIER_SIZES),
            loss=with_l2(classifier_loss),
            batch=(images, labels),
            adam_lrs=(3e-4, 1e-3, 3e-3, 1e-2),
            sgd_lrs=(1e-1, 3e-1),
        ),
        "autoencoder": Problem(
            name="autoencoder",
            make_model=model_maker(AUTOENCODER_SIZES),
            loss=with_l2(autoencoder_loss),
            batch=images,
            adam_lrs=(3e-4, 1e-3, 3e-3, 1e-2),
            sgd_lrs=(1e-2, 3e-2),
        ),
    }
