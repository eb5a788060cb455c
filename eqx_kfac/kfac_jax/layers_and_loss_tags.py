"""`kfac_jax.layers_and_loss_tags`: the registration functions with kfac-jax's keywords, on
`eqx_kfac`'s tags.

kfac-jax has one layer primitive, `layer_tag`, whose `variant` says the layer's kind; `eqx_kfac`
has one tag per kind (`dense_tag`, `conv2d_tag`, ...). `layer_tag` here stands for kfac-jax's in
graph patterns: `tag_graph_matcher.GraphPattern` replaces it by the tag of the pattern's
parameter extractor.
"""

import functools
from typing import Any

from jaxtyping import Array

from .._tracing.layer_registration import (
    register_conv2d as _register_conv2d,
    register_dense as _register_dense,
    register_generic as register_generic,
    register_scale_and_shift as _register_scale_and_shift,
)
from .._tracing.losses import (
    register_categorical_predictive_distribution as register_categorical_predictive_distribution,
    register_multi_bernoulli_predictive_distribution as register_multi_bernoulli_predictive_distribution,
    register_normal_predictive_distribution as register_normal_predictive_distribution,
    register_sigmoid_cross_entropy_loss as register_sigmoid_cross_entropy_loss,
    register_softmax_cross_entropy_loss as register_softmax_cross_entropy_loss,
    register_squared_error_loss as register_squared_error_loss,
)
from .._tracing.tags import dense_tag, LayerTag as LayerTag, LossTag as LossTag, loss_tag as loss_tag
from ._block_adapter import LayerData as LayerData


class KfacJaxLayerTag:
    """kfac-jax's single layer primitive, as a marker: `GraphPattern(tag_primitive=layer_tag,
    parameters_extractor_func=_dense_parameter_extractor, ...)` binds `eqx_kfac.dense_tag`, and
    likewise for the conv2d and scale-and-shift extractors of `tag_graph_matcher`."""

    def __repr__(self) -> str:
        return "kfac_jax.layers_and_loss_tags.layer_tag"


layer_tag = KfacJaxLayerTag()


def _no_variant(function: str, variant: str, kind: str) -> None:
    if variant != kind:
        raise NotImplementedError(
            f"{function}(variant={variant!r}): eqx_kfac's {kind} tag has no variants; a block of "
            f"your own for these layers is layer_tag_to_block_ctor={{{kind!r}: block}} (it applies "
            f"to every {kind} layer), or index_to_block_ctor= by parameter path."
        )


def register_dense(
    y: Array, x: Array, w: Array, b: Array | None = None, variant: str = "dense", type: str | None = None, **kwargs: Any
) -> Array:
    """Registers a dense layer `y = x @ w + b` (kfac-jax's function: `variant`, or the older
    keyword `type` when `variant` is not given, names the layer's variant, e.g.
    `"repeated_dense"`; see `eqx_kfac.register_dense`).

    A layer of a variant of your own whose shapes are not a dense layer's (FermiNet's `"qmc"`
    full envelope: `x: (batch, i, j, k)`, `w: (k, m, j, n)`, `y: (batch, i, j, m, n)`) is tagged
    with its arrays as they are, for the variant's own block (the dense blocks refuse it).

    **Arguments:**

    - `y`, `x`, `w`, `b`: the output, input, weight and bias (optional).
    - `variant`: the variant, whose block `set_default_tag_to_block_ctor` or
      `layer_tag_to_block_ctor` may name.
    - `type`: the variant, under kfac-jax's older keyword (used when `variant` is `"dense"`).
    - `kwargs`: `eqx_kfac.register_dense`'s keywords (`weight_layout`, `num_in_dims`).

    **Returns:**

    `y`, tagged.
    """
    if type is not None and variant == "dense":
        variant = type
    try:
        return _register_dense(y, x, w, b, variant=variant, **kwargs)
    except ValueError:
        if variant in ("dense", "repeated_dense"):
            raise
        args = (y, x, w) if b is None else (y, x, w, b)
        return dense_tag.bind(*args, weight_layout="in_out", has_bias=b is not None, origin="manual", variant=variant)[0]


register_repeated_dense = functools.partial(register_dense, variant="repeated_dense")


def register_conv2d(
    y: Array, x: Array, w: Array, b: Array | None = None, variant: str = "conv2d", **kwargs: Any
) -> Array:
    """Registers a 2D convolution `y = conv2d(x, w) + b` (kfac-jax's function; see
    `eqx_kfac.register_conv2d`, which takes `lax.conv_general_dilated`'s keywords).

    **Arguments:**

    - `y`, `x`, `w`, `b`: the output, input, kernel and bias (optional).
    - `variant`: `"conv2d"` (the only variant).
    - `kwargs`: the convolution's keywords.

    **Returns:**

    `y`, tagged.
    """
    _no_variant("register_conv2d", variant, "conv2d")
    return _register_conv2d(y, x, w, b, **kwargs)


def register_scale_and_shift(
    y: Array, x: Array, scale: Array | None = None, shift: Array | None = None,
    variant: str = "scale_and_shift", **kwargs: Any,
) -> Array:
    """Registers `y = x * scale + shift` (kfac-jax's function; see
    `eqx_kfac.register_scale_and_shift`).

    **Arguments:**

    - `y`, `x`, `scale`, `shift`: the output, input and parameters (at least one).
    - `variant`: `"scale_and_shift"` (the only variant).
    - `kwargs`: `eqx_kfac.register_scale_and_shift`'s keywords (`param_axes`).

    **Returns:**

    `y`, tagged.
    """
    _no_variant("register_scale_and_shift", variant, "scale_and_shift")
    return _register_scale_and_shift(y, x, scale, shift, **kwargs)
