"""Loss functions: per-example losses with their Fisher and GGN matrices, factors and samplers.

Curvature methods act on the loss *inputs* (logits, predicted means, ...). All leading axes of an
input are batch axes (batch, then e.g. sequence positions) and the last is the event axis; products
act on tuples shaped like `inputs` and sum over examples (no `1/B`); `weight` multiplies the loss
and its curvature, and factors `B` (`B Bᵀ` the curvature) by `sqrt(weight)`. The `register_*`
functions bind a loss to the `loss_tag` primitive for the tracer and return their first argument.
"""

import abc
import math
from collections.abc import Callable, Sequence
from typing import ClassVar, Literal

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Bool, Float, Int, PRNGKeyArray, PyTree, Real

from . import _tags

CoefficientMode = Literal["regular", "sqrt", "off"]


def _as_scalar(value: Real[ArrayLike, ""], name: str) -> Array:
    value = jnp.asarray(value)
    if value.ndim != 0:
        raise ValueError(f"`{name}` must be a scalar, got an array of shape {value.shape}.")
    return value


def _check_inputs(array: Array, name: str, cls: str) -> None:
    # ndim 1 is allowed for a loss registered per example under `jax.vmap`.
    if array.ndim < 1:
        raise ValueError(
            f"{cls}: `{name}` needs an event axis (shape (batch, ..., event)), got a scalar. "
            "Add a trailing axis of size 1 for scalar outputs."
        )


def _scale(tree: PyTree[Array], factor: Array) -> PyTree[Array]:
    return jax.tree.map(lambda a: a * factor.astype(a.dtype), tree)


def _apply_mask(values: Array, mask: Array | None, sqrt: bool = False) -> Array:
    """Multiplies `values` by a mask broadcastable to it, or by its square root (for factors)."""
    if mask is None:
        return values
    mask = mask.astype(values.dtype)
    return values * (jnp.sqrt(mask) if sqrt else mask)


def _check_shape(cls: str, name: str, array: Array | None, shape: tuple, expected: str) -> None:
    if array is not None and array.shape != shape:
        msg = f"{cls}: `{name}` must have shape {expected} = {shape}, not {array.shape}."
        raise ValueError(msg)


def _replicated_one_hot(
    shape: tuple[int, ...], index: tuple[int, ...], dtype: jnp.dtype
) -> Array:
    if len(index) != 1 or not 0 <= index[0] < shape[-1]:
        raise ValueError(
            f"`index` must be a tuple with one entry in [0, {shape[-1]}) (the position on the event"
            f" axis; all leading axes are batch axes), got {index}."
        )
    return jnp.zeros(shape, dtype).at[..., index[0]].set(1)


def _transpose_of_factor(
    factor: Callable[[Array], tuple[Array, ...]],
    inner_shape: tuple[int, ...],
    dtype: jnp.dtype,
    vector: Sequence[Array],
) -> Array:
    transpose = jax.linear_transpose(factor, jax.ShapeDtypeStruct(inner_shape, dtype))
    (result,) = transpose(tuple(vector))
    return result


class LossFunction(eqx.Module):
    """Extension point: a loss on the outputs of a model, with its generalised Gauss-Newton matrix.

    Unlike a usual training loss, `evaluate` returns one value per example (it is neither summed
    nor averaged over the batch). The GGN is that of this loss with respect to its `inputs`.

    A subclass declares its fields (`targets`, `weight` and its own), the class variable
    `input_fields` (names of the fields that hold the inputs) and `__init__`, and implements
    `evaluate_unweighted`, `ggn_factor_inner_shape` and
    `multiply_ggn_factor_unweighted`. Everything else has a default derived from the factor `B`
    (`G = B Bᵀ`, `Bᵀ` by linear transposition, replicated one-hot products by applying `B` to a
    one-hot array) that subclasses may override with cheaper closed forms. A loss whose GGN comes
    from an autodiff Hessian, for instance, implements the factor as a per-example symmetric square
    root of `jax.hessian` of its per-example loss.

    **Fields:**

    - `input_fields`: class variable, the names of the fields that make up `inputs`.
    - `targets`: targets the loss is evaluated on by default, or `None`.
    - `weight`: scalar coefficient of the loss.
    """

    input_fields: eqx.AbstractClassVar[tuple[str, ...]]
    targets: eqx.AbstractVar[Array | None]
    weight: eqx.AbstractVar[Array]

    @property
    def inputs(self) -> tuple[Array, ...]:
        """The parameter-dependent arrays of the loss (e.g. `(logits,)`), batch axes first."""
        return tuple(getattr(self, name) for name in self.input_fields)

    def with_inputs(self, new_inputs: Sequence[Array]) -> "LossFunction":
        """Returns a copy with `inputs` replaced (kfac-jax's `copy_with_different_inputs`).

        **Arguments:** `new_inputs`, arrays to use as the new `inputs`, one per entry of `inputs`.

        **Returns:** A loss of the same class with the same targets, masks and weight.
        """
        if len(new_inputs) != len(self.inputs):
            raise ValueError(
                f"{type(self).__name__}.with_inputs expects {len(self.inputs)} arrays, "
                f"got {len(new_inputs)}."
            )
        fields = self.input_fields
        return eqx.tree_at(
            lambda loss: tuple(getattr(loss, f) for f in fields), self, tuple(new_inputs)
        )

    @abc.abstractmethod
    def evaluate_unweighted(self, targets: Array) -> Array:
        """Per-example loss on `targets` without `weight` (masks applied), batch-shaped."""

    @property
    @abc.abstractmethod
    def ggn_factor_inner_shape(self) -> tuple[int, ...]:
        """Shape of the vectors that `multiply_ggn_factor` takes (batch axes included)."""

    @abc.abstractmethod
    def multiply_ggn_factor_unweighted(self, vector: Array) -> tuple[Array, ...]:
        """`multiply_ggn_factor` without the `sqrt(weight)` coefficient."""

    @property
    def dtype(self) -> jnp.dtype:
        """The floating dtype of the loss inputs."""
        return self.inputs[0].dtype

    def _coefficient(self, coefficient_mode: CoefficientMode) -> Array:
        if coefficient_mode == "regular":
            return self.weight
        if coefficient_mode == "sqrt":
            return jnp.sqrt(self.weight)
        if coefficient_mode == "off":
            return jnp.ones_like(self.weight)
        raise ValueError(
            f"`coefficient_mode` must be 'regular', 'sqrt' or 'off', got {coefficient_mode!r}."
        )

    def evaluate(
        self, targets: Array | None = None, coefficient_mode: CoefficientMode = "regular"
    ) -> Array:
        """Evaluates the per-example loss.

        **Arguments:**

        - `targets`: targets to evaluate the loss on; `None` uses `self.targets`.
        - `coefficient_mode`: `"regular"` multiplies by `weight`, `"sqrt"` by `sqrt(weight)`,
          `"off"` returns the unweighted loss.

        **Returns:** The loss of every example, shape `inputs[0].shape[:-1]` (zero where masked).
        """
        if targets is None:
            targets = self.targets
        if targets is None:
            raise ValueError(
                f"{type(self).__name__} has no targets: pass `targets=` to `evaluate`, or register "
                "the loss with targets (needed e.g. for the 'fisher_empirical' estimation mode)."
            )
        coefficient = self._coefficient(coefficient_mode)
        return self.evaluate_unweighted(targets) * coefficient.astype(self.dtype)

    def grad_of_evaluate(
        self, targets: Array | None = None, coefficient_mode: CoefficientMode = "regular"
    ) -> tuple[Array, ...]:
        """Gradient of the summed per-example losses with respect to `inputs`.

        **Arguments:**

        - `targets`: targets to evaluate the loss on; `None` uses `self.targets`.
        - `coefficient_mode`: as for `evaluate`.

        **Returns:** A tuple shaped like `inputs`.
        """

        def total(inputs: tuple[Array, ...]) -> Array:
            return jnp.sum(self.with_inputs(inputs).evaluate(targets, coefficient_mode))

        return jax.grad(total)(self.inputs)

    def multiply_ggn_unweighted(self, vector: Sequence[Array]) -> tuple[Array, ...]:
        """`multiply_ggn` without the `weight` coefficient."""
        return self.multiply_ggn_factor_unweighted(
            self.multiply_ggn_factor_transpose_unweighted(vector)
        )

    def multiply_ggn_factor_transpose_unweighted(self, vector: Sequence[Array]) -> Array:
        """`multiply_ggn_factor_transpose` without the `sqrt(weight)` coefficient."""
        return _transpose_of_factor(
            self.multiply_ggn_factor_unweighted, self.ggn_factor_inner_shape, self.dtype, vector
        )

    def multiply_ggn_factor_replicated_one_hot_unweighted(
        self, index: tuple[int, ...]
    ) -> tuple[Array, ...]:
        """`multiply_ggn_factor_replicated_one_hot` without the `sqrt(weight)` coefficient."""
        one_hot = _replicated_one_hot(self.ggn_factor_inner_shape, index, self.dtype)
        return self.multiply_ggn_factor_unweighted(one_hot)

    def multiply_ggn(self, vector: Sequence[Array]) -> tuple[Array, ...]:
        """Multiplies a vector by the GGN `G` of the loss with respect to its inputs.

        **Arguments:** `vector`, a tuple shaped like `inputs`.

        **Returns:** `G v`, a tuple shaped like `inputs` (summed over examples, times `weight`).
        """
        return _scale(self.multiply_ggn_unweighted(vector), self.weight)

    def multiply_ggn_factor(self, vector: Array) -> tuple[Array, ...]:
        """Multiplies by the GGN factor `B` (`B Bᵀ = G`).

        **Arguments:** `vector`, an array of shape `ggn_factor_inner_shape`.

        **Returns:** `B v`, a tuple shaped like `inputs` (times `sqrt(weight)`).
        """
        return _scale(self.multiply_ggn_factor_unweighted(vector), jnp.sqrt(self.weight))

    def multiply_ggn_factor_transpose(self, vector: Sequence[Array]) -> Array:
        """Multiplies by the transposed GGN factor `Bᵀ`.

        **Arguments:** `vector`, a tuple shaped like `inputs`.

        **Returns:** `Bᵀ v`, an array of shape `ggn_factor_inner_shape` (times `sqrt(weight)`).
        """
        return _scale(self.multiply_ggn_factor_transpose_unweighted(vector), jnp.sqrt(self.weight))

    def multiply_ggn_factor_replicated_one_hot(self, index: tuple[int, ...]) -> tuple[Array, ...]:
        """Multiplies the GGN factor `B` by a replicated one-hot vector.

        The vector has shape `ggn_factor_inner_shape` and is one at event position `index[0]` of
        every example (every position of the batch axes) and zero elsewhere. Summed over all
        indices, the outer products of the per-example slices of the results give the per-example
        GGN blocks, which is what the exact estimation modes use.

        **Arguments:** `index`, a one-element tuple: the position on the event axis.

        **Returns:** A tuple shaped like `inputs` (times `sqrt(weight)`).
        """
        return _scale(
            self.multiply_ggn_factor_replicated_one_hot_unweighted(index), jnp.sqrt(self.weight)
        )


class NegativeLogProbLoss(LossFunction):
    """Extension point: a loss that is the negative log-probability of a predictive distribution.

    Adds the Fisher information of the distribution with respect to its parameters (the loss
    inputs), its factors, and sampling of targets from the model's distribution. A subclass
    implements, on top of `LossFunction`'s requirements, `sample`, `fisher_factor_inner_shape` and
    `multiply_fisher_factor_unweighted`; the other Fisher methods derive from the factor unless
    overridden.
    """

    @abc.abstractmethod
    def sample(self, key: PRNGKeyArray) -> Array:
        """Samples targets from the predictive distribution.

        **Arguments:** `key`, a JAX PRNG key.

        **Returns:** An array of targets, one per example, in the format `evaluate` accepts.
        """

    @property
    @abc.abstractmethod
    def fisher_factor_inner_shape(self) -> tuple[int, ...]:
        """Shape of the vectors that `multiply_fisher_factor` takes (batch axes included)."""

    @abc.abstractmethod
    def multiply_fisher_factor_unweighted(self, vector: Array) -> tuple[Array, ...]:
        """`multiply_fisher_factor` without the `sqrt(weight)` coefficient."""

    def multiply_fisher_unweighted(self, vector: Sequence[Array]) -> tuple[Array, ...]:
        """`multiply_fisher` without the `weight` coefficient."""
        return self.multiply_fisher_factor_unweighted(
            self.multiply_fisher_factor_transpose_unweighted(vector)
        )

    def multiply_fisher_factor_transpose_unweighted(self, vector: Sequence[Array]) -> Array:
        """`multiply_fisher_factor_transpose` without the `sqrt(weight)` coefficient."""
        return _transpose_of_factor(
            self.multiply_fisher_factor_unweighted,
            self.fisher_factor_inner_shape,
            self.dtype,
            vector,
        )

    def multiply_fisher_factor_replicated_one_hot_unweighted(
        self, index: tuple[int, ...]
    ) -> tuple[Array, ...]:
        """`multiply_fisher_factor_replicated_one_hot` without the `sqrt(weight)` coefficient."""
        one_hot = _replicated_one_hot(self.fisher_factor_inner_shape, index, self.dtype)
        return self.multiply_fisher_factor_unweighted(one_hot)

    def multiply_fisher(self, vector: Sequence[Array]) -> tuple[Array, ...]:
        """Multiplies a vector by the Fisher `F` of the distribution with respect to `inputs`.

        **Arguments:** `vector`, a tuple shaped like `inputs`.

        **Returns:** `F v`, a tuple shaped like `inputs` (summed over examples, times `weight`).
        """
        return _scale(self.multiply_fisher_unweighted(vector), self.weight)

    def multiply_fisher_factor(self, vector: Array) -> tuple[Array, ...]:
        """Multiplies by the Fisher factor `B` (`B Bᵀ = F`).

        **Arguments:** `vector`, an array of shape `fisher_factor_inner_shape`.

        **Returns:** `B v`, a tuple shaped like `inputs` (times `sqrt(weight)`).
        """
        return _scale(self.multiply_fisher_factor_unweighted(vector), jnp.sqrt(self.weight))

    def multiply_fisher_factor_transpose(self, vector: Sequence[Array]) -> Array:
        """Multiplies by the transposed Fisher factor `Bᵀ`.

        **Arguments:** `vector`, a tuple shaped like `inputs`.

        **Returns:** `Bᵀ v`, an array of shape `fisher_factor_inner_shape` (times `sqrt(weight)`).
        """
        return _scale(
            self.multiply_fisher_factor_transpose_unweighted(vector), jnp.sqrt(self.weight)
        )

    def multiply_fisher_factor_replicated_one_hot(
        self, index: tuple[int, ...]
    ) -> tuple[Array, ...]:
        """Multiplies the Fisher factor `B` by a replicated one-hot vector.

        See `LossFunction.multiply_ggn_factor_replicated_one_hot` for the vector.

        **Arguments:** `index`, a one-element tuple: the position on the event axis.

        **Returns:** A tuple shaped like `inputs` (times `sqrt(weight)`).
        """
        return _scale(
            self.multiply_fisher_factor_replicated_one_hot_unweighted(index), jnp.sqrt(self.weight)
        )

    def grad_of_evaluate_on_sample(
        self, key: PRNGKeyArray, coefficient_mode: CoefficientMode = "regular"
    ) -> tuple[Array, ...]:
        """Gradient of the loss with respect to `inputs` at targets sampled from the model.

        Its outer product has the Fisher as expectation, which the `fisher_gradients` estimation
        mode relies on.

        **Arguments:**

        - `key`: a JAX PRNG key.
        - `coefficient_mode`: as for `evaluate`.

        **Returns:** A tuple shaped like `inputs`.
        """
        return self.grad_of_evaluate(self.sample(key), coefficient_mode)


class _AbstractFisherAsGGNLoss(NegativeLogProbLoss):
    """A negative log-probability loss whose GGN is defined to be its Fisher.

    For a distribution parameterised by its natural parameters (normal mean, Bernoulli and
    categorical logits) the Hessian of the loss does not depend on the targets, so it equals the
    Fisher: the GGN of the loss is exact.
    """

    def multiply_ggn_unweighted(self, vector: Sequence[Array]) -> tuple[Array, ...]:
        return self.multiply_fisher_unweighted(vector)

    def multiply_ggn_factor_unweighted(self, vector: Array) -> tuple[Array, ...]:
        return self.multiply_fisher_factor_unweighted(vector)

    def multiply_ggn_factor_transpose_unweighted(self, vector: Sequence[Array]) -> Array:
        return self.multiply_fisher_factor_transpose_unweighted(vector)

    def multiply_ggn_factor_replicated_one_hot_unweighted(
        self, index: tuple[int, ...]
    ) -> tuple[Array, ...]:
        return self.multiply_fisher_factor_replicated_one_hot_unweighted(index)

    @property
    def ggn_factor_inner_shape(self) -> tuple[int, ...]:
        return self.fisher_factor_inner_shape


class NormalMeanNegativeLogProbLoss(_AbstractFisherAsGGNLoss):
    """Negative log-likelihood of a normal distribution with a predicted mean and fixed variance.

    The loss of one example is `‖t - mean‖² / (2 variance)` (plus the log-normaliser
    `(d/2) log(2π variance)` when `normalize_log_prob`); its Fisher, GGN and Hessian with respect
    to the mean are `I / variance`. With `variance=0.5` and no normaliser this is the squared error
    `‖t - mean‖²`.

    **Fields:**

    - `mean`: the predicted means, shape `(*batch, d)`.
    - `targets`: optional targets of the same shape.
    - `variance`: scalar variance.
    - `weight`: scalar coefficient of the loss.
    - `normalize_log_prob`: whether `evaluate` includes the log-normaliser.
    """

    mean: Float[Array, "*batch d"]
    targets: Float[Array, "*batch d"] | None
    variance: Float[Array, ""]
    weight: Real[Array, ""]
    normalize_log_prob: bool = eqx.field(static=True)

    def __init__(
        self,
        mean: Float[Array, "*batch d"],
        targets: Float[Array, "*batch d"] | None = None,
        variance: Real[ArrayLike, ""] = 0.5,
        weight: Real[ArrayLike, ""] = 1.0,
        normalize_log_prob: bool = True,
    ):
        """**Arguments:** as the fields; `variance` and `weight` may be Python numbers."""
        _check_inputs(mean, "mean", type(self).__name__)
        _check_shape(type(self).__name__, "targets", targets, mean.shape, "mean.shape")
        self.mean = mean
        self.targets = targets
        self.variance = _as_scalar(variance, "variance").astype(mean.dtype)
        self.weight = _as_scalar(weight, "weight")
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


class NormalMeanVarianceNegativeLogProbLoss(_AbstractFisherAsGGNLoss):
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
    - `weight`: scalar coefficient of the loss.
    """

    mean: Float[Array, "*batch d"]
    variance: Float[Array, "*batch d"]
    targets: Float[Array, "*batch d"] | None
    weight: Real[Array, ""]

    def __init__(
        self,
        mean: Float[Array, "*batch d"],
        variance: Float[Array, "*batch d"],
        targets: Float[Array, "*batch d"] | None = None,
        weight: Real[ArrayLike, ""] = 1.0,
    ):
        """**Arguments:** as the fields; `weight` may be a Python number."""
        name = type(self).__name__
        _check_inputs(mean, "mean", name)
        _check_shape(name, "variance", variance, mean.shape, "mean.shape")
        _check_shape(name, "targets", targets, mean.shape, "mean.shape")
        self.mean = mean
        self.variance = variance
        self.targets = targets
        self.weight = _as_scalar(weight, "weight")

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


class MultiBernoulliNegativeLogProbLoss(_AbstractFisherAsGGNLoss):
    """Negative log-likelihood of independent Bernoulli outputs given by logits.

    The loss of one example is the sigmoid cross-entropy summed over the event axis,
    `Σ_i [softplus(l_i) - t_i l_i]`. The Fisher (= Hessian) is `diag(p (1 - p))` with
    `p = sigmoid(l)`, and the factor is its square root `diag(1 / (2 cosh(l / 2)))`.

    **Fields:**

    - `logits`: shape `(*batch, d)`.
    - `targets`: optional targets in `[0, 1]` (usually `{0, 1}`), same shape.
    - `mask`: optional non-negative (usually 0/1) mask of the same shape, multiplying each output's
      loss (its factor by the square root); masked outputs contribute nothing.
    - `weight`: scalar coefficient of the loss.
    """

    logits: Float[Array, "*batch d"]
    targets: Real[Array, "*batch d"] | None
    mask: Real[Array, "*batch d"] | Bool[Array, "*batch d"] | None
    weight: Real[Array, ""]

    def __init__(
        self,
        logits: Float[Array, "*batch d"],
        targets: Real[Array, "*batch d"] | None = None,
        mask: Real[Array, "*batch d"] | Bool[Array, "*batch d"] | None = None,
        weight: Real[ArrayLike, ""] = 1.0,
    ):
        """**Arguments:** as the fields; `weight` may be a Python number."""
        name = type(self).__name__
        _check_inputs(logits, "logits", name)
        _check_shape(name, "targets", targets, logits.shape, "logits.shape")
        _check_shape(name, "mask", mask, logits.shape, "logits.shape")
        self.logits = logits
        self.targets = targets
        self.mask = mask
        self.weight = _as_scalar(weight, "weight")

    input_fields: ClassVar[tuple[str, ...]] = ("logits",)

    def evaluate_unweighted(self, targets: Array) -> Array:
        per_output = jnp.logaddexp(0, self.logits) - targets.astype(self.dtype) * self.logits
        return jnp.sum(_apply_mask(per_output, self.mask), axis=-1)

    def sample(self, key: PRNGKeyArray) -> Array:
        return jax.random.bernoulli(key, jax.nn.sigmoid(self.logits)).astype(self.dtype)

    @property
    def fisher_factor_inner_shape(self) -> tuple[int, ...]:
        return self.logits.shape

    def _sqrt_fisher(self) -> Array:
        # p (1 - p) = 1 / (4 cosh²(l / 2)): smooth and free of 0 * inf for saturated logits.
        return _apply_mask(0.5 / jnp.cosh(0.5 * self.logits), self.mask, sqrt=True)

    def multiply_fisher_unweighted(self, vector: Sequence[Array]) -> tuple[Array, ...]:
        return (jnp.square(self._sqrt_fisher()) * vector[0],)

    def multiply_fisher_factor_unweighted(self, vector: Array) -> tuple[Array, ...]:
        return (self._sqrt_fisher() * vector,)

    def multiply_fisher_factor_transpose_unweighted(self, vector: Sequence[Array]) -> Array:
        return self._sqrt_fisher() * vector[0]


class _AbstractCategoricalLoss(_AbstractFisherAsGGNLoss):
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
        return _apply_mask(values, mask, sqrt)

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
    - `targets`: optional integer class indices, shape `(*batch,)`.
    - `mask`: optional non-negative (usually 0/1) per-example mask, shape `(*batch,)`; masked
      examples contribute nothing to the loss, its gradient and curvature.
    - `weight`: scalar coefficient of the loss.
    """

    logits: Float[Array, "*batch classes"]
    targets: Int[Array, "*batch"] | None
    mask: Real[Array, "*batch"] | Bool[Array, "*batch"] | None
    weight: Real[Array, ""]

    def __init__(
        self,
        logits: Float[Array, "*batch classes"],
        targets: Int[Array, "*batch"] | None = None,
        mask: Real[Array, "*batch"] | Bool[Array, "*batch"] | None = None,
        weight: Real[ArrayLike, ""] = 1.0,
    ):
        """**Arguments:** as the fields; `weight` may be a Python number."""
        name = type(self).__name__
        _check_inputs(logits, "logits", name)
        _check_shape(name, "targets", targets, logits.shape[:-1], "logits.shape[:-1]")
        _check_shape(name, "mask", mask, logits.shape[:-1], "logits.shape[:-1]")
        self.logits = logits
        self.targets = targets
        self.mask = mask
        self.weight = _as_scalar(weight, "weight")

    def evaluate_unweighted(self, targets: Array) -> Array:
        picked = jnp.take_along_axis(self._log_probs(), targets[..., None], axis=-1)
        return self._masked(-picked)[..., 0]

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
    - `weight`: scalar coefficient of the loss.
    """

    logits: Float[Array, "*batch classes"]
    targets: Real[Array, "*batch classes"] | None
    mask: Real[Array, "*batch"] | Bool[Array, "*batch"] | None
    weight: Real[Array, ""]

    def __init__(
        self,
        logits: Float[Array, "*batch classes"],
        targets: Real[Array, "*batch classes"] | None = None,
        mask: Real[Array, "*batch"] | Bool[Array, "*batch"] | None = None,
        weight: Real[ArrayLike, ""] = 1.0,
    ):
        """**Arguments:** as the fields; `weight` may be a Python number."""
        name = type(self).__name__
        _check_inputs(logits, "logits", name)
        _check_shape(name, "targets", targets, logits.shape, "logits.shape")
        _check_shape(name, "mask", mask, logits.shape[:-1], "logits.shape[:-1]")
        self.logits = logits
        self.targets = targets
        self.mask = mask
        self.weight = _as_scalar(weight, "weight")

    def evaluate_unweighted(self, targets: Array) -> Array:
        per_class = -targets.astype(self.dtype) * self._log_probs()
        return jnp.sum(self._masked(per_class), axis=-1)

    def sample(self, key: PRNGKeyArray) -> Array:
        classes = self._sample_classes(key)
        return jax.nn.one_hot(classes, self.logits.shape[-1], dtype=self.dtype)


def _register(loss: LossFunction) -> Array:
    return _tags.loss_tag.bind(loss)[0]


def register_normal_predictive_distribution(
    mean: Float[Array, "*batch d"],
    targets: Float[Array, "*batch d"] | None = None,
    variance: Real[ArrayLike, ""] = 0.5,
    weight: Real[ArrayLike, ""] = 1.0,
) -> Float[Array, "*batch d"]:
    """Registers a normal predictive distribution with fixed scalar variance.

    This is the loss `weight * ‖t - mean‖² / (2 variance)` (plus a constant log-normaliser),
    the norm over the last axis, averaged over the batch. The default
    `variance=0.5` makes it the squared error `weight * ‖t - mean‖²`.

    **Arguments:**

    - `mean`: the model's output, shape `(batch, ..., d)`.
    - `targets`: optional targets of the same shape (needed for `fisher_empirical`).
    - `variance`: the scalar variance, independent of the parameters.
    - `weight`: scalar coefficient of the loss, independent of the parameters.

    **Returns:** `mean`, unchanged (use the returned value: it carries the registration).
    """
    loss = NormalMeanNegativeLogProbLoss(mean, targets, variance=variance, weight=weight)
    return _register(loss)


def register_squared_error_loss(
    prediction: Float[Array, "*batch d"],
    targets: Float[Array, "*batch d"] | None = None,
    weight: Real[ArrayLike, ""] = 1.0,
) -> Float[Array, "*batch d"]:
    """Registers the squared error loss `weight * ‖t - prediction‖²`, averaged over the batch.

    The squared norm sums over the last axis only: a loss averaged over output coordinates too
    (`jnp.mean((t - p) ** 2)`) is registered with `weight = 1 / d`; one with a `1/2` coefficient
    with `weight = 0.5`. Its curvature with respect to `prediction` is `2 * weight * I` per
    example (a normal with variance `1/2`).

    **Arguments:**

    - `prediction`: the model's output, shape `(batch, ..., d)`.
    - `targets`: optional targets of the same shape (needed for `fisher_empirical`).
    - `weight`: scalar coefficient of the loss, independent of the parameters.

    **Returns:** `prediction`, unchanged.
    """
    loss = NormalMeanNegativeLogProbLoss(
        prediction, targets, variance=0.5, weight=weight, normalize_log_prob=False
    )
    return _register(loss)


def register_multi_bernoulli_predictive_distribution(
    logits: Float[Array, "*batch d"],
    targets: Real[Array, "*batch d"] | None = None,
    weight: Real[ArrayLike, ""] = 1.0,
    *,
    mask: Real[Array, "*batch d"] | Bool[Array, "*batch d"] | None = None,
) -> Float[Array, "*batch d"]:
    """Registers independent Bernoulli outputs given by logits.

    This is the loss `weight * Σ_i sigmoid_cross_entropy(l_i, t_i)`, summed over the last axis and
    averaged over the batch.

    **Arguments:**

    - `logits`: the model's output, shape `(batch, ..., d)`.
    - `targets`: optional targets of the same shape (needed for `fisher_empirical`).
    - `weight`: scalar coefficient of the loss, independent of the parameters.
    - `mask`: optional 0/1 mask of the shape of `logits`; masked outputs contribute nothing.

    **Returns:** `logits`, unchanged.
    """
    loss = MultiBernoulliNegativeLogProbLoss(logits, targets, mask=mask, weight=weight)
    return _register(loss)


def register_sigmoid_cross_entropy_loss(
    logits: Float[Array, "*batch d"],
    targets: Real[Array, "*batch d"] | None = None,
    weight: Real[ArrayLike, ""] = 1.0,
    *,
    mask: Real[Array, "*batch d"] | Bool[Array, "*batch d"] | None = None,
) -> Float[Array, "*batch d"]:
    """Registers a sigmoid cross-entropy loss (the same curvature as a multi-Bernoulli).

    **Arguments:** as for `register_multi_bernoulli_predictive_distribution`.

    **Returns:** `logits`, unchanged.
    """
    return register_multi_bernoulli_predictive_distribution(logits, targets, weight, mask=mask)


def register_categorical_predictive_distribution(
    logits: Float[Array, "*batch classes"],
    targets: Real[Array, "*batch"] | Real[Array, "*batch classes"] | None = None,
    mask: Real[Array, "*batch"] | Bool[Array, "*batch"] | None = None,
    weight: Real[ArrayLike, ""] = 1.0,
) -> Float[Array, "*batch classes"]:
    """Registers a categorical predictive distribution given by logits (softmax over the last axis).

    This is the loss `weight * softmax_cross_entropy(logits, targets)` averaged over the batch.

    **Arguments:**

    - `logits`: the model's output, shape `(batch, ..., classes)`.
    - `targets`: optional integer labels of shape `logits.shape[:-1]`, or one-hot vectors of the
      shape of `logits` (needed for `fisher_empirical`).
    - `mask`: optional 0/1 mask of shape `logits.shape[:-1]`; masked examples contribute nothing.
    - `weight`: scalar coefficient of the loss, independent of the parameters.

    **Returns:** `logits`, unchanged.
    """
    if targets is not None and targets.ndim == logits.ndim:
        loss = OneHotCategoricalLogitsNegativeLogProbLoss(logits, targets, mask, weight)
    elif targets is None or targets.ndim == logits.ndim - 1:
        loss = CategoricalLogitsNegativeLogProbLoss(logits, targets, mask, weight)
    else:
        raise ValueError(
            f"Categorical loss: `targets` must be integer labels of shape {logits.shape[:-1]} or "
            f"one-hot vectors of shape {logits.shape}, got shape {targets.shape}."
        )
    return _register(loss)


def register_softmax_cross_entropy_loss(
    logits: Float[Array, "*batch classes"],
    targets: Real[Array, "*batch"] | Real[Array, "*batch classes"] | None = None,
    mask: Real[Array, "*batch"] | Bool[Array, "*batch"] | None = None,
    weight: Real[ArrayLike, ""] = 1.0,
) -> Float[Array, "*batch classes"]:
    """Registers a softmax cross-entropy loss (the same curvature as a categorical distribution).

    **Arguments:** as for `register_categorical_predictive_distribution`.

    **Returns:** `logits`, unchanged.
    """
    return register_categorical_predictive_distribution(logits, targets, mask, weight)
