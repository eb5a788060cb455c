"""`kfac_preconditioner`: K-FAC as an optax gradient transformation.

The transformation keeps the curvature estimate (moving averages and cached inverses) in its optax
state and maps gradients to `(C + (l2_reg + damping) I)⁻¹ g`. Everything else (learning rate,
momentum, clipping, weight decay, schedules, gradient accumulation) is left to ordinary optax
transformations around it.
"""

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
from jax.typing import ArrayLike
from jaxtyping import Array, Int, PRNGKeyArray, PyTree

from .._curvature.blocks import CurvatureBlock
from .._curvature.blocks._solver_cache import check_solver_choice, SolverChoice
from .._core.cache import LRUCache
from .._core.control_flow import periodic
from .._core.tree import abstract_arrays, signature
from .._curvature.estimators import BlockDiagonalCurvature, EstimatorState
from .._curvature.estimators.base import batch_size_of
from .._curvature.estimators.modes import ESTIMATION_MODES
from .._curvature.estimators.fallbacks import check_on_unmatched
from .._curvature.estimators.loss_checks import check_batch_size, check_loss_is_averaged
from .._tracing.layer_data import LayerSpec
from .quad_model import norm_constraint_scale


logger = logging.getLogger("eqx_kfac")


class KFACPreconditionerState(eqx.Module):
    """The optax state of `kfac_preconditioner` (final).

    All leaves are arrays whose shapes and dtypes never change, so the state works with
    `optax.MultiSteps`, `optax.apply_if_finite`, `jax.lax.cond` and `eqx.tree_serialise_leaves`.

    **Fields:**

    - `count`: the number of updates so far (`int32`).
    - `estimator_state`: the curvature estimator's state (moving averages and cached inverses).
    """

    count: Int[Array, ""]
    estimator_state: EstimatorState


_ESTIMATORS = LRUCache(maxsize=32)


def _estimator(
    loss_fn: Callable[..., Any],
    example_args: tuple[Any, ...],
    estimation_mode: str,
    layer_tag_to_block_ctor: Mapping[str, Callable[[LayerSpec], CurvatureBlock]] | None,
    inverse_solver: SolverChoice | None,
    on_unmatched: str,
    batch_size_extractor: Callable[[Any], Any] | None,
) -> BlockDiagonalCurvature:
    """The estimator for these arguments, built (tracing `loss_fn`) once per signature.

    `optax.inject_hyperparams` rebuilds the transformation at every update, so without the cache
    every update would trace the loss again. When it is built, the loss is checked against its
    registrations (see `loss_checks`) on the example arguments.
    """
    abstract = abstract_arrays(example_args)
    ctors = tuple(sorted((layer_tag_to_block_ctor or {}).items()))

    def build() -> BlockDiagonalCurvature:
        estimator = BlockDiagonalCurvature(
            loss_fn,
            abstract,
            default_estimation_mode=estimation_mode,
            layer_tag_to_block_ctor=dict(ctors) or None,
            inverse_solver=inverse_solver,
            on_unmatched=on_unmatched,
        )
        logger.info(
            "eqx_kfac.kfac_preconditioner: curvature blocks (%d blocks, %d parameters):\n%s",
            estimator.num_blocks, estimator.dim, estimator.registrations(),
        )
        batch_size = batch_size_of(estimator.func, example_args, 0, batch_size_extractor)
        if batch_size_extractor is not None:
            check_batch_size(estimator.func, example_args, batch_size)
        check_loss_is_averaged(loss_fn, _loss_of, example_args, batch_size)
        return estimator

    key = (
        loss_fn, signature(abstract), estimation_mode, ctors, inverse_solver, on_unmatched,
        batch_size_extractor,
    )
    return _ESTIMATORS.get(key, build)


def _loss_of(out: Any) -> Any:
    return out[0] if isinstance(out, tuple) else out


def _check_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(
            f"kfac_preconditioner: {name} must be a Python integer >= 1, got {value!r}. Under "
            f"`optax.inject_hyperparams`, list it in `static_args`."
        )
    return value


def kfac_preconditioner(
    loss_fn: Callable[..., Any],
    example_args: Sequence[Any],
    *,
    damping: float | ArrayLike | optax.Schedule,
    l2_reg: float | ArrayLike = 0.0,
    curvature_ema: float | ArrayLike = 0.95,
    curvature_update_period: int = 1,
    inverse_update_period: int = 5,
    estimation_mode: str = "fisher_gradients",
    use_exact_inverses: bool = False,
    layer_tag_to_block_ctor: Mapping[str, Callable[[LayerSpec], CurvatureBlock]] | None = None,
    batch_size_extractor: Callable[[Any], Any] | None = None,
    inverse_solver: SolverChoice | None = None,
    on_unmatched: str = "warn",
    norm_constraint: float | ArrayLike | None = None,
) -> optax.GradientTransformationExtraArgs:
    """K-FAC preconditioning as an optax transformation: `g ↦ (C + (l2_reg + damping) I)⁻¹ g`.

    `C` is the block-diagonal curvature estimate of `BlockDiagonalCurvature` (K-FAC blocks for
    dense and conv layers by default), kept in the optax state. `update` folds the batch into
    the estimate every `curvature_update_period` steps, refreshes the cached inverses (damped by
    `l2_reg + damping`) every `inverse_update_period` steps, and returns the preconditioned
    gradient. It returns a *descent direction*, not an update: follow it with a learning rate.

    **Matching `Optimizer`.** kfac-jax's update is `δ_k = m·δ_{k-1} − lr_k·P g_k`. Since
    `optax.trace(m)` computes `t_k = m·t_{k-1} + u_k`,

    - `optax.chain(kfac_preconditioner(...), optax.trace(m), optax.scale(-lr))` gives
      `−lr·t_k = m·(−lr·t_{k-1}) − lr·P g_k`: the same steps as `Optimizer` with fixed
      `learning_rate=lr, momentum=m, damping=d` (and `num_burnin_steps=0`), for a fixed `lr`;
    - `optax.chain(kfac_preconditioner(...), optax.scale_by_schedule(lambda k: -lr(k)),
      optax.trace(m))` puts the learning rate before the momentum, as kfac-jax does, and matches
      `Optimizer` with `learning_rate_schedule=lr` too. (With trace first, a changing learning
      rate would also rescale the accumulated velocity.)

    Pass the same PRNG key to `update` as to `Optimizer.step` for the same curvature samples.

    **Usage.**

    ```python
    precondition = eqx_kfac.kfac_preconditioner(loss, (model, batch), damping=1e-3)
    optimizer = optax.chain(precondition, optax.trace(0.9), optax.scale(-0.1))
    params = eqx.filter(model, eqx.is_inexact_array)
    opt_state = optimizer.init(params)
    grads = eqx.filter_grad(loss)(model, batch)
    updates, opt_state = optimizer.update(grads, opt_state, params, batch=batch, key=key)
    model = eqx.apply_updates(model, updates)
    ```

    Under `optax.inject_hyperparams`, name the non-numeric arguments static:
    `optax.inject_hyperparams(eqx_kfac.kfac_preconditioner, static_args=("loss_fn",
    "curvature_update_period", "inverse_update_period", "batch_size_extractor"))`; `damping`,
    `l2_reg` and `curvature_ema` then become injectable hyperparameters.

    **Arguments:**

    - `loss_fn`: `loss_fn(model, batch)`, or `loss_fn(model, *loss_args)` for other forms (e.g.
      `loss_fn(model, func_state, key, batch)` with an `eqx.nn.State` and a dropout key), the
      training loss or `(loss, anything)`; it must register its losses (e.g.
      `register_softmax_cross_entropy_loss`).
    - `example_args`: `(model, batch)` (or `(model, *loss_args)`) with the shapes of every later
      call. They fix the
      structure and the non-array parts of the model: `init`/`update` take only its inexact
      arrays (`eqx.filter(model, eqx.is_inexact_array)`; the full model is accepted too).
    - `damping`: the damping `d`: a number, or an optax schedule of the update count.
    - `l2_reg`: the L2 coefficient of the loss, added to the damping (the preconditioner does
      not add an L2 term to the gradient).
    - `curvature_ema`: decay of the curvature moving averages.
    - `curvature_update_period`: update the curvature on every `k`-th step (starting with the
      first).
    - `inverse_update_period`: refresh the cached inverses every `k`-th step; `1` uses no cache
      (the inverse of the current estimate at every step).
    - `estimation_mode`: one of `fisher_gradients`, `fisher_empirical`, `fisher_exact`,
      `fisher_curvature_prop`, `ggn_exact`, `ggn_curvature_prop`.
    - `use_exact_inverses`: invert Kronecker blocks exactly instead of with pi-adjusted damping.
    - `layer_tag_to_block_ctor`: block class per tag name, overriding the defaults.
    - `batch_size_extractor`: the batch size of `batch`; `None` (default): the leading dimension
      of the registered losses' inputs.
    - `inverse_solver`: the lineax solver of the blocks' inverses, as for
      `BlockDiagonalCurvature`: one solver (for every `Full` and Kronecker block), one per block
      (or `None`), or a function from a block to its solver (or `None`); e.g. `lineax.Cholesky()`
      or `lineax.CG(rtol, atol)`. It replaces the choice of `use_exact_inverses` for those
      blocks. With caching, the solver state is refreshed every `inverse_update_period` steps
      with the damping of that step. A failed solve (e.g. CG out of steps) gives NaNs: wrap the
      chain in `optax.apply_if_finite` to skip such steps. (Under `optax.inject_hyperparams`, a
      function given here must be listed in `static_args` too.)
    - `norm_constraint`: `c`, or `None` (default): scale the preconditioned gradient `u = P g`
      by `min(1, sqrt(c / uᵀg))`, so that `uᵀg` (the step's squared length in the curvature's
      metric, and its first-order predicted decrease for a unit learning rate) is at most `c`.
      `Optimizer(norm_constraint=c_opt)` at learning rate `lr` takes the same steps with
      `c = c_opt / lr²`.
    - `on_unmatched`: what to do when a parameter falls back to a generic (diagonal) block
      because no layer accounts for it: `"warn"` (a `UserWarning` naming the parameters),
      `"error"` or `"ignore"`; see `BlockDiagonalCurvature`.

    The registration table (which block each parameter gets) is logged at INFO level on the
    `"eqx_kfac"` logger. When `example_args` are arrays, the loss is evaluated on them once: a
    loss summed over the batch instead of averaged raises `ValueError`.

    **Returns:**

    An `optax.GradientTransformationExtraArgs` whose `update(grads, state, params, *, batch,
    key)` needs the current `params` (or model), this step's `batch` (or, for a `loss_fn` with
    more arguments, `loss_args=` all the arguments after the model) and a PRNG `key` for the
    sampled estimation modes (ignored by the exact ones). Its state is a
    `KFACPreconditionerState`.
    """
    example_args = tuple(example_args)
    if len(example_args) < 2:
        raise ValueError(
            "kfac_preconditioner: example_args must be `(model, batch)` (or `(model, *loss_args)`), "
            f"the arguments of loss_fn; got {len(example_args)} argument(s)."
        )
    num_loss_args = len(example_args) - 1
    if estimation_mode not in ESTIMATION_MODES:
        raise ValueError(
            f"kfac_preconditioner: unknown estimation_mode {estimation_mode!r}; expected one of "
            f"{', '.join(ESTIMATION_MODES)}."
        )
    curvature_update_period = _check_int("curvature_update_period", curvature_update_period)
    inverse_update_period = _check_int("inverse_update_period", inverse_update_period)
    inverse_solver = check_solver_choice(inverse_solver, "kfac_preconditioner")
    check_on_unmatched(on_unmatched, "kfac_preconditioner")
    estimator = _estimator(
        loss_fn, example_args, estimation_mode, layer_tag_to_block_ctor, inverse_solver,
        on_unmatched, batch_size_extractor,
    )
    static_model = eqx.filter(example_args[0], eqx.is_inexact_array, inverse=True)
    use_cached = inverse_update_period != 1
    if not use_cached:
        exact, approx = None, None
    else:
        exact, approx = (-1, None) if use_exact_inverses else (None, -1)

    def model_from(params: PyTree) -> PyTree:
        if params is None:
            raise ValueError(
                "kfac_preconditioner: update needs the current parameters: call "
                "`update(grads, state, params, batch=..., key=...)`."
            )
        return eqx.combine(eqx.filter(params, eqx.is_inexact_array), static_model)

    def init_fn(params: PyTree) -> KFACPreconditionerState:
        del params
        return KFACPreconditionerState(
            count=jnp.zeros((), jnp.int32),
            estimator_state=estimator.init(None, exact, approx),
        )

    def update_fn(
        updates: PyTree,
        state: KFACPreconditionerState,
        params: PyTree = None,
        *,
        batch: PyTree = None,
        key: PRNGKeyArray | None = None,
        loss_args: tuple[Any, ...] | None = None,
        **extra_args: Any,
    ) -> tuple[PyTree, KFACPreconditionerState]:
        # Other transformations of a chain may take extra arguments of their own.
        del extra_args
        if loss_args is None and num_loss_args == 1 and batch is not None:
            loss_args = (batch,)
        if loss_args is None or batch is not None and num_loss_args > 1:
            call = "batch=..." if num_loss_args == 1 else f"loss_args=(...{num_loss_args} arguments...)"
            raise ValueError(
                "kfac_preconditioner: update needs this step's arguments of loss_fn after the "
                f"model: call `update(grads, state, params, {call}, key=...)`."
            )
        loss_args = tuple(loss_args)
        if len(loss_args) != num_loss_args:
            raise ValueError(
                f"kfac_preconditioner: loss_args has {len(loss_args)} entries, but loss_fn takes "
                f"{num_loss_args} arguments after the model (as in example_args)."
            )
        if key is None:
            if not estimation_mode.endswith("_exact"):
                raise ValueError(
                    f"kfac_preconditioner: estimation_mode={estimation_mode!r} samples, so update "
                    "needs a PRNG key: call `update(grads, state, params, batch=..., key=...)`."
                )
            key = jax.random.key(0)
        count = state.count
        current_damping = damping(count) if callable(damping) else damping
        identity_weight = l2_reg + jnp.asarray(current_damping)
        func_args = (model_from(params), *loss_args)
        batch_size = batch_size_of(estimator.func, func_args, 0, batch_size_extractor)

        def update_curvature(estimator_state: EstimatorState) -> EstimatorState:
            return estimator.update_curvature_matrix_estimate(
                estimator_state, curvature_ema, 1.0, batch_size, key, func_args
            )

        estimator_state = periodic(
            curvature_update_period, count, update_curvature, state.estimator_state
        )
        if use_cached:
            estimator_state = periodic(
                inverse_update_period,
                count,
                lambda s: estimator.update_cache(s, identity_weight, exact, approx),
                estimator_state,
            )
        grads = eqx.filter(updates, eqx.is_inexact_array)
        preconditioned = estimator.multiply_matpower(
            estimator_state, grads, identity_weight, -1, use_exact_inverses, use_cached
        )
        if norm_constraint is not None:
            scale, _ = norm_constraint_scale(optax.tree.vdot(preconditioned, grads), 1.0, norm_constraint)
            preconditioned = jax.tree.map(lambda p: p * scale, preconditioned)
        preconditioned = jax.tree.map(lambda p, g: p.astype(g.dtype), preconditioned, grads)
        new_state = KFACPreconditionerState(
            count=optax.safe_increment(count), estimator_state=estimator_state
        )
        return preconditioned, new_state

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def kfac_optax(
    loss_fn: Callable[..., Any],
    example_args: Sequence[Any],
    learning_rate: float | optax.Schedule = 0.1,
    *,
    damping: float | ArrayLike | optax.Schedule = 1e-2,
    norm_constraint: float | ArrayLike | None = 0.1,
    momentum: float | None = 0.9,
    **preconditioner_kwargs: Any,
) -> optax.GradientTransformationExtraArgs:
    """K-FAC as a ready optax optimizer: the recipe that trains every model of the zoo as it is.

    `optax.chain(kfac_preconditioner(loss_fn, example_args, damping=damping,
    norm_constraint=norm_constraint, ...), optax.trace(momentum), optax.scale_by_learning_rate(
    learning_rate))`. The defaults (learning rate 0.1, damping 0.01, norm constraint 0.1,
    momentum 0.9) trained all the models of the "Model gallery" page (CNN, ResNet with BatchNorm,
    transformer, GRU, LSTM, scan over layers, ...) without tuning; without the norm constraint the
    same recipe diverges on most of them. Use it like any optax optimizer, passing this step's
    batch to `update` (see `kfac_preconditioner` for the other forms of `loss_fn`):

    ```python
    optimizer = eqx_kfac.kfac_optax(loss, (model, batch))
    opt_state = optimizer.init(eqx.filter(model, eqx.is_inexact_array))
    grads = eqx.filter_grad(loss)(model, batch)
    params = eqx.filter(model, eqx.is_inexact_array)
    updates, opt_state = optimizer.update(grads, opt_state, params, batch=batch, key=key)
    model = eqx.apply_updates(model, updates)
    ```

    **Arguments:**

    - `loss_fn`, `example_args`: as for `kfac_preconditioner`.
    - `learning_rate`: a number or an optax schedule.
    - `damping`, `norm_constraint`: passed to `kfac_preconditioner` (see there).
    - `momentum`: the decay of `optax.trace`, or `None` for none.
    - `**preconditioner_kwargs`: the other keywords of `kfac_preconditioner` (e.g.
      `inverse_update_period`, `estimation_mode`, `l2_reg`).

    **Returns:**

    An `optax.GradientTransformationExtraArgs`.
    """
    return optax.chain(
        kfac_preconditioner(
            loss_fn, example_args, damping=damping, norm_constraint=norm_constraint,
            **preconditioner_kwargs,
        ),
        *([] if momentum is None else [optax.trace(momentum)]),
        optax.scale_by_learning_rate(learning_rate),
    )
