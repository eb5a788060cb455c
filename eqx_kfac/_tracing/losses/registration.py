"""The `register_*` functions: bind a loss to the `loss_tag` primitive for the tracer."""

from jaxtyping import Array, ArrayLike, Bool, Float, Real

from .. import tags as _tags
from .base import LossFunction, MeanOver, with_mean_over
from .logits import (
    CategoricalLogitsNegativeLogProbLoss,
    MultiBernoulliNegativeLogProbLoss,
    OneHotCategoricalLogitsNegativeLogProbLoss,
    check_class_labels,
)
from .normal import NormalMeanNegativeLogProbLoss


def _register(loss: LossFunction, mean_over: MeanOver, where: str) -> Array:
    return _tags.loss_tag.bind(with_mean_over(loss, mean_over, where))[0]


def register_loss(loss: LossFunction, *, mean_over: MeanOver = "batch") -> tuple[Array, ...]:
    """Registers a loss object of your own (a `LossFunction` or `NegativeLogProbLoss` subclass).

    The built-in `register_*` functions build a loss object and register it this way. Call it
    inside the loss function, on a loss whose inputs are the model's outputs; the curvature is
    then the loss's own (`multiply_ggn`, `multiply_fisher`, their factors, ...).

    **Arguments:**

    - `loss`: the loss object, with its inputs (and targets, if any) set.
    - `mean_over`: which leading axes your training loss averages this loss over: `"batch"`
      (default, kfac-jax's convention) the leading axis only, summing over the others (e.g.
      sequence positions); `"all"` every leading axis (a per-token mean), divided by the number
      of examples (the sum of a `mask` field, if the loss has one, as the built-in
      losses count it). It sets the curvature's scale: `"all"` is `weight` times
      `batch / examples` (`1 / positions` without a mask).

    **Returns:** `loss.inputs`, unchanged (use the returned values: they carry the registration).
    """
    return _tags.loss_tag.bind(with_mean_over(loss, mean_over, "register_loss"))


def register_normal_predictive_distribution(
    mean: Float[Array, "*batch d"],
    targets: Float[Array, "*batch d"] | None = None,
    variance: Real[ArrayLike, ""] = 0.5,
    weight: Real[ArrayLike, "..."] = 1.0,
    *,
    mean_over: MeanOver = "batch",
) -> Float[Array, "*batch d"]:
    """Registers a normal predictive distribution with fixed scalar variance.

    This is the loss `weight * ‖t - mean‖² / (2 variance)` (plus a constant log-normaliser),
    the norm over the last axis, averaged over the batch. The default
    `variance=0.5` makes it the squared error `weight * ‖t - mean‖²`.

    **Arguments:**

    - `mean`: the model's output, shape `(batch, ..., d)`.
    - `targets`: optional targets of the same shape (needed for `fisher_empirical`).
    - `variance`: the scalar variance, independent of the parameters.
    - `weight`: coefficient of the loss, independent of the parameters: a scalar, or one
      per example (shape `(batch,)`, or the leading batch axes of the inputs).
    - `mean_over`: which leading axes your training loss averages this loss over: `"batch"`
      (default, kfac-jax's convention) the leading axis only, summing over the others (e.g.
      sequence positions); `"all"` every leading axis (a per-token mean). It sets the
      curvature's scale: `"all"` is `weight` times `1 / positions`.

    **Returns:** `mean`, unchanged (use the returned value: it carries the registration).
    """
    loss = NormalMeanNegativeLogProbLoss(mean, targets, variance=variance, weight=weight)
    return _register(loss, mean_over, "register_normal_predictive_distribution")


def register_squared_error_loss(
    prediction: Float[Array, "*batch d"],
    targets: Float[Array, "*batch d"] | None = None,
    weight: Real[ArrayLike, "..."] = 1.0,
    *,
    mean_over: MeanOver = "batch",
) -> Float[Array, "*batch d"]:
    """Registers the squared error loss `weight * ‖t - prediction‖²`, averaged over the batch.

    The squared norm sums over the last axis only: a loss averaged over output coordinates too
    (`jnp.mean((t - p) ** 2)`) is registered with `weight = 1 / d`; one with a `1/2` coefficient
    with `weight = 0.5`. Its curvature with respect to `prediction` is `2 * weight * I` per
    example (a normal with variance `1/2`).

    **Arguments:**

    - `prediction`: the model's output, shape `(batch, ..., d)`.
    - `targets`: optional targets of the same shape (needed for `fisher_empirical`).
    - `weight`: coefficient of the loss, independent of the parameters: a scalar, or one
      per example (shape `(batch,)`, or the leading batch axes of the inputs).
    - `mean_over`: as for `register_normal_predictive_distribution` (`"all"` for
      `jnp.mean(jnp.sum((t - p) ** 2, axis=-1))` over `(batch, positions, d)` outputs).

    **Returns:** `prediction`, unchanged.
    """
    loss = NormalMeanNegativeLogProbLoss(
        prediction, targets, variance=0.5, weight=weight, normalize_log_prob=False
    )
    return _register(loss, mean_over, "register_squared_error_loss")


def register_multi_bernoulli_predictive_distribution(
    logits: Float[Array, "*batch d"],
    targets: Real[Array, "*batch d"] | None = None,
    weight: Real[ArrayLike, "..."] = 1.0,
    *,
    mask: Real[Array, "*batch d"] | Bool[Array, "*batch d"] | None = None,
    mean_over: MeanOver = "batch",
) -> Float[Array, "*batch d"]:
    """Registers independent Bernoulli outputs given by logits.

    This is the loss `weight * Σ_i sigmoid_cross_entropy(l_i, t_i)`, summed over the last axis and
    averaged over the batch.

    **Arguments:**

    - `logits`: the model's output, shape `(batch, ..., d)`.
    - `targets`: optional targets of the same shape (needed for `fisher_empirical`).
    - `weight`: coefficient of the loss, independent of the parameters: a scalar, or one
      per example (shape `(batch,)`, or the leading batch axes of the inputs).
    - `mask`: optional 0/1 mask of the shape of `logits`; masked outputs contribute nothing.
    - `mean_over`: which leading axes your training loss averages this loss over: `"batch"`
      (default, kfac-jax's convention) the leading axis only, summing over the others (e.g.
      sequence positions); `"all"` every leading axis (a per-token mean), divided by the number
      of examples the mask keeps (each example counted by the mean of its
      mask over the last axis). It sets the curvature's scale: `"all"` is `weight` times
      `batch / examples` (`1 / positions` without a mask).

    **Returns:** `logits`, unchanged.
    """
    where = "register_multi_bernoulli_predictive_distribution"
    loss = MultiBernoulliNegativeLogProbLoss(logits, targets, mask=mask, weight=weight)
    return _register(loss, mean_over, where)


def register_sigmoid_cross_entropy_loss(
    logits: Float[Array, "*batch d"],
    targets: Real[Array, "*batch d"] | None = None,
    weight: Real[ArrayLike, "..."] = 1.0,
    *,
    mask: Real[Array, "*batch d"] | Bool[Array, "*batch d"] | None = None,
    mean_over: MeanOver = "batch",
) -> Float[Array, "*batch d"]:
    """Registers a sigmoid cross-entropy loss (the same curvature as a multi-Bernoulli).

    **Arguments:** as for `register_multi_bernoulli_predictive_distribution`.

    **Returns:** `logits`, unchanged.
    """
    loss = MultiBernoulliNegativeLogProbLoss(logits, targets, mask=mask, weight=weight)
    return _register(loss, mean_over, "register_sigmoid_cross_entropy_loss")


def register_categorical_predictive_distribution(
    logits: Float[Array, "*batch classes"],
    targets: Real[Array, "*batch"] | Real[Array, "*batch classes"] | None = None,
    mask: Real[Array, "*batch"] | Bool[Array, "*batch"] | None = None,
    weight: Real[ArrayLike, "..."] = 1.0,
    *,
    mean_over: MeanOver = "batch",
) -> Float[Array, "*batch classes"]:
    """Registers a categorical predictive distribution given by logits (softmax over the last axis).

    This is the loss `weight * softmax_cross_entropy(logits, targets)` averaged over the batch.

    **Arguments:**

    - `logits`: the model's output, shape `(batch, ..., classes)`.
    - `targets`: optional integer labels in `[0, classes)` of shape `logits.shape[:-1]` (float
      labels are a `TypeError`), or one-hot vectors of the shape of `logits` (needed for
      `fisher_empirical`).
    - `mask`: optional 0/1 mask of shape `logits.shape[:-1]`; masked examples contribute nothing,
      and may carry any label (e.g. -1 for padding).
    - `weight`: coefficient of the loss, independent of the parameters: a scalar, or one
      per example (shape `(batch,)`, or the leading batch axes of the inputs).
    - `mean_over`: which leading axes your training loss averages this loss over: `"batch"`
      (default, kfac-jax's convention) the leading axis only, summing over the others (e.g.
      sequence positions); `"all"` every leading axis (a per-token mean), divided by the number
      of examples the mask keeps (`mask.sum()`). It sets the curvature's scale: `"all"` is
      `weight` times `batch / examples` (`1 / positions` without a mask).

    **Returns:** `logits`, unchanged.
    """
    where = "register_categorical_predictive_distribution"
    return _register_categorical(logits, targets, mask, weight, mean_over, where)


def _register_categorical(
    logits: Array,
    targets: Array | None,
    mask: Array | None,
    weight: ArrayLike,
    mean_over: MeanOver,
    where: str,
) -> Array:
    """The loss of `register_categorical_predictive_distribution`, registered; `where` is the
    `register_*` function called, for the messages."""
    if targets is not None and targets.ndim == logits.ndim:
        loss = OneHotCategoricalLogitsNegativeLogProbLoss(logits, targets, mask, weight)
    elif targets is None or targets.ndim == logits.ndim - 1:
        check_class_labels(targets, logits.shape, where)
        loss = CategoricalLogitsNegativeLogProbLoss(logits, targets, mask, weight)
    else:
        raise ValueError(
            f"{where}: `targets` must be integer labels of shape {logits.shape[:-1]} or "
            f"one-hot vectors of shape {logits.shape}, got shape {targets.shape}."
        )
    return _register(loss, mean_over, where)


def register_softmax_cross_entropy_loss(
    logits: Float[Array, "*batch classes"],
    targets: Real[Array, "*batch"] | Real[Array, "*batch classes"] | None = None,
    mask: Real[Array, "*batch"] | Bool[Array, "*batch"] | None = None,
    weight: Real[ArrayLike, "..."] = 1.0,
    *,
    mean_over: MeanOver = "batch",
) -> Float[Array, "*batch classes"]:
    """Registers a softmax cross-entropy loss (the same curvature as a categorical distribution).

    **Arguments:** as for `register_categorical_predictive_distribution`.

    **Returns:** `logits`, unchanged.
    """
    where = "register_softmax_cross_entropy_loss"
    return _register_categorical(logits, targets, mask, weight, mean_over, where)
