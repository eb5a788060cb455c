"""Graph patterns: the `GraphPattern` extension point and the default layer patterns.

A [`GraphPattern`][eqx_kfac.GraphPattern] describes a layer by example (a JAX function and example
shapes); `_graph_matcher` traces it and looks for its equations in a function's jaxpr. The defaults
cover dense, conv2d and scale-and-shift layers in the forms Equinox, Flax, Haiku and plain JAX emit
them (see `docs/registration.md` for the table).
"""

from collections.abc import Callable, Sequence
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend.core import JaxprEqn

from .tags import LayerTag, conv2d_tag, dense_tag, embedding_tag, scale_and_shift_tag

ExampleArgs = tuple[Any, tuple[jax.ShapeDtypeStruct, ...]]


def _as_struct(x: Any) -> Any:
    """Shapes and dtypes of `x`, in tuples (lists are not hashable)."""
    if isinstance(x, (list, tuple)):
        return tuple(_as_struct(a) for a in x)
    return jax.ShapeDtypeStruct(np.shape(x), jnp.result_type(x))


def _is_one_example(example_args: Any) -> bool:
    """Whether `example_args` is one `(inputs, params)` pair rather than a sequence of them."""
    return (
        isinstance(example_args, (tuple, list))
        and len(example_args) == 2
        and isinstance(example_args[1], (tuple, list))
        and all(hasattr(p, "shape") for p in example_args[1])
    )


def _check_tag(name: str, tag: Any, tag_primitive: Any, in_values_preprocessor: Any) -> LayerTag:
    if in_values_preprocessor is not None:
        raise TypeError(
            f"GraphPattern {name!r}: kfac-jax's in_values_preprocessor works on jaxpr variables; "
            "pass tag_inputs_func instead, a function from the matched input values to the tag's "
            "inputs (e.g. `lambda xs: (xs[0] * xs[1],)`)."
        )
    if (tag is None) == (tag_primitive is None):
        raise TypeError(f"GraphPattern {name!r}: give the LayerTag to bind as tag= (or tag_primitive=), once.")
    tag = tag if tag is not None else tag_primitive
    if not isinstance(tag, LayerTag):
        raise TypeError(
            f"GraphPattern {name!r}: the tag must be an eqx_kfac.LayerTag (e.g. eqx_kfac.dense_tag), "
            f"got {tag!r}; kfac-jax's single layer_tag with a variant is register_dense(..., variant=...) "
            "here, or a LayerTag of your own."
        )
    return tag


class GraphPattern(eqx.Module):
    """A computation to find in a traced function and the layer tag to bind where it is found.

    This is the extension point for automatic registration of new layer kinds: write the layer's
    computation as `compute_func`, say which tag it gets and how to read the tag's keyword parameters
    off the matched equations, and pass the pattern (with the defaults) as `graph_patterns`.

    **Arguments:**

    - `name`: the pattern's name; it becomes the tag's `origin` (shown in the registration report)
      and is what `patterns_to_skip` refers to.
    - `tag` (or `tag_primitive`, kfac-jax's name): the [`LayerTag`][eqx_kfac.LayerTag] to bind,
      e.g. `eqx_kfac.dense_tag`.
    - `compute_func`: `compute_func(inputs, params) -> outputs`, the layer written with JAX
      operations, batch dimension first, exactly as it appears in the functions to match (e.g.
      under `jax.vmap` for an Equinox layer). `inputs` and `outputs` are an array or a tuple of
      `tag.num_inputs` / `tag.num_outputs` arrays; `params` is a tuple of arrays, in tag order.
    - `example_args`: one `(inputs, params)` pair (kfac-jax's `[x, [w, b]]` is one), or a
      sequence of them, of arrays or `jax.ShapeDtypeStruct`s: the pattern is traced once per
      pair, so give one per form the computation takes (e.g. one per input rank). Only shapes and
      dtypes are kept; parameters given as lists reach `compute_func` as a list (kfac-jax's
      `jax.vmap(f, in_axes=[0, [None, None]])` needs that), otherwise as a tuple.
    - `parameters_extractor_func`: `f(eqns) -> dict`, from the matched target equations (in jaxpr
      order; kfac-jax passes them reversed) to the tag's keyword parameters (without `origin`,
      which is the pattern's name). Return `None` to reject the match. `None` (the default)
      reads the built-in tags' parameters off the match: a dense layer's `weight_layout` from
      its `dot_general`, a convolution's geometry, whether a scale-and-shift layer has a scale
      (a `mul`) and a shift (an `add`); other tags get none.
    - `precedence`: patterns are tried in increasing order of precedence (ties keep their order);
      give a larger pattern (e.g. with bias) a lower number than the one it contains (without).
    - `feature_major`: `(inputs, outputs)`, whether the matched inputs (outputs) hold their
      feature axis first and their batch axes after it. `jax.vmap` leaves the activations of
      per-example layers that way between bias-free layers (`(out, batch)` instead of
      `(batch, out)`); the tag receives them with the feature axis moved last, as its
      registration function expects.
    - `tag_inputs_func`: `f(inputs) -> tuple` of the tag's `tag.num_inputs` inputs, computed from
      the matched `inputs` when the layer's input in the tag's sense is not itself a value of the
      computation (kfac-jax's `in_values_preprocessor`). Flax and Haiku normalisation layers
      compute `(x - mean) * (rsqrt(var + eps) * scale) + shift`: their pattern's inputs are
      `(x - mean, rsqrt(var + eps))` and the scale-and-shift tag's input is their product. `None`
      (the default) hands the matched inputs over as they are.
    - `broadcast_inputs`: whether the tag receives the inputs broadcast to the shape of the
      (first) output. JAX broadcasts unit axes implicitly, so in FermiNet's envelope
      `exp(-r_ae[..., None] * sigma)` the input `r_ae[..., None]` has a unit axis where the
      output and `sigma` have the orbitals; the tag's input must be what multiplies the scale
      elementwise. The default scale-and-shift patterns set it (as kfac-jax's
      `scale_and_shift_broadcast` patterns do).
    - `bind_tags`: `f(outputs, inputs, params, meta, origin) -> outputs`, binding the tags of a
      match itself (several tags, e.g. one dense tag per piece of a concatenated weight), with
      the values (tag layout) and the extractor's `meta`; it is also run on shapes to validate a
      match (a `ValueError` or `TypeError` rejects it). `None` (the default) binds `tag` once.

    Example sizes should be distinctive (e.g. 19, 23, not 1 or 2): integer literals and sizes in
    the pattern that equal a dimension of an example parameter are matched up to the target's
    parameter shapes (an `eqx.nn.Embedding` lookup contains its table's sizes as constants).
    """

    name: str = eqx.field(static=True)
    tag: LayerTag = eqx.field(static=True)
    compute_func: Callable[..., Any] = eqx.field(static=True)
    example_args: tuple[ExampleArgs, ...] = eqx.field(static=True)
    parameters_extractor_func: Callable[[Sequence[JaxprEqn]], dict[str, Any] | None] | None = eqx.field(
        static=True
    )
    precedence: int = eqx.field(static=True, default=0)
    feature_major: tuple[bool, bool] = eqx.field(static=True, default=(False, False))
    tag_inputs_func: Callable[[tuple[Any, ...]], tuple[Any, ...]] | None = eqx.field(static=True, default=None)
    broadcast_inputs: bool = eqx.field(static=True, default=False)
    list_params: bool = eqx.field(static=True, default=False)
    bind_tags: Callable[..., list[Any]] | None = eqx.field(static=True, default=None)

    def __init__(
        self,
        name: str,
        tag: LayerTag | None = None,
        compute_func: Callable[..., Any] | None = None,
        example_args: Any = None,
        parameters_extractor_func: Callable[[Sequence[JaxprEqn]], dict[str, Any] | None] | None = None,
        precedence: int = 0,
        feature_major: tuple[bool, bool] = (False, False),
        tag_inputs_func: Callable[[tuple[Any, ...]], tuple[Any, ...]] | None = None,
        broadcast_inputs: bool = False,
        bind_tags: Callable[..., list[Any]] | None = None,
        *,
        tag_primitive: Any = None,
        in_values_preprocessor: Any = None,
    ):
        tag = _check_tag(name, tag, tag_primitive, in_values_preprocessor)
        if compute_func is None or example_args is None:
            raise TypeError(f"GraphPattern {name!r}: give compute_func and example_args.")
        if _is_one_example(example_args):
            example_args = [example_args]
        sets = [(_as_struct(inputs), tuple(_as_struct(p) for p in params)) for inputs, params in example_args]
        if not sets:
            raise ValueError(f"GraphPattern {name!r}: give at least one (inputs, params) example.")
        self.name = name
        self.tag = tag
        self.compute_func = compute_func
        self.example_args = tuple(sets)
        self.parameters_extractor_func = parameters_extractor_func
        self.precedence = precedence
        self.feature_major = (bool(feature_major[0]), bool(feature_major[1]))
        self.tag_inputs_func = tag_inputs_func
        self.broadcast_inputs = bool(broadcast_inputs)
        self.list_params = all(isinstance(params, list) for _, params in example_args)
        self.bind_tags = bind_tags

    def tag_inputs(self, inputs: Sequence[Any], outputs: Sequence[Any] = ()) -> tuple[Any, ...]:
        """The tag's inputs from the matched inputs (see `tag_inputs_func` and
        `broadcast_inputs`).

        **Arguments:**

        - `inputs`: the values (or tracers, under `jax.eval_shape`) bound to the pattern's inputs,
          in order.
        - `outputs`: the values bound to its outputs (their shape is used by
          `broadcast_inputs`).

        **Returns:**

        The tag's inputs, a tuple.
        """
        xs = tuple(inputs) if self.tag_inputs_func is None else tuple(self.tag_inputs_func(tuple(inputs)))
        if self.broadcast_inputs:
            xs = tuple(jnp.broadcast_to(x, jnp.shape(outputs[0])) for x in xs)
        return xs


# ----------------------------------------------------------------------------------------------
# Default patterns


def _vmapped(f: Callable[[Any], Any], x: Any, n_batch: int | None = None) -> Any:
    """Applies a per-example function to `x` with one `vmap` per leading batch axis.

    `n_batch` is the number of batch axes; by default all but the last axis.
    """
    for _ in range(x.ndim - 1 if n_batch is None else n_batch):
        f = jax.vmap(f)
    return f(x)


def _linear_per_example(x, params):
    w, *b = params
    return _vmapped(lambda v: w @ v + b[0] if b else w @ v, x)


def _linear_feature_major(input_feature_major: bool, output_feature_major: bool, bias: bool):
    """A per-example `eqx.nn.Linear` as `jax.vmap` emits it when the batch axis of its input
    (output) sits after the feature axis: the output stays `(out, *batch)` unless it is moved back
    for the bias (or the end of the `vmap`)."""

    def compute(x, params):
        w, *b = params
        contracted = 0 if input_feature_major else x.ndim - 1
        y = lax.dot_general(w, x, (((1,), (contracted,)), ((), ())))
        if output_feature_major:
            return y
        y = jnp.moveaxis(y, 0, -1)
        return y + b[0] if bias else y

    return compute


def _dense_out_in(x, params):
    w, *b = params
    return x @ w.T + b[0] if b else x @ w.T


def _dense_in_out(x, params):
    w, *b = params
    return x @ w + b[0] if b else x @ w


def _dense_general(n_in: int) -> Callable[[Any, Any], Any]:
    """`jnp.tensordot(x, w, n_in) (+ b)`: a dense layer with an n-d weight `(*in, *out)`, as Flax's
    `DenseGeneral` and kfac-jax's dense patterns write it."""

    def compute(x, params):
        w, *b = params
        y = jnp.tensordot(x, w, axes=n_in)
        return y + b[0] if b else y

    return compute


def _conv_per_example(x, params):
    w, *b = params

    def one(v):
        y = lax.conv_general_dilated(v[None], w, (1, 1), ((0, 0), (0, 0)))[0]
        return y + b[0] if b else y

    return jax.vmap(one)(x)


def _conv_nhwc(x, params):
    w, *b = params
    y = lax.conv_general_dilated(x, w, (1, 1), ((0, 0), (0, 0)), dimension_numbers=("NHWC", "HWIO", "NHWC"))
    return y + b[0] if b else y


def _conv_nchw(x, params):
    (w,) = params
    return lax.conv_general_dilated(x, w, (1, 1), ((0, 0), (0, 0)))


def _scale_and_shift(has_scale: bool, has_shift: bool) -> Callable[[Any, Any], Any]:
    def compute(x, params):
        params = list(params)
        if has_scale:
            x = x * params.pop(0)
        return x + params.pop(0) if has_shift else x

    return compute


def _normalization(has_shift: bool) -> Callable[[Any, Any], Any]:
    """The affine part of Flax's and Haiku's normalisation layers (`LayerNorm`, `BatchNorm`), which
    multiply the scale into `rsqrt(var + eps)` before the centred input; the pattern's inputs are
    the centred input and `rsqrt(var + eps)` (see `_normalized_input`)."""

    def compute(inputs, params):
        centred, rsqrt = inputs
        y = centred * (rsqrt * params[0])
        return y + params[1] if has_shift else y

    return compute


def _normalized_input(inputs: tuple[Any, ...]) -> tuple[Any]:
    """The scale-and-shift tag's input of a normalisation pattern: `(x - mean) * rsqrt(var + eps)`."""
    centred, rsqrt = inputs
    return (centred * rsqrt,)


def _left_broadcast(p: Any, shape: tuple[int, ...]) -> Any:
    """`p` aligned with the leading axes of `shape` and broadcast along the rest (as Equinox's
    `left_broadcast_to`, which `eqx.nn.GroupNorm` applies to its channel weight and bias)."""
    return jnp.broadcast_to(jnp.reshape(p, p.shape + (1,) * (len(shape) - p.ndim)), shape)


def _leading_scale_and_shift(has_scale: bool, has_shift: bool) -> Callable[[Any, Any], Any]:
    """A per-example `left_broadcast_to(s, v) * v + left_broadcast_to(b, v)` under one `vmap` per
    batch axis, written on the batch: the parameters broadcast to one example's shape, then against
    the batch. This is the graph the `vmap`s give (once broadcast chains are merged), for half the
    tracing."""

    def compute(x, params):
        # The examples size batch axes from `_BATCH` and feature axes never, so the batch axes are
        # the leading ones sized from `_BATCH`.
        shape = x.shape[next(i for i, d in enumerate(x.shape) if d not in _BATCH) :]
        params = list(params)
        if has_scale:
            x = _left_broadcast(params.pop(0), shape) * x
        return x + _left_broadcast(params.pop(0), shape) if has_shift else x

    return compute


def _leading_meta(has_scale: bool, has_shift: bool) -> Callable[[Sequence[JaxprEqn]], dict[str, Any] | None]:
    """Reads `param_axes` off the parameters' expansions to `(*param_shape, 1, ..., 1)`: a
    reshape (`p.reshape(c, 1, 1)`) or a broadcast of the parameter's own axes (`p[:, None, None]`).
    """

    def extract(eqns):
        found = set()
        for eqn in eqns:
            name = eqn.primitive.name
            if name not in ("reshape", "broadcast_in_dim"):
                continue
            shape = tuple(eqn.invars[0].aval.shape)
            new = tuple(int(d) for d in eqn.outvars[0].aval.shape)
            if name == "broadcast_in_dim" and tuple(eqn.params["broadcast_dimensions"]) != tuple(
                range(len(shape))
            ):
                continue  # the broadcast of the expanded parameter against the activations
            # The pattern compares shapes by rank only: any other target shape of that rank
            # (e.g. `(1, c)` instead of `(c, 1)`) aligns the parameter differently.
            if new != shape + (1,) * (len(new) - len(shape)):
                if name == "reshape":
                    return None
                continue
            found.add(tuple(range(-len(new), len(shape) - len(new))))
        if len(found) != 1:
            return None
        return dict(has_scale=has_scale, has_shift=has_shift, param_axes=found.pop())

    return extract


def _fixed_meta(**meta: Any) -> Callable[[Sequence[JaxprEqn]], dict[str, Any]]:
    """An extractor for patterns whose tag parameters do not depend on the matched equations."""
    return lambda eqns: dict(meta)


def _conv_meta(has_bias: bool) -> Callable[[Sequence[JaxprEqn]], dict[str, Any] | None]:
    def extract(eqns):
        (conv,) = [e for e in eqns if e.primitive.name == "conv_general_dilated"]
        p = conv.params
        if p["batch_group_count"] != 1:
            return None
        return dict(
            window_strides=tuple(int(s) for s in p["window_strides"]),
            padding=tuple((int(lo), int(hi)) for lo, hi in p["padding"]),
            lhs_dilation=tuple(int(s) for s in p["lhs_dilation"]),
            rhs_dilation=tuple(int(s) for s in p["rhs_dilation"]),
            dimension_numbers=p["dimension_numbers"],
            feature_group_count=int(p["feature_group_count"]),
            has_bias=has_bias,
        )

    return extract


def _dense_meta(eqns: Sequence[JaxprEqn], params: Sequence[Any], resolve: Callable[[Any], Any]) -> dict[str, Any] | None:
    """A dense layer's tag parameters: the weight's layout, from the axis its `dot_general`
    contracts."""
    dots = [e for e in eqns if e.primitive.name == "dot_general"]
    if len(dots) != 1:
        return None
    (dot,) = dots
    contracting, _ = dot.params["dimension_numbers"]
    # The weight may reach the product transposed (`x @ w.T`).
    transposed = {e.outvars[0]: e for e in eqns if e.primitive.name == "transpose"}
    for k, v in enumerate(dot.invars):
        permutation = tuple(range(v.aval.ndim))
        if v in transposed:
            permutation, v = tuple(transposed[v].params["permutation"]), transposed[v].invars[0]
        if resolve(v) is not params[0]:
            continue
        dims = tuple(permutation[int(d)] for d in contracting[k])
        if dims == tuple(range(len(dims))):
            return dict(weight_layout="in_out", has_bias=len(params) == 2)
        if v.aval.ndim == 2 and dims == (1,):
            return dict(weight_layout="out_in", has_bias=len(params) == 2)
    return None


def _scale_and_shift_meta(eqns: Sequence[JaxprEqn], params: Sequence[Any]) -> dict[str, Any] | None:
    """kfac-jax's reading: a `mul` is the scale, an `add` the shift."""
    names = {e.primitive.name for e in eqns}
    has_scale, has_shift = "mul" in names, bool({"add", "add_any"} & names)
    if has_scale + has_shift != len(params):
        return None
    return dict(has_scale=has_scale, has_shift=has_shift, param_axes=None)


def default_parameters(
    tag: LayerTag, eqns: Sequence[JaxprEqn], params: Sequence[Any], resolve: Callable[[Any], Any]
) -> dict[str, Any] | None:
    """The tag parameters of a match of a pattern without `parameters_extractor_func`.

    **Arguments:**

    - `tag`: the pattern's tag.
    - `eqns`: the matched equations, in jaxpr order.
    - `params`: the variables bound to the pattern's parameters.
    - `resolve`: maps an equation's input to the variable it is computed from by value-preserving
      equations (conversions), to recognise the parameters among the inputs.

    **Returns:**

    The tag's keyword parameters (empty for a tag other than the built-in ones), or `None` when
    they cannot be read off (the match is then rejected).
    """
    if tag is dense_tag:
        return _dense_meta(eqns, params, resolve)
    if tag is conv2d_tag:
        return _conv_meta(len(params) == 2)(eqns)
    if tag is scale_and_shift_tag:
        return _scale_and_shift_meta(eqns, params)
    return {}


def _embedding_per_example(ids, params):
    (table,) = params
    return _vmapped(eqx.nn.Embedding(weight=table), ids, ids.ndim)


def _f32(*shape: int) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(shape, jnp.float32)


# Batch sizes, feature sizes and ranks are all distinct so that no example shape is ambiguous.
_BATCH = (7, 11, 13)
_IN, _OUT = 3, 5
_VOCABULARY, _EMBEDDING = 23, 19


def _dense_examples(
    weight_shape: tuple[int, int], bias: bool, feature_major: bool = False
) -> list[ExampleArgs]:
    params = (_f32(*weight_shape), _f32(_OUT)) if bias else (_f32(*weight_shape),)
    if feature_major:
        return [(_f32(_IN, *_BATCH[:n]), params) for n in (1, 2, 3)]
    return [(_f32(*_BATCH[:n], _IN), params) for n in (1, 2, 3)]


def _conv_examples(x_shape, w_shape, bias_shape) -> list[ExampleArgs]:
    params = (_f32(*w_shape), _f32(*bias_shape)) if bias_shape else (_f32(*w_shape),)
    return [(_f32(*x_shape), params)]


_FEATURES = (3, 4, 5, 6)


def _leading_scale_and_shift_examples(n_params: int) -> list[ExampleArgs]:
    """Per-example inputs of rank 2 to 4 (e.g. `(channels, *spatial)`) under one or two vmaps,
    with parameters along their first 1 to rank - 1 axes."""
    examples = []
    for n_batch in (1, 2):
        for x_rank in (2, 3, 4):
            for p_rank in range(1, x_rank):
                p = _f32(*_FEATURES[:p_rank])
                examples.append((_f32(*_BATCH[:n_batch], *_FEATURES[:x_rank]), (p,) * n_params))
    return examples


def _scale_and_shift_examples(n_params: int) -> list[ExampleArgs]:
    examples = []
    for x_rank in (2, 3, 4):
        for p_rank in range(1, x_rank):
            x_shape = (*_BATCH[: x_rank - p_rank], *(_IN + 2 * i for i in range(p_rank)))
            p = _f32(*x_shape[x_rank - p_rank :])
            examples.append((_f32(*x_shape), (p,) * n_params))
    return examples


def _normalization_examples(n_params: int) -> list[ExampleArgs]:
    """Inputs of rank 2 to 4 with `rsqrt(var + eps)` of the same rank, and parameters along
    trailing axes, or of the input's rank with unit leading axes (Haiku's `BatchNorm`)."""
    examples = []
    for x, (p,) in _scale_and_shift_examples(1):
        examples.append(((x, _f32(*x.shape[:-1], 1)), (p,) * n_params))
    for x_rank in (2, 3, 4):
        x = _f32(*_BATCH[: x_rank - 1], _IN)
        examples.append(((x, _f32(*x.shape[:-1], 1)), (_f32(*(1,) * (x_rank - 1), _IN),) * n_params))
    return examples


def _scale_and_shift_patterns() -> list[GraphPattern]:
    """Flax's and Haiku's normalisation layers, then `x * s + b` (and its parts) with the
    parameters along the trailing or the leading axes of each example. An input with unit axes
    that the parameters broadcast against (`r[..., None] * sigma`) is broadcast for the tag."""
    patterns = []
    # Before `scale_only`, which would take the `rsqrt(var + eps) * scale` of a BatchNorm.
    for has_shift, precedence in ((True, 0), (False, 1)):
        patterns.append(
            GraphPattern(
                "normalization" if has_shift else "normalization_scale_only", scale_and_shift_tag,
                _normalization(has_shift), _normalization_examples(1 + has_shift),
                _fixed_meta(has_scale=True, has_shift=has_shift, param_axes=None), precedence,
                tag_inputs_func=_normalized_input,
            )
        )
    for name, has_scale, has_shift, precedence in (
        ("scale_and_shift", True, True, 0),
        ("scale_only", True, False, 1),
        ("shift_only", False, True, 1),
    ):
        patterns.append(
            GraphPattern(
                name, scale_and_shift_tag, _scale_and_shift(has_scale, has_shift),
                _scale_and_shift_examples(has_scale + has_shift),
                _fixed_meta(has_scale=has_scale, has_shift=has_shift, param_axes=None), precedence,
                broadcast_inputs=True,
            )
        )
        patterns.append(
            GraphPattern(
                f"leading_{name}", scale_and_shift_tag, _leading_scale_and_shift(has_scale, has_shift),
                _leading_scale_and_shift_examples(has_scale + has_shift),
                _leading_meta(has_scale, has_shift), precedence,
            )
        )
    return patterns


def _make_default_patterns() -> tuple[GraphPattern, ...]:
    patterns = []
    for bias in (True, False):
        suffix, precedence = ("with_bias", 0) if bias else ("no_bias", 1)
        for name, func, w_shape, layout in (
            ("linear", _linear_per_example, (_OUT, _IN), "out_in"),
            ("dense_out_in", _dense_out_in, (_OUT, _IN), "out_in"),
            ("dense_in_out", _dense_in_out, (_IN, _OUT), "in_out"),
        ):
            meta = _fixed_meta(weight_layout=layout, has_bias=bias)
            examples = _dense_examples(w_shape, bias)
            patterns.append(GraphPattern(f"{name}_{suffix}", dense_tag, func, examples, meta, precedence))
        # Between per-example layers without bias, `vmap` keeps activations feature-major.
        meta = _fixed_meta(weight_layout="out_in", has_bias=bias)
        layouts = [(True, False)] + ([] if bias else [(False, True), (True, True)])
        for input_major, output_major in layouts:
            name = {(True, False): "linear_from", (False, True): "linear_to", (True, True): "linear"}[
                (input_major, output_major)
            ] + "_feature_major"
            patterns.append(
                GraphPattern(
                    f"{name}_{suffix}", dense_tag, _linear_feature_major(input_major, output_major, bias),
                    _dense_examples((_OUT, _IN), bias, input_major), meta, precedence,
                    feature_major=(input_major, output_major),
                )
            )
        for n_in, n_out in ((1, 2), (2, 1), (2, 2)):
            in_dims, out_dims = (_IN, _IN + 1)[:n_in], (_OUT, _OUT + 1)[:n_out]
            params = (_f32(*in_dims, *out_dims), _f32(*out_dims)) if bias else (_f32(*in_dims, *out_dims),)
            examples = [(_f32(*_BATCH[:n], *in_dims), params) for n in (1, 2, 3)]
            meta = _fixed_meta(weight_layout="in_out", has_bias=bias)
            patterns.append(
                GraphPattern(f"dense_general_{n_in}x{n_out}_{suffix}", dense_tag, _dense_general(n_in), examples, meta, precedence)
            )
        for name, func, x_shape, w_shape, b_shape in (
            ("conv2d", _conv_per_example, (2, _IN, 8, 9), (_OUT, _IN, 3, 2), (_OUT, 1, 1)),
            ("conv2d_nhwc", _conv_nhwc, (2, 8, 9, _IN), (3, 2, _IN, _OUT), (_OUT,)),
        ):
            examples = _conv_examples(x_shape, w_shape, b_shape if bias else None)
            patterns.append(GraphPattern(f"{name}_{suffix}", conv2d_tag, func, examples, _conv_meta(bias), precedence))
    patterns.append(
        GraphPattern(
            "conv2d_nchw_no_bias", conv2d_tag, _conv_nchw,
            _conv_examples((2, _IN, 8, 9), (_OUT, _IN, 3, 2), None), _conv_meta(False), 2,
        )
    )
    patterns.extend(_scale_and_shift_patterns())
    # `eqx.nn.Embedding` contains its table's sizes as constants; they match any table's sizes
    # (see `GraphPattern`), so these distinctive example sizes stand for all of them.
    table = _f32(_VOCABULARY, _EMBEDDING)
    patterns.append(
        GraphPattern(
            "embedding", embedding_tag, _embedding_per_example,
            [(jax.ShapeDtypeStruct(_BATCH[:n], jnp.int32), (table,)) for n in (1, 2)], _fixed_meta(),
        )
    )
    return tuple(patterns)


CORE_GRAPH_PATTERNS: tuple[GraphPattern, ...] = _make_default_patterns()
"""The dense, conv2d, scale-and-shift and `eqx.nn.Embedding` patterns; `graph_patterns_flax.py`
adds Flax's and Haiku's lookups and concatenated gates for `DEFAULT_GRAPH_PATTERNS`."""
