"""PyTree helpers that optax.tree does not provide (its `vdot`, `norm` and friends are used directly)."""

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
