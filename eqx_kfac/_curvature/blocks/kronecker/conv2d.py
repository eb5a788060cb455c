"""K-FAC for 2-D convolutions (KFC, Grosse & Martens 2016): `C ≈ A ⊗ G` over input patches."""

import math
from typing import ClassVar

import equinox as eqx
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array

from ...._tracing.layer_data import LayerSpec
from ...patches import METHODS
from ..conv_statistics import check_conv_spec, conv_kronecker_factors, conv_layout
from .factored import KroneckerFactored


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
        return conv_kronecker_factors(self.spec, data, batch_size, self.dtype, self.patches_method)
