"""Shared builders for the curvature-block tests: layer specs and random estimation data."""

import jax
import jax.numpy as jnp
import numpy as np

from eqx_kfac._layer_data import EstimationData, LayerSpec


def dense_spec(n_in, n_out, *, bias=True, layout="in_out", batch=3, extra=(), stack=None):
    w_shape = (n_in, n_out) if layout == "in_out" else (n_out, n_in)
    shapes = (w_shape, (n_out,)) if bias else (w_shape,)
    return LayerSpec(
        tag="dense",
        index=0,
        param_paths=("w", "b")[: len(shapes)],
        param_indices=tuple(range(len(shapes))),
        param_shapes=shapes,
        param_dtypes=(jnp.float64,) * len(shapes),
        input_shapes=((batch, *extra, n_in),),
        output_shapes=((batch, *extra, n_out),),
        meta=(("has_bias", bias), ("weight_layout", layout)),
        stack_size=stack,
    )


def scale_shift_spec(x_shape, param_shape, *, scale=True, shift=True):
    shapes = (param_shape,) * (scale + shift)
    return LayerSpec(
        tag="scale_and_shift",
        index=1,
        param_paths=("scale", "shift")[: len(shapes)] if scale else ("shift",),
        param_indices=tuple(range(len(shapes))),
        param_shapes=shapes,
        param_dtypes=(jnp.float64,) * len(shapes),
        input_shapes=(x_shape,),
        output_shapes=(x_shape,),
        meta=(("has_scale", scale), ("has_shift", shift)),
    )


def generic_spec(*shapes):
    return LayerSpec(
        tag="generic",
        index=2,
        param_paths=tuple(f"p{i}" for i in range(len(shapes))),
        param_indices=tuple(range(len(shapes))),
        param_shapes=tuple(shapes),
        param_dtypes=(jnp.float64,) * len(shapes),
        input_shapes=(),
        output_shapes=(),
    )


def random_data(spec, key, num_vectors=2):
    """Random `EstimationData` consistent with `spec` (leading `V` axis on the tangents)."""
    k1, k2, k3 = jax.random.split(key, 3)
    lead = () if spec.stack_size is None else (spec.stack_size,)
    inputs = tuple(
        jax.random.normal(k, (*lead, *s)) for k, s in zip(jax.random.split(k1, 4), spec.input_shapes)
    )
    outputs_tangent = tuple(
        jax.random.normal(k, (num_vectors, *lead, *s))
        for k, s in zip(jax.random.split(k2, 4), spec.output_shapes)
    )
    params_tangent = tuple(
        jax.random.normal(k, (num_vectors, *lead, *s))
        for k, s in zip(jax.random.split(k3, 4), spec.param_shapes)
    )
    return EstimationData(
        params=(), inputs=inputs, outputs=(), outputs_tangent=outputs_tangent,
        params_tangent=params_tangent,
    )


def random_vector(block, key):
    keys = jax.random.split(key, len(block.param_shapes))
    return tuple(jax.random.normal(k, s) for k, s in zip(keys, block.param_shapes))


def flat(vector):
    return jnp.concatenate([jnp.ravel(v) for v in vector])


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
