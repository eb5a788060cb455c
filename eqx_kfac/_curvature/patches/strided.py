"""Patch moments from strided slices of the padded input, a chunk of examples at a time.

The patches of a chunk are `prod(kernel)` strided slices of the padded, dilated input (one per
kernel offset), contracted by one matrix product; `lax.scan` accumulates the chunks, each of
whose patches take at most `CHUNK_BYTES`.

Why no convolutions: XLA:CPU gives a convolution its fast kernels only in the canonical layout
(batch, spatial..., features), and rewrites other layouts into it only for convolutions of the
entry computation, not inside loops. The previous implementation contracted, for each kernel
offset in a `lax.map`, that offset's window against the whole input with one convolution (batch
as features, channels as the convolution's batch): it ran on XLA's generic loop emitter, 27-60x
slower than the explicit product. Even in the canonical layout, those convolutions (windows as
large as the image) were 2-5x slower than one matrix product of the patches.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jaxtyping import Array, Float

from .geometry import ConvGeometry


# A chunk's patches take at most this many bytes (unless one example's take more). On CPU, chunks
# of a few MiB were as fast as or faster than one product over a large batch's patches (cache
# locality; no fresh mapping of a large scratch buffer per call): see
# benchmarks/conv_statistics.py.
CHUNK_BYTES = 8 * 2**20


def patch_products(
    patches: Float[Array, "..."],
    weights: Float[Array, " rows"] | None,
    per_channel: bool,
    rows_first: bool,
    precision: lax.Precision | None,
) -> tuple[Float[Array, "..."], Float[Array, "..."]]:
    """`(Σ_r w_r p_r p_rᵀ, Σ_r w_r p_r)` over the rows `r` of a stack of patches.

    `patches` is `(rows, features)`, or `(features, rows)` when not `rows_first`, or
    `(rows, kernel_size, channels)` when `per_channel` (depthwise: one product per channel).
    """
    rows_axis = 0 if rows_first else patches.ndim - 1
    weighted = patches
    if weights is not None:
        other_axes = tuple(a for a in range(patches.ndim) if a != rows_axis)
        weighted = jnp.expand_dims(weights, other_axes) * patches
    if per_channel:
        spec = "rkc,rjc->kjc"
    elif rows_first:
        spec = "ri,rj->ij"
    else:
        spec = "ir,jr->ij"
    second = jnp.einsum(spec, weighted, patches, precision=precision)
    return second, jnp.sum(weighted, axis=rows_axis)


def moments_by_chunks(
    inputs: Float[Array, "..."],
    geometry: ConvGeometry,
    weights: Float[Array, "..."] | None,
    precision: lax.Precision | None,
    method: str,
) -> tuple[Float[Array, "..."], Float[Array, "..."]]:
    """`patches_moments` on validated arguments, its results shaped as `patch_products`'.

    The patches of a chunk of examples are `prod(kernel)` strided slices of the padded, dilated
    input (one per kernel offset), contracted by one matrix product; `lax.scan` accumulates the
    chunks. `inputs` and `weights` are in the compute dtype.
    """
    n = geometry.num_spatial
    # Channels last, spatial in order: `(batch, *spatial, channels)`.
    x = jnp.transpose(inputs, (geometry.lhs_spec[0], *geometry.lhs_spec[2:], geometry.lhs_spec[1]))
    batch, channels = x.shape[0], x.shape[-1]
    kernel_size = math.prod(geometry.kernel)
    locations = math.prod(geometry.output_spatial)
    num_chunks = chunk_count(method, batch, locations * kernel_size * channels * x.dtype.itemsize)
    chunk = -(-batch // num_chunks)
    extra = num_chunks * chunk - batch
    # One pad: the batch to whole chunks (zero examples have zero patches: they add nothing),
    # the spatial padding, and the input dilation as interior padding.
    spatial_config = [
        (lo, hi, d - 1) for (lo, hi), d in zip(geometry.padding, geometry.inputs_dilation)
    ]
    x = lax.pad(x, jnp.zeros((), x.dtype), [(0, extra, 0), *spatial_config, (0, 0, 0)])
    x = x.reshape(num_chunks, chunk, *x.shape[1:])
    if weights is not None:
        weights = jnp.broadcast_to(weights, (batch, *geometry.output_spatial))
        weights = jnp.pad(weights, [(0, extra)] + [(0, 0)] * n)
        weights = weights.reshape(num_chunks, chunk * locations)
    rows = chunk * locations
    # With one channel, offsets-major patches `(kernel_size, rows)` are written in contiguous
    # runs (offsets-minor ones would write single numbers `kernel_size` apart: 1.5x slower with
    # 5x5 kernels); with more channels, `(rows, kernel_size * channels)` copies runs of
    # `channels` numbers and needs no transposition for the product.
    rows_first = geometry.per_channel or channels > 1

    def offset_slice(x_chunk, offset):
        start = tuple(o * d for o, d in zip(offset, geometry.kernel_dilation))
        limit = tuple(
            s + (o - 1) * t + 1 for s, o, t in zip(start, geometry.output_spatial, geometry.strides)
        )
        return lax.slice(
            x_chunk, (0, *start, 0), (chunk, *limit, channels), (1, *geometry.strides, 1)
        )

    def chunk_moments(x_chunk, w_chunk):
        slices = [offset_slice(x_chunk, o) for o in np.ndindex(*geometry.kernel)]
        if not rows_first:
            patches = jnp.stack(slices).reshape(kernel_size, rows)
        elif geometry.per_channel:
            patches = jnp.stack(slices, -2).reshape(rows, kernel_size, channels)
        else:
            patches = jnp.stack(slices, -2).reshape(rows, kernel_size * channels)
        return patch_products(patches, w_chunk, geometry.per_channel, rows_first, precision)

    def accumulate(totals, chunk_data):
        return jax.tree.map(jnp.add, totals, chunk_moments(*chunk_data)), None

    first_chunk = jax.tree.map(lambda a: a[0], (x, weights))
    zeros = jax.tree.map(
        lambda a: jnp.zeros(a.shape, a.dtype), jax.eval_shape(chunk_moments, *first_chunk)
    )
    return lax.scan(accumulate, zeros, (x, weights))[0]


def chunk_count(method: str, batch: int, example_bytes: int) -> int:
    """Into how many chunks of equal size (up to padding) `moments_by_chunks` cuts the batch."""
    if method == "patches":
        return 1
    return -(-batch // max(1, CHUNK_BYTES // example_bytes))
