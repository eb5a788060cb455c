"""The Kronecker-factored family (K-FAC): `C ≈ A ⊗ G` kept as its factors, and its canonical array."""

import abc

import equinox as eqx
import jax.numpy as jnp
from jax.typing import ArrayLike
from jaxtyping import Array

from ...operators.block_operators import AbstractParameterLayout
from ...._tracing.layer_data import EstimationData
from ...operators.structured import (
    kron_vectors,
    apply_factors,
    KroneckerOperator,
)
from ...operators.kronecker_powers import (
    kronecker_damped_matpower,
    kronecker_eigh,
    pi_adjusted_inverse,
    refreshed_inverse_factors,
)
from ..linear_solver import (
    refreshed_solver_state,
    solver_takes_inverse,
    zero_solver_state,
)
from ..base import Power
from ..cached_powers import EighCache, FactorCache, PowerCache
from ..kronecker_form import AbstractKroneckerFormBlock
from ..statistics import WeightedMovingAverage


class KroneckerState(eqx.Module):
    """The state of a `KroneckerFactored` block.

    **Fields:**

    - `factors`: one moving average per Kronecker factor, `(n_i, n_i)`.
    - `cache`: the factors' eigenvalues (when eigenvalues or exact powers are cached) and
      eigenvectors (when exact powers are cached), per cached approximate power `p` the
      pi-adjusted damped factors raised to `p`, and, for a block with a `solver` caching power
      -1, the array part of the solver's state (see `KroneckerFactored`).
    """

    factors: tuple[WeightedMovingAverage, ...]
    cache: FactorCache


class KroneckerFactored(AbstractKroneckerFormBlock):
    """Approximates the curvature by a Kronecker product `F_1 ⊗ ... ⊗ F_k` (abstract family).

    For the two-factor blocks, `A ⊗ G` with `A` the second moment of the layer inputs (with a 1
    appended when there is a bias, so the bias is folded into `A`) and `G` that of the output
    tangents. The layer's parameters are rearranged into one canonical array of shape
    `factor_dims = (n_1, ..., n_k)` (e.g. `(in + 1, out)`), on which the product acts factor-wise.

    - Exact powers use the factors' eigendecompositions: `(⊗F_i + λI)^p` has eigenvalues
      `(⊗s_i + λ)^p` in the basis `⊗Q_i`. Cached exact powers store the eigendecompositions at
      `update_cache` and use the damping given at multiplication time.
    - Approximate powers use pi-adjusted factored damping: `⊗(F_i + d_i I)^p` with the `d_i`
      of Martens & Grosse (2015) multiplying to `λ`. Cached approximate powers store the damped
      factors' powers computed with the damping given to `update_cache`.
    - Power `1` always uses the current statistics (exact: `⊗F_i v + λ v`; approximate: the
      pi-adjusted damped product, consistent with the approximate inverse).

    Cost: `O(Σ n_i²)` memory and `O(Σ n_i³)` per factorisation, instead of `O(Π n_i²)` and
    `O(Π n_i³)` for `Full`.

    **Choosing the solver.** With `solver=` a lineax solver, power `-1` (exact and approximate
    alike: `exact_power` is then irrelevant) is `lineax.linear_solve(K + λ·I, v, solver)` on the
    canonical array, with `K` the PSD-tagged `KroneckerOperator` of the factors (the operator of
    `eqx_kfac.damped_block_operator`). `eqx_kfac.KroneckerEigenSolver()` gives the exact inverse,
    `eqx_kfac.KroneckerPiAdjustedSolver()` the pi-adjusted one, `lineax.CG(rtol, atol)` keeps
    the Kronecker structure, and dense solvers (`lineax.Cholesky()`, `lineax.LU()`) materialise
    the product (small blocks only). Caching `-1` stores `solver.init` of the operator at
    `update_cache`, with the damping given there (frozen until the next `update_cache`). A solve
    that does not succeed (e.g. CG out of steps) returns NaNs. Other powers are unaffected.

    **Fields** (besides the subclass's `spec`):

    - `solver`: the lineax solver for power `-1`, or `None` for the built-in methods (static,
      keyword-only: `DenseTwoKroneckerFactored(spec, solver=lineax.CG(rtol=1e-6, atol=1e-6))`).

    **Subclasses** declare `spec: LayerSpec = eqx.field(static=True)`, set `supported_tags`, and
    implement (for one slice):

    - `factor_dims` (property): the canonical array shape `(n_1, ..., n_k)`, a static tuple with
      `prod(factor_dims) == slice_dim`;
    - `_params_to_array(vector) -> Array`: a bijective rearrangement of the parameter tuple into
      the canonical array (every entry moved, none created or dropped), such that the
      block's curvature on that array is `F_1 ⊗ ... ⊗ F_k` in row-major order;
    - `_array_to_params(array) -> tuple[Array, ...]`: its inverse;
    - optionally `_params_to_product_array` / `_product_array_to_params`: an arrangement with
      the factors' axes permuted that is cheaper to form (approximate powers use it);
    - `_factor_statistics(data, batch_size) -> tuple[Array, ...]`: this batch's factors
      `(n_i, n_i)`, already normalised (they are averaged as they are).
    """

    @property
    @abc.abstractmethod
    def factor_dims(self) -> tuple[int, ...]:
        """The shape `(n_1, ..., n_k)` of the canonical parameter array."""

    @abc.abstractmethod
    def _params_to_array(self, vector: tuple[Array, ...]) -> Array:
        """Rearranges a parameter tuple into the canonical array (see the class docstring)."""

    @abc.abstractmethod
    def _array_to_params(self, array: Array) -> tuple[Array, ...]:
        """Inverse of `_params_to_array`."""

    def _params_to_product_array(self, vector: tuple[Array, ...]) -> tuple[Array, tuple[int, ...]]:
        """The parameters as an array with factor `i` along axis `axes[i]`, and `axes`.

        Approximate powers (one matrix per factor) are applied on this array. By default it is
        the canonical array; a subclass can return a permutation of it that is cheaper to form
        from the parameters (no transposed copy of a weight in each product).
        """
        return self._params_to_array(vector), tuple(range(len(self.factor_dims)))

    def _product_array_to_params(self, array: Array) -> tuple[Array, ...]:
        """Inverse of `_params_to_product_array`."""
        return self._array_to_params(array)

    @abc.abstractmethod
    def _factor_statistics(self, data: EstimationData, batch_size: ArrayLike) -> tuple[Array, ...]:
        """This batch's Kronecker factors (see the class docstring)."""

    def slice_init(self, exact_powers, approx_powers, cache_eigenvalues) -> KroneckerState:
        exact_powers, approx_powers, inverse = solver_takes_inverse(
            self.solver, exact_powers, approx_powers
        )
        dims = self.factor_dims
        cache = FactorCache(
            eigh=EighCache.zeros(
                dims, self.dtype, eigenvalues=cache_eigenvalues, eigenvectors=bool(exact_powers)
            ),
            approx=PowerCache.zeros(
                approx_powers, lambda: tuple(jnp.zeros((n, n), self.dtype) for n in dims)
            ),
            solver_state=zero_solver_state(self.solver, dims, self.dtype) if inverse else None,
        )
        return KroneckerState(
            factors=tuple(WeightedMovingAverage.zeros((n, n), self.dtype) for n in dims),
            cache=cache,
        )

    def slice_update_statistics(self, state, data, ema_old, ema_new, batch_size) -> KroneckerState:
        stats = self._factor_statistics(data, batch_size)
        return KroneckerState(
            factors=tuple(f.update(s, ema_old, ema_new) for f, s in zip(state.factors, stats)),
            cache=state.cache,
        )

    def _kronecker_factors(self, state: KroneckerState) -> tuple[Array, ...]:
        return tuple(f.value for f in state.factors)

    @property
    def _operand_layout(self) -> "KroneckerLayout":
        return KroneckerLayout(self)

    def slice_update_cache(
        self, state, identity_weight, exact_powers, approx_powers, eigenvalues
    ) -> KroneckerState:
        exact_powers, approx_powers, inverse = solver_takes_inverse(
            self.solver, exact_powers, approx_powers
        )
        factors = self._kronecker_factors(state)
        eigh = state.cache.eigh.refreshed(self, factors, exact_powers, eigenvalues)
        solver_state = state.cache.solver_state
        if inverse:
            solver_state = refreshed_solver_state(self, solver_state, factors, identity_weight)

        def powered(p: float, previous: tuple[Array, ...]) -> tuple[Array, ...]:
            if p == -1:
                return refreshed_inverse_factors(factors, identity_weight, previous)
            return pi_adjusted_inverse(factors, identity_weight, p).factors

        approx = state.cache.approx.refreshed(self, approx_powers, powered)
        return KroneckerState(factors=state.factors, cache=FactorCache(eigh, approx, solver_state))

    def slice_multiply_matpower(
        self,
        state: KroneckerState,
        vector: tuple[Array, ...],
        identity_weight: ArrayLike,
        power: Power,
        exact_power: bool,
        use_cached: bool,
    ) -> tuple[Array, ...]:
        if power == -1 and self.solver is not None:
            return self._solver_inverse(state, vector, identity_weight, use_cached)
        vector = tuple(v.astype(self.dtype) for v in vector)
        factors = self._kronecker_factors(state)
        if not exact_power and power != 1:
            return self._approximate_matpower(state, vector, identity_weight, power, use_cached)
        array = self._params_to_array(vector)
        if power != 1:
            if use_cached:
                eigh = state.cache.eigh.decomposition(self, f"exact power {power}")
            else:
                eigh = kronecker_eigh(factors)
            result = kronecker_damped_matpower(eigh, array, identity_weight, power)
        elif exact_power:
            result = KroneckerOperator(factors).mv(array) + identity_weight * array
        else:
            result = pi_adjusted_inverse(factors, identity_weight, 1.0).mv(array)
        return self._array_to_params(result)

    def _approximate_matpower(
        self,
        state: KroneckerState,
        vector: tuple[Array, ...],
        identity_weight: ArrayLike,
        power: Power,
        use_cached: bool,
    ) -> tuple[Array, ...]:
        """The pi-adjusted power (not 1): one matrix per factor, applied on the arrangement that
        is cheapest to form."""
        if use_cached:
            powered = state.cache.approx.get(self, power)
        else:
            factors = self._kronecker_factors(state)
            powered = pi_adjusted_inverse(factors, identity_weight, float(power)).factors
        array, axes = self._params_to_product_array(vector)
        return self._product_array_to_params(apply_factors(powered, array, axes))

    def slice_eigenvalues(self, state: KroneckerState, use_cached: bool) -> Array:
        if use_cached:
            values = state.cache.eigh.values(self)
        else:
            values = kronecker_eigh(self._kronecker_factors(state)).eigenvalues
        return kron_vectors(values)

    def slice_to_dense_matrix(self, state: KroneckerState) -> Array:
        return self.slice_operator(state, jnp.zeros((), self.dtype)).as_matrix()


class KroneckerLayout(AbstractParameterLayout):
    """The canonical array `factor_dims` of a `KroneckerFactored` block (final).

    **Fields:**

    - `block`: the block whose `_params_to_array` / `_array_to_params` define the arrangement
      (static).
    """

    block: KroneckerFactored = eqx.field(static=True)

    @property
    def param_shapes(self) -> tuple[tuple[int, ...], ...]:
        return self.block.spec.param_shapes

    @property
    def array_shape(self) -> tuple[int, ...]:
        return self.block.factor_dims

    def to_array(self, vector: tuple[Array, ...]) -> Array:
        return self.block._params_to_array(tuple(vector))

    def from_array(self, array: Array) -> tuple[Array, ...]:
        return self.block._array_to_params(array)
