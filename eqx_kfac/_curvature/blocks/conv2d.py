"""Curvature blocks of 2-D convolutions: diagonal, full, and Kronecker-factored (KFC).

A conv layer is described by a `LayerSpec` with tag `"conv2d"` whose meta holds the keyword
parameters of `lax.conv_general_dilated` (`window_strides`, explicit `padding` pairs,
`lhs_dilation`, `rhs_dilation`, `dimension_numbers` as a `lax.ConvDimensionNumbers`,
`feature_group_count`) and `has_bias`. Its input and output carry the batch on the axes the
dimension numbers name (`lhs_spec[0]`, `out_spec[0]`); any layout (NHWC, NCHW, ...) works.
"""

import math
from typing import ClassVar, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jaxtyping import Array

from ..._tracing.layer_data import EstimationData, LayerSpec
from ..patches import METHODS, patches_moments
from .base import CurvatureBlock
from .statistics import outer_from_samples, squares_from_samples, statistics_dtype
from .diagonal import Diagonal
from .full import Full
from .kronecker import KroneckerFactored


class _ConvLayout(NamedTuple):
    """The static facts about a conv layer that its blocks need."""

    dnums: lax.ConvDimensionNumbers
    kernel_spatial: tuple[int, ...]
    in_channels: int
    out_channels: int
    num_locations: int
    has_bias: bool


def _conv_params(spec: LayerSpec) -> dict:
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


def conv_layout(spec: LayerSpec) -> _ConvLayout:
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
    return _ConvLayout(
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
    params = _conv_params(spec)
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


class Conv2DDiagonal(Diagonal):
    """Exact diagonal of the per-example (Fisher / GGN) curvature of a conv layer (final).

    `diag = Σ_v Σ_b g_vb² / B` with the per-example kernel (and bias) gradients `g_vb` of
    `conv_gradient_samples`. Handles every layout, stride, padding, dilation and grouped or
    depthwise convolution. Cost: `O(dim)` memory; time of `V · B` per-example kernel gradients.

    **Fields:**

    - `spec`: the layer's `LayerSpec` (static).
    """

    spec: LayerSpec = eqx.field(static=True)
    supported_tags: ClassVar[frozenset[str] | None] = frozenset({"conv2d"})

    def _check_spec(self) -> None:
        check_conv_spec(self)

    def _diagonal_statistics(self, data, batch_size) -> tuple[Array, ...]:
        return squares_from_samples(conv_gradient_samples(self.spec, data), batch_size, self.dtype)


class Conv2DFull(Full):
    """Exact (per-example) curvature block of a conv layer, kernel and bias together (final).

    `C = Σ_v Σ_b vec(g_vb) vec(g_vb)ᵀ / B` with the per-example gradients of
    `conv_gradient_samples` (kernel flattened row-major in its own layout, then the bias).
    Handles every setting `Conv2DDiagonal` does. Cost: `O(dim²)` memory, `O(dim³)` per
    factorisation.

    **Fields:**

    - `spec`: the layer's `LayerSpec` (static).
    """

    spec: LayerSpec = eqx.field(static=True)
    supported_tags: ClassVar[frozenset[str] | None] = frozenset({"conv2d"})

    def _check_spec(self) -> None:
        check_conv_spec(self)

    def _full_statistics(self, data, batch_size) -> Array:
        return outer_from_samples(conv_gradient_samples(self.spec, data), batch_size, self.dtype)


class Conv2DTwoKroneckerFactored(KroneckerFactored):
    """K-FAC for convolutions, KFC (Grosse & Martens 2016): `C ≈ A ⊗ G` (final).

    With `p` the input patches (`prod(kernel_spatial) · in_channels` numbers, spatial offsets
    first, a 1 appended when there is a bias), `L` output locations per example and output
    tangents `dy: (V, ...)`:

    - `A = Σ_{b,l} p pᵀ / (B L)` (from `patches_moments`, with `patches_method`),
    - `G = Σ_v Σ_{b,l} dy dyᵀ / B`.

    kfac-jax divides both factors by `B L` and multiplies the product by `L`; the product
    here is the same (`L` is folded into `G`), as are the pi-adjusted damped inverses up to how
    the damping splits between the factors. For one output location and one example the
    approximation is exact.

    The canonical array is the kernel transposed to `(*kernel_spatial, in, out)`, flattened to
    `(prod(kernel_spatial) · in, out)`, with the bias as an extra row; any kernel layout of the
    dimension numbers (HWIO, OIHW, ...) maps onto it. Input and kernel dilation and strides
    are supported. Grouped and depthwise convolutions (`feature_group_count > 1`) are not:
    their curvature is no single Kronecker product (use `Conv2DDiagonal` or `Conv2DFull`).

    **Fields:**

    - `spec`: the layer's `LayerSpec` (static).
    - `patches_method`: `patches_moments`' `method` for `A` (static, keyword-only): `"auto"`
      (default: the patches of chunks of examples of at most 8 MiB, fastest on CPU) or
      `"patches"` (the whole batch's patches at once, e.g. on an accelerator with memory to
      spare: `functools.partial(Conv2DTwoKroneckerFactored, patches_method="patches")` in
      `layer_tag_to_block_ctor`).
    """

    spec: LayerSpec = eqx.field(static=True)
    patches_method: str = eqx.field(static=True, default="auto", kw_only=True)
    supported_tags: ClassVar[frozenset[str] | None] = frozenset({"conv2d"})

    def _check_spec(self) -> None:
        check_conv_spec(self)
        if self.patches_method not in METHODS:
            raise ValueError(
                f"{type(self).__name__} for the {self.spec.describe}: `patches_method` must be "
                f"one of {METHODS}, got {self.patches_method!r}."
            )
        groups = int(self.spec.get("feature_group_count", 1))
        if groups != 1:
            raise ValueError(
                f"{type(self).__name__} cannot handle the {self.spec.describe}: it is a grouped "
                f"or depthwise convolution (feature_group_count={groups}), whose curvature is "
                "not a single Kronecker product. Use Conv2DDiagonal or Conv2DFull for this "
                "layer (e.g. through `layer_tag_to_block_ctor`)."
            )

    @property
    def _kernel_permutation(self) -> tuple[int, ...]:
        """Axes of the kernel in canonical order: spatial, then input, then output features."""
        rhs_spec = conv_layout(self.spec).dnums.rhs_spec
        return (*rhs_spec[2:], rhs_spec[1], rhs_spec[0])

    @property
    def factor_dims(self) -> tuple[int, ...]:
        layout = conv_layout(self.spec)
        n_in = math.prod(layout.kernel_spatial) * layout.in_channels
        return (n_in + layout.has_bias, layout.out_channels)

    def _params_to_array(self, vector: tuple[Array, ...]) -> Array:
        layout = conv_layout(self.spec)
        kernel = jnp.transpose(vector[0], self._kernel_permutation)
        array = jnp.reshape(kernel, (-1, layout.out_channels))
        if not layout.has_bias:
            return array
        return jnp.concatenate([array, jnp.reshape(vector[1], (1, layout.out_channels))], axis=0)

    def _array_to_params(self, array: Array) -> tuple[Array, ...]:
        layout = conv_layout(self.spec)
        permutation = self._kernel_permutation
        canonical_shape = tuple(self.spec.param_shapes[0][a] for a in permutation)
        n_in = math.prod(canonical_shape[:-1])
        kernel = jnp.reshape(array[:n_in], canonical_shape)
        params = (jnp.transpose(kernel, tuple(np.argsort(permutation))),)
        if layout.has_bias:
            params += (jnp.reshape(array[n_in], self.spec.param_shapes[1]),)
        return params

    def _factor_statistics(self, data, batch_size) -> tuple[Array, ...]:
        layout = conv_layout(self.spec)
        params = _conv_params(self.spec)
        (x,) = data.inputs
        (dy,) = data.outputs_tangent
        second, first = patches_moments(
            x.astype(self.dtype),
            layout.kernel_spatial,
            strides=params["window_strides"],
            padding=params["padding"],
            dimension_numbers=layout.dnums,
            inputs_dilation=params["lhs_dilation"],
            kernel_dilation=params["rhs_dilation"],
            method=self.patches_method,
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
        dy = jnp.moveaxis(dy.astype(self.dtype), layout.dnums.out_spec[1] + 1, -1)
        dy = jnp.reshape(dy, (-1, layout.out_channels))
        return (a, dy.T @ dy / batch_size)
