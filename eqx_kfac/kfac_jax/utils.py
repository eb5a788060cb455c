"""`kfac_jax.utils` as kfac-jax code uses it: the type aliases, the helpers of kfac-jax's
replicated calling convention (one copy of the parameters per local device, a leading device axis
on the batch and the keys), and the PyTree arithmetic of its README and examples.

With `eqx_kfac.kfac_jax.Optimizer(multi_device=True)`, arguments made by these helpers are taken
as kfac-jax takes them (see `Optimizer.step`); `eqx_kfac.Optimizer` takes plain values instead.
"""

import functools
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, TypeVar

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.typing import ArrayLike, DTypeLike

from .._core.distributed import pmean
from .._core.linalg import spd_inverse
from .._core.tree import inner_products
from .._curvature.estimators import default_batch_size_extractor as default_batch_size_extractor
from .._curvature.operators.kronecker_powers import pi_adjusted_inverse
from ._block_adapter import WeightedMovingAverage as WeightedMovingAverage

# kfac-jax's type aliases (`kfac_jax/_src/utils/types.py`), for annotations.
T = TypeVar("T")
Array = jax.Array
PRNGKey = jax.Array
Scalar = float | int
Numeric = jax.Array | float | int
Shape = tuple[int, ...]
DType = DTypeLike
PyTree = Any
ArrayTree = Any
TArrayTree = TypeVar("TArrayTree")
Params = TypeVar("Params")
Batch = TypeVar("Batch")
FuncState = TypeVar("FuncState")
FuncAux = dict[str, Any]
PyTreeDef = jax.tree_util.PyTreeDef
FuncArgs = Sequence[Any]
FuncOuts = jax.Array | tuple[jax.Array, FuncAux]
Func = Callable[..., FuncOuts]
ValueFunc = Callable[..., jax.Array]
ValueAndGradFunc = Callable[..., tuple[jax.Array, Any]]
ScheduleType = Callable[..., ArrayLike]


def tree_is_empty(obj: PyTree) -> bool:
    """Whether `obj` has no leaves."""
    return not jax.tree.leaves(obj)


# --- the replicated calling convention ---------------------------------------------------------


def _device_mesh(axis_name: str | None) -> jax.sharding.Mesh:
    return jax.sharding.Mesh(jax.local_devices(), (axis_name or "kfac_devices",))


def _over_devices(axis_name: str | None) -> jax.NamedSharding:
    """The sharding of an array split along its leading axis, one entry per local device."""
    mesh = _device_mesh(axis_name)
    return jax.NamedSharding(mesh, jax.sharding.PartitionSpec(mesh.axis_names[0]))


def _split_over_devices(x: ArrayLike, axis_name: str | None) -> jax.Array:
    """`x`, whose leading axis has one entry per local device, placed one entry on each."""
    return jax.device_put(x, _over_devices(axis_name))


@functools.cache
def _replicator(axis_name: str | None) -> Callable[[PyTree], PyTree]:
    """One compiled program that stacks `jax.local_device_count()` copies of every leaf, one on
    each device (one dispatch for the whole tree)."""
    n = jax.local_device_count()
    stack = lambda tree: jax.tree.map(lambda x: jnp.broadcast_to(x, (n, *jnp.shape(x))), tree)
    return jax.jit(stack, out_shardings=_over_devices(axis_name))


def replicate_all_local_devices(obj: PyTree, axis_name: str | None = None) -> PyTree:
    """One copy of `obj` per local device, stacked along a new leading axis (kfac-jax's function).

    **Arguments:**

    - `obj`: a PyTree of arrays.
    - `axis_name`: the name of the device axis of the sharding (any name works here).

    **Returns:**

    `obj` with a leading axis of `jax.local_device_count()` copies, one on each device.
    """
    if tree_is_empty(obj):
        return obj
    return _replicator(axis_name)(obj)


def broadcast_all_local_devices(obj: PyTree, axis_name: str | None = None) -> PyTree:
    """Places `obj`, whose leaves have one entry per local device along their leading axis, one
    entry on each device (kfac-jax's function).

    **Arguments:**

    - `obj`: a PyTree of arrays with a leading axis of `jax.local_device_count()`.
    - `axis_name`: the name of the device axis of the sharding.

    **Returns:**

    `obj`, split over the local devices.
    """
    return jax.tree.map(lambda x: _split_over_devices(x, axis_name), obj)


_take = jax.jit(lambda tree, n: jax.tree.map(lambda x: x[n], tree))


def get_device_n_contents(obj: PyTree, n: int) -> PyTree:
    """Entry `n` of the leading (device) axis of every array of `obj` (kfac-jax's function).

    **Arguments:**

    - `obj`: a PyTree of per-device arrays (Python scalars and 0-d arrays are returned as they
      are).
    - `n`: the device's index.

    **Returns:**

    The PyTree of device `n`'s values.
    """
    arrays, rest = eqx.partition(obj, lambda x: isinstance(x, jax.Array) and x.ndim > 0)
    return eqx.combine(_take(arrays, n), rest)


def get_first(obj: PyTree) -> PyTree:
    """The first device's values of a per-device PyTree (kfac-jax's function).

    **Arguments:**

    - `obj`: a PyTree of per-device arrays.

    **Returns:**

    `get_device_n_contents(obj, 0)`.
    """
    return get_device_n_contents(obj, 0)


def get_mean(obj: PyTree) -> PyTree:
    """The mean over the leading (device) axis of every array of `obj`.

    **Arguments:**

    - `obj`: a PyTree of per-device arrays.

    **Returns:**

    The PyTree of means.
    """
    return jax.tree.map(lambda x: jnp.mean(x, axis=0), obj)


def get_sum(obj: PyTree) -> PyTree:
    """The sum over the leading (device) axis of every array of `obj`.

    **Arguments:**

    - `obj`: a PyTree of per-device arrays.

    **Returns:**

    The PyTree of sums.
    """
    return jax.tree.map(lambda x: jnp.sum(x, axis=0), obj)


def make_different_rng_key_on_all_devices(rng: PRNGKey) -> PRNGKey:
    """One different key per local device (and process), split over the devices (kfac-jax's
    function).

    **Arguments:**

    - `rng`: a PRNG key.

    **Returns:**

    `jax.local_device_count()` keys, stacked.
    """
    rng = jax.random.fold_in(rng, jax.process_index())
    return broadcast_all_local_devices(jax.random.split(rng, jax.local_device_count()))


def p_split(key: PRNGKey) -> tuple[PRNGKey, PRNGKey]:
    """Splits each device's key in two (kfac-jax's `jax.pmap`-ed `jax.random.split`).

    **Arguments:**

    - `key`: one key per device.

    **Returns:**

    Two stacks of keys, one per device each.
    """
    return p_split_num(key, 2)


def p_split_num(key: PRNGKey, num: int) -> tuple[PRNGKey, ...]:
    """Splits each device's key in `num` (kfac-jax's function).

    **Arguments:**

    - `key`: one key per device.
    - `num`: the number of keys made from each.

    **Returns:**

    `num` stacks of keys, one per device each.
    """
    keys = jax.vmap(lambda k: jax.random.split(k, num))(key)
    return tuple(broadcast_all_local_devices(keys[:, i]) for i in range(num))


def _axis_bound(axis_name: str | None) -> bool:
    if axis_name is None:
        return False
    try:
        jax.lax.axis_size(axis_name)
    except NameError:
        return False
    return True


def in_pmap(axis_name: str | None) -> bool:
    """Whether the code runs inside a map over the devices with the axis `axis_name` (a
    `jax.pmap`, `jax.shard_map`, or the step of `Optimizer(multi_device=True)`).

    **Arguments:**

    - `axis_name`: the axis's name, or `None`.

    **Returns:**

    Whether the axis is bound.
    """
    return _axis_bound(axis_name)


def wrap_if_pmap(p_func: Callable[[Any, str], Any]) -> Callable[[Any, str | None], Any]:
    """`p_func(obj, axis_name)` where the axis is bound, `obj` elsewhere (kfac-jax's function).

    **Arguments:**

    - `p_func`: a collective, e.g. `jax.lax.pmean`.

    **Returns:**

    The wrapped function.
    """

    @functools.wraps(p_func)
    def if_pmap(obj: Any, axis_name: str | None) -> Any:
        return p_func(obj, axis_name) if in_pmap(axis_name) else obj

    return if_pmap


def pmean_if_pmap(obj: PyTree, axis_name: str | None) -> PyTree:
    """The mean over the devices of `obj`'s inexact arrays where the axis is bound, `obj` elsewhere.

    **Arguments:**

    - `obj`: a PyTree.
    - `axis_name`: the devices' axis, or `None`.

    **Returns:**

    A PyTree like `obj`.
    """
    return pmean(obj, axis_name if in_pmap(axis_name) else None)


def psum_if_pmap(obj: PyTree, axis_name: str | None) -> PyTree:
    """The sum over the devices of `obj` where the axis is bound, `obj` elsewhere.

    **Arguments:**

    - `obj`: a PyTree.
    - `axis_name`: the devices' axis, or `None`.

    **Returns:**

    A PyTree like `obj`.
    """
    return jax.lax.psum(obj, axis_name) if in_pmap(axis_name) else obj


# --- PyTree arithmetic ------------------------------------------------------------------------


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
