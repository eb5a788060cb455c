"""The refresh schedule: when the curvature statistics are updated and the cached inverses renewed."""

import abc
from collections.abc import Callable

import equinox as eqx
import jax
from jax.typing import ArrayLike
from jaxtyping import Array, Bool, Int, PRNGKeyArray

from .._core.control_flow import apply_if, periodic, select_changed
from .._curvature.estimators import EstimatorState


def burnin_keys(rng: PRNGKeyArray, num: int) -> Array:
    """The keys of the `num` burn-in updates, derived from the step's key by folding in (so the
    step itself sees the same key with or without burn-in)."""
    return jax.random.split(jax.random.fold_in(rng, 1), num)


# `update(state, ema_old, key, max_statistics_growth)`: one curvature update.
CurvatureUpdate = Callable[[EstimatorState, ArrayLike, PRNGKeyArray, ArrayLike | None], EstimatorState]


class AbstractRefreshSchedule(eqx.Module):
    """When the curvature statistics are updated and the cached inverses refreshed (the extension
    point). The step calls `update_curvature` and then `refresh_inverses`.

    **Fields:**

    - `num_burnin_steps`: curvature updates before the first step (summed statistics).
    """

    @property
    @abc.abstractmethod
    def use_cached(self) -> bool:
        """Whether the direction uses cached inverses (refreshed by `refresh_inverses`)."""

    num_burnin_steps: eqx.AbstractVar[int]

    @abc.abstractmethod
    def update_curvature(
        self,
        estimator_state: EstimatorState,
        step: Int[Array, ""],
        finite: Bool[Array, ""] | None,
        step_key: PRNGKeyArray,
        burnin_in_graph: bool,
        update: CurvatureUpdate,
    ) -> EstimatorState:
        """This step's curvature updates (see `RefreshSchedule.update_curvature`)."""

    @abc.abstractmethod
    def refresh_inverses(
        self,
        estimator_state: EstimatorState,
        step: Int[Array, ""],
        finite: Bool[Array, ""] | None,
        refresh: Callable[[EstimatorState], EstimatorState],
    ) -> EstimatorState:
        """This step's refresh of the cached inverses (see `RefreshSchedule.refresh_inverses`)."""


class RefreshSchedule(AbstractRefreshSchedule):
    """When the curvature statistics are updated and the cached inverses refreshed (final).

    **Fields:**

    - `num_burnin_steps`: curvature updates before the first step, their statistics summed
      (`ema_old = ema_new = 1`).
    - `curvature_update_period`: steps between curvature updates (moving averages with decay
      `curvature_ema`).
    - `inverse_update_period`: steps between refreshes of the cached inverses; `1` caches
      nothing and computes the inverses in every step.
    - `curvature_ema`: the decay of the moving averages (a number, or an array such as an
      injected hyperparameter).
    - `max_statistics_growth`: a periodic update whose batch makes the statistics (all blocks
      together) grow in norm by more than this factor is dropped (an outlier batch, e.g. inputs
      1e10 times their usual size, whose statistics would otherwise dominate the moving averages
      for hundreds of steps); `None` folds in every finite batch. A number or an array, like
      `curvature_ema`.
    - `cache_inverses`: whether the inverses are cached between refreshes. `None` caches them
      unless `inverse_update_period=1`. `True` with a period of 1 computes them at every step as
      a refresh of the cache: the same values, but an inversion that fails keeps the previous
      inverse (as every refresh does) instead of falling back to an eigendecomposition, whose
      code the step then does not compile (the kfac-jax drop-in's choice: FermiNet's first step
      587 kernels to 469). `False` with a period above 1 raises.
    """

    num_burnin_steps: int = eqx.field(static=True, default=10)
    curvature_update_period: int = eqx.field(static=True, default=1)
    inverse_update_period: int = eqx.field(static=True, default=5)
    curvature_ema: float | Array = 0.95
    max_statistics_growth: float | Array | None = 1e3
    cache_inverses: bool | None = eqx.field(static=True, default=None)

    def __check_init__(self):
        problems = []
        if self.cache_inverses is False and self.inverse_update_period != 1:
            problems.append(
                f"cache_inverses=False needs inverse_update_period=1 (inverses computed at every "
                f"step), got {self.inverse_update_period}"
            )
        for name, minimum in (
            ("num_burnin_steps", 0), ("curvature_update_period", 1), ("inverse_update_period", 1)
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                problems.append(f"{name} must be an integer >= {minimum}, got {value!r}")
        if not problems and self.curvature_update_period > self.inverse_update_period:
            problems.append(
                f"curvature_update_period ({self.curvature_update_period}) is larger than "
                f"inverse_update_period ({self.inverse_update_period}): the same inverse would be "
                "recomputed; make inverse_update_period at least curvature_update_period"
            )
        if isinstance(self.curvature_ema, (int, float)) and not 0.0 <= self.curvature_ema <= 1.0:
            problems.append(f"curvature_ema must be in [0, 1], got {self.curvature_ema}")
        growth = self.max_statistics_growth
        if isinstance(growth, (int, float)) and not growth > 1.0:
            problems.append(f"max_statistics_growth must be None or > 1, got {growth}")
        if problems:
            raise ValueError("RefreshSchedule: " + "; ".join(problems) + ".")

    @property
    def use_cached(self) -> bool:
        """Whether inverses are cached (refreshed every `inverse_update_period` steps)."""
        return self.inverse_update_period != 1 if self.cache_inverses is None else self.cache_inverses

    def update_curvature(
        self,
        estimator_state: EstimatorState,
        step: Int[Array, ""],
        finite: Bool[Array, ""] | None,
        step_key: PRNGKeyArray,
        burnin_in_graph: bool,
        update: CurvatureUpdate,
    ) -> EstimatorState:
        """This step's curvature updates: the burn-in at step 0 (with `burnin_in_graph`), then the
        periodic update. A step that is not finite takes none of them (and its burn-in is
        repeated at the next step 0).

        The periodic update runs outside any loop when its period is 1: XLA on CPU gives a
        convolution inside a loop (or a conditional) its slow generic code, and the update runs
        the model's convolutions forward and backward (measured on the zoo's ResNet: the step
        took 6.9x Adam's time with the update in a loop, 2.4x without; a bare conv stack's
        gradient, 45x, `benchmarks/conv_in_loop.py`). For the same reason a directly called
        `Optimizer.step` runs the burn-in before the step, and `burnin_in_graph` is true only
        for a step given `batch=` inside a user's trace.

        **Arguments:**

        - `estimator_state`: the estimator's state.
        - `step`: the step counter.
        - `finite`: whether the step's loss and gradient are finite (`None`: not checked).
        - `step_key`: the step's PRNG key (the periodic update's; burn-in keys derive from it).
        - `burnin_in_graph`: whether the burn-in runs inside the step (a step inside a user's
          trace, with `batch=`).
        - `update`: `update(estimator_state, ema_old, key, max_statistics_growth)`, one curvature
          update (the burn-in's take every finite batch).

        **Returns:**

        The updated estimator state.
        """
        if burnin_in_graph and self.num_burnin_steps:
            keys = burnin_keys(step_key, self.num_burnin_steps)

            def burnin(state):
                return jax.lax.fori_loop(
                    0, self.num_burnin_steps, lambda i, s: update(s, 1.0, keys[i], None), state
                )

            first = step == 0 if finite is None else (step == 0) & finite
            with jax.named_scope("eqx_kfac.burn_in"):
                estimator_state = apply_if(first, burnin, estimator_state)

        @jax.named_scope("eqx_kfac.curvature_update")
        def periodic_update(state):
            return update(state, self.curvature_ema, step_key, self.max_statistics_growth)

        if self.curvature_update_period == 1:
            return select_changed(finite, periodic_update(estimator_state), estimator_state)
        return periodic(
            self.curvature_update_period, step, periodic_update, estimator_state, gate=finite
        )

    def refresh_inverses(
        self,
        estimator_state: EstimatorState,
        step: Int[Array, ""],
        finite: Bool[Array, ""] | None,
        refresh: Callable[[EstimatorState], EstimatorState],
    ) -> EstimatorState:
        """The cache refresh on its period, skipped on a step that is not finite, computed in
        place of the cache (see `periodic`). With `inverse_update_period=1` nothing is cached
        (unless `cache_inverses`), and `refresh` (which then caches no power) runs at every
        step: a block with a basis of its own (EK-FAC's eigenbasis) recomputes it from the
        current statistics.

        **Arguments:**

        - `estimator_state`: the estimator's state.
        - `step`: the step counter.
        - `finite`: whether the step's loss and gradient are finite (`None`: not checked).
        - `refresh`: the refresh of the cached inverses.

        **Returns:**

        The estimator state.
        """
        return periodic(self.inverse_update_period, step, refresh, estimator_state, gate=finite)
