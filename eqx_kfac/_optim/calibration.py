"""The initial damping's calibration: before the first step, trials of the step on its batch,
each adapting the damping once, until it stops changing (kfac-jax's
`use_initial_damping_calibration`; `LevenbergMarquardtDamping(calibrate=True)`)."""

from typing import Any

import equinox as eqx
import jax

from .abstract_optimizer import AbstractOptimizer
from .compilation import compiled_step

_MAX_TRIALS = 100


def calibrated(
    optimizer: AbstractOptimizer, args: tuple[Any, ...], burnin_in_graph: bool, step_int: int | None
) -> tuple[Any, ...]:
    """The step's arguments with the damping calibrated, when this is the first step and the
    damping rule calibrates (at most 100 trials, each a compiled step that never donates).

    **Arguments:**

    - `optimizer`: the optimizer.
    - `args`: `(params, state, rng, batch, func_state, given)`.
    - `burnin_in_graph`: whether the step's program runs the burn-in.
    - `step_int`: the step counter, or `None` to read it from the state.

    **Returns:**

    The arguments, with the calibrated damping in the state.
    """
    params, state, *rest = args
    if not optimizer.damping_rule.calibrates():
        return args
    try:
        step_int = int(state.step_counter) if step_int is None else step_int
    except jax.errors.ConcretizationTypeError:
        raise ValueError(
            "The damping's calibration (LevenbergMarquardtDamping(calibrate=True), kfac-jax's "
            "use_initial_damping_calibration) runs Python trials before the first step: call the "
            "first step outside jit."
        ) from None
    if step_int != 0:
        return args
    for _ in range(_MAX_TRIALS):
        trial = compiled_step(optimizer, (params, state, *rest), burnin_in_graph, calibrating=True)[1]
        previous = float(state.damping)
        state = eqx.tree_at(lambda s: s.damping_state, state, trial.damping_state)
        if float(state.damping) == previous:
            break
    return (params, state, *rest)
