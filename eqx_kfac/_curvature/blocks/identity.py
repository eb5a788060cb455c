"""`ScaledIdentity`: the curvature of a layer approximated by a fixed multiple of the identity."""

from typing import ClassVar

import equinox as eqx
import jax.numpy as jnp
from jax.typing import ArrayLike
from jaxtyping import Array

from ..operators.block_operators import ScaledIdentityCurvatureOperator
from ..._tracing.layer_data import EstimationData, LayerSpec
from .base import CurvatureBlock


class ScaledIdentityState(eqx.Module):
    """The state of a `ScaledIdentity` block: it has none (no statistics, no cache)."""


class ScaledIdentity(CurvatureBlock):
    """Approximates the curvature by `scale * I` (final).

    No statistics are collected, so it fits every tag; `(scale I + λ I)^p v = (scale + λ)^p v`.
    Cost: `O(dim)` per product, no memory. Useful for parameters whose curvature is not worth
    estimating, or as plain (damped) gradient descent on part of a model.

    **Fields:**

    - `spec`: the layer's `LayerSpec` (static).
    - `scale`: the multiple of the identity (static, default `1.0`).
    """

    spec: LayerSpec = eqx.field(static=True)
    scale: float = eqx.field(static=True, default=1.0)
    supported_tags: ClassVar[frozenset[str] | None] = None

    def slice_init(self, exact_powers, approx_powers, cache_eigenvalues) -> ScaledIdentityState:
        del exact_powers, approx_powers, cache_eigenvalues
        return ScaledIdentityState()

    def slice_update_statistics(
        self,
        state: ScaledIdentityState,
        data: EstimationData,
        ema_old: ArrayLike,
        ema_new: ArrayLike,
        batch_size: ArrayLike,
    ) -> ScaledIdentityState:
        del data, ema_old, ema_new, batch_size
        return state

    def slice_eigenvalues(self, state: ScaledIdentityState, use_cached: bool) -> Array:
        del state, use_cached
        return jnp.full((self.slice_dim,), self.scale, self.dtype)

    def slice_to_dense_matrix(self, state: ScaledIdentityState) -> Array:
        del state
        return self.scale * jnp.eye(self.slice_dim, dtype=self.dtype)

    def slice_operator(
        self, state: ScaledIdentityState, identity_weight: ArrayLike
    ) -> ScaledIdentityCurvatureOperator:
        del state
        return ScaledIdentityCurvatureOperator(
            jnp.asarray(self.scale, self.dtype), identity_weight, self.spec.param_shapes
        )
