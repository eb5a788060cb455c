"""K-FAC for dense layers: `C ≈ A ⊗ G` with the expand convention over shared dimensions."""

from typing import ClassVar

import equinox as eqx
import jax.numpy as jnp
from jaxtyping import Array

from ...._tracing.layer_data import LayerSpec
from .._layer_stats import (
    check_dense_spec,
    dense_array_to_params,
    dense_kronecker_factors,
    dense_layout,
    dense_params_to_array,
)
from .factored import KroneckerFactored


class DenseTwoKroneckerFactored(KroneckerFactored):
    """K-FAC for dense layers: `C ≈ A ⊗ G` (final).

    With inputs `x: (B, *extra, in)` (`x̃` = `x` with a 1 appended when there is a bias) and
    output tangents `dy: (V, B, *extra, out)`:

    - `A = Σ_{b,t} x̃ x̃ᵀ / (B T)`, `G = Σ_v Σ_{b,t} dy dyᵀ / B`, where `T = prod(extra)` is the
      number of positions per example (`T = 1` without extra dims).

    Positions are treated as more examples (the "expand" approximation of Eschenhagen et al.
    2023); the scaling — inputs averaged over positions, output tangents summed — is the one of
    curvlinops' `KFACType.EXPAND` and of kfac-jax's `RepeatedDenseKroneckerFactored` (without
    masking), and reduces to plain K-FAC for `T = 1`. The Kronecker structure acts on the weight
    in `(in, out)` orientation with the bias as an extra row, so both weight layouts (`"in_out"`,
    `y = x @ w`; `"out_in"`, `y = x @ w.T` as in `eqx.nn.Linear`) map onto the parameters'
    row-major flattening correctly.

    **Fields:**

    - `spec`: the layer's `LayerSpec` (static).
    """

    spec: LayerSpec = eqx.field(static=True)
    supported_tags: ClassVar[frozenset[str] | None] = frozenset({"dense"})

    def _check_spec(self) -> None:
        check_dense_spec(self)

    @property
    def factor_dims(self) -> tuple[int, ...]:
        _, has_bias, n_in, n_out = dense_layout(self.spec)
        return (n_in + has_bias, n_out)

    # An n-d `(*in, *out)` weight (and `out`-shaped bias) is used as its `(in, out)` reshape.

    def _params_to_array(self, vector: tuple[Array, ...]) -> Array:
        return dense_params_to_array(self.spec, vector)

    def _array_to_params(self, array: Array) -> tuple[Array, ...]:
        return dense_array_to_params(self.spec, array)

    # An `(out, in)` weight (`eqx.nn.Linear`) is used as it is, with the bias as an extra column:
    # transposing it into the canonical `(in + 1, out)` array would copy it in every product.

    def _params_to_product_array(self, vector: tuple[Array, ...]) -> tuple[Array, tuple[int, ...]]:
        in_out, has_bias, _, _ = dense_layout(self.spec)
        if in_out:
            return super()._params_to_product_array(vector)
        weight = vector[0]
        if has_bias:
            weight = jnp.concatenate([weight, vector[1][:, None]], axis=1)
        return weight, (1, 0)

    def _product_array_to_params(self, array: Array) -> tuple[Array, ...]:
        in_out, has_bias, n_in, _ = dense_layout(self.spec)
        if in_out:
            return super()._product_array_to_params(array)
        return (array[:, :n_in], array[:, n_in]) if has_bias else (array,)

    def _factor_statistics(self, data, batch_size) -> tuple[Array, ...]:
        return dense_kronecker_factors(self.spec, data, batch_size, self.dtype)
