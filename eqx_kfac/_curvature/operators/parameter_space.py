"""A lineax operator on parameter-space vectors made of an operator on per-block vectors."""

import numpy as np
import equinox as eqx
import jax
import jax.numpy as jnp
import lineax as lx
from jaxtyping import Array, Inexact, PyTree

from ..._core.compiled import compiled
from .spectral import eigenvalues, frobenius_norm, logdet, matpower, trace


class ParameterSpaceOperator(lx.AbstractLinearOperator):
    """A block-structured operator seen in parameter space.

    `inner` acts on a tuple with one entry per curvature block (each a tuple of that block's
    parameter arrays, as `BlockDiagonalOperator` does); this operator acts on parameter-space
    vectors (the structure of `eqx.filter(params, eqx.is_inexact_array)`), routing each leaf to
    its block and back. `as_matrix()` is ordered like the parameter leaves, each flattened
    row-major. Trace, log-determinant, eigenvalues and Frobenius norm are those of `inner`
    (a permutation changes none of them), and `matpower` is `inner`'s routed the same way, so
    they keep its structure.

    **Fields:**

    - `inner`: the operator on block vectors.
    - `treedef`: the tree structure of parameter-space vectors (static).
    - `block_indices`: for each block, the positions of its parameters among the leaves (static).
    """

    inner: lx.AbstractLinearOperator
    treedef: jax.tree_util.PyTreeDef = eqx.field(static=True)
    block_indices: tuple[tuple[int, ...], ...] = eqx.field(static=True)

    def _to_blocks(self, vector: PyTree[Array]) -> tuple[tuple[Array, ...], ...]:
        leaves = jax.tree.leaves(vector)
        return tuple(tuple(leaves[i] for i in idx) for idx in self.block_indices)

    def _from_blocks(self, blocks: tuple[tuple[PyTree, ...], ...]) -> PyTree:
        leaves = [None] * self.treedef.num_leaves
        for idx, block in zip(self.block_indices, blocks):
            for i, leaf in zip(idx, block):
                leaves[i] = leaf
        return jax.tree.unflatten(self.treedef, leaves)

    def _permutation(self) -> np.ndarray:
        """`perm` with `as_matrix() == inner.as_matrix()[perm][:, perm]`."""
        sizes = [
            int(np.prod(s.shape, dtype=int))
            for s in jax.tree.leaves(self._from_blocks(self.inner.in_structure()))
        ]
        offsets = np.cumsum([0, *sizes[:-1]])
        block_order = np.concatenate(
            [np.arange(offsets[i], offsets[i] + sizes[i]) for idx in self.block_indices for i in idx]
        ).astype(int)
        return np.argsort(block_order)

    @compiled
    def mv(self, vector: PyTree[Inexact[Array, "..."]]) -> PyTree[Inexact[Array, "..."]]:
        return self._from_blocks(self.inner.mv(self._to_blocks(vector)))

    @compiled
    def as_matrix(self) -> Inexact[Array, "a b"]:
        perm = self._permutation()
        return self.inner.as_matrix()[perm][:, perm]

    def transpose(self) -> "ParameterSpaceOperator":
        return ParameterSpaceOperator(self.inner.transpose(), self.treedef, self.block_indices)

    def in_structure(self) -> PyTree[jax.ShapeDtypeStruct]:
        return self._from_blocks(self.inner.in_structure())

    def out_structure(self) -> PyTree[jax.ShapeDtypeStruct]:
        return self._from_blocks(self.inner.out_structure())


for _transform in (lx.linearise, lx.materialise, lx.conj):

    @_transform.register(ParameterSpaceOperator)
    def _(operator, _transform=_transform):
        return ParameterSpaceOperator(
            _transform(operator.inner), operator.treedef, operator.block_indices
        )


@lx.diagonal.register(ParameterSpaceOperator)
def _(operator):
    return lx.diagonal(operator.inner)[operator._permutation()]


@lx.tridiagonal.register(ParameterSpaceOperator)
def _(operator):
    # Permuting the basis scatters the inner operator's bands; the dense matrix is the simple route.
    matrix = operator.as_matrix()
    return jnp.diagonal(matrix), jnp.diagonal(matrix, -1), jnp.diagonal(matrix, 1)


for _check in (
    lx.is_symmetric,
    lx.is_diagonal,
    lx.has_unit_diagonal,
    lx.is_positive_semidefinite,
    lx.is_negative_semidefinite,
):

    @_check.register(ParameterSpaceOperator)
    def _(operator, _check=_check):
        return _check(operator.inner)


for _check in (lx.is_tridiagonal, lx.is_lower_triangular, lx.is_upper_triangular):

    @_check.register(ParameterSpaceOperator)
    def _(operator, _check=_check):
        # A permutation keeps a diagonal diagonal but not a band or a triangle.
        return lx.is_diagonal(operator.inner)


for _spectral in (trace, frobenius_norm, eigenvalues, logdet):

    @_spectral.register(ParameterSpaceOperator)
    @compiled
    def _(operator, _spectral=_spectral):
        return _spectral(operator.inner)


@matpower.register(ParameterSpaceOperator)
def _(operator, power, exact=True):
    return ParameterSpaceOperator(
        matpower(operator.inner, power, exact), operator.treedef, operator.block_indices
    )
