"""What the curvature blocks of 2-D convolutions compute from a conv layer's data.

The spec check, the layer's layout, the exact per-example kernel (and bias) gradients (for the
diagonal, full and EK-FAC blocks) and the KFC Kronecker factors (for the Kronecker block).

A conv layer is described by a `LayerSpec` with tag `"conv2d"` whose meta holds the keyword
parameters of `lax.conv_general_dilated` (`window_strides`, explicit `padding` pairs,
`lhs_dilation`, `rhs_dilation`, `dimension_numbers` as a `lax.ConvDimensionNumbers`,
`feature_group_count`) and `has_bias`. Its input and output carry the batch on the axes the
dimension numbers name (`lhs_spec[0]`, `out_spec[0]`); any layout (NHWC, NCHW, ...) works.
"""

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.typing import ArrayLike
from jaxtyping import Array

from ..._tracing.layer_data import EstimationData, LayerSpec
from ..patches import patches_moments
from .base import CurvatureBlock
from .statistics import statistics_dtype


class ConvLayout(NamedTuple):
    """The static facts about a conv layer that its blocks need (from `conv_layout`).

    **Fields:**

    - `dnums`: the convolution's `lax.ConvDimensionNumbers`.
    - `kernel_spatial`: the kernel's spatial shape, in the order of the spatial dimensions.
    - `in_channels`, `out_channels`: the channel counts.
    - `num_locations`: the output locations per example.
    - `has_bias`: whether the layer has a bias.
    """

    dnums: lax.ConvDimensionNumbers
    kernel_spatial: tuple[int, ...]
    in_channels: int
    out_channels: int
    num_locations: int
    has_bias: bool


def conv_params(spec: LayerSpec) -> dict:
    """The keyword arguments of `lax.conv_general_dilated` that the conv layer's spec records."""
    return dict(
        window_strides=tuple(spec.get("window_strides")),
        padding=tuple(tuple(p) for p in spec.get("padding")),
        lhs_dilation=tuple(spec.get("lhs_dilation")),
        rhs_dilation=tuple(spec.get("rhs_dilation")),
        dimension_numbers=spec.get("dimension_numbers"),
        feature_group_count=int(spec.get("feature_group_count", 1)),
    )


def check_conv_spec(block: CurvatureBlock) -> None:
    """Raises `ValueError` unless `block.spec` is a well-formed conv2d layer.

    **Arguments:**

    - `block`: the block being constructed (for the error message).
    """
    spec = block.spec
    dnums = spec.get("dimension_numbers")
    has_bias = bool(spec.get("has_bias", len(spec.param_shapes) == 2))
    missing = [
        k
        for k in ("window_strides", "padding", "lhs_dilation", "rhs_dilation")
        if spec.get(k) is None
    ]
    problem = None
    if not isinstance(dnums, lax.ConvDimensionNumbers):
        problem = f"dimension_numbers must be a lax.ConvDimensionNumbers, got {dnums!r}"
    elif missing:
        problem = f"the tag lacks the convolution parameters {missing}"
    elif int(spec.get("batch_group_count", 1)) != 1:
        problem = "batch_group_count other than 1 is not supported"
    elif len(spec.param_shapes) != 1 + has_bias or len(spec.param_shapes[0]) != len(dnums.rhs_spec):
        problem = (
            f"expected a {len(dnums.rhs_spec)}-D kernel{' and a bias' if has_bias else ''}, got "
            f"parameter shapes {spec.param_shapes}"
        )
    elif len(spec.input_shapes) != 1 or len(spec.output_shapes) != 1:
        problem = "expected one input and one output"
    elif has_bias and math.prod(spec.param_shapes[1]) != spec.param_shapes[0][dnums.rhs_spec[0]]:
        problem = (
            f"the bias {spec.param_shapes[1]} must have one entry per output feature "
            f"({spec.param_shapes[0][dnums.rhs_spec[0]]})"
        )
    if problem is not None:
        raise ValueError(f"{type(block).__name__} cannot handle the {spec.describe}: {problem}.")


def conv_layout(spec: LayerSpec) -> ConvLayout:
    """Reads a conv layer's layout from its spec (checked by `check_conv_spec`).

    **Arguments:**

    - `spec`: the conv layer's spec.

    **Returns:**

    The layer's dimension numbers, kernel spatial shape (in the order of the spatial
    dimensions), input and output channel counts, number of output locations per example, and
    whether it has a bias.
    """
    dnums = spec.get("dimension_numbers")
    kernel_shape = spec.param_shapes[0]
    out_shape = spec.output_shapes[0]
    return ConvLayout(
        dnums=dnums,
        kernel_spatial=tuple(kernel_shape[i] for i in dnums.rhs_spec[2:]),
        in_channels=spec.input_shapes[0][dnums.lhs_spec[1]],
        out_channels=kernel_shape[dnums.rhs_spec[0]],
        num_locations=math.prod(out_shape[i] for i in dnums.out_spec[2:]),
        has_bias=len(spec.param_shapes) == 2,
    )


def conv_gradient_samples(spec: LayerSpec, data: EstimationData) -> tuple[Array, ...]:
    """Exact per-example gradients of a conv layer's kernel (and bias).

    Each kernel gradient is the transpose of the (linear) map `kernel ↦ conv(x_b, kernel)` for
    one example, applied to that example's output tangent, vmapped over examples and vectors; so
    every setting `lax.conv_general_dilated` supports (strides, padding, both dilations, groups)
    is handled.

    **Arguments:**

    - `spec`: the conv layer's spec.
    - `data`: input `x` (batch on `lhs_spec[0]`) and output tangents `dy: (V, *output_shape)`
      (batch on `out_spec[0] + 1`).

    **Returns:**

    Per-parameter arrays shaped `(V * B, *param_shape)`.
    """
    layout = conv_layout(spec)
    dnums = layout.dnums
    params = conv_params(spec)
    # Statistics accumulate in float32 or wider, so the gradients are formed in that dtype.
    dtype = statistics_dtype(spec)
    x = data.inputs[0].astype(dtype)
    dy = data.outputs_tangent[0].astype(dtype)
    kernel = jax.ShapeDtypeStruct(spec.param_shapes[0], dtype)

    def one_example(x_b, dy_vb):
        x_b = jnp.expand_dims(x_b, dnums.lhs_spec[0])
        transpose = jax.linear_transpose(
            lambda w: lax.conv_general_dilated(x_b, w, **params), kernel
        )

        def one_vector(dy_b):
            (grad,) = transpose(jnp.expand_dims(dy_b, dnums.out_spec[0]))
            return grad

        return jax.vmap(one_vector)(dy_vb)

    grads = jax.vmap(one_example, in_axes=(dnums.lhs_spec[0], dnums.out_spec[0] + 1), out_axes=1)(
        x, dy
    )
    v, b = grads.shape[:2]
    samples = (jnp.reshape(grads, (v * b, *spec.param_shapes[0])),)
    if layout.has_bias:
        # (V, B, out, *spatial): the bias gradient sums the output tangent over locations.
        canonical = jnp.transpose(dy, (0, *(a + 1 for a in dnums.out_spec)))
        bias = jnp.sum(canonical, axis=tuple(range(3, canonical.ndim)))
        samples += (jnp.reshape(bias, (v * b, *spec.param_shapes[1])),)
    return samples


def conv_kronecker_factors(
    spec: LayerSpec, data: EstimationData, batch_size: ArrayLike, dtype: Any, patches_method: str
) -> tuple[Array, Array]:
    """This batch's KFC factors `(A, G)` of a conv layer (see `Conv2DTwoKroneckerFactored`).

    **Arguments:**

    - `spec`: the conv layer's spec.
    - `data`: input `x` and output tangents `dy: (V, *output_shape)`.
    - `batch_size`: `B`, the number of examples the statistics are averaged over.
    - `dtype`: the statistics dtype.
    - `patches_method`: `patches_moments`' `method` for `A`.

    **Returns:**

    `A = Σ_{b,l} p pᵀ / (B L)` over the input patches `p` (spatial offsets first, a 1 appended
    when there is a bias) and `G = Σ_v Σ_{b,l} dy dyᵀ / B`.
    """
    layout = conv_layout(spec)
    params = conv_params(spec)
    (x,) = data.inputs
    (dy,) = data.outputs_tangent
    second, first = patches_moments(
        x.astype(dtype),
        layout.kernel_spatial,
        strides=params["window_strides"],
        padding=params["padding"],
        dimension_numbers=layout.dnums,
        inputs_dilation=params["lhs_dilation"],
        kernel_dilation=params["rhs_dilation"],
        method=patches_method,
    )
    n_in = first.size
    a = jnp.reshape(second, (n_in, n_in))
    if layout.has_bias:
        first = jnp.reshape(first, (n_in, 1))
        # The appended 1 of every patch: one per example and location.
        examples = x.shape[layout.dnums.lhs_spec[0]]
        count = jnp.full((1, 1), examples * layout.num_locations, a.dtype)
        a = jnp.block([[a, first], [first.T, count]])
    a = a / (batch_size * layout.num_locations)
    dy = jnp.moveaxis(dy.astype(dtype), layout.dnums.out_spec[1] + 1, -1)
    dy = jnp.reshape(dy, (-1, layout.out_channels))
    return (a, dy.T @ dy / batch_size)
