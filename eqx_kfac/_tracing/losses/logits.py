"""Losses on logits: independent Bernoulli outputs and categorical distributions."""

from collections.abc import Sequence
from typing import Any, ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Bool, Float, Int, PRNGKeyArray, Real

from .base import AbstractFisherAsGGNLoss, apply_mask, as_weight, check_inputs, check_shape


def _set_fields(
    loss: Any,
    logits: Array,
    targets: Array | None,
    mask: Array | None,
    weight: Real[ArrayLike, "..."],
    targets_per_class: bool,
    mask_per_class: bool,
) -> None:
    """Checks and sets the fields of a logits loss being initialised.

    `targets` and `mask` are shaped like `logits` when `*_per_class`, like `logits.shape[:-1]`
    (one per example) otherwise.
    """
    name = type(loss).__name__
    check_inputs(logits, "logits", name)
    fields = (("targets", targets, targets_per_class), ("mask", mask, mask_per_class))
    for field, value, per_class in fields:
        if per_class:
            check_shape(name, field, value, logits.shape, "logits.shape")
        else:
            check_shape(name, field, value, logits.shape[:-1], "logits.shape[:-1]")
    loss.logits = logits
    loss.targets = targets
    loss.mask = mask
    loss.weight = as_weight(weight, logits, name)


def check_class_labels(targets: Array | None, logits_shape: tuple[int, ...], where: str) -> None:
    """Raises `TypeError` unless `targets` (class labels, one per example) are integers.

    **Arguments:**

    - `targets`: the labels, or `None`.
    - `logits_shape`: the shape of the logits they index.
    - `where`: the loss or `register_*` function taking them, for the message.
    """
    if targets is not None and not jnp.issubdtype(targets.dtype, jnp.integer):
        raise TypeError(
            f"{where}: `targets` of shape {targets.shape} are read as class labels (one per "
            f"example), which must be integers, but they have dtype {targets.dtype}. Pass integer "
            "class labels (e.g. `labels.astype(jnp.int32)`), or one-hot (or probability) targets "
            f"of the shape of the logits {tuple(logits_shape)}, which select the one-hot loss."
        )


class MultiBernoulliNegativeLogProbLoss(AbstractFisherAsGGNLoss):
    """Negative log-likelihood of independent Bernoulli outputs given by logits.

    The loss of one example is the sigmoid cross-entropy summed over the event axis,
    `Σ_i [softplus(l_i) - t_i l_i]`. The Fisher (= Hessian) is `diag(p (1 - p))` with
    `p = sigmoid(l)`, and the factor is its square root `diag(1 / (2 cosh(l / 2)))`.

    **Fields:**

    - `logits`: shape `(*batch, d)`.
    - `targets`: optional targets in `[0, 1]` (usually `{0, 1}`), same shape.
    - `mask`: optional non-negative (usually 0/1) mask of the same shape, multiplying each output's
      loss (its factor by the square root); masked outputs contribute nothing.
    - `weight`: coefficient of the loss: a scalar, or one per example (shaped like the
      leading batch axes of the inputs).
    """

    logits: Float[Array, "*batch d"]
    targets: Real[Array, "*batch d"] | None
    mask: Real[Array, "*batch d"] | Bool[Array, "*batch d"] | None
    weight: Real[Array, "..."]

    def __init__(
        self,
        logits: Float[Array, "*batch d"],
        targets: Real[Array, "*batch d"] | None = None,
        mask: Real[Array, "*batch d"] | Bool[Array, "*batch d"] | None = None,
        weight: Real[ArrayLike, "..."] = 1.0,
    ):
        """**Arguments:** as the fields; `weight` may be a Python number."""
        _set_fields(self, logits, targets, mask, weight, targets_per_class=True, mask_per_class=True)

    input_fields: ClassVar[tuple[str, ...]] = ("logits",)

    def evaluate_unweighted(self, targets: Array) -> Array:
        per_output = jnp.logaddexp(0, self.logits) - targets.astype(self.dtype) * self.logits
        return jnp.sum(apply_mask(per_output, self.mask), axis=-1)

    def sample(self, key: PRNGKeyArray) -> Array:
        return jax.random.bernoulli(key, jax.nn.sigmoid(self.logits)).astype(self.dtype)

    @property
    def fisher_factor_inner_shape(self) -> tuple[int, ...]:
        return self.logits.shape

    def _sqrt_fisher(self) -> Array:
        # p (1 - p) = 1 / (4 cosh²(l / 2)): smooth and free of 0 * inf for saturated logits.
        return apply_mask(0.5 / jnp.cosh(0.5 * self.logits), self.mask, sqrt=True)

    def multiply_fisher_unweighted(self, vector: Sequence[Array]) -> tuple[Array, ...]:
        return (jnp.square(self._sqrt_fisher()) * vector[0],)

    def multiply_fisher_factor_unweighted(self, vector: Array) -> tuple[Array, ...]:
        return (self._sqrt_fisher() * vector,)

    def multiply_fisher_factor_transpose_unweighted(self, vector: Sequence[Array]) -> Array:
        return self._sqrt_fisher() * vector[0]


class _AbstractCategoricalLoss(AbstractFisherAsGGNLoss):
    """Shared math of the categorical losses (integer or one-hot targets) on logits.

    With `p = softmax(l)` and `q = sqrt(p)`, the Fisher (= Hessian) of one example is
    `diag(p) - p pᵀ` and its factor is `B = diag(q) - p qᵀ` (`B Bᵀ = F` because `qᵀ q = 1`).
    A per-example mask multiplies the loss and the Fisher, and the factor by its square root.
    """

    logits: eqx.AbstractVar[Array]
    mask: eqx.AbstractVar[Array | None]

    input_fields: ClassVar[tuple[str, ...]] = ("logits",)

    def _masked(self, values: Array, sqrt: bool = False) -> Array:
        mask = None if self.mask is None else self.mask[..., None]
        return apply_mask(values, mask, sqrt)

    def _log_probs(self) -> Array:
        return jax.nn.log_softmax(self.logits, axis=-1)

    def _sample_classes(self, key: PRNGKeyArray) -> Array:
        return jax.random.categorical(key, self.logits, axis=-1)

    @property
    def fisher_factor_inner_shape(self) -> tuple[int, ...]:
        return self.logits.shape

    def multiply_fisher_unweighted(self, vector: Sequence[Array]) -> tuple[Array, ...]:
        probs = jnp.exp(self._log_probs())
        (v,) = vector
        product = probs * v - probs * jnp.sum(probs * v, axis=-1, keepdims=True)
        return (self._masked(product),)

    def multiply_fisher_factor_unweighted(self, vector: Array) -> tuple[Array, ...]:
        log_probs = self._log_probs()
        probs, sqrt_probs = jnp.exp(log_probs), jnp.exp(0.5 * log_probs)
        product = sqrt_probs * vector - probs * jnp.sum(sqrt_probs * vector, -1, keepdims=True)
        return (self._masked(product, sqrt=True),)

    def multiply_fisher_factor_transpose_unweighted(self, vector: Sequence[Array]) -> Array:
        log_probs = self._log_probs()
        probs, sqrt_probs = jnp.exp(log_probs), jnp.exp(0.5 * log_probs)
        (v,) = vector
        v = self._masked(v, sqrt=True)
        return sqrt_probs * v - sqrt_probs * jnp.sum(probs * v, axis=-1, keepdims=True)



class CategoricalLogitsNegativeLogProbLoss(_AbstractCategoricalLoss):
    """Negative log-likelihood of a categorical distribution given by logits, integer targets.

    The loss of one example is the softmax cross-entropy `logsumexp(l) - l[t]`. The last axis of
    `logits` holds the classes; all leading axes are batch axes.

    **Fields:**

    - `logits`: shape `(*batch, classes)`.
    - `targets`: optional integer class indices, shape `(*batch,)`. A label outside
      `[0, classes)` gives a NaN loss and gradient (never a wrapped class).
    - `mask`: optional non-negative (usually 0/1) per-example mask, shape `(*batch,)`; masked
      examples contribute nothing to the loss, its gradient and curvature, whatever their label.
    - `weight`: coefficient of the loss: a scalar, or one per example (shaped like the
      leading batch axes of the inputs).
    """

    logits: Float[Array, "*batch classes"]
    targets: Int[Array, "*batch"] | None
    mask: Real[Array, "*batch"] | Bool[Array, "*batch"] | None
    weight: Real[Array, "..."]

    def __init__(
        self,
        logits: Float[Array, "*batch classes"],
        targets: Int[Array, "*batch"] | None = None,
        mask: Real[Array, "*batch"] | Bool[Array, "*batch"] | None = None,
        weight: Real[ArrayLike, "..."] = 1.0,
    ):
        """**Arguments:** as the fields; `weight` may be a Python number."""
        check_class_labels(targets, logits.shape, type(self).__name__)
        _set_fields(self, logits, targets, mask, weight, targets_per_class=False, mask_per_class=False)

    def _out_of_range(self, targets: Array) -> Array:
        """Where an example that is not masked out has a label outside `[0, classes)`; a masked
        example (`mask == 0`) may carry any label, e.g. -1 for padding."""
        outside = (targets < 0) | (targets >= self.logits.shape[-1])
        return outside if self.mask is None else outside & (self.mask != 0)

    def evaluate_unweighted(self, targets: Array) -> Array:
        # A label outside [0, classes) (e.g. -1 for "ignore") is looked up as class 0 (never a
        # wrapped class) and gives a NaN loss and a NaN gradient, which the step's finiteness
        # checks catch; on an example the mask drops, the mask zeroes that lookup instead.
        invalid = self._out_of_range(targets)
        labels = jnp.where((targets >= 0) & (targets < self.logits.shape[-1]), targets, 0)
        picked = jnp.take_along_axis(self._log_probs(), labels[..., None], axis=-1)[..., 0]
        nan_if_invalid = jnp.where(invalid, jnp.nan, 1).astype(picked.dtype)
        return apply_mask(-picked * nan_if_invalid, self.mask)

    def targets_out_of_range(self) -> Array:
        """The number of examples not masked out whose target lies outside `[0, classes)` (0
        without targets)."""
        if self.targets is None:
            return jnp.zeros((), jnp.int32)
        return jnp.sum(self._out_of_range(self.targets))

    def targets_in_range(self) -> Bool[Array, ""]:
        """Whether every example not masked out has a label in `[0, classes)` (true without
        targets): a step on a batch without it is skipped."""
        return self.targets_out_of_range() == 0

    def sample(self, key: PRNGKeyArray) -> Array:
        return self._sample_classes(key)


class OneHotCategoricalLogitsNegativeLogProbLoss(_AbstractCategoricalLoss):
    """Negative log-likelihood of a categorical distribution given by logits, one-hot targets.

    As `CategoricalLogitsNegativeLogProbLoss`, but targets (and samples) are vectors over the
    classes: the loss of one example is `-Σ_c t_c log softmax(l)_c` (soft labels work too).

    **Fields:**

    - `logits`: shape `(*batch, classes)`.
    - `targets`: optional one-hot (or probability) vectors, same shape as `logits`.
    - `mask`: optional non-negative (usually 0/1) per-example mask of shape `(*batch,)`.
    - `weight`: coefficient of the loss: a scalar, or one per example (shaped like the
      leading batch axes of the inputs).
    """

    logits: Float[Array, "*batch classes"]
    targets: Real[Array, "*batch classes"] | None
    mask: Real[Array, "*batch"] | Bool[Array, "*batch"] | None
    weight: Real[Array, "..."]

    def __init__(
        self,
        logits: Float[Array, "*batch classes"],
        targets: Real[Array, "*batch classes"] | None = None,
        mask: Real[Array, "*batch"] | Bool[Array, "*batch"] | None = None,
        weight: Real[ArrayLike, "..."] = 1.0,
    ):
        """**Arguments:** as the fields; `weight` may be a Python number."""
        _set_fields(self, logits, targets, mask, weight, targets_per_class=True, mask_per_class=False)

    def evaluate_unweighted(self, targets: Array) -> Array:
        per_class = -targets.astype(self.dtype) * self._log_probs()
        return jnp.sum(self._masked(per_class), axis=-1)

    def sample(self, key: PRNGKeyArray) -> Array:
        classes = self._sample_classes(key)
        return jax.nn.one_hot(classes, self.logits.shape[-1], dtype=self.dtype)
