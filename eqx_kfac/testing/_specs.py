"""Layer specs, realistic estimation data and block states for testing curvature blocks.

Plain functions (no hypothesis): the strategies of `eqx_kfac.testing` and `check_block` draw from
them, and they build fixed cases directly.
"""

from collections.abc import Sequence
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jaxtyping import Array, PRNGKeyArray

from .._curvature.blocks import CurvatureBlock
from .._curvature.blocks.base import PowersLike
from .._tracing.layer_data import EstimationData, LayerSpec


def _dtype(dtype: Any) -> Any:
    # `float` is float64 with `jax_enable_x64` and float32 without.
    return jnp.dtype(jnp.result_type(float) if dtype is None else dtype)


def _spec(tag: str, paths: Sequence[str], param_shapes, dtype, inputs, outputs, meta, stack):
    return LayerSpec(
        tag=tag,
        index=0,
        param_paths=tuple(f"{tag}.{p}" for p in paths),
        param_indices=tuple(range(len(param_shapes))),
        param_shapes=tuple(tuple(s) for s in param_shapes),
        param_dtypes=(_dtype(dtype),) * len(param_shapes),
        input_shapes=tuple(tuple(s) for s in inputs),
        output_shapes=tuple(tuple(s) for s in outputs),
        meta=tuple(sorted(meta.items())),
        stack_size=stack,
    )


def dense_spec(
    n_in: int,
    n_out: int,
    *,
    bias: bool = True,
    layout: str = "in_out",
    batch: int = 3,
    extra: Sequence[int] = (),
    stack: int | None = None,
    dtype: Any = None,
) -> LayerSpec:
    """The spec of a dense layer `y = x @ w (+ b)` (`"in_out"`) or `x @ w.T (+ b)` (`"out_in"`).

    **Arguments:**

    - `n_in`, `n_out`: the input and output sizes.
    - `bias`: whether the layer has a bias.
    - `layout`: `"in_out"` (`w: (in, out)`) or `"out_in"` (`w: (out, in)`, as `eqx.nn.Linear`).
    - `batch`: the batch size of the inputs.
    - `extra`: extra dims after the batch (e.g. sequence positions).
    - `stack`: the number of stacked slices for a layer applied in `jax.lax.scan`, or `None`.
    - `dtype`: the parameters' dtype (default: JAX's default float).

    **Returns:**

    A `LayerSpec` with tag `"dense"`.
    """
    w_shape = (n_in, n_out) if layout == "in_out" else (n_out, n_in)
    shapes = (w_shape, (n_out,)) if bias else (w_shape,)
    meta = {"has_bias": bias, "weight_layout": layout}
    inputs, outputs = [(batch, *extra, n_in)], [(batch, *extra, n_out)]
    return _spec("dense", ("w", "b"), shapes, dtype, inputs, outputs, meta, stack)


def conv2d_spec(
    in_channels: int,
    out_channels: int,
    *,
    spatial: Sequence[int] = (4, 3),
    kernel: Sequence[int] = (2, 2),
    strides: Sequence[int] = (1, 1),
    padding: Sequence[Sequence[int]] = ((0, 0), (0, 0)),
    layout: str = "NHWC",
    bias: bool = True,
    groups: int = 1,
    batch: int = 2,
    stack: int | None = None,
    dtype: Any = None,
) -> LayerSpec:
    """The spec of a 2-D convolution (`lax.conv_general_dilated`, plus a bias per output channel).

    **Arguments:**

    - `in_channels`, `out_channels`: the channel counts (`in_channels` divisible by `groups`).
    - `spatial`: the input's height and width.
    - `kernel`: the kernel's height and width.
    - `strides`, `padding`: as for `lax.conv_general_dilated` (explicit `(lo, hi)` pairs).
    - `layout`: `"NHWC"` (kernel `HWIO`) or `"NCHW"` (kernel `OIHW`, as `eqx.nn.Conv2d`).
    - `bias`: whether the layer has a bias.
    - `groups`: the `feature_group_count`.
    - `batch`: the batch size.
    - `stack`: the number of stacked slices, or `None`.
    - `dtype`: the parameters' dtype.

    **Returns:**

    A `LayerSpec` with tag `"conv2d"`.
    """
    sizes = {"N": batch, "H": spatial[0], "W": spatial[1], "C": in_channels}
    x_shape = tuple(sizes[a] for a in layout)
    kernel_layout = "HWIO" if layout == "NHWC" else "OIHW"
    kernel_sizes = {"H": kernel[0], "W": kernel[1], "I": in_channels // groups, "O": out_channels}
    w_shape = tuple(kernel_sizes[a] for a in kernel_layout)
    meta = dict(
        window_strides=tuple(strides),
        padding=tuple(tuple(p) for p in padding),
        lhs_dilation=(1, 1),
        rhs_dilation=(1, 1),
        dimension_numbers=lax.conv_dimension_numbers(
            x_shape, w_shape, (layout, kernel_layout, layout)
        ),
        feature_group_count=groups,
    )
    x, w = (jax.ShapeDtypeStruct(s, _dtype(dtype)) for s in (x_shape, w_shape))
    y = jax.eval_shape(lambda x, w: lax.conv_general_dilated(x, w, **meta), x, w)
    shapes = (w_shape, (out_channels,)) if bias else (w_shape,)
    meta["has_bias"] = bias
    return _spec("conv2d", ("kernel", "bias"), shapes, dtype, [x_shape], [y.shape], meta, stack)


def scale_and_shift_spec(
    x_shape: Sequence[int],
    param_shape: Sequence[int],
    *,
    scale: bool = True,
    shift: bool = True,
    param_axes: Sequence[int] | None = None,
    stack: int | None = None,
    dtype: Any = None,
) -> LayerSpec:
    """The spec of `y = x * scale + shift` (e.g. a LayerNorm's affine part).

    **Arguments:**

    - `x_shape`: the input's shape, batch first.
    - `param_shape`: the shape of each parameter (broadcast against the trailing dims of `x`, or
      along `param_axes`).
    - `scale`, `shift`: which parameters the layer has (at least one).
    - `param_axes`: the axes of `x`, counted from the end, that the parameters lie along; `None`
      for the trailing axes.
    - `stack`: the number of stacked slices, or `None`.
    - `dtype`: the parameters' dtype.

    **Returns:**

    A `LayerSpec` with tag `"scale_and_shift"`.
    """
    shapes = (tuple(param_shape),) * (scale + shift)
    paths = ("scale", "shift") if scale else ("shift",)
    meta = {"has_scale": scale, "has_shift": shift}
    if param_axes is not None:
        meta["param_axes"] = tuple(param_axes)
    return _spec("scale_and_shift", paths, shapes, dtype, [x_shape], [x_shape], meta, stack)


def embedding_spec(
    vocab: int,
    features: int,
    *,
    batch: int = 3,
    extra: Sequence[int] = (),
    stack: int | None = None,
    dtype: Any = None,
) -> LayerSpec:
    """The spec of an embedding lookup `y = table[ids]`.

    **Arguments:**

    - `vocab`, `features`: the table's shape.
    - `batch`: the batch size of the ids.
    - `extra`: extra dims of the ids after the batch (e.g. sequence positions).
    - `stack`: the number of stacked slices, or `None`.
    - `dtype`: the table's dtype.

    **Returns:**

    A `LayerSpec` with tag `"embedding"`.
    """
    ids = (batch, *extra)
    outputs = [(*ids, features)]
    return _spec("embedding", ("table",), [(vocab, features)], dtype, [ids], outputs, {}, stack)


def generic_spec(*shapes: Sequence[int], stack: int | None = None, dtype: Any = None) -> LayerSpec:
    """The spec of parameters without a layer (the `"generic"` tag: no inputs or outputs).

    **Arguments:**

    - `*shapes`: the parameters' shapes.
    - `stack`: the number of stacked slices, or `None`.
    - `dtype`: the parameters' dtype.

    **Returns:**

    A `LayerSpec` with tag `"generic"`, parameters named `p0`, `p1`, ...
    """
    paths = tuple(f"p{i}" for i in range(len(shapes)))
    return _spec("generic", paths, shapes, dtype, [], [], {}, stack)


def batch_size(spec: LayerSpec) -> int:
    """The number of examples of the data that `estimation_data` makes for `spec`.

    **Arguments:**

    - `spec`: a layer spec.

    **Returns:**

    The batch size of its first input (3 for a layer without inputs).
    """
    return spec.input_shapes[0][0] if spec.input_shapes else 3


def numpy_rng(key: PRNGKeyArray) -> np.random.Generator:
    """A NumPy generator seeded with the bits of a JAX PRNG key.

    Test data drawn with NumPy needs no compilation (JAX's random functions compile once per
    shape and dtype, seconds for a handful of small arrays).

    **Arguments:**

    - `key`: a JAX PRNG key (typed or raw).

    **Returns:**

    A `numpy.random.Generator`, the same for the same key.
    """
    if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        key = jax.random.key_data(key)
    return np.random.default_rng(np.asarray(key).ravel().tolist())


def estimation_data(spec: LayerSpec, key: PRNGKeyArray, num_vectors: int = 2) -> EstimationData:
    """Random `EstimationData` for a layer, shaped as the tracer hands it to the layer's block.

    Inputs, outputs and parameters are standard normal (the ids of an embedding are uniform over
    its vocabulary), as are the output and parameter tangents, which carry a leading vector axis
    `num_vectors`; a stacked layer's fields carry the stack axis (after the vector axis for
    tangents). A block's statistics of this data are the second moments of Gaussian samples:
    PSD, and singular where a factor is larger than the number of samples, as in training.
    The numbers are drawn with NumPy (`numpy_rng(key)`), so this is not for use under `jit`.

    **Arguments:**

    - `spec`: the layer's spec.
    - `key`: a PRNG key.
    - `num_vectors`: the number of loss-space vectors `V`.

    **Returns:**

    An `EstimationData`.
    """
    rng = numpy_rng(key)
    stack = () if spec.stack_size is None else (spec.stack_size,)
    dtype = spec.param_dtypes[0] if spec.param_dtypes else _dtype(None)

    def normal(*shape):
        return jnp.asarray(rng.standard_normal(shape), dtype)

    if spec.tag == "embedding":
        vocab = spec.param_shapes[0][0]
        inputs = tuple(jnp.asarray(rng.integers(0, vocab, (*stack, *s))) for s in spec.input_shapes)
    else:
        inputs = tuple(normal(*stack, *s) for s in spec.input_shapes)
    return EstimationData(
        params=tuple(normal(*stack, *s) for s in spec.param_shapes),
        inputs=inputs,
        outputs=tuple(normal(*stack, *s) for s in spec.output_shapes),
        outputs_tangent=tuple(normal(num_vectors, *stack, *s) for s in spec.output_shapes),
        params_tangent=tuple(normal(num_vectors, *stack, *s) for s in spec.param_shapes),
    )


def random_vector(block: CurvatureBlock, key: PRNGKeyArray) -> tuple[Array, ...]:
    """A standard normal vector shaped like a block's parameters (drawn with NumPy).

    **Arguments:**

    - `block`: a curvature block.
    - `key`: a PRNG key.

    **Returns:**

    A tuple of arrays shaped like `block.param_shapes`, in the block's statistics dtype.
    """
    rng = numpy_rng(key)
    return tuple(jnp.asarray(rng.standard_normal(s), block.dtype) for s in block.param_shapes)


def block_state(
    block: CurvatureBlock,
    key: PRNGKeyArray,
    *,
    updates: int = 2,
    exact_powers_to_cache: PowersLike = None,
    approx_powers_to_cache: PowersLike = None,
    cache_eigenvalues: bool = False,
) -> Any:
    """A block's state after moving-average updates with `estimation_data`.

    The first update replaces the empty statistics; before each later one the caches are
    refreshed (`update_cache` with damping 1 and the powers given here, which also refits an
    EK-FAC block's eigenbasis), and the new data is mixed in with decay `0.6` and weight `0.4`,
    so the state is an average over batches with caches one batch old, as in training.

    **Arguments:**

    - `block`: a curvature block.
    - `key`: a PRNG key.
    - `updates`: the number of batches (at least 1).
    - `exact_powers_to_cache`, `approx_powers_to_cache`, `cache_eigenvalues`: passed to `init`
      and to the refreshes.

    **Returns:**

    The block's state.
    """
    cache = (exact_powers_to_cache, approx_powers_to_cache, cache_eigenvalues)
    state = block.init(key, *cache)
    for i, k in enumerate(jax.random.split(key, updates)):
        state = _updated(block, state, estimation_data(block.spec, k), i > 0, cache)
    return state


@eqx.filter_jit
def _updated(
    block: CurvatureBlock, state: Any, data: EstimationData, later: bool, cache: tuple
) -> Any:
    if later:
        state = block.update_cache(state, 1.0, *cache)
    ema_old, ema_new = (0.6, 0.4) if later else (0.0, 1.0)
    size = batch_size(block.spec)
    return block.update_curvature_matrix_estimate(state, data, ema_old, ema_new, size)


def example_specs(tag: str) -> tuple[LayerSpec, ...]:
    """Two small layers of a tag for `check_block`: a plain one and a scan-stacked one.

    **Arguments:**

    - `tag`: `"dense"`, `"conv2d"`, `"scale_and_shift"`, `"embedding"` or `"generic"`.

    **Returns:**

    A tuple of two `LayerSpec`s (the second with `stack_size=2`), differing also in bias,
    layout and extra dims where the tag has them.
    """
    examples = {
        "dense": lambda: (
            dense_spec(3, 2, layout="out_in"),
            dense_spec(2, 3, bias=False, extra=(2,), stack=2),
        ),
        "conv2d": lambda: (
            conv2d_spec(2, 3),
            conv2d_spec(
                1, 2, layout="NCHW", bias=False, strides=(2, 1), padding=((1, 0), (0, 1)), stack=2
            ),
        ),
        "scale_and_shift": lambda: (
            scale_and_shift_spec((3, 2, 4), (4,)),
            scale_and_shift_spec((2, 2, 3), (1, 3), shift=False, stack=2),
        ),
        "embedding": lambda: (embedding_spec(4, 3, extra=(2,)), embedding_spec(3, 2, stack=2)),
        "generic": lambda: (generic_spec((3,), (2, 2)), generic_spec((2,), stack=2)),
    }
    if tag not in examples:
        raise ValueError(
            f"No example layers for tag {tag!r} (there are some for {', '.join(examples)}); "
            "pass `specs=` to `check_block`."
        )
    return examples[tag]()
