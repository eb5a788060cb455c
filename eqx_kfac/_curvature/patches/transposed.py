"""Patch moments of an input-dilated convolution (a transposed one) from the undilated input."""

import itertools
import math
from typing import NamedTuple

import jax.numpy as jnp
import numpy as np
from jax import lax
from jaxtyping import Array, Float

from .geometry import ConvGeometry
from .strided import moments_by_chunks


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


def _residue_classes(kernel: int, dilation: int, pad_lo: int, outputs: int) -> list[_ResidueClass]:
    """The residue classes of one spatial dimension that have output locations and offsets."""
    classes = []
    for r in range(min(dilation, outputs)):
        first = (pad_lo - r) % dilation
        offsets = max(0, -(-(kernel - first) // dilation))
        count = -(-(outputs - r) // dilation)
        if offsets and count:
            base = (r + first - pad_lo) // dilation
            classes.append(_ResidueClass(r, first, offsets, count, base))
    return classes


def _class_geometry(
    geometry: ConvGeometry, classes: tuple[_ResidueClass, ...], size: list[int]
) -> ConvGeometry:
    """The stride-1 convolution of the undilated input that gives one class's patches."""
    n = geometry.num_spatial
    return geometry._replace(
        kernel=tuple(c.offsets for c in classes),
        strides=(1,) * n,
        # Output `m` at offset `u` reads input `m + u + base`: pad (or crop) to match.
        padding=tuple(
            (-c.base, c.outputs + c.offsets - 2 + c.base - (i - 1)) for c, i in zip(classes, size)
        ),
        inputs_dilation=(1,) * n,
        output_spatial=tuple(c.outputs for c in classes),
    )


def _class_weights(
    weights: Array | None, classes: tuple[_ResidueClass, ...], dilation: tuple[int, ...]
) -> Array | None:
    """The weights of one class's output locations (broadcast axes of size 1 kept)."""
    if weights is None:
        return None
    slices = [
        slice(None) if w == 1 else slice(c.residue, None, d)
        for c, w, d in zip(classes, weights.shape[1:], dilation)
    ]
    return weights[(slice(None), *slices)]


def _class_offsets(classes: tuple[_ResidueClass, ...], geometry: ConvGeometry) -> np.ndarray:
    """The flat indices, among all kernel offsets, of one class's offsets (row-major)."""
    ranges = [c.first + d * np.arange(c.offsets) for c, d in zip(classes, geometry.inputs_dilation)]
    return np.ravel_multi_index(np.meshgrid(*ranges, indexing="ij"), geometry.kernel).ravel()


def moments_of_dilated(
    inputs: Float[Array, "..."],
    geometry: ConvGeometry,
    weights: Float[Array, "..."] | None,
    precision: lax.Precision | None,
    method: str,
) -> tuple[Float[Array, "..."], Float[Array, "..."]]:
    """`moments_by_chunks` for an input-dilated convolution (a transposed one), from the
    undilated input.

    A patch of the dilated input is non-zero only at the kernel offsets of its output location's
    residue class (`_ResidueClass`), where it is an ordinary patch of the undilated input with a
    smaller kernel. The second moment is therefore block diagonal (up to a permutation of the
    offsets), one block per class, each the moments of a stride-1 convolution of the undilated
    input: together about the cost of the convolution itself, instead of `prod(dilation)²`
    times more for the patches of the dilated input, which are mostly zeros.
    """
    size = [inputs.shape[a] for a in geometry.lhs_spec[2:]]
    per_dim = [
        _residue_classes(k, d, lo, o)
        for k, d, (lo, _), o in zip(
            geometry.kernel, geometry.inputs_dilation, geometry.padding, geometry.output_spatial
        )
    ]
    channels = inputs.shape[geometry.lhs_spec[1]]
    kernel_size = math.prod(geometry.kernel)
    trailing = (channels,) if geometry.per_channel else (channels, channels)
    second = jnp.zeros((kernel_size, kernel_size, *trailing), inputs.dtype)
    first = jnp.zeros((kernel_size, channels), inputs.dtype)
    for classes in itertools.product(*per_dim):
        sub_second, sub_first = moments_by_chunks(
            inputs, _class_geometry(geometry, classes, size),
            _class_weights(weights, classes, geometry.inputs_dilation), precision, method,
        )
        index = _class_offsets(classes, geometry)
        k = len(index)
        if not geometry.per_channel:
            sub_second = sub_second.reshape(k, channels, k, channels).transpose(0, 2, 1, 3)
        second = second.at[np.ix_(index, index)].set(sub_second)
        first = first.at[index].set(sub_first.reshape(k, channels))
    if geometry.per_channel:
        return second, first
    full = kernel_size * channels
    return second.transpose(0, 2, 1, 3).reshape(full, full), first.reshape(full)
