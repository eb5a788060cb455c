"""Where a step's learning rate or momentum comes from: passed to `step`, a schedule, or adapted.

A step rule holds one of these per coefficient. `value` gives this step's value, or `None` when the
coefficient is adapted (chosen by the step rule, e.g. from the quadratic model); `check` raises
when `step` is called with or without a value contrary to where the value comes from.
"""

import abc
import inspect
from collections.abc import Callable

import equinox as eqx
import jax.numpy as jnp
from jax.typing import ArrayLike
from jaxtyping import Array

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


class AbstractHyperparameter(eqx.Module):
    """Where the value of a step coefficient (learning rate, momentum, damping) comes from."""

    @abc.abstractmethod
    def value(self, given: Array | None, step: Array, data_seen: Array) -> Array | None:
        """This step's value, or `None` when it is adapted by the step rule.

        **Arguments:**

        - `given`: the value passed to `step` (`None` if none).
        - `step`, `data_seen`: the step counter and the number of examples seen.

        **Returns:**

        A scalar array or `None`.
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

    def value(self, given, step, data_seen):
        return jnp.asarray(given)

    def check(self, given, name):
        if given is None:
            raise ValueError(
                f"Missing {name}: with use_adaptive_{name}=False and no {name}_schedule, pass "
                f"{name}= to step (or set use_adaptive_{name}=True, or give a {name}_schedule)."
            )


class ScheduledHyperparameter(AbstractHyperparameter):
    """A function of the step counter (and of `data_seen=` if it takes that keyword).

    **Fields:**

    - `schedule`: the schedule.
    """

    schedule: Schedule = eqx.field(static=True)

    def value(self, given, step, data_seen):
        return call_schedule(self.schedule, step, data_seen)

    def check(self, given, name):
        if given is not None:
            raise ValueError(
                f"A {name}_schedule was given to the optimizer, so do not pass {name}= to step as "
                "well."
            )


class AdaptiveHyperparameter(AbstractHyperparameter):
    """Adapted by the step rule (the quadratic model for the learning rate and momentum)."""

    def value(self, given, step, data_seen):
        return None

    def check(self, given, name):
        if given is not None:
            raise ValueError(f"use_adaptive_{name}=True, so do not pass {name}= to step (it is adapted).")
