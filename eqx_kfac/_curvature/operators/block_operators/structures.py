"""The structures of the blocks' estimates: Kronecker factors, an eigenbasis, a diagonal, a
multiple of the identity."""

import functools as ft
import math
from collections.abc import Sequence
from typing import Any

import equinox as eqx
import jax.numpy as jnp
import lineax as lx
import numpy as np
from jax.typing import ArrayLike
from jaxtyping import Array, Float

from ..structured import (
    apply_along_axis,
    kron_vectors,
)
from ..kronecker_powers import (
    factor_trace,
    kronecker_eigh,
    pi_adjusted_damped_factors,
)
from ..spectral import scalar_power
from .base import AbstractSliceCurvatureOperator, Vector
from .layout import AbstractParameterLayout, flatten_vector


Factor = Float[Array, "_ _"] | Float[Array, " _"]


# Factor-wise helpers: a factor is a square matrix, a vector (a diagonal matrix) or, for an
# eigenbasis, `None` (the identity).


def _apply_factors(factors: Sequence[Array | None], x: Array) -> Array:
    for axis, factor in enumerate(factors):
        if factor is None:
            continue
        if factor.ndim == 1:
            x = x * jnp.reshape(factor, (-1,) + (1,) * (x.ndim - axis - 1))
        else:
            x = apply_along_axis(factor, x, axis)
    return x


def _dense_factor(factor: Array | None, n: int, dtype: Any) -> Array:
    if factor is None:
        return jnp.eye(n, dtype=dtype)
    return jnp.diag(factor) if factor.ndim == 1 else factor


def _factor_eigh(factor: Factor) -> tuple[Array, Array | None]:
    """Eigenvalues (clipped at zero) and eigenvectors (`None` for a diagonal factor)."""
    if factor.ndim == 1:
        return jnp.maximum(factor, 0.0), None
    decomposition = kronecker_eigh([factor])
    return decomposition.eigenvalues[0], decomposition.eigenvectors[0]


def _in_parameter_order(canonical: Array, layout: AbstractParameterLayout) -> Array:
    position = np.argsort(layout.canonical_order())
    return canonical[position[:, None], position[None, :]]


class KroneckerCurvatureOperator(AbstractSliceCurvatureOperator):
    """`F_1 ⊗ ... ⊗ F_k + λI` on a layout's canonical array (K-FAC; final).

    `F_i` acts along axis `i` of the canonical array of `layout`. A factor given as a vector is
    the diagonal matrix with that diagonal (e.g. an embedding's token frequencies), so it costs
    `O(n)`, not `O(n²)`. A full block is the case of one factor on the flat parameters
    (`ReshapeLayout(shapes, (dim,))`).

    - Exact powers use the factors' eigendecompositions: `(⊗F_i + λI)^p` has eigenvalues
      `(⊗s_i + λ)^p` in the basis `⊗Q_i` (an `EigenbasisCurvatureOperator`).
    - Approximate powers use pi-adjusted factored damping, `⊗(F_i + d_i I)^p` with the `d_i` of
      `pi_adjusted_damped_factors` (a `KroneckerCurvatureOperator` without damping).
    - Trace, Frobenius norm and diagonal are products of the factors'; eigenvalues and the
      log-determinant come from the factors' eigenvalues.

    **Fields:**

    - `factors`: the `(n_i, n_i)` PSD factors (or `(n_i,)` diagonals).
    - `damping`: `λ`.
    - `layout`: the canonical arrangement of the parameters (static).
    """

    factors: tuple[Factor, ...]
    damping: Float[Array, ""]
    layout: AbstractParameterLayout = eqx.field(static=True)

    def __init__(
        self, factors: Sequence[ArrayLike], damping: ArrayLike, layout: AbstractParameterLayout
    ):
        """**Arguments:**

        - `factors`: one PSD factor per axis of `layout.array_shape`, a square matrix or a vector
          (diagonal).
        - `damping`: `λ ≥ 0`, a scalar.
        - `layout`: how the parameters map onto the canonical array.
        """
        factors = tuple(jnp.asarray(f) for f in factors)
        shapes = tuple(f.shape for f in factors)
        if len(factors) != len(layout.array_shape) or any(
            s not in ((n, n), (n,)) for s, n in zip(shapes, layout.array_shape)
        ):
            raise ValueError(
                f"KroneckerCurvatureOperator: factors of shapes {shapes} do not act on a canonical "
                f"array of shape {layout.array_shape}: give one square matrix (n, n) or diagonal "
                "(n,) per axis."
            )
        dtype = jnp.result_type(*(f.dtype for f in factors), jnp.float32)
        self.factors = tuple(f.astype(dtype) for f in factors)
        self.damping = jnp.asarray(damping, dtype)
        self.layout = layout

    @property
    def param_shapes(self) -> tuple[tuple[int, ...], ...]:
        return self.layout.param_shapes

    def _curvature_mv(self, vector: Vector) -> Vector:
        return self.layout.from_array(_apply_factors(self.factors, self.layout.to_array(vector)))

    def _curvature_matrix(self) -> Float[Array, "dim dim"]:
        dense = [
            _dense_factor(f, n, f.dtype) for f, n in zip(self.factors, self.layout.array_shape)
        ]
        return _in_parameter_order(ft.reduce(jnp.kron, dense), self.layout)

    def _curvature_eigenvalues(self) -> Float[Array, " dim"]:
        return kron_vectors([_factor_eigh(f)[0] for f in self.factors])

    def _curvature_trace(self) -> Float[Array, ""]:
        return ft.reduce(jnp.multiply, [factor_trace(f) for f in self.factors])

    def _curvature_frobenius(self) -> Float[Array, ""]:
        return ft.reduce(jnp.multiply, [jnp.linalg.norm(f) for f in self.factors])

    def _curvature_diagonal(self) -> Vector:
        diagonals = [f if f.ndim == 1 else jnp.diagonal(f) for f in self.factors]
        return self.layout.from_array(
            jnp.reshape(kron_vectors(diagonals), self.layout.array_shape)
        )

    def _exact_power(self, power: float | int) -> "EigenbasisCurvatureOperator":
        decompositions = [_factor_eigh(f) for f in self.factors]
        values = kron_vectors([vals for vals, _ in decompositions])
        spectrum = jnp.reshape(values, self.layout.array_shape) + self.damping
        return EigenbasisCurvatureOperator(
            tuple(vecs for _, vecs in decompositions),
            scalar_power(spectrum, power),
            jnp.zeros_like(self.damping),
            self.layout,
        )

    def _approximate_power(self, power: float | int) -> "KroneckerCurvatureOperator":
        # The damped factors share the factors' eigenvectors, so the pi-adjusted damping can be
        # computed on the eigenvalues (as diagonal factors) and the powers taken on them.
        decompositions = [_factor_eigh(f) for f in self.factors]
        damped = pi_adjusted_damped_factors([vals for vals, _ in decompositions], self.damping)
        powered = tuple(
            scalar_power(d, power) if vecs is None else (vecs * scalar_power(d, power)) @ vecs.T
            for d, (_, vecs) in zip(damped, decompositions)
        )
        return KroneckerCurvatureOperator(powered, jnp.zeros_like(self.damping), self.layout)

    def scaled(self, factor: ArrayLike) -> "KroneckerCurvatureOperator":
        factors = (*self.factors[:-1], factor * self.factors[-1])
        return KroneckerCurvatureOperator(factors, factor * self.damping, self.layout)


class EigenbasisCurvatureOperator(AbstractSliceCurvatureOperator):
    """`(⊗Q_i) diag(s) (⊗Q_i)ᵀ + λI` on a layout's canonical array (EK-FAC; final).

    The eigenvalues `s` are an array shaped like the canonical array, so they need not be a
    Kronecker product (EK-FAC refits them). Every power is exact: `(⊗Q_i) diag((s + λ)^p) (⊗Q_i)ᵀ`.

    **Fields:**

    - `eigenvectors`: one orthogonal matrix per axis of the canonical array (`None` for the
      identity).
    - `spectrum`: the eigenvalues `s ≥ 0`, shaped like the canonical array.
    - `damping`: `λ`.
    - `layout`: the canonical arrangement of the parameters (static).
    """

    eigenvectors: tuple[Float[Array, "_ _"] | None, ...]
    spectrum: Float[Array, "..."]
    damping: Float[Array, ""]
    layout: AbstractParameterLayout = eqx.field(static=True)

    def __init__(
        self,
        eigenvectors: Sequence[ArrayLike | None],
        spectrum: ArrayLike,
        damping: ArrayLike,
        layout: AbstractParameterLayout,
    ):
        """**Arguments:**

        - `eigenvectors`: one orthogonal matrix (or `None`) per axis of `layout.array_shape`.
        - `spectrum`: the eigenvalues, shaped `layout.array_shape`.
        - `damping`: `λ ≥ 0`, a scalar.
        - `layout`: how the parameters map onto the canonical array.
        """
        spectrum = jnp.asarray(spectrum)
        vectors = tuple(None if q is None else jnp.asarray(q, spectrum.dtype) for q in eigenvectors)
        shapes = tuple(None if q is None else q.shape for q in vectors)
        if (
            spectrum.shape != layout.array_shape
            or any(s not in (None, (n, n)) for s, n in zip(shapes, layout.array_shape))
            or len(shapes) != len(layout.array_shape)
        ):
            raise ValueError(
                f"EigenbasisCurvatureOperator: eigenvectors of shapes {shapes} and a spectrum of "
                f"shape {spectrum.shape} do not fit a canonical array of shape "
                f"{layout.array_shape}."
            )
        self.eigenvectors = vectors
        self.spectrum = spectrum
        self.damping = jnp.asarray(damping, spectrum.dtype)
        self.layout = layout

    @property
    def param_shapes(self) -> tuple[tuple[int, ...], ...]:
        return self.layout.param_shapes

    def _curvature_mv(self, vector: Vector) -> Vector:
        transposed = [None if q is None else q.T for q in self.eigenvectors]
        rotated = _apply_factors(transposed, self.layout.to_array(vector))
        return self.layout.from_array(_apply_factors(self.eigenvectors, self.spectrum * rotated))

    def _curvature_matrix(self) -> Float[Array, "dim dim"]:
        dtype = self.spectrum.dtype
        dense = [
            _dense_factor(q, n, dtype) for q, n in zip(self.eigenvectors, self.layout.array_shape)
        ]
        basis = ft.reduce(jnp.kron, dense)
        canonical = (basis * jnp.reshape(self.spectrum, (-1,))) @ basis.T
        return _in_parameter_order(canonical, self.layout)

    def _curvature_eigenvalues(self) -> Float[Array, " dim"]:
        return jnp.reshape(self.spectrum, (-1,))

    def _curvature_trace(self) -> Float[Array, ""]:
        return jnp.sum(self.spectrum)

    def _curvature_frobenius(self) -> Float[Array, ""]:
        return jnp.linalg.norm(jnp.reshape(self.spectrum, (-1,)))

    def _curvature_diagonal(self) -> Vector:
        # diag(Q diag(s) Qᵀ)_j = Σ_k Q_jk² s_k, and Q∘Q of a Kronecker product is one too.
        squares = [None if q is None else jnp.square(q) for q in self.eigenvectors]
        return self.layout.from_array(_apply_factors(squares, self.spectrum))

    def _exact_power(self, power: float | int) -> "EigenbasisCurvatureOperator":
        return EigenbasisCurvatureOperator(
            self.eigenvectors,
            scalar_power(self.spectrum + self.damping, power),
            jnp.zeros_like(self.damping),
            self.layout,
        )

    def _approximate_power(self, power: float | int) -> "EigenbasisCurvatureOperator":
        return self._exact_power(power)

    def scaled(self, factor: ArrayLike) -> "EigenbasisCurvatureOperator":
        return EigenbasisCurvatureOperator(
            self.eigenvectors, factor * self.spectrum, factor * self.damping, self.layout
        )


class DiagonalCurvatureOperator(AbstractSliceCurvatureOperator):
    """`diag(d) + λI`, one diagonal array per parameter (final).

    **Fields:**

    - `diagonals`: the curvature's diagonal `d ≥ 0`, one array shaped like each parameter.
    - `damping`: `λ`.
    - `param_shapes`: the parameters' shapes (static, from `diagonals`).
    """

    diagonals: tuple[Float[Array, "..."], ...]
    damping: Float[Array, ""]
    param_shapes: tuple[tuple[int, ...], ...] = eqx.field(static=True)

    def __init__(self, diagonals: Sequence[ArrayLike], damping: ArrayLike):
        """**Arguments:**

        - `diagonals`: one array per parameter, shaped like it.
        - `damping`: `λ ≥ 0`, a scalar.
        """
        diagonals = tuple(jnp.asarray(d) for d in diagonals)
        dtype = jnp.result_type(*(d.dtype for d in diagonals), jnp.float32)
        self.diagonals = tuple(d.astype(dtype) for d in diagonals)
        self.damping = jnp.asarray(damping, dtype)
        self.param_shapes = tuple(d.shape for d in diagonals)

    def _curvature_mv(self, vector: Vector) -> Vector:
        return tuple(d * v for d, v in zip(self.diagonals, vector))

    def _curvature_matrix(self) -> Float[Array, "dim dim"]:
        return jnp.diag(flatten_vector(self.diagonals))

    def _curvature_eigenvalues(self) -> Float[Array, " dim"]:
        return flatten_vector(self.diagonals)

    def _curvature_trace(self) -> Float[Array, ""]:
        return jnp.sum(self._curvature_eigenvalues())

    def _curvature_frobenius(self) -> Float[Array, ""]:
        return jnp.linalg.norm(self._curvature_eigenvalues())

    def _curvature_diagonal(self) -> Vector:
        return self.diagonals

    def _exact_power(self, power: float | int) -> "DiagonalCurvatureOperator":
        powered = tuple(scalar_power(d + self.damping, power) for d in self.diagonals)
        return DiagonalCurvatureOperator(powered, jnp.zeros_like(self.damping))

    def _approximate_power(self, power: float | int) -> "DiagonalCurvatureOperator":
        return self._exact_power(power)

    def scaled(self, factor: ArrayLike) -> "DiagonalCurvatureOperator":
        return DiagonalCurvatureOperator(
            tuple(factor * d for d in self.diagonals), factor * self.damping
        )


class ScaledIdentityCurvatureOperator(AbstractSliceCurvatureOperator):
    """`(c + λ) I` (final).

    **Fields:**

    - `scale`: `c`, a scalar array.
    - `damping`: `λ`.
    - `param_shapes`: the parameters' shapes (static).
    """

    scale: Float[Array, ""]
    damping: Float[Array, ""]
    param_shapes: tuple[tuple[int, ...], ...] = eqx.field(static=True)

    def __init__(self, scale: ArrayLike, damping: ArrayLike, param_shapes: Sequence[Sequence[int]]):
        """**Arguments:**

        - `scale`: `c ≥ 0`, a scalar.
        - `damping`: `λ ≥ 0`, a scalar.
        - `param_shapes`: the shapes of the parameters it acts on.
        """
        scale = jnp.asarray(scale)
        dtype = jnp.result_type(scale.dtype, jnp.float32)
        self.scale = scale.astype(dtype)
        self.damping = jnp.asarray(damping, dtype)
        self.param_shapes = tuple(tuple(s) for s in param_shapes)

    def _curvature_mv(self, vector: Vector) -> Vector:
        return tuple(self.scale * v for v in vector)

    def _curvature_matrix(self) -> Float[Array, "dim dim"]:
        return self.scale * jnp.eye(self.dim, dtype=self.scale.dtype)

    def _curvature_eigenvalues(self) -> Float[Array, " dim"]:
        return jnp.full((self.dim,), self.scale)

    def _curvature_trace(self) -> Float[Array, ""]:
        return self.scale * self.dim

    def _curvature_frobenius(self) -> Float[Array, ""]:
        return jnp.abs(self.scale) * math.sqrt(self.dim)

    def _curvature_diagonal(self) -> Vector:
        return tuple(jnp.full(s, self.scale) for s in self.param_shapes)

    def _exact_power(self, power: float | int) -> "ScaledIdentityCurvatureOperator":
        return ScaledIdentityCurvatureOperator(
            scalar_power(self.scale + self.damping, power),
            jnp.zeros_like(self.damping),
            self.param_shapes,
        )

    def _approximate_power(self, power: float | int) -> "ScaledIdentityCurvatureOperator":
        return self._exact_power(power)

    def scaled(self, factor: ArrayLike) -> "ScaledIdentityCurvatureOperator":
        return ScaledIdentityCurvatureOperator(
            factor * self.scale, factor * self.damping, self.param_shapes
        )


@lx.is_diagonal.register(DiagonalCurvatureOperator)
@lx.is_diagonal.register(ScaledIdentityCurvatureOperator)
def _(operator):
    return True
