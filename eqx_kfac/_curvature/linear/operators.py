"""Lineax operators for K-FAC: Kronecker products, block diagonals, and their damped solves.

`KroneckerOperator(factors)` acts on arrays shaped `(n_1, ..., n_k)` by applying factor `i`
along axis `i`, so `as_matrix()` is `kron(f_1, ..., f_k)` for row-major flattening.
`BlockDiagonalOperator(blocks)` acts on a tuple with one entry per block.

Damped solves `(f_1 ⊗ ... ⊗ f_k + λI)^p v` work factor-wise, never forming the product:
exactly from the factors' eigendecompositions (`KroneckerEigh`), or approximately with
pi-adjusted factored damping. Both are also lineax solvers.

Numerical safety: factors are symmetrised before any decomposition. If an eigendecomposition of
finite input comes back non-finite (a known failure of some GPU solvers), it is retried on the
factor shifted by a small multiple of its scale, and the shift is subtracted from the eigenvalues.
Inverses of damped factors use block elimination with Cholesky factorisations at the leaves;
if one comes back non-finite (singular or indefinite by rounding), `pi_adjusted_inverse` takes it
from the eigendecomposition with eigenvalues floored at a relative epsilon (that is, more
damping), and a cache refresh (`refreshed_inverse_factors`) keeps the previous inverse.
Non-finite input has no sane answer and yields non-finite output, which
`lineax.linear_solve` reports as a failed solve.
"""

import functools as ft
from collections.abc import Sequence
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import lineax as lx
from jaxtyping import Array, ArrayLike, Float, Inexact, PyTree

from ..._core.linalg import eigh, spd_inverse


def _frozenset(tags: object) -> frozenset[object]:
    try:
        return frozenset(tags)  # pyright: ignore[reportArgumentType]
    except TypeError:
        return frozenset([tags])


def _apply_along_axis(matrix: Array, x: Array, axis: int) -> Array:
    out = jnp.tensordot(matrix, x, axes=((1,), (axis,)), precision=jax.lax.Precision.HIGHEST)
    return jnp.moveaxis(out, 0, axis)


def apply_factors(
    factors: Sequence[Array], x: Array, axes: Sequence[int] | None = None
) -> Array:
    """`(f_1 ⊗ ... ⊗ f_k)` applied to `x`, factor `i` along axis `axes[i]` (default: axis `i`)."""
    for axis, factor in zip(range(len(factors)) if axes is None else axes, factors, strict=True):
        x = _apply_along_axis(factor, x, axis)
    return x


def _kron_vectors(vectors: Sequence[Array]) -> Array:
    """Flattened outer product of vectors, in `kron` order."""
    return ft.reduce(lambda a, b: (a[:, None] * b[None, :]).reshape(-1), vectors)


def _symmetrise(matrix: Array) -> Array:
    return (matrix + matrix.T) / 2


# Operators


class KroneckerOperator(lx.AbstractLinearOperator):
    """The Kronecker product `f_1 ⊗ ... ⊗ f_k` of any number of matrices, as a lineax operator.

    It acts on arrays shaped `(n_1, ..., n_k)`, where factor `f_i` has shape `(m_i, n_i)`, by
    applying `f_i` along axis `i`; the output has shape `(m_1, ..., m_k)`. With row-major
    flattening this is multiplication by `kron(f_1, ..., f_k)`, which is what `as_matrix()` returns.
    Factors may be rectangular and may have size 0 or 1.

    Tags describe the product, as for `lineax.MatrixLinearOperator`. `lineax.symmetric_tag` and
    `lineax.positive_semidefinite_tag` are taken to mean that *every factor* is symmetric
    (respectively PSD), which is what K-FAC factors are and what the factor-wise solves use.

    `lineax.materialise` returns the operator itself: its factors are already stored arrays, and
    forming the product would defeat its purpose.
    """

    factors: tuple[Inexact[Array, "_ _"], ...]
    tags: frozenset[object] = eqx.field(static=True)

    def __init__(self, factors: Sequence[ArrayLike], tags: object = ()):
        """**Arguments:**

        - `factors`: a non-empty sequence of 2-dimensional arrays `f_1, ..., f_k`.
        - `tags`: lineax tags of the product (e.g. `lineax.positive_semidefinite_tag`); unchecked.
        """
        factors = tuple(jnp.asarray(f) for f in factors)
        if len(factors) == 0:
            raise ValueError("KroneckerOperator(factors=...) needs at least one factor.")
        for i, factor in enumerate(factors):
            if factor.ndim != 2:
                raise ValueError(
                    f"KroneckerOperator(factors=...): factors[{i}] has shape {factor.shape}; every "
                    "factor must be a 2-dimensional matrix."
                )
        dtype = jnp.result_type(*factors)
        if not jnp.issubdtype(dtype, jnp.inexact):
            dtype = jnp.result_type(float)
        self.factors = tuple(f.astype(dtype) for f in factors)
        self.tags = _frozenset(tags)

    def mv(self, vector: Inexact[Array, "..."]) -> Inexact[Array, "..."]:
        return apply_factors(self.factors, vector)

    def as_matrix(self) -> Inexact[Array, "a b"]:
        return ft.reduce(jnp.kron, self.factors)

    def transpose(self) -> "KroneckerOperator":
        if lx.is_symmetric(self):
            return self
        return KroneckerOperator(tuple(f.T for f in self.factors), lx.transpose_tags(self.tags))

    def in_structure(self) -> jax.ShapeDtypeStruct:
        shape = tuple(f.shape[1] for f in self.factors)
        return jax.ShapeDtypeStruct(shape, self.factors[0].dtype)

    def out_structure(self) -> jax.ShapeDtypeStruct:
        shape = tuple(f.shape[0] for f in self.factors)
        return jax.ShapeDtypeStruct(shape, self.factors[0].dtype)


class BlockDiagonalOperator(lx.AbstractLinearOperator):
    """A block-diagonal operator built from other lineax operators.

    It acts on a tuple with one entry per block (each shaped like that block's input structure)
    and returns a tuple of the blocks' outputs. `as_matrix()` places the blocks' matrices on the
    diagonal, in order, which matches flattening the tuple leaf by leaf.

    Properties such as symmetry or positive semi-definiteness hold when they hold for every block.
    """

    blocks: tuple[lx.AbstractLinearOperator, ...]

    def __init__(self, blocks: Sequence[lx.AbstractLinearOperator]):
        """**Arguments:**

        - `blocks`: a non-empty sequence of lineax operators.
        """
        blocks = tuple(blocks)
        if len(blocks) == 0:
            raise ValueError("BlockDiagonalOperator(blocks=...) needs at least one block.")
        for i, block in enumerate(blocks):
            if not isinstance(block, lx.AbstractLinearOperator):
                raise TypeError(
                    f"BlockDiagonalOperator(blocks=...): blocks[{i}] is a {type(block).__name__}; "
                    "every block must be a lineax.AbstractLinearOperator (wrap matrices in "
                    "lineax.MatrixLinearOperator)."
                )
        self.blocks = blocks

    def mv(self, vector: tuple[PyTree[Inexact[Array, "..."]], ...]) -> tuple[PyTree[Array], ...]:
        if not isinstance(vector, tuple) or len(vector) != len(self.blocks):
            raise ValueError(
                f"BlockDiagonalOperator.mv expects a tuple of {len(self.blocks)} entries, one per "
                "block."
            )
        return tuple(block.mv(v) for block, v in zip(self.blocks, vector))

    def as_matrix(self) -> Inexact[Array, "a b"]:
        matrices = [block.as_matrix() for block in self.blocks]
        dtype = jnp.result_type(*matrices)
        cols = [m.shape[1] for m in matrices]
        rows = []
        for i, m in enumerate(matrices):
            left = jnp.zeros((m.shape[0], sum(cols[:i])), dtype)
            right = jnp.zeros((m.shape[0], sum(cols[i + 1 :])), dtype)
            rows.append(jnp.concatenate([left, m.astype(dtype), right], axis=1))
        return jnp.concatenate(rows, axis=0)

    def transpose(self) -> "BlockDiagonalOperator":
        return BlockDiagonalOperator(tuple(block.transpose() for block in self.blocks))

    def in_structure(self) -> tuple[PyTree[jax.ShapeDtypeStruct], ...]:
        return tuple(block.in_structure() for block in self.blocks)

    def out_structure(self) -> tuple[PyTree[jax.ShapeDtypeStruct], ...]:
        return tuple(block.out_structure() for block in self.blocks)


# Lineax's single-dispatch functions


def _real(operator: lx.AbstractLinearOperator) -> bool:
    return not any(
        jnp.issubdtype(s.dtype, jnp.complexfloating)
        for s in jax.tree.leaves((operator.in_structure(), operator.out_structure()))
    )


@lx.linearise.register(KroneckerOperator)
@lx.materialise.register(KroneckerOperator)
def _(operator):
    return operator


@lx.diagonal.register(KroneckerOperator)
def _(operator):
    if all(f.shape[0] == f.shape[1] for f in operator.factors):
        return _kron_vectors([jnp.diagonal(f) for f in operator.factors])
    # With rectangular factors the product's diagonal mixes off-diagonal factor entries.
    return jnp.diagonal(operator.as_matrix())


@lx.tridiagonal.register(KroneckerOperator)
@lx.tridiagonal.register(BlockDiagonalOperator)
def _(operator):
    # Rarely needed (only by lineax.Tridiagonal); the off-diagonals of a Kronecker product mix
    # every factor's entries, so the dense matrix is the simple correct route.
    matrix = operator.as_matrix()
    return jnp.diagonal(matrix), jnp.diagonal(matrix, -1), jnp.diagonal(matrix, 1)


@lx.conj.register(KroneckerOperator)
def _(operator):
    return KroneckerOperator(tuple(f.conj() for f in operator.factors), operator.tags)


@lx.is_symmetric.register(KroneckerOperator)
def _(operator):
    if lx.symmetric_tag in operator.tags or lx.diagonal_tag in operator.tags:
        return True
    semidefinite = {lx.positive_semidefinite_tag, lx.negative_semidefinite_tag}
    return bool(semidefinite & operator.tags) and _real(operator)


@lx.is_diagonal.register(KroneckerOperator)
def _(operator):
    return lx.diagonal_tag in operator.tags or (
        operator.in_size() == 1 and operator.out_size() == 1
    )


@lx.is_tridiagonal.register(KroneckerOperator)
def _(operator):
    return lx.tridiagonal_tag in operator.tags or lx.is_diagonal(operator)


@lx.is_lower_triangular.register(KroneckerOperator)
def _(operator):
    return lx.lower_triangular_tag in operator.tags or lx.is_diagonal(operator)


@lx.is_upper_triangular.register(KroneckerOperator)
def _(operator):
    return lx.upper_triangular_tag in operator.tags or lx.is_diagonal(operator)


for _check, _tag in (
    (lx.has_unit_diagonal, lx.unit_diagonal_tag),
    (lx.is_positive_semidefinite, lx.positive_semidefinite_tag),
    (lx.is_negative_semidefinite, lx.negative_semidefinite_tag),
):

    @_check.register(KroneckerOperator)
    def _(operator, _tag=_tag):
        return _tag in operator.tags


for _transform in (lx.linearise, lx.materialise, lx.conj):

    @_transform.register(BlockDiagonalOperator)
    def _(operator, _transform=_transform):
        return BlockDiagonalOperator(tuple(_transform(block) for block in operator.blocks))


@lx.diagonal.register(BlockDiagonalOperator)
def _(operator):
    return jnp.concatenate([lx.diagonal(block) for block in operator.blocks])


for _check in (
    lx.is_symmetric,
    lx.is_diagonal,
    lx.is_tridiagonal,
    lx.has_unit_diagonal,
    lx.is_lower_triangular,
    lx.is_upper_triangular,
    lx.is_positive_semidefinite,
    lx.is_negative_semidefinite,
):

    @_check.register(BlockDiagonalOperator)
    def _(operator, _check=_check):
        return all(_check(block) for block in operator.blocks)


# Recognising `c·K + λ·I` (as written with lineax's operator arithmetic)


def _terms(operator: lx.AbstractLinearOperator, coeff: Any) -> list[tuple[Any, Any]]:
    if isinstance(operator, lx.AddLinearOperator):
        return _terms(operator.operator1, coeff) + _terms(operator.operator2, coeff)
    if isinstance(operator, lx.MulLinearOperator):
        return _terms(operator.operator, coeff * operator.scalar)
    if isinstance(operator, lx.DivLinearOperator):
        return _terms(operator.operator, coeff / operator.scalar)
    if isinstance(operator, lx.NegLinearOperator):
        return _terms(operator.operator, -coeff)
    if isinstance(operator, lx.TaggedLinearOperator):
        return _terms(operator.operator, coeff)
    return [(coeff, operator)]


def _damped_kronecker(operator: lx.AbstractLinearOperator) -> tuple[KroneckerOperator, Any] | None:
    """Writes `operator` as `(K, λ)` with `operator = K + λI` and `K` a PSD Kronecker product.

    Returns `None` when it has another form, including a scaled `K` (scale a factor instead).
    """
    krons, damping = [], 0.0
    for coeff, term in _terms(operator, 1.0):
        if isinstance(term, KroneckerOperator):
            krons.append((coeff, term))
        elif isinstance(term, lx.IdentityLinearOperator) and (
            eqx.tree_equal(term.in_structure(), term.out_structure()) is True
        ):
            damping = damping + coeff
        else:
            return None
    if len(krons) != 1:
        return None
    coeff, kron = krons[0]
    # `lineax.linear_solve` traces its operator, so a scalar on `K` has no known sign, and the
    # PSD clipping of the factor eigenvalues would be wrong for a negative one.
    if not (lx.is_positive_semidefinite(kron) and isinstance(coeff, float) and coeff == 1.0):
        return None
    return kron, jnp.asarray(damping)


def _require_damped_kronecker(
    operator: lx.AbstractLinearOperator, who: str
) -> tuple[KroneckerOperator, Any]:
    parsed = _damped_kronecker(operator)
    if parsed is None:
        raise ValueError(
            f"{who} solves with `K + λ·I` where `K` is a KroneckerOperator tagged "
            "lineax.positive_semidefinite_tag (unscaled: scale one of its factors instead) and "
            "`λ·I` a scaled lineax.IdentityLinearOperator, e.g. "
            "`KroneckerOperator(factors, lx.positive_semidefinite_tag) + λ * "
            f"lx.IdentityLinearOperator(...)`. Got {type(operator).__name__}."
        )
    return parsed


# Exact factor-wise damped powers


class KroneckerEigh(eqx.Module):
    """The eigendecompositions of the factors of a PSD Kronecker product (cacheable state).

    **Fields:**

    - `eigenvalues`: one vector per factor, clipped at zero.
    - `eigenvectors`: one orthogonal matrix per factor (columns are eigenvectors).
    """

    eigenvalues: tuple[Float[Array, " _"], ...]
    eigenvectors: tuple[Float[Array, "_ _"], ...]


def _keep_eigh(matrix: Array, vals: Array, vecs: Array) -> tuple[Array, Array]:
    return vals, vecs


def _shifted_eigh(matrix: Array, vals: Array, vecs: Array) -> tuple[Array, Array]:
    # A shift by a small multiple of the matrix's scale perturbs a finite input enough to get
    # past solver breakdowns; it is removed from the eigenvalues afterwards.
    shift = 1e-6 * (jnp.max(jnp.abs(jnp.diagonal(matrix)), initial=0.0) + 1.0)
    eye = jnp.eye(matrix.shape[0], dtype=matrix.dtype)
    shifted_vals, shifted_vecs = eigh(matrix + shift * eye)
    return shifted_vals - shift, shifted_vecs


def _guarded_eigh(matrix: Float[Array, "n n"]) -> tuple[Array, Array]:
    matrix = _symmetrise(matrix)
    vals, vecs = eigh(matrix)
    finite = jnp.all(jnp.isfinite(vals)) & jnp.all(jnp.isfinite(vecs))
    # Module-level branches (no closures) let JAX reuse the compiled `cond` across calls.
    return jax.lax.cond(finite, _keep_eigh, _shifted_eigh, matrix, vals, vecs)


def kronecker_eigh(
    operator: KroneckerOperator | Sequence[Float[Array, "_ _"]],
) -> KroneckerEigh:
    """Eigendecomposes every factor of a PSD Kronecker product.

    Factors are symmetrised first and their eigenvalues clipped at zero (rounding can make them
    slightly negative, which would break fractional powers). A decomposition that comes back
    non-finite for finite input is retried on a slightly shifted factor (see the module notes).

    **Arguments:**

    - `operator`: a `KroneckerOperator` or its sequence of square PSD factors.

    **Returns:**

    A `KroneckerEigh`, to pass to `kronecker_damped_matpower` as often as needed.
    """
    factors = operator.factors if isinstance(operator, KroneckerOperator) else tuple(operator)
    for i, factor in enumerate(factors):
        if factor.ndim != 2 or factor.shape[0] != factor.shape[1]:
            raise ValueError(
                f"kronecker_eigh: factor {i} has shape {factor.shape}; factors must be square."
            )
    decompositions = [_guarded_eigh(jnp.asarray(f)) for f in factors]
    return KroneckerEigh(
        eigenvalues=tuple(jnp.maximum(vals, 0.0) for vals, _ in decompositions),
        eigenvectors=tuple(vecs for _, vecs in decompositions),
    )


def kronecker_damped_matpower(
    operator: KroneckerOperator | KroneckerEigh,
    vector: Float[Array, "..."],
    damping: ArrayLike,
    power: float | ArrayLike,
) -> Float[Array, "..."]:
    """Computes `(f_1 ⊗ ... ⊗ f_k + λI)^p v` exactly, without forming the Kronecker product.

    With `f_i = Q_i diag(s_i) Q_iᵀ`, the damped product is
    `(⊗Q_i) diag(⊗s_i + λ) (⊗Q_i)ᵀ`, so the power is applied to the eigenvalues only. The cost is
    one eigendecomposition per factor (skipped when a `KroneckerEigh` is passed) and two passes of
    factor-wise products.

    **Arguments:**

    - `operator`: a PSD `KroneckerOperator` (its factors are decomposed here) or a precomputed
      `KroneckerEigh` from `kronecker_eigh`.
    - `vector`: an array shaped `(n_1, ..., n_k)`.
    - `damping`: `λ`, a scalar.
    - `power`: `p`, any real scalar; `-1` is the damped inverse. Eigenvalues `⊗s_i + λ` that are
      zero give infinities for negative powers (the damped matrix is singular).

    **Returns:**

    An array shaped like `vector`.
    """
    eigh = operator if isinstance(operator, KroneckerEigh) else kronecker_eigh(operator)
    expected = tuple(v.shape[0] for v in eigh.eigenvalues)
    if vector.shape != expected:
        raise ValueError(
            f"kronecker_damped_matpower: vector has shape {vector.shape}, but the Kronecker "
            f"factors need shape {expected} (one axis per factor)."
        )
    eigenvalues = _kron_vectors(eigh.eigenvalues).reshape(expected) + damping
    if isinstance(power, (int, float)) and power == -1:
        scale = 1.0 / eigenvalues
    else:
        scale = eigenvalues**power
    rotated = apply_factors([q.T for q in eigh.eigenvectors], vector)
    return apply_factors(eigh.eigenvectors, scale * rotated)


def kronecker_damped_solve(
    operator: KroneckerOperator | KroneckerEigh,
    vector: Float[Array, "..."],
    damping: ArrayLike,
) -> Float[Array, "..."]:
    """Computes `(f_1 ⊗ ... ⊗ f_k + λI)⁻¹ v` exactly; `kronecker_damped_matpower` with `p = -1`.

    **Arguments:**

    - `operator`: a PSD `KroneckerOperator` or a precomputed `KroneckerEigh`.
    - `vector`: an array shaped `(n_1, ..., n_k)`.
    - `damping`: `λ`, a scalar.

    **Returns:**

    An array shaped like `vector`.
    """
    return kronecker_damped_matpower(operator, vector, damping, -1)


# Pi-adjusted approximate damping


def _identity_like(factor: Array) -> Array:
    """The identity in the form of `factor`: a matrix, or for a diagonal factor a vector of ones."""
    if factor.ndim == 1:
        return jnp.ones_like(factor)
    return jnp.eye(factor.shape[0], dtype=factor.dtype)


def _factor_trace(factor: Array) -> Array:
    return jnp.sum(factor) if factor.ndim == 1 else jnp.trace(factor)


def pi_adjusted_damped_factors(
    operator: KroneckerOperator | Sequence[Float[Array, "_ _"] | Float[Array, " _"]],
    damping: ArrayLike,
) -> tuple[Float[Array, "_ _"] | Float[Array, " _"], ...]:
    """Kronecker factors whose product approximates `f_1 ⊗ ... ⊗ f_k + λI` (pi-adjusted damping).

    For two factors `A`, `G` this is `(A + π√λ I, G + √λ/π I)` with
    `π = sqrt((tr A / dim A) / (tr G / dim G))` (Martens & Grosse 2015). For `k` factors, with
    `t_i = tr f_i / dim f_i`, factor `i` gets damping `t_i λ^{1/k} / (t_1 ⋯ t_k)^{1/k}`; the
    dampings multiply to `λ`. As in kfac-jax, factors of size 1 are scalars `a` that only scale the
    product, so they are left undamped and the damping is spread over the other factors as
    `λ / ∏a` (exact when only one factor is larger than 1); if every factor has size 1 the
    result is exact. If some factor has a zero (or non-positive) trace, the PSD product is zero
    and every factor becomes `λ^{1/k} I`, which is exact.

    **Arguments:**

    - `operator`: a PSD `KroneckerOperator` or its sequence of PSD factors: square matrices, or
      vectors standing for diagonal matrices (e.g. the token frequencies of an embedding).
    - `damping`: `λ ≥ 0`, a scalar.

    **Returns:**

    A tuple with one damped factor per factor, each a square matrix or, for a vector, a vector.
    """
    factors = operator.factors if isinstance(operator, KroneckerOperator) else tuple(operator)
    factors = tuple(jnp.asarray(f) for f in factors)
    dims = [f.shape[0] for f in factors]
    k = len(factors)
    damping = jnp.asarray(damping)
    # A factor of size 0 makes the whole space empty; any positive mean keeps the algebra finite.
    means = [
        _factor_trace(f) / n if n > 0 else jnp.ones((), f.dtype) for f, n in zip(factors, dims)
    ]
    positive = ft.reduce(jnp.logical_and, [m > 0 for m in means])
    safe = [jnp.where(positive, m, 1.0) for m in means]
    root = damping ** (1.0 / k)
    zero_case = tuple(root * _identity_like(f) for f in factors)

    big = [i for i, n in enumerate(dims) if n != 1]
    if not big:
        product = ft.reduce(jnp.multiply, [jnp.reshape(f, (-1,))[0] for f in factors])
        regular = (jnp.reshape(product + damping, factors[0].shape),) + tuple(
            jnp.ones_like(f) for f in factors[1:]
        )
    else:
        scalar = ft.reduce(jnp.multiply, [safe[i] for i in range(k) if dims[i] == 1], 1.0)
        m = len(big)
        log_mean = sum(jnp.log(safe[i]) for i in big) / m
        # Spreading the scalar factors' product evenly keeps every damped factor on one scale.
        per_big = (damping / scalar) ** (1.0 / m)
        spread = scalar ** (1.0 / m)
        shares = [safe[i] * per_big * jnp.exp(-log_mean) for i in range(k)]
        regular = tuple(
            jnp.ones_like(f) if n == 1 else spread * (f + shares[i] * _identity_like(f))
            for i, (f, n) in enumerate(zip(factors, dims))
        )
    return tuple(jnp.where(positive, r, z) for r, z in zip(regular, zero_case))


# Leaves are at most this size. A multi-threaded OpenBLAS starts its own threads for triangular
# solves from 32 rows on, which spin and take cores from XLA (a refresh with 256-row leaves took
# 150 ms inside the step against 90 ms alone); with LAPACK's BLAS on one thread (see
# `eqx_kfac._linalg`) larger leaves are as fast, and the unrolled recursion, whose size is the
# number of leaves, compiles in a fraction of the time (measured on the 16 factors of a
# 784-1000-500-250-30 autoencoder: 31-row leaves 21.5 s, 255-row leaves 3.7 s, 128 against 121 ms).
_BLOCK_INVERSE_LEAF = 255


def _matmul(a: Array, b: Array) -> Array:
    return jnp.matmul(a, b, precision=jax.lax.Precision.HIGHEST)


def _block_spd_inverse(matrix: Float[Array, "n n"]) -> Float[Array, "n n"]:
    """The inverse of a symmetric positive definite matrix by recursive 2x2 block elimination.

    With `M = [[A, B], [Bᵀ, C]]`, `S = C - Bᵀ A⁻¹ B` (the Schur complement, the same one a block
    Cholesky factorisation forms) and `P = A⁻¹ B S⁻¹`: `M⁻¹ = [[A⁻¹ + P (A⁻¹B)ᵀ, -P], [-Pᵀ, S⁻¹]]`.
    About `4/3 n³` flops, almost all in matrix products. A matrix that is not positive definite
    yields non-finite entries (from a Cholesky factorisation at the leaves). Only the upper
    right off-diagonal blocks and the leaves' lower triangles are read, so a matrix symmetric up
    to rounding needs no symmetrising, and the result is symmetric up to rounding.
    """
    n = matrix.shape[0]
    if n <= _BLOCK_INVERSE_LEAF:
        return spd_inverse(matrix)
    h = n // 2
    a, b, c = matrix[:h, :h], matrix[:h, h:], matrix[h:, h:]
    a_inv = _block_spd_inverse(a)
    a_inv_b = _matmul(a_inv, b)
    s_inv = _block_spd_inverse(c - _matmul(b.T, a_inv_b))
    p = _matmul(a_inv_b, s_inv)
    top_left = a_inv + _matmul(p, a_inv_b.T)
    return jnp.block([[top_left, -p], [-p.T, s_inv]])


def _floored_eigh_inverse(matrix: Array) -> Array:
    vals, vecs = _guarded_eigh(matrix)
    finfo = jnp.finfo(matrix.dtype)
    floor = finfo.eps * matrix.shape[0] * jnp.max(jnp.abs(vals), initial=0.0) + finfo.tiny
    vals = jnp.maximum(vals, floor)
    return (vecs / vals) @ vecs.T


def _invert_damped(damped: Array) -> Array:
    return 1.0 / damped if damped.ndim == 1 else _block_spd_inverse(damped)


def _damped_inverses(factors: tuple[Array, ...], damping: Array) -> tuple[Array, ...]:
    """The inverses of the pi-adjusted damped factors, with the floored-eigenvalue fallback in a
    differentiable `cond`."""
    inverses = tuple(_invert_damped(d) for d in pi_adjusted_damped_factors(factors, damping))

    def fallback(factors, damping, inverses):
        damped = pi_adjusted_damped_factors(factors, damping)
        return tuple(
            jnp.where(jnp.all(jnp.isfinite(i)), i, 1.0 / d if d.ndim == 1 else _floored_eigh_inverse(_symmetrise(d)))
            for d, i in zip(damped, inverses)
        )

    # The branch operands are the raw factors, not the damped ones: the damped factors are
    # consumed by the inversion as they are computed, and handing them to `cond` too would
    # materialise them (a copy of every factor in every refresh, measured 2.5 ms per 1000²).
    finite = ft.reduce(jnp.logical_and, [jnp.all(jnp.isfinite(i)) for i in inverses])
    return jax.lax.cond(finite, lambda f, d, i: i, fallback, factors, damping, inverses)


def refreshed_inverse_factors(
    factors: Sequence[Float[Array, "_ _"]],
    damping: ArrayLike,
    previous: Sequence[Float[Array, "_ _"]],
) -> tuple[Float[Array, "_ _"], ...]:
    """The factors of `pi_adjusted_inverse(factors, damping)`, for a cache refresh.

    An inverse that comes back non-finite (a damped factor singular or indefinite by rounding,
    which needs a damping far below the factor's scale) keeps its `previous` value instead of
    the public function's eigendecomposition fallback: the refresh then compiles to the
    inversions alone, with no fallback code per factor (the fallback doubled the refresh's
    compile time), and a failed refresh leaves the cache as it was, as a failed solver
    factorisation does.

    **Arguments:**

    - `factors`: the square PSD Kronecker factors.
    - `damping`: `λ ≥ 0`, a scalar.
    - `previous`: the cached inverses to keep where the new ones are not finite.

    **Returns:**

    One inverse per factor.
    """
    damped = pi_adjusted_damped_factors(tuple(jnp.asarray(f) for f in factors), damping)
    return tuple(
        jnp.where(jnp.all(jnp.isfinite(inverse)), inverse, old)
        for inverse, old in zip(map(_invert_damped, damped), previous)
    )


def _psd_matpower(matrix: Float[Array, "n n"], power: float) -> Float[Array, "n n"]:
    vals, vecs = _guarded_eigh(matrix)
    return (vecs * jnp.maximum(vals, 0.0) ** power) @ vecs.T


def pi_adjusted_inverse(
    operator: KroneckerOperator | Sequence[Float[Array, "_ _"]],
    damping: ArrayLike,
    power: float = -1.0,
) -> KroneckerOperator:
    """The pi-adjusted approximation of `(f_1 ⊗ ... ⊗ f_k + λI)^p`, as a Kronecker operator.

    This is `⊗_i D_i^p` with `D_i` from `pi_adjusted_damped_factors`; for two factors and `p = -1`,
    `(A + π√λ I)⁻¹ ⊗ (G + √λ/π I)⁻¹`. The inverse uses block elimination with Cholesky
    factorisations at the leaves, falling back to an eigendecomposition with floored eigenvalues
    when that is not finite; other powers use the eigendecomposition. The result is PSD-tagged
    and can be cached and applied with `.mv`; it is differentiable.

    **Arguments:**

    - `operator`: a PSD `KroneckerOperator` or its sequence of square PSD factors.
    - `damping`: `λ ≥ 0`, a scalar.
    - `power`: `p`, a Python number (default `-1`).

    **Returns:**

    A `KroneckerOperator` with one factor per input factor.
    """
    if power == -1:
        factors = operator.factors if isinstance(operator, KroneckerOperator) else operator
        powered = _damped_inverses(tuple(jnp.asarray(f) for f in factors), jnp.asarray(damping))
    else:
        damped = pi_adjusted_damped_factors(operator, damping)
        powered = tuple(_psd_matpower(d, power) for d in damped)
    return KroneckerOperator(powered, lx.positive_semidefinite_tag)


# Lineax solvers


class _AbstractKroneckerSolver(lx.AbstractLinearSolver):
    """Shared parts of the Kronecker solvers: `K + λI` is symmetric and real."""

    def transpose(self, state, options):
        return state, options

    def conj(self, state, options):
        return state, options

    def assume_full_rank(self) -> bool:
        return True


class KroneckerEigenSolver(_AbstractKroneckerSolver):
    """Exact lineax solver for `K + λI` with `K` a PSD `KroneckerOperator`.

    Use as `lineax.linear_solve(KroneckerOperator(factors, lx.positive_semidefinite_tag) + λ *
    lx.IdentityLinearOperator(structure), b, solver=KroneckerEigenSolver())`. `init` eigendecomposes
    the factors (reuse its state for many right-hand sides); `compute` is
    `kronecker_damped_solve`. The Kronecker product is never formed.
    """

    def init(self, operator: lx.AbstractLinearOperator, options: dict[str, Any]):
        del options
        kron, damping = _require_damped_kronecker(operator, "KroneckerEigenSolver")
        return kronecker_eigh(kron), damping

    def compute(self, state, vector, options):
        del options
        eigh, damping = state
        return kronecker_damped_solve(eigh, vector, damping), lx.RESULTS.successful, {}


class KroneckerPiAdjustedSolver(_AbstractKroneckerSolver):
    """Approximate lineax solver for `K + λI` using pi-adjusted factored damping.

    Accepts the same operators as `KroneckerEigenSolver`, and returns
    `pi_adjusted_inverse(K, λ).mv(b)`: not the exact solution, but the K-FAC preconditioner of
    Martens & Grosse (2015). Differentiating through `lineax.linear_solve` with this solver
    differentiates the exact inverse evaluated with the approximate one, so prefer it for
    preconditioning, not for derivatives.
    """

    def init(self, operator: lx.AbstractLinearOperator, options: dict[str, Any]):
        del options
        kron, damping = _require_damped_kronecker(operator, "KroneckerPiAdjustedSolver")
        return pi_adjusted_inverse(kron, damping)

    def compute(self, state, vector, options):
        del options
        return state.mv(vector), lx.RESULTS.successful, {}
