"""Spec checks, layouts and statistics of dense and scale-and-shift layers.

Shared by the diagonal, full and Kronecker blocks of these layers, and public (exported from
`eqx_kfac`) for new blocks of these layers.
"""

from typing import Any

import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike
from jaxtyping import Array, Float, Shaped

from ..._tracing.layer_data import EstimationData, LayerSpec
from .base import CurvatureBlock
from .statistics import sum_to_shape


def dense_parameters_problem(spec: LayerSpec, two_dimensional: bool) -> str | None:
    """What is wrong with a dense-like layer's weight layout and parameters (`None`: nothing):
    a layout other than `"in_out"`/`"out_in"`, or parameters other than a weight (2-D when
    `two_dimensional`, else at least 2-D) and, when `has_bias`, a bias."""
    layout = spec.get("weight_layout")
    has_bias = bool(spec.get("has_bias", len(spec.param_shapes) == 2))
    if layout not in ("in_out", "out_in"):
        return f"weight_layout must be 'in_out' or 'out_in', got {layout!r}"
    weight_dims = len(spec.param_shapes[0]) if spec.param_shapes else 0
    if len(spec.param_shapes) != 1 + has_bias or weight_dims < 2 or (two_dimensional and weight_dims != 2):
        weight = "a 2-D weight" if two_dimensional else "a weight"
        return f"expected {weight}{' and a bias' if has_bias else ''}, got parameter shapes {spec.param_shapes}"
    return None


def check_dense_spec(block: CurvatureBlock) -> None:
    """Raises `ValueError` unless `block.spec` is a well-formed dense layer.

    **Arguments:**

    - `block`: the block being constructed (for the error message).
    """
    spec = block.spec
    problem = dense_parameters_problem(spec, two_dimensional=False)
    if problem is None and (len(spec.input_shapes) != 1 or len(spec.output_shapes) != 1):
        problem = "expected one input and one output"
    elif problem is None and len(spec.param_shapes[0]) > 2 and not _fits_flattened(spec):
        problem = (
            f"an n-d weight must be (*in, *out) (layout 'in_out') with the input's and output's "
            f"features flattened, got parameter shapes {spec.param_shapes} for input "
            f"{spec.input_shapes[0]} and output {spec.output_shapes[0]}"
        )
    if problem is not None:
        raise ValueError(f"{type(block).__name__} cannot handle the {spec.describe}: {problem}.")


def _fits_flattened(spec: LayerSpec) -> bool:
    n_in, n_out = spec.input_shapes[0][-1], spec.output_shapes[0][-1]
    return (
        spec.get("weight_layout") == "in_out"
        and int(np.prod(spec.param_shapes[0])) == n_in * n_out
        and all(int(np.prod(s)) == n_out for s in spec.param_shapes[1:])
    )


def dense_layout(spec: LayerSpec) -> tuple[bool, bool, int, int]:
    """Reads a dense layer's layout from its spec.

    **Arguments:**

    - `spec`: a dense layer's spec (checked by `check_dense_spec`).

    **Returns:**

    `(in_out, has_bias, n_in, n_out)`: whether the weight is `(in, out)`, whether there is a
    bias, and the input and output sizes. An n-d weight `(*in, *out)` (`register_dense` hands
    the tag the features flattened) is `(prod(in), prod(out))` in `"in_out"` layout.
    """
    in_out = spec.get("weight_layout") == "in_out"
    has_bias = len(spec.param_shapes) == 2
    if len(spec.param_shapes[0]) != 2:
        return True, has_bias, spec.input_shapes[0][-1], spec.output_shapes[0][-1]
    rows, cols = spec.param_shapes[0]
    return (in_out, has_bias, rows, cols) if in_out else (in_out, has_bias, cols, rows)


def dense_gradient_samples(spec: LayerSpec, data: EstimationData) -> tuple[Array, ...]:
    """Exact per-example gradients of a dense layer's parameters, built from `x` and `dy`.

    Extra leading input dims (sequence positions) are summed inside each example, so these are
    the true per-example gradients (no "expand" approximation).

    **Arguments:**

    - `spec`: the dense layer's spec.
    - `data`: inputs `x: (B, *extra, in)` and output tangents `dy: (V, B, *extra, out)`.

    **Returns:**

    Per-parameter arrays shaped `(V * B, *param_shape)`.
    """
    in_out, has_bias, n_in, n_out = dense_layout(spec)
    (x,) = data.inputs
    (dy,) = data.outputs_tangent
    v, b = dy.shape[:2]
    # Explicit sizes: a `-1` cannot be inferred when a layer has zero inputs or outputs.
    positions = int(np.prod(x.shape[1:-1], dtype=int))
    x = jnp.reshape(x, (b, positions, n_in))
    dy = jnp.reshape(dy, (v, b, positions, n_out))
    equation = "bti,vbto->vbio" if in_out else "bti,vbto->vboi"
    samples = (jnp.reshape(jnp.einsum(equation, x, dy), (v * b, *spec.param_shapes[0])),)
    if has_bias:
        samples += (jnp.reshape(jnp.sum(dy, axis=2), (v * b, *spec.param_shapes[1])),)
    return samples


def dense_params_to_array(spec: LayerSpec, vector: tuple[Array, ...]) -> Shaped[Array, "rows out"]:
    """A dense layer's parameters as one `(in, out)` array, with the bias as an extra last row.

    The canonical array of `DenseTwoKroneckerFactored`, on which `A ⊗ G` acts factor-wise:
    `(A ⊗ G) vec(W) = vec(A W G)` for this array `W`. An `(out, in)` weight (`"out_in"`) is
    transposed, an n-d `(*in, *out)` weight reshaped. Any dtype (integer arrays of positions
    too).

    **Arguments:**

    - `spec`: the dense layer's spec (checked by `check_dense_spec`).
    - `vector`: arrays shaped like `spec.param_shapes` (weight, then bias if any).

    **Returns:**

    An array of shape `(in + has_bias, out)`.
    """
    in_out, has_bias, n_in, n_out = dense_layout(spec)
    weight = jnp.reshape(vector[0], (n_in, n_out)) if in_out else vector[0].T
    if not has_bias:
        return weight
    return jnp.concatenate([weight, jnp.reshape(vector[1], (1, n_out))], axis=0)


def dense_array_to_params(spec: LayerSpec, array: Shaped[Array, "rows out"]) -> tuple[Array, ...]:
    """The inverse of `dense_params_to_array`.

    **Arguments:**

    - `spec`: the dense layer's spec.
    - `array`: an array of shape `(in + has_bias, out)`.

    **Returns:**

    A tuple of arrays shaped like `spec.param_shapes`.
    """
    in_out, has_bias, n_in, _ = dense_layout(spec)
    shapes = spec.param_shapes
    weight = array[:n_in]
    params = (jnp.reshape(weight, shapes[0]) if in_out else weight.T,)
    if has_bias:
        params += (jnp.reshape(array[n_in], shapes[1]),)
    return params


def dense_kronecker_factors(
    spec: LayerSpec, data: EstimationData, batch_size: ArrayLike, dtype: Any
) -> tuple[Float[Array, "rows rows"], Float[Array, "out out"]]:
    """This batch's K-FAC factors `(A, G)` of a dense layer (see `DenseTwoKroneckerFactored`).

    **Arguments:**

    - `spec`: the dense layer's spec.
    - `data`: inputs `x: (B, *extra, in)` and output tangents `dy: (V, B, *extra, out)`.
    - `batch_size`: `B`, the number of examples the statistics are averaged over.
    - `dtype`: the statistics dtype (`statistics_dtype(spec)`).

    **Returns:**

    `A = Σ_{b,t} x̃ x̃ᵀ / (B T)` (`x̃` = `x` with a 1 appended when there is a bias) and
    `G = Σ_v Σ_{b,t} dy dyᵀ / B`, with `T = prod(extra)` positions per example, the factors of
    `dense_params_to_array`'s array.
    """
    _, has_bias, n_in, n_out = dense_layout(spec)
    (x,) = data.inputs
    (dy,) = data.outputs_tangent
    positions = int(np.prod(x.shape[1:-1], dtype=int))
    # Explicit sizes: a `-1` cannot be inferred when a layer has zero inputs or outputs.
    x = jnp.reshape(x.astype(dtype), (x.shape[0] * positions, n_in))
    if has_bias:
        x = jnp.concatenate([x, jnp.ones((x.shape[0], 1), dtype)], axis=1)
    dy = jnp.reshape(dy.astype(dtype), (int(np.prod(dy.shape[:-1], dtype=int)), n_out))
    return (x.T @ x / (batch_size * positions), dy.T @ dy / batch_size)


def check_scale_and_shift_spec(block: CurvatureBlock) -> None:
    """Raises `ValueError` unless `block.spec` is a well-formed scale-and-shift layer.

    **Arguments:**

    - `block`: the block being constructed (for the error message).
    """
    spec = block.spec
    count = bool(spec.get("has_scale")) + bool(spec.get("has_shift"))
    problem = None
    if count == 0 or len(spec.param_shapes) != count or len(spec.input_shapes) != 1:
        problem = (
            f"expected one input and parameters matching has_scale={spec.get('has_scale')}, "
            f"has_shift={spec.get('has_shift')}, got parameter shapes {spec.param_shapes}"
        )
    else:
        axes = spec.get("param_axes")
        rank = len(spec.input_shapes[0])
        if axes is not None and not (
            all(isinstance(a, int) and -rank < a < 0 for a in axes)
            and all(a < b for a, b in zip(axes, axes[1:]))
            and all(len(s) == len(axes) for s in spec.param_shapes)
        ):
            problem = (
                f"param_axes={axes} must be increasing negative axes of the input (shape "
                f"{spec.input_shapes[0]}) other than its batch axis, one per parameter dimension "
                f"(parameter shapes {spec.param_shapes})"
            )
    if problem is not None:
        raise ValueError(f"{type(block).__name__} cannot handle the {spec.describe}: {problem}.")


def _sum_to_param(spec: LayerSpec, array: Array, shape: tuple[int, ...]) -> Array:
    """Sums `array: (V, B, *x_shape)` to `(V, B, *shape)` over the axes the parameter is broadcast along.

    A parameter may have a unit axis for the batch axis of `x` too (Haiku's `BatchNorm` keeps its
    scale as `(1, 1, 1, c)` for `x: (B, h, w, c)`)."""
    axes = spec.get("param_axes")
    if axes is not None:
        # Moving the parameter's axes to the end makes it broadcast against the trailing dims.
        array = jnp.moveaxis(array, [array.ndim + a for a in axes], list(range(-len(axes), 0)))
    per_example = shape[max(len(shape) - (array.ndim - 2), 0) :]
    return jnp.reshape(sum_to_shape(array, 2, per_example), (*array.shape[:2], *shape))


def scale_and_shift_gradient_samples(
    spec: LayerSpec, data: EstimationData
) -> tuple[Array, ...]:
    """Exact per-example gradients of `y = x * scale + shift` w.r.t. `scale` and `shift`.

    **Arguments:**

    - `spec`: the layer's spec (`has_scale` / `has_shift` in its meta, and `param_axes`: the axes
      of `x`, counted from the end, that the parameters lie along; `None` or absent for the
      trailing axes).
    - `data`: inputs `x: (B, ...)` and output tangents `dy: (V, B, ...)`.

    **Returns:**

    Per-parameter arrays shaped `(V * B, *param_shape)`, scale first.
    """
    (x,) = data.inputs
    (dy,) = data.outputs_tangent
    v, b = dy.shape[:2]
    shapes = list(spec.param_shapes)
    samples = []
    if spec.get("has_scale"):
        samples.append(_sum_to_param(spec, x[None] * dy, shapes.pop(0)))
    if spec.get("has_shift"):
        samples.append(_sum_to_param(spec, dy, shapes.pop(0)))
    return tuple(jnp.reshape(g, (v * b, *g.shape[2:])) for g in samples)
