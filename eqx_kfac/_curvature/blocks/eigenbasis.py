"""Eigenvalue-corrected K-FAC (EK-FAC, George et al. 2018): K-FAC's eigenbasis, a refitted diagonal.

K-FAC approximates a layer's curvature `C` by `A ⊗ G = (Q_A ⊗ Q_G) diag(s_A ⊗ s_G) (Q_A ⊗ Q_G)ᵀ`.
EK-FAC keeps the Kronecker eigenbasis `Q = Q_A ⊗ Q_G` but replaces the eigenvalues `s_A ⊗ s_G` by
the second moments of the per-example gradients projected into that basis,
`s*_k = Σ_n (Qᵀ vec g_n)_k² / B`. Of all matrices `Q diag(s) Qᵀ`, this is the one closest to the
per-example curvature `C = Σ_n vec g_n vec g_nᵀ / B` in Frobenius norm (`s* = diag(Qᵀ C Q)`), so it
is never further from `C` than K-FAC is.
"""

import abc
import functools as ft
from typing import ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike
from jaxtyping import Array

from ..operators.block_operators import EigenbasisCurvatureOperator
from ..._tracing.layer_data import EstimationData, LayerSpec
from ..operators.kronecker_powers import kronecker_eigh
from ..operators.structured import KroneckerOperator
from ._layer_stats import dense_gradient_samples, dense_layout
from .base import CurvatureBlock
from .statistics import WeightedMovingAverage
from .conv_statistics import conv_gradient_samples
from .kronecker import (
    Conv2DTwoKroneckerFactored,
    DenseTwoKroneckerFactored,
    KroneckerFactored,
    KroneckerLayout,
)


class EigenbasisState(eqx.Module):
    """The state of an EK-FAC block.

    **Fields:**

    - `factors`: moving averages of the Kronecker factors `(n_i, n_i)` (as for K-FAC).
    - `eigenvectors`: the eigenbasis `Q_i` of each factor, from the last `update_cache` (the
      identity before the first one).
    - `scaling`: moving average of the projected per-example second moments, an array shaped
      like the canonical parameter array `(n_1, ..., n_k)`: the eigenvalues of the estimate.
    """

    factors: tuple[WeightedMovingAverage, ...]
    eigenvectors: tuple[Array, ...]
    scaling: WeightedMovingAverage


class AbstractEigenbasisKFAC(CurvatureBlock):
    """EK-FAC: a Kronecker eigenbasis with a diagonal scaling refitted in it (abstract family).

    The estimate is `C ≈ Q diag(s) Qᵀ` with `Q = Q_1 ⊗ ... ⊗ Q_k` the eigenvectors of the
    Kronecker factors of a K-FAC block of the same layer (`kronecker`), acting on that block's
    canonical parameter array, and `s` the moving average of the squared per-example gradients
    projected into `Q`.

    - `update_curvature_matrix_estimate` updates the Kronecker factors (as K-FAC does) and the
      scaling, projecting this batch's per-example gradients into the *current* eigenbasis.
    - `update_cache` always refreshes the eigenbasis from the current factors (it is part of the
      estimate, not only a cache, so it needs no `init` arguments). The scaling, which was
      estimated in the old basis, restarts from K-FAC's eigenvalues `s_A ⊗ s_G` in the new basis
      and keeps its moving-average weight: later batches move it towards the projected second
      moments at the curvature moving-average rate.
    - Before the first `update_cache` the basis is the identity, so the estimate is the diagonal
      of the per-example curvature (in the canonical parameter order).
    - Every power is exact and cheap (`Q diag((s + λ)^p) Qᵀ`), so `exact_power` and `use_cached`
      make no difference, and `eigenvalues` is `s`.

    Cost: the factors' `O(Σ n_i²)` memory plus the scaling's `O(Π n_i)`; each update forms the
    per-example gradients of the batch (`V · B · Π n_i` numbers).

    **Subclasses** declare `spec: LayerSpec = eqx.field(static=True)`, set `supported_tags`, and
    implement:

    - `kronecker` (property): the K-FAC block of the same layer (its factor statistics and
      canonical parameter layout are reused);
    - `_gradient_samples(data) -> tuple[Array, ...]`: exact per-example gradients, per parameter
      `(N, *param_shape)`, one row per (vector, example) pair;

    and may override `_projected_second_moment(data, eigenvectors, batch_size)` with a cheaper
    formula.
    """

    @property
    @abc.abstractmethod
    def kronecker(self) -> KroneckerFactored:
        """The K-FAC block of the same layer, whose factors give the eigenbasis."""

    @abc.abstractmethod
    def _gradient_samples(self, data: EstimationData) -> tuple[Array, ...]:
        """Exact per-example gradients `(N, *param_shape)` per parameter (see the class docs)."""

    def _check_spec(self) -> None:
        try:
            self.kronecker
        except ValueError as error:
            raise ValueError(
                f"{type(self).__name__} uses the eigenbasis of a K-FAC block, which cannot "
                f"handle this layer: {error}"
            ) from None

    def _projected_second_moment(
        self, data: EstimationData, eigenvectors: tuple[Array, ...], batch_size: ArrayLike
    ) -> Array:
        """`Σ_n (Qᵀ g_n)² / B` in the canonical array shape, from explicit per-example gradients."""
        kron = self.kronecker
        samples = tuple(g.astype(self.dtype) for g in self._gradient_samples(data))
        canonical = jax.vmap(kron._params_to_array)(samples)
        rotate = KroneckerOperator(tuple(q.T for q in eigenvectors)).mv
        return jnp.sum(jnp.square(jax.vmap(rotate)(canonical)), axis=0) / batch_size

    def slice_init(self, exact_powers, approx_powers, cache_eigenvalues) -> EigenbasisState:
        del exact_powers, approx_powers, cache_eigenvalues
        dims = self.kronecker.factor_dims
        return EigenbasisState(
            factors=tuple(WeightedMovingAverage.zeros((n, n), self.dtype) for n in dims),
            eigenvectors=tuple(jnp.eye(n, dtype=self.dtype) for n in dims),
            scaling=WeightedMovingAverage.zeros(dims, self.dtype),
        )

    def slice_update_statistics(self, state, data, ema_old, ema_new, batch_size) -> EigenbasisState:
        stats = self.kronecker._factor_statistics(data, batch_size)
        moment = self._projected_second_moment(data, state.eigenvectors, batch_size)
        return EigenbasisState(
            factors=tuple(f.update(s, ema_old, ema_new) for f, s in zip(state.factors, stats)),
            eigenvectors=state.eigenvectors,
            scaling=state.scaling.update(moment, ema_old, ema_new),
        )

    def slice_update_cache(
        self, state, identity_weight, exact_powers, approx_powers, eigenvalues
    ) -> EigenbasisState:
        del identity_weight, exact_powers, approx_powers, eigenvalues
        eigh = kronecker_eigh(tuple(f.value for f in state.factors))
        kfac_values = ft.reduce(jnp.multiply.outer, eigh.eigenvalues)
        return EigenbasisState(
            factors=state.factors,
            eigenvectors=eigh.eigenvectors,
            scaling=WeightedMovingAverage(
                value=kfac_values.astype(self.dtype), weight=state.scaling.weight
            ),
        )

    def slice_eigenvalues(self, state: EigenbasisState, use_cached: bool) -> Array:
        del use_cached
        return jnp.reshape(state.scaling.value, (-1,))

    def slice_to_dense_matrix(self, state: EigenbasisState) -> Array:
        return self.slice_operator(state, jnp.zeros((), self.dtype)).as_matrix()

    def slice_operator(
        self, state: EigenbasisState, identity_weight: ArrayLike
    ) -> EigenbasisCurvatureOperator:
        layout = KroneckerLayout(self.kronecker)
        return EigenbasisCurvatureOperator(
            state.eigenvectors, state.scaling.value, identity_weight, layout
        )


class DenseEigenbasisKFAC(AbstractEigenbasisKFAC):
    """EK-FAC for dense layers (final): the eigenbasis of `DenseTwoKroneckerFactored`'s `A ⊗ G`.

    The scaling uses the exact per-example gradients (sequence positions summed within each
    example), so with extra input dims the eigenbasis is K-FAC-expand's while the scaling is fitted
    to the true per-example curvature (`DenseFull`). Without extra dims the projected second moment
    is `Σ_{v,b} (Q_Aᵀ x̃_b)² (Q_Gᵀ dy_vb)²ᵀ / B`, computed without forming per-example gradients.
    Use it with `layer_tag_to_block_ctor={"dense": DenseEigenbasisKFAC}`.

    **Fields:**

    - `spec`: the layer's `LayerSpec` (static).
    """

    spec: LayerSpec = eqx.field(static=True)
    supported_tags: ClassVar[frozenset[str] | None] = frozenset({"dense"})

    @property
    def kronecker(self) -> KroneckerFactored:
        return DenseTwoKroneckerFactored(self.spec)

    def _gradient_samples(self, data: EstimationData) -> tuple[Array, ...]:
        return dense_gradient_samples(self.spec, data)

    def _projected_second_moment(self, data, eigenvectors, batch_size) -> Array:
        _, has_bias, n_in, n_out = dense_layout(self.spec)
        (x,) = data.inputs
        if int(np.prod(x.shape[1:-1], dtype=int)) != 1:
            return super()._projected_second_moment(data, eigenvectors, batch_size)
        (dy,) = data.outputs_tangent
        x = jnp.reshape(x.astype(self.dtype), (x.shape[0], n_in))
        if has_bias:
            x = jnp.concatenate([x, jnp.ones((x.shape[0], 1), self.dtype)], axis=1)
        dy = jnp.reshape(dy.astype(self.dtype), (dy.shape[0], x.shape[0], n_out))
        # One example's gradient is the rank-one x̃ dyᵀ, so its projection squares factor-wise.
        x_sq = jnp.square(x @ eigenvectors[0])
        dy_sq = jnp.square(dy @ eigenvectors[1])
        return jnp.einsum("bi,vbo->io", x_sq, dy_sq) / batch_size


class Conv2DEigenbasisKFAC(AbstractEigenbasisKFAC):
    """EK-FAC for 2-D convolutions (final): the eigenbasis of `Conv2DTwoKroneckerFactored` (KFC).

    The scaling is fitted to the exact per-example kernel (and bias) gradients of
    `conv_gradient_samples`, so it matches `Conv2DFull` in the KFC eigenbasis. Grouped and
    depthwise convolutions are not supported (as for KFC). Use it with
    `layer_tag_to_block_ctor={"conv2d": Conv2DEigenbasisKFAC}`.

    **Fields:**

    - `spec`: the layer's `LayerSpec` (static).
    """

    spec: LayerSpec = eqx.field(static=True)
    supported_tags: ClassVar[frozenset[str] | None] = frozenset({"conv2d"})

    @property
    def kronecker(self) -> KroneckerFactored:
        return Conv2DTwoKroneckerFactored(self.spec)

    def _gradient_samples(self, data: EstimationData) -> tuple[Array, ...]:
        return conv_gradient_samples(self.spec, data)
