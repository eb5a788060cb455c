"""`Optimizer`: the K-FAC optimizer with kfac-jax's semantics, as a pure, Equinox-native step.

The optimizer is built from parts, each an `eqx.Module` (see "Building a variant"):

- the curvature estimator (`BlockDiagonalCurvature`, traced from the loss on first use);
- a `RefreshSchedule`: the burn-in, and when statistics and cached inverses are updated;
- an `AbstractDirection`: the preconditioned gradient `(C + (l2_reg + λ) I)⁻¹ g`, possibly
  shortened by a norm constraint;
- an `AbstractStepRule`: the update from the direction and the previous update (learning rate and
  momentum given, scheduled, or from the exact quadratic model);
- an `AbstractDampingRule`: the damping `λ` (given, scheduled, or Levenberg-Marquardt from `ρ`).

The kfac-jax keywords of the constructor build these parts. One step, in kfac-jax's order:
damping; loss and gradient; curvature updates (with the burn-in at step 0) and the cache
refresh; direction; update; damping adaptation. Every decision that depends on the step counter
is taken inside the compiled graph, so `step` gives the same result called directly or inside a
user's `jit`.
"""

import logging
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.typing import ArrayLike
from jaxtyping import Array, PRNGKeyArray, PyTree

from .._core import distributed as _distributed
from .._core.cache import LRUCache
from .._core.control_flow import select_changed
from .._core.tree import abstract_arrays, signature
from .._curvature.blocks._solver_cache import check_solver_choice
from .._curvature.estimators import BlockDiagonalCurvature, ImplicitExactCurvature
from .._curvature.estimators.fallbacks import check_on_unmatched
from .._curvature.estimators.loss_checks import check_batch_size, check_loss_is_averaged
from .damping import AbstractDampingRule
from .direction import AbstractDirection
from .hyperparameters import Schedule
from .refresh import RefreshSchedule, burnin_keys
from .step_rule import AbstractStepRule
from .optimizer_compiled import compiled_step, jitted_burnin
from .optimizer_config import (
    OptimizerState as OptimizerState,
    check_batch,
    check_func_state,
    parts_from_keywords,
)


logger = logging.getLogger("eqx_kfac")

# Building the estimators traces the loss: once per configuration and argument signature (the
# step looks them up at every trace). Kept here, not in the optimizer, which holds no mutable state.
_ESTIMATORS = LRUCache(maxsize=32)


class Optimizer(eqx.Module):
    """The K-FAC optimizer (kfac-jax's `Optimizer`, Equinox-native, pure, and built from parts).

    Build it once from a `value_and_grad_func`; `init` creates an `Optimizer.State`; `step`
    returns new parameters, state and statistics. Both are pure: call `step` directly (it is
    compiled once per argument structure and cached) or inside your own `eqx.filter_jit` /
    `jax.jit`. See the "Optimizer" documentation page for every option and advice on damping, and
    "Building a variant" for the parts.
    """

    State: ClassVar[type[OptimizerState]] = OptimizerState

    value_and_grad_func: Callable[..., Any] = eqx.field(static=True)
    value_func: Callable[..., Any] = eqx.field(static=True)
    value_func_for_estimator: Callable[..., Any] = eqx.field(static=True)
    l2_reg: float = eqx.field(static=True)
    value_func_has_aux: bool = eqx.field(static=True)
    value_func_has_state: bool = eqx.field(static=True)
    value_func_has_rng: bool = eqx.field(static=True)
    damping_rule: AbstractDampingRule
    step_rule: AbstractStepRule
    direction: AbstractDirection
    refresh: RefreshSchedule
    estimation_mode: str = eqx.field(static=True)
    batch_process_func: Callable[[Any], Any] | None = eqx.field(static=True)
    estimator_kwargs: tuple[tuple[str, Any], ...] = eqx.field(static=True)
    multi_device: bool = eqx.field(static=True)
    mesh: Any = eqx.field(static=True)
    pmap_axis_name: str = eqx.field(static=True)
    batch_size_extractor: Callable[[Any], Any] | None = eqx.field(static=True)
    include_norms_in_stats: bool = eqx.field(static=True)
    include_per_param_norms_in_stats: bool = eqx.field(static=True)
    distributed_inverses: bool = eqx.field(static=True)
    skip_non_finite: bool = eqx.field(static=True)
    donate_parameters: bool = eqx.field(static=True)
    donate_optimizer_state: bool = eqx.field(static=True)
    donate_batch_inputs: bool = eqx.field(static=True)
    donate_func_state: bool = eqx.field(static=True)

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
        damping_rule: AbstractDampingRule | None = None,
        step_rule: AbstractStepRule | None = None,
        direction: AbstractDirection | None = None,
        refresh: RefreshSchedule | None = None,
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
        - `damping_rule`, `step_rule`, `direction`, `refresh` (keyword only): the optimizer's
          parts, given directly instead of through the keywords above that build them (see
          "Building a variant"): an `AbstractDampingRule` (damping keywords), an
          `AbstractStepRule` (learning-rate and momentum keywords), an `AbstractDirection`
          (`use_exact_inverses`, `norm_constraint`, `distributed_precon_apply`) and a
          `RefreshSchedule` (`num_burnin_steps`, `curvature_update_period`,
          `inverse_update_period`, `curvature_ema`). Giving a part together with a keyword of
          its own raises `ValueError`.
        """
        keywords = dict(locals())
        parts = parts_from_keywords(keywords)
        self.value_and_grad_func = value_and_grad_func
        self.value_func = parts.value_func
        self.value_func_for_estimator = value_func_for_estimator or parts.value_func
        self.l2_reg = l2_reg
        self.value_func_has_aux = value_func_has_aux
        self.value_func_has_state = value_func_has_state
        self.value_func_has_rng = value_func_has_rng
        self.damping_rule = parts.damping_rule
        self.step_rule = parts.step_rule
        self.direction = parts.direction
        self.refresh = parts.refresh
        self.estimation_mode = estimation_mode
        self.batch_process_func = batch_process_func
        auto = dict(auto_register_kwargs or {})
        if register_only_generic:
            auto["register_only_generic"] = True
        if patterns_to_skip:
            auto["patterns_to_skip"] = tuple(patterns_to_skip)
        self.estimator_kwargs = tuple(sorted(dict(
            auto,
            default_estimation_mode=estimation_mode,
            layer_tag_to_block_ctor=tuple(sorted((layer_tag_to_block_ctor or {}).items())),
            inverse_solver=check_solver_choice(inverse_solver, "Optimizer"),
            on_unmatched=check_on_unmatched(on_unmatched, "Optimizer"),
        ).items()))
        self.multi_device = multi_device
        self.mesh = mesh
        self.pmap_axis_name = pmap_axis_name
        self.batch_size_extractor = batch_size_extractor
        self.include_norms_in_stats = include_norms_in_stats
        self.include_per_param_norms_in_stats = include_per_param_norms_in_stats
        self.distributed_inverses = distributed_inverses
        self.skip_non_finite = skip_non_finite
        self.donate_parameters = donate_parameters
        self.donate_optimizer_state = donate_optimizer_state
        self.donate_batch_inputs = donate_batch_inputs
        self.donate_func_state = donate_func_state

    # --- configuration helpers --------------------------------------------------------------

    @property
    def _axis(self) -> str | None:
        """The data axis inside the step, `None` on one device."""
        return self.pmap_axis_name if self.multi_device else None

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
        `"eqx_kfac"` logger) on first use, and cached afterwards for every optimizer with the same
        loss and estimator configuration (in a bounded cache outside the optimizer, which holds
        no mutable state).

        **Arguments:**

        - `func_args`: the arguments of the value function, `(params, [func_state], [rng], batch)`.

        **Returns:**

        `(block_diagonal, implicit_exact)`: the K-FAC estimator and the exact products used by the
        quadratic model.
        """
        abstract_args = abstract_arrays(tuple(func_args))

        def build() -> tuple[BlockDiagonalCurvature, ImplicitExactCurvature]:
            kwargs = dict(self.estimator_kwargs)
            kwargs["layer_tag_to_block_ctor"] = dict(kwargs["layer_tag_to_block_ctor"]) or None
            block_diagonal = BlockDiagonalCurvature(
                self.value_func_for_estimator, abstract_args, params_index=0, **kwargs
            )
            implicit = ImplicitExactCurvature(
                self.value_func, params_index=0, batch_size_extractor=self.batch_size_extractor
            )
            logger.info(
                "eqx_kfac.Optimizer: curvature blocks (%d blocks, %d parameters):\n%s",
                block_diagonal.num_blocks, block_diagonal.dim, block_diagonal.registrations(),
            )
            return block_diagonal, implicit

        key = (
            self.value_func_for_estimator, self.value_func, self.estimator_kwargs,
            self.batch_size_extractor, signature(abstract_args),
        )
        return _ESTIMATORS.get(key, build)

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
        exact, approx = self.direction.powers_to_cache() if self.refresh.use_cached else (None, None)
        filtered = eqx.filter(params, eqx.is_inexact_array)
        float_dtype = jnp.result_type(*jax.tree.leaves(filtered))
        return OptimizerState(
            velocities=jax.tree.map(jnp.zeros_like, filtered),
            estimator_state=block_diagonal.init(rng, exact, approx),
            damping=jnp.asarray(self.damping_rule.initial(), float_dtype),
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
        self.step_rule.check(learning_rate, momentum)
        self.damping_rule.check(damping)
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
        burnin = self.refresh.num_burnin_steps
        if step_int == 0 and burnin > 0:
            keys = burnin_keys(rng, burnin)
            for i in range(burnin):
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
