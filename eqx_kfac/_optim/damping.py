"""Damping rules: the damping `λ` of each step, and how it follows the step's outcome.

A rule owns its state (`init`, kept in `Optimizer.State.damping_state`). `value` is this step's
damping; `update` runs after the guard has decided whether the update is applied, and gives the
state for the next step with a `DampingReport` (the reduction ratio `ρ`, the loss at the new
parameters and the predicted change; NaN where the rule computed none).
"""

import abc
import math
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, PyTree

from .._core.methods import pytree_method
from .hyperparameters import AbstractHyperparameter, GivenHyperparameter, ScheduledHyperparameter
from .quadratic_model import (
    approximate_quadratic_model,
    exact_quadratic_model,
    levenberg_marquardt_damping,
    solve_quadratic_model,
)
from .step_context import GivenValues, StepContext


class DampingState(eqx.Module):
    """The state of the built-in damping rules (final).

    **Fields:**

    - `damping`: the damping for the next step (adaptive), or the last step's (otherwise).
    """

    damping: Float[Array, ""]


class StepOutcome(eqx.Module):
    """What a damping rule sees of the step it adapts to (final).

    **Fields:**

    - `delta`: the proposed update.
    - `new_params`: the parameters after the update (as proposed, whether applied or not).
    - `quad_change`: the step rule's predicted change, `None` when it computed none.
    - `new_loss`: the loss at `new_params` when the guard computed it, else `None`.
    - `applied`: whether the update is applied.
    - `faulty`: whether the step was not applied because something was not finite or the loss
      rose (a skipped or rejected step).
    """

    delta: PyTree[Array]
    new_params: PyTree[Any]
    quad_change: Float[Array, ""] | None
    new_loss: Float[Array, ""] | None
    applied: Bool[Array, ""]
    faulty: Bool[Array, ""]


class DampingReport(eqx.Module):
    """The damping rule's findings about the step (final; NaN where not computed).

    **Fields:**

    - `rho`: the reduction ratio `(L(θ + δ) - L(θ)) / Δq`.
    - `new_loss`: the loss after the update.
    - `quad_change`: the predicted change `Δq`.
    """

    rho: Float[Array, ""]
    new_loss: Float[Array, ""]
    quad_change: Float[Array, ""]


def damping_report(
    outcome: StepOutcome, context: StepContext, rho: Float[Array, ""] | None = None
) -> DampingReport:
    """The `DampingReport` of a step, NaN for what neither the rule nor the step computed.

    A rule that does not adapt at this step (a given or scheduled damping, or an adaptive one
    between its adaptations) reports `rho` as NaN, and the new loss and predicted change when the
    guard and the step rule computed them (`outcome.new_loss`, `outcome.quad_change`).

    **Arguments:**

    - `outcome`: the step's `StepOutcome`.
    - `context`: the step (its loss's dtype is the report's).
    - `rho`: the reduction ratio when the rule computed it, else `None`.

    **Returns:**

    A `DampingReport` of scalars in the loss's dtype.
    """
    dtype = context.loss.dtype

    def known(value: Array | None) -> Float[Array, ""]:
        return jnp.full((), jnp.nan, dtype) if value is None else jnp.asarray(value).astype(dtype)

    return DampingReport(known(rho), known(outcome.new_loss), known(outcome.quad_change))


class AbstractDampingRule(eqx.Module):
    """How each step's damping is chosen and adapted (the extension point)."""

    @abc.abstractmethod
    def init(self, dtype: Any) -> PyTree[Array]:
        """The rule's state before the first step.

        **Arguments:**

        - `dtype`: the parameters' floating dtype (for the damping scalar).

        **Returns:**

        A PyTree of arrays (the built-in rules: a `DampingState`).
        """

    @abc.abstractmethod
    def value(self, state: PyTree[Array], context: StepContext) -> Float[Array, ""]:
        """This step's damping.

        **Arguments:**

        - `state`: the rule's state.
        - `context`: the step (`context.given.damping` is the `damping` passed to `step`).

        **Returns:**

        A scalar.
        """

    @pytree_method
    def calibrates(self) -> bool:
        """Whether a directly called first step calibrates this rule's initial damping first
        (repeating the step's adaptation on its batch until the damping stops changing)."""
        return False

    @abc.abstractmethod
    def check(self, given: GivenValues) -> None:
        """Raises `ValueError` when `step` got (or lacks) a `damping=` contrary to the rule."""

    @abc.abstractmethod
    def update(
        self, state: PyTree[Array], damping: Float[Array, ""], outcome: StepOutcome, context: StepContext
    ) -> tuple[PyTree[Array], DampingReport]:
        """The state for the next step, from this step's outcome.

        **Arguments:**

        - `state`: the rule's state.
        - `damping`: this step's damping.
        - `outcome`: the `StepOutcome`.
        - `context`: the step.

        **Returns:**

        `(new_state, report)`.
        """


class _AbstractValueDamping(AbstractDampingRule):
    """A damping taken from a hyperparameter and stored as the state, never adapted."""

    source: eqx.AbstractVar[AbstractHyperparameter]

    def init(self, dtype):
        return DampingState(jnp.zeros((), dtype))

    def value(self, state, context):
        return self.source.range(context.given.damping, context.step, context.data_seen).lower

    @pytree_method
    def check(self, given):
        self.source.check(given.damping, "damping")

    def update(self, state, damping, outcome, context):
        return DampingState(damping.astype(state.damping.dtype)), damping_report(outcome, context)


class GivenDamping(_AbstractValueDamping):
    """The damping passed to `step` at each step."""

    source: AbstractHyperparameter = eqx.field(default_factory=GivenHyperparameter)


class ScheduledDamping(_AbstractValueDamping):
    """A damping schedule: a function of the step counter (and of `data_seen=`).

    **Fields:**

    - `source`: the schedule (a `ScheduledHyperparameter`).
    """

    source: ScheduledHyperparameter

    def __init__(self, schedule: Any):
        """**Arguments:**

        - `schedule`: `schedule(step)` or `schedule(step, data_seen=...)`.
        """
        self.source = ScheduledHyperparameter(schedule)


class LevenbergMarquardtDamping(AbstractDampingRule):
    """Levenberg-Marquardt adaptation from the reduction ratio `ρ` (kfac-jax's adaptive damping),
    with an immediate increase after a step that was not applied.

    Every `interval` steps (and in every trial of the initial damping's calibration),
    `ρ = (L(θ + δ) - L(θ)) / Δq` compares the loss change with the
    quadratic model's prediction `Δq` (the step rule's, or, when it computed none or with
    `own_prediction`, the model of the update `δ` with the K-FAC estimate, or with the exact
    curvature when `always_exact`); the
    damping is multiplied by `decay ** interval` when `ρ > upper`, divided by it when
    `ρ < lower` (or `ρ` is NaN). A step the guard did not apply (a rejected step, or an update
    that was not finite) then multiplies the damping by `fault_increase` at once (kfac-jax's
    `reject_damping_increase_factor`), and with `raise_at_once` a collapse of `ρ` between the
    intervals raises it at once. The result is clipped to `[minimum, maximum]`. A step the loss
    cannot resolve (a predicted change below `4·eps·|L|`, or a loss that did not change at all:
    a batch fitted to rounding, where `ρ` is 0 or NaN) leaves the damping as it is; kfac-jax
    raises it.

    **Fields:**

    - `initial_damping`, `interval`, `decay`, `lower`, `upper`, `minimum`, `maximum`: as above.
    - `always_exact`: predict with the exact curvature also when the step rule gave no model.
    - `include_damping_in_quad_change`: include the damping term in `Δq`.
    - `fault_increase`: the factor applied after a step that was not applied (`1` keeps the
      damping, as kfac-jax's default).
    - `calibrate`: before the first step (called outside `jit`), repeat its damping adaptation
      on its batch until the damping stops changing, at most 100 times (kfac-jax's
      `use_initial_damping_calibration`).
    - `own_prediction`: compute `Δq` as above also when the step rule gave its own. The adaptive
      step rule predicts with the exact curvature and chooses the coefficients that minimize
      that model, so its `Δq` matches the loss change (`ρ` near 1) whatever the damping, and the
      damping falls to `minimum` within a few dozen steps and stays there while the adapted
      learning rate shrinks; predicted with the K-FAC estimate, `ρ` measures how well the damped
      estimate models the loss along the step, and the damping keeps steering (one K-FAC
      product per adaptation, every `interval` steps).
    - `raise_at_once`: between the intervals, when the step computed both the loss after the
      update (step rejection) and the model's predicted change (adaptive coefficients), a `ρ`
      below `lower` raises the damping at once instead of at the next interval (decreases still
      wait for the interval). kfac-jax waits.
    """

    initial_damping: float = eqx.field(static=True)
    interval: int = eqx.field(static=True, default=5)
    decay: float = eqx.field(static=True, default=0.9)
    lower: float = eqx.field(static=True, default=0.25)
    upper: float = eqx.field(static=True, default=0.75)
    minimum: float = eqx.field(static=True, default=1e-8)
    maximum: float = eqx.field(static=True, default=math.inf)
    always_exact: bool = eqx.field(static=True, default=False)
    include_damping_in_quad_change: bool = eqx.field(static=True, default=False)
    fault_increase: float = eqx.field(static=True, default=1.0)
    raise_at_once: bool = eqx.field(static=True, default=False)
    calibrate: bool = eqx.field(static=True, default=False)
    own_prediction: bool = eqx.field(static=True, default=False)

    def __check_init__(self):
        problems = []
        if not 0.0 < self.initial_damping:
            problems.append(f"initial_damping must be > 0, got {self.initial_damping}")
        if not (isinstance(self.interval, int) and self.interval >= 1):
            problems.append(f"interval must be an integer >= 1, got {self.interval!r}")
        if not 0.0 < self.decay <= 1.0:
            problems.append(f"decay must be in (0, 1], got {self.decay}")
        if self.lower > self.upper:
            problems.append(f"lower ({self.lower}) is above upper ({self.upper})")
        if not 0.0 <= self.minimum <= self.maximum:
            problems.append(f"need 0 <= minimum <= maximum, got {self.minimum} and {self.maximum}")
        if self.fault_increase < 1.0:
            problems.append(f"fault_increase must be >= 1, got {self.fault_increase}")
        if problems:
            raise ValueError("LevenbergMarquardtDamping: " + "; ".join(problems) + ".")

    def init(self, dtype):
        return DampingState(jnp.asarray(self.initial_damping, dtype))

    @pytree_method
    def calibrates(self):
        return self.calibrate

    def value(self, state, context):
        return state.damping

    @pytree_method
    def check(self, given):
        if given.damping is not None:
            raise ValueError(
                "The damping is adapted (LevenbergMarquardtDamping; kfac_jax: use_adaptive_damping=True), "
                "so do not pass damping= to step."
            )

    def _adapt(
        self, state: DampingState, damping: Array, outcome: StepOutcome, context: StepContext
    ) -> tuple[Array, DampingReport]:
        change = None if self.own_prediction else outcome.quad_change
        if change is None:
            model_of = exact_quadratic_model if self.always_exact else approximate_quadratic_model
            change = solve_quadratic_model(
                model_of(context, [outcome.delta]), damping, context.l2_reg, (1.0,),
                self.include_damping_in_quad_change,
            ).change
        new_loss = context.loss_at(outcome.new_params) if outcome.new_loss is None else outcome.new_loss
        new_damping, rho = levenberg_marquardt_damping(
            context.loss, new_loss, change, damping,
            lower_threshold=self.lower, upper_threshold=self.upper,
            decay_factor=self.decay**self.interval, min_damping=self.minimum,
            max_damping=self.maximum,
        )
        dtype = context.loss.dtype
        # A predicted change below the loss's resolution (a batch fitted to rounding) says
        # nothing about the model: the loss cannot show it, and `ρ` is 0 or NaN.
        resolution = 4 * jnp.finfo(dtype).eps * jnp.abs(context.loss)
        resolved = (jnp.abs(change) > resolution) & (new_loss != context.loss)
        new_damping = jnp.where(resolved, new_damping, damping)
        report = DampingReport(rho.astype(dtype), new_loss.astype(dtype), change.astype(dtype))
        return new_damping.astype(state.damping.dtype), report

    def update(self, state, damping, outcome, context):
        def keep():
            known = outcome.new_loss is not None and outcome.quad_change is not None
            if not (self.raise_at_once and known):
                return state.damping, damping_report(outcome, context)
            # `ρ` is known without another evaluation: a collapse raises the damping now.
            adapted, report = self._adapt(state, damping, outcome, context)
            return jnp.maximum(adapted, state.damping), report

        due = (context.step + 1) % self.interval == 0 if not context.calibrating else True
        new_damping, report = jax.lax.cond(
            due, lambda: self._adapt(state, damping, outcome, context), keep
        )
        if self.fault_increase != 1.0:
            raised = jnp.clip(new_damping * self.fault_increase, self.minimum, self.maximum)
            new_damping = jnp.where(outcome.faulty, raised, new_damping)
        return DampingState(new_damping.astype(state.damping.dtype)), report
