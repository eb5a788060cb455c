"""The tanh network, and the main job's two full-batch problems on the digits.

`TanhMLP` is a stack of `eqx.nn.Linear` layers with tanh between them. The main job
(`benchmarks/run.py`) and `benchmarks/alternatives.py` train it on all 1,797 digits at every step:

- `classifier`: 64-128-128-10, softmax cross-entropy, averaged over the batch;
- `autoencoder`: 64-256-128-64-16-64-128-256-64, linear output logits, sigmoid cross-entropy
  against the pixels, summed over the 64 outputs and averaged over the batch (the convention of
  the K-FAC paper's autoencoders).

Both start from Haiku's initialisation (the problem kfac-jax users run) and add
`L2_REG / 2 * |θ|²` to the data loss, the convention `Optimizer(l2_reg=...)` expects; K-FAC traces
the whole objective (automatic registration ignores uses of a parameter, such as the regulariser,
that the registered losses do not depend on). The timing benchmarks keep Equinox's initialisation.
"""

from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int, PRNGKeyArray

import eqx_kfac

from ..harness import Problem, digits, full_batch
from .losses import cross_entropy

L2_REG = 1e-5
SIZES = {"classifier": (64, 128, 128, 10), "autoencoder": (64, 256, 128, 64, 16, 64, 128, 256, 64)}


class TanhMLP(eqx.Module):
    """Linear layers of widths `sizes`, tanh after each but the last (one example at a time)."""

    layers: tuple[eqx.nn.Linear, ...]

    def __init__(self, sizes: tuple[int, ...], key: PRNGKeyArray, haiku_init: bool = False):
        """**Arguments:**

        - `sizes`: the widths, input first.
        - `key`: a PRNG key.
        - `haiku_init`: Haiku's initialisation (weights from a truncated normal with standard
          deviation `1/sqrt(fan_in)`, zero biases) instead of Equinox's (uniform weights and
          biases).
        """
        layers = []
        for n_in, n_out, k in zip(sizes[:-1], sizes[1:], jax.random.split(key, len(sizes) - 1)):
            layer = eqx.nn.Linear(n_in, n_out, key=k)
            if haiku_init:
                # The truncation at two standard deviations shrinks the spread; rescale it back.
                std = 1.0 / (np.sqrt(n_in) * 0.87962566103423978)
                weight = std * jax.random.truncated_normal(k, -2.0, 2.0, (n_out, n_in))
                layer = eqx.tree_at(lambda m: (m.weight, m.bias), layer, (weight, jnp.zeros(n_out)))
            layers.append(layer)
        self.layers = tuple(layers)

    def __call__(self, x: Float[Array, " in"]) -> Float[Array, " out"]:
        for layer in self.layers[:-1]:
            x = jnp.tanh(layer(x))
        return self.layers[-1](x)


def l2_penalty(model: Any, l2_reg: float) -> Float[Array, ""]:
    """`l2_reg / 2` times the squared norm of the model's inexact arrays."""
    leaves = jax.tree.leaves(eqx.filter(model, eqx.is_inexact_array))
    return 0.5 * l2_reg * sum(jnp.sum(leaf**2) for leaf in leaves)


def classifier_loss(model: TanhMLP, batch: tuple[Float[Array, "n 64"], Int[Array, " n"]]) -> Float[Array, ""]:
    """Mean softmax cross-entropy of the digit labels, plus the L2 term."""
    x, labels = batch
    return cross_entropy(jax.vmap(model)(x), labels) + l2_penalty(model, L2_REG)


def autoencoder_data_loss(model: TanhMLP, batch: Float[Array, "n d"]) -> Float[Array, ""]:
    """Sigmoid cross-entropy of the reconstruction, summed over pixels, averaged over the batch."""
    logits = jax.vmap(model)(batch)
    eqx_kfac.register_sigmoid_cross_entropy_loss(logits, batch)
    return jnp.mean(jnp.sum(jax.nn.softplus(logits) - batch * logits, axis=-1))


def autoencoder_loss(model: TanhMLP, batch: Float[Array, "n d"]) -> Float[Array, ""]:
    """`autoencoder_data_loss` plus the L2 term."""
    return autoencoder_data_loss(model, batch) + l2_penalty(model, L2_REG)


@eqx.filter_jit
def _initial_model(sizes: tuple[int, ...], key: PRNGKeyArray, dtype: Any) -> TanhMLP:
    """`TanhMLP` with Haiku's initialisation in `dtype`, built under jit: one compilation instead of
    one per operation and layer shape (3.0 against 7.9 s for the autoencoder in the tests)."""
    model = TanhMLP(sizes, key, haiku_init=True)
    return jax.tree.map(lambda leaf: leaf.astype(dtype) if eqx.is_inexact_array(leaf) else leaf, model)


def problem(name: str, key: PRNGKeyArray, dtype: Any = None, num_examples: int | None = None) -> Problem:
    """One of the main job's full-batch problems.

    **Arguments:**

    - `name`: `"classifier"` or `"autoencoder"`.
    - `key`: the initial parameters' key.
    - `dtype`: the data's and the parameters' floating dtype (default: JAX's default float).
    - `num_examples`: use only the first `num_examples` images (tests); `None` for all 1,797.

    **Returns:**

    The `Problem`; its batch is the whole data set.
    """
    images, labels = digits(dtype)
    images, labels = images[:num_examples], labels[:num_examples]
    model = _initial_model(SIZES[name], key, images.dtype)
    if name == "classifier":
        return full_batch(name, model, classifier_loss, (images, labels))
    return full_batch(name, model, autoencoder_loss, images)
