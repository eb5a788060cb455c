"""Flax (Linen, NNX) and Haiku layers get structured blocks, each the exact GGN where K-FAC is exact.

Each model registers with `on_unmatched="error"` (no parameter falls back to a generic block), and
its curvature is compared with the GGN from `jax.jacobian` of the model's outputs: `Full` blocks
equal the diagonal blocks of the exact GGN on a batch (every layer here sees its examples
separately, BatchNorm's parameters included: they act after the batch statistics), and the default
Kronecker-factored dense blocks (bias included) equal them on one example.
"""

import equinox as eqx
import flax.linen as nn
import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.flatten_util import ravel_pytree

import eqx_kfac

FULL = {
    "dense": eqx_kfac.DenseFull,
    "conv2d": eqx_kfac.Conv2DFull,
    "scale_and_shift": eqx_kfac.ScaleAndShiftFull,
}


def _perturbed(params, key):
    """Parameters moved off their initial values (unit scales, zero biases) by random amounts."""
    leaves, treedef = jax.tree.flatten(params)
    keys = jax.random.split(key, len(leaves))
    return jax.tree.unflatten(
        treedef, [x + 0.3 * jax.random.normal(k, x.shape, x.dtype) for x, k in zip(leaves, keys)]
    )


def _loss_of(forward):
    """The squared-error loss of `forward(params, x)`, registered on its outputs."""

    def loss(params, batch):
        x, t = batch
        y = eqx_kfac.register_squared_error_loss(forward(params, x), t)
        return jnp.mean(jnp.sum((y - t) ** 2, axis=-1))

    return loss


def _check(forward, params, x, ctors, origins, rtol=1e-8):
    """Registers with no fallback, and every block equals the exact GGN's block on `x`."""
    t = jnp.zeros(forward(params, x).shape, x.dtype)
    args = (params, (x, t))
    estimator = eqx_kfac.BlockDiagonalCurvature(
        _loss_of(forward), args, layer_tag_to_block_ctor=ctors, on_unmatched="error",
        default_estimation_mode="ggn_exact",
    )
    assert {r.origin for r in estimator.registrations().values()} == origins
    flat, unravel = ravel_pytree(params)

    @jax.jit  # one program each (run eagerly, the estimate and the Jacobian compiled ~400 small ones)
    def dense_and_exact(args, flat):
        state = estimator.update_curvature_matrix_estimate(
            estimator.init(), 0.0, 1.0, x.shape[0], jax.random.key(0), args
        )
        jacobian = jax.jacobian(lambda f: forward(unravel(f), x))(flat).reshape(-1, flat.size)
        return estimator.to_dense_matrix(state), 2 * jacobian.T @ jacobian / x.shape[0]

    dense, exact = dense_and_exact(args, flat)
    owner = np.repeat(np.arange(len(estimator.param_shapes)), [np.prod(s, dtype=int) for s in estimator.param_shapes])
    block_of = {i: b for b, block in enumerate(estimator.blocks) for i in block.spec.param_indices}
    blocks = np.array([block_of[i] for i in owner])
    mask = blocks[:, None] == blocks[None, :]
    np.testing.assert_allclose(dense, np.where(mask, exact, 0.0), rtol=rtol, atol=rtol * 1e-3 * np.abs(exact).max())
    return estimator


# ------------------------------------------------------------------------------------------------
# Convolutional networks with BatchNorm, Conv, LayerNorm and Dense layers.

_IMAGES = jax.random.normal(jax.random.key(1), (3, 5, 5, 2))


class _LinenCNN(nn.Module):
    @nn.compact
    def __call__(self, x):
        f64 = dict(param_dtype=jnp.float64)
        x = nn.BatchNorm(use_running_average=False, **f64)(x)
        x = nn.LayerNorm(**f64)(jnp.tanh(nn.Conv(3, (3, 3), padding="VALID", **f64)(x)))
        return nn.Dense(2, **f64)(x.reshape(x.shape[0], -1))


class _NNXCNN(nnx.Module):
    def __init__(self, rngs):
        self.norm = nnx.BatchNorm(2, rngs=rngs, param_dtype=jnp.float64)
        self.conv = nnx.Conv(2, 3, (3, 3), padding="VALID", rngs=rngs, param_dtype=jnp.float64)
        self.layer_norm = nnx.LayerNorm(3, rngs=rngs, param_dtype=jnp.float64)
        self.linear = nnx.Linear(27, 2, rngs=rngs, param_dtype=jnp.float64)

    def __call__(self, x):
        x = self.layer_norm(jnp.tanh(self.conv(self.norm(x))))
        return self.linear(x.reshape(x.shape[0], -1))


def _haiku_cnn(x):
    x = hk.BatchNorm(True, True, 0.9)(x, is_training=True)
    x = hk.LayerNorm(-1, True, True)(jnp.tanh(hk.Conv2D(3, 3, padding="VALID")(x)))
    return hk.Linear(2)(x.reshape(x.shape[0], -1))


_CNN_ORIGINS = {"normalization", "conv2d_nhwc_with_bias", "dense_in_out_with_bias"}


def test_linen_cnn():
    model = _LinenCNN()
    variables = model.init(jax.random.key(0), _IMAGES)
    params = _perturbed(variables["params"], jax.random.key(2))

    def forward(p, x):
        return model.apply({"params": p, "batch_stats": variables["batch_stats"]}, x, mutable=["batch_stats"])[0]

    _check(forward, params, _IMAGES, FULL, _CNN_ORIGINS)


def test_nnx_cnn():
    graphdef, params, rest = nnx.split(_NNXCNN(nnx.Rngs(0)), nnx.Param, ...)
    params = _perturbed(params, jax.random.key(2))

    def forward(p, x):
        # `merge` builds the module inside the trace, where BatchNorm may update its statistics
        # (which NNX keeps in float32).
        return nnx.merge(graphdef, p, jax.tree.map(lambda s: s.astype(jnp.float64), rest))(x)

    _check(forward, params, _IMAGES, FULL, _CNN_ORIGINS)


def test_haiku_cnn():
    transformed = hk.transform_with_state(_haiku_cnn)
    params, state = transformed.init(jax.random.key(0), _IMAGES)
    params = _perturbed(params, jax.random.key(2))
    # Haiku keeps BatchNorm's scale and offset as (1, 1, 1, channels).
    assert params["batch_norm"]["scale"].shape == (1, 1, 1, 2)

    def forward(p, x):
        return transformed.apply(p, state, None, x)[0]

    _check(forward, params, _IMAGES, FULL, _CNN_ORIGINS)


def _kfac_jax_layer_norm(x):
    """The layer norm of kfac-jax's test models (`tests/models.py`), written as it writes it."""
    mean = jnp.broadcast_to(jnp.mean(x, axis=-1, keepdims=True), x.shape)
    variance = jnp.var(x, axis=-1, keepdims=True)
    scale = jnp.broadcast_to(hk.get_parameter("scale", x.shape[-1:], x.dtype, init=jnp.ones), x.shape)
    offset = jnp.broadcast_to(hk.get_parameter("offset", x.shape[-1:], x.dtype, init=jnp.zeros), x.shape)
    multiplier = scale * jax.lax.rsqrt(variance + 1e-5)
    return multiplier * (x - mean) + offset


def test_kfac_jax_layer_norm_is_one_scale_and_shift_block():
    transformed = hk.without_apply_rng(
        hk.transform(lambda x: hk.Linear(2)(jnp.tanh(_kfac_jax_layer_norm(hk.Linear(4)(x)))))
    )
    x = jax.random.normal(jax.random.key(3), (4, 3))
    params = _perturbed(transformed.init(jax.random.key(0), x), jax.random.key(2))
    _check(transformed.apply, params, x, FULL, {"normalization", "dense_in_out_with_bias"})


# ------------------------------------------------------------------------------------------------
# Dense layers: the bias is in the Kronecker-factored block, exact on one example.

_ONE = jax.random.normal(jax.random.key(4), (1, 3))


def test_linen_dense_kronecker_block_is_exact_on_one_example():
    model = nn.Sequential([nn.Dense(4, param_dtype=jnp.float64), jnp.tanh, nn.Dense(2, param_dtype=jnp.float64)])
    params = _perturbed(model.init(jax.random.key(0), _ONE)["params"], jax.random.key(2))
    _check(lambda p, x: model.apply({"params": p}, x), params, _ONE, None, {"dense_in_out_with_bias"})


def test_nnx_linear_kronecker_block_is_exact_on_one_example():
    rngs = nnx.Rngs(0)
    model = nnx.Sequential(
        nnx.Linear(3, 4, rngs=rngs, param_dtype=jnp.float64), jnp.tanh,
        nnx.Linear(4, 2, rngs=rngs, param_dtype=jnp.float64),
    )
    graphdef, params = nnx.split(model)
    params = _perturbed(params, jax.random.key(2))
    _check(lambda p, x: nnx.merge(graphdef, p)(x), params, _ONE, None, {"dense_in_out_with_bias"})


def test_haiku_linear_kronecker_block_is_exact_on_one_example():
    transformed = hk.without_apply_rng(hk.transform(lambda x: hk.Linear(2)(jnp.tanh(hk.Linear(4)(x)))))
    params = _perturbed(transformed.init(jax.random.key(0), _ONE), jax.random.key(2))
    _check(transformed.apply, params, _ONE, None, {"dense_in_out_with_bias"})


def test_linen_dense_general_kronecker_block_is_exact_on_one_example():
    """`DenseGeneral` kernels of shape `(in, *out)` and `(*in, out)`: the block acts on the
    kernel's `(in, out)` reshape."""
    model = nn.Sequential([
        nn.DenseGeneral((2, 2), param_dtype=jnp.float64), jnp.tanh,
        nn.DenseGeneral(2, axis=(-2, -1), param_dtype=jnp.float64),
    ])
    params = _perturbed(model.init(jax.random.key(0), _ONE)["params"], jax.random.key(2))
    origins = {"dense_general_1x2_with_bias", "dense_general_2x1_with_bias"}
    _check(lambda p, x: model.apply({"params": p}, x), params, _ONE, None, origins)


def test_plain_dense_kronecker_block_is_exact_on_one_example():
    keys = jax.random.split(jax.random.key(5), 4)
    params = {
        "w1": jax.random.normal(keys[0], (3, 4)), "b1": jax.random.normal(keys[1], (4,)),
        "w2": jax.random.normal(keys[2], (4, 2)), "b2": jax.random.normal(keys[3], (2,)),
    }

    def forward(p, x):
        return jnp.tanh(x @ p["w1"] + p["b1"]) @ p["w2"] + p["b2"]

    _check(forward, params, _ONE, None, {"dense_in_out_with_bias"})


# ------------------------------------------------------------------------------------------------
# Float32 parameters meeting float64 inputs (under `jax_enable_x64`) through `convert_element_type`.


class _EqxNet(eqx.Module):
    linear: eqx.nn.Linear
    group_norm: eqx.nn.GroupNorm
    layer_norm: eqx.nn.LayerNorm

    def __init__(self, key):
        self.linear = eqx.nn.Linear(3, 4, key=key, dtype=jnp.float32)
        self.group_norm = eqx.nn.GroupNorm(2, 4, dtype=jnp.float32)
        self.layer_norm = eqx.nn.LayerNorm(4, dtype=jnp.float32)

    def __call__(self, x):
        return self.layer_norm(jnp.tanh(self.group_norm(self.linear(x))))


@pytest.mark.parametrize("kind", ["linen", "equinox", "plain"])
def test_float32_parameters_with_float64_inputs(kind):
    x = jax.random.normal(jax.random.key(6), (4, 3))
    if kind == "linen":
        model = nn.Sequential([nn.Conv(3, (3, 3)), jnp.tanh, lambda h: h.reshape(h.shape[0], -1), nn.Dense(2)])
        x = _IMAGES
        params = model.init(jax.random.key(0), x.astype(jnp.float32))["params"]
        forward = lambda p, x: model.apply({"params": p}, x)  # noqa: E731
        origins = {"conv2d_nhwc_with_bias", "dense_in_out_with_bias"}
    elif kind == "equinox":
        params = _perturbed(_EqxNet(jax.random.key(0)), jax.random.key(2))
        forward = lambda m, x: jax.vmap(m)(x)  # noqa: E731
        origins = {"linear_with_bias", "scale_and_shift"}
    else:
        params = {"w": jnp.ones((3, 2), jnp.float32), "b": jnp.arange(2, dtype=jnp.float32)}
        forward = lambda p, x: x @ p["w"] + p["b"]  # noqa: E731
        origins = {"dense_in_out_with_bias"}
    assert x.dtype == jnp.float64
    estimator = _check(forward, params, x, FULL, origins, rtol=1e-4)
    # The tags record the float32 parameters themselves, so the blocks keep their dtype.
    assert {s for b in estimator.blocks for s in b.spec.param_dtypes} == {jnp.dtype(jnp.float32)}


def test_register_conv2d_takes_kfac_jax_arguments():
    x = jax.random.normal(jax.random.key(7), (2, 6, 6, 3))
    w = jax.random.normal(jax.random.key(8), (3, 3, 3, 4))
    kfac_jax_args = dict(
        batch_group_count=1, feature_group_count=1, lhs_dilation=(1, 1), rhs_dilation=(1, 1),
        padding=((0, 1), (0, 1)), window_strides=(2, 2), out_sharding=None, preferred_element_type=None,
        precision=(jax.lax.Precision.HIGHEST, jax.lax.Precision.HIGHEST),
        dimension_numbers=jax.lax.ConvDimensionNumbers((0, 3, 1, 2), (3, 2, 0, 1), (0, 3, 1, 2)),
    )
    y = jax.lax.conv_general_dilated(x, w, **kfac_jax_args)
    np.testing.assert_array_equal(eqx_kfac.register_conv2d(y, x, w, **kfac_jax_args), y)
    with pytest.raises(ValueError, match="batch_group_count"):
        eqx_kfac.register_conv2d(y, x, w, **{**kfac_jax_args, "batch_group_count": 2})
    with pytest.raises(ValueError, match="do not fit"):
        eqx_kfac.register_conv2d(y, x, w, **{**kfac_jax_args, "precision": "bogus"})
