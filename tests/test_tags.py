"""Tag primitives: identity at run time under every transformation, visible in jaxprs, shape checks
(internal on purpose: the primitives under the public `register_*` functions)."""

import functools as ft

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P
from jaxtyping import Array

from eqx_kfac import (
    register_conv2d,
    register_dense,
    register_generic,
    register_scale_and_shift,
)
from eqx_kfac import (
    LayerTag,
    conv2d_tag,
    dense_tag,
    generic_tag,
    is_layer_tag_eqn,
    is_loss_tag_eqn,
    layer_tag_of,
    loss_tag,
    scale_and_shift_tag,
)


class ToyLoss(eqx.Module):
    """Squared error with a weight; the loss interface the tags need."""

    prediction: Array
    targets: Array
    weight: float = 1.0

    @property
    def inputs(self):
        return (self.prediction,)

    def with_inputs(self, inputs):
        return ToyLoss(inputs[0], self.targets, self.weight)

    def evaluate(self):
        return 0.5 * self.weight * jnp.sum((self.prediction - self.targets) ** 2)


def _model(params, x, tagged):
    """Per-example model: conv (NHWC) -> dense (out_in) -> scale/shift -> dense (in_out)."""
    conv_kw = dict(window_strides=(1, 1), padding="SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))
    xb = x[None]
    h = jax.lax.conv_general_dilated(xb, params["k"], **conv_kw) + params["kb"]
    if tagged:
        h = register_conv2d(h, xb, params["k"], params["kb"], **conv_kw)
    h = jnp.tanh(h).reshape(-1)
    y = params["w1"] @ h + params["b1"]
    if tagged:
        y = register_dense(y, h, params["w1"], params["b1"])
    z = y * params["s"] + params["t"]
    if tagged:
        z = register_scale_and_shift(z, y, params["s"], params["t"])
    out = jnp.sin(z) @ params["w2"]
    if tagged:
        out = register_dense(out, jnp.sin(z), params["w2"])
    extra = register_generic(params["g"]) if tagged else params["g"]
    return out * extra


def _loss(params, xs, targets, tagged=True):
    preds = jax.vmap(_model, (None, 0, None))(params, xs, tagged)
    loss = ToyLoss(preds, targets, 2.0)
    if tagged:
        (preds,) = loss_tag.bind(loss)
        loss = loss.with_inputs((preds,))
    return loss.evaluate()


def _setup(getkey, batch=4):
    params = {
        "k": jax.random.normal(getkey(), (3, 3, 2, 3)),
        "kb": jax.random.normal(getkey(), (3,)),
        "w1": jax.random.normal(getkey(), (5, 4 * 4 * 3)) * 0.2,
        "b1": jax.random.normal(getkey(), (5,)),
        "s": jax.random.normal(getkey(), (5,)),
        "t": jax.random.normal(getkey(), (5,)),
        "w2": jax.random.normal(getkey(), (5, 2)),
        "g": jax.random.normal(getkey(), ()),
    }
    xs = jax.random.normal(getkey(), (batch, 4, 4, 2))
    targets = jax.random.normal(getkey(), (batch, 2))
    return params, xs, targets


def _close(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(x, y, rtol=1e-10, atol=1e-12)


def test_identity_under_jit_grad_jvp_linearize(getkey):
    params, xs, targets = _setup(getkey)
    tagged = lambda p: _loss(p, xs, targets, True)
    plain = lambda p: _loss(p, xs, targets, False)
    tangent = jax.tree.map(lambda a: jnp.ones_like(a), params)

    # Every transformation is compiled (op by op, the Hessian alone took 20 s).
    @ft.partial(jax.jit, static_argnums=1)
    def transformed(p, f):
        y, lin = jax.linearize(f, p)
        return {
            "value": f(p),
            "grad": jax.grad(f)(p),
            "jvp": jax.jvp(f, (p,), (tangent,)),
            "linearize": (y, lin(tangent)),
            "hessian": jax.hessian(f)(p)["w2"]["w2"],
        }

    tagged_out = transformed(params, tagged)
    plain_out = transformed(params, plain)
    for name in tagged_out:
        _close(tagged_out[name], plain_out[name])
    # Plain (eager) evaluation of the tagged function too.
    _close(tagged(params), plain(params))


def test_identity_under_checkpoint_and_scan(getkey):
    params, xs, targets = _setup(getkey)

    def scanned(p, tagged):
        def body(carry, xt):
            x, t = xt
            f = eqx.filter_checkpoint(lambda q: _loss(q, x[None], t[None], tagged))
            return carry + f(p), None

        return jax.lax.scan(body, 0.0, (xs, targets))[0]

    _close(scanned(params, True), scanned(params, False))
    _close(jax.grad(scanned)(params, True), jax.grad(scanned)(params, False))
    _close(jax.jit(jax.grad(scanned), static_argnums=1)(params, True), jax.grad(scanned)(params, False))


def test_identity_under_shard_map(getkey):
    params, xs, targets = _setup(getkey, batch=8)
    mesh = Mesh(np.array(jax.devices()[:4]), ("d",))

    def sharded(tagged):
        def per_shard(p, x, t):
            value, grad = jax.value_and_grad(_loss)(p, x, t, tagged)
            # The gradient of replicated parameters is already summed over devices (the transpose
            # of shard_map's implicit broadcast of unvarying values is a psum).
            return jax.lax.psum(value, "d"), grad

        return jax.shard_map(per_shard, mesh=mesh, in_specs=(P(), P("d"), P("d")), out_specs=(P(), P()))

    _close(jax.jit(sharded(True))(params, xs, targets), jax.value_and_grad(_loss)(params, xs, targets, False))


def _tag_eqns(jaxpr):
    return [e for e in jaxpr.eqns if is_layer_tag_eqn(e) or is_loss_tag_eqn(e)]


def test_tags_appear_batched_in_jaxpr(getkey):
    params, xs, targets = _setup(getkey)
    jaxpr = jax.make_jaxpr(_loss)(params, xs, targets).jaxpr
    eqns = _tag_eqns(jaxpr)
    assert [e.primitive.name for e in eqns] == [
        "conv2d_tag", "dense_tag", "scale_and_shift_tag", "dense_tag", "generic_tag", "loss_tag",
    ]
    conv, dense1, ss, dense2, generic, loss = eqns
    assert layer_tag_of(conv) is conv2d_tag and layer_tag_of(ss) is scale_and_shift_tag
    assert layer_tag_of(generic) is generic_tag and layer_tag_of(loss) is None
    # Registered per example under vmap: the batch axis is in front of inputs and outputs
    # (merged into the conv's own batch axis).
    assert conv.invars[1].aval.shape == (4, 4, 4, 2) and conv.outvars[0].aval.shape == (4, 4, 4, 3)
    assert dense1.invars[1].aval.shape == (4, 48) and dense1.outvars[0].aval.shape == (4, 5)
    assert dense1.params["weight_layout"] == "out_in" and dense1.params["has_bias"]
    assert dense2.params["weight_layout"] == "in_out" and not dense2.params["has_bias"]
    assert conv.params["padding"] == ((1, 1), (1, 1)) and conv.params["origin"] == "manual"
    assert conv.params["dimension_numbers"] == jax.lax.conv_dimension_numbers(
        (1, 4, 4, 2), (3, 3, 2, 3), ("NHWC", "HWIO", "NHWC")
    )
    assert ss.params["has_scale"] and ss.params["has_shift"]
    outs, ins, ps = dense_tag.split(dense1.invars)
    assert len(outs) == 1 and len(ins) == 1 and len(ps) == 2


def test_nchw_conv_vmap_merges_batch_axis(getkey):
    x = jax.random.normal(getkey(), (3, 2, 6, 6))
    k = jax.random.normal(getkey(), (4, 2, 3, 3))

    def per_example(x):
        y = jax.lax.conv_general_dilated(x[None], k, (2, 2), "VALID")
        return register_conv2d(y, x[None], k, window_strides=(2, 2), padding="VALID")[0]

    jaxpr = jax.make_jaxpr(jax.vmap(per_example))(x).jaxpr
    (conv,) = _tag_eqns(jaxpr)
    assert conv.invars[1].aval.shape == (3, 2, 6, 6) and conv.outvars[0].aval.shape == (3, 4, 2, 2)
    ref = jax.lax.conv_general_dilated(x, k, (2, 2), "VALID")
    _close(jax.vmap(per_example)(x), ref)


def test_batched_params_drop_the_tag(getkey):
    w = jax.random.normal(getkey(), (3, 4, 2))
    x = jax.random.normal(getkey(), (3, 4))
    f = jax.vmap(lambda w, x: register_dense(x @ w, x, w))
    assert not _tag_eqns(jax.make_jaxpr(f)(w, x).jaxpr)
    _close(f(w, x), jnp.einsum("bi,bio->bo", x, w))


def test_register_generic_returns(getkey):
    a, b = jnp.ones(2), jnp.zeros(3)
    assert register_generic(a) is not None and register_generic(a).shape == (2,)
    out = register_generic(a, b)
    assert isinstance(out, tuple) and out[1].shape == (3,)
    _close(jax.grad(lambda a, b: jnp.sum(register_generic(a, b)[0] ** 2))(a, b), 2 * a)


def test_loss_from_eqn_roundtrip(getkey):
    pred, targ = jax.random.normal(getkey(), (4, 2)), jax.random.normal(getkey(), (4, 2))

    def f(pred):
        return loss_tag.bind(ToyLoss(pred, targ, 3.0))[0]

    closed = jax.make_jaxpr(f)(pred)
    (eqn,) = _tag_eqns(closed.jaxpr)
    assert eqn.params["num_inputs"] == 1
    new_pred = pred + 1.0
    loss = loss_tag.loss_from_eqn(eqn, [new_pred, pred, targ])
    assert isinstance(loss, ToyLoss) and loss.weight == 3.0
    _close((loss.prediction, loss.targets), (new_pred, targ))
    # A loss registered per example under vmap becomes one batched loss.
    per_example = jax.make_jaxpr(jax.vmap(lambda p, t: loss_tag.bind(ToyLoss(p, t))[0]))(pred, targ)
    (eqn,) = _tag_eqns(per_example.jaxpr)
    assert [v.aval.shape for v in eqn.invars] == [(4, 2)] * 3


def test_custom_layer_tag():
    tag = LayerTag("my_layer", num_inputs=2, num_outputs=1)
    x1, x2, w = jnp.ones(3), jnp.ones(3), jnp.ones(3)
    (y,) = tag.bind(x1 * w + x2, x1, x2, w, kind="test")
    jaxpr = jax.make_jaxpr(lambda w: tag.bind(x1 * w, x1, x2, w, kind="test"))(w).jaxpr
    assert layer_tag_of(jaxpr.eqns[-1]) is tag and jaxpr.eqns[-1].params == {"kind": "test"}
    assert tag.split((1, 2, 3, 4, 5)) == ((1,), (2, 3), (4, 5))
    _close(y, 2 * jnp.ones(3))


def test_dense_shape_errors():
    x, y = jnp.ones((4, 3)), jnp.ones((4, 2))
    with pytest.raises(ValueError, match=r"w: \(3, 3\).*\(in, out\) = \(3, 2\) or \(out, in\) = \(2, 3\)"):
        register_dense(y, x, jnp.ones((3, 3)))
    with pytest.raises(ValueError, match="same leading"):
        register_dense(jnp.ones((5, 2)), x, jnp.ones((3, 2)))
    with pytest.raises(ValueError, match=r"bias must have shape \(out,\) = \(2,\)"):
        register_dense(y, x, jnp.ones((3, 2)), jnp.ones(3))
    with pytest.raises(ValueError, match="weight_layout='out_in'"):
        register_dense(y, x, jnp.ones((3, 2)), weight_layout="out_in")


def test_square_dense_layout_override():
    x, w = jnp.ones((4, 3)), jnp.ones((3, 3))
    jaxpr = jax.make_jaxpr(lambda w: register_dense(x @ w.T, x, w, weight_layout="out_in"))(w).jaxpr
    assert jaxpr.eqns[-1].params["weight_layout"] == "out_in"


def test_conv_and_scale_shift_shape_errors():
    x, k = jnp.ones((2, 6, 6, 3)), jnp.ones((3, 3, 3, 4))
    dn = ("NHWC", "HWIO", "NHWC")
    with pytest.raises(ValueError, match=r"convolution gives shape \(2, 4, 4, 4\)"):
        register_conv2d(jnp.ones((2, 6, 6, 4)), x, k, padding="VALID", dimension_numbers=dn)
    with pytest.raises(ValueError, match="4 entries"):
        register_conv2d(jnp.ones((2, 6, 6, 4)), x, k, jnp.ones(3), padding="SAME", dimension_numbers=dn)
    with pytest.raises(TypeError, match="lhs_shape"):
        register_conv2d(jnp.ones((2, 6, 6, 4)), x, k, padding="SAME", dimension_numbers=dn, lhs_shape=None)
    with pytest.raises(ValueError, match="batch_group_count"):
        register_conv2d(jnp.ones((2, 6, 6, 4)), x, k, padding="SAME", dimension_numbers=dn, batch_group_count=2)
    with pytest.raises(ValueError, match="at least one"):
        register_scale_and_shift(jnp.ones(3), jnp.ones(3))
    with pytest.raises(ValueError, match="trailing dims"):
        register_scale_and_shift(jnp.ones((2, 3)), jnp.ones((2, 3)), jnp.ones(2))


def _channel_affine(x, s, t):
    """`x * s + t` with `s`, `t` of shape `(channels,)` along the first axis of `x`, as GroupNorm."""
    expand = (slice(None),) + (None,) * (x.ndim - 1)
    return x * s[expand] + t[expand]


def test_scale_and_shift_param_axes_are_kept_under_vmap(getkey):
    x = jax.random.normal(getkey(), (3, 4, 2, 5))
    s, t = jax.random.normal(getkey(), (4,)), jax.random.normal(getkey(), (4,))

    def per_example(s, t, x):
        return register_scale_and_shift(_channel_affine(x, s, t), x, s, t, param_axes=(0,))

    def on_batch(s, t, x):
        y = jax.vmap(_channel_affine, (0, None, None))(x, s, t)
        return register_scale_and_shift(y, x, s, t, param_axes=(1,))

    f = lambda s, t, x: jax.vmap(per_example, (None, None, 0))(s, t, x)
    metas = []
    for g in (f, on_batch):
        (ss,) = _tag_eqns(jax.make_jaxpr(g)(s, t, x).jaxpr)
        assert ss.invars[1].aval.shape == (3, 4, 2, 5) and ss.outvars[0].aval.shape == (3, 4, 2, 5)
        metas.append(ss.params)
    # Counted from the end, the axes are the same per example and on the batch.
    assert metas[0] == metas[1] and metas[0]["param_axes"] == (-3,)
    plain = lambda s, t, x: jnp.sum(jnp.sin(jax.vmap(_channel_affine, (0, None, None))(x, s, t)))
    tagged = lambda s, t, x: jnp.sum(jnp.sin(f(s, t, x)))
    _close(jax.value_and_grad(tagged, (0, 1))(s, t, x), jax.value_and_grad(plain, (0, 1))(s, t, x))


def test_scale_and_shift_param_axes_normalisation():
    x = jnp.ones((3, 4, 5))

    def params_of(**kw):
        scale = kw.pop("scale")
        jaxpr = jax.make_jaxpr(lambda s: register_scale_and_shift(x, x, s, **kw))(scale).jaxpr
        return jaxpr.eqns[-1].params

    # The trailing axes, however written, are the default.
    assert params_of(scale=jnp.ones(5))["param_axes"] is None
    assert params_of(scale=jnp.ones((4, 5)), param_axes=(1, -1))["param_axes"] is None
    assert params_of(scale=jnp.ones((4, 1)), param_axes=(1, 2))["param_axes"] is None
    assert params_of(scale=jnp.ones(4), param_axes=[1])["param_axes"] == (-2,)
    assert params_of(scale=jnp.ones((3, 1)), param_axes=(0, -2))["param_axes"] == (-3, -2)


def test_scale_and_shift_param_axes_errors():
    x = jnp.ones((3, 4, 5))
    with pytest.raises(ValueError, match=r"param_axes \(3,\) are out of range for x of rank 3"):
        register_scale_and_shift(x, x, jnp.ones(4), param_axes=(3,))
    with pytest.raises(ValueError, match="distinct axes of x in increasing order"):
        register_scale_and_shift(x, x, jnp.ones((5, 4)), param_axes=(2, 1))
    with pytest.raises(ValueError, match=r"one dimension per axis.*x has sizes \(4,\) on those axes"):
        register_scale_and_shift(x, x, jnp.ones(5), param_axes=(1,))
    with pytest.raises(ValueError, match="one dimension per axis"):
        register_scale_and_shift(x, x, jnp.ones(4), jnp.ones((4, 5)), param_axes=(1,))
    # Without param_axes, a channel-first parameter is rejected with a pointer to param_axes.
    with pytest.raises(ValueError, match="pass param_axes"):
        register_scale_and_shift(x, x, jnp.ones(4))
