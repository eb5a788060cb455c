"""kfac-jax's replicated calling convention, for `eqx_kfac.kfac_jax.Optimizer(multi_device=True)`.

kfac-jax's multi-device optimizer takes and returns one copy of the parameters, state and function
state per local device (`utils.replicate_all_local_devices`), one key per device
(`utils.make_different_rng_key_on_all_devices`, `utils.p_split`), and the batch with a leading
device axis. `eqx_kfac`'s step takes the plain values and the global batch; these functions
convert between the two.
"""

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import PyTree

from .utils import device_contents_placed, get_first, replicate_all_local_devices


def is_per_device(rng: Any) -> bool:
    """Whether `rng` is one key per device (kfac-jax's convention) rather than one key.

    **Arguments:**

    - `rng`: a typed key or a raw `uint32` key, or a stack of them.

    **Returns:**

    Whether it has one more leading axis than a key.
    """
    typed = jax.dtypes.issubdtype(jnp.result_type(rng), jax.dtypes.prng_key)
    return jnp.ndim(rng) == (1 if typed else 2)


def unreplicated(tree: PyTree, mesh: jax.sharding.Mesh) -> PyTree:
    """The first device's copy of a replicated PyTree (`None` stays `None`), replicated over
    `mesh` as the multi-device step takes its arguments (so that the step puts nothing on the
    devices before it runs).

    **Arguments:**

    - `tree`: a PyTree of per-device arrays.
    - `mesh`: the step's mesh.

    **Returns:**

    The PyTree of one copy.
    """
    replicated_on_mesh = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    return device_contents_placed(tree, 0, replicated_on_mesh)


def first_copy_on_host(tree: PyTree) -> PyTree:
    """The first device's copy of a replicated PyTree, read into host (NumPy) arrays: no program
    is compiled (`unreplicated` compiles one per tree), for `init`, which runs once (FermiNet's
    `init` spent 0.07 s compiling them).

    **Arguments:**

    - `tree`: a PyTree of per-device arrays (`None` stays `None`).

    **Returns:**

    The PyTree of NumPy arrays of one copy.
    """
    def first(x: Any) -> Any:
        if not isinstance(x, jax.Array) or x.ndim == 0:
            return np.asarray(x)[0] if isinstance(x, np.ndarray) and x.ndim else x
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            return get_first(x)
        return np.asarray(x.addressable_shards[0].data).reshape(x.shape[1:])

    return jax.tree.map(first, tree)


def merged_batch_shapes(batch: PyTree) -> PyTree:
    """`merged_batch(batch)`'s shapes and dtypes (`jax.ShapeDtypeStruct`s), without computing it:
    `init` only traces the batch.

    **Arguments:**

    - `batch`: a PyTree of `(devices, examples, ...)` arrays.

    **Returns:**

    The PyTree of `jax.ShapeDtypeStruct`s of `(devices * examples, ...)`.
    """
    return jax.eval_shape(merged_batch, batch)


def _merged_leaf(x: Any) -> Any:
    if jnp.ndim(x) < 2:
        raise ValueError(
            "kfac_jax.Optimizer(multi_device=True) was given one key per device (kfac-jax's "
            "replicated convention), so every batch array needs a leading device axis and an "
            f"example axis; got an array of shape {jnp.shape(x)}. Pass a single key to use "
            "eqx_kfac's convention (plain values and the global batch)."
        )
    return jnp.reshape(x, (-1, *jnp.shape(x)[2:]))


# One program for the whole batch, `jax.jit`'s own dispatch (`eqx.filter_jit`'s took 0.65 ms of
# FermiNet He's 4.8 ms step): kfac-jax's batches hold arrays only, as its `pmap` requires.
_merged = jax.jit(lambda batch: jax.tree.map(_merged_leaf, batch))


def merged_batch(batch: PyTree) -> PyTree:
    """The global batch of a batch with a leading device axis: the device and example axes of
    every array merged, devices first (the order in which `eqx_kfac` splits it again).

    **Arguments:**

    - `batch`: a PyTree of `(devices, examples, ...)` arrays.

    **Returns:**

    The PyTree of `(devices * examples, ...)` arrays.
    """
    return _merged(batch)


def replicated(tree: PyTree, axis_name: str) -> PyTree:
    """One copy of `tree` per local device, as kfac-jax returns its outputs.

    **Arguments:**

    - `tree`: a PyTree.
    - `axis_name`: the devices' axis name.

    **Returns:**

    The replicated PyTree.
    """
    return replicate_all_local_devices(tree, axis_name)
