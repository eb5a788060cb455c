"""Lineax operators for K-FAC: Kronecker products and block diagonals.

`KroneckerOperator(factors)` acts on arrays shaped `(n_1, ..., n_k)` by applying factor `i`
along axis `i`, so `as_matrix()` is `kron(f_1, ..., f_k)` for row-major flattening.
`BlockDiagonalOperator(blocks)` acts on a tuple with one entry per block. Both register with
lineax's single-dispatch functions. Their damped powers and solves are in `kronecker.py` and
`solvers.py`.
"""

import functools as ft
from collections.abc import Sequence

import equinox as eqx
import jax
import jax.numpy as jnp
import lineax as lx
from jaxtyping import Array, ArrayLike, Inexact, PyTree


def _frozenset(tags: object) -> frozenset[object]:
    try:
        return frozenset(tags)  # pyright: ignore[reportArgumentType]
    except TypeError:
        return frozenset([tags])


def apply_along_axis(matrix: Array, x: Array, axis: int) -> Array:
    out = jnp.tensordot(matrix, x, axes=((1,), (axis,)), precision=jax.lax.Precision.HIGHEST)
    return jnp.moveaxis(out, 0, axis)


def apply_factors(
    factors: Sequence[Array], x: Array, axes: Sequence[int] | None = None
) -> Array:
    """`(f_1 ⊗ ... ⊗ f_k)` applied to `x`, factor `i` along axis `axes[i]` (default: axis `i`)."""
    for axis, factor in zip(range(len(factors)) if axes is None else axes, factors, strict=True):
        x = apply_along_axis(factor, x, axis)
    return x


def kron_vectors(vectors: Sequence[Array]) -> Array:
    """Flattened outer product of vectors, in `kron` order."""
    return ft.reduce(lambda a, b: (a[:, None] * b[None, :]).reshape(-1), vectors)


def symmetrise(matrix: Array) -> Array:
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
        return kron_vectors([jnp.diagonal(f) for f in operator.factors])
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
