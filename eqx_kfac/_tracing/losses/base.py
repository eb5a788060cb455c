"""Loss functions: per-example losses with their Fisher and GGN matrices, factors and samplers.

Curvature methods act on the loss *inputs* (logits, predicted means, ...). All leading axes of an
input are batch axes (batch, then e.g. sequence positions) and the last is the event axis; products
act on tuples shaped like `inputs` and sum over examples (no `1/B`); `weight` multiplies the loss
and its curvature, and factors `B` (`B Bᵀ` the curvature) by `sqrt(weight)`: a scalar weight
scales all examples, a per-example weight (shaped like the leading batch axes, e.g. `(batch,)`)
each example's slice, which is right because every product acts on each example separately.
`with_mean_over` rescales the weight of a loss whose training loss averages over every leading
axis (e.g. a per-token mean) instead of the batch axis alone. The
`register_*` functions (in `registration.py`) bind a loss to the `loss_tag` primitive for the
tracer and return their first argument.

This module holds the base classes and the helpers the loss families share; `normal.py` and
`logits.py` hold the families.
"""

import abc
import math
from collections.abc import Callable, Sequence
from typing import Literal

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Bool, PRNGKeyArray, PyTree, Real



CoefficientMode = Literal["regular", "sqrt", "off"]
MeanOver = Literal["batch", "all"]


def as_scalar(value: Real[ArrayLike, ""], name: str) -> Array:
    value = jnp.asarray(value)
    if value.ndim != 0:
        raise ValueError(f"`{name}` must be a scalar, got an array of shape {value.shape}.")
    return value


def as_weight(weight: Real[ArrayLike, "..."], inputs: Array, cls: str) -> Array:
    """Checks a loss weight: a scalar, or one weight per example, shaped like the leading batch
    axes of `inputs` (all axes but the last), e.g. `(batch,)`."""
    weight = jnp.asarray(weight)
    batch = inputs.shape[:-1]
    if weight.ndim > len(batch) or weight.shape != batch[: weight.ndim]:
        raise ValueError(
            f"{cls}: `weight` must be a scalar or hold one weight per example, shaped like the "
            f"leading batch axes of the inputs {batch} (e.g. {batch[:1]}); got shape {weight.shape}."
        )
    return weight


def _on_examples(weight: Array, values: Array) -> Array:
    """`weight` in the dtype of `values`, aligned with its leading (batch) axes."""
    return jnp.reshape(weight, weight.shape + (1,) * (values.ndim - weight.ndim)).astype(values.dtype)


def examples_counted(inputs: Array, mask: Array | None) -> Array | None:
    """What a mean over every leading axis of `inputs` divides by: the number of examples
    (positions of the leading axes), or with a mask, the mask's sum. A mask shaped like `inputs`
    (one value per output, as the multi-Bernoulli's) counts each example by its mean over the last
    axis. `None` for a mask of another shape. In at least float32 (a count in bfloat16 rounds)."""
    dtype = jnp.promote_types(inputs.dtype, jnp.float32)
    if mask is None:
        return jnp.asarray(math.prod(inputs.shape[:-1]), dtype)
    total = jnp.sum(mask.astype(dtype))
    if mask.shape == inputs.shape:
        return total / inputs.shape[-1]
    return total if mask.shape == inputs.shape[:-1] else None


def with_mean_over(loss: "LossFunction", mean_over: MeanOver, where: str) -> "LossFunction":
    """`loss` with its weight set for a training loss averaged over `mean_over`.

    The curvature of a registered loss is averaged over the batch (the leading axis) and summed
    over the other leading axes. `"batch"` keeps the loss; `"all"`, a mean over every leading axis
    (divided by `examples_counted`: the examples, or the mask's sum), multiplies its weight by
    `batch / examples_counted`, which is `1 / positions` without a mask.
    """
    if mean_over not in ("batch", "all"):
        raise ValueError(
            f"{where}: `mean_over` must be 'batch' (the loss is averaged over the leading axis "
            "and summed over the others) or 'all' (averaged over every leading axis, e.g. a "
            f"per-token mean), got {mean_over!r}."
        )
    if mean_over == "batch":
        return loss
    inputs = loss.inputs[0]
    mask = getattr(loss, "mask", None)
    count = examples_counted(inputs, mask)
    if count is None:
        raise ValueError(
            f"{where}: mean_over='all' counts the examples the mask keeps, so the mask must be "
            f"shaped like the inputs {inputs.shape} or their leading axes {inputs.shape[:-1]}; "
            f"got shape {mask.shape}."
        )
    batch = inputs.shape[0] if inputs.ndim > 1 else 1
    weight = loss.weight * (batch / jnp.where(count > 0, count, 1))
    return eqx.tree_at(lambda l: l.weight, loss, as_weight(weight, inputs, where))


def check_inputs(array: Array, name: str, cls: str) -> None:
    # ndim 1 is allowed for a loss registered per example under `jax.vmap`.
    if array.ndim < 1:
        raise ValueError(
            f"{cls}: `{name}` needs an event axis (shape (batch, ..., event)), got a scalar. "
            "Add a trailing axis of size 1 for scalar outputs."
        )


def apply_mask(values: Array, mask: Array | None, sqrt: bool = False) -> Array:
    """Multiplies `values` by a mask broadcastable to it, or by its square root (for factors)."""
    if mask is None:
        return values
    mask = mask.astype(values.dtype)
    return values * (jnp.sqrt(mask) if sqrt else mask)


def check_shape(cls: str, name: str, array: Array | None, shape: tuple, expected: str) -> None:
    if array is not None and array.shape != shape:
        msg = f"{cls}: `{name}` must have shape {expected} = {shape}, not {array.shape}."
        raise ValueError(msg)


def _factor_times_replicated_one_hot(
    factor: Callable[[Array], tuple[Array, ...]],
    inner_shape: tuple[int, ...],
    dtype: jnp.dtype,
    index: tuple[int, ...],
) -> tuple[Array, ...]:
    """Applies `factor` to the array of `inner_shape` that is one at event position `index[0]`."""
    if len(index) != 1 or not 0 <= index[0] < inner_shape[-1]:
        raise ValueError(
            f"`index` must be a tuple with one entry in [0, {inner_shape[-1]}) (the position on the"
            f" event axis; all leading axes are batch axes), got {index}."
        )
    return factor(jnp.zeros(inner_shape, dtype).at[..., index[0]].set(1))


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
    - `weight`: coefficient of the loss: a scalar, or one per example (shaped like the leading
      batch axes of the inputs).
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

    def targets_in_range(self) -> Bool[Array, ""]:
        """Whether every target on an example the loss keeps is one it is defined on: always,
        unless the targets have a range (class labels; the categorical loss overrides this).

        **Returns:** a boolean scalar.
        """
        return jnp.asarray(True)

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

    def _times_weight(self, values: PyTree[Array]) -> PyTree[Array]:
        # Every product's leading axes are the examples' (batch axes first), so a per-example
        # weight multiplies each example's slice.
        return jax.tree.map(lambda x: x * _on_examples(self.weight, x), values)

    def _times_sqrt_weight(self, values: PyTree[Array]) -> PyTree[Array]:
        return jax.tree.map(lambda x: x * _on_examples(jnp.sqrt(self.weight), x), values)

    def _weighted(self, values: Array, coefficient_mode: CoefficientMode) -> Array:
        """Per-example loss `values` times the coefficient of `coefficient_mode`."""
        return values * _on_examples(self._coefficient(coefficient_mode), values)

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
        return self._weighted(self.evaluate_unweighted(targets), coefficient_mode)

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
        return _factor_times_replicated_one_hot(
            self.multiply_ggn_factor_unweighted, self.ggn_factor_inner_shape, self.dtype, index
        )

    def multiply_ggn(self, vector: Sequence[Array]) -> tuple[Array, ...]:
        """Multiplies a vector by the GGN `G` of the loss with respect to its inputs.

        **Arguments:** `vector`, a tuple shaped like `inputs`.

        **Returns:** `G v`, a tuple shaped like `inputs` (summed over examples, times `weight`).
        """
        return self._times_weight(self.multiply_ggn_unweighted(vector))

    def multiply_ggn_factor(self, vector: Array) -> tuple[Array, ...]:
        """Multiplies by the GGN factor `B` (`B Bᵀ = G`).

        **Arguments:** `vector`, an array of shape `ggn_factor_inner_shape`.

        **Returns:** `B v`, a tuple shaped like `inputs` (times `sqrt(weight)`).
        """
        return self._times_sqrt_weight(self.multiply_ggn_factor_unweighted(vector))

    def multiply_ggn_factor_transpose(self, vector: Sequence[Array]) -> Array:
        """Multiplies by the transposed GGN factor `Bᵀ`.

        **Arguments:** `vector`, a tuple shaped like `inputs`.

        **Returns:** `Bᵀ v`, an array of shape `ggn_factor_inner_shape` (times `sqrt(weight)`).
        """
        return self._times_sqrt_weight(self.multiply_ggn_factor_transpose_unweighted(vector))

    def multiply_ggn_factor_replicated_one_hot(self, index: tuple[int, ...]) -> tuple[Array, ...]:
        """Multiplies the GGN factor `B` by a replicated one-hot vector.

        The vector has shape `ggn_factor_inner_shape` and is one at event position `index[0]` of
        every example (every position of the batch axes) and zero elsewhere. Summed over all
        indices, the outer products of the per-example slices of the results give the per-example
        GGN blocks, which is what the exact estimation modes use.

        **Arguments:** `index`, a one-element tuple: the position on the event axis.

        **Returns:** A tuple shaped like `inputs` (times `sqrt(weight)`).
        """
        unweighted = self.multiply_ggn_factor_replicated_one_hot_unweighted(index)
        return self._times_sqrt_weight(unweighted)


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
        return _factor_times_replicated_one_hot(
            self.multiply_fisher_factor_unweighted,
            self.fisher_factor_inner_shape,
            self.dtype,
            index,
        )

    def multiply_fisher(self, vector: Sequence[Array]) -> tuple[Array, ...]:
        """Multiplies a vector by the Fisher `F` of the distribution with respect to `inputs`.

        **Arguments:** `vector`, a tuple shaped like `inputs`.

        **Returns:** `F v`, a tuple shaped like `inputs` (summed over examples, times `weight`).
        """
        return self._times_weight(self.multiply_fisher_unweighted(vector))

    def multiply_fisher_factor(self, vector: Array) -> tuple[Array, ...]:
        """Multiplies by the Fisher factor `B` (`B Bᵀ = F`).

        **Arguments:** `vector`, an array of shape `fisher_factor_inner_shape`.

        **Returns:** `B v`, a tuple shaped like `inputs` (times `sqrt(weight)`).
        """
        return self._times_sqrt_weight(self.multiply_fisher_factor_unweighted(vector))

    def multiply_fisher_factor_transpose(self, vector: Sequence[Array]) -> Array:
        """Multiplies by the transposed Fisher factor `Bᵀ`.

        **Arguments:** `vector`, a tuple shaped like `inputs`.

        **Returns:** `Bᵀ v`, an array of shape `fisher_factor_inner_shape` (times `sqrt(weight)`).
        """
        return self._times_sqrt_weight(self.multiply_fisher_factor_transpose_unweighted(vector))

    def multiply_fisher_factor_replicated_one_hot(
        self, index: tuple[int, ...]
    ) -> tuple[Array, ...]:
        """Multiplies the Fisher factor `B` by a replicated one-hot vector.

        See `LossFunction.multiply_ggn_factor_replicated_one_hot` for the vector.

        **Arguments:** `index`, a one-element tuple: the position on the event axis.

        **Returns:** A tuple shaped like `inputs` (times `sqrt(weight)`).
        """
        unweighted = self.multiply_fisher_factor_replicated_one_hot_unweighted(index)
        return self._times_sqrt_weight(unweighted)

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


class AbstractFisherAsGGNLoss(NegativeLogProbLoss):
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
