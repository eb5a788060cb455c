"""K-FAC-reduce (Eschenhagen et al. 2023) for dense layers applied along shared dimensions."""

from typing import ClassVar

import equinox as eqx
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike
from jaxtyping import Array

from ...._tracing.layer_data import EstimationData, LayerSpec
from .._layer_stats import check_dense_spec, dense_array_to_params, dense_layout, dense_params_to_array
from .factored import KroneckerFactored


class DenseTwoKroneckerFactoredReduce(KroneckerFactored):
    """K-FAC-reduce for dense layers with shared (e.g. sequence) dims: `C ≈ A ⊗ G` (final).

    With inputs `x: (B, *extra, in)` (`x̃` = `x` with a 1 appended when there is a bias), output
    tangents `dy: (V, B, *extra, out)` and `T = prod(extra)` positions per example, the shared
    dims are reduced *before* the outer products:

    - `A = Σ_b x̄_b x̄_bᵀ / B` with `x̄_b = Σ_t x̃_bt / T` (inputs averaged over positions),
    - `G = Σ_v Σ_b ḡ_vb ḡ_vbᵀ / B` with `ḡ_vb = Σ_t dy_vbt` (output tangents summed).

    K-FAC-expand (`DenseTwoKroneckerFactored`, the default) treats positions as more examples
    instead. Both coincide without extra dims. Eschenhagen et al. show that for deep linear
    networks expand is exact when the loss has a term per position (the "expand" setting) and
    reduce is exact when the positions are reduced before the loss (the "reduce" setting, e.g.
    mean pooling); reduce costs a factor `T` less to form. The parameter layout is the one of
    `DenseTwoKroneckerFactored`. Use it with
    `layer_tag_to_block_ctor={"dense": DenseTwoKroneckerFactoredReduce}` (or per layer with
    `index_to_block_ctor`).

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

    def _params_to_array(self, vector: tuple[Array, ...]) -> Array:
        return dense_params_to_array(self.spec, vector)

    def _array_to_params(self, array: Array) -> tuple[Array, ...]:
        return dense_array_to_params(self.spec, array)

    def _factor_statistics(self, data: EstimationData, batch_size: ArrayLike) -> tuple[Array, ...]:
        _, has_bias, n_in, n_out = dense_layout(self.spec)
        (x,) = data.inputs
        (dy,) = data.outputs_tangent
        examples = x.shape[0]
        positions = int(np.prod(x.shape[1:-1], dtype=int))
        x = jnp.reshape(x.astype(self.dtype), (examples, positions, n_in))
        x = jnp.mean(x, axis=1) if positions else jnp.zeros((examples, n_in), self.dtype)
        if has_bias:
            x = jnp.concatenate([x, jnp.ones((examples, 1), self.dtype)], axis=1)
        dy = jnp.reshape(dy.astype(self.dtype), (dy.shape[0] * examples, positions, n_out))
        dy = jnp.sum(dy, axis=1)
        return (x.T @ x / batch_size, dy.T @ dy / batch_size)
