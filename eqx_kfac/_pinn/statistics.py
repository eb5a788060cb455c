"""Statistics of `taylor_dense` layers: exact per-example gradients and Kronecker factors.

For point set `k` a layer sees the Taylor coefficients `x: (B_k, S_k, in)` of its input and the
output tangents `dy: (V, B_k, S_k, out)`. With `x̃` the input with a 1 appended on the value
channel (0 on the derivative channels: the bias enters the value only), the exact per-example
gradient of the (weight, bias) pair is `Σ_s x̃_s dy_sᵀ`, and the Kronecker factors of point set `k`
are (Dangel, Müller and Zeinhofer 2024; Eschenhagen et al. 2023 for the two variants)

- expand: `A_k = Σ_{b,s} x̃ x̃ᵀ / (B_k S_k)`, `G_k = Σ_v Σ_{b,s} dy dyᵀ / batch_size`;
- reduce: `A_k = Σ_b x̄ x̄ᵀ / B_k` with `x̄ = Σ_s x̃_s / S_k`,
  `G_k = Σ_v Σ_b ḡ ḡᵀ / batch_size` with `ḡ = Σ_s dy_s`.

`A_k` is a mean over the point set's own inputs; `G_k` is divided by the estimator's batch size
(that of the first registered loss), and the loss weights make every point set's term a mean
over its own points (see `register_residual_loss`).
"""

from typing import Any, Literal

import jax.numpy as jnp
from jax.typing import ArrayLike
from jaxtyping import Array

from .._curvature.blocks._layer_stats import dense_layout
from .._tracing.layer_data import EstimationData, LayerSpec


Approximation = Literal["expand", "reduce"]

APPROXIMATIONS = ("expand", "reduce")


def check_approximation(block: Any) -> None:
    """Raises `ValueError` unless `block.approximation` is `"expand"` or `"reduce"`."""
    if block.approximation not in APPROXIMATIONS:
        raise ValueError(
            f"{type(block).__name__}: approximation must be 'expand' or 'reduce', got "
            f"{block.approximation!r}."
        )


def augmented_inputs(spec: LayerSpec, x: Array, dtype: Any) -> Array:
    """The inputs `(B, S, in)` with a bias entry appended: 1 on the value channel, 0 elsewhere.

    **Arguments:**

    - `spec`: the `taylor_dense` layer's spec.
    - `x`: one point set's input coefficients.
    - `dtype`: the statistics dtype.

    **Returns:**

    `(B, S, in + 1)` with a bias, `(B, S, in)` without.
    """
    x = x.astype(dtype)
    _, has_bias, _, _ = dense_layout(spec)
    if not has_bias:
        return x
    indicator = jnp.zeros((*x.shape[:2], 1), dtype).at[:, 0].set(1.0)
    return jnp.concatenate([x, indicator], axis=-1)


def gradient_samples(spec: LayerSpec, data: EstimationData, dtype: Any) -> tuple[tuple[Array, ...], ...]:
    """Exact per-example gradients of a `taylor_dense` layer's parameters, per point set.

    **Arguments:**

    - `spec`: the layer's spec.
    - `data`: its inputs `x_k: (B_k, S_k, in)` and output tangents `dy_k: (V, B_k, S_k, out)`.
    - `dtype`: the statistics dtype.

    **Returns:**

    For each point set, one array per parameter, `(V, B_k, *param_shape)`.
    """
    in_out, has_bias, n_in, _ = dense_layout(spec)
    per_set = []
    for x, dy in zip(data.inputs, data.outputs_tangent, strict=True):
        x = augmented_inputs(spec, x, dtype)
        grads = jnp.einsum("bsi,vbso->vbio", x, dy.astype(dtype))
        weight = grads[:, :, :n_in] if in_out else jnp.swapaxes(grads[:, :, :n_in], 2, 3)
        per_set.append((weight, grads[:, :, n_in]) if has_bias else (weight,))
    return tuple(per_set)


def factor_pairs(
    spec: LayerSpec,
    data: EstimationData,
    batch_size: ArrayLike,
    dtype: Any,
    approximation: Approximation,
) -> tuple[tuple[tuple[Array, Array], ...], tuple[int, ...]]:
    """Each point set's Kronecker factors `(A_k, G_k)` (see the module docstring).

    **Arguments:**

    - `spec`: the layer's spec.
    - `data`: its inputs and output tangents.
    - `batch_size`: the divisor of the `G_k`.
    - `dtype`: the statistics dtype.
    - `approximation`: `"expand"` or `"reduce"`.

    **Returns:**

    `(pairs, counts)`: one `(A_k, G_k)` per point set, and the number of input rows each `A_k`
    averages (`B_k S_k` for expand, `B_k` for reduce).
    """
    pairs, counts = [], []
    for x, dy in zip(data.inputs, data.outputs_tangent, strict=True):
        x = augmented_inputs(spec, x, dtype)
        dy = dy.astype(dtype)
        if approximation == "reduce":
            x = jnp.mean(x, axis=1)
            dy = jnp.sum(dy, axis=2)
        x = jnp.reshape(x, (-1, x.shape[-1]))
        dy = jnp.reshape(dy, (-1, dy.shape[-1]))
        pairs.append((x.T @ x / x.shape[0], dy.T @ dy / batch_size))
        counts.append(x.shape[0])
    return tuple(pairs), tuple(counts)
