"""Hypothesis strategies for property tests of curvature blocks and operators."""

import math
from collections.abc import Callable
from typing import Any

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array

from .._curvature.blocks import CurvatureBlock
from .._curvature.blocks.base import PowersLike
from .._tracing.layer_data import LayerSpec
from ._specs import (
    block_state,
    conv2d_spec,
    dense_spec,
    embedding_spec,
    generic_spec,
    scale_and_shift_spec,
)


LAYER_TAGS = ("dense", "conv2d", "scale_and_shift", "embedding", "generic")


def prng_keys() -> st.SearchStrategy[Array]:
    """JAX PRNG keys from hypothesis-drawn seeds.

    **Returns:**

    A strategy of `jax.random.key(seed)`.
    """
    return st.integers(0, 2**31 - 1).map(jax.random.key)


@st.composite
def spd_matrices(
    draw: Callable[..., Any],
    n: int | st.SearchStrategy[int],
    *,
    max_condition: float = 1e3,
    scale: tuple[float, float] = (1e-2, 1e2),
    diagonal: bool = False,
    dtype: Any = None,
) -> Array:
    """Symmetric positive definite matrices with a controlled condition number.

    A matrix is `Q diag(s) Qᵀ` with `Q` a random orthogonal matrix and eigenvalues `s` spread
    log-uniformly between `c` and `c · κ`, where the condition number `κ ≤ max_condition` and
    the scale `c` are drawn too (the extreme eigenvalues are exactly `c` and `c · κ`).

    **Arguments:**

    - `n`: the size, or a strategy of sizes.
    - `max_condition`: the largest condition number `κ` (at least 1).
    - `scale`: the range of the smallest eigenvalue `c`.
    - `diagonal`: return the eigenvalues `s` as a vector (a diagonal factor) instead.
    - `dtype`: the dtype (default: JAX's default float).

    **Returns:**

    A strategy of `(n, n)` arrays (`(n,)` with `diagonal=True`).
    """
    size = draw(n) if isinstance(n, st.SearchStrategy) else n
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    log_condition = draw(st.floats(0.0, math.log10(max_condition)))
    smallest = 10 ** draw(st.floats(math.log10(scale[0]), math.log10(scale[1])))
    spread = rng.uniform(0.0, 1.0, size)
    spread[: min(size, 2)] = (0.0, 1.0)[: min(size, 2)]
    values = smallest * 10 ** (log_condition * spread)
    dtype = jnp.result_type(float) if dtype is None else dtype
    if diagonal:
        return jnp.asarray(values, dtype)
    q, r = np.linalg.qr(rng.standard_normal((size, size)))
    q = q * np.sign(np.diagonal(r))
    return jnp.asarray((q * values) @ q.T, dtype)


@st.composite
def layer_specs(
    draw: Callable[..., Any],
    tags: tuple[str, ...] = LAYER_TAGS,
    *,
    bias: bool | None = None,
    stacked: bool | None = None,
    dtype: Any = None,
) -> LayerSpec:
    """Small layers of the built-in tags, as the tracer describes them.

    Sizes stay small (a few parameters to a few dozen) so dense references are cheap. Dense
    layers vary sizes, weight layout and sequence positions; convolutions layout, kernel,
    strides and padding; scale-and-shift layers their parameter shapes and which parameters they
    have; embeddings vocabulary, features and positions.

    **Arguments:**

    - `tags`: the tags to draw from.
    - `bias`: `True` / `False` to fix whether dense and conv layers have a bias (default: drawn).
    - `stacked`: `True` / `False` to fix whether the layer is scan-stacked (two slices; default:
      drawn).
    - `dtype`: the parameters' dtype.

    **Returns:**

    A strategy of `LayerSpec`s.
    """
    tag = draw(st.sampled_from(tags))
    has_bias = draw(st.booleans()) if bias is None else bias
    stack = (2 if draw(st.booleans()) else None) if stacked is None else (2 if stacked else None)
    small = st.integers(1, 3)
    if tag == "dense":
        return dense_spec(
            draw(small),
            draw(small),
            bias=has_bias,
            layout=draw(st.sampled_from(["in_out", "out_in"])),
            batch=draw(st.integers(1, 4)),
            extra=draw(st.sampled_from([(), (2,)])),
            stack=stack,
            dtype=dtype,
        )
    if tag == "conv2d":
        return conv2d_spec(
            draw(st.integers(1, 2)),
            draw(small),
            spatial=(draw(st.integers(3, 4)), 3),
            kernel=(draw(st.integers(1, 2)), 2),
            strides=(draw(st.integers(1, 2)), 1),
            padding=((draw(st.integers(0, 1)), 0), (0, draw(st.integers(0, 1)))),
            layout=draw(st.sampled_from(["NHWC", "NCHW"])),
            bias=has_bias,
            stack=stack,
            dtype=dtype,
        )
    if tag == "scale_and_shift":
        features = draw(small)
        scale, shift = draw(st.sampled_from([(True, True), (True, False), (False, True)]))
        x_shape = draw(st.sampled_from([(3, features), (2, 2, features)]))
        param_shape = draw(st.sampled_from([(features,), (1, features)][: len(x_shape) - 1]))
        return scale_and_shift_spec(
            x_shape, param_shape, scale=scale, shift=shift, stack=stack, dtype=dtype
        )
    if tag == "embedding":
        return embedding_spec(
            draw(st.integers(2, 5)),
            draw(small),
            extra=draw(st.sampled_from([(), (2,)])),
            stack=stack,
            dtype=dtype,
        )
    shapes = draw(st.lists(st.sampled_from([(2,), (3,), (2, 2)]), min_size=1, max_size=2))
    return generic_spec(*shapes, stack=stack, dtype=dtype)


def block_states(
    block: CurvatureBlock,
    *,
    exact_powers_to_cache: PowersLike = None,
    approx_powers_to_cache: PowersLike = None,
    cache_eigenvalues: bool = False,
) -> st.SearchStrategy[Any]:
    """States of a block with realistic statistics: one to three moving-average updates with
    `estimation_data` (see `block_state`).

    **Arguments:**

    - `block`: a curvature block.
    - `exact_powers_to_cache`, `approx_powers_to_cache`, `cache_eigenvalues`: passed to `init`.

    **Returns:**

    A strategy of the block's states.
    """
    return st.builds(
        lambda key, updates: block_state(
            block,
            key,
            updates=updates,
            exact_powers_to_cache=exact_powers_to_cache,
            approx_powers_to_cache=approx_powers_to_cache,
            cache_eigenvalues=cache_eigenvalues,
        ),
        prng_keys(),
        st.integers(1, 3),
    )
