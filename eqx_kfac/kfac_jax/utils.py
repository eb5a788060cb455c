"""`kfac_jax.utils` as kfac-jax code uses it: the type aliases, the helpers of kfac-jax's
replicated calling convention (one copy of the parameters per local device, a leading device axis
on the batch and the keys), the PyTree arithmetic of its README and examples (defined in
`_utils_arithmetic`), and what `examples/training.py` uses besides: `serialize_state_tree`,
`host_all_gather` and `MultiChunkAccumulator`.

With `eqx_kfac.kfac_jax.Optimizer(multi_device=True)`, arguments made by these helpers are taken
as kfac-jax takes them (see `Optimizer.step`); `eqx_kfac.Optimizer` takes plain values instead.
"""

import functools
from collections.abc import Callable, Sequence
from typing import Any, Generic, TypeVar

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.experimental import multihost_utils
from jax.typing import ArrayLike, DTypeLike

from .._core.tree import filled
from .._curvature.estimators import default_batch_size_extractor as default_batch_size_extractor
from ._block_adapter import WeightedMovingAverage as WeightedMovingAverage
from ._axes import in_pmap as in_pmap, pmean_if_pmap as pmean_if_pmap
from ._utils_arithmetic import (
    default_add_function as default_add_function,
    inner_product as inner_product,
    norm as norm,
    per_parameter_norm as per_parameter_norm,
    pi_adjusted_kronecker_inverse as pi_adjusted_kronecker_inverse,
    product as product,
    psd_inv as psd_inv,
    scalar_div as scalar_div,
    scalar_mul as scalar_mul,
    squared_norm as squared_norm,
    sum_of_objects as sum_of_objects,
    weighted_sum_of_objects as weighted_sum_of_objects,
)

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


def _stacked_copies(tree: PyTree) -> PyTree:
    """`jax.local_device_count()` copies of every leaf, stacked along a new leading axis."""
    n = jax.local_device_count()
    return jax.tree.map(lambda x: jnp.broadcast_to(x, (n, *jnp.shape(x))), tree)


@functools.cache
def _replicator(axis_name: str | None) -> Callable[[PyTree], PyTree]:
    """One compiled program that stacks `jax.local_device_count()` copies of every leaf, one on
    each device (one dispatch for the whole tree)."""
    return jax.jit(_stacked_copies, out_shardings=_over_devices(axis_name))


def replicated_in_program(tree: PyTree, axis_name: str | None = None) -> PyTree:
    """`replicate_all_local_devices(tree, axis_name)` inside a traced program (a sharding
    constraint on the stacked copies instead of a program of its own); non-array leaves stay.

    **Arguments:**

    - `tree`: a PyTree (of tracers, inside `jit`).
    - `axis_name`: the name of the device axis of the sharding.

    **Returns:**

    The PyTree with one copy per local device along a new leading axis.
    """
    arrays, rest = eqx.partition(tree, eqx.is_array)
    stacked = jax.lax.with_sharding_constraint(_stacked_copies(arrays), _over_devices(axis_name))
    return eqx.combine(stacked, rest)


def replicate_all_local_devices(obj: PyTree, axis_name: str | None = None) -> PyTree:
    """One copy of `obj` per local device, stacked along a new leading axis (kfac-jax's function).

    **Arguments:**

    - `obj`: a PyTree of arrays.
    - `axis_name`: the name of the device axis of the sharding (any name works here).

    **Returns:**

    `obj` with a leading axis of `jax.local_device_count()` copies, one on each device.
    """
    # (The program takes the flat list of leaves, flattened once here: `jit` of the tree, after a
    # walk to find whether it has leaves, took 1.22 ms of FermiNet He's step, this 0.85 ms.)
    leaves, treedef = jax.tree.flatten(obj)
    if not leaves:
        return obj
    return jax.tree.unflatten(treedef, _replicator(axis_name)(leaves))


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


@functools.cache
def _taker(n: int, sharding: jax.sharding.Sharding | None) -> Callable[[PyTree], PyTree]:
    """One compiled program taking entry `n` of every leaf, its outputs laid out by `sharding`."""
    return jax.jit(lambda tree: jax.tree.map(lambda x: x[n], tree), out_shardings=sharding)


def device_contents_placed(obj: PyTree, n: int, sharding: jax.sharding.Sharding | None) -> PyTree:
    """`get_device_n_contents(obj, n)` with its arrays laid out by `sharding` (`None`: as XLA
    places them) by the program that takes them.

    **Arguments:**

    - `obj`: a PyTree of per-device arrays (Python scalars and 0-d arrays are returned as they
      are).
    - `n`: the device's index.
    - `sharding`: the outputs' sharding.

    **Returns:**

    The PyTree of device `n`'s values.
    """
    # (One flatten and the flat list to the program: `eqx.partition` and `eqx.combine` around a
    # `jit` of the tree took 2.47 ms of FermiNet He's step, this 0.80 ms.)
    leaves, treedef = jax.tree.flatten(obj)
    positions = [k for k, x in enumerate(leaves) if isinstance(x, jax.Array) and x.ndim > 0]
    taken = _taker(n, sharding)([leaves[k] for k in positions])
    return jax.tree.unflatten(treedef, filled(leaves, positions, taken))


def get_device_n_contents(obj: PyTree, n: int) -> PyTree:
    """Entry `n` of the leading (device) axis of every array of `obj` (kfac-jax's function).

    **Arguments:**

    - `obj`: a PyTree of per-device arrays (Python scalars and 0-d arrays are returned as they
      are).
    - `n`: the device's index.

    **Returns:**

    The PyTree of device `n`'s values.
    """
    return device_contents_placed(obj, n, None)


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
    return _splitter(num)(key)


@functools.cache
def _splitter(num: int) -> Callable[[PRNGKey], tuple[PRNGKey, ...]]:
    """One compiled program splitting each device's key in `num`, the stacks split over the
    devices. (Splitting eagerly traced `vmap` at every call: 3 ms of FermiNet's 10 ms iteration,
    which calls it twice; kfac-jax's is a `pmap`.)"""

    def split(key: PRNGKey) -> tuple[PRNGKey, ...]:
        keys = jax.vmap(lambda k: jax.random.split(k, num))(key)
        return tuple(keys[:, i] for i in range(num))

    return jax.jit(split, out_shardings=_over_devices(None))


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


def psum_if_pmap(obj: PyTree, axis_name: str | None) -> PyTree:
    """The sum over the devices of `obj` where the axis is bound, `obj` elsewhere.

    **Arguments:**

    - `obj`: a PyTree.
    - `axis_name`: the devices' axis, or `None`.

    **Returns:**

    A PyTree like `obj`.
    """
    return jax.lax.psum(obj, axis_name) if in_pmap(axis_name) else obj


def host_all_gather(x: PyTree) -> PyTree:
    """Every process's value of each leaf of `x`, stacked (kfac-jax's function): in a single
    process `x` itself, as kfac-jax returns it; across processes
    `jax.experimental.multihost_utils.process_allgather` (a new leading axis of
    `jax.process_count()`).

    **Arguments:**

    - `x`: a PyTree of arrays, of the same shapes on every process.

    **Returns:**

    `x`, or the PyTree of the gathered arrays.
    """
    if jax.process_count() == 1:
        return x
    return jax.tree.map(jnp.asarray, multihost_utils.process_allgather(x))


# --- what examples/training.py uses besides -----------------------------------------------------


def _named_children(instance: Any) -> dict[str, Any] | None:
    """The children of a PyTree node whose children are named attributes (an `eqx.Module`'s
    fields but its static ones, a kfac-jax-style block `State`'s fields), by name; `None` for
    any other object."""
    if isinstance(instance, WeightedMovingAverage):
        return {"weight": instance.weight, "value": instance.value}
    if instance is None:
        return None
    children = jax.tree_util.tree_flatten_with_path(instance, is_leaf=lambda x: x is not instance)[0]
    if not all(len(path) == 1 and isinstance(path[0], jax.tree_util.GetAttrKey) for path, _ in children):
        return None  # a leaf (its path is empty), or a node whose children are not attributes
    return {path[0].name: child for path, child in children}


def serialize_state_tree(instance: PyTree) -> PyTree:
    """`instance` with every state object as a dict of its fields and its class's name under
    `"__class__"`, recursively (kfac-jax's function, which does so for its `State` classes).

    The state objects here are the PyTree nodes whose children are named attributes: an
    `eqx.Module` (`Optimizer.State` and every state in it) with its fields but its static ones, a
    kfac-jax-style block `State`, and kfac-jax's `WeightedMovingAverage` (`weight`, `value`).
    Lists, tuples (named tuples included, as plain tuples), sets and dicts are rebuilt with their
    entries serialised; anything else is returned as it is. The arrays of the result are those of
    `instance`, and its only other leaves are the class names.

    **Arguments:**

    - `instance`: a PyTree, e.g. an optimizer state.

    **Returns:**

    The serialised PyTree.
    """
    if isinstance(instance, list):
        return [serialize_state_tree(v) for v in instance]
    if isinstance(instance, tuple):
        return tuple(serialize_state_tree(v) for v in instance)
    if isinstance(instance, set):
        return {serialize_state_tree(v) for v in instance}
    if isinstance(instance, dict):
        return {k: serialize_state_tree(v) for k, v in instance.items()}
    fields = _named_children(instance)
    if fields is None:
        return instance
    cls = type(instance)
    return {**{k: serialize_state_tree(v) for k, v in fields.items()}, "__class__": f"{cls.__module__}.{cls.__qualname__}"}


def _quotient(value: PyTree, weight: ArrayLike) -> PyTree:
    """`value / weight`, `weight` (a number, or one per device) against the leading axes."""
    return jax.tree.map(lambda x: x / jnp.reshape(weight, jnp.shape(weight) + (1,) * (jnp.ndim(x) - jnp.ndim(weight))), value)


_jit_quotient = jax.jit(_quotient)


@functools.cache
def _device_mean_of_quotient() -> Callable[[PyTree, ArrayLike], PyTree]:
    """kfac-jax's `pmap_sync_and_divide_value` on the replicated convention's arrays: each
    device's `value / weight`, averaged over the devices, one copy on each device."""
    return jax.jit(lambda value, weight: _stacked_copies(get_mean(_quotient(value, weight))), out_shardings=_over_devices(None))


class MultiChunkAccumulator(Generic[T]):
    """A weighted sum of PyTrees added chunk by chunk, and its normalised value (kfac-jax's
    class, mutable as kfac-jax's: `add` and `clear` change it in place; a PyTree of
    `accumulator` and `weight`).

    `add(v, w)` adds `w * v` to the accumulator and `w` to the weight; `value` is the accumulator
    divided by the weight. With `multi_device=True` (values of the replicated convention, e.g. a
    `jax.pmap`'s outputs, and a weight with one entry per device) `value` is each device's
    quotient averaged over the devices, one copy per device, as kfac-jax's `pmean`.
    """

    def __init__(self, init_obj_value: T | None, weight: ArrayLike | None, multi_device: bool):
        """**Arguments:**

        - `init_obj_value`: the initial (not normalised) accumulator, or `None` for none.
        - `weight`: the weight counted in it.
        - `multi_device`: whether the accumulated values follow the replicated convention.
        """
        self._accumulator = init_obj_value
        self._weight = weight
        self._multi_device = multi_device

    @property
    def accumulator(self) -> T | None:
        """The weighted sum so far (not normalised)."""
        return self._accumulator

    @property
    def weight(self) -> ArrayLike | None:
        """The total weight so far."""
        return self._weight

    @property
    def multi_device(self) -> bool:
        """Whether the values follow the replicated convention."""
        return self._multi_device

    @property
    def value(self) -> T | None:
        """The accumulator divided by the weight (averaged over the devices with `multi_device`)."""
        if tree_is_empty(self._accumulator):
            return self._accumulator
        if self._multi_device:
            return _device_mean_of_quotient()(self._accumulator, self._weight)
        return _jit_quotient(self._accumulator, self._weight)

    def clear(self) -> None:
        """Sets the accumulator and the weight to `None`."""
        self._accumulator = None
        self._weight = None

    def value_and_clear(self) -> T | None:
        """The normalised value, then `clear()`.

        **Returns:**

        `value` before clearing.
        """
        value = self.value
        self.clear()
        return value

    def add(self, value_obj: T, weight: ArrayLike = 1) -> None:
        """Adds `weight * value_obj` to the accumulator and `weight` to the weight (in place).

        **Arguments:**

        - `value_obj`: a PyTree like the accumulator's (any, for the first chunk).
        - `weight`: a Python number, or an array shaped like the accumulator's weight.
        """
        value_obj = jax.tree.map(lambda x: x * weight, value_obj)
        if self._accumulator is None:
            self._accumulator = value_obj
            self._weight = _first_weight(self._weight, weight)
            return
        if tree_is_empty(self._accumulator) != tree_is_empty(value_obj):
            which = "an empty" if tree_is_empty(self._accumulator) else "a non-empty"
            raise ValueError(
                f"MultiChunkAccumulator.add: `value_obj` must be a PyTree like the accumulator, which holds {which} "
                "PyTree; add values of one structure to one accumulator."
            )
        if not tree_is_empty(value_obj):
            self._accumulator = jax.tree.map(jnp.add, self._accumulator, value_obj)
        self._weight = self._weight + weight

    @classmethod
    def zeros_like(cls, obj: T, multi_device: bool) -> "MultiChunkAccumulator[T]":
        """An accumulator of zeros like `obj`, weight zero (`int32`, one per device with
        `multi_device`).

        **Arguments:**

        - `obj`: a PyTree of arrays (per device, with a leading device axis, with `multi_device`).
        - `multi_device`: whether the values follow the replicated convention.

        **Returns:**

        The accumulator.
        """
        zeros = jax.tree.map(jnp.zeros_like, obj)
        weight = jnp.zeros([], dtype=jnp.int32)
        if multi_device:
            zeros, weight = broadcast_all_local_devices(zeros), replicate_all_local_devices(weight)
        return cls(zeros, weight, multi_device)

    @classmethod
    def empty(cls, multi_device: bool) -> "MultiChunkAccumulator[Any]":
        """An accumulator with nothing in it (its first `add` sets the structure).

        **Arguments:**

        - `multi_device`: whether the values follow the replicated convention.

        **Returns:**

        The accumulator, weight zero (`int32`, one per device with `multi_device`).
        """
        weight = jnp.zeros([], dtype=jnp.int32)
        return cls(None, replicate_all_local_devices(weight) if multi_device else weight, multi_device)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._accumulator!r}, {self._weight!r}, {self._multi_device})"

    def copy(self) -> "MultiChunkAccumulator[T]":
        """A new accumulator holding the same arrays.

        **Returns:**

        The copy.
        """
        leaves, treedef = jax.tree.flatten(self)
        return jax.tree.unflatten(treedef, leaves)


def _first_weight(weight: Any, new: ArrayLike) -> Any:
    """The weight after the first chunk: `new` (filled into the shape of `weight` when a Python
    number), as kfac-jax sets it."""
    if isinstance(new, (float, int)):
        return jnp.full_like(weight, new)
    if not isinstance(new, jax.Array):
        raise ValueError(f"MultiChunkAccumulator.add: `weight` must be a float, an int or a jax.Array, not {type(new).__name__}.")
    if jnp.shape(weight) != new.shape:
        raise ValueError(
            f"MultiChunkAccumulator.add: an array `weight` must have the shape of the accumulator's weight, "
            f"{jnp.shape(weight)}, not {new.shape} (or pass a Python number)."
        )
    return new


jax.tree_util.register_pytree_node(
    MultiChunkAccumulator,
    lambda a: ((a.accumulator, a.weight), (a.multi_device,)),
    lambda fixed, arrays: MultiChunkAccumulator(*arrays, *fixed),
)
