"""Damping rules: the damping `λ` of each step, and how it follows the step's outcome.

A rule keeps its state in `Optimizer.State.damping` (a scalar). `value` is this step's damping;
`update` runs after the update has been formed and gives the state for the next step, with the
reduction ratio `ρ`, the loss at the new parameters and the quadratic model's predicted change
(`NaN` where the rule does not compute them).
"""

import abc
import math
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.typing import ArrayLike
from jaxtyping import Array, Float

from .._core import distributed as _distributed
from .quad_model import levenberg_marquardt_damping, solve_quadratic_model
from .context import StepContext
from .hyperparameters import AbstractHyperparameter, GivenHyperparameter, ScheduledHyperparameter
from .quadratic import approximate_quadratic_model, exact_quadratic_model

DampingOutcome = tuple[Float[Array, ""], Float[Array, ""], Float[Array, ""], Float[Array, ""]]


class AbstractDampingRule(eqx.Module):
    """How each step's damping is chosen and adapted (the extension point).

    Subclasses implement `initial`, `value`, `check` and `update`.
    """

    @abc.abstractmethod
    def initial(self) -> float:
        """The damping state before the first step."""

    @abc.abstractmethod
    def value(self, state: Float[Array, ""], context: StepContext) -> Float[Array, ""]:
        """This step's damping.

        **Arguments:**

        - `state`: the damping state (`Optimizer.State.damping`).
        - `context`: the step (`context.given[2]` is the `damping` passed to `step`).

        **Returns:**

        A scalar.
        """

    @abc.abstractmethod
    def check(self, given: ArrayLike | None) -> None:
        """Raises `ValueError` when `step` got (or lacks) a `damping=` contrary to the rule."""

    @abc.abstractmethod
    def update(
        self,
        state: Float[Array, ""],
        damping: Float[Array, ""],
        quad_change: Float[Array, ""] | None,
        delta: Any,
        new_params: Any,
        context: StepContext,
    ) -> DampingOutcome:
        """The damping state for the next step, from this step's outcome.

        **Arguments:**

        - `state`, `damping`: the damping state and this step's damping.
        - `quad_change`: the quadratic model's predicted change of the step rule, or `None`
          when it computed none.
        - `delta`: the update.
        - `new_params`: the parameters after the update.
        - `context`: the step.

        **Returns:**

        `(new_state, rho, new_loss, quad_change)`, NaN where not computed.
        """


def _nan(context: StepContext) -> Float[Array, ""]:
    return jnp.full((), jnp.nan, context.loss.dtype)


class _ValueDamping(AbstractDampingRule):
    """A damping taken from a hyperparameter and stored as the state, never adapted."""

    source: eqx.AbstractVar[AbstractHyperparameter]

    def initial(self) -> float:
        return 0.0

    def value(self, state, context):
        return jnp.asarray(self.source.value(context.given[2], context.step, context.data_seen))

    def check(self, given):
        self.source.check(given, "damping")

    def update(self, state, damping, quad_change, delta, new_params, context):
        nan = _nan(context)
        return damping.astype(state.dtype), nan, nan, nan if quad_change is None else quad_change


class GivenDamping(_ValueDamping):
    """The damping passed to `step` at each step."""

    source: AbstractHyperparameter = eqx.field(default_factory=GivenHyperparameter)


class ScheduledDamping(_ValueDamping):
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
    """Levenberg-Marquardt adaptation from the reduction ratio `ρ` (kfac-jax's adaptive damping).

    Every `interval` steps, `ρ = (L(θ + δ) - L(θ)) / Δq` compares the loss change with the
    quadratic model's prediction `Δq` (the step rule's, or, when it computed none, the model of
    the update `δ` with the K-FAC estimate, or with the exact curvature when `always_exact`); the
    damping is multiplied by `decay ** interval` when `ρ > upper`, divided by it when
    `ρ < lower` (or `ρ` is NaN), and clipped to `[minimum, maximum]`.

    **Fields:**

    - `initial_damping`, `interval`, `decay`, `lower`, `upper`, `minimum`, `maximum`: as above.
    - `always_exact`: predict with the exact curvature also when the step rule gave no model.
    - `include_damping_in_quad_change`: include the damping term in `Δq`.
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

    def initial(self) -> float:
        return self.initial_damping

    def value(self, state, context):
        return state

    def check(self, given):
        if given is not None:
            raise ValueError(
                "use_adaptive_damping=True, so do not pass damping= to step (it is adapted)."
            )

    def update(self, state, damping, quad_change, delta, new_params, context):
        def adapt():
            change = quad_change
            if change is None:
                model_of = exact_quadratic_model if self.always_exact else approximate_quadratic_model
                _, change = solve_quadratic_model(
                    model_of(context, [delta]), damping, context.l2_reg, (1.0,),
                    self.include_damping_in_quad_change,
                )
            new_loss = _distributed.pmean(
                context.loss_of(context.value_func(new_params, *context.func_args[1:])),
                context.axis_name,
            )
            new_damping, rho = levenberg_marquardt_damping(
                context.loss, new_loss, change, damping,
                lower_threshold=self.lower, upper_threshold=self.upper,
                decay_factor=self.decay**self.interval, min_damping=self.minimum,
                max_damping=self.maximum,
            )
            return new_damping.astype(state.dtype), rho, new_loss, change

        def keep():
            nan = _nan(context)
            return state, nan, nan, nan if quad_change is None else quad_change

        return jax.lax.cond((context.step + 1) % self.interval == 0, adapt, keep)
