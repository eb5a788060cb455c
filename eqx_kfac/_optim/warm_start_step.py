"""The warm start's step (`warm_start.WarmStart`), and when a directly called step takes one."""

import itertools
from collections.abc import Iterator
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax

from .._core.control_flow import select_changed
from .._core.tree import all_finite
from .abstract_optimizer import AbstractOptimizer
from .arguments import check_batch, next_batch
from .compilation import compiling_burnin_meanwhile, compiling_step_meanwhile, jit_program, jitted_burnin
from .optimizer_state import OptimizerState
from .optimizer_step import applied
from .warm_start import WarmStartState


def warm_update(
    transformation: optax.GradientTransformation, params: Any, grads: Any, loss: Any,
    transformation_state: Any, skip_non_finite: bool = True,
) -> tuple[Any, Any, Any]:
    """One step of a warm start's `transformation`, skipped (parameters and its state kept) where
    `skip_non_finite` and the loss, gradient or update is not finite.

    **Arguments:**

    - `transformation`: the optax transformation.
    - `params`: the parameters (their inexact arrays are trained).
    - `grads`: the loss's gradient.
    - `loss`: the loss.
    - `transformation_state`: the transformation's state.
    - `skip_non_finite`: whether to skip a non-finite step.

    **Returns:**

    `(params, transformation_state, finite)`: the new parameters and state, and whether the step
    was taken.
    """
    grads = eqx.filter(grads, eqx.is_inexact_array)
    updates, new_state = transformation.update(grads, transformation_state, eqx.filter(params, eqx.is_inexact_array))
    if skip_non_finite:
        finite = jnp.isfinite(loss) & all_finite(grads) & all_finite(updates)
    else:
        finite = jnp.ones((), bool)
    return (
        select_changed(finite, applied(params, updates), params),
        select_changed(finite, new_state, transformation_state), finite,
    )


def _warm_step_body(
    optimizer: AbstractOptimizer, params: Any, state: OptimizerState, rng: Any, batch: Any, func_state: Any,
    burned_in: Any,
) -> tuple[Any, ...]:
    """One step of the warm start's transformation (skipped, but for its count, where the loss,
    gradient or update is not finite and the guard skips such steps)."""
    function, warm = optimizer.function, state.warm_start_state
    func_args = function.args(params, func_state, function.keys(rng, None)[1], function.process(batch))
    out, grads = function.value_and_grad(*func_args)
    loss, new_func_state, aux = function.split(out)
    new_params, transformation_state, finite = warm_update(
        optimizer.warm_start.transformation, params, grads, loss, warm.transformation_state,
        optimizer.guard.skip_non_finite,
    )
    batch_size = optimizer.estimators(func_args)[1].batch_size(func_args)
    new_warm = WarmStartState(transformation_state, warm.steps_taken + 1, warm.burnin_updates + burned_in)
    examples = select_changed(finite, state.examples_seen.add(batch_size), state.examples_seen)
    new_state = eqx.tree_at(lambda s: (s.warm_start_state, s.examples_seen), state, (new_warm, examples))
    stats = dict(
        loss=loss, step=state.step_counter, warm_start_step=new_warm.steps_taken,
        batch_size=jnp.asarray(batch_size), data_seen=new_state.data_seen, skipped=~finite,
        **({} if aux is None else {"aux": aux}),
    )
    if function.has_state:
        return new_params, new_state, select_changed(finite, new_func_state, func_state), stats
    return new_params, new_state, stats


def warm_counts(state: OptimizerState) -> tuple[int, int]:
    """`(steps taken, burn-in updates made)` of the warm start (read from the device).

    **Arguments:**

    - `state`: the optimizer state of an optimizer with a `WarmStart`.

    **Returns:**

    The two counts.
    """
    warm = state.warm_start_state
    return tuple(int(n) for n in jax.device_get((warm.steps_taken, warm.burnin_updates)))


def warm_step(
    optimizer: AbstractOptimizer, params: Any, state: OptimizerState, rng: Any, batches: Iterator[Any],
    func_state: Any, given: Any, counts: tuple[int, int], check_batches: bool,
) -> tuple[tuple[Any, ...] | None, Iterator[Any]]:
    """The warm start's step on the next batch of `batches`, or `None` when K-FAC's first step
    is due. Every call makes sure both K-FAC programs are compiling (in threads, once).

    **Arguments:**

    - `optimizer`: the optimizer (with a `warm_start`).
    - `params`, `state`, `rng`, `func_state`, `given`: `step`'s arguments.
    - `batches`: the batches (`itertools.repeat(batch)` for `batch=`).
    - `counts`: `warm_counts(state)`.
    - `check_batches`: check the batch drawn against `init`'s batch (an iterator's).

    **Returns:**

    `(outputs, batches)`: the step's outputs (as `Optimizer.step`'s) or `None`, and the batches
    for K-FAC's step (a batch drawn for a warm step that did not happen put back in front).
    """
    warm, (taken, burned) = optimizer.warm_start, counts
    if taken >= warm.steps:
        return None, batches
    batch = next_batch(batches, 0, 0)
    if check_batches:
        check_batch(state.batch_signature, batch, "batch from data_iterator")
    args = (params, state, rng, batch, func_state)
    if not warm.takes_the_call(taken, lambda: compiling_step_meanwhile(optimizer, (*args, given))):
        return None, itertools.chain([batch], batches)
    burnin = optimizer.refresh.num_burnin_steps
    # The burn-in's updates: on the last `burnin` warm batches (on the first call too, compiling
    # there, when there are no more warm steps than that), or as soon as their program is ready.
    if burned >= burnin:
        burn_in = False
    elif warm.switch_when_ready:
        burn_in = taken > 0 and compiling_burnin_meanwhile(optimizer, *args).done()
    else:
        burn_in = taken >= warm.steps - burnin
    if burn_in:
        state = jitted_burnin(optimizer, params, state, rng, batch, func_state, burned)
    program = jit_program(_warm_step_body, optimizer.compiler_options)
    out = program(optimizer, params, state, rng, batch, func_state, np.int32(burn_in))
    if taken == 0:
        compiling_step_meanwhile(optimizer, (*args, given))
        if burnin:
            compiling_burnin_meanwhile(optimizer, *args)
    return out, batches
