"""`kfac_jax.OptaxPreconditioner`: kfac-jax's optax-compatible K-FAC preconditioner, its keywords,
defaults and methods, on `eqx_kfac`'s `Preconditioner` (the part `Optimizer` and
`kfac_preconditioner` hold).

kfac-jax's examples (`examples/optax_wrapper.py`) call it inside their own `jax.pmap` over
`pmap_axis_name`: where that axis is bound, the curvature statistics are averaged over it at every
update (kfac-jax averages them before each refresh of the inverses: the same estimate, the moving
averages being linear) and the inverses and products are spread over the devices as
`distributed_inverses` and `distributed_precon_apply` say; elsewhere everything runs on one device.
"""

from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any, NamedTuple

import jax.numpy as jnp
import optax
from jax.typing import ArrayLike
from jaxtyping import Array, Int, PRNGKeyArray, PyTree

from .._curvature.blocks.linear_solver import SolverChoice
from .._curvature.estimators import BlockDiagonalCurvature, EstimatorState
from .._optim.direction import PreconditionedGradient
from .._optim.optax_transforms import _loss_of
from .._optim.preconditioner import Preconditioner
from .._optim.refresh import RefreshSchedule
from ._keywords import _curvature, REFUSED
from .curvature_blocks import check_block_ctors
from .utils import default_batch_size_extractor, in_pmap, Numeric, pmean_if_pmap, ScheduleType

_WHO = "kfac_jax.OptaxPreconditioner"


class OptaxPreconditionState(NamedTuple):
    """kfac-jax's `OptaxPreconditionState`: the preconditioner's state.

    **Fields:**

    - `count`: the number of `increment_count` calls so far (`int32`).
    - `estimator_state`: the curvature estimator's state (moving averages and cached inverses).
    """

    count: Int[Array, ""]
    estimator_state: EstimatorState


def _check_keywords(a: Mapping[str, Any]) -> None:
    """kfac-jax's checks of the constructor's arguments, and the keywords refused here."""
    if a["curvature_update_period"] != 1:
        raise ValueError(
            f"{_WHO}: curvature_update_period must be 1 (as in kfac-jax), got "
            f"{a['curvature_update_period']!r}; eqx_kfac.kfac_preconditioner takes other periods."
        )
    if (a["damping"] is None) == (a["damping_schedule"] is None):
        raise ValueError(f"{_WHO}: give exactly one of damping= and damping_schedule=.")
    refused = {
        "use_sqrt_inv": (False, "the preconditioner is the curvature's inverse (power -1)."),
        "num_samples": (1, REFUSED["num_estimator_samples"][1]),
        "norm_to_scale_identity_weight_per_block": REFUSED["norm_to_scale_identity_weight_per_block"],
    }
    for name, (default, instead) in refused.items():
        if a[name] != default and not (name.startswith("norm_to") and a[name] == "none"):
            raise NotImplementedError(
                f"{_WHO}({name}={a[name]!r}) is not supported by eqx_kfac (only {default!r}): {instead}"
            )


class OptaxPreconditioner:
    """kfac-jax's `OptaxPreconditioner`: K-FAC preconditioning for optax optimizers, with
    kfac-jax's keywords, defaults (`estimation_mode="fisher_gradients"`) and methods.

    `init(func_args, rng)` builds the estimator (tracing `value_func` on `func_args`) and its
    state; each step calls `maybe_update(state, func_args, rng)` (the curvature update, and the
    inverses' refresh every `inverse_update_period` steps) and `increment_count`; `apply` (or
    `as_gradient_transform()` in an optax chain, given `precond_state=` at `update`) multiplies
    the gradient by the damped inverse curvature. kfac-jax's examples run it unchanged (see the
    module's note on `jax.pmap`). Differences from kfac-jax: a batch whose statistics are not
    finite is not folded in; the `should_*` helpers and `sync=` are absent or ignored (the
    statistics are averaged over the devices at every update); `multiply_curvature` computes the
    product on every device. Not a `eqx.Module`: like kfac-jax's, it keeps the estimator it
    builds at `init`.
    """

    def __init__(
        self, value_func: Callable[..., Any], l2_reg: Numeric = 0.0, damping: float | None = None,
        damping_schedule: ScheduleType | None = None, norm_constraint: Numeric | None = None,
        estimation_mode: str = "fisher_gradients", curvature_ema: Numeric = 0.95,
        curvature_update_period: int = 1, inverse_update_period: int = 5, use_exact_inverses: bool = False,
        use_sqrt_inv: bool = False, register_only_generic: bool = False, patterns_to_skip: Sequence[str] = (),
        auto_register_kwargs: Mapping[str, Any] | None = None,
        layer_tag_to_block_ctor: Mapping[str, Any] | None = None, pmap_axis_name: str = "batch_axis",
        batch_size_extractor: Callable[[Any], Numeric] = default_batch_size_extractor,
        distributed_inverses: bool = True, distributed_precon_apply: bool = True, num_samples: int = 1,
        should_vmap_samples: bool = False, norm_to_scale_identity_weight_per_block: str | None = None,
        *,
        inverse_solver: SolverChoice | None = None, on_unmatched: str = "warn",
        graph_patterns: Sequence[Any] | None = None, index_to_block_ctor: Mapping[Any, Any] | None = None,
        max_statistics_growth: float | ArrayLike | None = None,
    ):
        """**Arguments:** kfac-jax's keywords, in kfac-jax's order, with its defaults (see its
        documentation). `use_sqrt_inv`, `num_samples` and
        `norm_to_scale_identity_weight_per_block` are accepted at kfac-jax's default and raise
        `NotImplementedError` otherwise; `should_vmap_samples` is ignored (one sample). The
        keyword-only arguments are `eqx_kfac`'s, as for `eqx_kfac.kfac_jax.Optimizer`
        (`max_statistics_growth=None`: every finite batch is folded in, as in kfac-jax).
        """
        arguments = dict(locals())
        _check_keywords(arguments)
        check_block_ctors(layer_tag_to_block_ctor)
        check_block_ctors(index_to_block_ctor)
        curvature = _curvature(dict(arguments, use_automatic_registration=True))
        refresh = RefreshSchedule(0, 1, inverse_update_period, curvature_ema, max_statistics_growth)
        direction = PreconditionedGradient(use_exact_inverses, norm_constraint, distributed_precon_apply)
        self._preconditioner = Preconditioner(curvature, refresh, direction)
        self._value_func = value_func
        self._l2_reg, self._damping, self._damping_schedule = l2_reg, damping, damping_schedule
        self._pmap_axis_name = pmap_axis_name
        self._distributed_inverses = distributed_inverses
        self._estimator: BlockDiagonalCurvature | None = None

    @property
    def estimator(self) -> BlockDiagonalCurvature:
        """The curvature estimator (an `eqx_kfac.BlockDiagonalCurvature`), built by `init`."""
        if self._estimator is None:
            raise ValueError(
                f"{_WHO}: the estimator is built from the function's arguments: call "
                "`init(func_args, rng)` (or `maybe_update`) first."
            )
        return self._estimator

    @property
    def pmap_axis_name(self) -> str:
        """The devices' axis name inside kfac-jax's `jax.pmap`."""
        return self._pmap_axis_name

    def _axis(self) -> Hashable | None:
        return self._pmap_axis_name if in_pmap(self._pmap_axis_name) else None

    def _estimator_of(self, func_args: Sequence[Any], report: bool = False) -> BlockDiagonalCurvature:
        # Built once per argument signature (cached by `Preconditioner.estimator`).
        self._estimator = self._preconditioner.estimator(self._value_func, func_args, _WHO, report)
        return self._estimator

    def init(self, func_args: Sequence[Any], rng: PRNGKeyArray) -> OptaxPreconditionState:
        """Builds the estimator for arguments like `func_args` and returns the initial state.

        **Arguments:**

        - `func_args`: `value_func`'s arguments `(params, [func_state], [rng], batch)`.
        - `rng`: a PRNG key.

        **Returns:**

        The `OptaxPreconditionState`, its count 0.
        """
        estimator = self._estimator_of(func_args, report=True)
        self._preconditioner.check_loss(_loss_of, func_args, estimator)
        return OptaxPreconditionState(jnp.zeros((), jnp.int32), self._preconditioner.init(estimator, rng))

    def get_identity_weight(self, state: OptaxPreconditionState) -> Numeric:
        """The damping at `state.count` (fixed, or the schedule's) plus `l2_reg`.

        **Arguments:**

        - `state`: the preconditioner's state.

        **Returns:**

        The weight of the identity added to the curvature.
        """
        damping = self._damping if self._damping_schedule is None else self._damping_schedule(state.count)
        return damping + self._l2_reg

    def sync_estimator_state(self, state: OptaxPreconditionState) -> OptaxPreconditionState:
        """The state with its statistics averaged over the devices (inside the `pmap`; else as
        it is). The updates average them already: kept for kfac-jax's code.

        **Arguments:**

        - `state`: the preconditioner's state.

        **Returns:**

        The state.
        """
        return OptaxPreconditionState(state.count, pmean_if_pmap(state.estimator_state, self._pmap_axis_name))

    def maybe_update(
        self, state: OptaxPreconditionState, func_args: Sequence[Any], rng: PRNGKeyArray
    ) -> OptaxPreconditionState:
        """This step's curvature update, then the refresh of the inverses every
        `inverse_update_period` counts.

        **Arguments:**

        - `state`: the preconditioner's state.
        - `func_args`: this step's arguments of `value_func`.
        - `rng`: this step's PRNG key (for the sampled estimation modes).

        **Returns:**

        The updated state (its count unchanged).
        """
        state = self.maybe_update_estimator_curvature(state, func_args, rng)
        return self.maybe_update_inverse_cache(state)

    def maybe_update_estimator_curvature(
        self, state: OptaxPreconditionState, func_args: Sequence[Any], rng: PRNGKeyArray,
        decay_old_ema: ArrayLike = True, sync: ArrayLike = True,
    ) -> OptaxPreconditionState:
        """Folds the batch's curvature into the moving averages (decayed by `curvature_ema`, or
        not decayed with `decay_old_ema=False`, for micro-batches).

        **Arguments:**

        - `state`, `func_args`, `rng`: as for `maybe_update`.
        - `decay_old_ema`: whether the old averages decay.
        - `sync`: ignored: the statistics are averaged over the devices at every update.

        **Returns:**

        The updated state.
        """
        del sync
        estimator = self._estimator_of(func_args)
        refresh = self._preconditioner.refresh
        estimator_state = estimator.update_curvature_matrix_estimate(
            state.estimator_state, jnp.where(decay_old_ema, refresh.curvature_ema, 1.0), 1.0,
            self._preconditioner.batch_size(estimator, func_args), rng, func_args,
            axis_name=self._axis(), max_statistics_growth=refresh.max_statistics_growth,
        )
        return OptaxPreconditionState(state.count, estimator_state)

    def maybe_update_inverse_cache(self, state: OptaxPreconditionState) -> OptaxPreconditionState:
        """Refreshes the cached inverses from the current statistics when `state.count` is a
        multiple of `inverse_update_period` (nothing is cached with period 1).

        **Arguments:**

        - `state`: the preconditioner's state.

        **Returns:**

        The updated state.
        """
        estimator_state = self._preconditioner.refresh_inverses(
            self.estimator, state.estimator_state, state.count, None, self.get_identity_weight(state),
            self._axis(), self._distributed_inverses,
        )
        return OptaxPreconditionState(state.count, estimator_state)

    def apply(self, updates: PyTree[Array], state: OptaxPreconditionState) -> PyTree[Array]:
        """`(C + (damping + l2_reg) I)⁻¹ updates`, scaled by `min(1, sqrt(c / uᵀ updates))`
        with a `norm_constraint` `c`.

        **Arguments:**

        - `updates`: a gradient-like tree (the parameters' structure).
        - `state`: the preconditioner's state.

        **Returns:**

        The preconditioned updates.
        """
        outcome = self._preconditioner.precondition(
            self.estimator, state.estimator_state, updates, None, self.get_identity_weight(state), 1.0,
            self._axis(),
        )
        return outcome.direction

    def multiply_curvature(self, updates: PyTree[Array], state: OptaxPreconditionState) -> PyTree[Array]:
        """`(C + (damping + l2_reg) I) updates` (the exact product of the estimate, as kfac-jax's).

        **Arguments:**

        - `updates`: a gradient-like tree.
        - `state`: the preconditioner's state.

        **Returns:**

        The product.
        """
        return self.estimator.multiply(state.estimator_state, updates, self.get_identity_weight(state))

    def as_gradient_transform(self, use_inverse: bool = True) -> optax.GradientTransformationExtraArgs:
        """An optax transformation that multiplies the updates by the inverse curvature (or the
        curvature): its `update` takes the preconditioner's state as `precond_state=`.

        **Arguments:**

        - `use_inverse`: `apply` (`True`) or `multiply_curvature` (`False`).

        **Returns:**

        The transformation (its own state `optax.EmptyState()`).
        """
        multiply = self.apply if use_inverse else self.multiply_curvature

        def update(
            updates: PyTree[Array], state: optax.EmptyState, params: PyTree = None, *,
            precond_state: OptaxPreconditionState, **extra_args: Any,
        ) -> tuple[PyTree[Array], optax.EmptyState]:
            del params, extra_args
            return multiply(updates, precond_state), state

        return optax.GradientTransformationExtraArgs(lambda params: optax.EmptyState(), update)

    def increment_count(self, state: OptaxPreconditionState) -> OptaxPreconditionState:
        """The state with its count one higher.

        **Arguments:**

        - `state`: the preconditioner's state.

        **Returns:**

        The state.
        """
        return OptaxPreconditionState(optax.safe_increment(state.count), state.estimator_state)
