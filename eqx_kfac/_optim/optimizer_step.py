"""The body of one `Optimizer` step, pure, and the burn-in update; compiled by `compilation.py`.

One step, in kfac-jax's order: loss and gradient; damping; curvature updates (with the burn-in at
step 0) and the cache refresh; direction; proposed update; the guard's decision (skip a step that
is not finite, reject one that raises the loss); damping adaptation. What each outcome keeps:

- loss or gradient not finite, or a class label of the batch outside `[0, classes)` on an
  example its categorical loss does not mask out: nothing changes but the guard's count of faults;
- update not finite, or rejected: parameters, the direction's state and the step rule's state
  (velocity) are kept; the curvature statistics take the batch, the damping reacts, the counters
  advance;
- applied: everything moves on.
"""

from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
from jaxtyping import Array, Int, PRNGKeyArray, PyTree

from .._core import distributed as _distributed
from .._core.control_flow import select_changed
from .._core.tree import all_finite
from .damping import StepOutcome
from .abstract_optimizer import AbstractOptimizer
from .optimizer_state import OptimizerState
from .refresh import burnin_keys
from .step_context import GivenValues, StepContext


def _curvature_args(optimizer: AbstractOptimizer, params: Any, func_state: Any, batch: Any):
    """The value function's arguments for a curvature update with key `k` (its randomness, if
    any, drawn from `k`)."""

    def args_of(key: PRNGKeyArray) -> tuple[Any, ...]:
        return optimizer.function.keyed_args(params, func_state, key, batch, None)[1]

    return args_of


def burnin_update(
    optimizer: AbstractOptimizer, params: Any, state: OptimizerState, rng: PRNGKeyArray, batch: Any,
    func_state: Any, index: Int[Array, ""],
) -> OptimizerState:
    """The burn-in's curvature update number `index`, on `batch` (summed statistics), run before
    the step of `rng` (whose burn-in keys it draws, as the step's own burn-in would)."""
    key = burnin_keys(rng, optimizer.refresh.num_burnin_steps)[index]
    func_args = _curvature_args(optimizer, params, func_state, optimizer.function.process(batch))(key)
    estimator, implicit = optimizer.estimators(func_args)
    estimator_state = estimator.update_curvature_matrix_estimate(
        state.estimator_state, 1.0, 1.0, implicit.batch_size(func_args), key, func_args,
        axis_name=optimizer.axis_name,
    )
    return eqx.tree_at(lambda s: s.estimator_state, state, estimator_state)


def _norms(
    optimizer: AbstractOptimizer, params: Any, grads: Any, direction: Any, delta: Any
) -> dict[str, Array]:
    """The norms asked for by `include_norms_in_stats` (whole vectors) and
    `include_per_param_norms_in_stats` (per leaf, named `name(path)`)."""
    trees = dict(
        param_norm=eqx.filter(params, eqx.is_inexact_array), grad_norm=grads,
        precon_grad_norm=direction, update_norm=delta,
    )
    norms = {}
    if optimizer.include_norms_in_stats:
        norms.update({name: optax.tree.norm(tree) for name, tree in trees.items()})
    if optimizer.include_per_param_norms_in_stats:
        norms.update({
            f"{name}({jax.tree_util.keystr(path).lstrip('.')})": jnp.linalg.norm(leaf.reshape(-1))
            for name, tree in trees.items()
            for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]
        })
    return norms


def _evaluate(
    optimizer: AbstractOptimizer, params: Any, state: OptimizerState, rng: PRNGKeyArray, batch: Any,
    func_state: Any, given: GivenValues, calibrating: bool,
) -> tuple[StepContext, PRNGKeyArray, Any, Any]:
    """The loss and gradient, as a `StepContext`; the curvature's key, new function state, aux."""
    function, axis = optimizer.function, optimizer.axis_name
    key, func_args = function.keyed_args(params, func_state, rng, function.process(batch), axis)
    estimator, implicit = optimizer.estimators(func_args)
    out, grads = function.value_and_grad(*func_args)
    loss, new_func_state, aux = function.split(_distributed.pmean(out, axis))
    context = StepContext(
        state.step_counter, state.data_seen, func_args, loss,
        _distributed.pmean(eqx.filter(grads, eqx.is_inexact_array), axis), estimator,
        state.estimator_state, implicit, optimizer.preconditioner.curvature.estimation_mode,
        optimizer.l2_reg, axis, function.value, function.loss_of, given, calibrating,
    )
    return context, key, new_func_state, aux


def _refreshed_curvature(
    optimizer: AbstractOptimizer, context: StepContext, key: PRNGKeyArray, finite: Any,
    identity_weight: Array, burnin_in_graph: bool, params: Any, func_state: Any, batch: Any,
) -> Any:
    """The estimator state after this step's curvature updates and cache refresh (none of them
    where `finite` is false: a loss or gradient that is not finite, or an invalid label)."""
    preconditioner, estimator = optimizer.preconditioner, context.estimator
    estimator_state = preconditioner.update_curvature(
        estimator, context.estimator_state, context.step, finite, key,
        _curvature_args(optimizer, params, func_state, optimizer.function.process(batch)),
        context.implicit.batch_size(context.func_args), burnin_in_graph, optimizer.axis_name,
    )
    # The refresh needs no select of its own (a copy of the whole cache): a failed inverse keeps
    # its previous value, and so does a block's failed solver factorisation.
    return preconditioner.refresh_inverses(
        estimator, estimator_state, context.step, finite, identity_weight, optimizer.axis_name,
        optimizer.multi_device and optimizer.distributed_inverses,
    )


def applied(params: PyTree, delta: PyTree) -> PyTree:
    """`params + delta`, each parameter keeping its dtype (bf16 parameters, float32 updates)."""
    delta = jax.tree.map(lambda d, p: d.astype(p.dtype), delta, eqx.filter(params, eqx.is_inexact_array))
    return eqx.apply_updates(params, delta)


def _next_state(
    state: OptimizerState, direction_state: Any, step_rule_state: Any, damping_state: Any,
    estimator_state: Any, batch_size: Any, finite: Any, decision: Any, guard_state: Any,
) -> OptimizerState:
    """The state after a step: moved on where the step was finite (the direction's and the step
    rule's states only where its update was applied), else kept but for the (already gated)
    estimator state; the guard's state in any case."""
    moved = OptimizerState(
        direction_state=select_changed(decision.applied, direction_state, state.direction_state),
        step_rule_state=select_changed(decision.applied, step_rule_state, state.step_rule_state),
        damping_state=damping_state, guard_state=state.guard_state,
        estimator_state=estimator_state, examples_seen=state.examples_seen.add(batch_size),
        step_counter=state.step_counter + 1, warm_start_state=state.warm_start_state,
        batch_signature=state.batch_signature,
        params_signature=state.params_signature,
    )
    kept = eqx.tree_at(lambda s: s.estimator_state, state, estimator_state)
    new_state = select_changed(finite, moved, kept)
    return eqx.tree_at(lambda s: s.guard_state, new_state, guard_state)


def step_body(
    optimizer: AbstractOptimizer, params: Any, state: OptimizerState, rng: PRNGKeyArray, batch: Any,
    func_state: Any, given: GivenValues, burnin_in_graph: bool, calibrating: bool = False,
) -> tuple[Any, ...]:
    """One K-FAC step of `optimizer`, as `Optimizer.step` returns it (pure; jitted by the caller).

    **Arguments:**

    - `optimizer`: the `Optimizer`.
    - `params`, `state`, `rng`, `batch`, `func_state`: as for `Optimizer.step`.
    - `given`: the `GivenValues` passed to `step`.
    - `burnin_in_graph`: whether the burn-in runs inside the step (`batch=` inside a user's trace).
    - `calibrating`: the step is a trial of the initial damping's calibration.

    **Returns:**

    `(params, state, stats)`, or `(params, state, func_state, stats)` when `value_func_has_state`.
    """
    with jax.named_scope("eqx_kfac.loss_and_gradient"):
        context, key, new_func_state, aux = _evaluate(
            optimizer, params, state, rng, batch, func_state, given, calibrating
        )
    guard = optimizer.guard
    valid = optimizer.preconditioner.targets_in_range(
        context.estimator, context.func_args, optimizer.axis_name
    )
    finite = (
        jnp.isfinite(context.loss) & all_finite(context.grads) & valid if guard.skip_non_finite else None
    )
    damping = optimizer.damping_rule.value(state.damping_state, context)
    identity_weight = optimizer.l2_reg + damping
    estimator_state = _refreshed_curvature(
        optimizer, context, key, finite, identity_weight, burnin_in_graph, params, func_state, batch
    )
    context = eqx.tree_at(lambda c: c.estimator_state, context, estimator_state)
    direction = optimizer.preconditioner.precondition(
        context.estimator, estimator_state, context.grads, state.direction_state, identity_weight,
        optimizer.step_rule.fixed_learning_rate(context), optimizer.axis_name,
    )
    with jax.named_scope("eqx_kfac.step_rule"):
        proposal = optimizer.step_rule(direction.direction, state.step_rule_state, damping, context)
    candidate = applied(params, proposal.delta)
    with jax.named_scope("eqx_kfac.guard"):
        new_loss = context.loss_at(candidate) if guard.reject_loss_increase else None
        decision = guard.decide(context.loss, context.grads, proposal.delta, new_loss, params, valid)
    outcome = StepOutcome(
        proposal.delta, candidate, proposal.coefficients.quad_change, new_loss, decision.applied,
        ~decision.applied,
    )
    with jax.named_scope("eqx_kfac.damping"):
        damping_state, report = optimizer.damping_rule.update(
            state.damping_state, damping, outcome, context
        )
    batch_size = _distributed.global_batch_size(
        context.implicit.batch_size(context.func_args), optimizer.axis_name
    )
    new_state = _next_state(
        state, direction.state, proposal.state, damping_state, estimator_state, batch_size, finite, decision,
        guard.update(state.guard_state, decision),
    )
    new_params = select_changed(decision.applied, candidate, params)
    stats = dict(
        step=new_state.step_counter, batch_size=jnp.asarray(batch_size), data_seen=new_state.data_seen,
        loss=context.loss, new_loss=report.new_loss, learning_rate=proposal.coefficients.learning_rate,
        momentum=proposal.coefficients.momentum, damping=damping, rho=report.rho,
        quad_model_change=report.quad_change, skipped=decision.skipped, rejected=decision.rejected,
        stalled=decision.stalled, invalid_targets=~valid,
        curvature_update_dropped=estimator_state.dropped_updates > state.estimator_state.dropped_updates,
        **direction.stats, **({} if aux is None else {"aux": aux}),
        **_norms(optimizer, new_params, context.grads, direction.direction, proposal.delta),
    )
    if optimizer.function.has_state:
        return new_params, new_state, select_changed(finite, new_func_state, func_state), stats
    return new_params, new_state, stats
