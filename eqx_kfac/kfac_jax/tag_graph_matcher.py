"""`kfac_jax.tag_graph_matcher`: the names kfac-jax code imports from kfac-jax's graph matcher
(FermiNet builds its repeated-dense patterns from `_dense` and `_dense_parameter_extractor`), on
`eqx_kfac`'s graph matcher.

A parameter extractor here returns `eqx_kfac`'s tag parameters (`weight_layout`, `has_bias`,
`variant`, ...), where kfac-jax's returns its `meta`.
"""

from collections.abc import Callable, Sequence
from typing import Any

import jax.numpy as jnp
from jax.extend.core import JaxprEqn
from jaxtyping import Array

from .._tracing.graph_matcher import auto_register_tags as auto_register_tags
from .._tracing.graph_patterns import GraphPattern as _GraphPattern
from .._tracing.graph_patterns_flax import DEFAULT_GRAPH_PATTERNS as DEFAULT_GRAPH_PATTERNS
from .._tracing.tags import LayerTag, conv2d_tag, dense_tag, scale_and_shift_tag
from .layers_and_loss_tags import KfacJaxLayerTag


def _dense(x: Array, params: Sequence[Array], axes: int, with_reshape: bool) -> Array:
    """kfac-jax's example dense layer: `tensordot(x, w, axes) (+ b)`, the bias reshaped to the
    output's rank when `with_reshape`."""
    y = jnp.tensordot(x, params[0], axes=axes)
    if len(params) == 1:
        return y
    (b,) = params[1:]
    return y + (b.reshape((1,) * (y.ndim - b.ndim) + b.shape) if with_reshape else b)


def _dense_parameter_extractor(eqns: Sequence[JaxprEqn], variant: str = "dense") -> dict[str, Any]:
    """The dense tag's parameters of a match of `_dense` (`x @ w`, the weight `(*in, *out)`):
    `weight_layout="in_out"`, `has_bias` (an `add` among the equations) and `variant` (kfac-jax's
    keyword; a variant other than `"dense"` may have a block of its own)."""
    meta = dict(weight_layout="in_out", has_bias=any(e.primitive.name == "add" for e in eqns))
    return meta if variant == "dense" else dict(meta, variant=variant)


def _conv2d_parameter_extractor(eqns: Sequence[JaxprEqn], variant: str = "conv2d") -> dict[str, Any]:
    """The conv2d tag's parameters of a matched convolution (the equation's own geometry)."""
    if variant != "conv2d":
        raise NotImplementedError(f"_conv2d_parameter_extractor(variant={variant!r}): the conv2d tag has no variants.")
    (conv,) = [e for e in eqns if e.primitive.name == "conv_general_dilated"]
    p = conv.params
    return dict(
        window_strides=tuple(p["window_strides"]), padding=tuple(tuple(lh) for lh in p["padding"]),
        lhs_dilation=tuple(p["lhs_dilation"]), rhs_dilation=tuple(p["rhs_dilation"]),
        dimension_numbers=p["dimension_numbers"], feature_group_count=int(p["feature_group_count"]),
        has_bias=any(e.primitive.name == "add" for e in eqns),
    )


def _scale_and_shift_parameter_extractor(eqns: Sequence[JaxprEqn], variant: str = "scale_and_shift") -> dict[str, Any]:
    """The scale-and-shift tag's parameters of a match: a `mul` is the scale, an `add` the shift."""
    if variant != "scale_and_shift":
        raise NotImplementedError(
            f"_scale_and_shift_parameter_extractor(variant={variant!r}): the scale-and-shift tag has no variants."
        )
    names = {e.primitive.name for e in eqns}
    return dict(has_scale="mul" in names, has_shift="add" in names)


_TAG_OF_EXTRACTOR: dict[Callable[..., Any], LayerTag] = {
    _dense_parameter_extractor: dense_tag,
    _conv2d_parameter_extractor: conv2d_tag,
    _scale_and_shift_parameter_extractor: scale_and_shift_tag,
}


def _tag_of(name: str, extractor: Any) -> LayerTag:
    function = getattr(extractor, "func", extractor)  # through functools.partial
    if function not in _TAG_OF_EXTRACTOR:
        raise TypeError(
            f"GraphPattern {name!r}: tag_primitive=layer_tag (kfac-jax's one layer primitive) needs "
            "one of this module's parameter extractors (_dense_parameter_extractor, "
            "_conv2d_parameter_extractor, _scale_and_shift_parameter_extractor), which say the layer's "
            f"kind; got {extractor!r}. Pass tag_primitive=eqx_kfac.dense_tag (or the LayerTag of "
            "your layer) instead."
        )
    return _TAG_OF_EXTRACTOR[function]


def GraphPattern(
    name: str, tag_primitive: Any = None, compute_func: Callable[..., Any] | None = None,
    parameters_extractor_func: Callable[[Sequence[JaxprEqn]], dict[str, Any] | None] | None = None,
    example_args: Any = None, **kwargs: Any,
) -> _GraphPattern:
    """kfac-jax's `GraphPattern(name=, tag_primitive=, compute_func=, parameters_extractor_func=,
    example_args=)`, built as an `eqx_kfac.GraphPattern`. `tag_primitive=layer_tag` becomes the
    tag of the pattern's extractor (`_dense_parameter_extractor`: the dense tag, and so on).

    **Arguments:**

    - `name`, `compute_func`, `example_args`: as for `eqx_kfac.GraphPattern`.
    - `tag_primitive`: `layer_tag`, or an `eqx_kfac.LayerTag`.
    - `parameters_extractor_func`: the extractor (this module's, or one returning `eqx_kfac`'s
      tag parameters).
    - `kwargs`: `eqx_kfac.GraphPattern`'s other arguments.

    **Returns:**

    The `eqx_kfac.GraphPattern`.
    """
    if isinstance(tag_primitive, KfacJaxLayerTag):
        tag_primitive = _tag_of(name, parameters_extractor_func)
    return _GraphPattern(
        name, compute_func=compute_func, example_args=example_args,
        parameters_extractor_func=parameters_extractor_func, tag_primitive=tag_primitive, **kwargs,
    )
