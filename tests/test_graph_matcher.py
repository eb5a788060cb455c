"""Automatic layer registration: the tagged jaxpr registers exactly what a hand-registered twin does
(internal on purpose: `layer_tag_of` and the tags' primitives identify what was registered).

Registrations are read off the traced jaxpr by a small independent walker (below) that follows
parameter variables into `jit`, `checkpoint`, custom-derivative and `scan` bodies, so a tag inside a
scan body is attributed to the stacked parameter leaf it slices.
"""

import warnings
from collections.abc import Callable

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.extend.core import Var

from eqx_kfac import BlockDiagonalCurvature
from eqx_kfac import DEFAULT_GRAPH_PATTERNS, GraphPattern, auto_register_tags
from eqx_kfac import register_squared_error_loss
from eqx_kfac import register_conv2d, register_dense, register_scale_and_shift
from eqx_kfac import LayerTag, layer_tag_of
from eqx_kfac._tracing.jaxpr_interpreter import scan_consts_and_carry

_SUBJAXPR_KEYS = {
    "jit": "jaxpr",
    "remat2": "jaxpr",
    "custom_jvp_call": "call_jaxpr",
    "custom_vjp_call": "call_jaxpr",
    "shard_map": "jaxpr",
}


def _registrations(fn, args):
    """Sorted `(tag, param paths, meta without origin, origin, input shapes, output shapes)` per layer tag."""
    closed = eqx.filter_make_jaxpr(fn)(*args)[0]
    flat = jax.tree_util.tree_flatten_with_path(tuple(args))[0]
    dyn = [(p, leaf) for p, leaf in flat if eqx.is_array(leaf)]
    names = {
        v: jax.tree_util.keystr(p[1:]).lstrip(".")
        for v, (p, leaf) in zip(closed.jaxpr.invars, dyn)
        if p[0] == jax.tree_util.SequenceKey(0) and jnp.issubdtype(leaf.dtype, jnp.inexact)
    }
    found = []

    def walk(jaxpr, names):
        for eqn in jaxpr.eqns:
            tag = layer_tag_of(eqn)
            if tag is not None:
                outs, ins, params = tag.split(eqn.invars)
                meta = tuple(sorted((k, v) for k, v in eqn.params.items() if k != "origin"))
                found.append(
                    (
                        tag.name,
                        tuple(names[v] for v in params),
                        meta,
                        eqn.params["origin"],
                        tuple(v.aval.shape for v in ins),
                        tuple(v.aval.shape for v in outs),
                    )
                )
                continue
            name = eqn.primitive.name
            if name in _SUBJAXPR_KEYS:
                sub = eqn.params[_SUBJAXPR_KEYS[name]]
                inner = getattr(sub, "jaxpr", sub)
                walk(inner, {iv: names[v] for iv, v in zip(inner.invars, eqn.invars) if isinstance(v, Var) and v in names})
            elif name == "scan":
                inner = eqn.params["jaxpr"].jaxpr
                start = sum(scan_consts_and_carry(eqn))
                pairs = list(zip(inner.invars, eqn.invars))[start:]
                walk(inner, {iv: names[v] for iv, v in pairs if isinstance(v, Var) and v in names})

    walk(closed.jaxpr, names)
    return sorted(found, key=repr)


def _layers(regs):
    """Registrations without the origin, generic tags left out."""
    return [(t, p, m, i, o) for t, p, m, _, i, o in regs if t != "generic"]


def _generic(regs):
    return sorted((p, origin) for t, p, _, origin, _, _ in regs if t == "generic")


def _assert_same_value_and_grad(untagged, tagged):
    """`(value, grads)` pairs agree to rounding: the tags are identities and the operations the same."""
    (v1, g1), (v2, g2) = untagged, tagged
    np.testing.assert_allclose(np.asarray(v2), np.asarray(v1), rtol=1e-12)
    for a, b in zip(jax.tree.leaves(g2), jax.tree.leaves(g1), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-14)


def _check_value_and_grad(loss, tagged, params, batch, has_aux=False):
    # Both losses' values and gradients in one compiled program (one compilation, not two).
    both = eqx.filter_jit(
        lambda p, b: tuple(eqx.filter_value_and_grad(f, has_aux=has_aux)(p, b) for f in (loss, tagged))
    )
    _assert_same_value_and_grad(*both(params, batch))


def _check_against_twin(apply, twin, params, batch, generic=(), n_manual=0):
    """`apply(params, x)` auto-registered equals `twin(params, x)` (hand-registered) on layer tags."""

    def loss(p, b):
        x, t = b
        return jnp.sum((register_squared_error_loss(apply(p, x)) - t) ** 2)

    def twin_loss(p, b):
        x, t = b
        return jnp.sum((register_squared_error_loss(twin(p, x)) - t) ** 2)

    tagged = auto_register_tags(loss, (params, batch))
    auto = _registrations(tagged, (params, batch))
    manual = _registrations(twin_loss, (params, batch))
    assert manual and all(r[3] == "manual" for r in manual)
    assert _layers(auto) == _layers(manual)
    assert _generic(auto) == sorted((p, "unmatched") for p in generic)
    assert sum(r[3] == "manual" for r in auto) == n_manual
    _check_value_and_grad(loss, tagged, params, batch)
    return auto


def _batch(getkey, x_shape, t_shape):
    return jax.random.normal(getkey(), x_shape), jax.random.normal(getkey(), t_shape)


class _MLP(eqx.Module):
    layers: tuple[eqx.nn.Linear, ...]
    activation: Callable = eqx.field(static=True)

    def __init__(self, sizes, activation, key):
        keys = jax.random.split(key, len(sizes) - 1)
        self.layers = tuple(eqx.nn.Linear(a, b, key=k) for a, b, k in zip(sizes[:-1], sizes[1:], keys))
        self.activation = activation


def _mlp_apply(m, x, register=False):
    for i, layer in enumerate(m.layers):
        y = jax.vmap(layer)(x)
        if register:
            y = register_dense(y, x, layer.weight, layer.bias, weight_layout="out_in")
        x = m.activation(y) if i < len(m.layers) - 1 else y
    return x


@pytest.mark.parametrize("activation", [jnp.tanh, jax.nn.relu, jax.nn.gelu, jax.nn.softplus])
def test_mlp(getkey, activation):
    model = _MLP((3, 5, 4, 2), activation, getkey())
    regs = _check_against_twin(
        _mlp_apply, lambda m, x: _mlp_apply(m, x, register=True), model, _batch(getkey, (6, 3), (6, 2))
    )
    assert [r[3] for r in regs] == ["linear_with_bias"] * 3


def test_eqx_mlp(getkey):
    model = eqx.nn.MLP(3, 2, 4, 2, activation=jax.nn.gelu, key=getkey())

    def twin(m, x):
        for i, layer in enumerate(m.layers):
            y = register_dense(jax.vmap(layer)(x), x, layer.weight, layer.bias, weight_layout="out_in")
            x = m.activation(y) if i < len(m.layers) - 1 else y
        return x

    _check_against_twin(lambda m, x: jax.vmap(m)(x), twin, model, _batch(getkey, (5, 3), (5, 2)))


class _NormMLP(eqx.Module):
    lin1: eqx.nn.Linear
    norm: eqx.nn.LayerNorm
    lin2: eqx.nn.Linear

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.lin1 = eqx.nn.Linear(3, 4, key=k1)
        self.norm = eqx.nn.LayerNorm(4)
        self.lin2 = eqx.nn.Linear(4, 2, key=k2)


def test_mlp_with_layer_norm(getkey):
    model = _NormMLP(getkey())
    model = eqx.tree_at(lambda m: (m.norm.weight, m.norm.bias), model, (jnp.linspace(0.5, 2, 4), jnp.arange(4.0)))

    def apply(m, x):
        return jax.vmap(m.lin2)(jnp.tanh(jax.vmap(m.norm)(jax.vmap(m.lin1)(x))))

    def twin(m, x):
        h = register_dense(jax.vmap(m.lin1)(x), x, m.lin1.weight, m.lin1.bias, weight_layout="out_in")
        xhat = jax.vmap(eqx.nn.LayerNorm(4, use_weight=False, use_bias=False))(h)
        h = register_scale_and_shift(m.norm.weight * xhat + m.norm.bias, xhat, m.norm.weight, m.norm.bias)
        h = jnp.tanh(h)
        return register_dense(jax.vmap(m.lin2)(h), h, m.lin2.weight, m.lin2.bias, weight_layout="out_in")

    regs = _check_against_twin(apply, twin, model, _batch(getkey, (6, 3), (6, 2)))
    assert sorted(r[3] for r in regs) == ["linear_with_bias", "linear_with_bias", "scale_and_shift"]


class _CNN(eqx.Module):
    conv: eqx.nn.Conv2d
    conv2: eqx.nn.Conv2d
    lin: eqx.nn.Linear

    def __init__(self, key):
        k1, k2, k3 = jax.random.split(key, 3)
        self.conv = eqx.nn.Conv2d(2, 3, 3, padding=1, key=k1)
        self.conv2 = eqx.nn.Conv2d(3, 4, (2, 3), stride=(1, 2), use_bias=False, key=k2)
        self.lin = eqx.nn.Linear(4 * 2 * 1, 2, key=k3)


def test_cnn(getkey):
    model = _CNN(getkey())
    pool = eqx.nn.MaxPool2d(2, 2)

    def apply(m, x):
        h = jax.vmap(pool)(jax.nn.relu(jax.vmap(m.conv)(x)))
        h = jax.vmap(eqx.nn.AvgPool2d((2, 1), 1))(jnp.tanh(jax.vmap(m.conv2)(h)))
        return jax.vmap(m.lin)(h.reshape(h.shape[0], -1))

    def twin(m, x):
        y = register_conv2d(jax.vmap(m.conv)(x), x, m.conv.weight, m.conv.bias, padding=((1, 1), (1, 1)))
        h = jax.vmap(pool)(jax.nn.relu(y))
        y = register_conv2d(jax.vmap(m.conv2)(h), h, m.conv2.weight, window_strides=(1, 2))
        h = jax.vmap(eqx.nn.AvgPool2d((2, 1), 1))(jnp.tanh(y))
        h = h.reshape(h.shape[0], -1)
        return register_dense(jax.vmap(m.lin)(h), h, m.lin.weight, m.lin.bias, weight_layout="out_in")

    regs = _check_against_twin(apply, twin, model, _batch(getkey, (3, 2, 8, 8), (3, 2)))
    assert sorted(r[3] for r in regs) == ["conv2d_no_bias", "conv2d_with_bias", "linear_with_bias"]


class _GroupNormCNN(eqx.Module):
    conv: eqx.nn.Conv2d
    norm: eqx.nn.GroupNorm
    lin: eqx.nn.Linear

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.conv = eqx.nn.Conv2d(2, 4, 3, padding=1, key=k1)
        self.norm = eqx.nn.GroupNorm(2, 4)
        self.lin = eqx.nn.Linear(4 * 3 * 2, 2, key=k2)


def test_group_norm_affine_is_a_scale_and_shift_layer(getkey):
    model = _GroupNormCNN(getkey())
    model = eqx.tree_at(
        lambda m: (m.norm.weight, m.norm.bias), model, (jnp.linspace(0.5, 2.0, 4), jnp.linspace(-1.0, 1.0, 4))
    )

    def apply(m, x):
        h = jnp.tanh(jax.vmap(m.norm)(jax.vmap(m.conv)(x)))
        return jax.vmap(m.lin)(h.reshape(h.shape[0], -1))

    def twin(m, x):
        y = register_conv2d(jax.vmap(m.conv)(x), x, m.conv.weight, m.conv.bias, padding=((1, 1), (1, 1)))
        xhat = jax.vmap(eqx.nn.GroupNorm(2, 4, channelwise_affine=False))(y)

        def affine(v):
            # Registered per example, with the parameters along the channel axis (axis 0).
            w, b = m.norm.weight[:, None, None], m.norm.bias[:, None, None]
            return register_scale_and_shift(w * v + b, v, m.norm.weight, m.norm.bias, param_axes=(0,))

        h = jnp.tanh(jax.vmap(affine)(xhat)).reshape(x.shape[0], -1)
        return register_dense(jax.vmap(m.lin)(h), h, m.lin.weight, m.lin.bias, weight_layout="out_in")

    regs = _check_against_twin(apply, twin, model, _batch(getkey, (3, 2, 3, 2), (3, 2)))
    (norm,) = [r for r in regs if r[1] == ("norm.weight", "norm.bias")]
    assert norm[0] == "scale_and_shift" and norm[3] == "leading_scale_and_shift" and norm[4] == ((3, 4, 3, 2),)
    assert dict(norm[2]) == {"has_scale": True, "has_shift": True, "param_axes": (-3,)}


def test_parameter_reshaped_against_another_axis_is_not_a_leading_scale():
    # `p.reshape(1, 4)` has the rank of the channel form `p.reshape(4, 1)` but aligns `p` with the
    # last axis; the x shape (3, 4, 4) would let it pass the shape check on the wrong axis. It is
    # the trailing scale `x * p` (the reshape only inserts a unit axis, as `jnp` broadcasting does).
    params = (jnp.linspace(0.5, 1.5, 4),)
    x = jnp.linspace(-1.0, 1.0, 48).reshape(3, 4, 4)
    apply = lambda p, x: x * p[0].reshape(1, 4)
    tagged = auto_register_tags(_loss_of(apply), (params, x))
    regs = _registrations(tagged, (params, x))
    assert [(t, paths, dict(meta)["param_axes"], origin) for t, paths, meta, origin, _, _ in regs] == [
        ("scale_and_shift", ("[0]",), None, "scale_only")
    ]
    _check_value_and_grad(_loss_of(apply), tagged, params, x)


class _ScanMLP(eqx.Module):
    first: eqx.nn.Linear
    hidden: eqx.nn.Linear
    last: eqx.nn.Linear

    def __init__(self, key):
        k1, k2, k3 = jax.random.split(key, 3)
        self.first = eqx.nn.Linear(3, 4, key=k1)
        self.hidden = eqx.filter_vmap(lambda k: eqx.nn.Linear(4, 4, key=k))(jax.random.split(k2, 3))
        self.last = eqx.nn.Linear(4, 2, key=k3)


def _scan_apply(m, x, register=False):
    """First layer, then the stacked hidden layers applied by a checkpointed scan, then the last layer."""

    def dense(layer, h):
        y = jax.vmap(layer)(h)
        return register_dense(y, h, layer.weight, layer.bias, weight_layout="out_in") if register else y

    dynamic, static = eqx.partition(m.hidden, eqx.is_array)

    def body(h, layer_params):
        return jnp.tanh(dense(eqx.combine(layer_params, static), h)), None

    h = jnp.tanh(dense(m.first, x))
    h = jax.checkpoint(lambda h, d: lax.scan(body, h, d)[0])(h, dynamic)
    return dense(m.last, h)


def test_scan_over_stacked_layers(getkey):
    model = _ScanMLP(getkey())
    regs = _check_against_twin(
        _scan_apply, lambda m, x: _scan_apply(m, x, register=True), model, _batch(getkey, (5, 3), (5, 2))
    )
    stacked = [r for r in regs if r[1] == ("hidden.weight", "hidden.bias")]
    assert len(stacked) == 1 and dict(stacked[0][2]) == {"has_bias": True, "weight_layout": "out_in"}
    assert stacked[0][4] == ((5, 4),)


def _l2(params):
    return 0.5 * 1e-3 * sum(jnp.sum(p**2) for p in jax.tree.leaves(eqx.filter(params, eqx.is_inexact_array)))


@pytest.mark.parametrize("jit", [False, True])
def test_regulariser_and_metrics_are_not_uses(getkey, jit):
    # kfac-jax's convention puts `l2 / 2 * sum(theta ** 2)` in the loss; with a metric computed
    # from the first layer (before the model, so that it is the first candidate match), it must
    # register the same layers as the hand-registered twin without either.
    model = _MLP((3, 5, 4, 2), jnp.tanh, getkey())
    batch = _batch(getkey, (6, 3), (6, 2))

    def loss(m, b):
        x, t = b
        metric = jnp.mean(jax.vmap(m.layers[0])(2.0 * x))
        y = register_squared_error_loss(_mlp_apply(m, x))
        return jnp.sum((y - t) ** 2) + _l2(m), metric

    def twin_loss(m, b):
        x, t = b
        return jnp.sum((register_squared_error_loss(_mlp_apply(m, x, register=True)) - t) ** 2)

    loss = jax.jit(loss) if jit else loss
    tagged = auto_register_tags(loss, (model, batch))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        auto = _registrations(tagged, (model, batch))
    manual = _registrations(twin_loss, (model, batch))
    assert len(_layers(manual)) == 3
    assert _layers(auto) == _layers(manual) and not _generic(auto)
    assert [r[3] for r in auto] == ["linear_with_bias"] * 3
    # (Under one `jit`, not the untagged loss op by op: 90 compilations -> 3.)
    _check_value_and_grad(loss, tagged, model, batch, has_aux=True)


def test_shard_map_with_varying_axis_checks(getkey):
    # With `check_vma=True` (the default) JAX puts `pvary` on the replicated parameters inside
    # the map; the tags must still record the parameter leaves themselves.
    model = _NormMLP(getkey())
    x, t = _batch(getkey, (8, 3), (8, 2))
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]), ("d",))
    spec = jax.sharding.PartitionSpec

    def loss(m, b):
        x, t = b
        y = jax.vmap(m.lin2)(jnp.tanh(jax.vmap(m.norm)(jax.vmap(m.lin1)(x))))
        return jnp.sum((register_squared_error_loss(y) - t) ** 2)

    def sharded(f):
        def per_device(m, x, t):
            value, grad = jax.value_and_grad(f)(m, (x, t))
            return lax.psum(value, "d"), grad

        return jax.shard_map(per_device, mesh=mesh, in_specs=(spec(), spec("d"), spec("d")), out_specs=(spec(), spec()))

    tagged = auto_register_tags(loss, (model, (x, t)))
    (eqn,) = [e for e in jax.make_jaxpr(sharded(loss))(model, x, t).jaxpr.eqns if e.primitive.name == "shard_map"]
    assert any(e.primitive.name == "pvary" for e in eqn.params["jaxpr"].eqns)
    inside = _registrations(sharded(tagged), (model, x, t))
    outside = _registrations(tagged, (model, (x[:2], t[:2])))
    assert _layers(inside) == _layers(outside) and len(_layers(inside)) == 3 and not _generic(inside)
    assert [r[3] for r in inside] == [r[3] for r in outside]
    # The unsharded reference under the same `jit` as the sharded run (one program, not dozens of
    # eager operations).
    both = jax.jit(lambda m, x, t: (jax.value_and_grad(loss)(m, (x, t)), sharded(tagged)(m, x, t)))
    _assert_same_value_and_grad(*both(model, x, t))


def test_mixed_manual_and_automatic(getkey):
    model = _MLP((3, 5, 4, 2), jnp.tanh, getkey())

    def apply(m, x):
        # The middle layer is registered by hand; the others are left to the matcher.
        for i, layer in enumerate(m.layers):
            y = jax.vmap(layer)(x)
            if i == 1:
                y = register_dense(y, x, layer.weight, layer.bias, weight_layout="out_in")
            x = jnp.tanh(y) if i < 2 else y
        return x

    regs = _check_against_twin(apply, lambda m, x: _mlp_apply(m, x, register=True), model, _batch(getkey, (4, 3), (4, 2)), n_manual=1)
    assert sorted(r[3] for r in regs) == ["linear_with_bias", "linear_with_bias", "manual"]


def _loss_of(apply):
    def loss(p, x):
        return jnp.sum(register_squared_error_loss(apply(p, x)) ** 2)

    return loss


_LAYER_FORMS = [
        ("linear_no_bias", eqx.nn.Linear(3, 2, use_bias=False, key=jax.random.key(1)), (5, 3),
         lambda m, x: jax.vmap(m)(x), [("dense", "linear_no_bias", ((5, 3),), {"has_bias": False, "weight_layout": "out_in"})]),
        ("scalar_in", eqx.nn.Linear("scalar", 2, key=jax.random.key(1)), (5,),
         lambda m, x: jax.vmap(m)(x), [("dense", "linear_with_bias", ((5, 1),), {"has_bias": True, "weight_layout": "out_in"})]),
        ("scalar_out", eqx.nn.Linear(3, "scalar", key=jax.random.key(1)), (5, 3),
         lambda m, x: jax.vmap(m)(x)[:, None], [("dense", "linear_with_bias", ((5, 3),), {"has_bias": True, "weight_layout": "out_in"})]),
        ("nested_vmap", eqx.nn.Linear(3, 2, key=jax.random.key(1)), (4, 5, 3),
         lambda m, x: jax.vmap(jax.vmap(m))(x), [("dense", "linear_with_bias", ((4, 5, 3),), {"has_bias": True, "weight_layout": "out_in"})]),
        ("x_wT_b", (jnp.ones((2, 3)), jnp.ones(2)), (4, 5, 3),
         lambda p, x: x @ p[0].T + p[1], [("dense", "dense_out_in_with_bias", ((4, 5, 3),), {"has_bias": True, "weight_layout": "out_in"})]),
        ("x_w_b_jit", (jnp.ones((3, 2)), jnp.ones(2)), (5, 3),
         jax.jit(lambda p, x: x @ p[0] + p[1]), [("dense", "dense_in_out_with_bias", ((5, 3),), {"has_bias": True, "weight_layout": "in_out"})]),
        ("nhwc", (jnp.ones((3, 3, 3, 4)), jnp.ones(4)), (2, 6, 6, 3),
         lambda p, x: lax.conv_general_dilated(x, p[0], (2, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")) + p[1],
         [("conv2d", "conv2d_nhwc_with_bias", ((2, 6, 6, 3),), {"has_bias": True, "window_strides": (2, 1)})]),
        ("rms_norm", eqx.nn.RMSNorm(5), (2, 5),
         lambda m, x: jax.vmap(m)(x), [("scale_and_shift", "scale_and_shift", ((2, 5),), {"has_scale": True, "has_shift": True})]),
        ("scale_only", (jnp.ones((7, 5)),), (2, 7, 5),
         lambda p, x: p[0] * x, [("scale_and_shift", "scale_only", ((2, 7, 5),), {"has_scale": True, "has_shift": False, "param_axes": None})]),
        ("group_norm_nested_vmap", eqx.nn.GroupNorm(2, 4), (2, 3, 4, 5), lambda m, x: jax.vmap(jax.vmap(m))(x),
         [("scale_and_shift", "leading_scale_and_shift", ((2, 3, 4, 5),), {"has_scale": True, "has_shift": True, "param_axes": (-2,)})]),
        ("group_norm_unit_spatial", eqx.nn.GroupNorm(2, 4), (3, 4, 1, 1), lambda m, x: jax.vmap(m)(x),
         [("scale_and_shift", "leading_scale_and_shift", ((3, 4, 1, 1),), {"param_axes": (-3,)})]),
        # Channels only: the parameters lie along the trailing axis.
        ("group_norm_channels_only", eqx.nn.GroupNorm(2, 4), (3, 4), lambda m, x: jax.vmap(m)(x),
         [("scale_and_shift", "scale_and_shift", ((3, 4),), {"param_axes": None})]),
        # Not GroupNorm-specific: any parameter reshaped to (n, 1, ...) against a middle axis.
        ("channel_scale_only", (jnp.linspace(0.5, 1.5, 4),), (3, 4, 5),
         lambda p, x: x * p[0].reshape(4, 1), [("scale_and_shift", "leading_scale_only", ((3, 4, 5),), {"has_scale": True, "has_shift": False, "param_axes": (-2,)})]),
        ("channel_shift_only", (jnp.linspace(0.5, 1.5, 6).reshape(2, 3),), (3, 2, 3, 5),
         lambda p, x: x + p[0].reshape(2, 3, 1), [("scale_and_shift", "leading_shift_only", ((3, 2, 3, 5),), {"has_scale": False, "has_shift": True, "param_axes": (-3, -2)})]),
]


@pytest.mark.parametrize("name, params, x_shape, apply, expected", _LAYER_FORMS, ids=[c[0] for c in _LAYER_FORMS])
def test_layer_forms(name, params, x_shape, apply, expected):
    x = jnp.linspace(-1.0, 1.0, int(np.prod(x_shape))).reshape(x_shape)
    loss = _loss_of(apply)
    tagged = auto_register_tags(loss, (params, x))
    regs = _registrations(tagged, (params, x))
    got = [(t, origin, ins) for t, _, _, origin, ins, _ in regs]
    assert got == [(t, origin, ins) for t, origin, ins, _ in expected]
    for (_, _, meta, *_), (*_, expected_meta) in zip(regs, expected):
        assert expected_meta.items() <= dict(meta).items()
    _check_value_and_grad(loss, tagged, params, x)


def test_intermediate_used_twice_and_scalar_bias():
    # `h` is used outside `h + b`, so no dense-with-bias layer; a bias of shape (1,) is no dense bias.
    params = (jnp.arange(6.0).reshape(3, 2) / 6, jnp.array([0.5, -0.5]), jnp.array([0.3]), jnp.ones((2, 2)))

    def apply(p, x):
        h = x @ p[0]
        y = (h + p[1]) * h
        return y @ p[3] + p[2]

    x = jnp.linspace(-1.0, 1.0, 12).reshape(4, 3)
    tagged = auto_register_tags(_loss_of(apply), (params, x))
    regs = _registrations(tagged, (params, x))
    got = sorted((t, paths, origin) for t, paths, _, origin, _, _ in regs)
    assert got == [
        ("dense", ("[0]",), "dense_in_out_no_bias"),
        ("dense", ("[3]",), "dense_in_out_no_bias"),
        ("scale_and_shift", ("[1]",), "shift_only"),
        ("scale_and_shift", ("[2]",), "shift_only"),
    ]
    _check_value_and_grad(_loss_of(apply), tagged, params, x)


def test_weight_tying_gets_a_generic_tag_and_the_estimator_reports_it():
    params = (jnp.eye(3) + 0.1, jnp.ones(3))
    x = jnp.linspace(-1.0, 1.0, 12).reshape(4, 3)

    def apply(p, x):
        return jnp.tanh(x @ p[0] + p[1]) @ p[0].T

    tagged = auto_register_tags(_loss_of(apply), (params, x))
    regs = _registrations(tagged, (params, x))
    got = sorted((t, paths, origin) for t, paths, _, origin, _, _ in regs)
    assert got == [("generic", ("[0]",), "shared"), ("scale_and_shift", ("[1]",), "shift_only")]
    _check_value_and_grad(_loss_of(apply), tagged, params, x)
    # The estimator names the parameter and the reason, at the user's call.
    with pytest.warns(UserWarning, match=r"`\[0\]` \(shared\): it is used in 2 places .* \(`dot_general`, `transpose`\)") as record:
        BlockDiagonalCurvature(_loss_of(apply), (params, x))
    assert [w.filename for w in record] == [__file__]
    with pytest.raises(ValueError, match=r"`\[0\]` \(shared\)"):
        BlockDiagonalCurvature(_loss_of(apply), (params, x), on_unmatched="error")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        BlockDiagonalCurvature(_loss_of(apply), (params, x), on_unmatched="ignore")
    with pytest.raises(ValueError, match="on_unmatched must be one of"):
        BlockDiagonalCurvature(_loss_of(apply), (params, x), on_unmatched="raise")


def test_register_only_generic_and_patterns_to_skip(getkey):
    model = eqx.nn.Linear(3, 2, key=getkey())
    x = jnp.ones((4, 3))
    loss = _loss_of(lambda m, x: jax.vmap(m)(x))
    regs = _registrations(auto_register_tags(loss, (model, x), register_only_generic=True), (model, x))
    assert _generic(regs) == [(("bias",), "unregistered"), (("weight",), "unregistered")] and not _layers(regs)
    regs = _registrations(auto_register_tags(loss, (model, x), patterns_to_skip=("linear_with_bias",)), (model, x))
    assert sorted((r[1], r[3]) for r in regs) == [(("bias",), "shift_only"), (("weight",), "linear_no_bias")]
    with pytest.raises(ValueError, match=r"unknown patterns \['linear'\]"):
        auto_register_tags(loss, (model, x), patterns_to_skip=("linear",))
    with pytest.raises(ValueError, match="params_index"):
        auto_register_tags(loss, (model, x), params_index=2)


def test_user_pattern_for_a_new_layer():
    exp_scale_tag = LayerTag("exp_scale", num_inputs=1, num_outputs=1)
    pattern = GraphPattern(
        name="exp_scale",
        tag=exp_scale_tag,
        compute_func=lambda x, params: x * jnp.exp(params[0]),
        example_args=[(np.zeros((2, 3)), (np.zeros(3),)), (np.zeros((2, 4, 3)), (np.zeros(3),))],
        parameters_extractor_func=lambda eqns: {},
    )
    params = (jnp.array([0.1, 0.2, 0.3]), eqx.nn.Linear(3, 2, key=jax.random.key(0)))
    x = jnp.linspace(-1.0, 1.0, 24).reshape(2, 4, 3)
    loss = _loss_of(lambda p, x: jax.vmap(jax.vmap(p[1]))(x * jnp.exp(p[0])))
    tagged = auto_register_tags(loss, (params, x), graph_patterns=(pattern, *DEFAULT_GRAPH_PATTERNS))
    regs = _registrations(tagged, (params, x))
    got = sorted((t, paths, origin, ins) for t, paths, _, origin, ins, _ in regs)
    assert got == [
        ("dense", ("[1].weight", "[1].bias"), "linear_with_bias", ((2, 4, 3),)),
        ("exp_scale", ("[0]",), "exp_scale", ((2, 4, 3),)),
    ]
    _check_value_and_grad(loss, tagged, params, x)
