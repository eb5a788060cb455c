"""Tests for the conv2d curvature blocks against brute-force per-example gradients and KFC formulas."""

import math

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eqx_kfac import Conv2DDiagonal, Conv2DFull, Conv2DTwoKroneckerFactored
from eqx_kfac import EstimationData, LayerSpec
from eqx_kfac.testing import numpy_rng


def _layer(getkey, *, lhs="NHWC", rhs="HWIO", batch=3, channels=4, spatial=(6, 5), kernel=(3, 2),
           out_channels=4, strides=(1, 1), padding=((0, 0), (0, 0)), lhs_dilation=(1, 1),
           rhs_dilation=(1, 1), groups=1, bias=True, vectors=2):
    """A random conv layer: its spec, its estimation data, and a per-example conv function."""
    x_nhwc_shape = (batch, *spatial, channels)
    x_shape = tuple(x_nhwc_shape["NHWC".index(a)] for a in lhs)
    kernel_sizes = {"H": kernel[0], "W": kernel[1], "I": channels // groups, "O": out_channels}
    w_shape = tuple(kernel_sizes[a] for a in rhs)
    dnums = jax.lax.conv_dimension_numbers(x_shape, w_shape, (lhs, rhs, lhs))
    meta = dict(
        window_strides=strides, padding=padding, lhs_dilation=lhs_dilation,
        rhs_dilation=rhs_dilation, dimension_numbers=dnums, feature_group_count=groups,
    )
    # Standard normal data drawn with NumPy (JAX's random functions compile once per shape).
    rng = numpy_rng(getkey())
    x = jnp.asarray(rng.standard_normal(x_shape))
    params = (jnp.asarray(rng.standard_normal(w_shape)),)
    if bias:
        # A bias shaped as in `eqx.nn.Conv2d`, `(out, 1, 1)`, to check that only its size matters.
        params += (jnp.asarray(rng.standard_normal((out_channels, 1, 1))),)
    bias_shape = [1] * 4
    bias_shape[dnums.out_spec[1]] = out_channels

    def conv(params, x):
        y = jax.lax.conv_general_dilated(x, params[0], **meta)
        return y + jnp.reshape(params[1], bias_shape) if bias else y

    y = jax.jit(conv)(params, x)
    dy = jnp.asarray(rng.standard_normal((vectors, *y.shape)))
    spec = LayerSpec(
        tag="conv2d", index=0, param_paths=tuple(f"conv.p{i}" for i in range(len(params))),
        param_indices=tuple(range(len(params))), param_shapes=tuple(p.shape for p in params),
        param_dtypes=tuple(p.dtype for p in params), input_shapes=(x.shape,),
        output_shapes=(y.shape,), meta=tuple(sorted({**meta, "has_bias": bias}.items())),
    )
    # The conv blocks never read `params_tangent` (they build per-example gradients from x and
    # dy), so zeros keep the fixture cheap; a block that read it would fail the brute-force test.
    zeros = tuple(jnp.zeros((vectors, *p.shape), p.dtype) for p in params)
    data = EstimationData(params=params, inputs=(x,), outputs=(y,), outputs_tangent=(dy,),
                          params_tangent=zeros)
    return spec, data, conv


@eqx.filter_jit
def _brute_force_full(data, conv, lhs_batch_axis, out_batch_axis):
    """`Σ_v Σ_b vec(g_vb) vec(g_vb)ᵀ / B` from `jax.grad` of one example's conv contracted with dy."""
    (x,), (dy,) = data.inputs, data.outputs_tangent

    def example_grad(x_b, dy_b):
        def contracted(params):
            y = conv(params, jnp.expand_dims(x_b, lhs_batch_axis))
            return jnp.sum(y * jnp.expand_dims(dy_b, out_batch_axis))

        grads = jax.grad(contracted)(data.params)
        return jnp.concatenate([jnp.ravel(g) for g in grads])

    per_vector = jax.vmap(example_grad, in_axes=(lhs_batch_axis, out_batch_axis))
    grads = jax.vmap(lambda d: per_vector(x, d))(dy)
    grads = grads.reshape(-1, grads.shape[-1])
    return grads.T @ grads / x.shape[lhs_batch_axis]


# Compiled as a whole: op-by-op dispatch of the vmapped convolutions costs several times more.
@eqx.filter_jit
def _estimate(block, data, batch_size):
    """One batch's statistics (no moving average) and the block's dense matrix."""
    state = block.init(jax.random.key(0))
    state = block.update_curvature_matrix_estimate(state, data, 0.0, 1.0, batch_size)
    return state, block.to_dense_matrix(state)


_CONFIGS = {
    "nhwc": dict(),
    "nchw_oihw": dict(lhs="NCHW", rhs="OIHW", strides=(2, 1), padding=((1, 1), (0, 2))),
    "nhwc_ohwi_no_bias": dict(rhs="OHWI", bias=False, rhs_dilation=(2, 1), padding=((2, 1), (1, 0))),
    "nchw_strided_lhs_dilation": dict(lhs="NCHW", rhs="OIHW", lhs_dilation=(2, 1), strides=(2, 2)),
    # A transposed convolution (`eqx.nn.ConvTranspose2d`): input dilation, stride 1.
    "transposed": dict(lhs_dilation=(2, 2), padding=((2, 1), (1, 2))),
    "depthwise": dict(groups=4, out_channels=8, padding=((1, 1), (1, 0))),
    "grouped_nchw": dict(lhs="NCHW", rhs="OIHW", groups=2, out_channels=6, strides=(1, 2)),
}


@pytest.mark.parametrize("name", sorted(_CONFIGS))
def test_full_equals_brute_force_and_diagonal_equals_its_diagonal(getkey, name):
    config = _CONFIGS[name]
    spec, data, conv = _layer(getkey, **config)
    dnums = spec.get("dimension_numbers")
    batch = data.inputs[0].shape[dnums.lhs_spec[0]]
    full = Conv2DFull(spec)
    _, dense = _estimate(full, data, batch)
    expected = _brute_force_full(data, conv, dnums.lhs_spec[0], dnums.out_spec[0])
    np.testing.assert_allclose(dense, expected, rtol=1e-10, atol=1e-10)
    diagonal = Conv2DDiagonal(spec)
    _, diag_dense = _estimate(diagonal, data, batch)
    np.testing.assert_allclose(diag_dense, np.diag(np.diag(dense)), rtol=1e-10, atol=1e-10)


def _kernel_index_map(spec):
    """Row (patch entry, spatial-major then channel) and column (output channel) of every
    flattened parameter entry in the KFC factorisation, computed by unravelling indices."""
    dnums = spec.get("dimension_numbers")
    w_shape = spec.param_shapes[0]
    o_axis, i_axis, h_axis, w_axis = dnums.rhs_spec
    idx = np.unravel_index(np.arange(math.prod(w_shape)), w_shape)
    n_in = w_shape[i_axis]
    rows = (idx[h_axis] * w_shape[w_axis] + idx[w_axis]) * n_in + idx[i_axis]
    cols = idx[o_axis]
    if len(spec.param_shapes) == 2:
        n_out = w_shape[o_axis]
        rows = np.concatenate([rows, np.full(n_out, math.prod(w_shape) // n_out)])
        cols = np.concatenate([cols, np.arange(n_out)])
    return rows, cols


@pytest.mark.parametrize(
    "name, patches_method",
    [
        ("nhwc", "auto"),
        ("nchw_oihw", "auto"),
        ("nchw_oihw", "patches"),
        ("nhwc_ohwi_no_bias", "auto"),
        ("nchw_strided_lhs_dilation", "auto"),
        ("transposed", "auto"),
        ("transposed", "patches"),
    ],
)
def test_kronecker_factors_equal_explicit_formulas(getkey, name, patches_method):
    spec, data, _ = _layer(getkey, **_CONFIGS[name])
    batch = data.inputs[0].shape[spec.get("dimension_numbers").lhs_spec[0]]
    block = Conv2DTwoKroneckerFactored(spec, patches_method=patches_method)
    state, dense = _estimate(block, data, batch)
    a, g = (np.asarray(f.value) for f in state.factors)
    expected_a, expected_g = _explicit_factors(spec, data)
    np.testing.assert_allclose(a, expected_a, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(g, expected_g, rtol=1e-10, atol=1e-12)

    # The dense matrix is A ⊗ G laid out on the parameters' row-major flattening.
    rows, cols = _kernel_index_map(spec)
    expected = a[rows[:, None], rows[None, :]] * g[cols[:, None], cols[None, :]]
    np.testing.assert_allclose(dense, expected, rtol=1e-10, atol=1e-12)


# One program per layer shape (shared by the two patch methods) instead of dozens of eager
# operations.
@eqx.filter_jit
def _explicit_factors(spec, data):
    """The KFC factors A and G of one batch, from their explicit formulas."""
    dnums = spec.get("dimension_numbers")
    (x,), (dy,) = data.inputs, data.outputs_tangent
    batch = x.shape[dnums.lhs_spec[0]]

    # A: patches from `conv_general_dilated_patches` (channel-major features), reordered to
    # spatial-major, with the bias 1 appended, averaged over examples and locations.
    kernel = tuple(spec.param_shapes[0][i] for i in dnums.rhs_spec[2:])
    patches = jax.lax.conv_general_dilated_patches(
        x, kernel, spec.get("window_strides"), spec.get("padding"),
        lhs_dilation=spec.get("lhs_dilation"), rhs_dilation=spec.get("rhs_dilation"),
        dimension_numbers=(_fmt(dnums.lhs_spec), "OIHW", _fmt(dnums.lhs_spec)),
    )
    patches = jnp.moveaxis(patches, dnums.lhs_spec[1], -1)
    channels = x.shape[dnums.lhs_spec[1]]
    patches = patches.reshape(-1, channels, math.prod(kernel)).transpose(0, 2, 1)
    patches = patches.reshape(patches.shape[0], -1)
    if len(spec.param_shapes) == 2:
        patches = jnp.concatenate([patches, jnp.ones((patches.shape[0], 1))], axis=1)
    locations = patches.shape[0] // batch
    expected_a = patches.T @ patches / (batch * locations)

    # G: output tangents summed over vectors, examples and locations, divided by the batch size.
    dy_flat = jnp.moveaxis(dy, dnums.out_spec[1] + 1, -1).reshape(-1, dy.shape[dnums.out_spec[1] + 1])
    return expected_a, dy_flat.T @ dy_flat / batch


def _fmt(lhs_spec):
    letters = [""] * 4
    for letter, axis in zip("NCHW", lhs_spec):
        letters[axis] = letter
    return "".join(letters)


@pytest.mark.parametrize("layout", [("NHWC", "HWIO"), ("NCHW", "OIHW"), ("NHWC", "OHWI")])
def test_kronecker_is_exact_for_one_example_and_one_location(getkey, layout):
    # With one location and one example the gradient is p dyᵀ, so its outer product is A ⊗ G.
    spec, data, _ = _layer(getkey, lhs=layout[0], rhs=layout[1], batch=1, spatial=(3, 2), vectors=1)
    kfc = Conv2DTwoKroneckerFactored(spec)
    full = Conv2DFull(spec)
    np.testing.assert_allclose(
        _estimate(kfc, data, 1)[1], _estimate(full, data, 1)[1], rtol=1e-10, atol=1e-12
    )


def test_kronecker_round_trips_parameters(getkey):
    spec, data, _ = _layer(getkey, lhs="NCHW", rhs="OIHW")
    block = Conv2DTwoKroneckerFactored(spec)
    array = block._params_to_array(data.params)
    assert array.shape == block.factor_dims == (3 * 2 * 4 + 1, 4)
    for got, want in zip(block._array_to_params(array), data.params):
        np.testing.assert_array_equal(got, want)


def test_kronecker_rejects_grouped_and_depthwise(getkey):
    for config in (_CONFIGS["depthwise"], _CONFIGS["grouped_nchw"]):
        spec, _, _ = _layer(getkey, **config)
        groups = config["groups"]
        with pytest.raises(
            ValueError,
            match=rf"Conv2DTwoKroneckerFactored cannot handle the conv2d layer #0 \(conv.p0, conv.p1\): "
            rf"it is a grouped or depthwise convolution \(feature_group_count={groups}\).*"
            "Use Conv2DDiagonal or Conv2DFull",
        ):
            Conv2DTwoKroneckerFactored(spec)


def test_kronecker_rejects_unknown_patches_method(getkey):
    spec, _, _ = _layer(getkey)
    with pytest.raises(
        ValueError,
        match=r"Conv2DTwoKroneckerFactored for the conv2d layer #0 \(conv.p0, conv.p1\): "
        r"`patches_method` must be one of \('auto', 'patches'\), got 'offsets'",
    ):
        Conv2DTwoKroneckerFactored(spec, patches_method="offsets")


def test_malformed_specs_are_rejected(getkey):
    spec, _, _ = _layer(getkey)
    wrong_bias = _replace_fields(spec, param_shapes=(spec.param_shapes[0], (3,)))
    for block in (Conv2DDiagonal, Conv2DFull, Conv2DTwoKroneckerFactored):
        with pytest.raises(ValueError, match=rf"{block.__name__} cannot handle the conv2d layer #0.*"
                           r"the bias \(3,\) must have one entry per output feature \(4\)"):
            block(wrong_bias)
    dense = _replace_fields(spec, tag="dense")
    with pytest.raises(ValueError, match="Conv2DFull cannot approximate the dense layer #0"):
        Conv2DFull(dense)


def _replace_fields(spec, **changes):
    fields = {k: getattr(spec, k) for k in spec.__dataclass_fields__}
    return LayerSpec(**{**fields, **changes})
