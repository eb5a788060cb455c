"""Where a step coefficient (learning rate, momentum, damping) comes from: passed to `step`, a
schedule, or adapted by the step rule within bounds.

Every source gives the step rule an interval for the coefficient: a given or scheduled value `v`
is the interval `[v, v]`; an adapted coefficient is free between its `lower` and `upper` bounds,
where the step rule's quadratic model places it. `check` raises when `step` is called with or
without a value contrary to where the value comes from.
"""

import abc
import inspect
import math
from collections.abc import Callable
from typing import ClassVar

import equinox as eqx
import jax.numpy as jnp
from jax.typing import ArrayLike
from jaxtyping import Array, Float

from .._core.methods import pytree_method

Schedule = Callable[..., ArrayLike]


def call_schedule(schedule: Schedule, step: Array, data_seen: Array) -> Array:
    """`schedule(step)`, or `schedule(step, data_seen=data_seen)` if it takes that keyword.

    **Arguments:**

    - `schedule`: a function of the step counter (and optionally of `data_seen=`).
    - `step`, `data_seen`: the step counter and the number of examples seen.

    **Returns:**

    The scheduled value as an array.
    """
    try:
        accepts_data_seen = "data_seen" in inspect.signature(schedule).parameters
    except (TypeError, ValueError):
        accepts_data_seen = False
    if accepts_data_seen:
        return jnp.asarray(schedule(step, data_seen=data_seen))
    return jnp.asarray(schedule(step))


class CoefficientRange(eqx.Module):
    """The interval a step coefficient may take in this step (final).

    **Fields:**

    - `lower`, `upper`: the bounds (equal for a given or scheduled value; infinite where an
      adapted coefficient is unbounded).
    """

    lower: Float[Array, ""]
    upper: Float[Array, ""]

    @classmethod
    def point(cls, value: ArrayLike) -> "CoefficientRange":
        """The interval `[value, value]`."""
        value = jnp.asarray(value)
        return cls(value, value)


class AbstractHyperparameter(eqx.Module):
    """Where the value of a step coefficient comes from (the extension point).

    `adapted` (a class variable) says whether the step rule chooses the value; `range` gives the
    interval it may take in this step.
    """

    adapted: ClassVar[bool]

    @abc.abstractmethod
    def range(self, given: Array | None, step: Array, data_seen: Array) -> CoefficientRange:
        """This step's interval for the coefficient.

        **Arguments:**

        - `given`: the value passed to `step` (`None` if none).
        - `step`, `data_seen`: the step counter and the number of examples seen.

        **Returns:**

        A `CoefficientRange`.
        """

    @abc.abstractmethod
    def check(self, given: ArrayLike | None, name: str) -> None:
        """Raises `ValueError` when `step` got (or lacks) a value for it, contrary to its source.

        **Arguments:**

        - `given`: what `step` received for it.
        - `name`: its keyword, e.g. `"learning_rate"`, for the message.
        """


class GivenHyperparameter(AbstractHyperparameter):
    """The value passed to `step` (required there)."""

    adapted: ClassVar[bool] = False

    def range(self, given, step, data_seen):
        return CoefficientRange.point(given)

    @pytree_method
    def check(self, given, name):
        if given is None:
            raise ValueError(
                f"Missing {name}: it is given at each step (GivenHyperparameter; kfac_jax.Optimizer "
                f"with use_adaptive_{name}=False and no {name}_schedule), so pass {name}= to step, "
                f"or build the step rule with an AdaptiveHyperparameter or ScheduledHyperparameter "
                f"for it (kfac_jax: use_adaptive_{name}=True or a {name}_schedule)."
            )


class ScheduledHyperparameter(AbstractHyperparameter):
    """A function of the step counter (and of `data_seen=` if it takes that keyword).

    **Fields:**

    - `schedule`: the schedule.
    """

    schedule: Schedule = eqx.field(static=True)
    adapted: ClassVar[bool] = False

    def range(self, given, step, data_seen):
        return CoefficientRange.point(call_schedule(self.schedule, step, data_seen))

    @pytree_method
    def check(self, given, name):
        if given is not None:
            raise ValueError(
                f"The {name} is scheduled (ScheduledHyperparameter; kfac_jax: {name}_schedule), so do "
                f"not pass {name}= to step as "
                "well."
            )


class AdaptiveHyperparameter(AbstractHyperparameter):
    """Chosen by the step rule (the quadratic model for the learning rate and momentum), between
    `lower` and `upper`.

    **Fields:**

    - `lower`, `upper`: the bounds (default: unbounded, as in kfac-jax). The quadratic model is
      minimised over the box the bounds make, exactly (it is convex).
    """

    lower: float = eqx.field(static=True, default=-math.inf)
    upper: float = eqx.field(static=True, default=math.inf)
    adapted: ClassVar[bool] = True

    def __check_init__(self):
        if not self.lower <= self.upper:
            raise ValueError(
                f"AdaptiveHyperparameter: lower ({self.lower}) must not exceed upper ({self.upper})."
            )

    def range(self, given, step, data_seen):
        return CoefficientRange(jnp.asarray(self.lower), jnp.asarray(self.upper))

    @pytree_method
    def check(self, given, name):
        if given is not None:
            raise ValueError(
                f"The {name} is adapted (AdaptiveHyperparameter; kfac_jax: use_adaptive_{name}=True), "
                f"so do not pass {name}= to step."
            )
