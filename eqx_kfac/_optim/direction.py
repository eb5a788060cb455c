"""Directions: the vector a step moves along, from the gradient, the curvature estimate and the
direction's own state (e.g. moving averages of the gradient)."""

import abc

import equinox as eqx
import jax.numpy as jnp
import optax
from jax.typing import ArrayLike
from jaxtyping import Array, Float, PyTree

from .._core.tree import scale_keeping_dtypes
from .._curvature.estimators import BlockDiagonalCurvature, EstimatorState
from .._curvature.estimators.distributed import distributed_multiply_matpower


class DirectionOutcome(eqx.Module):
    """A direction, the direction's next state, and what it reports (final).

    **Fields:**

    - `direction`: a parameter-space vector.
    - `state`: the direction's state for the next step (what its `init` made, updated; `None`
      for a direction without state).
    - `stats`: scalars for the step's statistics (e.g. `scaled_grad_norm_sq`).
    """

    direction: PyTree[Array]
    state: PyTree[Array]
    stats: dict[str, Array] = eqx.field(default_factory=dict)


class AbstractDirection(eqx.Module):
    """The step's direction from the gradient, the curvature and the direction's state (the
    extension point).

    `init` makes the direction's state (kept in `Optimizer.State.direction_state`, or in
    `KFACPreconditionerState.direction_state` on the optax path), `__call__` returns the
    direction and the next state. Where the step's update is not applied (skipped or rejected),
    the state is kept as it was, like the step rule's.
    """

    @abc.abstractmethod
    def init(self, estimator: BlockDiagonalCurvature, params: PyTree[Array]) -> PyTree[Array]:
        """The direction's state before the first step.

        **Arguments:**

        - `estimator`: the curvature estimator (its blocks say how the parameters are grouped).
        - `params`: the parameters (`eqx.filter(params, eqx.is_inexact_array)`).

        **Returns:**

        A PyTree of arrays, or `None` for a direction without state.
        """

    @abc.abstractmethod
    def powers_to_cache(self) -> tuple[int | None, int | None]:
        """`(exact, approximate)` powers of the curvature the direction uses, cached by the
        refresh schedule (`None` for none)."""

    @abc.abstractmethod
    def __call__(
        self,
        estimator: BlockDiagonalCurvature,
        estimator_state: EstimatorState,
        grads: PyTree[Array],
        state: PyTree[Array],
        identity_weight: Float[Array, ""],
        learning_rate: Float[Array, ""] | None,
        use_cached: bool,
        axis_name: str | None = None,
    ) -> DirectionOutcome:
        """The direction, the next state and the statistics.

        **Arguments:**

        - `estimator`, `estimator_state`: the curvature estimate (its state refreshed).
        - `grads`: the gradient.
        - `state`: the direction's state from the previous step (`init`'s at the first).
        - `identity_weight`: `l2_reg + damping`.
        - `learning_rate`: the step's learning rate when it is fixed, `None` when it is adapted.
        - `use_cached`: whether the curvature's cached powers are fresh (the refresh schedule
          caches them), else they are computed from the statistics.
        - `axis_name`: the data axis inside a multi-device step (`None` on one device).

        **Returns:**

        A `DirectionOutcome`.
        """


def norm_constraint_scale(
    precon_grad_dot_grad: ArrayLike, learning_rate: ArrayLike, norm_constraint: ArrayLike
) -> tuple[Float[Array, ""], Float[Array, ""]]:
    """The factor that scales the preconditioned gradient so that its step obeys the norm constraint.

    The step `-lr·P g` has approximate squared curvature norm `lr² gᵀ P g` (with `P ≈ C⁻¹`); the
    preconditioned gradient is scaled by `min(1, sqrt(norm_constraint / (lr² gᵀ P g)))`.

    **Arguments:**

    - `precon_grad_dot_grad`: `gᵀ P g`.
    - `learning_rate`: the learning rate.
    - `norm_constraint`: the bound on the squared norm.

    **Returns:**

    `(scale, lr² gᵀ P g)`.
    """
    scaled_sq_norm = precon_grad_dot_grad * jnp.asarray(learning_rate) ** 2
    return jnp.minimum(jnp.sqrt(norm_constraint / scaled_sq_norm), 1.0), scaled_sq_norm


class PreconditionedGradient(AbstractDirection):
    """`(C + (l2_reg + λ) I)⁻¹ g`, the K-FAC direction, optionally shortened by a norm constraint
    (final; no state: its `init` returns `None`).

    **Fields:**

    - `exact_inverses`: invert Kronecker blocks exactly (eigendecompositions) instead of with
      pi-adjusted damping.
    - `norm_constraint`: `c` or `None`: scale the direction `u` by
      `min(1, sqrt(c / (lr² uᵀg)))` (needs a fixed learning rate; a number, or an array such as an
      injected hyperparameter).
    - `distributed`: under `multi_device`, each block's product is computed by one device and
      shared.
    """

    exact_inverses: bool = eqx.field(static=True, default=False)
    norm_constraint: float | Array | None = None
    distributed: bool = eqx.field(static=True, default=True)

    def __check_init__(self):
        c = self.norm_constraint
        if isinstance(c, (int, float)) and not c > 0:
            raise ValueError(f"PreconditionedGradient: norm_constraint must be > 0, got {c}.")

    def init(self, estimator, params):
        return None

    def powers_to_cache(self):
        return (-1, None) if self.exact_inverses else (None, -1)

    def __call__(
        self, estimator, estimator_state, grads, state, identity_weight, learning_rate, use_cached,
        axis_name=None,
    ):
        args = (estimator_state, grads, identity_weight, -1, self.exact_inverses, use_cached)
        if axis_name is not None and self.distributed:
            direction = distributed_multiply_matpower(estimator, *args, axis_name)
        else:
            direction = estimator.multiply_matpower(*args)
        if self.norm_constraint is None:
            return DirectionOutcome(direction, state)
        if learning_rate is None:
            raise ValueError(
                "PreconditionedGradient(norm_constraint=...) needs a fixed or scheduled learning "
                "rate (the adaptive learning rate already chooses the step length)."
            )
        scale, scaled_sq_norm = norm_constraint_scale(
            optax.tree.vdot(direction, grads), learning_rate, self.norm_constraint
        )
        return DirectionOutcome(
            scale_keeping_dtypes(direction, scale), state, {"scaled_grad_norm_sq": scaled_sq_norm}
        )
