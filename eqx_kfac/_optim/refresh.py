"""The refresh schedule: when the curvature statistics are updated and the cached inverses renewed."""

from collections.abc import Callable

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Int, PRNGKeyArray

from .._control_flow import periodic
from .._estimators import EstimatorState


def burnin_keys(rng: PRNGKeyArray, num: int) -> Array:
    """The keys of the `num` burn-in updates, derived from the step's key by folding in (so the
    step itself sees the same key with or without burn-in)."""
    return jax.random.split(jax.random.fold_in(rng, 1), num)


class RefreshSchedule(eqx.Module):
    """When the curvature statistics are updated and the cached inverses refreshed.

    **Fields:**

    - `num_burnin_steps`: curvature updates before the first step, their statistics summed
      (`ema_old = ema_new = 1`).
    - `curvature_update_period`: steps between curvature updates (moving averages with decay
      `curvature_ema`).
    - `inverse_update_period`: steps between refreshes of the cached inverses; `1` caches
      nothing and computes the inverses in every step.
    - `curvature_ema`: the decay of the moving averages.
    """

    num_burnin_steps: int = eqx.field(static=True, default=10)
    curvature_update_period: int = eqx.field(static=True, default=1)
    inverse_update_period: int = eqx.field(static=True, default=5)
    curvature_ema: float = eqx.field(static=True, default=0.95)

    @property
    def use_cached(self) -> bool:
        """Whether inverses are cached (refreshed every `inverse_update_period` steps)."""
        return self.inverse_update_period != 1

    def update_curvature(
        self,
        estimator_state: EstimatorState,
        step: Int[Array, ""],
        finite: Bool[Array, ""] | None,
        step_key: PRNGKeyArray,
        burnin_in_graph: bool,
        update: Callable[[EstimatorState, Array, PRNGKeyArray], EstimatorState],
    ) -> EstimatorState:
        """This step's curvature updates: the burn-in at step 0 (with `burnin_in_graph`) and the
        periodic update, as trips of one loop so that `update` is compiled once. A step that is
        not finite takes none of them (and its burn-in is repeated at the next step 0).

        **Arguments:**

        - `estimator_state`: the estimator's state.
        - `step`: the step counter.
        - `finite`: whether the step's loss and gradient are finite (`None`: not checked).
        - `step_key`: the step's PRNG key (the periodic update's; burn-in keys derive from it).
        - `burnin_in_graph`: whether the burn-in runs inside the step (no data iterator).
        - `update`: `update(estimator_state, ema_old, key)`, one curvature update.

        **Returns:**

        The updated estimator state.
        """
        burnin = self.num_burnin_steps if burnin_in_graph else 0
        keys = step_key[None]
        if burnin:
            keys = jnp.concatenate([burnin_keys(step_key, burnin), keys])
        trips = (step % self.curvature_update_period == 0).astype(int)
        if burnin:
            trips = trips + jnp.where(step == 0, burnin, 0)
        if finite is not None:
            trips = jnp.where(finite, trips, 0)

        def trip(i, state):
            burning = i < jnp.where(step == 0, burnin, 0)
            ema_old = jnp.where(burning, 1.0, self.curvature_ema)
            return update(state, ema_old, keys[jnp.where(burning, i, burnin)])

        return jax.lax.fori_loop(0, trips, trip, estimator_state)

    def refresh_inverses(
        self,
        estimator_state: EstimatorState,
        step: Int[Array, ""],
        finite: Bool[Array, ""] | None,
        refresh: Callable[[EstimatorState], EstimatorState],
    ) -> EstimatorState:
        """The cache refresh on its period (none when nothing is cached), skipped on a step that
        is not finite, computed in place of the cache (see `periodic`).

        **Arguments:**

        - `estimator_state`: the estimator's state.
        - `step`: the step counter.
        - `finite`: whether the step's loss and gradient are finite (`None`: not checked).
        - `refresh`: the refresh of the cached inverses.

        **Returns:**

        The estimator state.
        """
        if not self.use_cached:
            return estimator_state
        return periodic(self.inverse_update_period, step, refresh, estimator_state, gate=finite)
