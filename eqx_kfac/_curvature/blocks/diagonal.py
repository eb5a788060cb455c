"""Diagonal curvature blocks: one moving-average diagonal per parameter array."""

import abc
from typing import ClassVar

import equinox as eqx
import jax.numpy as jnp
from jax.typing import ArrayLike
from jaxtyping import Array

from ..operators.block_operators import DiagonalCurvatureOperator
from ..._tracing.layer_data import EstimationData, LayerSpec
from ._layer_stats import (
    check_dense_spec,
    check_scale_and_shift_spec,
    dense_gradient_samples,
    dense_layout,
    scale_and_shift_gradient_samples,
)
from .base import (
    CurvatureBlock,
    flatten_vector,
)
from .conv_statistics import check_conv_spec, conv_gradient_samples
from .statistics import (
    squares_from_samples,
    WeightedMovingAverage,
)


class DiagonalState(eqx.Module):
    """The state of a `Diagonal` block.

    **Fields:**

    - `diagonals`: one moving average per parameter, shaped like that parameter.
    """

    diagonals: tuple[WeightedMovingAverage, ...]


class Diagonal(CurvatureBlock):
    """Approximates the curvature by its diagonal (abstract family).

    Products, powers and eigenvalues are elementwise (`O(dim)`), so nothing needs caching:
    `use_cached=True` returns the same as `False` (the current statistics and damping), and
    `exact_power` is irrelevant.

    **Subclasses** declare `spec: LayerSpec = eqx.field(static=True)`, set `supported_tags`, and
    implement `_diagonal_statistics(data, batch_size) -> tuple[Array, ...]`: one array per
    parameter (shaped like it, per slice) holding this batch's diagonal of the curvature, i.e.
    `Σ_v Σ_b g_vb² / batch_size` for per-example gradients `g_vb`
    (`squares_from_samples` computes that from samples).
    """

    @abc.abstractmethod
    def _diagonal_statistics(
        self, data: EstimationData, batch_size: ArrayLike
    ) -> tuple[Array, ...]:
        """This batch's curvature diagonal, one array per parameter (see the class docstring)."""

    def slice_init(self, exact_powers, approx_powers, cache_eigenvalues) -> DiagonalState:
        del exact_powers, approx_powers, cache_eigenvalues
        return DiagonalState(
            diagonals=tuple(
                WeightedMovingAverage.zeros(tuple(s), self.dtype) for s in self.spec.param_shapes
            )
        )

    def slice_update_statistics(
        self,
        state: DiagonalState,
        data: EstimationData,
        ema_old: ArrayLike,
        ema_new: ArrayLike,
        batch_size: ArrayLike,
    ) -> DiagonalState:
        stats = self._diagonal_statistics(data, batch_size)
        return DiagonalState(
            diagonals=tuple(d.update(s, ema_old, ema_new) for d, s in zip(state.diagonals, stats))
        )

    def slice_eigenvalues(self, state: DiagonalState, use_cached: bool) -> Array:
        del use_cached
        return flatten_vector([d.value for d in state.diagonals])

    def slice_to_dense_matrix(self, state: DiagonalState) -> Array:
        return jnp.diag(self.slice_eigenvalues(state, False))

    def slice_operator(
        self, state: DiagonalState, identity_weight: ArrayLike
    ) -> DiagonalCurvatureOperator:
        return DiagonalCurvatureOperator(tuple(d.value for d in state.diagonals), identity_weight)


class NaiveDiagonal(Diagonal):
    """Diagonal from the parameter gradients themselves (final; fits every tag).

    The statistic is `Σ_v g_v² / B` where `g_v` is the batch's summed gradient for loss-space
    vector `v` (`params_tangent`). With one sampled vector per batch this is the diagonal of
    `(Σ_b g_b)(Σ_b g_b)ᵀ / B`, which equals the per-example estimate only in expectation (batch
    size 1 makes them equal). Cost: `O(dim)` memory and time.

    **Fields:**

    - `spec`: the layer's `LayerSpec` (static).
    """

    spec: LayerSpec = eqx.field(static=True)
    supported_tags: ClassVar[frozenset[str] | None] = None

    def _diagonal_statistics(self, data, batch_size) -> tuple[Array, ...]:
        return squares_from_samples(data.params_tangent, batch_size, self.dtype)


class DenseDiagonal(Diagonal):
    """Exact diagonal of the per-example (Fisher / GGN) curvature of a dense layer (final).

    `diag = Σ_v Σ_b g_vb² / B` with per-example gradients `g_vb` built from the layer inputs and
    output tangents (sequence positions summed within each example). Cost: `O(dim)` memory,
    `O(V B in out)` time per update.

    **Fields:**

    - `spec`: the layer's `LayerSpec` (static).
    """

    spec: LayerSpec = eqx.field(static=True)
    supported_tags: ClassVar[frozenset[str] | None] = frozenset({"dense"})

    def _check_spec(self) -> None:
        check_dense_spec(self)

    def _diagonal_statistics(self, data, batch_size) -> tuple[Array, ...]:
        (x,) = data.inputs
        if x.ndim > 2:
            return squares_from_samples(
                dense_gradient_samples(self.spec, data), batch_size, self.dtype
            )
        # Without positions, g_vb = x_b ⊗ dy_vb, so its square factorises and no per-example
        # gradient needs to be formed.
        in_out, has_bias, _, _ = dense_layout(self.spec)
        (dy,) = data.outputs_tangent
        x2 = jnp.square(x.astype(self.dtype))
        dy2 = jnp.square(dy.astype(self.dtype))
        equation = "bi,vbo->io" if in_out else "bi,vbo->oi"
        shapes = self.spec.param_shapes  # an n-d weight is its (in, out) reshape
        stats = (jnp.reshape(jnp.einsum(equation, x2, dy2) / batch_size, shapes[0]),)
        if has_bias:
            stats += (jnp.reshape(jnp.sum(dy2, axis=(0, 1)) / batch_size, shapes[1]),)
        return stats


class ScaleAndShiftDiagonal(Diagonal):
    """Exact diagonal of the per-example curvature of `y = x * scale + shift` (final).

    Per-example gradients are `Σ x ⊙ dy` (scale) and `Σ dy` (shift), summed over the axes the
    parameters are broadcast along (the parameters lie along the trailing axes of `x`, or along
    the axes in the tag's `param_axes`, e.g. the channel axis of `eqx.nn.GroupNorm`); the
    statistic is `Σ_v Σ_b g_vb² / B`. Cost: `O(dim)`.

    **Fields:**

    - `spec`: the layer's `LayerSpec` (static).
    """

    spec: LayerSpec = eqx.field(static=True)
    supported_tags: ClassVar[frozenset[str] | None] = frozenset({"scale_and_shift"})

    def _check_spec(self) -> None:
        check_scale_and_shift_spec(self)

    def _diagonal_statistics(self, data, batch_size) -> tuple[Array, ...]:
        return squares_from_samples(
            scale_and_shift_gradient_samples(self.spec, data), batch_size, self.dtype
        )


class Conv2DDiagonal(Diagonal):
    """Exact diagonal of the per-example (Fisher / GGN) curvature of a conv layer (final).

    `diag = Σ_v Σ_b g_vb² / B` with the per-example kernel (and bias) gradients `g_vb` of
    `conv_gradient_samples`. Handles every layout, stride, padding, dilation and grouped or
    depthwise convolution. Cost: `O(dim)` memory; time of `V · B` per-example kernel gradients.

    **Fields:**

    - `spec`: the layer's `LayerSpec` (static).
    """

    spec: LayerSpec = eqx.field(static=True)
    supported_tags: ClassVar[frozenset[str] | None] = frozenset({"conv2d"})

    def _check_spec(self) -> None:
        check_conv_spec(self)

    def _diagonal_statistics(self, data, batch_size) -> tuple[Array, ...]:
        return squares_from_samples(conv_gradient_samples(self.spec, data), batch_size, self.dtype)
