"""Directions: the vector a step moves along, from the gradient and the curvature estimate."""

import abc

import equinox as eqx
import optax
from jaxtyping import Array, Float, PyTree

from .._curvature.estimators.distributed import distributed_multiply_matpower
from .quad_model import norm_constraint_scale
from .context import StepContext


class AbstractDirection(eqx.Module):
    """The step's direction from the gradient and the curvature (the extension point)."""

    @abc.abstractmethod
    def powers_to_cache(self) -> tuple[int | None, int | None]:
        """`(exact, approximate)` powers of the curvature the direction uses, cached by the
        refresh schedule (`None` for none)."""

    @abc.abstractmethod
    def __call__(
        self,
        context: StepContext,
        identity_weight: Float[Array, ""],
        learning_rate: Float[Array, ""] | None,
        use_cached: bool,
    ) -> tuple[PyTree[Array], dict[str, Array]]:
        """The direction and its statistics.

        **Arguments:**

        - `context`: the step (its estimator state refreshed).
        - `identity_weight`: `l2_reg + damping`.
        - `learning_rate`: the step rule's fixed learning rate, or `None` when it is adapted.
        - `use_cached`: whether the curvature's cached powers are fresh (the refresh schedule
          caches them), else they are computed from the statistics.

        **Returns:**

        `(direction, stats)`: a parameter-space vector and a dict of scalars for the step's
        statistics.
        """


class PreconditionedGradient(AbstractDirection):
    """`(C + (l2_reg + λ) I)⁻¹ g`, the K-FAC direction, optionally shortened by a norm constraint.

    **Fields:**

    - `exact_inverses`: invert Kronecker blocks exactly (eigendecompositions) instead of with
      pi-adjusted damping.
    - `norm_constraint`: `c` or `None`: scale the direction `u` by
      `min(1, sqrt(c / (lr² uᵀg)))` (needs a fixed learning rate).
    - `distributed`: under `multi_device`, each block's product is computed by one device and
      shared.
    """

    exact_inverses: bool = eqx.field(static=True, default=False)
    norm_constraint: float | None = eqx.field(static=True, default=None)
    distributed: bool = eqx.field(static=True, default=True)

    def powers_to_cache(self):
        return (-1, None) if self.exact_inverses else (None, -1)

    def __call__(self, context, identity_weight, learning_rate, use_cached):
        args = (
            context.estimator_state, context.grads, identity_weight, -1, self.exact_inverses, use_cached
        )
        if context.axis_name is not None and self.distributed:
            direction = distributed_multiply_matpower(
                context.estimator, *args, context.axis_name
            )
        else:
            direction = context.estimator.multiply_matpower(*args)
        if self.norm_constraint is None:
            return direction, {}
        scale, scaled_sq_norm = norm_constraint_scale(
            optax.tree.vdot(direction, context.grads), learning_rate, self.norm_constraint
        )
        return optax.tree.scale(scale, direction), {"scaled_grad_norm_sq": scaled_sq_norm}

