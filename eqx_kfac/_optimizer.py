"""`Optimizer`: the K-FAC optimizer with kfac-jax's semantics, as a pure, Equinox-native step.

One step (kfac-jax's order of operations):

1. learning rate, momentum and damping from the step arguments, the schedules or the state;
2. at step 0, `num_burnin_steps` curvature updates (from the data iterator or the step's batch);
3. the curvature estimate is updated with the batch (every `curvature_update_period` steps);
4. loss and gradients from `value_and_grad_func`;
5. every `inverse_update_period` steps the cached damped inverses are refreshed;
6. the gradient is preconditioned with `(C + (l2_reg + damping) I)⁻¹` and, with
   `norm_constraint`, scaled down;
7. the coefficients of the preconditioned gradient and the previous update: fixed/scheduled, or
   minimising the exact quadratic model;
8. the update is applied and becomes the new velocity;
9. every `damping_adaptation_interval` steps (adaptive damping) the damping follows `ρ`.

Every decision that depends on the step counter is taken inside the compiled graph (`lax.cond`),
so `step` gives the same result called directly or inside a user's `jit`.
"""

import logging
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.typing import ArrayLike
from jaxtyping import Array, Float, PRNGKeyArray, PyTree

from . import _distributed
from ._blocks._solver_cache import check_solver_choice
from ._control_flow import periodic, select_changed
from ._estimators import BlockDiagonalCurvature, EstimatorState, ImplicitExactCurvature
from ._estimators.fallbacks import check_on_unmatched
from ._estimators.loss_checks import check_batch_size, check_loss_is_averaged
from ._optimizer_compiled import burnin_keys, compiled_step, jitted_burnin
from ._optimizer_config import (
    EstimatorCache,
    OptimizerState as OptimizerState,
    Schedule,
    abstract,
    call_schedule,
    check_batch,
    check_constructor_arguments,
    check_func_state,
    check_hyperparameters,
    signature,
)
from ._quad_model import (
    QuadraticModel,
    all_finite,
    gram_matrix,
    inner_product,
    levenberg_marquardt_damping,
    norm_constraint_scale,
    quadratic_model,
    solve_quadratic_model,
)


logger = logging.getLogger("eqx_kfac")

def _norm(tree: PyTree[Array]) -> Float[Array, ""]:
    return jnp.sqrt(inner_product(tree, tree))


def _per_param_norms(tree: PyTree[Array], prefix: str) -> dict[str, Array]:
    with_paths = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {
        f"{prefix}({jax.tree_util.keystr(path).lstrip('.')})": jnp.linalg.norm(leaf.reshape(-1))
        for path, leaf in with_paths
    }


class Optimizer(eqx.Module):
    """The K-FAC optimizer (kfac-jax's `Optimizer`, Equinox-native and pure).

    Build it once from a `value_and_grad_func`; `init` creates an `Optimizer.State`; `step`
    returns new parameters, state and statistics. Both are pure: call `step` directly (it is
    compiled once per argument structure and cached) or inside your own `eqx.filter_jit` /
    `jax.jit`. See the "Optimizer" documentation page for every option and advice on damping.
    """

    State: ClassVar[type[OptimizerState]] = OptimizerState

    value_and_grad_func: Callable[..., Any] = eqx.field(static=True)
    value_func: Callable[..., Any] = eqx.field(static=True)
    value_func_for_estimator: Callable[..., Any] = eqx.field(static=True)
    l2_reg: float = eqx.field(static=True)
    value_func_has_aux: bool = eqx.field(static=True)
    value_func_has_state: bool = eqx.field(static=True)
    value_func_has_rng: bool = eqx.field(static=True)
    use_adaptive_learning_rate: bool = eqx.field(static=True)
    learning_rate_schedule: Schedule | None = eqx.field(static=True)
    use_adaptive_momentum: bool = eqx.field(static=True)
    momentum_schedule: Schedule | None = eqx.field(static=True)
    use_adaptive_damping: bool = eqx.field(static=True)
    damping_schedule: Schedule | None = eqx.field(static=True)
    initial_damping: float | None = eqx.field(static=True)
    min_damping: float = eqx.field(static=True)
    max_damping: float = eqx.field(static=True)
    include_damping_in_quad_change: bool = eqx.field(static=True)
    damping_adaptation_interval: int = eqx.field(static=True)
    damping_adaptation_decay: float = eqx.field(static=True)
    damping_lower_threshold: float = eqx.field(static=True)
    damping_upper_threshold: float = eqx.field(static=True)
    always_use_exact_qmodel_for_damping_adjustment: bool = eqx.field(static=True)
    norm_constraint: float | None = eqx.field(static=True)
    num_burnin_steps: int = eqx.field(static=True)
    estimation_mode: str = eqx.field(static=True)
    curvature_ema: float = eqx.field(static=True)
    curvature_update_period: int = eqx.field(static=True)
    inverse_update_period: int = eqx.field(static=True)
    use_exact_inverses: bool = eqx.field(static=True)
    batch_process_func: Callable[[Any], Any] | None = eqx.field(static=True)
    register_only_generic: bool = eqx.field(static=True)
    patterns_to_skip: tuple[str, ...] = eqx.field(static=True)
    auto_register_kwargs: tuple[tuple[str, Any], ...] = eqx.field(static=True)
    layer_tag_to_block_ctor: tuple[tuple[str, Any], ...] = eqx.field(static=True)
    inverse_solver: Any = eqx.field(static=True)
    multi_device: bool = eqx.field(static=True)
    mesh: Any = eqx.field(static=True)
    pmap_axis_name: str = eqx.field(static=True)
    batch_size_extractor: Callable[[Any], Any] | None = eqx.field(static=True)
    include_norms_in_stats: bool = eqx.field(static=True)
    include_per_param_norms_in_stats: bool = eqx.field(static=True)
    distributed_precon_apply: bool = eqx.field(static=True)
    distributed_inverses: bool = eqx.field(static=True)
    skip_non_finite: bool = eqx.field(static=True)
    donate_parameters: bool = eqx.field(static=True)
    donate_optimizer_state: bool = eqx.field(static=True)
    donate_batch_inputs: bool = eqx.field(static=True)
    donate_func_state: bool = eqx.field(static=True)
    on_unmatched: str = eqx.field(static=True)
    _cache: EstimatorCache = eqx.field(static=True)

    def __init__(
        self,
        value_and_grad_func: Callable[..., Any],
        l2_reg: float,
        value_func_has_aux: bool = False,
        value_func_has_state: bool = False,
        value_func_has_rng: bool = False,
        use_adaptive_learning_rate: bool = False,
        learning_rate_schedule: Schedule | None = None,
        use_adaptive_momentum: bool = False,
        momentum_schedule: Schedule | None = None,
        use_adaptive_damping: bool = False,
        damping_schedule: Schedule | None = None,
        initial_damping: float | None = None,
        min_damping: float = 1e-8,
        max_damping: float = math.inf,
        include_damping_in_quad_change: bool = False,
        damping_adaptation_interval: int = 5,
        damping_adaptation_decay: float = 0.9,
        damping_lower_threshold: float = 0.25,
        damping_upper_threshold: float = 0.75,
        always_use_exact_qmodel_for_damping_adjustment: bool = False,
        norm_constraint: float | None = None,
        num_burnin_steps: int = 10,
        estimation_mode: str = "fisher_gradients",
        curvature_ema: float = 0.95,
        inverse_update_period: int = 5,
        use_exact_inverses: bool = False,
        batch_process_func: Callable[[Any], Any] | None = None,
        register_only_generic: bool = False,
        patterns_to_skip: Sequence[str] = (),
        auto_register_kwargs: Mapping[str, Any] | None = None,
        layer_tag_to_block_ctor: Mapping[str, Any] | None = None,
        multi_device: bool = False,
        mesh: Any = None,
        pmap_axis_name: str = "kfac_axis",
        batch_size_extractor: Callable[[Any], Any] | None = None,
        include_norms_in_stats: bool = False,
        include_per_param_norms_in_stats: bool = False,
        distributed_precon_apply: bool = True,
        distributed_inverses: bool = True,
        skip_non_finite: bool = True,
        *,
        curvature_update_period: int = 1,
        value_func: Callable[..., Any] | None = None,
        value_func_for_estimator: Callable[..., Any] | None = None,
        donate_parameters: bool = False,
        donate_optimizer_state: bool = False,
        donate_batch_inputs: bool = False,
        donate_func_state: bool = False,
        inverse_solver: Any = None,
        on_unmatched: str = "warn",
    ):
        """**Arguments:**

        - `value_and_grad_func`: `value_and_grad_func(params, [func_state], [rng], batch)` returns
          `(out, grads)` as `eqx.filter_value_and_grad(loss)` or `jax.value_and_grad(loss)` do;
          `out` is `loss`, `(loss, aux)`, `(loss, func_state)` or `(loss, (func_state, aux))`.
          The loss must register its losses (e.g. `register_softmax_cross_entropy_loss`) and be
          averaged over the batch; add any L2 term `l2_reg/2·Σθ²` yourself.
        - `l2_reg`: the L2 coefficient used in the loss; it is added to the curvature's damping
          and to the quadratic model.
        - `value_func_has_aux`, `value_func_has_state`, `value_func_has_rng`: the function forms
          above; `func_state` may be an `eqx.nn.State`, `rng` a PRNG key (split from `step`'s).
        - `use_adaptive_learning_rate`, `use_adaptive_momentum`: choose the learning rate and/or
          momentum by minimising the exact quadratic model (GGN or Fisher, after
          `estimation_mode`) over the preconditioned gradient and the previous update.
        - `learning_rate_schedule`, `momentum_schedule`, `damping_schedule`: functions of the
          step counter (and of `data_seen=` if they accept that keyword).
        - `use_adaptive_damping`: Levenberg-Marquardt adaptation of the damping from `ρ`, starting
          at `initial_damping`, every `damping_adaptation_interval` steps: multiply by
          `damping_adaptation_decay ** damping_adaptation_interval` when
          `ρ > damping_upper_threshold`, divide when `ρ < damping_lower_threshold`, clip to
          `[min_damping, max_damping]`.
        - `include_damping_in_quad_change`: include the damping term in the predicted change.
        - `always_use_exact_qmodel_for_damping_adjustment`: with fixed learning rate and momentum,
          predict the change with the exact curvature instead of the K-FAC estimate.
        - `norm_constraint`: scale the preconditioned gradient so that `lr²·gᵀ P g` is at most this
          (not with an adaptive learning rate).
        - `num_burnin_steps`: curvature updates before the first step (from `data_iterator`, or
          repeated on the first batch).
        - `estimation_mode`: one of `fisher_gradients`, `fisher_empirical`, `fisher_exact`,
          `fisher_curvature_prop`, `ggn_exact`, `ggn_curvature_prop`.
        - `curvature_ema`: decay of the curvature moving averages.
        - `inverse_update_period`: steps between refreshes of the cached inverses (1: no cache,
          inverses are computed in every step).
        - `use_exact_inverses`: invert Kronecker blocks exactly (eigendecompositions) instead of
          with pi-adjusted factored damping.
        - `batch_process_func`: applied to every batch before use.
        - `register_only_generic`, `patterns_to_skip`, `auto_register_kwargs`: passed to
          `auto_register_tags`.
        - `layer_tag_to_block_ctor`: block class per tag name, overriding the defaults.
        - `inverse_solver`: the lineax solver the curvature blocks use for their inverse
          (keyword only), as for `BlockDiagonalCurvature`: one solver (for every `Full` /
          Kronecker block), a sequence with one solver or `None` per block, or a function from
          a block to a solver or `None` (e.g. `lineax.Cholesky()`, `lineax.CG(rtol, atol)`,
          `eqx_kfac.KroneckerEigenSolver()`). It replaces `use_exact_inverses` for those blocks;
          cached solver states are refreshed every `inverse_update_period` steps with that
          step's damping. A failed solve gives a non-finite update, which
          `skip_non_finite=True` skips.
        - `multi_device`: run the step under `jax.shard_map` over `mesh` (default: a 1-D mesh of
          all devices): parameters and state replicated, the batch (the global batch) split along
          its first axis over the axis `pmap_axis_name`; loss, gradients, curvature statistics and
          quadratic-model products are averaged over it. See "Multi-device and multi-host".
        - `mesh`, `pmap_axis_name`: the mesh and the name of its data axis.
        - `distributed_inverses`, `distributed_precon_apply`: with `multi_device`, each block's
          cache update / preconditioner product is computed by one device and shared, instead
          of by every device.
        - `batch_size_extractor`: maps the (processed) batch to its size; `None` (default): the
          leading dimension of the registered losses' inputs, whatever else the batch holds.
        - `include_norms_in_stats`, `include_per_param_norms_in_stats`: add the norms of the
          parameters, gradient, preconditioned gradient and update to the statistics.
        - `skip_non_finite`: when the loss or gradient is not finite, return the parameters,
          state and function state unchanged (the step counter too) and set `stats["skipped"]`.
          When only the update is not finite (a failed solve), the parameters, velocities,
          damping and counters are unchanged and `stats["skipped"]` is set; the curvature
          statistics keep the (finite) batch. A block whose `inverse_solver` factorisation
          fails at a cache refresh keeps its previous solver state.
        - `curvature_update_period`: steps between curvature updates (keyword only).
        - `value_func`: the loss function itself (keyword only). By default it is recovered
          from `value_and_grad_func.__wrapped__` (set by `jax.value_and_grad`,
          `eqx.filter_value_and_grad` and `functools.wraps`); without either, construction
          raises `ValueError`.
        - `value_func_for_estimator`: the function whose registrations the curvature estimator
          traces (keyword only; default `value_func`), e.g. the loss without regularisers.
        - `donate_parameters`, `donate_optimizer_state`, `donate_batch_inputs`,
          `donate_func_state`: donate these arguments' buffers to `step` (keyword only, as in
          kfac-jax): the step writes its outputs into them, which saves a copy of the
          parameters and of the optimizer state (curvature factors and cached inverses) per
          step, and the arrays you passed are deleted. Donate only what you replace with the
          step's outputs (`params, state, stats = optimizer.step(params, state, ...)`). Inside
          your own `jit`, use its `donate_argnums` instead.
        - `on_unmatched`: what to do when a parameter falls back to a generic (diagonal) block
          because no layer accounts for it (keyword only): `"warn"` (a `UserWarning` naming the
          parameters, at the first step or `init`), `"error"` or `"ignore"`; see
          `BlockDiagonalCurvature`.
        """
        value_func = check_constructor_arguments(
            value_and_grad_func=value_and_grad_func,
            value_func=value_func,
            mesh=mesh,
            pmap_axis_name=pmap_axis_name,
            use_adaptive_learning_rate=use_adaptive_learning_rate,
            learning_rate_schedule=learning_rate_schedule,
            use_adaptive_momentum=use_adaptive_momentum,
            momentum_schedule=momentum_schedule,
            use_adaptive_damping=use_adaptive_damping,
            damping_schedule=damping_schedule,
            initial_damping=initial_damping,
            norm_constraint=norm_constraint,
            estimation_mode=estimation_mode,
            damping_adaptation_interval=damping_adaptation_interval,
            inverse_update_period=inverse_update_period,
            curvature_update_period=curvature_update_period,
            num_burnin_steps=num_burnin_steps,
            damping_adaptation_decay=damping_adaptation_decay,
            damping_lower_threshold=damping_lower_threshold,
            damping_upper_threshold=damping_upper_threshold,
            curvature_ema=curvature_ema,
        )
        self.value_and_grad_func = value_and_grad_func
        self.value_func = value_func
        self.value_func_for_estimator = value_func_for_estimator or value_func
        self.l2_reg = l2_reg
        self.value_func_has_aux = value_func_has_aux
        self.value_func_has_state = value_func_has_state
        self.value_func_has_rng = value_func_has_rng
        self.use_adaptive_learning_rate = use_adaptive_learning_rate
        self.learning_rate_schedule = learning_rate_schedule
        self.use_adaptive_momentum = use_adaptive_momentum
        self.momentum_schedule = momentum_schedule
        self.use_adaptive_damping = use_adaptive_damping
        self.damping_schedule = damping_schedule
        self.initial_damping = initial_damping
        self.min_damping = min_damping
        self.max_damping = max_damping
        self.include_damping_in_quad_change = include_damping_in_quad_change
        self.damping_adaptation_interval = damping_adaptation_interval
        self.damping_adaptation_decay = damping_adaptation_decay
        self.damping_lower_threshold = damping_lower_threshold
        self.damping_upper_threshold = damping_upper_threshold
        self.always_use_exact_qmodel_for_damping_adjustment = (
            always_use_exact_qmodel_for_damping_adjustment
        )
        self.norm_constraint = norm_constraint
        self.num_burnin_steps = num_burnin_steps
        self.estimation_mode = estimation_mode
        self.curvature_ema = curvature_ema
        self.curvature_update_period = curvature_update_period
        self.inverse_update_period = inverse_update_period
        self.use_exact_inverses = use_exact_inverses
        self.batch_process_func = batch_process_func
        self.register_only_generic = register_only_generic
        self.patterns_to_skip = tuple(patterns_to_skip)
        self.auto_register_kwargs = tuple(sorted((auto_register_kwargs or {}).items()))
        self.layer_tag_to_block_ctor = tuple(sorted((layer_tag_to_block_ctor or {}).items()))
        self.inverse_solver = check_solver_choice(inverse_solver, "Optimizer")
        self.multi_device = multi_device
        self.mesh = mesh
        self.pmap_axis_name = pmap_axis_name
        self.batch_size_extractor = batch_size_extractor
        self.include_norms_in_stats = include_norms_in_stats
        self.include_per_param_norms_in_stats = include_per_param_norms_in_stats
        self.distributed_precon_apply = distributed_precon_apply
        self.distributed_inverses = distributed_inverses
        self.skip_non_finite = skip_non_finite
        self.donate_parameters = donate_parameters
        self.donate_optimizer_state = donate_optimizer_state
        self.donate_batch_inputs = donate_batch_inputs
        self.donate_func_state = donate_func_state
        self.on_unmatched = check_on_unmatched(on_unmatched, "Optimizer")
        self._cache = EstimatorCache()

    # --- configuration helpers --------------------------------------------------------------

    @property
    def _axis(self) -> str | None:
        """The data axis inside the step, `None` on one device."""
        return self.pmap_axis_name if self.multi_device else None

    @property
    def _use_cached_inverses(self) -> bool:
        return self.inverse_update_period != 1

    @property
    def _powers_to_cache(self) -> tuple[int | None, int | None]:
        """(exact, approximate) powers the estimator caches."""
        if not self._use_cached_inverses:
            return None, None
        return (-1, None) if self.use_exact_inverses else (None, -1)

    def _keys(self, rng: PRNGKeyArray) -> tuple[PRNGKeyArray, PRNGKeyArray | None]:
        """This device's key for the curvature's sampling, and one for the value function's
        randomness (`None` without `value_func_has_rng`)."""
        rng = _distributed.fold_in_device(rng, self._axis)
        return tuple(jax.random.split(rng)) if self.value_func_has_rng else (rng, None)

    def _process(self, batch: Any) -> Any:
        return batch if self.batch_process_func is None else self.batch_process_func(batch)

    def _func_args(self, params: Any, func_state: Any, rng: Any, batch: Any) -> tuple[Any, ...]:
        args = (params,)
        if self.value_func_has_state:
            args += (func_state,)
        if self.value_func_has_rng:
            args += (rng,)
        return args + (batch,)

    def _loss_of(self, out: Any) -> Array:
        return out[0] if (self.value_func_has_aux or self.value_func_has_state) else out

    def _split_outputs(self, out: Any) -> tuple[Array, Any, Any]:
        if not (self.value_func_has_aux or self.value_func_has_state):
            return out, None, None
        loss, other = out
        if self.value_func_has_aux and self.value_func_has_state:
            return loss, other[0], other[1]
        if self.value_func_has_aux:
            return loss, None, other
        return loss, other, None

    def estimators(
        self, func_args: Sequence[Any]
    ) -> tuple[BlockDiagonalCurvature, ImplicitExactCurvature]:
        """The curvature estimators for function arguments of this structure and these shapes.

        Built (tracing the loss once, and logging the registration report at INFO level on the
        `"eqx_kfac"` logger) on first use, cached afterwards.

        **Arguments:**

        - `func_args`: the arguments of the value function, `(params, [func_state], [rng], batch)`.

        **Returns:**

        `(block_diagonal, implicit_exact)`: the K-FAC estimator and the exact products used by the
        quadratic model.
        """
        abstract_args = jax.tree.map(abstract, tuple(func_args))
        key = signature(abstract_args)
        try:
            hash(key)
        except TypeError:
            key = None
        if key is not None and key in self._cache.entries:
            return self._cache.entries[key]
        kwargs = dict(self.auto_register_kwargs)
        if self.register_only_generic:
            kwargs["register_only_generic"] = True
        if self.patterns_to_skip:
            kwargs["patterns_to_skip"] = self.patterns_to_skip
        block_diagonal = BlockDiagonalCurvature(
            self.value_func_for_estimator,
            abstract_args,
            params_index=0,
            default_estimation_mode=self.estimation_mode,
            layer_tag_to_block_ctor=dict(self.layer_tag_to_block_ctor) or None,
            inverse_solver=self.inverse_solver,
            on_unmatched=self.on_unmatched,
            **kwargs,
        )
        implicit = ImplicitExactCurvature(
            self.value_func, params_index=0, batch_size_extractor=self.batch_size_extractor
        )
        logger.info(
            "eqx_kfac.Optimizer: curvature blocks (%d blocks, %d parameters):\n%s",
            block_diagonal.num_blocks, block_diagonal.dim, block_diagonal.registrations(),
        )
        if key is not None:
            self._cache.entries[key] = (block_diagonal, implicit)
        return block_diagonal, implicit

    # --- init -------------------------------------------------------------------------------

    def init(
        self, params: PyTree, rng: PRNGKeyArray, batch: PyTree, func_state: PyTree = None
    ) -> OptimizerState:
        """Creates the optimizer state, and checks the loss against its registrations.

        The loss is evaluated once on `batch`: a loss summed over the batch (instead of averaged,
        as the curvature is) raises `ValueError`; an explicit `batch_size_extractor` that
        disagrees with the registered losses' batch dimension warns.

        **Arguments:**

        - `params`: the parameters (a PyTree or an `eqx.Module`; its inexact arrays are trained).
        - `rng`: a PRNG key (for the blocks' initialisation).
        - `batch`: an example batch with the shapes every `step` will use.
        - `func_state`: an example function state (required when `value_func_has_state`).

        **Returns:**

        An `Optimizer.State`.
        """
        check_func_state(self, func_state)
        func_args = self._func_args(params, func_state, rng, self._process(batch))
        block_diagonal, implicit = self.estimators(func_args)
        batch_size = implicit.batch_size(func_args)
        if self.batch_size_extractor is not None:
            check_batch_size(self.value_func, func_args, batch_size)
        if not self.multi_device:
            # (Under `multi_device` the loss may use collectives, which need the step's map.)
            check_loss_is_averaged(self.value_func, self._loss_of, func_args, batch_size)
        exact, approx = self._powers_to_cache
        filtered = eqx.filter(params, eqx.is_inexact_array)
        float_dtype = jnp.result_type(*jax.tree.leaves(filtered))
        return OptimizerState(
            velocities=jax.tree.map(jnp.zeros_like, filtered),
            estimator_state=block_diagonal.init(rng, exact, approx),
            damping=jnp.asarray(
                0.0 if self.initial_damping is None else self.initial_damping, float_dtype
            ),
            data_seen=jnp.zeros((), int),
            step_counter=jnp.zeros((), int),
            batch_signature=signature(batch),
        )

    # --- step -------------------------------------------------------------------------------

    def step(
        self,
        params: PyTree,
        state: OptimizerState,
        rng: PRNGKeyArray,
        data_iterator: Any = None,
        batch: PyTree = None,
        func_state: PyTree = None,
        learning_rate: ArrayLike | None = None,
        momentum: ArrayLike | None = None,
        damping: ArrayLike | None = None,
        global_step_int: int | None = None,
    ) -> tuple[Any, ...]:
        """Takes one K-FAC step.

        **Arguments:**

        - `params`: the current parameters.
        - `state`: the optimizer state.
        - `rng`: a PRNG key, different at every step.
        - `data_iterator`: an iterator of batches (burn-in batches at step 0, then one per step);
          not usable inside `jit`. Exactly one of `data_iterator` and `batch` is required.
        - `batch`: the batch of this step (also the burn-in batch at step 0).
        - `func_state`: the function state, when `value_func_has_state`.
        - `learning_rate`, `momentum`, `damping`: required when the quantity is neither adaptive
          nor scheduled, forbidden otherwise.
        - `global_step_int`: the step counter as a Python int (with `data_iterator`, saves reading
          it from the device).

        **Returns:**

        `(params, state, stats)`, or `(params, state, func_state, stats)` when
        `value_func_has_state`. `stats` has `loss`, `learning_rate`, `momentum`, `damping`, `rho`,
        `new_loss`, `quad_model_change`, `step`, `data_seen`, `batch_size`, `skipped` (the update
        was not applied because the loss or gradient was not finite), `aux` when the function has
        auxiliary outputs, and norms when requested.
        """
        if (data_iterator is None) == (batch is None):
            raise ValueError("Pass exactly one of data_iterator= and batch= to step.")
        if data_iterator is not None and not isinstance(data_iterator, Iterator):
            raise TypeError(
                "Optimizer.step(params, state, rng, data_iterator=None, batch=None, ...): the fourth "
                f"positional argument is `data_iterator`, an iterator of batches, but got a "
                f"{type(data_iterator).__name__}. Pass a single batch by keyword: "
                "`optimizer.step(params, state, rng, batch=batch)`."
            )
        check_hyperparameters(self, learning_rate, momentum, damping)
        check_func_state(self, func_state)
        if not isinstance(state, OptimizerState):
            raise TypeError(f"state must be an Optimizer.State (from init), got {type(state)}.")
        hyper = tuple(None if v is None else jnp.asarray(v) for v in (learning_rate, momentum, damping))
        if data_iterator is None:
            check_batch(state, batch, "batch")
            return compiled_step(self, (params, state, rng, batch, func_state, hyper), True)
        step_int = global_step_int
        if step_int is None:
            try:
                step_int = int(state.step_counter)
            except jax.errors.ConcretizationTypeError:
                raise ValueError(
                    "data_iterator cannot be used inside jit (batches are drawn in Python); pass "
                    "batch= instead, or call step outside jit."
                ) from None
        original = state
        if step_int == 0 and self.num_burnin_steps > 0:
            keys = burnin_keys(rng, self.num_burnin_steps)
            for i in range(self.num_burnin_steps):
                burnin_batch = next(data_iterator)
                check_batch(state, burnin_batch, f"burn-in batch #{i}")
                state = jitted_burnin(self, params, state, keys[i], burnin_batch, func_state)
        batch = next(data_iterator)
        check_batch(state, batch, "batch from data_iterator")
        out = compiled_step(self, (params, state, rng, batch, func_state, hyper), False)
        if state is original:
            return out
        # A skipped step must leave the state as it was before the burn-in too.
        stats = out[-1]
        return (*out[:1], select_changed(stats["skipped"], original, out[1]), *out[2:])

    # --- the compiled parts -----------------------------------------------------------------

    def _burnin_update(
        self, params: Any, state: OptimizerState, key: PRNGKeyArray, batch: Any, func_state: Any
    ) -> OptimizerState:
        """One burn-in curvature update: summed statistics (ema_old = ema_new = 1)."""
        batch = self._process(batch)
        key, func_key = self._keys(key)
        func_args = self._func_args(params, func_state, func_key, batch)
        block_diagonal, implicit = self.estimators(func_args)
        estimator_state = block_diagonal.update_curvature_matrix_estimate(
            state.estimator_state, 1.0, 1.0, implicit.batch_size(func_args), key, func_args,
            axis_name=self._axis,
        )
        return eqx.tree_at(lambda s: s.estimator_state, state, estimator_state)

    def _hyperparameters(
        self, state: OptimizerState, learning_rate: Any, momentum: Any, damping: Any
    ) -> tuple[Any, Any, Array]:
        step, seen = state.step_counter, state.data_seen
        if self.learning_rate_schedule is not None:
            learning_rate = call_schedule(self.learning_rate_schedule, step, seen)
        if self.momentum_schedule is not None:
            momentum = call_schedule(self.momentum_schedule, step, seen)
        if self.use_adaptive_damping:
            damping = state.damping
        elif self.damping_schedule is not None:
            damping = call_schedule(self.damping_schedule, step, seen)
        return learning_rate, momentum, jnp.asarray(damping)

    def _exact_quad_model(
        self, implicit: ImplicitExactCurvature, func_args: Any, vectors: Sequence[Any], grads: Any
    ) -> QuadraticModel:
        if self.estimation_mode.startswith("fisher"):
            factor = implicit.multiply_fisher_factor_transpose
        else:
            factor = implicit.multiply_ggn_factor_transpose
        # One batched Jacobian-vector product: the forward pass is shared by all the vectors
        # (under `vmap` only the tangents carry the batch axis).
        stacked = jax.tree.map(lambda *leaves: jnp.stack(leaves), *vectors)
        products = jax.vmap(lambda v: factor(func_args, v))(stacked)
        curvature = gram_matrix(
            [jax.tree.map(lambda x, i=i: x[i], products) for i in range(len(vectors))]
        )
        curvature = _distributed.pmean(curvature, self._axis)
        return quadratic_model(vectors, grads, curvature)

    def _approx_quad_model(
        self, block_diagonal: BlockDiagonalCurvature, estimator_state: EstimatorState,
        vectors: Sequence[Any], grads: Any,
    ) -> QuadraticModel:
        products = [block_diagonal.multiply(estimator_state, v, 0.0, True, False) for v in vectors]
        return quadratic_model(vectors, grads, gram_matrix(products, vectors))

    def _step(
        self,
        params: Any,
        state: OptimizerState,
        rng: PRNGKeyArray,
        batch: Any,
        func_state: Any,
        hyper: tuple[Any, Any, Any],
        burnin_in_graph: bool,
    ) -> tuple[Any, ...]:
        learning_rate, momentum, damping = self._hyperparameters(state, *hyper)
        identity_weight = self.l2_reg + damping
        step = state.step_counter

        processed = self._process(batch)
        step_key = rng
        rng, func_rng = self._keys(rng)
        func_args = self._func_args(params, func_state, func_rng, processed)
        block_diagonal, implicit = self.estimators(func_args)
        batch_size = implicit.batch_size(func_args)

        out, grads = self.value_and_grad_func(*func_args)
        out = _distributed.pmean(out, self._axis)
        loss, new_func_state, aux = self._split_outputs(out)
        grads = _distributed.pmean(eqx.filter(grads, eqx.is_inexact_array), self._axis)
        # Gates on the state, applied where each part is computed so that they fuse with it
        # (one select over the whole state at the end would copy it in every step).
        finite = jnp.isfinite(loss) & all_finite(grads) if self.skip_non_finite else None

        # The burn-in (summed statistics, `num_burnin_steps` keys) at step 0 and this step's
        # update (every `curvature_update_period` steps) are trips of one loop, so that the
        # curvature update is compiled once. A step that is not finite takes none of them (and
        # its burn-in is repeated at the next step 0).
        burnin = self.num_burnin_steps if burnin_in_graph else 0
        keys = jnp.concatenate([burnin_keys(step_key, burnin), step_key[None]]) if burnin else step_key[None]
        trips = (step % self.curvature_update_period == 0).astype(int)
        if burnin:
            trips = trips + jnp.where(step == 0, burnin, 0)
        if finite is not None:
            trips = jnp.where(finite, trips, 0)

        def update_curvature(i, estimator_state):
            burning = i < jnp.where(step == 0, burnin, 0)
            key, key_of_func = self._keys(keys[jnp.where(burning, i, burnin)])
            return block_diagonal.update_curvature_matrix_estimate(
                estimator_state, jnp.where(burning, 1.0, self.curvature_ema), 1.0, batch_size, key,
                self._func_args(params, func_state, key_of_func, processed), axis_name=self._axis,
            )

        estimator_state = jax.lax.fori_loop(0, trips, update_curvature, state.estimator_state)

        if self._use_cached_inverses:
            exact, approx = self._powers_to_cache
            if self.multi_device and self.distributed_inverses:
                def new_cache(s):
                    return _distributed.distributed_update_cache(
                        block_diagonal, s, identity_weight, exact, approx, self._axis
                    )
            else:
                def new_cache(s):
                    return block_diagonal.update_cache(s, identity_weight, exact, approx)

            # Not refreshed on a skipped step. A refresh needs no select of its own (a copy of
            # the whole cache): the built-in inverses fall back to a floored eigendecomposition
            # and are finite for finite statistics, and a block whose solver factorisation fails
            # keeps its previous solver state (`store_solver_state`).
            estimator_state = periodic(
                self.inverse_update_period, step, new_cache, estimator_state, gate=finite
            )
        precon_args = (
            estimator_state, grads, identity_weight, -1, self.use_exact_inverses,
            self._use_cached_inverses,
        )
        if self.multi_device and self.distributed_precon_apply:
            precon_grad = _distributed.distributed_multiply_matpower(
                block_diagonal, *precon_args, self._axis
            )
        else:
            precon_grad = block_diagonal.multiply_matpower(*precon_args)
        scaled_grad_norm_sq = None
        if self.norm_constraint is not None:
            scale, scaled_grad_norm_sq = norm_constraint_scale(
                inner_product(precon_grad, grads), learning_rate, self.norm_constraint
            )
            precon_grad = jax.tree.map(lambda x: x * scale, precon_grad)

        vectors = (precon_grad, state.velocities)
        fixed = (None if learning_rate is None else -learning_rate, momentum)
        adaptive = self.use_adaptive_learning_rate or self.use_adaptive_momentum
        if adaptive:
            model = self._exact_quad_model(implicit, func_args, vectors, grads)
            coefficients, quad_change = solve_quadratic_model(
                model, damping, self.l2_reg, fixed, self.include_damping_in_quad_change
            )
        else:
            coefficients = tuple(jnp.asarray(c) for c in fixed)
            quad_change = None
        delta = jax.tree.map(
            lambda p, v: p * coefficients[0] + v * coefficients[1], precon_grad, state.velocities
        )
        # A non-finite update (e.g. from a failed solve) is skipped like a non-finite gradient.
        applied = None if finite is None else finite & all_finite(delta)
        new_params = select_changed(applied, eqx.apply_updates(params, delta), params)

        def adapt_damping():
            change = quad_change
            if change is None:
                if self.always_use_exact_qmodel_for_damping_adjustment:
                    model = self._exact_quad_model(implicit, func_args, [delta], grads)
                else:
                    model = self._approx_quad_model(block_diagonal, estimator_state, [delta], grads)
                _, change = solve_quadratic_model(
                    model, damping, self.l2_reg, (1.0,), self.include_damping_in_quad_change
                )
            new_loss = _distributed.pmean(
                self._loss_of(self.value_func(new_params, *func_args[1:])), self._axis
            )
            new_damping, rho = levenberg_marquardt_damping(
                loss, new_loss, change, damping,
                lower_threshold=self.damping_lower_threshold,
                upper_threshold=self.damping_upper_threshold,
                decay_factor=self.damping_adaptation_decay ** self.damping_adaptation_interval,
                min_damping=self.min_damping,
                max_damping=self.max_damping,
            )
            return new_damping.astype(state.damping.dtype), rho, new_loss, change

        def keep_damping():
            nan = jnp.full((), jnp.nan, loss.dtype)
            change = nan if quad_change is None else quad_change
            return state.damping, nan, nan, change

        if self.use_adaptive_damping:
            new_damping, rho, new_loss, quad_change = jax.lax.cond(
                (step + 1) % self.damping_adaptation_interval == 0, adapt_damping, keep_damping
            )
        else:
            _, rho, new_loss, quad_change = keep_damping()
            new_damping = damping.astype(state.damping.dtype)

        batch_size = _distributed.global_batch_size(batch_size, self._axis)
        new_state = OptimizerState(
            velocities=delta,
            estimator_state=estimator_state,
            damping=new_damping,
            data_seen=state.data_seen + batch_size,
            step_counter=step + 1,
            batch_signature=state.batch_signature,
        )
        if applied is None:
            skipped = jnp.zeros((), bool)
        else:
            # The estimator state is gated already (the statistics by `finite`, the cache refresh
            # skipped unless `finite`): replacing it in `state` leaves nothing to select there.
            kept = eqx.tree_at(lambda s: s.estimator_state, state, estimator_state)
            new_state = select_changed(applied, new_state, kept)
            new_func_state = select_changed(finite, new_func_state, func_state)
            skipped = ~applied
        stats = dict(
            step=new_state.step_counter,
            batch_size=jnp.asarray(batch_size),
            data_seen=new_state.data_seen,
            loss=loss,
            new_loss=new_loss,
            learning_rate=-coefficients[0],
            momentum=coefficients[1],
            damping=damping,
            rho=rho,
            quad_model_change=quad_change,
            skipped=skipped,
        )
        if scaled_grad_norm_sq is not None:
            stats["scaled_grad_norm_sq"] = scaled_grad_norm_sq
        if aux is not None:
            stats["aux"] = aux
        if self.include_norms_in_stats:
            stats["param_norm"] = _norm(eqx.filter(new_params, eqx.is_inexact_array))
            stats["grad_norm"] = _norm(grads)
            stats["precon_grad_norm"] = _norm(precon_grad)
            stats["update_norm"] = _norm(delta)
        if self.include_per_param_norms_in_stats:
            stats.update(_per_param_norms(eqx.filter(new_params, eqx.is_inexact_array), "param_norm"))
            stats.update(_per_param_norms(grads, "grad_norm"))
            stats.update(_per_param_norms(precon_grad, "precon_grad_norm"))
            stats.update(_per_param_norms(delta, "update_norm"))
        if self.value_func_has_state:
            return new_params, new_state, new_func_state, stats
        return new_params, new_state, stats
