"""What the optimizer's parts see of a step: `StepContext`."""

from collections.abc import Callable, Hashable
from typing import Any, NamedTuple

from jaxtyping import Array, Float, Int, PyTree

from .._curvature.estimators import BlockDiagonalCurvature, EstimatorState, ImplicitExactCurvature


class StepContext(NamedTuple):
    """The quantities of one step that the optimizer's parts work with.

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
    - `value_func`, `loss_of`: the value function (to evaluate the loss at new parameters) and
      the map from its output to the loss value.
    - `given`: the `learning_rate`, `momentum` and `damping` passed to `step` (`None` if not).
    """

    step: Int[Array, ""]
    data_seen: Int[Array, ""]
    func_args: tuple[Any, ...]
    loss: Float[Array, ""]
    grads: PyTree[Array]
    estimator: BlockDiagonalCurvature
    estimator_state: EstimatorState
    implicit: ImplicitExactCurvature
    estimation_mode: str
    l2_reg: float
    axis_name: Hashable | None
    value_func: Callable[..., Any]
    loss_of: Callable[[Any], Array]
    given: tuple[Array | None, Array | None, Array | None]
