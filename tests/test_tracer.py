"""The jaxpr interpreter and the tracer, against plain JAX references on small models (internal on
purpose: `eval_jaxpr`, its hooks and the cached `trace` are what every estimator is built on)."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eqx_kfac._tracing.jaxpr_interpreter import JaxprHook, current_path, eval_jaxpr
from eqx_kfac import (
    CategoricalLogitsNegativeLogProbLoss,
    NormalMeanNegativeLogProbLoss,
    register_softmax_cross_entropy_loss,
    register_squared_error_loss,
)
from eqx_kfac import register_conv2d, register_dense, register_generic, register_scale_and_shift
from eqx_kfac import layer_tags_vjp, loss_tags_hvp, loss_tags_jvp, loss_tags_vjp
# The tracer's cached `trace` is internal (`eqx_kfac.trace` is the operators' trace).
from eqx_kfac._tracing.tracer import trace


def _close(a, b, rtol=1e-10):
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    assert len(la) == len(lb)
    for x, y in zip(la, lb):
        np.testing.assert_allclose(x, y, rtol=rtol, atol=1e-12)


# ------------------------------------------------------------------------------------------------
# The interpreter


@jax.custom_jvp
def _scaled_sin(x):
    return jnp.sin(x)


_scaled_sin.defjvp(lambda p, t: (_scaled_sin(p[0]), 2.0 * jnp.cos(p[0]) * t[0]))  # deliberately "wrong"


@jax.custom_vjp
def _triple(x):
    return 3.0 * x


_triple.defvjp(lambda x: (3.0 * x, None), lambda _, g: (5.0 * g,))  # deliberately "wrong"


def _nested(x):
    x = jax.jit(jnp.tanh)(x)
    x = eqx.filter_checkpoint(lambda y: jnp.exp(-y) * y)(x)
    x = _scaled_sin(_triple(x))
    carry, ys = jax.lax.scan(lambda c, a: (c * a + 1.0, jnp.sin(c + a)), x[0], x, reverse=True)
    return ys * carry


def test_eval_jaxpr_matches_function_and_custom_rules():
    x = jnp.linspace(0.1, 1.0, 4)
    closed = jax.make_jaxpr(_nested)(x)
    interp = lambda x: eval_jaxpr(closed, [x])[0]
    _close(interp(x), _nested(x))
    # Custom derivative rules are kept (the test rules are deliberately not the true derivatives).
    _close(jax.jacobian(interp)(x), jax.jacobian(_nested)(x))
    _close(jax.jit(jax.jacobian(interp))(x), jax.jacobian(_nested)(x))


def test_hook_replaces_inside_higher_order_equations():
    x = jnp.linspace(0.1, 1.0, 4)
    closed = jax.make_jaxpr(_nested)(x)
    seen = []

    def hook(eqn, invals):
        if eqn.primitive.name == "sin":
            seen.append(current_path())
            return [jnp.cos(invals[0])]
        return None

    def replaced(x):
        x = jax.jit(jnp.tanh)(x)
        x = jnp.exp(-x) * x
        x = _scaled_sin(_triple(x))  # a plain function hook keeps custom calls as they are
        carry, ys = jax.lax.scan(lambda c, a: (c * a + 1.0, jnp.cos(c + a)), x[0], x, reverse=True)
        return ys * carry

    _close(eval_jaxpr(closed, [x], hook)[0], replaced(x))
    assert seen and all(len(p) == 2 for p in seen)  # only the sin inside the scan body, one level down
    scan_index = [e.primitive.name for e in closed.jaxpr.eqns].index("scan")
    assert all(p[0] == scan_index for p in seen)


def test_descends_into_custom_jvp_when_hook_matches():
    x = jnp.linspace(0.1, 1.0, 3)
    closed = jax.make_jaxpr(_scaled_sin)(x)

    class SinHook(JaxprHook):
        def matches(self, eqn):
            return eqn.primitive.name == "sin"

        def __call__(self, eqn, invals):
            return [jnp.cos(invals[0])] if eqn.primitive.name == "sin" else None

    _close(eval_jaxpr(closed, [x], SinHook())[0], jnp.cos(x))
    # Inlined: the derivative is now the ordinary one of cos.
    _close(jax.grad(lambda x: eval_jaxpr(closed, [x], SinHook())[0].sum())(x), -jnp.sin(x))


def test_scan_extra_inputs_and_outputs():
    xs = jnp.arange(5.0)
    closed = jax.make_jaxpr(lambda xs: jax.lax.scan(lambda c, a: (c + jnp.sin(a), c), 0.0, xs))(xs)
    extra = jnp.arange(5.0) * 10.0

    class Hook(JaxprHook):
        def __init__(self):
            self.frames, self.result = [], None

        def enter_scan(self, eqn):
            return extra

        def begin_iteration(self, x):
            self.frames.append({"x": x})

        def __call__(self, eqn, invals):
            if eqn.primitive.name == "sin":
                self.frames[-1]["seen"] = invals[0]
                return [jnp.sin(invals[0]) + self.frames[-1]["x"]]
            return None

        def end_iteration(self):
            return self.frames.pop()["seen"]

        def exit_scan(self, eqn, ys):
            self.result = ys

    hook = Hook()
    carry, ys = eval_jaxpr(closed, [xs], hook)
    _close(hook.result, xs)
    _close(carry, jnp.sum(jnp.sin(xs) + extra))
    _close(ys, jnp.concatenate([jnp.zeros(1), jnp.cumsum(jnp.sin(xs) + extra)[:-1]]))


# ------------------------------------------------------------------------------------------------
# The tracer


def _init(getkey, d_in=3, d_h=4, d_out=2):
    return {
        "w1": jax.random.normal(getkey(), (d_h, d_in)),
        "b1": jax.random.normal(getkey(), (d_h,)),
        "s": jax.random.normal(getkey(), (d_h,)),
        "t": jax.random.normal(getkey(), (d_h,)),
        "w2": jax.random.normal(getkey(), (d_h, d_out)),
        "temp": jnp.asarray(1.3),
        "step": jnp.asarray(3),  # integer leaf: not a parameter
    }


def _forward(params, x, e=None):
    """Reference forward pass with explicit output perturbations `e` (batched), no tags."""
    e = e or (0.0, 0.0, 0.0)
    h = x @ params["w1"].T + params["b1"] + e[0]
    z = h * params["s"] + params["t"] + e[1]
    y = jnp.tanh(z) @ params["w2"] + e[2]
    return y * params["temp"], h, z


def _loss_fn(params, batch):
    """Per-example tagged model (the Equinox way), two registered losses."""
    x, t, labels = batch

    def per_example(x):
        h = register_dense(params["w1"] @ x + params["b1"], x, params["w1"], params["b1"])
        z = register_scale_and_shift(h * params["s"] + params["t"], h, params["s"], params["t"])
        a = jnp.tanh(z)
        return register_dense(a @ params["w2"], a, params["w2"])

    y = jax.vmap(per_example)(x) * params["temp"]
    y1 = register_squared_error_loss(y, t)
    y2 = register_softmax_cross_entropy_loss(y, labels)
    return jnp.mean(jnp.sum((y1 - t) ** 2, -1)) + jnp.mean(jax.nn.logsumexp(y2, -1))


def _batch(getkey, n=6):
    return (
        jax.random.normal(getkey(), (n, 3)),
        jax.random.normal(getkey(), (n, 2)),
        jax.random.randint(getkey(), (n,), 0, 2),
    )


def _ref_losses(params, batch):
    x, t, labels = batch
    y = _forward(params, x)[0]
    return (
        NormalMeanNegativeLogProbLoss(y, t, variance=0.5, normalize_log_prob=False),
        CategoricalLogitsNegativeLogProbLoss(y, labels),
    )


def _filter(params):
    return eqx.filter(params, eqx.is_inexact_array)


def test_specs(getkey):
    params, batch = _init(getkey), _batch(getkey)
    traced = trace(_loss_fn, (params, batch))
    assert trace(_loss_fn, (params, batch)) is traced  # cached
    specs = traced.layer_specs
    assert [(s.tag, s.param_paths) for s in specs] == [
        ("dense", ("['w1']", "['b1']")),
        ("scale_and_shift", ("['s']", "['t']")),
        ("dense", ("['w2']",)),
        ("generic", ("['temp']",)),
    ]
    assert traced.param_paths == ("['b1']", "['s']", "['t']", "['temp']", "['w1']", "['w2']")
    assert specs[0].param_indices == (4, 0) and specs[0].input_shapes == ((6, 3),)
    assert specs[0].output_shapes == ((6, 4),) and specs[0].get("weight_layout") == "out_in"
    assert specs[2].get("weight_layout") == "in_out" and specs[3].origin == "unregistered"
    assert traced.loss_classes == (NormalMeanNegativeLogProbLoss, CategoricalLogitsNegativeLogProbLoss)
    # ShapeDtypeStructs trace to the same specs.
    sds = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), (params, batch))
    assert trace(_loss_fn, sds).layer_specs == specs


def test_loss_tags_vjp_jvp_hvp(getkey):
    params, batch = _init(getkey), _batch(getkey)
    fparams = _filter(params)
    cts = tuple((jax.random.normal(getkey(), (6, 2)),) for _ in range(2))
    tangent = jax.tree.map(lambda a: jax.random.normal(getkey(), a.shape), fparams)

    # One compilation (eager op-by-op evaluation is slow); ours first, the references second.
    @jax.jit
    def compare(params, batch, cts, tangent):
        ref_inputs = lambda p: tuple(l.inputs for l in _ref_losses(eqx.combine(p, params), batch))
        total = lambda p: sum(jnp.sum(l.evaluate()) for l in _ref_losses(eqx.combine(p, params), batch))
        losses, vjp = loss_tags_vjp(_loss_fn)((params, batch))
        _, tangents = loss_tags_jvp(_loss_fn)((params, batch), tangent)
        hvp, _ = loss_tags_hvp(_loss_fn)((params, batch), tangent)
        ours = (tuple(l.inputs for l in losses), vjp(cts), tangents, hvp)
        refs = (
            ref_inputs(fparams),
            jax.vjp(ref_inputs, fparams)[1](cts)[0],
            jax.jvp(ref_inputs, (fparams,), (tangent,))[1],
            jax.jvp(jax.grad(total), (fparams,), (tangent,))[1],
        )
        return ours, refs

    ours, refs = compare(params, batch, cts, tangent)
    _close(ours, refs)
    assert jax.tree.structure(ours[3]) == jax.tree.structure(fparams)


def _ref_layer_vjp(params, batch, cts):
    x = batch[0]

    def f(p, e):
        return _forward(eqx.combine(p, params), x, e)[0]

    e = (jnp.zeros((6, 4)), jnp.zeros((6, 4)), jnp.zeros((6, 2)))
    _, vjp = jax.vjp(f, _filter(params), e)
    gp, ge = vjp(cts)
    return gp, ge


def test_layer_tags_vjp(getkey):
    params, batch = _init(getkey), _batch(getkey)
    losses, data, vjp = layer_tags_vjp(_loss_fn)((params, batch))
    y, h, z = _forward(params, batch[0])
    _close([d.inputs for d in data[:3]], [(batch[0],), (h,), (jnp.tanh(z),)])
    _close([d.outputs for d in data[:3]], [(h,), (z,), (y / params["temp"],)])
    _close([d.params for d in data], [(params["w1"], params["b1"]), (params["s"], params["t"]), (params["w2"],), (params["temp"],)])
    cts = (jax.random.normal(getkey(), (6, 2)),), (jax.random.normal(getkey(), (6, 2)),)
    result = vjp(cts)
    # Both losses take the same predictions, so their cotangents add.
    gp, ge = _ref_layer_vjp(params, batch, cts[0][0] + cts[1][0])
    expected = [
        ((ge[0],), (gp["w1"], gp["b1"])),
        ((ge[1],), (gp["s"], gp["t"])),
        ((ge[2],), (gp["w2"],)),
        ((), (gp["temp"],)),
    ]
    _close(result, expected)
    # jit-compatible, and vmappable over loss-space vectors as the estimators use it.
    jitted = jax.jit(lambda a, c: layer_tags_vjp(_loss_fn)(a)[2](c))((params, batch), cts)
    _close(jitted, expected)
    stacked = jax.tree.map(lambda a: jnp.stack([a, 2 * a]), cts)
    batched = jax.vmap(layer_tags_vjp(_loss_fn)((params, batch))[2])(stacked)
    _close(jax.tree.map(lambda a: a[1], batched), jax.tree.map(lambda a: 2 * a, expected))


def test_batch_split_recombines(getkey):
    params, batch = _init(getkey), _batch(getkey)
    cts = (jax.random.normal(getkey(), (6, 2)),), (jax.random.normal(getkey(), (6, 2)),)
    full = layer_tags_vjp(_loss_fn)((params, batch))
    halves = [
        layer_tags_vjp(_loss_fn)((params, jax.tree.map(lambda a: a[sl], batch)))
        for sl in (slice(0, 3), slice(3, 6))
    ]
    full_t = full[2](cts)
    half_t = [h[2](jax.tree.map(lambda a: a[sl], cts)) for h, sl in zip(halves, (slice(0, 3), slice(3, 6)))]
    for k in range(3):
        _close(full[1][k].inputs, jax.tree.map(lambda a, b: jnp.concatenate([a, b]), halves[0][1][k].inputs, halves[1][1][k].inputs))
        _close(full_t[k][0], jax.tree.map(lambda a, b: jnp.concatenate([a, b]), half_t[0][k][0], half_t[1][k][0]))
    for k in range(4):
        _close(full_t[k][1], jax.tree.map(jnp.add, half_t[0][k][1], half_t[1][k][1]))


class _Stacked(eqx.Module):
    w: jax.Array  # (L, d, d)
    b: jax.Array  # (L, d)
    head: jax.Array  # (d, 2)


def _scan_loss(model, batch, tagged=True, e=None):
    x, t = batch

    def body(h, wbe):
        w, b, pert = wbe
        y = h @ w + b
        if tagged:
            y = register_dense(y, h, w, b)
        return jnp.tanh(y + pert), None

    pert = jnp.zeros((model.w.shape[0],) + x.shape) if e is None else e
    h, _ = jax.lax.scan(body, x, (model.w, model.b, pert))
    # The head's tag sits inside a checkpointed function.
    head = lambda h: register_dense(h @ model.head, h, model.head) if tagged else h @ model.head
    y = eqx.filter_checkpoint(head)(h)
    if tagged:
        y = register_squared_error_loss(y, t)
    return y


def test_scan_over_stacked_layers(getkey):
    model = _Stacked(
        jax.random.normal(getkey(), (3, 4, 4)) * 0.5, jax.random.normal(getkey(), (3, 4)), jax.random.normal(getkey(), (4, 2))
    )
    batch = (jax.random.normal(getkey(), (5, 4)), jax.random.normal(getkey(), (5, 2)))
    specs = trace(_scan_loss, (model, batch)).layer_specs
    assert [(s.param_paths, s.stack_size) for s in specs] == [(("w", "b"), 3), (("head",), None)]
    assert specs[0].param_shapes == ((4, 4), (4,)) and specs[0].input_shapes == ((5, 4),)
    losses, data, vjp = layer_tags_vjp(_scan_loss)((model, batch))
    ct = jax.random.normal(getkey(), (5, 2))
    result = vjp(((ct,),))

    def ref(m, e):
        return _scan_loss(m, batch, tagged=False, e=e)

    e = jnp.zeros((3, 5, 4))
    _, ref_vjp = jax.vjp(ref, model, e)
    gm, ge = ref_vjp(ct)
    _close(result[0], ((ge,), (gm.w, gm.b)))
    assert data[0].inputs[0].shape == (3, 5, 4) and data[0].outputs[0].shape == (3, 5, 4)
    _close(data[0].inputs[0][0], batch[0])
    _close(result[1][1], (gm.head,))


def test_no_loss_error(getkey):
    params = _init(getkey)
    with pytest.raises(ValueError, match=r"No loss is registered.*register_\*_loss"):
        trace(lambda p, x: jnp.sum(x @ p["w2"]), (params, jnp.ones((2, 4))))


def _single(w, x, body):
    return register_squared_error_loss(body(w, x), jnp.zeros(x.shape[:1] + (w["w"].shape[1],)))


def test_claimed_twice_error(getkey):
    w = {"w": jax.random.normal(getkey(), (3, 3))}

    def body(w, x):
        h = register_dense(x @ w["w"], x, w["w"])
        return register_dense(h @ w["w"], h, w["w"])

    with pytest.raises(ValueError, match=r"`\['w'\]` is claimed by two layer tags: dense layer #0.*dense layer #1"):
        trace(lambda w, x: _single(w, x, body), (w, jnp.ones((2, 3))))


def test_weight_tying_error(getkey):
    w = {"w": jax.random.normal(getkey(), (3, 3))}

    def body(w, x):
        h = jnp.tanh(x @ w["w"])  # the same weight, unregistered
        return register_dense(h @ w["w"], h, w["w"])

    with pytest.raises(ValueError, match=r"`\['w'\]` of dense layer #0.*also affects the loss outside"):
        trace(lambda w, x: _single(w, x, body), (w, jnp.ones((2, 3))))

    def unused_return(w, x):
        y = x @ w["w"]
        register_dense(y, x, w["w"])
        return y

    with pytest.raises(ValueError, match="value returned by its registration"):
        trace(lambda w, x: _single(w, x, unused_return), (w, jnp.ones((2, 3))))


def test_tag_param_not_a_leaf_error(getkey):
    w = {"w": jax.random.normal(getkey(), (3, 2))}
    with pytest.raises(ValueError, match="Parameter #0 of the dense tag .* not a parameter leaf"):
        trace(lambda w, x: _single(w, x, lambda w, x: register_dense(x @ w["w"], x, 2 * w["w"])), (w, jnp.ones((2, 3))))


def test_weight_used_at_every_scan_step_is_one_repeated_layer(getkey):
    w = {"w": jax.random.normal(getkey(), (3, 3))}

    def body(w, x):
        step = lambda h, _: (register_dense(h @ w["w"], h, w["w"]), None)
        return jax.lax.scan(step, x, None, length=4)[0]

    (spec,) = trace(lambda w, x: _single(w, x, body), (w, jnp.ones((2, 3)))).layer_specs
    # The steps sit after the batch axis, like sequence positions.
    assert (spec.repeat_size, spec.stack_size) == (4, None)
    assert spec.input_shapes == ((2, 4, 3),) and spec.output_shapes == ((2, 4, 3),)


def test_scan_layer_errors(getkey):
    w = {"w": jax.random.normal(getkey(), (4, 3, 3)), "b": jnp.zeros(3)}

    def mixed(w, x):
        step = lambda h, wi: (register_dense(h @ wi + w["b"], h, wi, w["b"]), None)
        return jax.lax.scan(step, x, w["w"])[0]

    with pytest.raises(ValueError, match=r"partly sliced from stacked leaves"):
        trace(lambda w, x: register_squared_error_loss(mixed(w, x)), (w, jnp.ones((2, 3))))

    kernel = {"k": jax.random.normal(getkey(), (2, 2, 3, 3))}

    def conv(k, x):
        def step(h, _):
            y = jax.lax.conv_general_dilated(h, k["k"], (1, 1), "SAME")
            return register_conv2d(y, h, k["k"], padding="SAME"), None

        return jax.lax.scan(step, x, None, length=2)[0].reshape(x.shape[0], -1)

    with pytest.raises(ValueError, match=r"convolution shared over time"):
        trace(lambda k, x: register_squared_error_loss(conv(k, x)), (kernel, jnp.ones((2, 2, 4, 4))))


def test_tag_inside_cond_error(getkey):
    w = {"w": jax.random.normal(getkey(), (3, 3))}

    def body(w, x):
        return jax.lax.cond(True, lambda x: register_dense(x @ w["w"], x, w["w"]), lambda x: x, x)

    with pytest.raises(ValueError, match="inside `cond`"):
        trace(lambda w, x: _single(w, x, body), (w, jnp.ones((2, 3))))


def test_generic_tag_claims_params(getkey):
    params = {"a": jax.random.normal(getkey(), (2,)), "b": jax.random.normal(getkey(), (2,))}

    def f(p, x):
        a, b = register_generic(p["a"], p["b"])
        return register_squared_error_loss(x * a + b, jnp.zeros_like(x))

    specs = trace(f, (params, jnp.ones((3, 2)))).layer_specs
    assert [(s.tag, s.param_paths, s.origin) for s in specs] == [("generic", ("['a']", "['b']"), "manual")]
    _, data, vjp = layer_tags_vjp(f)((params, jnp.ones((3, 2))))
    ct = jnp.ones((3, 2))
    _close(vjp(((ct,),)), [((), (jnp.full(2, 3.0), jnp.full(2, 3.0)))])


def test_param_used_in_other_layers_outputs_error(getkey):
    w = {"w": jax.random.normal(getkey(), (3, 3)), "v": jax.random.normal(getkey(), (3, 3))}

    def body(w, x):
        h = register_dense(x @ w["w"], x, w["w"])
        return register_dense(h @ w["v"] + x @ w["w"], h, w["v"])

    with pytest.raises(ValueError, match=r"`\['w'\]` of dense layer #0.*outputs of dense layer #1"):
        trace(lambda w, x: register_squared_error_loss(body(w, x), jnp.zeros((2, 3))), (w, jnp.ones((2, 3))))


def test_generic_tag_before_a_layer_is_not_mistaken_for_its_outputs(getkey):
    # A generic tag (no outputs) ahead of a layer used to shift the layer bookkeeping by one and
    # report the dense weight as used by the generic layer's outputs.
    p = {"w": jax.random.normal(getkey(), (3, 2)), "t": jnp.array(2.0)}

    def f(p, x):
        t = register_generic(p["t"])
        y = register_dense(x @ p["w"], x, p["w"]) * t
        return register_squared_error_loss(y, jnp.zeros((4, 2)))

    specs = trace(f, (p, jnp.ones((4, 3)))).layer_specs
    assert sorted((s.tag, s.param_paths) for s in specs) == [("dense", ("['w']",)), ("generic", ("['t']",))]


def test_abstract_and_concrete_arguments_share_one_trace():
    # The estimator traces `ShapeDtypeStruct`s, the loss checks and the step concrete arrays or
    # tracers of the same shapes: one trace serves them all (each trace of a large model costs
    # seconds). PRNG keys in the arguments are keyed by their extended dtype.
    def loss(params, key, batch):
        x, y = batch
        noise = 0.0 * jax.random.normal(key, x.shape)
        register_squared_error_loss(register_dense(x @ params["w"], x + noise, params["w"]), y)
        return jnp.sum(x)

    params = {"w": jnp.ones((3, 2))}
    args = (params, jax.random.key(0), (jnp.ones((4, 3)), jnp.zeros((4, 2))))
    abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), args)
    first = trace(loss, abstract)
    assert trace(loss, args) is first
    inside_jit = []
    jax.jit(lambda *a: inside_jit.append(trace(loss, a)) or 0.0)(*args)
    assert inside_jit[0] is first
