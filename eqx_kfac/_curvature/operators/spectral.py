"""Spectral functions of lineax operators: trace, Frobenius norm, eigenvalues, log-determinant
and matrix powers.

Each is a `functools.singledispatch` function with structured rules (Kronecker products factor by
factor, block diagonals block by block, damped Kronecker products `K + λI` from the factors'
eigenvalues, sums and scalings term by term; the blocks' curvature operators register theirs)
and a dense fallback for any other operator.
"""

import functools as ft
import math

import jax
import jax.numpy as jnp
import lineax as lx
from jax.flatten_util import ravel_pytree
from jaxtyping import Array, ArrayLike, Float, Inexact

from ..._core.linalg import eigh
from ..solvers.kronecker import split_damped_kronecker
from .structured import (
    kron_vectors,
    symmetrise,
    BlockDiagonalOperator,
    KroneckerOperator,
)
from .kronecker_powers import (
    kronecker_damped_matpower,
    kronecker_eigh,
    pi_adjusted_inverse,
)


_PSD = (lx.symmetric_tag, lx.positive_semidefinite_tag)


def scalar_power(x: ArrayLike, power: float | int) -> Array:
    """`x ** power` elementwise, as a division for `power == -1` (exact like a solve).

    **Arguments:**

    - `x`: an array (e.g. damped eigenvalues).
    - `power`: a Python number.

    **Returns:**

    An array shaped like `x`.
    """
    return 1.0 / x if power == -1 else jnp.power(x, power)


def _require(check, operator: lx.AbstractLinearOperator, name: str, what: str, tag: str) -> None:
    if not check(operator):
        raise ValueError(
            f"{name} needs a {what} operator; got {type(operator).__name__} without that property. "
            f"If it holds, wrap the operator: lineax.TaggedLinearOperator(operator, lineax.{tag})."
        )


@ft.singledispatch
def trace(operator: lx.AbstractLinearOperator) -> Inexact[Array, ""]:
    """The trace of a square operator.

    Kronecker products use `∏ tr f_i`, block diagonals sum their blocks, sums and scalings of
    operators are taken term by term; any other lineax operator sums `lineax.diagonal`.

    **Arguments:**

    - `operator`: a lineax operator with equal input and output sizes.

    **Returns:**

    A scalar array.
    """
    return jnp.sum(lx.diagonal(operator))


@trace.register(KroneckerOperator)
def _(operator):
    return ft.reduce(jnp.multiply, [jnp.trace(f) for f in operator.factors])


@trace.register(BlockDiagonalOperator)
def _(operator):
    return sum(trace(block) for block in operator.blocks)


@trace.register(lx.AddLinearOperator)
def _(operator):
    return trace(operator.operator1) + trace(operator.operator2)


@trace.register(lx.MulLinearOperator)
def _(operator):
    return trace(operator.operator) * operator.scalar


@trace.register(lx.DivLinearOperator)
def _(operator):
    return trace(operator.operator) / operator.scalar


@trace.register(lx.NegLinearOperator)
def _(operator):
    return -trace(operator.operator)


@trace.register(lx.TaggedLinearOperator)
def _(operator):
    return trace(operator.operator)


@ft.singledispatch
def frobenius_norm(operator: lx.AbstractLinearOperator) -> Float[Array, ""]:
    """The Frobenius norm of an operator.

    Kronecker products use `∏ ‖f_i‖_F`, block diagonals `sqrt(Σ ‖B_j‖_F²)`; any other lineax
    operator uses its dense matrix.

    **Arguments:**

    - `operator`: a lineax operator.

    **Returns:**

    A non-negative scalar array.
    """
    return jnp.linalg.norm(operator.as_matrix())


@frobenius_norm.register(KroneckerOperator)
def _(operator):
    return ft.reduce(jnp.multiply, [jnp.linalg.norm(f) for f in operator.factors])


@frobenius_norm.register(BlockDiagonalOperator)
def _(operator):
    return jnp.sqrt(sum(frobenius_norm(block) ** 2 for block in operator.blocks))


@frobenius_norm.register(lx.TaggedLinearOperator)
def _(operator):
    return frobenius_norm(operator.operator)


@ft.singledispatch
def eigenvalues(operator: lx.AbstractLinearOperator) -> Float[Array, " n"]:
    """The eigenvalues of a symmetric operator.

    For a Kronecker product, the flattened outer product of the factors' eigenvalues, in `kron`
    order (not sorted; PSD-tagged products clip factor eigenvalues at zero); for `K + λI` with `K`
    a PSD Kronecker product, those plus `λ`; for a block diagonal, the concatenation of its
    blocks' eigenvalues. Any other symmetric lineax operator uses `eigvalsh` of its dense
    matrix (ascending).

    **Arguments:**

    - `operator`: a symmetric lineax operator (for a Kronecker product: every factor symmetric).

    **Returns:**

    A vector with one entry per dimension.
    """
    damped = split_damped_kronecker(operator)
    if damped is not None:
        kron, damping = damped
        return eigenvalues(kron) + damping
    _require(lx.is_symmetric, operator, "eigenvalues", "symmetric", "symmetric_tag")
    return eigh(symmetrise(operator.as_matrix()))[0]


@eigenvalues.register(KroneckerOperator)
def _(operator):
    _require(lx.is_symmetric, operator, "eigenvalues", "symmetric", "symmetric_tag")
    if lx.is_positive_semidefinite(operator):
        return kron_vectors(kronecker_eigh(operator).eigenvalues)
    return kron_vectors([eigh(symmetrise(f))[0] for f in operator.factors])


@eigenvalues.register(BlockDiagonalOperator)
def _(operator):
    return jnp.concatenate([eigenvalues(block) for block in operator.blocks])


@ft.singledispatch
def logdet(operator: lx.AbstractLinearOperator) -> Float[Array, ""]:
    """The log-determinant of a positive semi-definite operator: the sum of its log-eigenvalues.

    For a Kronecker product of factors `f_i` of sizes `n_i` and `N = ∏ n_i`,
    `Σ_i (N / n_i) logdet f_i`; for `K + λI` with `K` a PSD Kronecker product, the sum of
    `log(⊗s_i + λ)` over the factors' eigenvalues; block diagonals sum their blocks. Any other
    lineax operator uses the eigenvalues of its dense matrix. Singular operators give `-inf`.

    **Arguments:**

    - `operator`: a PSD lineax operator (tagged `lineax.positive_semidefinite_tag`; for `K + λI`,
      `K` tagged and `λ ≥ 0`).

    **Returns:**

    A scalar array.
    """
    damped = split_damped_kronecker(operator)
    if damped is not None:
        return jnp.sum(jnp.log(eigenvalues(operator)))
    _require(lx.is_positive_semidefinite, operator, "logdet", "positive semi-definite",
             "positive_semidefinite_tag")
    return jnp.sum(jnp.log(jnp.maximum(eigenvalues(operator), 0.0)))


@logdet.register(KroneckerOperator)
def _(operator):
    _require(lx.is_positive_semidefinite, operator, "logdet", "positive semi-definite",
             "positive_semidefinite_tag")
    dims = [f.shape[0] for f in operator.factors]
    size = math.prod(dims)
    if size == 0:
        return jnp.zeros((), operator.factors[0].dtype)
    eigh = kronecker_eigh(operator)
    return sum((size // n) * jnp.sum(jnp.log(vals)) for n, vals in zip(dims, eigh.eigenvalues))


@logdet.register(BlockDiagonalOperator)
def _(operator):
    return sum(logdet(block) for block in operator.blocks)


@ft.singledispatch
def matpower(
    operator: lx.AbstractLinearOperator, power: float | int, exact: bool = True
) -> lx.AbstractLinearOperator:
    """The matrix power `operator^power` of a positive semi-definite operator, as an operator.

    Structured operators keep their structure: the curvature operators of the blocks (K-FAC
    factor by factor, exactly from the factors' eigendecompositions or with pi-adjusted damping),
    block diagonals block by block, `K + λI` with `K` a PSD `KroneckerOperator` exactly from the
    factors' eigendecompositions or as `pi_adjusted_inverse`. Any other lineax operator uses the
    eigendecomposition of its dense matrix. With `power = -1` this is the (damped) inverse, so
    `matpower(operator, -1).mv(b)` is a solve.

    **Arguments:**

    - `operator`: a symmetric PSD lineax operator (for `K + λI`: `K` tagged PSD and `λ ≥ 0`).
    - `power`: `p`, a Python number.
    - `exact`: `False` allows each structure's cheaper approximation of a damped power (pi-adjusted
      factored damping for Kronecker products); other operators are always exact.

    **Returns:**

    A symmetric PSD lineax operator with the structure of `operator`. Eigenvalues that are zero
    give infinities for negative powers.
    """
    damped = split_damped_kronecker(operator)
    if damped is not None:
        kron, damping = damped
        if not exact:
            return pi_adjusted_inverse(kron, damping, power)
        decomposition = kronecker_eigh(kron)
        return lx.FunctionLinearOperator(
            lambda v: kronecker_damped_matpower(decomposition, v, damping, power),
            kron.in_structure(),
            tags=_PSD,
        )
    _require(lx.is_positive_semidefinite, operator, "matpower", "positive semi-definite",
             "positive_semidefinite_tag")
    values, vectors = eigh(symmetrise(operator.as_matrix()))
    matrix = (vectors * scalar_power(jnp.maximum(values, 0.0), power)) @ vectors.T
    zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), operator.in_structure())
    _, unravel = ravel_pytree(zeros)
    return lx.FunctionLinearOperator(
        lambda v: unravel(matrix @ ravel_pytree(v)[0]), operator.in_structure(), tags=_PSD
    )


@matpower.register(BlockDiagonalOperator)
def _(operator, power, exact=True):
    return BlockDiagonalOperator(tuple(matpower(b, power, exact) for b in operator.blocks))
