"""Optimizers for physics-informed networks, as optax transformations.

- `engd`: energy natural gradient descent (Müller and Zeinhofer 2023), the dense Gauss-Newton
  direction `(G + λI)⁻¹ ∇L` of `DenseGaussNewton`, scaled by the grid line search.
- `pinn_kfac`: K-FAC for PINNs (Dangel, Müller and Zeinhofer 2024), the same with the
  Kronecker-factored `G` of `kfac_preconditioner` and `TaylorDenseKroneckerSum` blocks.

Both are `damped_linesearch`: the grid line search, and a damping `λ` that adapts to its
outcome, so `update` needs the loss `value` and `value_fn` besides the batch. The library's
`Optimizer` with `use_adaptive_learning_rate=True` and `use_adaptive_momentum=True` on the same
blocks is the paper's "KFAC*".
"""

from collections.abc import Callable, Sequence
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import lineax as lx
import optax
from jax.typing import ArrayLike
from jaxtyping import Array, Float, Int, PyTree

from .._curvature.blocks import CurvatureBlock
from .._curvature.estimators import EstimatorState
from .._curvature.estimators.base import batch_size_of
from .._optim.optax_transforms import kfac_preconditioner
from .._tracing.layer_data import LayerSpec
from .gauss_newton import DenseGaussNewton
from .damping import damped_linesearch
from .kronecker_sum import TaylorDenseKroneckerSum
from .tags import TAG_NAME


class DenseGaussNewtonState(eqx.Module):
    """The optax state of `engd_preconditioner` (final).

    **Fields:**

    - `count`: the number of updates so far.
    - `estimator_state`: the `DenseGaussNewton` estimator's state (the Gramian's moving average).
    """

    count: Int[Array, ""]
    estimator_state: EstimatorState


def engd_preconditioner(
    loss_fn: Callable[..., Any],
    example_args: Sequence[Any],
    *,
    damping: float | ArrayLike,
    curvature_ema: float | ArrayLike = 0.0,
    estimation_mode: str = "ggn_exact",
    solver: lx.AbstractLinearSolver | None = None,
) -> optax.GradientTransformationExtraArgs:
    """The dense Gauss-Newton preconditioner of ENGD: `g ↦ (G + damping·I)⁻¹ g`.

    `G` is `DenseGaussNewton`'s Gramian of this step's batch (or its moving average with
    `curvature_ema > 0`), over all parameters: `O(dim²)` memory and `O(dim³)` per step.

    **Arguments:**

    - `loss_fn`: `loss_fn(model, batch)`, evaluating the network with `taylor_forward` and
      registering its losses (`register_residual_loss`).
    - `example_args`: `(model, batch)` with the shapes of every later call.
    - `damping`: `λ`, added to the Gramian.
    - `curvature_ema`: the decay of the Gramian's moving average (`0`: this batch's only).
    - `estimation_mode`: `"ggn_exact"` (default) or another estimation mode.
    - `solver`: the lineax solver of the damped system (see `DenseGaussNewton`).

    **Returns:**

    An `optax.GradientTransformationExtraArgs` whose `update(grads, state, params, *, batch)`
    returns the preconditioned gradient (a descent direction, before any step size). Its state
    is a `DenseGaussNewtonState`.
    """
    example_args = tuple(example_args)
    estimator = DenseGaussNewton(
        loss_fn, example_args, default_estimation_mode=estimation_mode, solver=solver
    )
    static_model = eqx.filter(example_args[0], eqx.is_inexact_array, inverse=True)

    def init_fn(params: PyTree) -> DenseGaussNewtonState:
        del params
        return DenseGaussNewtonState(jnp.zeros((), jnp.int32), estimator.init())

    def update_fn(updates, state, params=None, *, batch=None, **extra_args):
        del extra_args
        if params is None or batch is None:
            raise ValueError(
                "engd_preconditioner: update needs the current parameters and this step's batch: "
                "call `update(grads, state, params, batch=...)`."
            )
        args = (eqx.combine(eqx.filter(params, eqx.is_inexact_array), static_model), batch)
        estimator_state = estimator.update_curvature_matrix_estimate(
            state.estimator_state, curvature_ema, 1.0, batch_size_of(loss_fn, args),
            jax.random.key(0), args,
        )
        grads = eqx.filter(updates, eqx.is_inexact_array)
        direction = estimator.multiply_inverse(estimator_state, grads, damping, exact_power=True)
        direction = jax.tree.map(lambda d, g: d.astype(g.dtype), direction, grads)
        return direction, DenseGaussNewtonState(optax.safe_increment(state.count), estimator_state)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


# The defaults of `engd` and `pinn_kfac` (docs/pinn.md, "Damping", recommends and measures them).
INITIAL_DAMPING = 1.0
DAMPING_FACTOR = 10.0
MIN_DAMPING = 1e-10
MAX_DAMPING = 1e6


def engd(
    loss_fn: Callable[..., Any],
    example_args: Sequence[Any],
    *,
    damping: float = INITIAL_DAMPING,
    damping_factor: float = DAMPING_FACTOR,
    min_damping: float = MIN_DAMPING,
    max_damping: float = MAX_DAMPING,
    curvature_ema: float | ArrayLike = 0.0,
    momentum: float = 0.0,
    grid: Float[ArrayLike, " n"] | None = None,
    solver: lx.AbstractLinearSolver | None = None,
) -> optax.GradientTransformationExtraArgs:
    """Energy natural gradient descent: the dense Gauss-Newton direction, the grid line search,
    and a damping that adapts.

    `damped_linesearch` over `engd_preconditioner`: the direction `-(G + λI)⁻¹ ∇L`, scaled by
    the grid step with the lowest loss, and `λ` lowered by `damping_factor` after a step of `1/2`
    or more, raised by it after a step below `2^-10` or none (`adapted_damping`). For small
    networks (`O(dim³)` per step).

    ```python
    optimizer = eqx_kfac.engd(loss, (model, batch))
    params = eqx.filter(model, eqx.is_inexact_array)
    opt_state = optimizer.init(params)
    value, grads = eqx.filter_value_and_grad(loss)(model, batch)
    value_fn = lambda p: loss(eqx.combine(p, model), batch)
    updates, opt_state = optimizer.update(
        grads, opt_state, params, batch=batch, value=value, value_fn=value_fn
    )
    model = eqx.apply_updates(model, updates)
    ```

    **Arguments:**

    - `loss_fn`, `example_args`, `curvature_ema`, `solver`: as for `engd_preconditioner`.
    - `damping`: the first step's damping `λ`.
    - `damping_factor`: the factor of one change of `λ` (`1`: a fixed damping).
    - `min_damping`, `max_damping`: the bounds of `λ`.
    - `momentum`, `grid`: as for `scale_by_grid_linesearch`.

    **Returns:**

    An `optax.GradientTransformationExtraArgs`; `update` takes `batch=`, `value=` and
    `value_fn=`. Its state is a `DampedLineSearchState`.
    """
    return damped_linesearch(
        lambda d: engd_preconditioner(
            loss_fn, example_args, damping=d, curvature_ema=curvature_ema, solver=solver
        ),
        damping=damping, damping_factor=damping_factor, min_damping=min_damping,
        max_damping=max_damping, grid=grid, momentum=momentum,
    )


def pinn_kfac(
    loss_fn: Callable[..., Any],
    example_args: Sequence[Any],
    *,
    damping: float = INITIAL_DAMPING,
    damping_factor: float = DAMPING_FACTOR,
    min_damping: float = MIN_DAMPING,
    max_damping: float = MAX_DAMPING,
    curvature_ema: float | ArrayLike = 0.0,
    momentum: float = 0.0,
    grid: Float[ArrayLike, " n"] | None = None,
    block: Callable[[LayerSpec], CurvatureBlock] = TaylorDenseKroneckerSum,
    inverse_update_period: int = 1,
    **preconditioner_kwargs: Any,
) -> optax.GradientTransformationExtraArgs:
    """K-FAC for PINNs: the Kronecker-factored Gauss-Newton direction, the grid line search, and
    a damping that adapts.

    `damped_linesearch` over `kfac_preconditioner(..., estimation_mode="ggn_exact",
    layer_tag_to_block_ctor={"taylor_dense": block})`: the "KFAC" optimizer of Dangel, Müller and
    Zeinhofer (2024), with one Kronecker product per point set (`TaylorDenseKroneckerSum`,
    expand) refreshed at every step, and the damping of `engd`. `update` takes the same
    arguments as `engd`'s.

    **Arguments:**

    - `loss_fn`, `example_args`: as for `kfac_preconditioner` (`loss_fn(model, batch)`
      evaluates the network with `taylor_forward`).
    - `damping`, `damping_factor`, `min_damping`, `max_damping`: as for `engd` (see
      `TaylorDenseKroneckerSum` for how `λ` is split over the factors).
    - `curvature_ema`: the decay of the Kronecker factors' moving averages (`0`: this step's
      factors, right for fixed collocation points).
    - `momentum`, `grid`: as for `scale_by_grid_linesearch`.
    - `block`: the block of the `taylor_dense` layers, e.g.
      `functools.partial(eqx_kfac.TaylorDenseKroneckerSum, approximation="reduce")` or
      `eqx_kfac.TaylorDenseTwoKroneckerFactored`.
    - `inverse_update_period`: refresh the inverses every `k`-th step (`1`: every step; cached
      inverses keep the damping of the step that refreshed them).
    - `**preconditioner_kwargs`: other keywords of `kfac_preconditioner`.

    **Returns:**

    An `optax.GradientTransformationExtraArgs`; `update` takes `batch=`, `value=` and
    `value_fn=` (and `key=` for a sampled estimation mode). Its state is a
    `DampedLineSearchState`.
    """
    ctors = {TAG_NAME: block, **preconditioner_kwargs.pop("layer_tag_to_block_ctor", {})}
    preconditioner_kwargs.setdefault("estimation_mode", "ggn_exact")
    return damped_linesearch(
        lambda d: kfac_preconditioner(
            loss_fn, example_args, damping=d, curvature_ema=curvature_ema,
            inverse_update_period=inverse_update_period, layer_tag_to_block_ctor=ctors,
            **preconditioner_kwargs,
        ),
        damping=damping, damping_factor=damping_factor, min_damping=min_damping,
        max_damping=max_damping, grid=grid, momentum=momentum,
    )
