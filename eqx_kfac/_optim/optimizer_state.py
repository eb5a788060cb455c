"""The state of `Optimizer`: each part's own state, the estimator's, and the counters."""

from typing import Any

import equinox as eqx
import jax.numpy as jnp
from jax.typing import ArrayLike
from jaxtyping import Array, Float, Int, PyTree

from .._curvature.estimators import EstimatorState
from .guard import GuardState

_LOW_WORD = 2**30


class ExampleCount(eqx.Module):
    """A count of examples that does not overflow 32-bit integers: `high · 2³⁰ + low` (final).

    (An `int32` counter wraps after 2³¹ examples, where a schedule of `data_seen` would jump.)

    **Fields:**

    - `high`, `low`: the two words, `0 <= low < 2³⁰`.
    """

    high: Int[Array, ""]
    low: Int[Array, ""]

    @classmethod
    def zero(cls) -> "ExampleCount":
        """No examples."""
        return cls(jnp.zeros((), jnp.int32), jnp.zeros((), jnp.int32))

    def add(self, count: ArrayLike) -> "ExampleCount":
        """The count plus `count` examples (`count < 2³⁰`)."""
        low = self.low + jnp.asarray(count, jnp.int32)
        return ExampleCount(self.high + low // _LOW_WORD, low % _LOW_WORD)

    def as_int(self) -> int:
        """The exact count as a Python integer (reads the two words from the device).

        **Returns:**

        `high · 2³⁰ + low`.
        """
        return int(self.high) * _LOW_WORD + int(self.low)

    @property
    def value(self) -> Float[Array, ""]:
        """The count as a float of the default dtype (exact up to 2²⁴ in float32, 2⁵³ in float64)."""
        dtype = jnp.result_type(float)
        return self.high.astype(dtype) * _LOW_WORD + self.low.astype(dtype)


class OptimizerState(eqx.Module):
    """The state of `Optimizer` (also available as `Optimizer.State`; final).

    **Fields:**

    - `step_rule_state`: the step rule's state (for `MomentumStep`, a `MomentumState` with the
      previous update).
    - `damping_state`: the damping rule's state (for the built-in rules, a `DampingState`).
    - `guard_state`: the step guard's `GuardState` (faults in a row).
    - `estimator_state`: the curvature estimator's state (moving averages and cached inverses).
    - `examples_seen`: the number of examples processed (`ExampleCount`; `data_seen` reads it).
    - `step_counter`: the number of steps taken.
    - `batch_signature`, `params_signature`: (static) the structure, shapes and dtypes of the
      batch and parameters given to `init`; `step` rejects others.
    """

    step_rule_state: PyTree[Array]
    damping_state: PyTree[Array]
    guard_state: GuardState
    estimator_state: EstimatorState
    examples_seen: ExampleCount
    step_counter: Int[Array, ""]
    batch_signature: Any = eqx.field(static=True)
    params_signature: Any = eqx.field(static=True)

    @property
    def velocities(self) -> PyTree[Array]:
        """The step rule's velocity (the previous update, for `MomentumStep`)."""
        return self.step_rule_state.velocity

    @property
    def damping(self) -> Float[Array, ""]:
        """The damping rule's current damping (for the built-in rules)."""
        return self.damping_state.damping

    @property
    def data_seen(self) -> Float[Array, ""]:
        """The number of examples processed, as a float (see `ExampleCount`)."""
        return self.examples_seen.value
