"""Second moments of convolution patches, the input statistics of Kronecker-factored conv blocks.

A patch is the window of the (padded, dilated) input that one output location of a convolution
reads: `prod(kernel_spatial_shape) * channels` numbers. For a batch of images, the functions here
return the sum over examples and output locations of the (optionally weighted) outer products of
the patches with themselves, and the matching sum of the patches, as kfac-jax's functions of the
same names do.

`patches_moments` cuts the patches out of the padded input with one strided slice per kernel
offset and contracts them with one matrix product, a chunk of examples at a time so that a
chunk's patches take at most `_CHUNK_BYTES` (all at once with `method="patches"`).
`patches_moments_explicit` extracts all patches with `jax.lax.conv_general_dilated_patches`; it
is the reference the tests compare against.

Why no convolutions: XLA:CPU gives a convolution its fast kernels only in the canonical layout
(batch, spatial..., features), and rewrites other layouts into it only for convolutions of the
entry computation, not inside loops. The previous implementation contracted, for each kernel
offset in a `lax.map`, that offset's window against the whole input with one convolution (batch
as features, channels as the convolution's batch): it ran on XLA's generic loop emitter, 27-60x
slower than the explicit product. Even in the canonical layout, those convolutions (windows as
large as the image) were 2-5x slower than one matrix product of the patches.
"""

import functools
import itertools
import math
from collections.abc import Callable, Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jaxtyping import Array, Float, Shaped


_DATA_FORMAT_ALIASES = {"channels_last": "NHWC", "channels_first": "NCHW"}

# A chunk's patches take at most this many bytes (unless one example's take more). On CPU, chunks
# of a few MiB were as fast as or faster than one product over a large batch's patches (cache
# locality; no fresh mapping of a large scratch buffer per call): see
# benchmarks/conv_statistics.py.
_CHUNK_BYTES = 8 * 2**20

# The values of `patches_moments`' `method`.
METHODS = ("auto", "patches")

IntOrInts = int | Sequence[int]
Padding = str | int | Sequence[int] | Sequence[tuple[int, int]]
DimensionNumbers = lax.ConvDimensionNumbers | tuple[str, str, str]


class _Geometry(NamedTuple):
    """A convolution's layout and window, normalised to one tuple entry per spatial dimension."""

    lhs_spec: tuple[int, ...]
    kernel: tuple[int, ...]
    strides: tuple[int, ...]
    padding: tuple[tuple[int, int], ...]
    inputs_dilation: tuple[int, ...]
    kernel_dilation: tuple[int, ...]
    output_spatial: tuple[int, ...]
    per_channel: bool

    @property
    def num_spatial(self) -> int:
        return len(self.kernel)


def _as_tuple(name: str, value: IntOrInts | None, n: int) -> tuple[int, ...]:
    if value is None:
        return (1,) * n
    if isinstance(value, (int, np.integer)):
        return (int(value),) * n
    value = tuple(int(v) for v in value)
    if len(value) != n:
        raise ValueError(
            f"patches_moments: `{name}` must be an int or have one entry per spatial dimension "
            f"({n}), got {value}."
        )
    return value


def _lhs_spec(ndim: int, data_format: str | None, dimension_numbers: DimensionNumbers | None):
    if dimension_numbers is not None:
        if isinstance(dimension_numbers, lax.ConvDimensionNumbers):
            return tuple(dimension_numbers.lhs_spec)
        if isinstance(dimension_numbers, tuple) and len(dimension_numbers) == 3:
            data_format = dimension_numbers[0]
        else:
            raise TypeError(
                "patches_moments: `dimension_numbers` must be a `lax.ConvDimensionNumbers` or a "
                f"tuple of three layout strings such as ('NCHW', 'OIHW', 'NCHW'), got "
                f"{dimension_numbers!r}."
            )
    if data_format is None:
        raise ValueError("patches_moments: give `data_format` or `dimension_numbers`.")
    fmt = _DATA_FORMAT_ALIASES.get(data_format, data_format)
    if (
        len(fmt) != ndim
        or len(set(fmt)) != ndim
        or fmt.count("N") != 1
        or fmt.count("C") != 1
    ):
        raise ValueError(
            f"patches_moments: data format {data_format!r} does not describe inputs of rank "
            f"{ndim}: it needs one 'N', one 'C' and {ndim - 2} distinct spatial letters "
            "(e.g. 'NHWC', 'NCHW', 'channels_last', 'channels_first')."
        )
    spatial = tuple(i for i, letter in enumerate(fmt) if letter not in "NC")
    return (fmt.index("N"), fmt.index("C"), *spatial)


def _pads(
    padding: Padding,
    n: int,
    in_spatial: tuple[int, ...],
    effective_kernel: tuple[int, ...],
    strides: tuple[int, ...],
    inputs_dilation: tuple[int, ...],
) -> tuple[tuple[int, int], ...]:
    """The `(low, high)` padding of each spatial dimension, read as `lax.conv_general_dilated`
    reads `padding` (a string, one integer, or an integer or pair per dimension)."""
    if isinstance(padding, str):
        if inputs_dilation != (1,) * n:
            raise ValueError(
                f"patches_moments: string padding {padding!r} is undefined with "
                f"`inputs_dilation` {inputs_dilation} (as in `lax.conv_general_dilated`): give "
                "explicit (low, high) pairs."
            )
        # As `lax.conv_general_dilated` does: string padding is computed from the undilated input.
        return tuple(
            tuple(p) for p in lax.padtype_to_pads(in_spatial, effective_kernel, strides, padding)
        )
    if isinstance(padding, (int, np.integer)):
        return ((int(padding), int(padding)),) * n
    pads = tuple(
        (int(p), int(p)) if isinstance(p, (int, np.integer)) else (int(p[0]), int(p[1]))
        for p in padding
    )
    if len(pads) != n:
        raise ValueError(
            f"patches_moments: `padding` needs one (low, high) pair per spatial dimension "
            f"({n}), got {padding}."
        )
    return pads


def _geometry(
    inputs_shape: tuple[int, ...],
    kernel_spatial_shape: IntOrInts,
    strides: IntOrInts,
    padding: Padding,
    data_format: str | None,
    dimension_numbers: DimensionNumbers | None,
    inputs_dilation: IntOrInts | None,
    kernel_dilation: IntOrInts | None,
    feature_group_count: int,
) -> _Geometry:
    ndim = len(inputs_shape)
    if ndim < 3:
        raise ValueError(
            f"patches_moments: inputs must have a batch, a channel and at least one spatial "
            f"dimension, got shape {inputs_shape}."
        )
    n = ndim - 2
    lhs_spec = _lhs_spec(ndim, data_format, dimension_numbers)
    kernel = _as_tuple("kernel_spatial_shape", kernel_spatial_shape, n)
    strides = _as_tuple("strides", strides, n)
    inputs_dilation = _as_tuple("inputs_dilation", inputs_dilation, n)
    kernel_dilation = _as_tuple("kernel_dilation", kernel_dilation, n)
    if min(kernel + strides + inputs_dilation + kernel_dilation) < 1:
        raise ValueError(
            "patches_moments: kernel sizes, strides and dilations must be positive, got "
            f"kernel {kernel}, strides {strides}, dilations {inputs_dilation}, {kernel_dilation}."
        )
    in_spatial = tuple(inputs_shape[i] for i in lhs_spec[2:])
    effective_kernel = tuple((k - 1) * d + 1 for k, d in zip(kernel, kernel_dilation))
    pads = _pads(padding, n, in_spatial, effective_kernel, strides, inputs_dilation)
    dilated = tuple((s - 1) * d + 1 for s, d in zip(in_spatial, inputs_dilation))
    padded = tuple(s + lo + hi for s, (lo, hi) in zip(dilated, pads))
    if any(p < k for p, k in zip(padded, effective_kernel)):
        raise ValueError(
            f"patches_moments: the padded input's spatial shape {padded} is smaller than the "
            f"(dilated) kernel {effective_kernel}: the convolution has no output location."
        )
    output_spatial = tuple((p - k) // s + 1 for p, k, s in zip(padded, effective_kernel, strides))
    channels = inputs_shape[lhs_spec[1]]
    if feature_group_count not in (1, channels):
        raise ValueError(
            f"patches_moments: `feature_group_count` must be 1 (an ordinary convolution) or the "
            f"number of input channels {channels} (depthwise), got {feature_group_count}: the "
            "patches of a grouped convolution have no single second moment."
        )
    return _Geometry(
        lhs_spec=lhs_spec,
        kernel=kernel,
        strides=strides,
        padding=pads,
        inputs_dilation=inputs_dilation,
        kernel_dilation=kernel_dilation,
        output_spatial=output_spatial,
        per_channel=feature_group_count != 1,
    )


def _weights(
    weighting_array: Shaped[Array, "..."] | None, batch: int, geometry: _Geometry, dtype
) -> Array | None:
    """The weighting array broadcastable to `(batch, *output_spatial)`, or `None` (unweighted)."""
    if weighting_array is None:
        return None
    shape = tuple(weighting_array.shape)
    full = (batch, *geometry.output_spatial)
    if shape == (batch,):
        return weighting_array.astype(dtype).reshape((batch,) + (1,) * geometry.num_spatial)
    if shape == full:
        return weighting_array.astype(dtype)
    raise ValueError(
        f"patches_moments: `weighting_array` must have shape (batch,) = {(batch,)} or "
        f"(batch, *output_spatial) = {full}, got {shape}."
    )


def _compute_dtype(dtype) -> jnp.dtype:
    # Statistics accumulate in float32 or wider, even for low-precision inputs.
    return jnp.promote_types(dtype, jnp.float32)


def _patch_products(
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


def _moments_by_chunks(
    inputs: Float[Array, "..."],
    geometry: _Geometry,
    weights: Float[Array, "..."] | None,
    precision: lax.Precision | None,
    method: str,
) -> tuple[Float[Array, "..."], Float[Array, "..."]]:
    """`patches_moments` on validated arguments, its results shaped as `_patch_products`'.

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
    num_chunks = _num_chunks(method, batch, locations * kernel_size * channels * x.dtype.itemsize)
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
        return _patch_products(patches, w_chunk, geometry.per_channel, rows_first, precision)

    def accumulate(totals, chunk_data):
        return jax.tree.map(jnp.add, totals, chunk_moments(*chunk_data)), None

    first_chunk = jax.tree.map(lambda a: a[0], (x, weights))
    zeros = jax.tree.map(
        lambda a: jnp.zeros(a.shape, a.dtype), jax.eval_shape(chunk_moments, *first_chunk)
    )
    return lax.scan(accumulate, zeros, (x, weights))[0]


class _ResidueClass(NamedTuple):
    """The output locations `o ≡ r (mod s)` of an input-dilated convolution along one dimension,
    and the kernel offsets that read non-zero inputs there.

    With input dilation `s` (stride 1, no kernel dilation), output `o = r + s·m` at kernel offset
    `j` reads input `m + u + base` when `j = first + s·u`, and an inserted zero otherwise.
    """

    residue: int
    first: int
    offsets: int
    outputs: int
    base: int


def _residue_classes(size: int, kernel: int, dilation: int, pad_lo: int, outputs: int) -> list[_ResidueClass]:
    classes = []
    for r in range(min(dilation, outputs)):
        first = (pad_lo - r) % dilation
        offsets = max(0, -(-(kernel - first) // dilation))
        count = -(-(outputs - r) // dilation)
        if offsets and count:
            classes.append(_ResidueClass(r, first, offsets, count, (r + first - pad_lo) // dilation))
    return classes


def _moments_of_dilated(
    inputs: Float[Array, "..."],
    geometry: _Geometry,
    weights: Float[Array, "..."] | None,
    precision: lax.Precision | None,
    method: str,
) -> tuple[Float[Array, "..."], Float[Array, "..."]]:
    """`_moments_by_chunks` for an input-dilated convolution (a transposed one), from the
    undilated input.

    A patch of the dilated input is non-zero only at the kernel offsets of its output location's
    residue class (`_ResidueClass`), where it is an ordinary patch of the undilated input with a
    smaller kernel. The second moment is therefore block diagonal (up to a permutation of the
    offsets), one block per class, each the moments of a stride-1 convolution of the undilated
    input: together about the cost of the convolution itself, instead of `prod(dilation)²`
    times more for the patches of the dilated input, which are mostly zeros.
    """
    n = geometry.num_spatial
    size = [inputs.shape[a] for a in geometry.lhs_spec[2:]]
    per_dim = [
        _residue_classes(i, k, d, lo, o)
        for i, k, d, (lo, _), o in zip(
            size, geometry.kernel, geometry.inputs_dilation, geometry.padding, geometry.output_spatial
        )
    ]
    channels = inputs.shape[geometry.lhs_spec[1]]
    kernel_size = math.prod(geometry.kernel)
    trailing = (channels,) if geometry.per_channel else (channels, channels)
    second = jnp.zeros((kernel_size, kernel_size, *trailing), inputs.dtype)
    first = jnp.zeros((kernel_size, channels), inputs.dtype)
    for classes in itertools.product(*per_dim):
        sub = geometry._replace(
            kernel=tuple(c.offsets for c in classes),
            strides=(1,) * n,
            padding=tuple(
                (-c.base, c.outputs + c.offsets - 2 + c.base - (i - 1)) for c, i in zip(classes, size)
            ),
            inputs_dilation=(1,) * n,
            output_spatial=tuple(c.outputs for c in classes),
        )
        sub_weights = None if weights is None else weights[
            (slice(None), *(slice(None) if w == 1 else slice(c.residue, None, d)
                            for c, w, d in zip(classes, weights.shape[1:], geometry.inputs_dilation)))
        ]
        sub_second, sub_first = _moments_by_chunks(inputs, sub, sub_weights, precision, method)
        index = np.ravel_multi_index(
            np.meshgrid(*[c.first + d * np.arange(c.offsets) for c, d in zip(classes, geometry.inputs_dilation)],
                        indexing="ij"),
            geometry.kernel,
        ).ravel()
        k = len(index)
        if geometry.per_channel:
            block = sub_second
        else:
            block = sub_second.reshape(k, channels, k, channels).transpose(0, 2, 1, 3)
        second = second.at[np.ix_(index, index)].set(block)
        first = first.at[index].set(sub_first.reshape(k, channels))
    if geometry.per_channel:
        return second, first
    full = kernel_size * channels
    return second.transpose(0, 2, 1, 3).reshape(full, full), first.reshape(full)


def _moments_by_method(
    inputs: Float[Array, "..."],
    geometry: _Geometry,
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
        return _moments_of_dilated(inputs, geometry, weights, precision, method)
    return _moments_by_chunks(inputs, geometry, weights, precision, method)


def _num_chunks(method: str, batch: int, example_bytes: int) -> int:
    """Into how many chunks of equal size (up to padding) `_moments_by_chunks` cuts the batch."""
    if method == "patches":
        return 1
    return -(-batch // max(1, _CHUNK_BYTES // example_bytes))


def _moments_from_patches(
    inputs: Float[Array, "..."],
    geometry: _Geometry,
    weights: Float[Array, "..."] | None,
    precision: lax.Precision | None,
) -> tuple[Float[Array, "..."], Float[Array, "..."]]:
    """`patches_moments_explicit` on validated arguments (see `_moments_by_chunks`)."""
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
    return _patch_products(patches, weights, geometry.per_channel, True, precision)


_Compute = Callable[
    [Array, _Geometry, Array | None, lax.Precision | None], tuple[Array, Array]
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
    geometry = _geometry(
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
    dtype = _compute_dtype(inputs.dtype)
    weights = _weights(weighting_array, inputs.shape[geometry.lhs_spec[0]], geometry, dtype)
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
