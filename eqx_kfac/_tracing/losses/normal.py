"""Normal predictive distributions: fixed variance, and predicted mean and variance."""

import math
from collections.abc import Sequence
from typing import ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Float, PRNGKeyArray, Real

from .base import AbstractFisherAsGGNLoss, as_scalar, as_weight, check_inputs, check_shape


class NormalMeanNegativeLogProbLoss(AbstractFisherAsGGNLoss):
    """Negative log-likelihood of a normal distribution with a predicted mean and fixed variance.

    The loss of one example is `‖t - mean‖² / (2 variance)` (plus the log-normaliser
    `(d/2) log(2π variance)` when `normalize_log_prob`); its Fisher, GGN and Hessian with respect
    to the mean are `I / variance`. With `variance=0.5` and no normaliser this is the squared error
    `‖t - mean‖²`.

    **Fields:**

    - `mean`: the predicted means, shape `(*batch, d)`.
    - `targets`: optional targets of the same shape.
    - `variance`: scalar variance.
    - `weight`: coefficient of the loss: a scalar, or one per example (shaped like the
      leading batch axes of the inputs).
    - `normalize_log_prob`: whether `evaluate` includes the log-normaliser.
    """

    mean: Float[Array, "*batch d"]
    targets: Float[Array, "*batch d"] | None
    variance: Float[Array, ""]
    weight: Real[Array, "..."]
    normalize_log_prob: bool = eqx.field(static=True)

    def __init__(
        self,
        mean: Float[Array, "*batch d"],
        targets: Float[Array, "*batch d"] | None = None,
        variance: Real[ArrayLike, ""] = 0.5,
        weight: Real[ArrayLike, "..."] = 1.0,
        normalize_log_prob: bool = True,
    ):
        """**Arguments:** as the fields; `variance` and `weight` may be Python numbers."""
        check_inputs(mean, "mean", type(self).__name__)
        check_shape(type(self).__name__, "targets", targets, mean.shape, "mean.shape")
        self.mean = mean
        self.targets = targets
        self.variance = as_scalar(variance, "variance").astype(mean.dtype)
        self.weight = as_weight(weight, mean, type(self).__name__)
        self.normalize_log_prob = normalize_log_prob

    input_fields: ClassVar[tuple[str, ...]] = ("mean",)

    def evaluate_unweighted(self, targets: Array) -> Array:
        loss = 0.5 * jnp.sum(jnp.square(targets - self.mean), axis=-1) / self.variance
        if self.normalize_log_prob:
            loss = loss + 0.5 * self.mean.shape[-1] * jnp.log(2 * math.pi * self.variance)
        return loss

    def sample(self, key: PRNGKeyArray) -> Array:
        noise = jax.random.normal(key, self.mean.shape, self.dtype)
        return self.mean + jnp.sqrt(self.variance) * noise

    @property
    def fisher_factor_inner_shape(self) -> tuple[int, ...]:
        return self.mean.shape

    def multiply_fisher_unweighted(self, vector: Sequence[Array]) -> tuple[Array, ...]:
        return (vector[0] / self.variance,)

    def multiply_fisher_factor_unweighted(self, vector: Array) -> tuple[Array, ...]:
        return (vector / jnp.sqrt(self.variance),)

    def multiply_fisher_factor_transpose_unweighted(self, vector: Sequence[Array]) -> Array:
        return vector[0] / jnp.sqrt(self.variance)


class NormalMeanVarianceNegativeLogProbLoss(AbstractFisherAsGGNLoss):
    """Negative log-likelihood of a normal distribution with predicted mean and variance.

    The loss of one example is `Σ_i [log(2π v_i) + (t_i - m_i)² / v_i] / 2` over the event axis.
    The Fisher with respect to `(mean, variance)` is diagonal, `1 / v` for the means and
    `1 / (2 v²)` for the variances; its factor's inner space is the means' coordinates followed by
    the variances' along the last axis (shape `(*batch, 2d)`).

    The Hessian of this loss is indefinite in the variance (the parameters are not natural), so the
    GGN is *defined* to be the Fisher, i.e. the expected Hessian under the model's distribution.

    **Fields:**

    - `mean`: the predicted means, shape `(*batch, d)`.
    - `variance`: the predicted variances (positive), same shape.
    - `targets`: optional targets of the same shape.
    - `weight`: coefficient of the loss: a scalar, or one per example (shaped like the
      leading batch axes of the inputs).
    """

    mean: Float[Array, "*batch d"]
    variance: Float[Array, "*batch d"]
    targets: Float[Array, "*batch d"] | None
    weight: Real[Array, "..."]

    def __init__(
        self,
        mean: Float[Array, "*batch d"],
        variance: Float[Array, "*batch d"],
        targets: Float[Array, "*batch d"] | None = None,
        weight: Real[ArrayLike, "..."] = 1.0,
    ):
        """**Arguments:** as the fields; `weight` may be a Python number."""
        name = type(self).__name__
        check_inputs(mean, "mean", name)
        check_shape(name, "variance", variance, mean.shape, "mean.shape")
        check_shape(name, "targets", targets, mean.shape, "mean.shape")
        self.mean = mean
        self.variance = variance
        self.targets = targets
        self.weight = as_weight(weight, mean, name)

    input_fields: ClassVar[tuple[str, ...]] = ("mean", "variance")

    def evaluate_unweighted(self, targets: Array) -> Array:
        per_dim = jnp.log(2 * math.pi * self.variance) + jnp.square(targets - self.mean) / (
            self.variance
        )
        return 0.5 * jnp.sum(per_dim, axis=-1)

    def sample(self, key: PRNGKeyArray) -> Array:
        noise = jax.random.normal(key, self.mean.shape, self.dtype)
        return self.mean + jnp.sqrt(self.variance) * noise

    @property
    def fisher_factor_inner_shape(self) -> tuple[int, ...]:
        return (*self.mean.shape[:-1], 2 * self.mean.shape[-1])

    def _factor_diagonals(self) -> tuple[Array, Array]:
        return jax.lax.rsqrt(self.variance), 1 / (math.sqrt(2) * self.variance)

    def multiply_fisher_unweighted(self, vector: Sequence[Array]) -> tuple[Array, ...]:
        mean_vector, variance_vector = vector
        return mean_vector / self.variance, variance_vector / (2 * jnp.square(self.variance))

    def multiply_fisher_factor_unweighted(self, vector: Array) -> tuple[Array, ...]:
        mean_factor, variance_factor = self._factor_diagonals()
        mean_vector, variance_vector = jnp.split(vector, 2, axis=-1)
        return mean_factor * mean_vector, variance_factor * variance_vector

    def multiply_fisher_factor_transpose_unweighted(self, vector: Sequence[Array]) -> Array:
        mean_factor, variance_factor = self._factor_diagonals()
        mean_vector, variance_vector = vector
        return jnp.concatenate([mean_factor * mean_vector, variance_factor * variance_vector], -1)
