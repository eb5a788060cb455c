"""Step rules: the update `δ` from the direction and the previous update (momentum)."""

import abc
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, PyTree

from .._core.methods import pytree_method
from .hyperparameters import AbstractHyperparameter, CoefficientRange, GivenHyperparameter
from .quadratic_model import exact_quadratic_model, solve_quadratic_model
from .step_context import GivenValues, StepContext


class StepCoefficients(eqx.Module):
    """The learning rate and momentum of a step (final).

    **Fields:**

    - `learning_rate`, `momentum`: the coefficients (the direction's is `-learning_rate`).
    - `quad_change`: the quadratic model's predicted change of the step, `None` when the rule
      computed no model (no coefficient adapted).
    """

    learning_rate: Float[Array, ""]
    momentum: Float[Array, ""]
    quad_change: Float[Array, ""] | None


class StepProposal(eqx.Module):
    """What a step rule proposes (final).

    **Fields:**

    - `delta`: the update.
    - `state`: the step rule's state for the next step (e.g. the velocity).
    - `coefficients`: the `StepCoefficients` it used.
    """

    delta: PyTree[Array]
    state: PyTree[Array]
    coefficients: StepCoefficients


class AbstractStepRule(eqx.Module):
    """How the update is formed from the direction and the rule's state (the extension point).

    `init` makes the rule's state (kept in `Optimizer.State.step_rule_state`), `__call__`
    proposes the update and the next state; the optimizer applies the update unless its guard
    skips or rejects the step, in which case the state is kept as it was.
    """

    @abc.abstractmethod
    def init(self, params: PyTree[Array]) -> PyTree[Array]:
        """The rule's state before the first step.

        **Arguments:**

        - `params`: the parameters (`eqx.filter(params, eqx.is_inexact_array)`).

        **Returns:**

        A PyTree of arrays.
        """

    @abc.abstractmethod
    def check(self, given: GivenValues) -> None:
        """Raises `ValueError` when `step` got (or lacks) `learning_rate=` / `momentum=` contrary
        to the rule."""

    @abc.abstractmethod
    def fixed_learning_rate(self, context: StepContext) -> Float[Array, ""] | None:
        """This step's learning rate when it is not adapted (for a norm constraint), else `None`."""

    @abc.abstractmethod
    def __call__(
        self,
        direction: PyTree[Array],
        state: PyTree[Array],
        damping: Float[Array, ""],
        context: StepContext,
    ) -> StepProposal:
        """The update.

        **Arguments:**

        - `direction`: the step's direction (the preconditioned gradient).
        - `state`: the rule's state from the previous step (`init`'s at the first).
        - `damping`: this step's damping.
        - `context`: the step.

        **Returns:**

        A `StepProposal`.
        """


class MomentumState(eqx.Module):
    """The state of `MomentumStep` (final).

    **Fields:**

    - `velocity`: the previous update `δ_prev` (zeros before the first step), in the parameters'
      dtypes promoted to at least float32.
    """

    velocity: PyTree[Array]


def _wide(x: Array) -> Array:
    return jnp.zeros(x.shape, jnp.promote_types(x.dtype, jnp.float32))


def _scaled_change(change: Array, slope: Array, scale: Array) -> Array:
    """The model's change `½ s² α + s β` at coefficients scaled by `s`, from its change at `s = 1`
    (`½ α + β`) and its slope term `β = wᵀ b`."""
    alpha = 2 * (change - slope)
    return 0.5 * alpha * scale**2 + slope * scale


def _within_decrease(change: Array, slope: Array, limit: Array) -> Array:
    """The largest `s` in `[0, 1]` whose predicted change `½ s² α + s β` is at least `-limit`
    (1 when the change at `s = 1` is); the smaller root of `½ α s² + β s + limit = 0`."""
    alpha = 2 * (change - slope)
    root = jnp.sqrt(jnp.maximum(slope**2 - 2 * alpha * limit, 0.0))
    quadratic = (-slope - root) / jnp.where(alpha > 0, alpha, 1.0)
    linear = limit / jnp.where(slope < 0, -slope, 1.0)
    scale = jnp.clip(jnp.where(alpha > 0, quadratic, linear), 0.0, 1.0)
    return jnp.where(change < -limit, scale, 1.0)


class MomentumStep(AbstractStepRule):
    """`δ = -lr · u + m · δ_prev` (kfac-jax's update; the velocity is the update itself), with
    each of `lr` and `m` given, scheduled or adapted; adapted ones minimise the exact quadratic
    model over `u` and `δ_prev`, within their bounds.

    **Fields:**

    - `learning_rate`, `momentum`: where each comes from (`GivenHyperparameter`,
      `ScheduledHyperparameter` or `AdaptiveHyperparameter`).
    - `include_damping_in_quad_change`: include the damping term in the predicted change.
    - `max_predicted_decrease`: a trust region when both coefficients are adapted, `τ` or `None`:
      when the quadratic model predicts a decrease larger than `τ·|L|` (`L` the loss on the
      batch), both coefficients are scaled down until it predicts exactly that (a given or
      scheduled coefficient is never changed, so with one the limit does not apply). A loss
      bounded below by zero cannot fall by more than itself; on a minibatch whose exact curvature is nearly flat along
      the step (seen on digits once most batches are fitted: a predicted change of -3,000 for a
      loss of 0.2, and a loss of 1e9 after the step), the model's minimiser is far outside the
      region where it is right.
    """

    learning_rate: AbstractHyperparameter = eqx.field(default_factory=GivenHyperparameter)
    momentum: AbstractHyperparameter = eqx.field(default_factory=GivenHyperparameter)
    include_damping_in_quad_change: bool = eqx.field(static=True, default=False)
    max_predicted_decrease: float | None = eqx.field(static=True, default=None)

    def __check_init__(self):
        if self.max_predicted_decrease is not None and not self.max_predicted_decrease > 0:
            raise ValueError(
                "MomentumStep: max_predicted_decrease must be None or a number > 0, got "
                f"{self.max_predicted_decrease!r}."
            )

    def init(self, params):
        return MomentumState(jax.tree.map(_wide, params))

    @pytree_method
    def check(self, given):
        self.learning_rate.check(given.learning_rate, "learning_rate")
        self.momentum.check(given.momentum, "momentum")

    def _range(self, source: AbstractHyperparameter, given: Any, context: StepContext) -> CoefficientRange:
        return source.range(given, context.step, context.data_seen)

    def fixed_learning_rate(self, context):
        if self.learning_rate.adapted:
            return None
        return self._range(self.learning_rate, context.given.learning_rate, context).lower

    def coefficients(
        self, direction: PyTree[Array], velocity: PyTree[Array], damping: Array, context: StepContext
    ) -> StepCoefficients:
        """The learning rate and momentum: the given or scheduled ones, and for adapted ones the
        minimiser of the exact quadratic model within their bounds (scaled into the trust region
        of `max_predicted_decrease`).

        **Arguments:**

        - `direction`, `velocity`: the two vectors `u` and `δ_prev`.
        - `damping`: this step's damping.
        - `context`: the step.

        **Returns:**

        `StepCoefficients`.
        """
        lr = self._range(self.learning_rate, context.given.learning_rate, context)
        momentum = self._range(self.momentum, context.given.momentum, context)
        if not (self.learning_rate.adapted or self.momentum.adapted):
            return StepCoefficients(lr.lower, momentum.lower, None)
        model = exact_quadratic_model(context, (direction, velocity))
        solution = solve_quadratic_model(
            model,
            damping,
            context.l2_reg,
            (CoefficientRange(-lr.upper, -lr.lower), momentum),
            self.include_damping_in_quad_change,
        )
        w, change = jnp.stack(solution.coefficients), solution.change
        both_adapted = self.learning_rate.adapted and self.momentum.adapted
        if self.max_predicted_decrease is not None and both_adapted:
            limit = self.max_predicted_decrease * jnp.abs(context.loss).astype(change.dtype)
            scale = _within_decrease(change, jnp.dot(w, model.b), limit)
            w, change = scale * w, _scaled_change(change, jnp.dot(w, model.b), scale)
        return StepCoefficients(-w[0], w[1], change)

    def __call__(self, direction, state, damping, context):
        c = self.coefficients(direction, state.velocity, damping, context)
        delta = jax.tree.map(
            lambda u, v: (v * c.momentum.astype(v.dtype) - u * c.learning_rate.astype(u.dtype)).astype(v.dtype),
            direction,
            state.velocity,
        )
        return StepProposal(delta, MomentumState(delta), c)
