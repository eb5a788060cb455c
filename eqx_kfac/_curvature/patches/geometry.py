"""A convolution's layout and window, read and validated as `lax.conv_general_dilated` reads them.

`conv_geometry` normalises the arguments of `patches_moments` (data format or dimension numbers,
kernel, strides, padding, dilations, groups) to one `ConvGeometry` with one entry per spatial
dimension, raising a `ValueError` that names the argument for anything a convolution would
reject.
"""

from collections.abc import Sequence
from typing import NamedTuple

import jax.numpy as jnp
import numpy as np
from jax import lax
from jaxtyping import Array, Shaped


_DATA_FORMAT_ALIASES = {"channels_last": "NHWC", "channels_first": "NCHW"}

IntOrInts = int | Sequence[int]
Padding = str | int | Sequence[int] | Sequence[tuple[int, int]]
DimensionNumbers = lax.ConvDimensionNumbers | tuple[str, str, str]


class ConvGeometry(NamedTuple):
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


def conv_geometry(
    inputs_shape: tuple[int, ...],
    kernel_spatial_shape: IntOrInts,
    strides: IntOrInts,
    padding: Padding,
    data_format: str | None,
    dimension_numbers: DimensionNumbers | None,
    inputs_dilation: IntOrInts | None,
    kernel_dilation: IntOrInts | None,
    feature_group_count: int,
) -> ConvGeometry:
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
    return ConvGeometry(
        lhs_spec=lhs_spec,
        kernel=kernel,
        strides=strides,
        padding=pads,
        inputs_dilation=inputs_dilation,
        kernel_dilation=kernel_dilation,
        output_spatial=output_spatial,
        per_channel=feature_group_count != 1,
    )


def patch_weights(
    weighting_array: Shaped[Array, "..."] | None, batch: int, geometry: ConvGeometry, dtype
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


def compute_dtype(dtype) -> jnp.dtype:
    # Statistics accumulate in float32 or wider, even for low-precision inputs.
    return jnp.promote_types(dtype, jnp.float32)
