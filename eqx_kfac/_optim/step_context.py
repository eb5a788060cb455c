"""What the optimizer's parts see of a step: `StepContext`, and the values passed to `step`."""

from collections.abc import Callable, Hashable
from typing import Any

import equinox as eqx
from jaxtyping import Array, Float, PyTree

from .._core import distributed as _distributed
from .._curvature.estimators import BlockDiagonalCurvature, EstimatorState, ImplicitExactCurvature


class GivenValues(eqx.Module):
    """The coefficients passed to `Optimizer.step` (final).

    **Fields:**

    - `learning_rate`, `momentum`, `damping`: the values passed, `None` where not passed.
    """

    learning_rate: Float[Array, ""] | None = None
    momentum: Float[Array, ""] | None = None
    damping: Float[Array, ""] | None = None


class StepContext(eqx.Module):
    """The quantities of one step that the optimizer's parts work with (final).

    **Fields:**

    - `step`, `data_seen`: the step counter and the number of examples seen before this step.
    - `func_args`: the value function's arguments, `(params, [func_state], [rng], batch)`.
    - `loss`, `grads`: the loss and its gradient (averaged over devices).
    - `estimator`: the K-FAC estimator (`BlockDiagonalCurvature`).
    - `estimator_state`: its state: before the step's curvature update while the refresh
      schedule runs, after it (and after the inverse refresh) for the other parts.
    - `implicit`: the exact curvature products (`ImplicitExactCurvature`).
    - `estimation_mode`: the curvature estimation mode (`"ggn_..."` or `"fisher_..."`).
    - `l2_reg`: the L2 coefficient of the loss.
    - `axis_name`: the data axis inside the multi-device step, `None` on one device.
    - `value_func`, `loss_of`: the value function and the map from its output to the loss value
      (see `loss_at`).
    - `given`: the `GivenValues` passed to `step`.
    - `calibrating`: (static) the step is a trial of the initial damping's calibration
      (`use_initial_damping_calibration`): adaptive damping adapts in it whatever the counter.
    """

    step: Array
    data_seen: Array
    func_args: tuple[Any, ...]
    loss: Float[Array, ""]
    grads: PyTree[Array]
    estimator: BlockDiagonalCurvature
    estimator_state: EstimatorState
    implicit: ImplicitExactCurvature
    estimation_mode: str = eqx.field(static=True)
    l2_reg: float
    axis_name: Hashable | None = eqx.field(static=True)
    value_func: Callable[..., Any] = eqx.field(static=True)
    loss_of: Callable[[Any], Array] = eqx.field(static=True)
    given: GivenValues
    calibrating: bool = eqx.field(static=True, default=False)

    def loss_at(self, params: PyTree) -> Float[Array, ""]:
        """The loss at `params` on this step's batch (averaged over devices).

        **Arguments:**

        - `params`: parameters with the structure of `func_args[0]`.

        **Returns:**

        A scalar.
        """
        out = self.value_func(params, *self.func_args[1:])
        return _distributed.pmean(self.loss_of(out), self.axis_name)
