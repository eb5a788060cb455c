"""Multi-device execution: the `shard_map` step, the sharded (SPMD) step, cross-device reductions,
block work spread over devices.

**Replicated state (`shard_map`).** The optimizer's step runs once per device under
`jax.shard_map`: parameters and optimizer state are replicated, the batch is split along its first
axis over the data axis of the mesh. Every quantity that depends on the batch (loss, gradients,
curvature statistics, quadratic-model products) is averaged over that axis; the per-device batches
all have the same size, so the plain mean over devices is the mean over the global batch. The step
runs with `check_vma=False` (the per-device semantics of `pmap`): with varying-axis checks, JAX
inserts `pvary` on the replicated parameters wherever they meet the batch, and the layer patterns
would no longer see an Equinox layer.

Cache updates (inverses, eigendecompositions) and preconditioner products can be spread over the
devices: each block is given to one device (greedily balancing a cost estimate), the owner computes
it, and a `psum` of the owner's result with zeros elsewhere hands it to every device.

All helpers take `axis_name=None` to mean "one device", where they are the identity, so the
optimizer's step reads the same for one and many devices.

**Sharded state (SPMD).** With the state sharded, the step is one program over global arrays
(`spmd_call`), written as for one device, and JAX's SPMD partitioner splits it over the mesh: the
batch along its first axis over the data axis, the optimizer state by `sharding_by_size` over every
axis of the mesh (each mesh axis splitting an array axis it divides evenly, the stack of stacked
factors first), the parameters as the caller placed them (by `sharding_by_size` if on one
device). No array of the state is whole on any device between steps; the partitioner gathers a
factor where a computation needs all of it (a factorisation) and reduces the statistics of the
batch shards into their owners' shards.
"""

import heapq
import math
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from jax.typing import ArrayLike
from jaxtyping import Array, PRNGKeyArray, PyTree


def data_mesh(axis_name: Hashable, devices: Sequence[Any] | None = None) -> Mesh:
    """A 1-D mesh over `devices` (default: all devices of all processes) with one data axis.

    **Arguments:**

    - `axis_name`: the name of the data axis (the optimizer's `pmap_axis_name`).
    - `devices`: the devices, in order; `None` means `jax.devices()` (global in multi-host runs).

    **Returns:**

    A `jax.sharding.Mesh`.
    """
    devices = jax.devices() if devices is None else list(devices)
    return Mesh(np.array(devices), (axis_name,))


def check_mesh(mesh: Mesh, axis_name: Hashable) -> None:
    """Raises `ValueError` when `mesh` has no axis called `axis_name`.

    **Arguments:**

    - `mesh`: the user's mesh.
    - `axis_name`: the data axis the batch is split over.

    **Returns:**

    Nothing.
    """
    if not isinstance(mesh, Mesh):
        raise TypeError(f"mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}.")
    if axis_name not in mesh.axis_names:
        raise ValueError(
            f"The mesh has axes {tuple(mesh.axis_names)} but the batch is split over "
            f"the data axis {axis_name!r} (MultiDevice's axis_name, kfac_jax's pmap_axis_name); "
            f"name the mesh's data axis {axis_name!r} or pass an axis_name equal to it."
        )


def check_even_split(batch: PyTree, num_devices: int, axis_name: Hashable) -> None:
    """Raises `ValueError` unless every array of `batch` splits evenly over `num_devices`.

    Unequal per-device batches would need per-device weights in every average; K-FAC's statistics
    are normalised per device, so the global batch must divide evenly instead. Scalars (0-d
    arrays) have no batch axis: they are given to every device whole.

    **Arguments:**

    - `batch`: the global batch.
    - `num_devices`: the size of the data axis.
    - `axis_name`: the data axis (for the message).

    **Returns:**

    Nothing.
    """
    for path, leaf in jax.tree_util.tree_flatten_with_path(batch)[0]:
        if not eqx.is_array(leaf) or leaf.ndim == 0:
            continue
        where = jax.tree_util.keystr(path) or "the batch"
        if leaf.shape[0] % num_devices != 0:
            raise ValueError(
                f"The global batch cannot be split evenly over the {num_devices} devices of mesh "
                f"axis {axis_name!r}: {where} has batch size {leaf.shape[0]} (leading axis), which is not a multiple "
                f"of {num_devices}. Use a global batch size divisible by {num_devices} (pad or "
                "drop the last batch), or run on fewer devices."
            )


def fold_in_device(key: PRNGKeyArray, axis_name: Hashable | None) -> PRNGKeyArray:
    """A key of its own for every device along `axis_name` (the key itself for one device).

    **Arguments:**

    - `key`: a replicated PRNG key.
    - `axis_name`: the data axis, or `None`.

    **Returns:**

    `jax.random.fold_in(key, axis_index)`, so samples drawn on different devices are independent.
    """
    if axis_name is None:
        return key
    return jax.random.fold_in(key, jax.lax.axis_index(axis_name))


def pmean(tree: PyTree, axis_name: Hashable | None) -> PyTree:
    """The mean over devices of every inexact array of `tree` (other leaves are left alone).

    **Arguments:**

    - `tree`: any PyTree.
    - `axis_name`: the data axis, or `None` (identity).

    **Returns:**

    A PyTree of the same structure.
    """
    if axis_name is None:
        return tree
    return jax.tree.map(
        lambda x: jax.lax.pmean(x, axis_name) if eqx.is_inexact_array(x) else x, tree
    )


def global_batch_size(batch_size: ArrayLike, axis_name: Hashable | None) -> ArrayLike:
    """The global batch size from the (equal) per-device batch size.

    **Arguments:**

    - `batch_size`: the per-device batch size.
    - `axis_name`: the data axis, or `None`.

    **Returns:**

    `batch_size` times the size of the data axis.
    """
    if axis_name is None:
        return batch_size
    return batch_size * jax.lax.axis_size(axis_name)


# --- spreading block work over devices ------------------------------------------------------


def block_cost(block_state: PyTree) -> float:
    """A cost estimate for a block's factorisations: `n³` per square matrix, size otherwise.

    Read from the shapes of the block's state, so it covers every block kind: a Kronecker block's
    factors cost `in³ + out³`, a full block `dim³`, a diagonal block `dim`; stacked (scanned) blocks
    multiply by the stack size.

    **Arguments:**

    - `block_state`: the block's state.

    **Returns:**

    A positive number.
    """
    cost = 0.0
    for leaf in jax.tree.leaves(block_state):
        if not eqx.is_inexact_array(leaf):
            continue
        shape = leaf.shape
        if len(shape) >= 2 and shape[-1] == shape[-2]:
            cost += math.prod(shape[:-2]) * float(shape[-1]) ** 3
        else:
            cost += float(math.prod(shape))
    return max(cost, 1.0)


def assign_blocks(costs: Sequence[float], num_devices: int) -> tuple[int, ...]:
    """Gives each block to a device, balancing the total cost (longest-processing-time first).

    **Arguments:**

    - `costs`: one cost per block.
    - `num_devices`: the number of devices.

    **Returns:**

    The owning device index of every block.
    """
    loads = [(0.0, d) for d in range(num_devices)]
    owners = [0] * len(costs)
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        load, device = heapq.heappop(loads)
        owners[i] = device
        heapq.heappush(loads, (load + costs[i], device))
    return tuple(owners)


def _from_owner(x: Array, mine: Array, axis_name: Hashable) -> Array:
    """Every device gets the owner's `x`: a `psum` of it with zeros on the other devices."""
    if x.dtype == jnp.bool_:
        return _from_owner(x.astype(jnp.int32), mine, axis_name).astype(jnp.bool_)
    return jax.lax.psum(jnp.where(mine, x, jnp.zeros_like(x)), axis_name)


def _changed_leaves(fn: Callable[[Any], Any], tree: PyTree) -> list[bool]:
    """Which array leaves of `tree` `fn` replaces (leaves passed through unchanged keep identity).

    Found by tracing `fn` abstractly; a leaf that cannot be matched counts as changed, which is
    only more communication, never a wrong result.
    """
    changed: list[bool] = []

    def probe(t):
        out = fn(t)
        ins, in_def = jax.tree.flatten(t)
        outs, out_def = jax.tree.flatten(out)
        if in_def == out_def:
            changed.extend(o is not i for i, o in zip(ins, outs))
        else:
            changed.extend([True] * len(outs))
        return out

    jax.eval_shape(probe, tree)
    return changed


def owner_computes(
    fn: Callable[[Any], Any], tree: PyTree, owner: int, axis_name: Hashable
) -> PyTree:
    """`fn(tree)` computed on device `owner` only and given to every device.

    `tree` must be replicated and `fn` must keep its structure; only the leaves `fn` changes travel.

    **Arguments:**

    - `fn`: the computation, from `tree` to a tree of the same structure.
    - `tree`: its (replicated) argument.
    - `owner`: the index of the device that computes it.
    - `axis_name`: the device axis.

    **Returns:**

    `fn(tree)`, replicated.
    """
    mine = jax.lax.axis_index(axis_name) == owner
    changed = _changed_leaves(fn, tree)
    new = jax.lax.cond(mine, fn, lambda t: t, tree)
    leaves, treedef = jax.tree.flatten(new)
    old = jax.tree.leaves(tree)
    return jax.tree.unflatten(treedef, [
        _from_owner(n, mine, axis_name) if c else o for n, o, c in zip(leaves, old, changed)
    ])


# --- the shard_map wrapper ------------------------------------------------------------------


def sharded_call(
    fn: Callable[..., Any],
    mesh: Mesh,
    axis_name: Hashable,
    args: Sequence[Any],
    batch_index: int,
) -> Any:
    """Calls `fn(*args)` once per device under `jax.shard_map`, splitting `args[batch_index]`.

    Every other argument is replicated, and so are the batch's scalars (0-d arrays); so must be
    every output (`fn` reduces what depends on the batch). Non-array leaves (static parts of
    Equinox modules, `None`s) stay outside the map.

    **Arguments:**

    - `fn`: the per-device function.
    - `mesh`: the mesh; the batch is split over its axis `axis_name` and replicated over the rest.
    - `axis_name`: the data axis.
    - `args`: the arguments of `fn` (global arrays).
    - `batch_index`: position of the batch among `args`.

    **Returns:**

    The (replicated) output of `fn`.
    """
    check_even_split(args[batch_index], mesh.shape[axis_name], axis_name)
    dynamic, static = eqx.partition(tuple(args), eqx.is_array)
    out_static: list[Any] = []

    def body(dynamic_args):
        out = fn(*eqx.combine(dynamic_args, static))
        out_dynamic, out_rest = eqx.partition(out, eqx.is_array)
        out_static.append(out_rest)
        return out_dynamic

    in_specs = tuple(
        jax.tree.map(
            lambda x: PartitionSpec(axis_name) if i == batch_index and x.ndim else PartitionSpec(), a
        )
        for i, a in enumerate(dynamic)
    )
    mapped = jax.shard_map(
        body, mesh=mesh, in_specs=(in_specs,), out_specs=PartitionSpec(), check_vma=False
    )
    out_dynamic = mapped(dynamic)
    return eqx.combine(out_dynamic, out_static[0])


def placed_on_mesh(
    args: Sequence[Any],
    mesh: Mesh,
    axis_name: Hashable,
    batch_index: int,
    is_state: Callable[[Any], bool] | None = None,
) -> tuple[Any, ...]:
    """`args` placed on `mesh` as the multi-device step's program returns its outputs (call outside
    `jit`, before the program): `args[batch_index]` split by `batch_sharding`; with `is_state`
    (the SPMD step) the optimizer states laid out by `sharding_by_size` and the arrays the caller
    placed on `mesh` kept as they are; every other array replicated over `mesh`.

    JAX keys its compiled programs by the arguments' shardings too: the caller's arrays (on one
    device) at the first step and the previous step's outputs (on the mesh) afterwards would
    otherwise compile the step twice. An array placed so already is not copied. With several
    processes (a mesh not all of whose devices are this process's) the arguments are left as they
    are; a batch that does not split evenly raises `ValueError` (`check_even_split`).

    **Arguments:**

    - `args`: the arguments of the program (global arrays).
    - `mesh`: the mesh.
    - `axis_name`: the data axis.
    - `batch_index`: position of the batch among `args`.
    - `is_state`: which subtrees are optimizer states (the SPMD step's), or `None` (the
      `shard_map` step's: every argument but the batch replicated).

    **Returns:**

    The arguments, placed.
    """
    check_even_split(args[batch_index], mesh.shape[axis_name], axis_name)
    replicated = NamedSharding(mesh, PartitionSpec())
    if not replicated.is_fully_addressable:
        # (Several processes: a process-local array cannot be put on the global mesh here; `jit`
        # places it.)
        return tuple(args)

    def other(x: Any) -> Any:
        if is_state is None:
            return replicated
        if isinstance(getattr(x, "sharding", None), NamedSharding) and x.sharding.mesh == mesh:
            return x.sharding
        return sharding_by_size(x, mesh)

    dynamic, static = eqx.partition(tuple(args), eqx.is_array)
    shardings = tuple(
        batch_sharding(a, mesh, axis_name) if i == batch_index else jax.tree.map(other, a, is_leaf=is_state)
        for i, a in enumerate(dynamic)
    )
    # Only what is not placed so already is put (the previous step's outputs are): `jax.device_put`
    # of a whole state, even a no-op, took 40% of a small model's step (FermiNet's He: 10 of
    # 26 ms under cProfile). The shardings must be equal, not just equivalent: a program compiled
    # for one device's arrays would compile again for the mesh's.
    # (`jax.device_put`, not `eqx.filter_shard`: outside `jit` the latter compiles a program per
    # array shape to apply its sharding constraint.)
    leaves, treedef = jax.tree.flatten(dynamic)
    targets = jax.tree.leaves(shardings, is_leaf=lambda s: isinstance(s, jax.sharding.Sharding))
    moving = [i for i, (x, target) in enumerate(zip(leaves, targets)) if getattr(x, "sharding", None) != target]
    if not moving:
        return tuple(args)
    for i, moved in zip(moving, jax.device_put([leaves[i] for i in moving], [targets[i] for i in moving])):
        leaves[i] = moved
    return eqx.combine(jax.tree.unflatten(treedef, leaves), static)


# --- the sharded (SPMD) step ----------------------------------------------------------------


def _spec(shape: tuple[int, ...], sizes: dict[Hashable, int]) -> PartitionSpec:
    """Mesh axes given to the axes of an array of `shape`, greedily, largest mesh axis first.

    Each mesh axis goes to the first array axis (in order of preference) whose size it divides
    together with the mesh axes given to it already (JAX shards evenly only); a mesh axis that
    divides none is left out (the array is replicated over it). Preference: for a stack of square
    matrices `(..., n, n)` the stack axes first (each device then factorises whole matrices of its
    own, which the partitioner can do where they lie), then the largest axes.
    """
    stacked = len(shape) >= 3 and shape[-1] == shape[-2]
    stack_axes = list(range(len(shape) - 2)) if stacked else []
    rest = sorted(set(range(len(shape))) - set(stack_axes), key=lambda i: (-shape[i], i))
    given: list[list[Hashable]] = [[] for _ in shape]
    for name in sorted(sizes, key=lambda n: -sizes[n]):
        for i in stack_axes + rest:
            if shape[i] % (math.prod(sizes[n] for n in given[i]) * sizes[name]) == 0:
                given[i].append(name)
                break
    if not any(given):
        return PartitionSpec()
    return PartitionSpec(*(None if not g else g[0] if len(g) == 1 else tuple(g) for g in given))


def sharding_by_size(
    tree: PyTree, mesh: Mesh, axis_names: Sequence[Hashable] | None = None
) -> PyTree:
    """A sharding for every array of `tree`, spreading it over the devices of `mesh` (FSDP-style).

    Each mesh axis of `axis_names` splits one axis of the array, the largest mesh axes first, each
    going to the first array axis whose size it divides evenly (with the mesh axes given to that
    axis already): a `(2048, 8192)` weight on a 2 x 4 mesh is split 8 ways along its 8192 axis,
    every device holding `1/8` of it. A mesh axis that divides no axis of the array replicates it
    over that mesh axis (JAX arrays shard evenly only): scalars, and dimensions like the `in + 1`
    rows of a biased layer's input factor, stay whole. For a stack of square matrices
    `(..., n, n)` (the factors of scan-stacked layers) the stack axes come first, then the rows: a
    device then factorises whole matrices of its own. The result depends on the shapes and the
    mesh only, so it is the same for the optimizer's state at `init` and after every step.

    **Arguments:**

    - `tree`: a PyTree (parameters, an optimizer state); its arrays and `jax.ShapeDtypeStruct`s
      get shardings, other leaves `None`.
    - `mesh`: the device mesh.
    - `axis_names`: the mesh axes to spread over (default: all of them, data and model axes).

    **Returns:**

    A PyTree of the structure of `tree` with a `jax.sharding.NamedSharding` for every array (to
    pass to `eqx.filter_shard` or `jax.device_put`) and `None` elsewhere.
    """
    names = tuple(mesh.axis_names if axis_names is None else axis_names)
    sizes = {name: mesh.shape[name] for name in names}

    def leaf(x: Any) -> NamedSharding | None:
        if not (eqx.is_array(x) or isinstance(x, jax.ShapeDtypeStruct)):
            return None
        return NamedSharding(mesh, _spec(tuple(x.shape), sizes))

    return jax.tree.map(leaf, tree, is_leaf=lambda x: isinstance(x, jax.ShapeDtypeStruct))


def batch_sharding(batch: PyTree, mesh: Mesh, axis_name: Hashable) -> PyTree:
    """The sharding of a global batch: every array split along its first axis over `axis_name`,
    replicated over the other mesh axes; scalars replicated.

    **Arguments:**

    - `batch`: the global batch.
    - `mesh`: the mesh.
    - `axis_name`: the data axis.

    **Returns:**

    A PyTree of `NamedSharding`s (`None` for non-array leaves).
    """

    def leaf(x: Any) -> NamedSharding | None:
        if not eqx.is_array(x):
            return None
        return NamedSharding(mesh, PartitionSpec(axis_name) if x.ndim else PartitionSpec())

    return jax.tree.map(leaf, batch)


def lay_out(tree: PyTree, mesh: Mesh, is_state: Callable[[Any], bool]) -> PyTree:
    """`tree` with every subtree `is_state` holds for placed by `sharding_by_size` (a sharding
    constraint inside `jit`, a transfer outside), the rest as it is.

    **Arguments:**

    - `tree`: any PyTree.
    - `mesh`: the mesh.
    - `is_state`: which subtrees are optimizer states.

    **Returns:**

    `tree`, its states laid out.
    """

    def place(x: Any) -> Any:
        return eqx.filter_shard(x, sharding_by_size(x, mesh)) if is_state(x) else x

    return jax.tree.map(place, tree, is_leaf=is_state)


def spmd_call(
    fn: Callable[..., Any],
    mesh: Mesh,
    axis_name: Hashable,
    args: Sequence[Any],
    batch_index: int,
    is_state: Callable[[Any], bool],
) -> Any:
    """Calls `fn(*args)` as one program over global arrays, split over `mesh` by JAX's SPMD
    partitioner (call inside `jit`).

    `args[batch_index]` is split along its first axis over `axis_name`; the optimizer states among
    the arguments and outputs (the subtrees `is_state` holds for) are laid out by
    `sharding_by_size`; every other array keeps the sharding it comes with (the parameters: the
    caller's), and the partitioner chooses the rest. `fn` is written for one device: the program
    computes the same values as on one device, only the placement differs.

    **Arguments:**

    - `fn`: the function of global arrays.
    - `mesh`: the mesh.
    - `axis_name`: the data axis.
    - `args`: the arguments of `fn`.
    - `batch_index`: position of the batch among `args`.
    - `is_state`: which subtrees are optimizer states.

    **Returns:**

    The output of `fn`, its states laid out.
    """
    check_even_split(args[batch_index], mesh.shape[axis_name], axis_name)
    args = list(lay_out(tuple(args), mesh, is_state))
    batch = args[batch_index]
    args[batch_index] = eqx.filter_shard(batch, batch_sharding(batch, mesh, axis_name))
    return lay_out(fn(*args), mesh, is_state)
