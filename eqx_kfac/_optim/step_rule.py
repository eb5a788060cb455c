"""Step rules: the update `δ` from the direction and the previous update (momentum)."""

import abc
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.typing import ArrayLike
from jaxtyping import Array, Float, PyTree

from .quad_model import solve_quadratic_model
from .context import StepContext
from .hyperparameters import AbstractHyperparameter, GivenHyperparameter
from .quadratic import exact_quadratic_model

StepOutcome = tuple[
    PyTree[Array], PyTree[Array], Float[Array, ""], Float[Array, ""], Float[Array, ""] | None
]


class AbstractStepRule(eqx.Module):
    """How the update is formed from the direction and the velocity (the extension point).

    The velocity it returns is kept in `Optimizer.State.velocities` for the next step.
    """

    @abc.abstractmethod
    def check(self, learning_rate: ArrayLike | None, momentum: ArrayLike | None) -> None:
        """Raises `ValueError` when `step` got (or lacks) `learning_rate=` / `momentum=` contrary
        to the rule."""

    @abc.abstractmethod
    def fixed_learning_rate(self, context: StepContext) -> Float[Array, ""] | None:
        """This step's learning rate when it is not adapted (for a norm constraint), else `None`."""

    @abc.abstractmethod
    def __call__(
        self,
        direction: PyTree[Array],
        velocity: PyTree[Array],
        damping: Float[Array, ""],
        context: StepContext,
    ) -> StepOutcome:
        """The update.

        **Arguments:**

        - `direction`: the step's direction (the preconditioned gradient).
        - `velocity`: the velocity returned by the previous step (zeros at the first).
        - `damping`: this step's damping.
        - `context`: the step.

        **Returns:**

        `(delta, velocity, learning_rate, momentum, quad_change)`: the update, the velocity for
        the next step, the coefficients it used (for the statistics), and the quadratic model's
        predicted change (`None` when it computed none).
        """


class MomentumStep(AbstractStepRule):
    """`δ = -lr · u + m · δ_prev` (kfac-jax's update; the velocity is the update itself), with
    each of `lr` and `m` given, scheduled or adapted; adapted ones minimise the exact quadratic
    model over `u` and `δ_prev`.

    **Fields:**

    - `learning_rate`, `momentum`: where each comes from (`GivenHyperparameter`,
      `ScheduledHyperparameter` or `AdaptiveHyperparameter`).
    - `include_damping_in_quad_change`: include the damping term in the predicted change.
    """

    learning_rate: AbstractHyperparameter = eqx.field(default_factory=GivenHyperparameter)
    momentum: AbstractHyperparameter = eqx.field(default_factory=GivenHyperparameter)
    include_damping_in_quad_change: bool = eqx.field(static=True, default=False)

    def check(self, learning_rate, momentum):
        self.learning_rate.check(learning_rate, "learning_rate")
        self.momentum.check(momentum, "momentum")

    def fixed_learning_rate(self, context):
        return self.learning_rate.value(context.given[0], context.step, context.data_seen)

    def coefficients(
        self, direction: Any, velocity: Any, damping: Any, context: StepContext
    ) -> tuple[tuple[Array, Array], Array | None]:
        """`((coefficient of u, coefficient of δ_prev), quad_change)`, after the quadratic model
        for the adapted ones (`quad_change` is `None` when none is adapted)."""
        learning_rate = self.fixed_learning_rate(context)
        momentum = self.momentum.value(context.given[1], context.step, context.data_seen)
        fixed = (None if learning_rate is None else -learning_rate, momentum)
        if None not in fixed:
            return tuple(jnp.asarray(c) for c in fixed), None
        model = exact_quadratic_model(context, (direction, velocity))
        return solve_quadratic_model(
            model, damping, context.l2_reg, fixed, self.include_damping_in_quad_change
        )

    def __call__(self, direction, velocity, damping, context):
        (c_direction, c_velocity), quad_change = self.coefficients(direction, velocity, damping, context)
        delta = jax.tree.map(lambda u, v: u * c_direction + v * c_velocity, direction, velocity)
        return delta, delta, -c_direction, c_velocity, quad_change
