"""PyTree helpers that optax.tree does not provide (its `vdot`, `norm` and friends are used directly)."""

from collections.abc import Hashable

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.typing import ArrayLike
from jaxtyping import Array, Bool, PyTree


def all_finite(tree: PyTree) -> Bool[Array, ""]:
    """Whether every inexact array leaf of `tree` is finite (no NaN or infinity).

    **Arguments:**

    - `tree`: any PyTree; non-array and integer leaves are ignored.

    **Returns:**

    A boolean scalar.
    """
    leaves = [x for x in jax.tree.leaves(tree) if eqx.is_inexact_array(x)]
    return jnp.all(jnp.asarray([jnp.all(jnp.isfinite(x)) for x in leaves] or [True]))


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
