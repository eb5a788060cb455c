"""Curvature blocks of `taylor_dense` layers: the exact block and one Kronecker product.

`TaylorDenseKroneckerSum` (`kronecker_sum.py`, the default of the PINN optimizers) keeps one
Kronecker product per point set, as Dangel, Müller and Zeinhofer (2024) do. The blocks here are
the exact per-layer reference and the cheaper single product, which the library's Kronecker
family handles entirely (every power, exact or pi-adjusted damping, solvers, caching).
"""

from typing import ClassVar

import equinox as eqx
import jax.numpy as jnp
from jaxtyping import Array

from .._curvature.blocks import AbstractEigenbasisKFAC, DenseTwoKroneckerFactored, Full, KroneckerFactored
from .._curvature.blocks.statistics import outer_from_samples
from .._tracing.layer_data import EstimationData, LayerSpec
from .statistics import Approximation, check_approximation, factor_pairs, gradient_samples
from .tags import check_taylor_dense_spec, dense_view, TAG_NAME


def _samples(spec: LayerSpec, data: EstimationData, dtype) -> list[Array]:
    """Every point set's per-example gradients, one `(Σ_k V B_k, *shape)` array per parameter."""
    per_set = gradient_samples(spec, data, dtype)
    return [jnp.concatenate([jnp.reshape(g, (-1, *g.shape[2:])) for g in parts]) for parts in zip(*per_set)]


class TaylorDenseFull(Full):
    """The exact curvature block of a `taylor_dense` layer, weight and bias together (final).

    `C = Σ_v Σ_k Σ_b vec(g_vkb) vec(g_vkb)ᵀ / B` with the exact per-example gradients
    `g = Σ_s x̃_s dy_sᵀ` of every point set (the derivative channels summed within each example;
    the bias seen by the value channel only). With `estimation_mode="ggn_exact"` this is the
    layer's diagonal block of the Gauss-Newton matrix (ENGD's Gramian). `O(dim²)` memory.

    **Fields:**

    - `spec`: the layer's `LayerSpec` (static).
    """

    spec: LayerSpec = eqx.field(static=True)
    supported_tags: ClassVar[frozenset[str] | None] = frozenset({TAG_NAME})

    def _check_spec(self) -> None:
        check_taylor_dense_spec(self)

    def _full_statistics(self, data, batch_size) -> Array:
        return outer_from_samples(_samples(self.spec, data, self.dtype), batch_size, self.dtype)


class TaylorDenseTwoKroneckerFactored(KroneckerFactored):
    """One Kronecker product `A ⊗ G` for a `taylor_dense` layer and all its point sets (final).

    The point sets' factors (see `eqx_kfac._pinn.statistics`) are pooled: `A` is the mean of all
    the inputs every point set's `A_k` averages (`A = Σ_k n_k A_k / Σ_k n_k`, with `n_k` input
    rows), and `G = Σ_k G_k`. With one point set this is the Kronecker factorisation of
    Dangel, Müller and Zeinhofer (2024) for that term; with several it approximates their sum of
    one product per point set (`TaylorDenseKroneckerSum`) by one product, so everything the
    Kronecker family offers applies (exact and pi-adjusted powers, `solver=`, eigenvalues).

    **Fields:**

    - `spec`: the layer's `LayerSpec` (static).
    - `approximation`: `"expand"` (default: derivative channels as more examples) or `"reduce"`
      (channels averaged / summed before the outer products); static, keyword-only.
    """

    spec: LayerSpec = eqx.field(static=True)
    approximation: Approximation = eqx.field(static=True, default="expand", kw_only=True)
    supported_tags: ClassVar[frozenset[str] | None] = frozenset({TAG_NAME})

    def _check_spec(self) -> None:
        check_taylor_dense_spec(self)
        check_approximation(self)

    @property
    def _dense(self) -> DenseTwoKroneckerFactored:
        """A dense layer's block with the same parameters, for the parameter layout."""
        return DenseTwoKroneckerFactored(dense_view(self.spec))

    @property
    def factor_dims(self) -> tuple[int, ...]:
        return self._dense.factor_dims

    def _params_to_array(self, vector: tuple[Array, ...]) -> Array:
        return self._dense._params_to_array(vector)

    def _array_to_params(self, array: Array) -> tuple[Array, ...]:
        return self._dense._array_to_params(array)

    def _params_to_product_array(self, vector: tuple[Array, ...]) -> tuple[Array, tuple[int, ...]]:
        return self._dense._params_to_product_array(vector)

    def _product_array_to_params(self, array: Array) -> tuple[Array, ...]:
        return self._dense._product_array_to_params(array)

    def _factor_statistics(self, data, batch_size) -> tuple[Array, ...]:
        pairs, counts = factor_pairs(self.spec, data, batch_size, self.dtype, self.approximation)
        total = sum(counts)
        a = sum(n / total * a for n, (a, _) in zip(counts, pairs))
        g = sum(g for _, g in pairs)
        return (a, g)


class TaylorDenseEigenbasisKFAC(AbstractEigenbasisKFAC):
    """EK-FAC for a `taylor_dense` layer (final): `TaylorDenseTwoKroneckerFactored`'s eigenbasis,
    with the eigenvalues refitted to the exact per-example gradients.

    The estimate is `Q diag(s) Qᵀ` with `Q` the eigenvectors of the pooled factors `A ⊗ G` and
    `s` the second moments of the per-example gradients `Σ_s x̃_s dy_sᵀ` (all point sets)
    projected into `Q` (George et al. 2018): the closest matrix to `TaylorDenseFull` in that
    basis. Every power is exact; the basis is refreshed by `update_cache` (use an
    `inverse_update_period` that caches, or call it yourself).

    **Fields:**

    - `spec`: the layer's `LayerSpec` (static).
    - `approximation`: the eigenbasis's factors, `"expand"` (default) or `"reduce"` (static,
      keyword-only).
    """

    spec: LayerSpec = eqx.field(static=True)
    approximation: Approximation = eqx.field(static=True, default="expand", kw_only=True)
    supported_tags: ClassVar[frozenset[str] | None] = frozenset({TAG_NAME})

    @property
    def kronecker(self) -> KroneckerFactored:
        return TaylorDenseTwoKroneckerFactored(self.spec, approximation=self.approximation)

    def _gradient_samples(self, data: EstimationData) -> tuple[Array, ...]:
        return tuple(_samples(self.spec, data, self.dtype))
