"""Whether a device axis is bound, and the mean over it where it is (kfac-jax's `in_pmap` and
`pmean_if_pmap`), for `utils` and the accumulators (which `utils` imports)."""

import jax
from jaxtyping import PyTree

from .._core.distributed import pmean


def in_pmap(axis_name: str | None) -> bool:
    """Whether the code runs inside a map over the devices with the axis `axis_name` (a
    `jax.pmap`, `jax.shard_map`, or the step of `Optimizer(multi_device=True)`).

    **Arguments:**

    - `axis_name`: the axis's name, or `None`.

    **Returns:**

    Whether the axis is bound.
    """
    if axis_name is None:
        return False
    try:
        jax.lax.axis_size(axis_name)
    except NameError:
        return False
    return True


def pmean_if_pmap(obj: PyTree, axis_name: str | None) -> PyTree:
    """The mean over the devices of `obj`'s inexact arrays where the axis is bound, `obj` elsewhere.

    **Arguments:**

    - `obj`: a PyTree.
    - `axis_name`: the devices' axis, or `None`.

    **Returns:**

    A PyTree like `obj`.
    """
    return pmean(obj, axis_name if in_pmap(axis_name) else None)
