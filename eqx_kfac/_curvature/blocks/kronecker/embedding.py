"""K-FAC for embedding lookups: `A ⊗ G` with `A` the diagonal of token frequencies."""

from typing import ClassVar

import equinox as eqx
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike
from jaxtyping import Array

from ...operators.block_operators import (
    EigenbasisCurvatureOperator,
    KroneckerCurvatureOperator,
    ReshapeLayout,
)
from ...._tracing.layer_data import EstimationData, LayerSpec
from ...operators.kronecker_powers import kronecker_eigh
from ..base import CurvatureBlock, Power
from ..cached_powers import EighCache, FactorCache, PowerCache
from ..statistics import WeightedMovingAverage


class EmbeddingState(eqx.Module):
    """The state of an `EmbeddingKroneckerFactored` block.

    **Fields:**

    - `frequencies`: moving average of the input factor's diagonal `(vocab,)`.
    - `output_factor`: moving average of `G`, `(features, features)`.
    - `cache`: the eigenvalues and eigenvectors of `G` (for cached eigenvalues or exact powers)
      and, per cached approximate power `p`, the damped, powered diagonal and `G` factor (no
      solver state).
    """

    frequencies: WeightedMovingAverage
    output_factor: WeightedMovingAverage
    cache: FactorCache


class EmbeddingKroneckerFactored(CurvatureBlock):
    """K-FAC for an embedding `y = table[ids]`, i.e. `y = one_hot(ids) @ table` (final).

    With ids `(B, *extra)` (`T = prod(extra)` positions per example) and output tangents
    `dy: (V, B, *extra, features)`, this is `DenseTwoKroneckerFactored` of the one-hot layer
    (expand convention, no bias), stored without its zeros: the input factor
    `A = Σ_{b,t} one_hot one_hotᵀ / (B T)` is diagonal, the frequency of each token, kept as a
    vector; `G = Σ_v Σ_{b,t} dy dyᵀ / B`. The table `(vocab, features)` is the canonical array
    (vocabulary rows, feature columns). Exact powers use `G`'s eigendecomposition and the
    frequencies directly; approximate powers use pi-adjusted damping
    `(diag(a) + π√λ)^p ⊗ (G + √λ/π)^p`, `π = sqrt(mean(a) / (tr G / features))` (each factor gets
    `√λ` when either trace is zero; `pi_adjusted_damped_factors` with the frequencies as a
    diagonal factor). Its operator (`as_linear_operator`) is a `KroneckerCurvatureOperator` with
    that diagonal factor. Memory `O(vocab + features²)`, so large vocabularies are cheap.

    It is the default block of the `"embedding"` tag, which the default graph pattern binds on
    every `eqx.nn.Embedding` lookup (any table shape); `register_embedding` registers a lookup by
    hand.

    **Fields:**

    - `spec`: the layer's `LayerSpec` (static).
    """

    spec: LayerSpec = eqx.field(static=True)
    supported_tags: ClassVar[frozenset[str] | None] = frozenset({"embedding"})

    def _check_spec(self) -> None:
        shapes = self.spec.param_shapes
        if len(shapes) != 1 or len(shapes[0]) != 2 or len(self.spec.input_shapes) != 1:
            raise ValueError(
                f"{type(self).__name__} cannot handle the {self.spec.describe}: expected one "
                f"input (the ids) and one 2-D table, got parameter shapes {shapes}."
            )

    @property
    def _sizes(self) -> tuple[int, int]:
        vocab, features = self.spec.param_shapes[0]
        return vocab, features

    def slice_init(self, exact_powers, approx_powers, cache_eigenvalues) -> EmbeddingState:
        vocab, features = self._sizes
        cache = FactorCache(
            eigh=EighCache.zeros(
                (features,), self.dtype, eigenvalues=cache_eigenvalues, eigenvectors=bool(exact_powers)
            ),
            approx=PowerCache.zeros(
                approx_powers,
                lambda: (jnp.zeros((vocab,), self.dtype), jnp.zeros((features, features), self.dtype)),
            ),
            solver_state=None,
        )
        return EmbeddingState(
            frequencies=WeightedMovingAverage.zeros((vocab,), self.dtype),
            output_factor=WeightedMovingAverage.zeros((features, features), self.dtype),
            cache=cache,
        )

    def slice_update_statistics(self, state, data: EstimationData, ema_old, ema_new, batch_size) -> EmbeddingState:
        vocab, features = self._sizes
        (ids,) = data.inputs
        (dy,) = data.outputs_tangent
        positions = int(np.prod(ids.shape[1:], dtype=int))
        counts = jnp.zeros((vocab,), self.dtype).at[jnp.reshape(ids, (-1,))].add(1.0)
        dy = jnp.reshape(dy.astype(self.dtype), (-1, features))
        return EmbeddingState(
            frequencies=state.frequencies.update(
                counts / (batch_size * positions), ema_old, ema_new
            ),
            output_factor=state.output_factor.update(dy.T @ dy / batch_size, ema_old, ema_new),
            cache=state.cache,
        )

    def slice_update_cache(
        self, state, identity_weight, exact_powers, approx_powers, eigenvalues
    ) -> EmbeddingState:
        eigh = state.cache.eigh.refreshed(self, [state.output_factor.value], exact_powers, eigenvalues)
        operator = self.slice_operator(state, identity_weight)
        approx = state.cache.approx.refreshed(
            self, approx_powers, lambda p, _: operator.matpower(p, False).factors
        )
        return EmbeddingState(
            frequencies=state.frequencies,
            output_factor=state.output_factor,
            cache=FactorCache(eigh, approx, None),
        )

    def slice_multiply_matpower(
        self,
        state: EmbeddingState,
        vector: tuple[Array, ...],
        identity_weight: ArrayLike,
        power: Power,
        exact_power: bool,
        use_cached: bool,
    ) -> tuple[Array, ...]:
        if not use_cached or power == 1:
            operator = self.slice_operator(state, identity_weight)
            return operator.matpower(power, exact_power).mv(vector)
        if exact_power:
            eigh = state.cache.eigh.decomposition(self, f"exact power {power}")
            (vals,), (vecs,) = eigh.eigenvalues, eigh.eigenvectors
            spectrum = jnp.outer(state.frequencies.value, vals)
            cached = EigenbasisCurvatureOperator(
                (None, vecs), spectrum, identity_weight, self._layout
            )
            return cached.matpower(power).mv(vector)
        powered = state.cache.approx.get(self, power)
        return KroneckerCurvatureOperator(powered, 0.0, self._layout).mv(vector)

    def slice_eigenvalues(self, state: EmbeddingState, use_cached: bool) -> Array:
        if use_cached:
            (vals,) = state.cache.eigh.values(self)
        else:
            vals = kronecker_eigh([state.output_factor.value]).eigenvalues[0]
        return jnp.reshape(state.frequencies.value[:, None] * vals[None, :], (-1,))

    def slice_to_dense_matrix(self, state: EmbeddingState) -> Array:
        return self.slice_operator(state, jnp.zeros((), self.dtype)).as_matrix()

    @property
    def _layout(self) -> ReshapeLayout:
        return ReshapeLayout(self.spec.param_shapes, self._sizes)

    def slice_operator(
        self, state: EmbeddingState, identity_weight: ArrayLike
    ) -> KroneckerCurvatureOperator:
        factors = (state.frequencies.value, state.output_factor.value)
        return KroneckerCurvatureOperator(factors, identity_weight, self._layout)
