"""`TaylorDenseKroneckerSum`: one Kronecker product per point set, inverted exactly as a sum.

Dangel, Müller and Zeinhofer (2024) approximate the Gauss-Newton block of a layer by
`Σ_k A_k ⊗ G_k`, one Kronecker product per loss term (the interior term with its derivative
channels, the boundary term), and invert the damped sum of two products exactly with the trick of
Martens and Grosse (2015, appendix I): two pairs of SPD matrices are diagonalised simultaneously,
`T_Aᵀ Ā_1 T_A = diag(a)`, `T_Aᵀ Ā_2 T_A = I` (and `T_G` likewise), so that
`(Ā_1 ⊗ Ḡ_1 + Ā_2 ⊗ Ḡ_2)⁻¹ = (T_A ⊗ T_G) diag(1 / (a ⊗ g + 1)) (T_A ⊗ T_G)ᵀ`.
"""

from typing import Any, ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.typing import ArrayLike
from jaxtyping import Array, Float

from .._core.tree import all_finite
from .._curvature.blocks import CurvatureBlock, DenseTwoKroneckerFactored, KroneckerLayout
from .._curvature.blocks.base import Power
from .._curvature.blocks.cached_powers import PowerCache
from .._curvature.blocks.statistics import WeightedMovingAverage
from .._curvature.operators.block_operators import KroneckerCurvatureOperator
from .._curvature.operators.kronecker_powers import (
    kronecker_damped_matpower,
    kronecker_eigh,
    pi_adjusted_damped_factors,
    pi_adjusted_inverse,
)
from .._curvature.operators.structured import kron_vectors
from .._tracing.layer_data import LayerSpec
from .statistics import Approximation, check_approximation, factor_pairs
from .tags import check_taylor_dense_spec, dense_view, TAG_NAME


class SimultaneousDiagonalisation(eqx.Module):
    """`(Σ_k Ā_k ⊗ Ḡ_k)⁻¹` as `(T_A ⊗ T_G) diag(1 / (a ⊗ g + c)) (T_A ⊗ T_G)ᵀ` (final).

    With one product, `T` holds the factors' eigenvectors, `a`, `g` their eigenvalues and
    `c = 0`; with two, the simultaneous diagonalisation of the module docstring and `c = 1`.

    **Fields:**

    - `bases`: `(T_A, T_G)`.
    - `values`: `(a, g)`.
    - `shift`: `c`, a scalar.
    """

    bases: tuple[Float[Array, "_ _"], Float[Array, "_ _"]]
    values: tuple[Float[Array, " _"], Float[Array, " _"]]
    shift: Float[Array, ""]

    def solve(self, array: Float[Array, "n_a n_g"]) -> Float[Array, "n_a n_g"]:
        """Applies the inverse to the canonical array `(n_a, n_g)` (`(Ā ⊗ Ḡ) X = Ā X Ḡ`)."""
        t_a, t_g = self.bases
        rotated = t_a.T @ array @ t_g
        scaled = rotated / (self.values[0][:, None] * self.values[1][None, :] + self.shift)
        return t_a @ scaled @ t_g.T

    def is_finite(self) -> Array:
        """Whether every array is finite (a factorisation that broke down is not)."""
        return all_finite(self)

    @classmethod
    def zero(cls, n_a: int, n_g: int, dtype: Any) -> "SimultaneousDiagonalisation":
        """The value of a cache before its first refresh: zero bases, so `solve` gives zeros
        (as the other blocks' zeroed caches do), with unit values so that it divides by no zero.
        Built from shapes alone: no factorisation runs (on the 39,073-parameter PINN of
        `benchmarks/pinn.py`, factorising identities here took 5.5 s of `Optimizer.init`).

        **Arguments:**

        - `n_a`, `n_g`: the sizes of the input-side and output-side factors.
        - `dtype`: the statistics dtype.

        **Returns:**

        The zero `SimultaneousDiagonalisation`.
        """
        return cls(
            (jnp.zeros((n_a, n_a), dtype), jnp.zeros((n_g, n_g), dtype)),
            (jnp.ones((n_a,), dtype), jnp.ones((n_g,), dtype)),
            jnp.zeros((), dtype),
        )


def _simultaneous_basis(first: Array, second: Array) -> tuple[Array, Array]:
    """`(T, d)` with `Tᵀ first T = diag(d)` and `Tᵀ second T = I`, for SPD `second`."""
    eigh = kronecker_eigh([second])
    whiten = eigh.eigenvectors[0] / jnp.sqrt(eigh.eigenvalues[0])[None, :]
    inner = kronecker_eigh([whiten.T @ first @ whiten])
    return whiten @ inner.eigenvectors[0], inner.eigenvalues[0]


def damped_inverse(
    pairs: tuple[tuple[Array, Array], ...], damping: ArrayLike
) -> SimultaneousDiagonalisation:
    """The inverse of `Σ_k Ā_k ⊗ Ḡ_k`, each product damped by `damping / K` (pi-adjusted).

    **Arguments:**

    - `pairs`: one or two `(A_k, G_k)` pairs of PSD factors.
    - `damping`: `λ`, split evenly over the products.

    **Returns:**

    A `SimultaneousDiagonalisation`.
    """
    damped = [pi_adjusted_damped_factors(pair, jnp.asarray(damping) / len(pairs)) for pair in pairs]
    if len(damped) == 1:
        eigh = kronecker_eigh(damped[0])
        return SimultaneousDiagonalisation(eigh.eigenvectors, eigh.eigenvalues, jnp.zeros((), eigh.eigenvalues[0].dtype))
    (a1, g1), (a2, g2) = damped
    t_a, d_a = _simultaneous_basis(a1, a2)
    t_g, d_g = _simultaneous_basis(g1, g2)
    return SimultaneousDiagonalisation((t_a, t_g), (d_a, d_g), jnp.ones((), d_a.dtype))


class KroneckerSumState(eqx.Module):
    """The state of a `TaylorDenseKroneckerSum` block (final).

    **Fields:**

    - `factors`: one `(A_k, G_k)` pair of moving averages per point set.
    - `cache`: the cached approximate powers: the `SimultaneousDiagonalisation` of the damped
      inverse for power `-1` when it was declared (`approx_powers_to_cache=-1`), else nothing.
    """

    factors: tuple[tuple[WeightedMovingAverage, WeightedMovingAverage], ...]
    cache: PowerCache


class TaylorDenseKroneckerSum(CurvatureBlock):
    """K-FAC for PINNs: `C ≈ Σ_k A_k ⊗ G_k`, one Kronecker product per point set (final).

    The factors of point set `k` (interior points with their derivative channels, boundary
    points, ...) are those of `eqx_kfac._pinn.statistics` (expand or reduce). This is the
    approximation of Dangel, Müller and Zeinhofer (2024), with the library's damping convention:

    - power `-1` with `exact_power=False` (what `Optimizer`, `kfac_preconditioner` and
      `pinn_kfac` use) is the exact inverse of `Σ_k (A_k + π_k √(λ/K) I) ⊗ (G_k + √(λ/K)/π_k I)`:
      each of the `K` products gets a pi-adjusted share `λ/K` of the damping (for `K = 1` this is
      `DenseTwoKroneckerFactored`'s approximate inverse); two products are inverted by
      simultaneous diagonalisation (see the module docstring). It can be cached.
    - power `1` is `Σ_k A_k ⊗ G_k + λI` (exact) or the damped sum above (approximate).
    - with one point set every power is available, as for a Kronecker block; with two, powers
      other than `1` and the approximate `-1` raise `ValueError` (the damped sum of two
      Kronecker products and `λI` has no factored inverse): use `TaylorDenseTwoKroneckerFactored`
      or `TaylorDenseFull` for them. More than two point sets raise at construction: merge point
      sets that need the same derivatives (e.g. boundary and initial conditions) into one.

    Eigenvalues and `to_dense_matrix` form the `(dim, dim)` matrix (for inspection of small
    layers).

    **Fields:**

    - `spec`: the layer's `LayerSpec` (static).
    - `approximation`: `"expand"` (default) or `"reduce"` (static, keyword-only).
    """

    spec: LayerSpec = eqx.field(static=True)
    approximation: Approximation = eqx.field(static=True, default="expand", kw_only=True)
    supported_tags: ClassVar[frozenset[str] | None] = frozenset({TAG_NAME})

    def _check_spec(self) -> None:
        check_taylor_dense_spec(self)
        check_approximation(self)
        if len(self.spec.input_shapes) > 2:
            raise ValueError(
                f"TaylorDenseKroneckerSum cannot handle the {self.spec.describe}: it is applied to "
                f"{len(self.spec.input_shapes)} point sets, and a sum of more than two Kronecker "
                "products has no factored inverse. Evaluate the point sets that need the same "
                "derivatives (e.g. boundary and initial conditions) as one point set, or use "
                "TaylorDenseTwoKroneckerFactored."
            )

    @property
    def _dense(self) -> DenseTwoKroneckerFactored:
        """A dense layer's block with the same parameters, for the parameter layout."""
        return DenseTwoKroneckerFactored(dense_view(self.spec))

    def _unavailable(self, what: str) -> ValueError:
        return ValueError(
            f"TaylorDenseKroneckerSum for the {self.spec.describe} (a sum of "
            f"{len(self.spec.input_shapes)} Kronecker products) has no {what}: it offers power 1 "
            "and the approximate power -1 (`exact_power=False`, as `Optimizer` uses with "
            "`use_exact_inverses=False`). Use TaylorDenseTwoKroneckerFactored or "
            "TaylorDenseFull for this layer."
        )

    def slice_init(self, exact_powers, approx_powers, cache_eigenvalues) -> KroneckerSumState:
        if exact_powers or cache_eigenvalues or set(approx_powers) - {-1.0}:
            raise self._unavailable(
                f"cache for exact powers {exact_powers}, approximate powers {approx_powers} or "
                "eigenvalues"
            )
        n_a, n_g = self._dense.factor_dims
        zeros = lambda n: WeightedMovingAverage.zeros((n, n), self.dtype)  # noqa: E731
        factors = tuple((zeros(n_a), zeros(n_g)) for _ in self.spec.input_shapes)
        cache = PowerCache.zeros(
            approx_powers, lambda: SimultaneousDiagonalisation.zero(n_a, n_g, self.dtype)
        )
        return KroneckerSumState(factors=factors, cache=cache)

    def slice_update_statistics(self, state, data, ema_old, ema_new, batch_size) -> KroneckerSumState:
        pairs, _ = factor_pairs(self.spec, data, batch_size, self.dtype, self.approximation)
        factors = tuple(
            (a.update(new_a, ema_old, ema_new), g.update(new_g, ema_old, ema_new))
            for (a, g), (new_a, new_g) in zip(state.factors, pairs)
        )
        return KroneckerSumState(factors=factors, cache=state.cache)

    def _pairs(self, state: KroneckerSumState) -> tuple[tuple[Array, Array], ...]:
        return tuple((a.value, g.value) for a, g in state.factors)

    def slice_update_cache(self, state, identity_weight, exact_powers, approx_powers, eigenvalues) -> KroneckerSumState:
        if exact_powers or eigenvalues or set(approx_powers) - {-1.0}:
            raise self._unavailable(f"cache for exact powers {exact_powers} or approximate powers {approx_powers}")

        def inverse(power: float, previous: SimultaneousDiagonalisation) -> SimultaneousDiagonalisation:
            new = damped_inverse(self._pairs(state), identity_weight)
            # A factorisation that broke down keeps the previous inverse (as Kronecker blocks do).
            finite = new.is_finite()
            return jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, previous)

        cache = state.cache.refreshed(self, approx_powers, inverse)
        return KroneckerSumState(factors=state.factors, cache=cache)

    def slice_multiply_matpower(
        self,
        state: KroneckerSumState,
        vector: tuple[Array, ...],
        identity_weight: ArrayLike,
        power: Power,
        exact_power: bool,
        use_cached: bool,
    ) -> tuple[Array, ...]:
        array = self._dense._params_to_array(tuple(v.astype(self.dtype) for v in vector))
        pairs = self._pairs(state)
        if power == 1:
            damped = pairs if exact_power else [
                pi_adjusted_damped_factors(p, jnp.asarray(identity_weight) / len(pairs)) for p in pairs
            ]
            result = sum(a @ array @ g for a, g in damped)
            result = result + identity_weight * array if exact_power else result
        elif power == -1 and not exact_power:
            if use_cached:
                inverse = state.cache.get(self, power)
            else:
                inverse = damped_inverse(pairs, identity_weight)
            result = inverse.solve(array)
        elif len(pairs) == 1 and exact_power:
            result = kronecker_damped_matpower(kronecker_eigh(pairs[0]), array, identity_weight, power)
        elif len(pairs) == 1:
            result = pi_adjusted_inverse(pairs[0], identity_weight, float(power)).mv(array)
        else:
            raise self._unavailable(f"{'exact' if exact_power else 'approximate'} power {power}")
        return self._dense._array_to_params(result)

    def slice_eigenvalues(self, state: KroneckerSumState, use_cached: bool) -> Array:
        if use_cached:
            raise self._unavailable("cached eigenvalues")
        pairs = self._pairs(state)
        if len(pairs) == 1:
            return kron_vectors(kronecker_eigh(pairs[0]).eigenvalues)
        return kronecker_eigh([self.slice_to_dense_matrix(state)]).eigenvalues[0]

    def slice_to_dense_matrix(self, state: KroneckerSumState) -> Array:
        layout = KroneckerLayout(self._dense)
        zero = jnp.zeros((), self.dtype)
        return sum(KroneckerCurvatureOperator(pair, zero, layout).as_matrix() for pair in self._pairs(state))
