"""Registering layers by hand: the `register_*` functions of the layer tags.

Each checks that the shapes fit its tag (raising a `ValueError` that says what was expected) and
binds the tag (`tags.py`) with the origin `"manual"`; the graph matcher binds dense layers through
`bind_dense` too, with its pattern's name as the origin.
"""

import math
import operator
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jaxtyping import Array

from .tags import conv2d_tag, dense_tag, embedding_tag, generic_tag, scale_and_shift_tag


def _shape_error(what: str, detail: str) -> ValueError:
    return ValueError(f"{what}: {detail}")


def _in_dims(what: str, x: tuple[int, ...], y: tuple[int, ...], w: tuple[int, ...], num_in_dims: int | None) -> int:
    """How many leading axes of an n-d weight `(*in, *out)` are input features."""
    fits = [
        k for k in range(1, len(w))
        if x[len(x) - k:] == w[:k] and y[len(y) - (len(w) - k):] == w[k:]
        and x[: len(x) - k] == y[: len(y) - (len(w) - k)] and len(x) >= k
    ]
    if num_in_dims is not None:
        fits = [k for k in fits if k == num_in_dims]
    if len(fits) != 1:
        raise _shape_error(
            what,
            "an n-d weight must be (*in, *out), with x: (..., *in) and y: (..., *out) sharing their "
            + ("leading dims; " if not fits else "leading dims, and several splits fit: pass num_in_dims; ")
            + "a transposed n-d weight is not supported.",
        )
    return fits[0]


def register_dense(
    y: Array,
    x: Array,
    w: Array,
    b: Array | None = None,
    *,
    weight_layout: str | None = None,
    variant: str = "dense",
    num_in_dims: int | None = None,
) -> Array:
    """Registers a dense layer `y = x @ w (+ b)` (or `y = x @ w.T (+ b)`).

    **Arguments:**

    - `y`: the layer output, shape `(..., out)`.
    - `x`: the layer input, shape `(..., in)` with the same leading dims as `y`: the batch axis,
      then any number of axes the layer is repeated along (sequence positions, FermiNet's
      electrons), which the blocks treat as more examples (the "expand" convention).
    - `w`: the weight, shape `(in, out)` (layout `"in_out"`) or `(out, in)` (layout `"out_in"`, as
      in `eqx.nn.Linear`). The layout is inferred from the shapes; a square weight is taken as
      `"in_out"` unless `weight_layout` says otherwise. A weight of more than two axes is
      `(*in, *out)` (`y = jnp.tensordot(x, w, len(in)) (+ b)`, as Flax's `DenseGeneral` and
      kfac-jax's dense patterns have it) with `x: (..., *in)`, `y: (..., *out)` and `b: out`;
      the tag gets the features flattened, and the blocks treat the weight as its
      `(prod(in), prod(out))` reshape.
    - `b`: optional bias of shape `(out,)` (or `out` for an n-d weight).
    - `weight_layout`: `"in_out"` or `"out_in"`, to override the inference.
    - `variant`: kfac-jax's keyword, kept in the tag's parameters (the `LayerSpec`'s `meta`).
      `"dense"` (the default) and `"repeated_dense"` are the same layer here: the dense tag
      takes repeated axes after the batch axis, which kfac-jax's `"dense"` refuses and its
      `"repeated_dense"` (`register_repeated_dense`) takes. Any other name is a variant of your
      own: the layer gets the block given for that name in `layer_tag_to_block_ctor` (or by
      `set_default_tag_to_block_ctor`), and the dense blocks where there is none.
    - `num_in_dims`: for an n-d weight, how many of its leading axes are input features, when
      the shapes leave it ambiguous.

    **Returns:**

    `y`, unchanged.
    """
    return bind_dense(
        y, x, w, b, weight_layout=weight_layout, variant=variant, num_in_dims=num_in_dims, origin="manual"
    )


def bind_dense(
    y: Array,
    x: Array,
    w: Array,
    b: Array | None = None,
    *,
    weight_layout: str | None,
    variant: str,
    origin: str,
    num_in_dims: int | None = None,
) -> Array:
    """`register_dense` with the tag's `origin` (the graph matcher binds matched dense layers
    through it, with the pattern's name): checks the shapes, flattens the features of an n-d
    weight's layer, and binds the dense tag.

    **Arguments:** as for `register_dense`, and `origin`.

    **Returns:**

    `y`, unchanged.
    """
    what = f"register_dense(y: {jnp.shape(y)}, x: {jnp.shape(x)}, w: {jnp.shape(w)}, b: {None if b is None else jnp.shape(b)})"
    if not isinstance(variant, str) or not variant:
        raise TypeError(f"{what}: variant must be a non-empty string such as 'dense', got {variant!r}.")
    meta = {} if variant == "dense" else {"variant": variant}
    if jnp.ndim(w) > 2 and weight_layout in (None, "in_out"):
        k = _in_dims(what, jnp.shape(x), jnp.shape(y), jnp.shape(w), num_in_dims)
        n_out = math.prod(jnp.shape(w)[k:])
        if b is not None and jnp.shape(b) != jnp.shape(w)[k:]:
            raise _shape_error(what, f"the bias must have the output features' shape {jnp.shape(w)[k:]}.")
        flat_x = jnp.reshape(x, (*jnp.shape(x)[: jnp.ndim(x) - k], -1))
        flat_y = jnp.reshape(y, (*jnp.shape(flat_x)[:-1], n_out))
        args = (flat_y, flat_x, w) if b is None else (flat_y, flat_x, w, b)
        out = dense_tag.bind(*args, weight_layout="in_out", has_bias=b is not None, origin=origin, **meta)[0]
        return jnp.reshape(out, jnp.shape(y))
    if jnp.ndim(x) < 1 or jnp.ndim(y) < 1 or jnp.ndim(w) != 2:
        raise _shape_error(what, "expected x: (..., in), y: (..., out) and a 2-D weight (or an n-d one, (*in, *out)).")
    if jnp.shape(x)[:-1] != jnp.shape(y)[:-1]:
        raise _shape_error(what, "x and y must have the same leading (batch) dimensions.")
    n_in, n_out = jnp.shape(x)[-1], jnp.shape(y)[-1]
    fits = {"in_out": jnp.shape(w) == (n_in, n_out), "out_in": jnp.shape(w) == (n_out, n_in)}
    requested = weight_layout
    if weight_layout is None:
        weight_layout = "in_out" if fits["in_out"] else "out_in"
    if weight_layout not in fits:
        raise ValueError(f"{what}: weight_layout must be 'in_out' or 'out_in', got {weight_layout!r}.")
    if not fits[weight_layout]:
        raise _shape_error(
            what,
            f"the weight must have shape (in, out) = {(n_in, n_out)} or (out, in) = {(n_out, n_in)}"
            + (f" for weight_layout={requested!r}." if requested else "."),
        )
    if b is not None and jnp.shape(b) != (n_out,):
        raise _shape_error(what, f"the bias must have shape (out,) = {(n_out,)}.")
    args = (y, x, w) if b is None else (y, x, w, b)
    return dense_tag.bind(*args, weight_layout=weight_layout, has_bias=b is not None, origin=origin, **meta)[0]


def register_repeated_dense(
    y: Array, x: Array, w: Array, b: Array | None = None, *, weight_layout: str | None = None
) -> Array:
    """`register_dense(..., variant="repeated_dense")`, kfac-jax's (and FermiNet's) name for a
    dense layer applied along repeated axes, e.g. to every electron: `x: (batch, *repeats, in)`.

    **Arguments:** as for [`register_dense`][eqx_kfac.register_dense].

    **Returns:**

    `y`, unchanged.
    """
    return register_dense(y, x, w, b, weight_layout=weight_layout, variant="repeated_dense")


def normalize_conv_params(
    x_shape: tuple[int, ...],
    w_shape: tuple[int, ...],
    window_strides: Sequence[int] | None = None,
    padding: str | Sequence[tuple[int, int]] = "VALID",
    lhs_dilation: Sequence[int] | None = None,
    rhs_dilation: Sequence[int] | None = None,
    dimension_numbers: Any = None,
    feature_group_count: int = 1,
) -> dict[str, Any]:
    """Normalises `lax.conv_general_dilated` keyword arguments to hashable conv2d tag parameters.

    **Arguments:**

    - `x_shape`, `w_shape`: shapes of the convolution's input and kernel.
    - the remaining arguments are those of `lax.conv_general_dilated` (`window_strides` defaults
      to ones; `dimension_numbers` may be strings such as `("NHWC", "HWIO", "NHWC")`).

    **Returns:**

    A dict with `window_strides`, `padding` (explicit `(lo, hi)` pairs), `lhs_dilation`,
    `rhs_dilation`, `dimension_numbers` (a `lax.ConvDimensionNumbers`) and `feature_group_count`.
    """
    n_spatial = len(x_shape) - 2
    dnums = lax.conv_dimension_numbers(x_shape, w_shape, dimension_numbers)
    strides = tuple(int(s) for s in (window_strides or (1,) * n_spatial))
    lhs_dil = tuple(int(s) for s in (lhs_dilation or (1,) * n_spatial))
    rhs_dil = tuple(int(s) for s in (rhs_dilation or (1,) * n_spatial))
    if isinstance(padding, str):
        if any(d != 1 for d in lhs_dil):
            raise ValueError("String padding is not supported with lhs_dilation; pass (lo, hi) pairs.")
        in_spatial = [x_shape[i] for i in dnums.lhs_spec[2:]]
        kernel = [(w_shape[i] - 1) * d + 1 for i, d in zip(dnums.rhs_spec[2:], rhs_dil)]
        padding = lax.padtype_to_pads(in_spatial, kernel, strides, padding)
    pads = tuple((int(lo), int(hi)) for lo, hi in padding)
    return dict(
        window_strides=strides,
        padding=pads,
        lhs_dilation=lhs_dil,
        rhs_dilation=rhs_dil,
        dimension_numbers=dnums,
        feature_group_count=int(feature_group_count),
    )


def register_conv2d(y: Array, x: Array, w: Array, b: Array | None = None, **conv_params: Any) -> Array:
    """Registers a 2-D convolution `y = lax.conv_general_dilated(x, w, **conv_params) (+ b)`.

    **Arguments:**

    - `y`: the convolution output.
    - `x`: the convolution input (with its batch axis, as `lax.conv_general_dilated` takes it).
    - `w`: the kernel.
    - `b`: optional bias with one entry per output feature (any shape of that size, e.g. `(out,)`
      or `eqx.nn.Conv2d`'s `(out, 1, 1)`), added along the output feature axis.
    - `**conv_params`: keyword arguments of `lax.conv_general_dilated`: `window_strides`,
      `padding`, `lhs_dilation`, `rhs_dilation`, `dimension_numbers` (e.g.
      `("NHWC", "HWIO", "NHWC")`), `feature_group_count`; and, as kfac-jax passes them,
      `batch_group_count` (only `1`: a convolution grouped over the batch mixes examples),
      `precision`, `preferred_element_type` and `out_sharding`, which are checked (by
      `lax.conv_general_dilated` itself) and otherwise ignored: they change the rounding, not
      the layer.

    **Returns:**

    `y`, unchanged.
    """
    what = f"register_conv2d(y: {jnp.shape(y)}, x: {jnp.shape(x)}, w: {jnp.shape(w)}, b: {None if b is None else jnp.shape(b)})"
    if jnp.ndim(x) != 4 or jnp.ndim(w) != 4:
        raise _shape_error(what, "x and w must be 4-D (batch, feature and two spatial axes).")
    numerics = {k: conv_params.pop(k) for k in ("precision", "preferred_element_type", "out_sharding") if k in conv_params}
    unknown = set(conv_params) - {
        "window_strides", "padding", "lhs_dilation", "rhs_dilation", "dimension_numbers", "feature_group_count",
        "batch_group_count",
    }
    if unknown:
        raise TypeError(f"{what}: unsupported convolution arguments {sorted(unknown)}.")
    if conv_params.pop("batch_group_count", 1) != 1:
        raise ValueError(f"{what}: batch_group_count != 1 mixes examples in one output; register it with register_generic.")
    params = normalize_conv_params(jnp.shape(x), jnp.shape(w), **conv_params)
    # Float32 kernels meet float64 inputs under `jax_enable_x64` (the layer converts the kernel).
    dtype = jnp.result_type(x, w)
    try:
        expected = jax.eval_shape(
            lambda a, k: lax.conv_general_dilated(a, k, **params, **numerics),
            jax.ShapeDtypeStruct(jnp.shape(x), dtype),
            jax.ShapeDtypeStruct(jnp.shape(w), dtype),
        ).shape
    except (TypeError, ValueError) as e:
        raise _shape_error(what, f"the convolution arguments do not fit the shapes ({e}).") from e
    if expected != jnp.shape(y):
        raise _shape_error(what, f"the convolution gives shape {expected}, not y's shape.")
    n_out = jnp.shape(w)[params["dimension_numbers"].rhs_spec[0]]
    if b is not None and math.prod(jnp.shape(b)) != n_out:
        raise _shape_error(what, f"the bias must have {n_out} entries (one per output feature).")
    args = (y, x, w) if b is None else (y, x, w, b)
    return conv2d_tag.bind(*args, **params, has_bias=b is not None, origin="manual")[0]


def _normalize_param_axes(
    what: str, param_axes: Sequence[int], x_shape: tuple[int, ...], params: Sequence[Array]
) -> tuple[int, ...] | None:
    """Checks `param_axes` and returns them counted from the end of `x` (`None`: trailing)."""
    rank = len(x_shape)
    try:
        axes = tuple(operator.index(a) for a in param_axes)
    except TypeError as e:
        raise TypeError(f"{what}: param_axes must be a sequence of ints, got {param_axes!r}.") from e
    if any(not -rank <= a < rank for a in axes):
        raise ValueError(f"{what}: param_axes {axes} are out of range for x of rank {rank}.")
    # Counted from the end, the axes stay the same when vmap adds batch axes in front of x.
    axes = tuple(a - rank if a >= 0 else a for a in axes)
    if any(a >= b for a, b in zip(axes, axes[1:])):
        raise ValueError(f"{what}: param_axes {param_axes} must name distinct axes of x in increasing order.")
    for p in params:
        ps = jnp.shape(p)
        if len(ps) != len(axes) or any(d not in (1, x_shape[a]) for d, a in zip(ps, axes)):
            raise _shape_error(
                what,
                f"with param_axes={param_axes}, scale and shift must have one dimension per axis, "
                f"each 1 or equal to x's size there; x has sizes {tuple(x_shape[a] for a in axes)} "
                "on those axes.",
            )
    return None if axes == tuple(range(-len(axes), 0)) else axes


def register_scale_and_shift(
    y: Array,
    x: Array,
    scale: Array | None = None,
    shift: Array | None = None,
    *,
    param_axes: Sequence[int] | None = None,
) -> Array:
    """Registers an elementwise affine layer `y = x * scale + shift`.

    **Arguments:**

    - `y`: the layer output, same shape as `x`.
    - `x`: the layer input.
    - `scale`, `shift`: optional parameters (at least one). By default they broadcast against the
      trailing dims of `x` (as in `eqx.nn.LayerNorm`).
    - `param_axes`: the axes of `x` that the parameters' dimensions lie along, one per dimension,
      in increasing order, for parameters aligned with other axes than the trailing ones. For
      example `eqx.nn.GroupNorm` scales a per-example `x` of shape `(channels, *spatial)` by a
      `(channels,)` weight: `param_axes=(0,)` (per example) or `(1,)` (on a batch). The axes are
      stored counted from the end of `x` (here `(-3,)` for two spatial axes), so they are the same
      whether the layer is registered per example under `jax.vmap` or on the batch; they must not
      include the batch axis.

    **Returns:**

    `y`, unchanged.
    """
    what = (
        f"register_scale_and_shift(y: {jnp.shape(y)}, x: {jnp.shape(x)}, scale: "
        f"{None if scale is None else jnp.shape(scale)}, shift: {None if shift is None else jnp.shape(shift)})"
    )
    if scale is None and shift is None:
        raise ValueError(f"{what}: give at least one of scale and shift.")
    if jnp.shape(y) != jnp.shape(x):
        raise _shape_error(what, "y and x must have the same shape.")
    params = tuple(p for p in (scale, shift) if p is not None)
    if param_axes is None:
        for p in params:
            ps, xs = jnp.shape(p), jnp.shape(x)
            trailing = xs[len(xs) - len(ps) :] if ps else ()
            if len(ps) > len(xs) or any(a not in (1, b) for a, b in zip(ps, trailing)):
                raise _shape_error(
                    what,
                    "scale and shift must broadcast against the trailing dims of x; pass param_axes "
                    "for parameters aligned with other axes (e.g. the channel axis of GroupNorm).",
                )
    else:
        param_axes = _normalize_param_axes(what, param_axes, jnp.shape(x), params)
    return scale_and_shift_tag.bind(
        y,
        x,
        *params,
        has_scale=scale is not None,
        has_shift=shift is not None,
        param_axes=param_axes,
        origin="manual",
    )[0]


def register_embedding(y: Array, ids: Array, table: Array) -> Array:
    """Registers an embedding lookup `y = table[ids]` (the gather of `eqx.nn.Embedding`).

    **Arguments:**

    - `y`: the looked-up rows, shape `(*ids.shape, features)`.
    - `ids`: the integer token ids (any leading shape; batch first once vmapped).
    - `table`: the embedding table `(vocab, features)`.

    **Returns:**

    `y`, unchanged.
    """
    if jnp.ndim(table) != 2 or jnp.shape(y) != (*jnp.shape(ids), jnp.shape(table)[1]):
        raise ValueError(
            f"register_embedding(y: {jnp.shape(y)}, ids: {jnp.shape(ids)}, table: "
            f"{jnp.shape(table)}): expected a 2-D table (vocab, features) and y of shape "
            "(*ids.shape, features)."
        )
    if not jnp.issubdtype(jnp.result_type(ids), jnp.integer):
        raise TypeError(f"register_embedding: ids must be integers, got {jnp.result_type(ids)}.")
    return embedding_tag.bind(y, ids, table, origin="manual")[0]


def register_generic(*params: Array) -> Array | tuple[Array, ...]:
    """Registers parameters as one generic layer (no inputs or outputs are known).

    **Arguments:**

    - `*params`: the parameters.

    **Returns:**

    The parameters, unchanged: the array itself for one parameter, a tuple otherwise.
    """
    if not params:
        raise ValueError("register_generic needs at least one parameter.")
    out = generic_tag.bind(*params, origin="manual")
    return out[0] if len(params) == 1 else tuple(out)
