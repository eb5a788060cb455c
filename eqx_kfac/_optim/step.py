"""The body of one `Optimizer` step, pure, and the burn-in update; compiled by `optimizer_compiled.py`.

One step, in kfac-jax's order: damping; loss and gradient; curvature updates (with the burn-in at
step 0) and the cache refresh; direction; update; damping adaptation. Each function takes the
`Optimizer` (its parts and static configuration) as its first argument.
"""

from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
from jaxtyping import Array, PRNGKeyArray

from .._core import distributed as _distributed
from .._core.control_flow import select_changed
from .._core.tree import all_finite
from .._curvature.estimators import EstimatorState
from .._curvature.estimators.distributed import distributed_update_cache
from .context import StepContext
from .optimizer_config import OptimizerState


def update_curvature(
    optimizer: Any, params: Any, func_state: Any, batch: Any, estimator_state: EstimatorState,
    ema_old: Any, key: PRNGKeyArray,
) -> EstimatorState:
    """One curvature update on the processed `batch` with the step key `key`."""
    key, func_key = optimizer._keys(key)
    func_args = optimizer._func_args(params, func_state, func_key, batch)
    estimator, implicit = optimizer.estimators(func_args)
    return estimator.update_curvature_matrix_estimate(
        estimator_state, ema_old, 1.0, implicit.batch_size(func_args), key, func_args,
        axis_name=optimizer._axis,
    )


def burnin_update(
    optimizer: Any, params: Any, state: OptimizerState, key: PRNGKeyArray, batch: Any, func_state: Any
) -> OptimizerState:
    """One burn-in curvature update from a data iterator: summed statistics."""
    estimator_state = update_curvature(
        optimizer, params, func_state, optimizer._process(batch), state.estimator_state, 1.0, key
    )
    return eqx.tree_at(lambda s: s.estimator_state, state, estimator_state)


def _norms(optimizer: Any, params: Any, grads: Any, direction: Any, delta: Any) -> dict[str, Array]:
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


def _refresh_cache(optimizer: Any, context: StepContext, identity_weight: Array) -> Callable:
    """The cache refresh of the step (shared over devices with `distributed_inverses`)."""
    exact, approx = optimizer.direction.powers_to_cache()
    if optimizer.multi_device and optimizer.distributed_inverses:
        return lambda s: distributed_update_cache(
            context.estimator, s, identity_weight, exact, approx, optimizer._axis
        )
    return lambda s: context.estimator.update_cache(s, identity_weight, exact, approx)


def step_body(
    optimizer: Any,
    params: Any,
    state: OptimizerState,
    rng: PRNGKeyArray,
    batch: Any,
    func_state: Any,
    hyper: tuple[Any, Any, Any],
    burnin_in_graph: bool,
) -> tuple[Any, ...]:
    """One K-FAC step of `optimizer`, as `Optimizer.step` returns it (pure; jitted by the caller).

    **Arguments:**

    - `optimizer`: the `Optimizer`.
    - `params`, `state`, `rng`, `batch`, `func_state`: as for `Optimizer.step`.
    - `hyper`: the step's `(learning_rate, momentum, damping)`, `None` where not given.
    - `burnin_in_graph`: whether the burn-in runs inside the step (no `data_iterator`).

    **Returns:**

    `(params, state, stats)`, or `(params, state, func_state, stats)` when `value_func_has_state`.
    """
    processed = optimizer._process(batch)
    _, func_rng = optimizer._keys(rng)
    func_args = optimizer._func_args(params, func_state, func_rng, processed)
    estimator, implicit = optimizer.estimators(func_args)
    out, grads = optimizer.value_and_grad_func(*func_args)
    loss, new_func_state, aux = optimizer._split_outputs(_distributed.pmean(out, optimizer._axis))
    grads = _distributed.pmean(eqx.filter(grads, eqx.is_inexact_array), optimizer._axis)
    context = StepContext(
        state.step_counter, state.data_seen, func_args, loss, grads, estimator,
        state.estimator_state, implicit, optimizer.estimation_mode, optimizer.l2_reg, optimizer._axis,
        optimizer.value_func, optimizer._loss_of, hyper,
    )
    # Gates on the state, applied where each part is computed so that they fuse with it
    # (one select over the whole state at the end would copy it in every step).
    finite = jnp.isfinite(loss) & all_finite(grads) if optimizer.skip_non_finite else None

    damping = optimizer.damping_rule.value(state.damping, context)
    identity_weight = optimizer.l2_reg + damping
    estimator_state = optimizer.refresh.update_curvature(
        state.estimator_state, context.step, finite, rng, burnin_in_graph,
        lambda s, ema_old, key: update_curvature(optimizer, params, func_state, processed, s, ema_old, key),
    )
    # The refresh needs no select of its own (a copy of the whole cache): a failed inverse
    # keeps its previous value, and so does a block's failed solver factorisation.
    estimator_state = optimizer.refresh.refresh_inverses(
        estimator_state, context.step, finite, _refresh_cache(optimizer, context, identity_weight)
    )
    context = context._replace(estimator_state=estimator_state)

    learning_rate = optimizer.step_rule.fixed_learning_rate(context)
    direction, direction_stats = optimizer.direction(
        context, identity_weight, learning_rate, optimizer.refresh.use_cached
    )
    delta, velocity, learning_rate, momentum, quad_change = optimizer.step_rule(
        direction, state.velocities, damping, context
    )
    # A non-finite update (e.g. from a failed solve) is skipped like a non-finite gradient.
    applied = None if finite is None else finite & all_finite(delta)
    new_params = select_changed(applied, eqx.apply_updates(params, delta), params)
    new_damping, rho, new_loss, quad_change = optimizer.damping_rule.update(
        state.damping, damping, quad_change, delta, new_params, context
    )

    batch_size = _distributed.global_batch_size(implicit.batch_size(func_args), optimizer._axis)
    new_state = OptimizerState(
        velocities=velocity, estimator_state=estimator_state, damping=new_damping,
        data_seen=state.data_seen + batch_size, step_counter=state.step_counter + 1,
        batch_signature=state.batch_signature,
    )
    skipped = jnp.zeros((), bool)
    if applied is not None:
        # The estimator state is gated already (the statistics and the refresh by `finite`):
        # replacing it in `state` leaves nothing to select there.
        kept = eqx.tree_at(lambda s: s.estimator_state, state, estimator_state)
        new_state = select_changed(applied, new_state, kept)
        new_func_state = select_changed(finite, new_func_state, func_state)
        skipped = ~applied
    stats = dict(
        step=new_state.step_counter, batch_size=jnp.asarray(batch_size),
        data_seen=new_state.data_seen, loss=loss, new_loss=new_loss,
        learning_rate=learning_rate, momentum=momentum, damping=damping, rho=rho,
        quad_model_change=quad_change, skipped=skipped, **direction_stats,
        **({} if aux is None else {"aux": aux}),
        **_norms(optimizer, new_params, grads, direction, delta),
    )
    if optimizer.value_func_has_state:
        return new_params, new_state, new_func_state, stats
    return new_params, new_state, stats
