"""PyTree helpers that optax.tree does not provide (its `vdot`, `norm` and friends are used directly)."""

from collections.abc import Hashable, Sequence
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.typing import ArrayLike
from jaxtyping import Array, Bool, Float, PyTree


def _inexact_leaves(tree: PyTree) -> list[Array]:
    return [x for x in jax.tree.leaves(tree) if eqx.is_inexact_array(x)]


def sums(arrays: Sequence[Array]) -> Float[Array, " n"]:
    """The sums of arrays of one shape and dtype, one reduction each.

    XLA fuses elementwise producers into each reduction: `sums([a * b, a * c])` writes two
    numbers, where `jnp.sum(jnp.stack(...))` would write the stack first. One variadic reduction
    (`lax.reduce` of a tuple) would read `a` once instead of twice, but XLA:CPU compiles it to
    scalar code: on a 1729² float32 matrix, three sums as one variadic reduction took 3.6 ms and
    as three reductions 0.8 ms.

    **Arguments:**

    - `arrays`: arrays of one shape and one dtype.

    **Returns:**

    The vector of their sums, in their dtype.
    """
    return jnp.stack([jnp.sum(x) for x in arrays])


# Leaves with fewer elements than this are concatenated before a reduction (one compiled kernel
# for all of them instead of one each), larger ones are reduced where they lie (a concatenation
# would copy them): 64Ki float32 numbers copy in about the time a kernel takes to launch.
SMALL_LEAF = 1 << 16


def positions_by_size(positions: Sequence[tuple[Array, ...]], dtype: Any) -> list[tuple[Array, ...]]:
    """Leaf positions (tuples of arrays of one shape) as reductions should read them: each large
    position as it is, and the small ones (below `SMALL_LEAF` elements) as one position of
    concatenations, raveled and cast to `dtype`.

    **Arguments:**

    - `positions`: tuples of arrays; the arrays of one tuple share a shape, the tuples have one
      length.
    - `dtype`: the dtype of the concatenations.

    **Returns:**

    The large positions, then (if there are small ones) the concatenated position.
    """
    large = [p for p in positions if p[0].size >= SMALL_LEAF]
    small = [p for p in positions if p[0].size < SMALL_LEAF]
    if small:
        large.append(
            tuple(jnp.concatenate([jnp.ravel(p[i]).astype(dtype) for p in small]) for i in range(len(small[0])))
        )
    return large


def inner_products(pairs: Sequence[tuple[PyTree[Array], PyTree[Array]]]) -> Float[Array, " n"]:
    """The inner products `⟨a_k, b_k⟩` of PyTree pairs, in the promoted dtype of all leaves.

    Large leaves are read where they lie and the small ones together (`positions_by_size`), one
    reduction per pair and position (`sums`): a few kernels, and no copy of a large vector.

    **Arguments:**

    - `pairs`: `(a_k, b_k)` pairs of PyTrees, all of the same structure.

    **Returns:**

    A vector with one inner product per pair.
    """
    lefts = [_inexact_leaves(a) for a, _ in pairs]
    rights = [_inexact_leaves(b) for _, b in pairs]
    dtype = jnp.result_type(*[x for leaves in lefts + rights for x in leaves], jnp.float32)
    total = jnp.zeros(len(pairs), dtype)
    for position in positions_by_size(list(zip(*lefts, *rights)), dtype):
        a, b = position[: len(pairs)], position[len(pairs) :]
        total = total + sums([x.astype(dtype) * y.astype(dtype) for x, y in zip(a, b)])
    return total


def zero_or_nan(x: Array) -> Array:
    """`x * 0` in `x`'s own dtype: 0 where `x` is finite, NaN where it is not, so that a sum of
    it is finite exactly when every element is (no overflow, unlike a sum of `x` itself)."""
    return x * jnp.zeros((), x.dtype)


def all_finite(tree: PyTree) -> Bool[Array, ""]:
    """Whether every inexact array leaf of `tree` is finite (no NaN or infinity).

    One reduction per distinct leaf shape, and no copy: the sum over the leaves of one shape of
    `zero_or_nan` is finite exactly when they all are.

    **Arguments:**

    - `tree`: any PyTree; non-array and integer leaves are ignored.

    **Returns:**

    A boolean scalar.
    """
    by_shape: dict[tuple[int, ...], Array] = {}
    for x in _inexact_leaves(tree):
        zero = zero_or_nan(x)
        by_shape[x.shape] = zero if x.shape not in by_shape else by_shape[x.shape] + zero
    return jnp.isfinite(sum((jnp.sum(z) for z in by_shape.values()), jnp.zeros((), jnp.float32)))


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


def filled(leaves: Sequence[Any], positions: Sequence[int], values: Sequence[Any]) -> list[Any]:
    """A copy of `leaves` with `values` at `positions` (the arrays of a flattened tree put back
    among its other leaves).

    **Arguments:**

    - `leaves`: a flat list, e.g. of a tree's leaves.
    - `positions`: the indices to fill, one per value.
    - `values`: the new values.

    **Returns:**

    The new list.
    """
    leaves = list(leaves)
    for position, x in zip(positions, values):
        leaves[position] = x
    return leaves


def any_traced(tree: PyTree) -> bool:
    """Whether any leaf of `tree` is a tracer (the tree is being traced by `jit`, `vmap`, ...).

    **Arguments:**

    - `tree`: any PyTree.

    **Returns:**

    A Python bool.
    """
    return any(isinstance(leaf, jax.core.Tracer) for leaf in jax.tree.leaves(tree))


def under_a_trace() -> bool:
    """Whether a transformation that stages operations out (`jit`, `make_jaxpr`, ...) is tracing
    the caller: there JAX stages even an operation on constants, so a new array is a tracer (under
    `grad` or `vmap` alone it is not, and a `jit` called there on concrete arrays runs as a
    top-level one).

    **Returns:**

    A Python bool.
    """
    return isinstance(jnp.zeros((), jnp.int8), jax.core.Tracer)


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
