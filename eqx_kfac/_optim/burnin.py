"""The burn-in of a directly called first step: its curvature updates run in Python before the
step, each a compiled program, while the step compiles in a thread of its own.

Inside the step's program the burn-in would be a loop, and XLA:CPU gives the convolutions in a
loop its slow generic code (a U-Net's first step ran 45 s with the loop inside; docs/examples.md).
Inside a user's `jit` with `batch=` the step's program runs the loop instead (the same result).
"""

from collections.abc import Iterator
from typing import Any

import equinox as eqx
import jax

from .._core.control_flow import select_changed
from .abstract_optimizer import AbstractOptimizer
from .arguments import check_batch, next_batch
from .compilation import compiling_step_meanwhile, jitted_burnin
from .optimizer_state import OptimizerState


class BurnedIn(eqx.Module):
    """The burn-in's outcome (final).

    **Fields:**

    - `state`: the state after the burn-in's updates (the given one when there were none).
    - `batch`: the step's own batch, the next one after the burn-in's.
    """

    state: OptimizerState
    batch: Any


def run_burnin(
    optimizer: AbstractOptimizer,
    params: Any,
    state: OptimizerState,
    rng: Any,
    batches: Iterator[Any],
    func_state: Any,
    given: Any,
    step_int: int | None,
    check_batches: bool,
    done: int = 0,
) -> BurnedIn:
    """At step 0, the burn-in's updates on the next batches of `batches` (the step compiling
    meanwhile), those a warm start made (`done`) left out; at every step, the step's own batch
    drawn after them.

    **Arguments:**

    - `optimizer`: the optimizer.
    - `params`, `state`, `rng`, `func_state`, `given`: the step's arguments.
    - `batches`: the batches (`itertools.repeat(batch)` for `batch=`).
    - `step_int`: the step counter (read from the device by the caller when it matters).
    - `check_batches`: check each batch drawn against `init`'s batch (an iterator's).
    - `done`: the burn-in's updates already made (by a warm start, on its own batches).

    **Returns:**

    A `BurnedIn`.
    """
    burnin = optimizer.refresh.num_burnin_steps if step_int == 0 else 0
    compiling = None
    for i in range(done, burnin):
        batch = next_batch(batches, i - done, burnin - done)
        if check_batches:
            check_batch(state.batch_signature, batch, f"burn-in batch #{i - done}")
        if compiling is None and not isinstance(state.step_counter, jax.core.Tracer):
            # The step's structure is known (its batch that of every burn-in batch): compile it
            # while the burn-in compiles and runs (the step waits for it).
            compiling = compiling_step_meanwhile(optimizer, (params, state, rng, batch, func_state, given))
        state = jitted_burnin(optimizer, params, state, rng, batch, func_state, i)
    batch = next_batch(batches, max(burnin - done, 0), max(burnin - done, 0))
    if check_batches:
        check_batch(state.batch_signature, batch, "batch from data_iterator")
    return BurnedIn(state, batch)


def undone_if_not_processed(
    original: OptimizerState, burned: OptimizerState, out: tuple[Any, ...], step_int: int | None
) -> tuple[Any, ...]:
    """The step's outputs, with the state before the burn-in (but for the guard's counts) when
    the step did not process its batch (a loss or gradient that is not finite: its counter
    stays), as if the step had not been called.

    **Arguments:**

    - `original`: the state given to `step`.
    - `burned`: the state after the burn-in.
    - `out`: the step's outputs.
    - `step_int`: the step counter before the step.

    **Returns:**

    The outputs.
    """
    if burned is original:
        return out
    new_state = out[1]
    kept = eqx.tree_at(lambda s: s.guard_state, original, new_state.guard_state)
    if isinstance(new_state.step_counter, jax.core.Tracer):  # a data iterator in a user's jit
        unprocessed = new_state.step_counter == original.step_counter
        return (out[0], select_changed(unprocessed, kept, new_state), *out[2:])
    return out if int(new_state.step_counter) != step_int else (out[0], kept, *out[2:])
