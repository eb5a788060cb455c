"""Second moments of convolution patches, the input statistics of Kronecker-factored conv blocks.

A patch is the window of the (padded, dilated) input that one output location of a convolution
reads: `prod(kernel_spatial_shape) * channels` numbers. For a batch of images, the functions here
return the sum over examples and output locations of the (optionally weighted) outer products of
the patches with themselves, and the matching sum of the patches, as kfac-jax's functions of the
same names do.

`patches_moments` cuts the patches out of the padded input with one strided slice per kernel
offset and contracts them with one matrix product, a chunk of examples at a time
(`strided.py`), or for a transposed convolution works on the undilated input, one residue class
of output locations at a time (`transposed.py`). `patches_moments_explicit` extracts all patches
with `jax.lax.conv_general_dilated_patches`; it is the reference the tests compare against.

"""

import functools
import math
from collections.abc import Callable

import jax.numpy as jnp
from jax import lax
from jaxtyping import Array, Float

from .geometry import (
    compute_dtype,
    conv_geometry,
    ConvGeometry,
    DimensionNumbers,
    IntOrInts,
    Padding,
    patch_weights,
)
from .strided import moments_by_chunks, patch_products
from .transposed import moments_of_dilated


# The values of `patches_moments`' `method`.
METHODS = ("auto", "patches")


def _moments_by_method(
    inputs: Float[Array, "..."],
    geometry: ConvGeometry,
    weights: Float[Array, "..."] | None,
    precision: lax.Precision | None,
    method: str,
) -> tuple[Float[Array, "..."], Float[Array, "..."]]:
    """`patches_moments`' computation: from the undilated input's residue classes for an
    input-dilated convolution with stride 1 and no kernel dilation (the transposed
    convolutions), from strided slices of the padded input otherwise."""
    n = geometry.num_spatial
    if (
        geometry.inputs_dilation != (1,) * n
        and geometry.strides == (1,) * n
        and geometry.kernel_dilation == (1,) * n
    ):
        return moments_of_dilated(inputs, geometry, weights, precision, method)
    return moments_by_chunks(inputs, geometry, weights, precision, method)


def _moments_from_patches(
    inputs: Float[Array, "..."],
    geometry: ConvGeometry,
    weights: Float[Array, "..."] | None,
    precision: lax.Precision | None,
) -> tuple[Float[Array, "..."], Float[Array, "..."]]:
    """`patches_moments_explicit` on validated arguments (see `moments_by_chunks`)."""
    n = geometry.num_spatial
    batch, channels = inputs.shape[geometry.lhs_spec[0]], inputs.shape[geometry.lhs_spec[1]]
    # Output in the inputs' layout; the filter layout only matters to the identity kernel
    # `conv_general_dilated_patches` builds, so use the plain `OI<spatial>`.
    dnums = lax.ConvDimensionNumbers(geometry.lhs_spec, tuple(range(n + 2)), geometry.lhs_spec)
    patches = lax.conv_general_dilated_patches(
        inputs,
        filter_shape=geometry.kernel,
        window_strides=geometry.strides,
        padding=geometry.padding,
        lhs_dilation=geometry.inputs_dilation,
        rhs_dilation=geometry.kernel_dilation,
        dimension_numbers=dnums,
        precision=precision,
    )
    patches = jnp.transpose(
        patches, (geometry.lhs_spec[0], *geometry.lhs_spec[2:], geometry.lhs_spec[1])
    )
    kernel_size = math.prod(geometry.kernel)
    # The patch features are ordered channel-major: `(channels, *kernel)`.
    patches = patches.reshape(-1, channels, kernel_size).transpose(0, 2, 1)
    if not geometry.per_channel:
        patches = patches.reshape(patches.shape[0], kernel_size * channels)
    if weights is not None:
        weights = jnp.broadcast_to(weights, (batch, *geometry.output_spatial)).reshape(-1)
    return patch_products(patches, weights, geometry.per_channel, True, precision)


_Compute = Callable[
    [Array, ConvGeometry, Array | None, lax.Precision | None], tuple[Array, Array]
]


def _moments(
    compute: _Compute,
    inputs: Float[Array, "..."],
    kernel_spatial_shape: IntOrInts,
    strides: IntOrInts,
    padding: Padding,
    data_format: str | None,
    feature_group_count: int,
    precision: lax.Precision | None,
    weighting_array: Float[Array, "..."] | None,
    dimension_numbers: DimensionNumbers | None,
    inputs_dilation: IntOrInts | None,
    kernel_dilation: IntOrInts | None,
) -> tuple[Float[Array, "..."], Float[Array, "..."]]:
    """Validates the arguments shared by both public functions, runs `compute` on them and
    shapes its results."""
    geometry = conv_geometry(
        tuple(inputs.shape),
        kernel_spatial_shape,
        strides,
        padding,
        data_format,
        dimension_numbers,
        inputs_dilation,
        kernel_dilation,
        feature_group_count,
    )
    dtype = compute_dtype(inputs.dtype)
    weights = patch_weights(weighting_array, inputs.shape[geometry.lhs_spec[0]], geometry, dtype)
    second, first = compute(inputs.astype(dtype), geometry, weights, precision)
    patch_shape = geometry.kernel + (inputs.shape[geometry.lhs_spec[1]],)
    if geometry.per_channel:
        return second.reshape(geometry.kernel + patch_shape), first.reshape(patch_shape)
    return second.reshape(patch_shape + patch_shape), first.reshape(patch_shape)


def patches_moments(
    inputs: Float[Array, "..."],
    kernel_spatial_shape: IntOrInts,
    strides: IntOrInts = 1,
    padding: Padding = "VALID",
    data_format: str | None = "NHWC",
    feature_group_count: int = 1,
    precision: lax.Precision | None = None,
    weighting_array: Float[Array, "..."] | None = None,
    *,
    dimension_numbers: DimensionNumbers | None = None,
    inputs_dilation: IntOrInts | None = None,
    kernel_dilation: IntOrInts | None = None,
    method: str = "auto",
) -> tuple[Float[Array, "..."], Float[Array, "..."]]:
    """Sums of the outer products of a convolution's input patches, and of the patches.

    For the convolution `lax.conv_general_dilated(inputs, kernel, strides, padding,
    inputs_dilation, kernel_dilation, ...)` with a kernel of spatial shape `kernel_spatial_shape`,
    let `p[n, l]` be the patch that output location `l` of example `n` reads, laid out as
    `kernel_spatial_shape + (channels,)` (spatial offsets first, channels last, whatever the data
    format). This returns

    - `second = Σ_{n, l} w[n, l] · p[n, l] ⊗ p[n, l]`, of shape
      `kernel_spatial_shape + (channels,) + kernel_spatial_shape + (channels,)`, and
    - `first = Σ_{n, l} w[n, l] · p[n, l]`, of shape `kernel_spatial_shape + (channels,)`,

    where `w` is `weighting_array` (all ones by default). These are sums, not means, as in
    kfac-jax: divide by `batch * prod(output_spatial)` for the moments. A Kronecker-factored conv
    block builds its input factor `[[second, first], [firstᵀ, Σ w]]` from them (the appended
    constant 1 of the bias).

    For a depthwise convolution (`feature_group_count == channels > 1`) each output channel sees a
    single input channel, so only the per-channel moments are formed: `second` then has shape
    `kernel_spatial_shape + kernel_spatial_shape + (channels,)`; `first` is unchanged.

    The patches are cut out of the padded input (one strided slice per kernel offset) and
    contracted by a matrix product, for as many examples at a time as `method` says: the
    arithmetic is that of `patchesᵀ @ patches`, the memory that of the input plus one chunk's
    patches.

    **Arguments:**

    - `inputs`: the batch of images, laid out as `data_format` (or `dimension_numbers`) says.
    - `kernel_spatial_shape`: the kernel's spatial sizes (an int for all spatial dimensions), in
      the order of the spatial dimensions of the layout (`(H, W)` for `NHWC` and `NCHW`).
    - `strides`: the window strides (int or one per spatial dimension).
    - `padding`: `"VALID"`, `"SAME"`, `"SAME_LOWER"`, an int, or one `(low, high)` pair (or int)
      per spatial dimension, with `lax.conv_general_dilated`'s meaning.
    - `data_format`: the inputs' layout: `"NHWC"` (`"channels_last"`), `"NCHW"`
      (`"channels_first"`), or any string with one `N`, one `C` and spatial letters.
    - `feature_group_count`: 1, or the number of input channels for a depthwise convolution.
    - `precision`: the precision of the products (see `jax.numpy.einsum`).
    - `weighting_array`: optional weights of shape `(batch,)` or `(batch, *output_spatial)`
      (output spatial sizes in the order of the spatial dimensions).
    - `dimension_numbers`: a `lax.ConvDimensionNumbers` or a tuple of three layout strings; when
      given, its input layout replaces `data_format`.
    - `inputs_dilation`, `kernel_dilation`: `lax.conv_general_dilated`'s `lhs_dilation` and
      `rhs_dilation` (int or one per spatial dimension; default 1).
    - `method`: how many examples' patches exist at once. `"auto"` (default): the batch is cut
      into the fewest chunks of equal size whose patches take at most 8 MiB each (one chunk,
      the whole batch, when they fit), accumulated by `lax.scan`; on CPU this was as fast as
      or faster than one product over all the patches at every measured shape
      (`benchmarks/conv_statistics.py`). `"patches"`: the whole batch's patches at once
      (memory `prod(kernel_spatial_shape)` times the input's; no loop, e.g. for an accelerator
      with memory to spare).

    **Returns:**

    The pair `(second, first)`, in float32 or the inputs' dtype if wider.
    """
    if method not in METHODS:
        raise ValueError(f"patches_moments: `method` must be one of {METHODS}, got {method!r}.")
    return _moments(
        functools.partial(_moments_by_method, method=method), inputs, kernel_spatial_shape,
        strides, padding, data_format, feature_group_count, precision, weighting_array,
        dimension_numbers, inputs_dilation, kernel_dilation,
    )


def patches_moments_explicit(
    inputs: Float[Array, "..."],
    kernel_spatial_shape: IntOrInts,
    strides: IntOrInts = 1,
    padding: Padding = "VALID",
    data_format: str | None = "NHWC",
    feature_group_count: int = 1,
    precision: lax.Precision | None = None,
    weighting_array: Float[Array, "..."] | None = None,
    *,
    dimension_numbers: DimensionNumbers | None = None,
    inputs_dilation: IntOrInts | None = None,
    kernel_dilation: IntOrInts | None = None,
) -> tuple[Float[Array, "..."], Float[Array, "..."]]:
    """The same as [`eqx_kfac.patches_moments`][], computed by materialising the patches.

    The patches come from `jax.lax.conv_general_dilated_patches`, so memory grows with
    `prod(kernel_spatial_shape)` times the size of the input; use it as a reference.

    **Arguments:**

    The same as [`eqx_kfac.patches_moments`][].

    **Returns:**

    The pair `(second, first)`, shaped as for [`eqx_kfac.patches_moments`][].
    """
    return _moments(
        _moments_from_patches, inputs, kernel_spatial_shape, strides, padding, data_format,
        feature_group_count, precision, weighting_array, dimension_numbers, inputs_dilation,
        kernel_dilation,
    )
