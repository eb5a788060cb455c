"""Full curvature blocks: one dense moving-average matrix over all of a layer's parameters."""

import abc
from typing import ClassVar

import equinox as eqx
from jax.typing import ArrayLike
from jaxtyping import Array

from ..operators.block_operators import ReshapeLayout
from ..._tracing.layer_data import EstimationData, LayerSpec
from ..operators.kronecker_powers import kronecker_damped_matpower, kronecker_eigh, pi_adjusted_inverse
from ._layer_stats import (
    check_dense_spec,
    check_scale_and_shift_spec,
    dense_gradient_samples,
    scale_and_shift_gradient_samples,
)
from .linear_solver import (
    refreshed_solver_state,
    solver_takes_inverse,
    zero_solver_state,
)
from .base import (
    flatten_vector,
    Power,
    unflatten_vector,
)
from .cached_powers import EighCache, FactorCache, PowerCache
from .conv_statistics import check_conv_spec, conv_gradient_samples
from .kronecker_form import AbstractKroneckerFormBlock
from .statistics import (
    outer_from_samples,
    WeightedMovingAverage,
)


class FullState(eqx.Module):
    """The state of a `Full` block.

    **Fields:**

    - `matrix`: moving average of the `(dim, dim)` curvature (parameters flattened in order).
    - `cache`: the matrix's eigenvalues (`(dim,)`, when eigenvalues or powers are cached) and
      eigenvectors (`(dim, dim)`, when powers are cached), and, for a block with a `solver`
      caching power -1, the array part of the solver's state (see `Full`). Approximate powers
      are exact here, so they are cached as eigendecompositions too.
    """

    matrix: WeightedMovingAverage
    cache: FactorCache


class Full(AbstractKroneckerFormBlock):
    """Approximates the curvature of a layer by a dense `(dim, dim)` matrix (abstract family).

    Exact and approximate powers coincide (there is nothing to approximate). Caching any power
    stores the eigendecomposition of the statistics, after which every power and every damping
    is one pair of `(dim, dim)` products; the damping passed to `multiply_matpower` is used.
    Uncached inverses use a Cholesky factorisation with an eigendecomposition fallback; power
    `1` always uses the current statistics. Cost: `O(dim²)` memory, `O(dim³)` per factorisation.

    **Choosing the solver.** With `solver=` a lineax solver (e.g. `lineax.Cholesky()`,
    `lineax.CG(rtol, atol)`, `eqx_kfac.KroneckerEigenSolver()`), power `-1` (exact or
    approximate alike) is `lineax.linear_solve(C + λ·I, v, solver)`, with the operator of
    `eqx_kfac.damped_block_operator` (a one-factor `KroneckerOperator` plus `λ·I`, acting on the
    flat parameters). Caching `-1` then stores `solver.init` of that operator at `update_cache`,
    with the damping given there (frozen until the next `update_cache`). A solve that does not
    succeed (e.g. CG out of steps) returns NaNs. Other powers are unaffected.

    **Fields** (besides the subclass's `spec`):

    - `solver`: the lineax solver for power `-1`, or `None` for the built-in method (static,
      keyword-only: `DenseFull(spec, solver=lineax.Cholesky())`).

    **Subclasses** declare `spec: LayerSpec = eqx.field(static=True)`, set `supported_tags`, and
    implement `_full_statistics(data, batch_size) -> Array`: this batch's `(slice_dim,
    slice_dim)` curvature `Σ_v Σ_b vec(g_vb) vec(g_vb)ᵀ / batch_size`, with each sample's
    parameters flattened row-major and concatenated in tag order (`outer_from_samples` computes
    it from per-parameter samples).
    """

    @abc.abstractmethod
    def _full_statistics(self, data: EstimationData, batch_size: ArrayLike) -> Array:
        """This batch's dense curvature (see the class docstring)."""

    def slice_init(self, exact_powers, approx_powers, cache_eigenvalues) -> FullState:
        exact_powers, approx_powers, inverse = solver_takes_inverse(
            self.solver, exact_powers, approx_powers
        )
        d = self.slice_dim
        cache = FactorCache(
            eigh=EighCache.zeros(
                (d,),
                self.dtype,
                eigenvalues=cache_eigenvalues,
                eigenvectors=bool(exact_powers or approx_powers),
            ),
            approx=PowerCache((), ()),
            solver_state=zero_solver_state(self.solver, (d,), self.dtype) if inverse else None,
        )
        return FullState(matrix=WeightedMovingAverage.zeros((d, d), self.dtype), cache=cache)

    def _kronecker_factors(self, state: FullState) -> tuple[Array, ...]:
        return (state.matrix.value,)

    @property
    def _operand_layout(self) -> ReshapeLayout:
        return ReshapeLayout(self.spec.param_shapes, (self.slice_dim,))

    def slice_update_statistics(self, state, data, ema_old, ema_new, batch_size) -> FullState:
        stats = self._full_statistics(data, batch_size)
        return FullState(matrix=state.matrix.update(stats, ema_old, ema_new), cache=state.cache)

    def slice_update_cache(
        self, state, identity_weight, exact_powers, approx_powers, eigenvalues
    ) -> FullState:
        exact_powers, approx_powers, inverse = solver_takes_inverse(
            self.solver, exact_powers, approx_powers
        )
        factors = (state.matrix.value,)
        powers = exact_powers or approx_powers
        eigh = state.cache.eigh.refreshed(self, factors, powers, eigenvalues, "powers")
        solver_state = state.cache.solver_state
        if inverse:
            solver_state = refreshed_solver_state(self, solver_state, factors, identity_weight)
        cache = FactorCache(eigh, state.cache.approx, solver_state)
        return FullState(matrix=state.matrix, cache=cache)

    def slice_multiply_matpower(
        self,
        state: FullState,
        vector: tuple[Array, ...],
        identity_weight: ArrayLike,
        power: Power,
        exact_power: bool,
        use_cached: bool,
    ) -> tuple[Array, ...]:
        del exact_power
        if power == -1 and self.solver is not None:
            return self._solver_inverse(state, vector, identity_weight, use_cached)
        flat = flatten_vector(vector).astype(self.dtype)
        matrix = state.matrix.value
        if power == 1:
            result = matrix @ flat + identity_weight * flat
        elif use_cached:
            eigh = state.cache.eigh.decomposition(self, f"power {power}")
            result = kronecker_damped_matpower(eigh, flat, identity_weight, power)
        else:
            # With a single factor the pi-adjusted damping is exactly `matrix + λ I`.
            result = pi_adjusted_inverse([matrix], identity_weight, float(power)).mv(flat)
        return unflatten_vector(result, self.spec.param_shapes)

    def slice_eigenvalues(self, state: FullState, use_cached: bool) -> Array:
        if use_cached:
            return state.cache.eigh.values(self)[0]
        return kronecker_eigh([state.matrix.value]).eigenvalues[0]

    def slice_to_dense_matrix(self, state: FullState) -> Array:
        return state.matrix.value


class NaiveFull(Full):
    """Full matrix from the parameter gradients themselves (final; fits every tag).

    The statistic is `Σ_v g_v g_vᵀ / B` with `g_v` the batch's summed gradient for loss-space
    vector `v` (`params_tangent`): `(Σ_b g_b)(Σ_b g_b)ᵀ / B` per vector, equal to the
    per-example estimate in expectation or for batch size 1.

    **Fields:**

    - `spec`: the layer's `LayerSpec` (static).
    """

    spec: LayerSpec = eqx.field(static=True)
    supported_tags: ClassVar[frozenset[str] | None] = None

    def _full_statistics(self, data, batch_size) -> Array:
        return outer_from_samples(data.params_tangent, batch_size, self.dtype)


class DenseFull(Full):
    """Exact (per-example) curvature block of a dense layer, weight and bias together (final).

    `C = Σ_v Σ_b vec(g_vb) vec(g_vb)ᵀ / B` with per-example gradients `g_vb` built from the
    layer inputs and output tangents (sequence positions summed within each example).

    **Fields:**

    - `spec`: the layer's `LayerSpec` (static).
    """

    spec: LayerSpec = eqx.field(static=True)
    supported_tags: ClassVar[frozenset[str] | None] = frozenset({"dense"})

    def _check_spec(self) -> None:
        check_dense_spec(self)

    def _full_statistics(self, data, batch_size) -> Array:
        return outer_from_samples(dense_gradient_samples(self.spec, data), batch_size, self.dtype)


class ScaleAndShiftFull(Full):
    """Exact (per-example) curvature block of `y = x * scale + shift` (final).

    `C = Σ_v Σ_b vec(g_vb) vec(g_vb)ᵀ / B` with per-example gradients `Σ x ⊙ dy` (scale) and
    `Σ dy` (shift), summed over the axes the parameters are broadcast along (the parameters lie
    along the trailing axes of `x`, or along the axes in the tag's `param_axes`, e.g. the channel
    axis of `eqx.nn.GroupNorm`).

    **Fields:**

    - `spec`: the layer's `LayerSpec` (static).
    """

    spec: LayerSpec = eqx.field(static=True)
    supported_tags: ClassVar[frozenset[str] | None] = frozenset({"scale_and_shift"})

    def _check_spec(self) -> None:
        check_scale_and_shift_spec(self)

    def _full_statistics(self, data, batch_size) -> Array:
        return outer_from_samples(
            scale_and_shift_gradient_samples(self.spec, data), batch_size, self.dtype
        )


class Conv2DFull(Full):
    """Exact (per-example) curvature block of a conv layer, kernel and bias together (final).

    `C = Σ_v Σ_b vec(g_vb) vec(g_vb)ᵀ / B` with the per-example gradients of
    `conv_gradient_samples` (kernel flattened row-major in its own layout, then the bias).
    Handles every setting `Conv2DDiagonal` does. Cost: `O(dim²)` memory, `O(dim³)` per
    factorisation.

    **Fields:**

    - `spec`: the layer's `LayerSpec` (static).
    """

    spec: LayerSpec = eqx.field(static=True)
    supported_tags: ClassVar[frozenset[str] | None] = frozenset({"conv2d"})

    def _check_spec(self) -> None:
        check_conv_spec(self)

    def _full_statistics(self, data, batch_size) -> Array:
        return outer_from_samples(conv_gradient_samples(self.spec, data), batch_size, self.dtype)
