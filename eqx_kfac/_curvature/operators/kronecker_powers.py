"""Factor-wise damped powers of PSD Kronecker products: exact and pi-adjusted.

`(f_1 ⊗ ... ⊗ f_k + λI)^p v` is computed without forming the product: exactly from the factors'
eigendecompositions (`KroneckerEigh`), or approximately with pi-adjusted factored damping.

Numerical safety: factors are symmetrised before any decomposition. If an eigendecomposition of
finite input comes back non-finite (a known failure of some GPU solvers), it is retried on the
factor shifted by a small multiple of its scale, and the shift is subtracted from the eigenvalues.
Inverses of damped factors use, on CPU, block elimination with Cholesky factorisations at the
leaves, and on GPU/TPU one Cholesky factorisation per factor (chosen when the program is lowered);
if one comes back non-finite (singular or indefinite by rounding), `pi_adjusted_inverse` takes it
from the eigendecomposition with eigenvalues floored at a relative epsilon (that is, more
damping; that eigendecomposition is not retried shifted: a fallback that fails too gives a
non-finite inverse, and the step that uses it is skipped), and a cache refresh
(`refreshed_inverse_factors`) keeps the previous inverse. (The retry in the fallback doubled the
eigendecompositions a step without a cache compiles: FermiNet's first step, 663 kernels to 587.)
Non-finite input has no sane answer and yields non-finite output.
"""

import functools as ft
from collections.abc import Sequence

import equinox as eqx
import jax
import jax.numpy as jnp
import lineax as lx
from jaxtyping import Array, ArrayLike, Float

from ..._core.linalg import eigh, per_platform, spd_inverse
from ..._core.tree import all_finite
from .structured import kron_vectors, symmetrise, apply_factors, KroneckerOperator


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
    matrix = symmetrise(matrix)
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
    eigenvalues = kron_vectors(eigh.eigenvalues).reshape(expected) + damping
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


def identity_like(factor: Array) -> Array:
    """The identity in the form of `factor`: a matrix, or for a diagonal factor a vector of ones."""
    if factor.ndim == 1:
        return jnp.ones_like(factor)
    return jnp.eye(factor.shape[0], dtype=factor.dtype)


def factor_trace(factor: Array) -> Array:
    if factor.ndim == 1:
        return jnp.sum(factor)
    # The diagonal as a strided slice of the flat matrix, summed in one kernel (`jnp.trace` masks
    # the whole matrix, and `jnp.diagonal` gathers: two kernels of the matrix's size each).
    return jnp.sum(jnp.reshape(factor, (-1,))[:: factor.shape[0] + 1])


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
        factor_trace(f) / n if n > 0 else jnp.ones((), f.dtype) for f, n in zip(factors, dims)
    ]
    positive = ft.reduce(jnp.logical_and, [m > 0 for m in means])
    safe = [jnp.where(positive, m, 1.0) for m in means]
    root = damping ** (1.0 / k)
    zero_case = tuple(root * identity_like(f) for f in factors)

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
            jnp.ones_like(f) if n == 1 else spread * (f + shares[i] * identity_like(f))
            for i, (f, n) in enumerate(zip(factors, dims))
        )
    return tuple(jnp.where(positive, r, z) for r, z in zip(regular, zero_case))


# Leaves are at most this size. A multi-threaded OpenBLAS starts its own threads for triangular
# solves from 32 rows on, which spin and take cores from XLA (a refresh with 256-row leaves took
# 150 ms inside the step against 90 ms alone); with LAPACK's BLAS on one thread (see
# `eqx_kfac._core.linalg`) larger leaves are as fast, and the unrolled recursion, whose size is the
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
    triangle is read (the upper right off-diagonal blocks and the leaves' upper triangles), so a
    matrix symmetric up to rounding needs no symmetrising, and the result is symmetric up to rounding.
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
    vals, vecs = eigh(matrix)
    finfo = jnp.finfo(matrix.dtype)
    floor = finfo.eps * matrix.shape[0] * jnp.max(jnp.abs(vals), initial=0.0) + finfo.tiny
    vals = jnp.maximum(vals, floor)
    return (vecs / vals) @ vecs.T


# Block elimination is a CPU choice: its leaves keep XLA:CPU's compile time down and its matrix
# products keep OpenBLAS's spinning threads out of the way (see `_BLOCK_INVERSE_LEAF`). On a GPU or
# TPU a Cholesky factorisation of the whole matrix is one solver call (batched over a stack of
# factors), where the recursion would be a chain of small kernels per level and leaf.
_spd_inverse_for_platform = per_platform(_block_spd_inverse, spd_inverse)


def _invert_damped(damped: Array) -> Array:
    return 1.0 / damped if damped.ndim == 1 else _spd_inverse_for_platform(damped)


def _damped_inverses(factors: tuple[Array, ...], damping: Array) -> tuple[Array, ...]:
    """The inverses of the pi-adjusted damped factors, with the floored-eigenvalue fallback in a
    differentiable `cond`."""
    inverses = tuple(_invert_damped(d) for d in pi_adjusted_damped_factors(factors, damping))

    def fallback(factors, damping, inverses):
        damped = pi_adjusted_damped_factors(factors, damping)
        return tuple(
            jnp.where(jnp.all(jnp.isfinite(i)), i, 1.0 / d if d.ndim == 1 else _floored_eigh_inverse(symmetrise(d)))
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

    When an inverse comes back non-finite (a damped factor singular or indefinite by rounding,
    which needs a damping far below the factor's scale), all of them keep their `previous` values
    instead of the public function's eigendecomposition fallback: the refresh then compiles to the
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
    inverses = tuple(map(_invert_damped, damped))
    # One check for the block (the pi-adjusted inverses belong together; one reduction compiles
    # to fewer kernels than one per factor).
    finite = all_finite(inverses)
    return tuple(jnp.where(finite, inverse, old) for inverse, old in zip(inverses, previous))


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
