"""kfac-jax's PyTree arithmetic (`kfac_jax.utils`' `inner_product`, `norm`, ..., and the moving
averages' `default_add_function`), as its README and examples use it. `utils` re-exports every
name.
"""

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike
from jaxtyping import PyTree

from .._core.linalg import spd_inverse
from .._core.tree import inner_products
from .._curvature.operators.kronecker_powers import pi_adjusted_inverse

TArrayTree = TypeVar("TArrayTree")


def product(iterable_object: Iterable[Any]) -> Any:
    """The product of the elements (`math.prod`).

    **Arguments:**

    - `iterable_object`: numbers or arrays.

    **Returns:**

    Their product (`1` for none).
    """
    return math.prod(iterable_object)


def inner_product(obj1: PyTree, obj2: PyTree, in_float64: bool = False) -> jax.Array:
    """The inner product of two PyTrees of the same structure, `<vec(obj1), vec(obj2)>`.

    **Arguments:**

    - `obj1`, `obj2`: PyTrees of arrays.
    - `in_float64`: compute in float64 (needs `jax_enable_x64`).

    **Returns:**

    A scalar.
    """
    if in_float64:
        obj1, obj2 = (jax.tree.map(lambda x: jnp.asarray(x, jnp.float64), o) for o in (obj1, obj2))
    return inner_products([(obj1, obj2)])[0]


def squared_norm(obj: PyTree) -> jax.Array:
    """The squared Euclidean norm of a PyTree of arrays.

    **Arguments:**

    - `obj`: a PyTree of arrays.

    **Returns:**

    A scalar.
    """
    return inner_product(obj, obj)


def norm(obj: PyTree) -> jax.Array:
    """The Euclidean norm of a PyTree of arrays.

    **Arguments:**

    - `obj`: a PyTree of arrays.

    **Returns:**

    A scalar.
    """
    return jnp.sqrt(squared_norm(obj))


def per_parameter_norm(obj: PyTree, key_prefix: str) -> Mapping[str, jax.Array]:
    """The norm of each leaf, keyed `f"{key_prefix}({path})"` (paths joined by `/`).

    **Arguments:**

    - `obj`: a PyTree of arrays.
    - `key_prefix`: the keys' prefix.

    **Returns:**

    A dict of scalars.
    """
    leaves = jax.tree_util.tree_leaves_with_path(obj)
    name = lambda path: "/".join(str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))) for k in path)
    return {f"{key_prefix}({name(path)})": jnp.linalg.norm(x) for path, x in leaves}


def scalar_mul(obj: PyTree, scalar: ArrayLike) -> PyTree:
    """Every leaf of `obj` times `scalar`.

    **Arguments:**

    - `obj`: a PyTree of arrays.
    - `scalar`: a number.

    **Returns:**

    The scaled PyTree.
    """
    return jax.tree.map(lambda x: x * scalar, obj)


def scalar_div(obj: PyTree, scalar: ArrayLike) -> PyTree:
    """Every leaf of `obj` divided by `scalar`.

    **Arguments:**

    - `obj`: a PyTree of arrays.
    - `scalar`: a number.

    **Returns:**

    The scaled PyTree.
    """
    return jax.tree.map(lambda x: x / scalar, obj)


def weighted_sum_of_objects(objects: Sequence[PyTree], coefficients: Sequence[ArrayLike]) -> PyTree:
    """`sum_i coefficients[i] * objects[i]` for PyTrees of the same structure.

    **Arguments:**

    - `objects`: the PyTrees.
    - `coefficients`: one number each.

    **Returns:**

    The weighted sum.
    """
    return jax.tree.map(lambda *xs: sum(c * x for c, x in zip(coefficients, xs, strict=True)), *objects)


def default_add_function(obj1: TArrayTree, obj2: TArrayTree, coeff1: ArrayLike, coeff2: ArrayLike) -> TArrayTree:
    """`coeff1 * obj1 + coeff2 * obj2` for PyTrees of the same structure: how kfac-jax's moving
    averages combine the old value with the new one (kfac-jax's function).

    **Arguments:**

    - `obj1`, `obj2`: PyTrees of arrays.
    - `coeff1`, `coeff2`: one number each.

    **Returns:**

    The weighted sum, a PyTree like `obj1`.
    """
    return weighted_sum_of_objects([obj1, obj2], [coeff1, coeff2])


def sum_of_objects(objects: Sequence[PyTree]) -> PyTree:
    """The sum of PyTrees of the same structure.

    **Arguments:**

    - `objects`: the PyTrees.

    **Returns:**

    Their sum.
    """
    return weighted_sum_of_objects(objects, [1] * len(objects))


def psd_inv(matrix: jax.Array) -> jax.Array:
    """The inverse of a symmetric positive-definite matrix (`eqx_kfac`'s Cholesky inverse).

    **Arguments:**

    - `matrix`: an `(n, n)` matrix, or a stack of them.

    **Returns:**

    The inverse.
    """
    return spd_inverse(matrix)


def pi_adjusted_kronecker_inverse(*factors: jax.Array, damping: ArrayLike) -> tuple[jax.Array, ...]:
    """The pi-adjusted damped inverses of Kronecker factors: `(f_1 ⊗ ... ⊗ f_k + damping I)^-1`
    is approximated by the Kronecker product of the returned matrices.

    **Arguments:**

    - `factors`: the Kronecker factors, square matrices.
    - `damping`: the damping.

    **Returns:**

    One inverse factor per factor.
    """
    return tuple(pi_adjusted_inverse(factors, damping).factors)
