"""The `taylor_dense` layer tag: a dense layer applied in Taylor mode to several point sets.

Taylor-mode differentiation pushes the network's value and its input derivatives (Taylor
coefficients) forward together. A dense layer `z ↦ W z + b` maps every coefficient with the same
weight, and the bias enters the value only: for the coefficients `Z: (batch, S, in)` of one point
set (channel 0 is the value, channels 1.. the derivatives), the layer computes
`Y = Z Wᵀ + e_0 bᵀ`. The weight is shared over the `S` channels, which is what the curvature
blocks of `_pinn/blocks.py` and `_pinn/kronecker_sum.py` exploit (Dangel, Müller and Zeinhofer,
2024).

A physics-informed loss evaluates the same network on several point sets (interior and
boundary points, each with the derivatives its residual needs). A parameter may belong to one
layer tag only, so one `taylor_dense` tag records all of them: it has one input and one output
per point set. The tags of different arities share the name `"taylor_dense"` (the key of
`layer_tag_to_block_ctor`).
"""

from collections.abc import Sequence

import jax.numpy as jnp
from jaxtyping import Array

from .._curvature.blocks._layer_stats import dense_layout, dense_parameters_problem
from .._curvature.blocks.base import CurvatureBlock
from .._tracing.layer_data import LayerSpec
from .._tracing.tags import LayerTag


TAG_NAME = "taylor_dense"

_TAGS: dict[int, LayerTag] = {}


def taylor_dense_tag(num_point_sets: int) -> LayerTag:
    """The `taylor_dense` layer tag with one input and one output per point set.

    **Arguments:**

    - `num_point_sets`: the number of point sets the layer is applied to (at least 1).

    **Returns:**

    The `LayerTag` (created on first use and shared afterwards).
    """
    if num_point_sets not in _TAGS:
        _TAGS[num_point_sets] = LayerTag(TAG_NAME, num_inputs=num_point_sets, num_outputs=num_point_sets)
    return _TAGS[num_point_sets]


def register_taylor_dense(
    ys: Sequence[Array],
    xs: Sequence[Array],
    w: Array,
    b: Array | None = None,
    *,
    weight_layout: str = "out_in",
) -> tuple[Array, ...]:
    """Registers a dense layer applied in Taylor mode to one or more point sets.

    For each point set, `x: (batch, S, in)` holds the layer input's Taylor coefficients (channel
    0 the value, the others its derivatives with respect to the network's input) and
    `y = x @ w.T + b` on channel 0, `y = x @ w.T` on the others (layout `"out_in"`, as in
    `eqx.nn.Linear`; `"in_out"`: `x @ w`). `eqx_kfac.taylor_forward` calls this for every
    `eqx.nn.Linear` of an MLP; call it yourself to propagate derivatives through another
    architecture.

    **Arguments:**

    - `ys`: the layer's output coefficients, one `(batch, S, out)` array per point set.
    - `xs`: the layer's input coefficients, one `(batch, S, in)` array per point set (batch and
      channel counts may differ between point sets).
    - `w`: the weight, `(out, in)` or `(in, out)` as `weight_layout` says.
    - `b`: the bias `(out,)`, or `None`.
    - `weight_layout`: `"out_in"` (default) or `"in_out"`.

    **Returns:**

    `ys`, unchanged, as a tuple (use these values downstream).
    """
    ys, xs = tuple(ys), tuple(xs)
    what = (
        f"register_taylor_dense(ys: {[jnp.shape(y) for y in ys]}, xs: {[jnp.shape(x) for x in xs]}, "
        f"w: {jnp.shape(w)}, b: {None if b is None else jnp.shape(b)})"
    )
    if weight_layout not in ("out_in", "in_out"):
        raise ValueError(f"{what}: weight_layout must be 'out_in' or 'in_out', got {weight_layout!r}.")
    if not xs or len(xs) != len(ys) or jnp.ndim(w) != 2:
        raise ValueError(f"{what}: give one input and one output per point set and a 2-D weight.")
    n_out, n_in = jnp.shape(w) if weight_layout == "out_in" else jnp.shape(w)[::-1]
    for x, y in zip(xs, ys):
        if jnp.ndim(x) != 3 or jnp.shape(x)[-1] != n_in or jnp.shape(y) != (*jnp.shape(x)[:2], n_out):
            raise ValueError(
                f"{what}: every input must be (batch, S, in) = (batch, S, {n_in}) and its output "
                f"(batch, S, out) = (batch, S, {n_out}) with the same batch and channel counts."
            )
    if b is not None and jnp.shape(b) != (n_out,):
        raise ValueError(f"{what}: the bias must have shape (out,) = {(n_out,)}.")
    args = (*ys, *xs, w) if b is None else (*ys, *xs, w, b)
    tag = taylor_dense_tag(len(xs))
    return tuple(tag.bind(*args, weight_layout=weight_layout, has_bias=b is not None, origin="manual"))


def check_taylor_dense_spec(block: CurvatureBlock) -> None:
    """Raises `ValueError` unless `block.spec` is a well-formed `taylor_dense` layer.

    **Arguments:**

    - `block`: the block being constructed (for the error message).
    """
    spec = block.spec
    problem = dense_parameters_problem(spec, two_dimensional=True)
    if problem is None and (not spec.input_shapes or len(spec.input_shapes) != len(spec.output_shapes)):
        problem = "expected one input and one output per point set"
    elif problem is None:
        _, _, n_in, n_out = dense_layout(spec)
        for x, y in zip(spec.input_shapes, spec.output_shapes):
            if len(x) != 3 or x[-1] != n_in or tuple(y) != (*x[:2], n_out):
                problem = f"expected inputs (batch, S, {n_in}) and outputs (batch, S, {n_out}), got {spec.input_shapes} and {spec.output_shapes}"
    if problem is None and (spec.stack_size is not None or spec.repeat_size is not None):
        problem = "it is inside `jax.lax.scan`, which taylor_dense blocks do not support"
    if problem is not None:
        raise ValueError(f"{type(block).__name__} cannot handle the {spec.describe}: {problem}.")


def dense_view(spec: LayerSpec) -> LayerSpec:
    """The spec of a `dense` layer with the parameters of a `taylor_dense` one.

    The Taylor layer's parameters are arranged for the Kronecker algebra as a dense layer's are
    (the weight in `(in, out)` orientation with the bias as an extra row), so its blocks use
    `DenseTwoKroneckerFactored`'s layout on this view.

    **Arguments:**

    - `spec`: a `taylor_dense` spec (checked by `check_taylor_dense_spec`).

    **Returns:**

    A `dense` `LayerSpec` with the same parameters and the first point set's input and output.
    """
    return LayerSpec(
        tag="dense",
        index=spec.index,
        param_paths=spec.param_paths,
        param_indices=spec.param_indices,
        param_shapes=spec.param_shapes,
        param_dtypes=spec.param_dtypes,
        input_shapes=spec.input_shapes[:1],
        output_shapes=spec.output_shapes[:1],
        meta=spec.meta,
        origin=spec.origin,
    )
