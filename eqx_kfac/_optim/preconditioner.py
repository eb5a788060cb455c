"""The K-FAC preconditioner that `Optimizer` and `kfac_preconditioner` share.

`Preconditioner` holds everything about the curvature that both entry points have in common: how
the estimator is built (`CurvatureOptions`: estimation mode, blocks, graph patterns, solver), when
its statistics and cached inverses are refreshed (an `AbstractRefreshSchedule`), and the direction
it turns a gradient into (an `AbstractDirection`). The estimator is built (tracing the loss) once
per loss, configuration and argument signature, and cached outside the preconditioner, which holds
no mutable state.
"""

import logging
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.typing import ArrayLike
from jaxtyping import Array, Bool, Int, PRNGKeyArray, PyTree

from .._core.lru_cache import LRUCache
from .._core.tree import abstract_arrays, signature
from .._curvature.blocks.linear_solver import check_solver_choice, SolverChoice
from .._curvature.estimators import BlockDiagonalCurvature, EstimatorState
from .._curvature.estimators.base import batch_size_of
from .._curvature.estimators.distributed import distributed_update_cache
from .._curvature.estimators.fallbacks import check_on_unmatched, report_fallbacks
from .._curvature.estimators.loss_checks import check_batch_size, check_loss_values
from .._curvature.estimators.modes import check_estimation_mode, check_mode_name
from .._tracing.tracer import trace
from .direction import AbstractDirection, DirectionOutcome, PreconditionedGradient
from .refresh import AbstractRefreshSchedule, RefreshSchedule


logger = logging.getLogger("eqx_kfac")

# Building an estimator traces the loss: once per loss, configuration and argument signature.
_ESTIMATORS = LRUCache(maxsize=32)


def _sorted_items(mapping: Mapping[Any, Any] | None) -> tuple[tuple[Any, Any], ...]:
    return tuple(sorted((mapping or {}).items(), key=lambda item: repr(item[0])))


def _check_real(params: PyTree, who: str) -> None:
    """Raises `ValueError` naming the complex parameters: K-FAC's statistics, factors and
    damping are those of real parameters (complex factors would need conjugates throughout)."""
    paths = [
        f"{jax.tree_util.keystr(path).lstrip('.') or 'params'} ({x.dtype})"
        for path, x in jax.tree_util.tree_leaves_with_path(params)
        if jnp.issubdtype(getattr(x, "dtype", jnp.float32), jnp.complexfloating)
    ]
    if paths:
        raise ValueError(
            f"{who}: K-FAC trains real parameters, but these are complex: {', '.join(paths)}. "
            "Split each complex parameter into its real and imaginary parts, a real array with a "
            "trailing axis of 2 (`jnp.stack([w.real, w.imag], -1)`), and form "
            "`w[..., 0] + 1j * w[..., 1]` inside the model."
        )


def _check_not_empty(batch_size: Any, extracted: bool) -> None:
    """Raises `ValueError` for a batch of no examples (where its size is known)."""
    try:
        empty = int(batch_size) == 0
    except (TypeError, jax.errors.ConcretizationTypeError):
        return
    if empty:
        source = "batch_size_extractor's" if extracted else "the leading axis of the registered losses' inputs"
        raise ValueError(
            f"The example batch has no examples (its batch size, {source}, is 0): K-FAC averages "
            "its curvature statistics over the examples. Pass a batch of at least one example "
            "(e.g. the first training batch) to `Optimizer.init`, or in kfac_preconditioner's "
            "`example_args`."
        )


class CurvatureOptions(eqx.Module):
    """How the K-FAC estimator is built from the loss (final; every field static and hashable).

    **Fields:**

    - `estimation_mode`: one of `fisher_gradients`, `fisher_empirical`, `fisher_exact`,
      `fisher_curvature_prop`, `ggn_exact`, `ggn_curvature_prop`.
    - `layer_tag_to_block_ctor`: block constructor per tag name, as `(tag, ctor)` pairs.
    - `index_to_block_ctor`: block constructor per layer (parameter indices or a parameter
      path), as pairs.
    - `auto_register_kwargs`: arguments of `auto_register_tags` (`graph_patterns`,
      `patterns_to_skip`, `register_only_generic`, ...), as pairs.
    - `inverse_solver`: the lineax solver choice of the blocks' inverses.
    - `on_unmatched`: `"warn"`, `"error"` or `"ignore"` for parameters that fall back to a
      generic block.
    - `batch_size_extractor`: the batch size of a batch, or `None` for the registered losses'.
    """

    estimation_mode: str = eqx.field(static=True)
    layer_tag_to_block_ctor: tuple[tuple[str, Callable], ...] = eqx.field(static=True)
    index_to_block_ctor: tuple[tuple[Hashable, Callable], ...] = eqx.field(static=True)
    auto_register_kwargs: tuple[tuple[str, Any], ...] = eqx.field(static=True)
    inverse_solver: SolverChoice | None = eqx.field(static=True)
    on_unmatched: str = eqx.field(static=True)
    batch_size_extractor: Callable[[Any], Any] | None = eqx.field(static=True)

    def __init__(
        self,
        *,
        estimation_mode: str = "fisher_gradients",
        layer_tag_to_block_ctor: Mapping[str, Callable] | None = None,
        index_to_block_ctor: Mapping[Hashable, Callable] | None = None,
        auto_register_kwargs: Mapping[str, Any] | None = None,
        inverse_solver: SolverChoice | None = None,
        on_unmatched: str = "warn",
        batch_size_extractor: Callable[[Any], Any] | None = None,
        graph_patterns: Sequence[Any] | None = None,
        patterns_to_skip: Sequence[str] = (),
        register_only_generic: bool = False,
    ):
        """**Arguments:** the fields, with mappings given as mappings; `graph_patterns`,
        `patterns_to_skip` and `register_only_generic` are added to `auto_register_kwargs`."""
        auto_register_kwargs = dict(auto_register_kwargs or {})
        if register_only_generic:
            auto_register_kwargs["register_only_generic"] = True
        if patterns_to_skip:
            auto_register_kwargs["patterns_to_skip"] = tuple(patterns_to_skip)
        if graph_patterns is not None:
            auto_register_kwargs["graph_patterns"] = tuple(graph_patterns)
        check_mode_name(estimation_mode)
        self.estimation_mode = estimation_mode
        self.layer_tag_to_block_ctor = _sorted_items(layer_tag_to_block_ctor)
        self.index_to_block_ctor = _sorted_items(index_to_block_ctor)
        self.auto_register_kwargs = _sorted_items(
            {k: tuple(v) if isinstance(v, list) else v for k, v in auto_register_kwargs.items()}
        )
        self.inverse_solver = check_solver_choice(inverse_solver, "CurvatureOptions")
        self.on_unmatched = check_on_unmatched(on_unmatched, "CurvatureOptions")
        self.batch_size_extractor = batch_size_extractor

    def build(self, func: Callable[..., Any], abstract_args: tuple[Any, ...]) -> BlockDiagonalCurvature:
        """The estimator of `func` for arguments like `abstract_args` (traces `func`); an
        estimation mode that does not fit the registered losses raises here."""
        estimator = BlockDiagonalCurvature(
            func,
            abstract_args,
            default_estimation_mode=self.estimation_mode,
            layer_tag_to_block_ctor=dict(self.layer_tag_to_block_ctor) or None,
            index_to_block_ctor=dict(self.index_to_block_ctor) or None,
            inverse_solver=self.inverse_solver,
            on_unmatched=self.on_unmatched,
            **dict(self.auto_register_kwargs),
        )
        check_estimation_mode(self.estimation_mode, trace(estimator.func, abstract_args).loss_classes)
        return estimator


class Preconditioner(eqx.Module):
    """The K-FAC preconditioner: the curvature estimate, its refresh schedule and the direction
    (final). `Optimizer` and `kfac_preconditioner` each hold one.

    **Fields:**

    - `curvature`: the `CurvatureOptions` of the estimator.
    - `refresh`: the `AbstractRefreshSchedule`.
    - `direction`: the `AbstractDirection`.
    """

    curvature: CurvatureOptions = eqx.field(default_factory=CurvatureOptions)
    refresh: AbstractRefreshSchedule = eqx.field(default_factory=RefreshSchedule)
    direction: AbstractDirection = eqx.field(default_factory=PreconditionedGradient)

    def estimator(
        self,
        func: Callable[..., Any],
        func_args: Sequence[Any],
        who: str = "eqx_kfac",
        report: bool = False,
    ) -> BlockDiagonalCurvature:
        """The estimator of `func` for arguments of this structure and these shapes.

        Built on first use (tracing `func` once, logging the registration table at INFO level
        on the `"eqx_kfac"` logger and reporting fallbacks to generic blocks as `on_unmatched`
        says), and cached afterwards for every preconditioner with the same function and
        curvature options. Complex parameters (the first argument's) raise `ValueError`.

        **Arguments:**

        - `func`: the loss function; it registers its losses.
        - `func_args`: its arguments (arrays or `jax.ShapeDtypeStruct`s).
        - `who`: the caller's name, for the log and the errors.
        - `report`: log the table and report the fallbacks for a cached estimator too (each
          optimizer built reports, not only the first on a loss).

        **Returns:**

        A `BlockDiagonalCurvature`.
        """
        abstract = abstract_arrays(tuple(func_args))
        built = []

        def build() -> BlockDiagonalCurvature:
            _check_real(abstract[0], who)
            built.append(self.curvature.build(func, abstract))
            return built[0]

        estimator = _ESTIMATORS.get((func, self.curvature, signature(abstract)), build)
        if report and not built:
            report_fallbacks(tuple(b.spec for b in estimator.blocks), self.curvature.on_unmatched)
        if report or built:
            logger.info(
                "%s: curvature blocks (%d blocks, %d parameters):\n%s",
                who, estimator.num_blocks, estimator.dim, estimator.registrations(),
            )
        return estimator

    def batch_size(self, estimator: BlockDiagonalCurvature, func_args: Sequence[Any]) -> Any:
        """The number of examples in `func_args` (the extractor's, or the registered losses')."""
        return batch_size_of(estimator.func, func_args, 0, self.curvature.batch_size_extractor)

    def check_loss(
        self,
        loss_of: Callable[[Any], Any],
        func_args: Sequence[Any],
        estimator: BlockDiagonalCurvature,
    ) -> None:
        """Checks the loss against its registrations on concrete arguments: a batch of no
        examples, a loss summed over the batch, or class labels outside the range, raise
        `ValueError`; an explicit batch size
        that is not the registrations' warns (see `loss_checks`)."""
        batch_size = self.batch_size(estimator, func_args)
        _check_not_empty(batch_size, self.curvature.batch_size_extractor is not None)
        if self.curvature.batch_size_extractor is not None:
            check_batch_size(estimator.func, func_args, batch_size)
        # The estimator's function is `func` with its layers tagged (tags return their inputs):
        # the same values, and the trace the estimator made already.
        check_loss_values(estimator.func, loss_of, func_args, batch_size)

    def targets_in_range(
        self,
        estimator: BlockDiagonalCurvature,
        func_args: Sequence[Any],
        axis_name: Hashable | None = None,
    ) -> Bool[Array, ""]:
        """Whether the batch's targets are in range for every registered loss (no class label
        outside `[0, classes)` on an example a categorical loss does not mask out), on every
        device of `axis_name`: a step without it is skipped like a non-finite one, since the
        user's loss would read such a label as another class (e.g. -1 as the last).

        **Arguments:**

        - `estimator`: the estimator.
        - `func_args`: the loss function's arguments.
        - `axis_name`: the data axis inside a multi-device step.

        **Returns:**

        A boolean scalar.
        """
        valid = estimator.targets_in_range(func_args)
        if axis_name is None:
            return valid
        return jax.lax.pmin(valid.astype(jnp.int32), axis_name) == 1

    def init(self, estimator: BlockDiagonalCurvature, key: PRNGKeyArray | None = None) -> EstimatorState:
        """The estimator's state, with the direction's powers cached when the schedule caches."""
        exact, approx = self.direction.powers_to_cache() if self.refresh.use_cached else (None, None)
        return estimator.init(key, exact, approx)

    def update_curvature(
        self,
        estimator: BlockDiagonalCurvature,
        state: EstimatorState,
        step: Int[Array, ""],
        gate: Bool[Array, ""] | None,
        key: PRNGKeyArray,
        func_args: Callable[[PRNGKeyArray], Sequence[Any]] | Sequence[Any],
        batch_size: ArrayLike,
        burnin_in_graph: bool = False,
        axis_name: Hashable | None = None,
    ) -> EstimatorState:
        """This step's curvature updates on the refresh schedule (burn-in at step 0 with
        `burnin_in_graph`, then the periodic update), skipped where `gate` is false. A batch whose
        statistics are not finite, or (in the periodic update) grow beyond the schedule's
        `max_statistics_growth`, is not folded in (`EstimatorState.dropped_updates` counts it).

        **Arguments:**

        - `estimator`, `state`: the estimator and its state.
        - `step`: the step counter.
        - `gate`: whether the step may update the curvature (`None`: always).
        - `key`: the step's PRNG key (for the sampled estimation modes).
        - `func_args`: the loss function's arguments, or a function from an update's key to them
          (for a loss that takes a key).
        - `batch_size`: the number of examples per device.
        - `burnin_in_graph`: whether the burn-in runs inside this call.
        - `axis_name`: the data axis inside a multi-device step.

        **Returns:**

        The updated state.
        """
        args_of = func_args if callable(func_args) else (lambda _: func_args)

        def update(
            s: EstimatorState, ema_old: ArrayLike, k: PRNGKeyArray, max_growth: ArrayLike | None
        ) -> EstimatorState:
            return estimator.update_curvature_matrix_estimate(
                s, ema_old, 1.0, batch_size, k, args_of(k), axis_name=axis_name,
                max_statistics_growth=max_growth,
            )

        return self.refresh.update_curvature(state, step, gate, key, burnin_in_graph, update)

    def refresh_inverses(
        self,
        estimator: BlockDiagonalCurvature,
        state: EstimatorState,
        step: Int[Array, ""],
        gate: Bool[Array, ""] | None,
        identity_weight: ArrayLike,
        axis_name: Hashable | None = None,
        distributed: bool = False,
    ) -> EstimatorState:
        """The cache refresh on the schedule, damped by `identity_weight`, skipped where `gate`
        is false; with `distributed` (inside a multi-device step) each block's factorisation runs
        on one device and is shared. A failed inverse keeps its previous value. Without a cache
        (`inverse_update_period=1`) no power is refreshed, but blocks with a basis of their own
        (EK-FAC) still recompute it."""
        exact, approx = self.direction.powers_to_cache() if self.refresh.use_cached else (None, None)

        @jax.named_scope("eqx_kfac.inverse_refresh")
        def refresh(s: EstimatorState) -> EstimatorState:
            if distributed and axis_name is not None:
                return distributed_update_cache(estimator, s, identity_weight, exact, approx, axis_name)
            return estimator.update_cache(s, identity_weight, exact, approx)

        return self.refresh.refresh_inverses(state, step, gate, refresh)

    def precondition(
        self,
        estimator: BlockDiagonalCurvature,
        state: EstimatorState,
        grads: PyTree[Array],
        direction_state: PyTree[Array],
        identity_weight: ArrayLike,
        learning_rate: ArrayLike | None,
        axis_name: Hashable | None = None,
    ) -> DirectionOutcome:
        """The direction for `grads` (`self.direction` with the schedule's cache).

        **Arguments:**

        - `estimator`, `state`: the estimator and its (refreshed) state.
        - `grads`: the gradient.
        - `direction_state`: the direction's state (from `self.direction.init` at first).
        - `identity_weight`: `l2_reg + damping`.
        - `learning_rate`: the step's learning rate when it is fixed, `None` when adapted.
        - `axis_name`: the data axis inside a multi-device step.

        **Returns:**

        The `DirectionOutcome`, with the direction's next state.
        """
        with jax.named_scope("eqx_kfac.direction"):
            return self.direction(
                estimator, state, grads, direction_state, identity_weight, learning_rate,
                self.refresh.use_cached, axis_name,
            )
