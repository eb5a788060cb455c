"""The configuration side of `Optimizer`: its state, argument checks and small helpers.

Everything here runs in Python at construction or call time (never inside the compiled step):
checking the constructor's arguments, the step's hyperparameters, function state and batch (against
the signature of the batch given to `init`).
"""

import inspect
from collections.abc import Callable
from typing import Any, NamedTuple

import equinox as eqx
from jaxtyping import Array, Float, Int, PyTree

from .._core import distributed as _distributed
from .._core.tree import signature
from .._curvature.estimators import EstimatorState
from .._curvature.estimators.modes import ESTIMATION_MODES
from .damping import (
    AbstractDampingRule,
    GivenDamping,
    LevenbergMarquardtDamping,
    ScheduledDamping,
)
from .direction import AbstractDirection, PreconditionedGradient
from .hyperparameters import (
    AbstractHyperparameter,
    AdaptiveHyperparameter,
    GivenHyperparameter,
    Schedule,
    ScheduledHyperparameter,
)
from .refresh import RefreshSchedule
from .step_rule import AbstractStepRule, MomentumStep


class Parts(NamedTuple):
    """The loss function and the parts the kfac-jax keywords of `Optimizer` describe."""

    value_func: Callable[..., Any]
    damping_rule: AbstractDampingRule
    step_rule: AbstractStepRule
    direction: AbstractDirection
    refresh: RefreshSchedule


# The keywords of `Optimizer.__init__` each part replaces when given directly.
_PART_KEYWORDS = {
    "damping_rule": (
        "use_adaptive_damping", "damping_schedule", "initial_damping", "min_damping", "max_damping",
        "damping_adaptation_interval", "damping_adaptation_decay", "damping_lower_threshold",
        "damping_upper_threshold", "always_use_exact_qmodel_for_damping_adjustment",
    ),
    "step_rule": (
        "use_adaptive_learning_rate", "learning_rate_schedule", "use_adaptive_momentum",
        "momentum_schedule", "include_damping_in_quad_change",
    ),
    "direction": ("use_exact_inverses", "norm_constraint", "distributed_precon_apply"),
    "refresh": ("num_burnin_steps", "curvature_update_period", "inverse_update_period", "curvature_ema"),
}


def _hyperparameter(adaptive: bool, schedule: Any) -> AbstractHyperparameter:
    if adaptive:
        return AdaptiveHyperparameter()
    return GivenHyperparameter() if schedule is None else ScheduledHyperparameter(schedule)


def parts_from_keywords(keywords: dict[str, Any]) -> Parts:
    """Checks the keywords of `Optimizer.__init__` and builds the parts they describe.

    **Arguments:**

    - `keywords`: the constructor's arguments by name (its `locals()`, `self` included).

    **Returns:**

    The `Parts`, each the one given directly or the one built from its keywords.
    """
    k = keywords
    defaults = {
        name: p.default for name, p in inspect.signature(type(k["self"]).__init__).parameters.items()
    }
    for part, names in _PART_KEYWORDS.items():
        changed = [n for n in names if k[n] is not defaults[n] and k[n] != defaults[n]]
        if k[part] is not None and changed:
            raise ValueError(
                f"Optimizer got {part}= and the keywords {changed}, which that part replaces; pass "
                f"them to the {type(k[part]).__name__} instead (or drop {part}=)."
            )
    value_func = check_constructor_arguments(
        **{name: k[name] for name in inspect.signature(check_constructor_arguments).parameters}
    )
    if k["use_adaptive_damping"]:
        damping_rule = LevenbergMarquardtDamping(
            k["initial_damping"], k["damping_adaptation_interval"], k["damping_adaptation_decay"],
            k["damping_lower_threshold"], k["damping_upper_threshold"], k["min_damping"],
            k["max_damping"], k["always_use_exact_qmodel_for_damping_adjustment"],
            k["include_damping_in_quad_change"],
        )
    elif k["damping_schedule"] is not None:
        damping_rule = ScheduledDamping(k["damping_schedule"])
    else:
        damping_rule = GivenDamping()
    return Parts(
        value_func=value_func,
        damping_rule=k["damping_rule"] or damping_rule,
        step_rule=k["step_rule"] or MomentumStep(
            _hyperparameter(k["use_adaptive_learning_rate"], k["learning_rate_schedule"]),
            _hyperparameter(k["use_adaptive_momentum"], k["momentum_schedule"]),
            k["include_damping_in_quad_change"],
        ),
        direction=k["direction"] or PreconditionedGradient(
            k["use_exact_inverses"], k["norm_constraint"], k["distributed_precon_apply"]
        ),
        refresh=k["refresh"] or RefreshSchedule(
            k["num_burnin_steps"], k["curvature_update_period"], k["inverse_update_period"],
            k["curvature_ema"],
        ),
    )


class OptimizerState(eqx.Module):
    """The state of `Optimizer` (also available as `Optimizer.State`).

    **Fields:**

    - `velocities`: the step rule's velocity (for the default `MomentumStep`, the previous update
      `θ_t - θ_{t-1}`), shaped like `eqx.filter(params, eqx.is_inexact_array)`.
    - `estimator_state`: the curvature estimator's state (moving averages and cached inverses).
    - `damping`: with adaptive damping, the current damping; otherwise the damping of the last
      step (`initial_damping`, or 0, before the first step).
    - `data_seen`: the number of examples processed.
    - `step_counter`: the number of steps taken.
    - `batch_signature`: (static) the structure, shapes and dtypes of the batch given to `init`;
      `step` rejects batches that differ.
    """

    velocities: PyTree[Array]
    estimator_state: EstimatorState
    damping: Float[Array, ""]
    data_seen: Int[Array, ""]
    step_counter: Int[Array, ""]
    batch_signature: Any = eqx.field(static=True)


def describe_signature(signature: Any) -> str:
    return ", ".join(
        f"{dtype}{list(shape)}" if shape != "static" else f"static {dtype!r}"
        for shape, dtype in signature[1]
    )


def check_constructor_arguments(
    *,
    value_and_grad_func: Callable[..., Any],
    value_func: Callable[..., Any] | None,
    mesh: Any,
    pmap_axis_name: str,
    use_adaptive_learning_rate: bool,
    learning_rate_schedule: Schedule | None,
    use_adaptive_momentum: bool,
    momentum_schedule: Schedule | None,
    use_adaptive_damping: bool,
    damping_schedule: Schedule | None,
    initial_damping: float | None,
    norm_constraint: float | None,
    estimation_mode: str,
    damping_adaptation_interval: int,
    inverse_update_period: int,
    curvature_update_period: int,
    num_burnin_steps: int,
    damping_adaptation_decay: float,
    damping_lower_threshold: float,
    damping_upper_threshold: float,
    curvature_ema: float,
) -> Callable[..., Any]:
    """Raises `ValueError` for inconsistent `Optimizer` arguments; returns the value function.

    The value function is `value_func`, or recovered from `value_and_grad_func.__wrapped__`.
    """
    if mesh is not None:
        _distributed.check_mesh(mesh, pmap_axis_name)
    for adaptive, schedule, name in (
        (use_adaptive_learning_rate, learning_rate_schedule, "learning_rate"),
        (use_adaptive_momentum, momentum_schedule, "momentum"),
        (use_adaptive_damping, damping_schedule, "damping"),
    ):
        if adaptive and schedule is not None:
            raise ValueError(
                f"use_adaptive_{name}=True and a {name}_schedule were both given; the "
                f"{name} is either adapted or scheduled. Drop one of them."
            )
    if use_adaptive_damping and initial_damping is None:
        raise ValueError(
            "use_adaptive_damping=True needs initial_damping (a good start is 1e-2 for a loss "
            "of order 1; see the damping advice in the Optimizer docs)."
        )
    if norm_constraint is not None and use_adaptive_learning_rate:
        raise ValueError(
            "norm_constraint cannot be used with use_adaptive_learning_rate=True: the adaptive "
            "learning rate already chooses the step length. Drop one of them."
        )
    if estimation_mode not in ESTIMATION_MODES:
        raise ValueError(
            f"Unknown estimation_mode {estimation_mode!r}; expected one of "
            f"{', '.join(ESTIMATION_MODES)}."
        )
    for name, value, minimum in (
        ("damping_adaptation_interval", damping_adaptation_interval, 1),
        ("inverse_update_period", inverse_update_period, 1),
        ("curvature_update_period", curvature_update_period, 1),
        ("num_burnin_steps", num_burnin_steps, 0),
    ):
        if not isinstance(value, int) or value < minimum:
            raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}.")
    if curvature_update_period > inverse_update_period:
        raise ValueError(
            f"curvature_update_period ({curvature_update_period}) is larger than "
            f"inverse_update_period ({inverse_update_period}): the same inverse would be "
            "recomputed. Make inverse_update_period at least curvature_update_period."
        )
    if not 0.0 < damping_adaptation_decay <= 1.0:
        raise ValueError(
            f"damping_adaptation_decay must be in (0, 1], got {damping_adaptation_decay}."
        )
    if damping_lower_threshold > damping_upper_threshold:
        raise ValueError(
            f"damping_lower_threshold ({damping_lower_threshold}) is above "
            f"damping_upper_threshold ({damping_upper_threshold})."
        )
    if not 0.0 <= curvature_ema <= 1.0:
        raise ValueError(f"curvature_ema must be in [0, 1], got {curvature_ema}.")
    if value_func is None:
        value_func = getattr(value_and_grad_func, "__wrapped__", None)
        value_func = inspect.unwrap(value_func) if value_func is not None else None
    if value_func is None:
        # Tracing through `value_and_grad_func` would show the tracer the backward pass too,
        # whose uses of the weights look like extra layers: ask for the loss instead.
        raise ValueError(
            "Cannot recover the loss function from value_and_grad_func: it has no "
            "`__wrapped__` attribute. Build it with eqx.filter_value_and_grad(loss) or "
            "jax.value_and_grad(loss) (or functools.wraps(loss)), or pass value_func=loss."
        )
    return value_func


def check_func_state(optimizer: Any, func_state: Any) -> None:
    """Raises if `func_state` is given without `value_func_has_state`, or missing with it."""
    if optimizer.value_func_has_state and func_state is None:
        raise ValueError(
            "value_func_has_state=True but func_state is None: pass the function state "
            "(e.g. the model's eqx.nn.State) as func_state=."
        )
    if not optimizer.value_func_has_state and func_state is not None:
        raise ValueError(
            "func_state was given but value_func_has_state=False; construct the optimizer "
            "with value_func_has_state=True or drop func_state."
        )

def check_batch(state: OptimizerState, batch: Any, where: str) -> None:
    """Raises unless `batch` has the signature of the batch given to `init`."""
    got = signature(batch)
    if got != state.batch_signature:
        raise ValueError(
            f"The {where} does not have the structure/shapes/dtypes of the batch given to "
            f"init: got ({describe_signature(got)}), expected "
            f"({describe_signature(state.batch_signature)}). K-FAC's state was built for the "
            "init batch's shapes; call init with a batch of the new shapes (or pad/drop the "
            "last incomplete batch)."
        )
