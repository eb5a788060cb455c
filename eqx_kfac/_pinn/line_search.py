"""`scale_by_grid_linesearch`: the logarithmic grid line search of ENGD and K-FAC for PINNs.

Müller and Zeinhofer (2023) and Dangel, Müller and Zeinhofer (2024) scale each natural-gradient
direction by the step size of a fixed logarithmic grid (`2^-30, ..., 2^0`) that gives the lowest
loss, and skip the step when none lowers it.
"""

from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
from jaxtyping import Array, ArrayLike, Bool, Float, Int, PyTree


class GridLineSearchState(eqx.Module):
    """The optax state of `scale_by_grid_linesearch` (final).

    **Fields:**

    - `previous_step`: the last update returned (zeros at first), for the momentum.
    - `learning_rate`: the step size chosen last (`0` when the step was skipped).
    - `decreased`: whether a step of the grid lowered the loss at the last update (when not, the
      step was skipped: the direction was unusable, e.g. too long for the smallest step to
      help, or not finite).
    - `num_skipped`: the number of updates so far whose step was skipped.
    """

    previous_step: PyTree[Array]
    learning_rate: Float[Array, ""]
    decreased: Bool[Array, ""]
    num_skipped: Int[Array, ""]


def default_grid() -> Float[Array, " 31"]:
    """The grid of Müller and Zeinhofer (2023): `2^-30, 2^-29, ..., 2^0`."""
    return 2.0 ** jnp.arange(-30.0, 1.0)


def scale_by_grid_linesearch(
    grid: Float[ArrayLike, " n"] | None = None, momentum: float = 0.0
) -> optax.GradientTransformationExtraArgs:
    """Scales a descent direction by the grid step size with the lowest loss.

    With `d = u + momentum · δ_prev` (`u` the incoming update, a descent direction; `δ_prev` the
    previous step), the step is `α* d` with `α*` the entry of `grid` minimising `value_fn(params
    + α d)`, or `0` when no entry lowers the loss below `value` (the step is skipped, as it is when
    the direction is not finite; the state's `decreased` and `num_skipped` report it). This is the
    update rule of the ENGD and K-FAC optimizers of Dangel, Müller and Zeinhofer (2024), momentum
    included.

    **Arguments:**

    - `grid`: the candidate step sizes (default `default_grid()`: `2^-30, ..., 2^0`).
    - `momentum`: the weight of the previous step in the direction.

    **Returns:**

    An `optax.GradientTransformationExtraArgs` whose `update(updates, state, params, *, value,
    value_fn)` needs the loss `value` at `params` and `value_fn(params) -> loss` (the loss on
    this step's batch). Its state is a `GridLineSearchState`.
    """
    steps = default_grid() if grid is None else jnp.asarray(grid)
    if steps.ndim != 1 or steps.shape[0] == 0:
        raise ValueError(f"scale_by_grid_linesearch: grid must be a non-empty 1-D array, got shape {steps.shape}.")

    def init_fn(params: PyTree) -> GridLineSearchState:
        zeros = jax.tree.map(jnp.zeros_like, eqx.filter(params, eqx.is_inexact_array))
        return GridLineSearchState(
            zeros, jnp.zeros((), steps.dtype), jnp.ones((), bool), jnp.zeros((), jnp.int32)
        )

    def update_fn(
        updates: PyTree, state: GridLineSearchState, params: PyTree = None, *,
        value: ArrayLike | None = None, value_fn: Any = None, **extra_args: Any,
    ) -> tuple[PyTree, GridLineSearchState]:
        del extra_args
        if params is None or value is None or value_fn is None:
            raise ValueError(
                "scale_by_grid_linesearch: update needs the parameters, the loss `value` at them "
                "and `value_fn` (params -> loss on this batch): call "
                "`update(updates, state, params, value=loss, value_fn=...)`."
            )
        direction = jax.tree.map(lambda u, p: u + momentum * p, updates, state.previous_step)

        def loss_at(alpha):
            return value_fn(jax.tree.map(lambda p, d: p + alpha * d, params, direction))

        # One candidate after the other: `vmap` would turn the network's matrix products into
        # batched ones, which XLA runs several times slower on CPU (measured 4x, 31 candidates).
        losses = jax.lax.map(loss_at, steps)
        losses = jnp.where(jnp.isfinite(losses), losses, jnp.inf)
        best = jnp.argmin(losses)
        decreased = losses[best] < value
        alpha = jnp.where(decreased, steps[best], 0.0)
        step = jax.tree.map(lambda d: jnp.where(decreased, alpha * d, 0.0).astype(d.dtype), direction)
        num_skipped = state.num_skipped + jnp.where(decreased, 0, 1).astype(jnp.int32)
        return step, GridLineSearchState(step, alpha, decreased, num_skipped)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)
