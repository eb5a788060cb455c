"""PyTree helpers that optax.tree does not provide (its `vdot`, `norm` and friends are used directly)."""

from collections.abc import Hashable, Sequence

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.typing import ArrayLike
from jaxtyping import Array, Bool, PyTree


def flat_rows(trees: Sequence[PyTree[Array]], batch_dims: int = 0) -> Array:
    """The inexact array leaves of each tree raveled and concatenated into one row per tree:
    `(len(trees), D)`, in the promoted dtype of all leaves; with `batch_dims=1`, each tree's
    leaves share a leading axis of rows, which is kept (`(len(trees) · rows, D)`).

    One concatenated array instead of one operation per leaf: reductions and inner products over
    a PyTree then compile to one kernel (XLA compiles each per-leaf reduction into several).

    **Arguments:**

    - `trees`: PyTrees of the same structure.
    - `batch_dims`: `0`, or `1` when the leaves carry a leading axis of rows.

    **Returns:**

    A 2-D array.
    """
    rows = []
    for tree in trees:
        leaves = [x for x in jax.tree.leaves(tree) if eqx.is_inexact_array(x)]
        lead = leaves[0].shape[0] if batch_dims and leaves else 1
        rows.append([jnp.reshape(x, (lead, -1)) for x in leaves])
    dtype = jnp.result_type(*[x for row in rows for x in row], jnp.float32)
    return jnp.concatenate(
        [jnp.concatenate([x.astype(dtype) for x in row], axis=1) for row in rows if row]
        or [jnp.zeros((len(trees), 0), dtype)]
    )


def all_finite(tree: PyTree) -> Bool[Array, ""]:
    """Whether every inexact array leaf of `tree` is finite (no NaN or infinity).

    **Arguments:**

    - `tree`: any PyTree; non-array and integer leaves are ignored.

    **Returns:**

    A boolean scalar.
    """
    leaves = [x for x in jax.tree.leaves(tree) if eqx.is_inexact_array(x)]
    if not leaves:
        return jnp.asarray(True)
    return jnp.all(jnp.isfinite(jnp.concatenate([jnp.ravel(x).astype(jnp.result_type(*leaves)) for x in leaves])))


def scale_keeping_dtypes(tree: PyTree[Array], factor: ArrayLike) -> PyTree[Array]:
    """`factor * tree`, with `factor` cast to each leaf's dtype first.

    (`optax.tree.scale` promotes: a float64 factor would turn float32 leaves into float64.)

    **Arguments:**

    - `tree`: a PyTree of arrays.
    - `factor`: a scalar.

    **Returns:**

    The scaled PyTree, each leaf with its own dtype.
    """
    return jax.tree.map(lambda x: x * jnp.asarray(factor, x.dtype), tree)


def abstract_arrays(tree: PyTree) -> PyTree:
    """`tree` with every array leaf replaced by its `jax.ShapeDtypeStruct`.

    **Arguments:**

    - `tree`: any PyTree.

    **Returns:**

    The PyTree, with its other leaves unchanged.
    """
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype) if eqx.is_array(x) else x, tree)


def signature(tree: PyTree) -> Hashable:
    """The structure, shapes and dtypes of `tree`: equal for trees that trace alike.

    **Arguments:**

    - `tree`: any PyTree; array and `jax.ShapeDtypeStruct` leaves count by shape and dtype, other
      leaves by value.

    **Returns:**

    `(treedef, leaves)`, hashable when the non-array leaves are.
    """
    leaves, treedef = jax.tree.flatten(tree)
    return (treedef, tuple(
        (tuple(x.shape), str(x.dtype)) if eqx.is_array(x) or isinstance(x, jax.ShapeDtypeStruct)
        else ("static", x)
        for x in leaves
    ))
