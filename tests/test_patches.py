"""Tests for `patches_moments` / `patches_moments_explicit` against each other and a numpy loop."""

import functools
import itertools
import math

import equinox as eqx
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings

from eqx_kfac import patches_moments, patches_moments_explicit


def _numpy_reference(x_nhwc, kernel, strides, padding, inputs_dilation, kernel_dilation, depthwise, w):
    """Loops over every output location of a padded, dilated NHWC image (independent of JAX)."""
    x = np.asarray(x_nhwc)
    n, h, wd, c = x.shape
    dilated = np.zeros((n, (h - 1) * inputs_dilation[0] + 1, (wd - 1) * inputs_dilation[1] + 1, c))
    dilated[:, :: inputs_dilation[0], :: inputs_dilation[1]] = x
    (plo, phi), (qlo, qhi) = padding
    padded = np.pad(dilated, ((0, 0), (plo, phi), (qlo, qhi), (0, 0)))
    eff = [(k - 1) * d + 1 for k, d in zip(kernel, kernel_dilation)]
    out = [(padded.shape[1 + i] - eff[i]) // strides[i] + 1 for i in range(2)]
    size = kernel[0] * kernel[1] * c
    second = np.zeros((kernel[0], kernel[1], kernel[0], kernel[1], c) if depthwise else (size, size))
    first = np.zeros(kernel + (c,))
    for b, i, j in itertools.product(range(n), range(out[0]), range(out[1])):
        rows = i * strides[0] + np.arange(kernel[0]) * kernel_dilation[0]
        cols = j * strides[1] + np.arange(kernel[1]) * kernel_dilation[1]
        patch = padded[b][np.ix_(rows, cols)]
        weight = w[b, i, j]
        first += weight * patch
        if depthwise:
            second += weight * np.einsum("abc,dec->abdec", patch, patch)
        else:
            second += weight * np.outer(patch.ravel(), patch.ravel())
    if not depthwise:
        second = second.reshape(kernel + (c,) + kernel + (c,))
    return second, first, tuple(out)


_CONFIGS = st.fixed_dictionaries(
    {
        "kernel": st.sampled_from([(1, 1), (2, 3), (3, 3), (3, 1)]),
        "strides": st.sampled_from([(1, 1), (2, 2), (2, 1), (1, 3)]),
        "padding": st.sampled_from(["VALID", "SAME", ((1, 0), (2, 1)), ((0, 2), (1, 1))]),
        "data_format": st.sampled_from(["NHWC", "NCHW"]),
        "depthwise": st.booleans(),
        "kernel_dilation": st.sampled_from([(1, 1), (2, 1)]),
        "inputs_dilation": st.sampled_from([(1, 1), (1, 2)]),
        "weighting": st.sampled_from([None, "batch", "locations"]),
        "channels": st.sampled_from([1, 3]),
        "method": st.sampled_from(["auto", "patches"]),
    }
)


def _inputs(key, data_format, channels=3):
    x = jax.random.normal(key, (2, 7, 6, channels), dtype=jnp.float64)
    return x if data_format == "NHWC" else jnp.transpose(x, (0, 3, 1, 2))


def _weighting(key, kind, batch, out_spatial):
    if kind is None:
        return None, np.ones((batch, *out_spatial))
    if kind == "batch":
        w = jax.random.uniform(key, (batch,), dtype=jnp.float64)
        return w, np.broadcast_to(np.asarray(w)[:, None, None], (batch, *out_spatial))
    w = jax.random.uniform(key, (batch, *out_spatial), dtype=jnp.float64)
    return w, np.asarray(w)


# Each example compiles two fresh programs: a dozen examples cover the grid at a few seconds' cost.
@settings(max_examples=12)
@given(config=_CONFIGS)
def test_efficient_equals_explicit_and_numpy(config):
    keys = jax.random.split(jax.random.key(1), 2)
    x = _inputs(keys[0], config["data_format"], config["channels"])
    x_nhwc = x if config["data_format"] == "NHWC" else jnp.transpose(x, (0, 2, 3, 1))
    channels = x_nhwc.shape[-1]
    # With one channel, a depthwise convolution is an ordinary one.
    depthwise = config["depthwise"] and channels > 1
    kwargs = dict(
        kernel_spatial_shape=config["kernel"],
        strides=config["strides"],
        padding=config["padding"],
        data_format=config["data_format"],
        feature_group_count=channels if depthwise else 1,
        kernel_dilation=config["kernel_dilation"],
        inputs_dilation=config["inputs_dilation"],
    )
    if isinstance(config["padding"], str) and config["inputs_dilation"] != (1, 1):
        with pytest.raises(ValueError, match="string padding .* is undefined with `inputs_dilation`"):
            patches_moments(x, **kwargs)
        return
    # The output spatial shape, for the weighting array, from an actual convolution.
    out = jax.lax.conv_general_dilated(
        x_nhwc,
        jnp.zeros(config["kernel"] + (channels, 1)),
        config["strides"],
        config["padding"],
        lhs_dilation=config["inputs_dilation"],
        rhs_dilation=config["kernel_dilation"],
        dimension_numbers=("NHWC", "HWIO", "NHWC"),
    )
    out_spatial = out.shape[1:3]
    weighting, dense_w = _weighting(keys[1], config["weighting"], x.shape[0], out_spatial)

    # Compiled as a whole (static configuration), which is cheaper than op-by-op dispatch.
    second, first = eqx.filter_jit(patches_moments)(
        x, weighting_array=weighting, method=config["method"], **kwargs
    )
    second_x, first_x = eqx.filter_jit(patches_moments_explicit)(x, weighting_array=weighting, **kwargs)
    np.testing.assert_allclose(second, second_x, rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(first, first_x, rtol=1e-10, atol=1e-10)

    pads = config["padding"]
    if isinstance(pads, str):
        # `lax.conv_general_dilated` resolves string padding on the undilated input shape.
        dilated_kernel = [(k - 1) * d + 1 for k, d in zip(config["kernel"], config["kernel_dilation"])]
        pads = jax.lax.padtype_to_pads(x_nhwc.shape[1:3], dilated_kernel, config["strides"], pads)
    ref_second, ref_first, ref_out = _numpy_reference(
        x_nhwc,
        config["kernel"],
        config["strides"],
        pads,
        config["inputs_dilation"],
        config["kernel_dilation"],
        depthwise,
        dense_w,
    )
    assert ref_out == tuple(out_spatial)
    np.testing.assert_allclose(second, ref_second, rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(first, ref_first, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize(
    "kernel, dilation, padding, channels, depthwise, weighting",
    [
        ((3, 3), (2, 2), ((1, 2), (1, 2)), 3, False, None),
        ((4, 2), (2, 3), ((2, 2), (0, 1)), 2, False, "locations"),
        ((5, 3), (2, 2), ((0, 3), (2, 0)), 4, True, "batch"),
        ((3, 3), (3, 3), ((2, 2), (2, 2)), 1, False, "locations"),
    ],
)
def test_transposed_convolutions_equal_numpy(getkey, kernel, dilation, padding, channels, depthwise, weighting):
    # Input dilation with stride 1 (a transposed convolution) takes the residue-class path: the
    # patches of the undilated input, one smaller kernel per class of output locations.
    x = jax.random.normal(getkey(), (2, 5, 4, channels), dtype=jnp.float64)
    kwargs = dict(kernel_spatial_shape=kernel, strides=1, padding=padding, data_format="NHWC",
                  inputs_dilation=dilation, feature_group_count=channels if depthwise else 1)
    out_spatial = tuple(
        (s - 1) * d + 1 + lo + hi - k + 1 for s, d, (lo, hi), k in zip((5, 4), dilation, padding, kernel)
    )
    weights, dense_w = _weighting(getkey(), weighting, 2, out_spatial)
    second, first = eqx.filter_jit(patches_moments)(x, weighting_array=weights, **kwargs)
    ref_second, ref_first, ref_out = _numpy_reference(
        x, kernel, (1, 1), padding, dilation, (1, 1), depthwise, dense_w
    )
    assert ref_out == out_spatial
    np.testing.assert_allclose(second, ref_second.reshape(second.shape), rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(first, ref_first, rtol=1e-10, atol=1e-10)


def _num_chunks(x, **kwargs):
    """The length of `patches_moments`' loop over chunks of examples (traced, not run)."""
    jaxpr = jax.make_jaxpr(functools.partial(patches_moments, **kwargs))(x)
    (scan,) = [eqn for eqn in jaxpr.eqns if eqn.primitive.name == "scan"]
    return scan.params["length"]


# The documented budget of `method="auto"`: chunks of examples whose patches take at most 8 MiB.
CHUNK_BYTES = 8 * 2**20


@pytest.mark.parametrize(
    "shape, kernel, strides",
    [((128, 16, 8, 8), 3, 1), ((256, 64, 32, 32), 3, 1), ((64, 3, 224, 224), 7, 2), ((2, 1, 4, 4), 1, 1)],
)
def test_auto_chunks_the_batch_only_when_its_patches_exceed_the_budget(shape, kernel, strides):
    x = jax.ShapeDtypeStruct(shape, jnp.float32)
    kwargs = dict(kernel_spatial_shape=kernel, strides=strides, padding="SAME", data_format="NCHW")
    out_locations = math.prod(-(-s // strides) for s in shape[2:])
    example_bytes = out_locations * kernel**2 * shape[1] * 4
    per_chunk = max(1, CHUNK_BYTES // example_bytes)
    assert _num_chunks(x, **kwargs) == -(-shape[0] // per_chunk)
    assert _num_chunks(x, method="patches", **kwargs) == 1


@pytest.mark.parametrize(
    "batch, channels, size, kernel, data_format, depthwise",
    [(29, 1, 64, 3, "NHWC", False), (5, 24, 32, 3, "NCHW", False), (5, 24, 32, 3, "NHWC", True)],
)
def test_chunks_equal_explicit_patches(getkey, batch, channels, size, kernel, data_format, depthwise):
    # Large enough that "auto" takes two chunks, the last one padded with a zero example.
    shape = (batch, size, size, channels) if data_format == "NHWC" else (batch, channels, size, size)
    x = jax.random.normal(getkey(), shape, dtype=jnp.float64)
    weights = jax.random.uniform(getkey(), (batch, size, size), dtype=jnp.float64)
    kwargs = dict(
        kernel_spatial_shape=kernel,
        padding="SAME",
        data_format=data_format,
        feature_group_count=channels if depthwise else 1,
        weighting_array=weights,
    )
    assert _num_chunks(x, **kwargs) == 2
    got = eqx.filter_jit(patches_moments)(x, **kwargs)
    want = eqx.filter_jit(patches_moments_explicit)(x, **kwargs)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-10, atol=1e-10 * float(jnp.max(jnp.abs(w))))


def test_unknown_method_is_rejected():
    with pytest.raises(ValueError, match=r"`method` must be one of \('auto', 'patches'\), got 'offsets'"):
        patches_moments(jnp.ones((2, 5, 5, 4)), 3, method="offsets")


def test_any_dimension_numbers_and_channels_aliases(getkey):
    x = jax.random.normal(getkey(), (2, 6, 3, 5), dtype=jnp.float64)  # N H C W
    dnums = jax.lax.ConvDimensionNumbers((0, 2, 1, 3), (3, 2, 0, 1), (0, 2, 1, 3))
    got = patches_moments(x, (2, 3), strides=(1, 2), padding="SAME", dimension_numbers=dnums)
    nhwc = jnp.transpose(x, (0, 1, 3, 2))
    want = patches_moments(nhwc, (2, 3), strides=(1, 2), padding="SAME", data_format="channels_last")
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-10, atol=1e-10)
    nchw = jnp.transpose(x, (0, 2, 1, 3))
    strings = patches_moments(
        nchw, (2, 3), strides=(1, 2), padding="SAME", dimension_numbers=("NCHW", "OIHW", "NCHW")
    )
    first = patches_moments(nchw, (2, 3), strides=(1, 2), padding="SAME", data_format="channels_first")
    for g, s, w in zip(strings, first, want):
        np.testing.assert_allclose(g, w, rtol=1e-10, atol=1e-10)
        np.testing.assert_allclose(s, w, rtol=1e-10, atol=1e-10)


def test_low_precision_inputs_accumulate_in_float32(getkey):
    x = jax.random.normal(getkey(), (3, 5, 5, 2), dtype=jnp.float32)
    second, first = patches_moments(x.astype(jnp.bfloat16), 3, padding="SAME")
    assert second.dtype == jnp.float32 and first.dtype == jnp.float32
    ref, _ = patches_moments_explicit(x.astype(jnp.bfloat16).astype(jnp.float64), 3, padding="SAME")
    np.testing.assert_allclose(second, ref, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(feature_group_count=2), "`feature_group_count` must be 1 .* or the number of input channels 4"),
        (dict(data_format="NHW"), "data format 'NHW' does not describe inputs of rank 4"),
        (dict(weighting_array=jnp.ones((2, 3))), r"`weighting_array` must have shape \(batch,\) = \(2,\)"),
        (dict(kernel_spatial_shape=(9, 1)), "smaller than the \\(dilated\\) kernel"),
        (dict(strides=(1, 1, 1)), "`strides` must be an int or have one entry per spatial dimension"),
    ],
)
def test_errors(kwargs, message):
    x = jnp.ones((2, 5, 5, 4))
    kwargs = {"kernel_spatial_shape": 3, **kwargs}
    for fn in (patches_moments, patches_moments_explicit):
        with pytest.raises(ValueError, match=message):
            fn(x, **kwargs)
