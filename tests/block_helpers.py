"""Shared helpers of the curvature-block tests (layer specs and random data come from the kit)."""

import jax.numpy as jnp
import numpy as np

from eqx_kfac.testing import (
    dense_spec as dense_spec,
    estimation_data as random_data,
    generic_spec as generic_spec,
    random_vector as random_vector,
    scale_and_shift_spec as scale_shift_spec,
)

__all__ = [
    "dense_matpower", "dense_spec", "flat", "flat_numpy", "generic_spec", "random_data", "random_vector",
    "scale_shift_spec", "unflat",
]


def flat(vector):
    return jnp.concatenate([jnp.ravel(v) for v in vector])


def flat_numpy(vector):
    """`flat` with NumPy, for concrete arrays outside a trace (`jnp.concatenate` called eagerly
    compiles a program per combination of shapes)."""
    return np.concatenate([np.ravel(np.asarray(v)) for v in vector])


def unflat(x, shapes):
    out, i = [], 0
    for s in shapes:
        n = int(np.prod(s, dtype=int))
        out.append(jnp.reshape(x[i : i + n], s))
        i += n
    return tuple(out)


def dense_matpower(matrix, damping, power):
    """Reference `(M + λI)^p` via numpy's eigendecomposition."""
    m = np.asarray(matrix)
    s, q = np.linalg.eigh((m + m.T) / 2 + damping * np.eye(m.shape[0]))
    return (q * np.power(np.maximum(s, 0.0), power)) @ q.T
