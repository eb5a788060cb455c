"""How often `init` and the first step trace the user's loss (issue 49: `init` and the first step
no slower than kfac-jax's). Tracing a large loss (FermiNet's local energy) takes seconds each time.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh, PartitionSpec

import eqx_kfac
from eqx_kfac._tracing.derivative_rules import abstract_outputs, function_jaxpr


def _counted_loss(traces):
    def loss(model, batch):
        traces.append(None)
        x, y = batch
        logits = jax.vmap(model)(x)
        eqx_kfac.register_softmax_cross_entropy_loss(logits, y)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean(), logits

    return loss


def _problem():
    params = eqx.nn.MLP(4, 3, 8, 1, key=jax.random.key(0))
    batch = (jax.random.normal(jax.random.key(1), (16, 4)), jax.random.randint(jax.random.key(2), (16,), 0, 3))
    return params, batch


@pytest.mark.parametrize("devices", [None, eqx_kfac.MultiDevice()])
def test_init_traces_the_loss_once_and_the_step_once_more(devices):
    # The scalar check, the graph matcher and the tracer share one trace at init (there were
    # three); the step traces the value and gradient, and its curvature and batch size reuse the
    # estimator's trace (the exact products traced the loss once more). Under `MultiDevice`,
    # `init` traces under the step's `shard_map` on a device's share of the batch, so the step
    # reuses that trace too (it traced and matched the loss again under its mesh).
    traces = []
    optimizer = eqx_kfac.Optimizer(
        eqx.filter_value_and_grad(_counted_loss(traces), has_aux=True), value_func_has_aux=True,
        step_rule=eqx_kfac.MomentumStep(), damping_rule=eqx_kfac.GivenDamping(), devices=devices,
    )
    params, batch = _problem()
    state = optimizer.init(params, jax.random.key(3), batch)
    assert len(traces) == 1
    traces.clear()
    # Traced inside `eval_shape` (the step's program, not compiled).
    eqx.filter_eval_shape(
        lambda p, s: optimizer.step(p, s, jax.random.key(4), batch=batch, learning_rate=0.1, momentum=0.0, damping=1e-2),
        params, state,
    )
    assert len(traces) == 1


def test_abstract_outputs_are_the_function_outputs_shapes():
    traces = []
    loss = _counted_loss(traces)
    params, batch = _problem()
    expected = eqx.filter_eval_shape(loss, params, batch)
    got = eqx.filter_eval_shape(abstract_outputs(loss), params, batch)
    assert jax.tree.map(lambda x: (x.shape, x.dtype), got) == jax.tree.map(lambda x: (x.shape, x.dtype), expected)
    closed, _, _ = function_jaxpr(loss, (params, batch), 0)
    assert len(traces) == 2  # eval_shape's own trace, then one shared by the other two
    np.testing.assert_allclose(
        jax.core.eval_jaxpr(closed.jaxpr, closed.consts, *jax.tree.leaves(eqx.filter((params, batch), eqx.is_array)))[0],
        loss(params, batch)[0], rtol=1e-6,
    )


def test_a_function_registering_inside_its_rules_is_traced_through_them_at_once_under_another_mesh():
    calls = []

    @jax.custom_jvp
    def energy(w, x):
        calls.append(None)
        return jnp.mean(jnp.tanh(x @ w) ** 2)

    @energy.defjvp
    def energy_jvp(primals, tangents):
        w, x = primals
        psi, psi_dot = jax.jvp(lambda v: x @ v, (w,), (tangents[0],))
        eqx_kfac.register_normal_predictive_distribution(psi)
        return energy(w, x), jnp.mean(psi_dot)

    args = (jnp.ones((3, 2)), jnp.ones((5, 3)))
    closed, _, _ = function_jaxpr(energy, args, 0)
    # A custom-derivative function is traced through its rule first: the rule's call of `energy`
    # is the only trace of its primal (no plain trace before it, as FermiNet's energy had).
    assert len(calls) == 1
    assert any(e.primitive.name == "loss_tag" for e in closed.jaxpr.eqns)
    calls.clear()
    mesh = Mesh(np.array(jax.devices()[:1]), ("data",))

    def body(w, x):
        return function_jaxpr(energy, (w, x), 0)[0].out_avals[0].shape

    # The walkers sharded over the data axis, as in a multi-device step.
    jax.eval_shape(jax.shard_map(lambda w, x: (body(w, x), w)[1], mesh=mesh,
                                 in_specs=(PartitionSpec(), PartitionSpec("data")), out_specs=PartitionSpec()), *args)
    assert len(calls) == 1  # a new mesh, a new trace: through the rule at once


def test_a_custom_derivative_function_registering_outside_its_rule_is_traced_plainly():
    """A `custom_jvp` function whose primal registers the loss and whose rule does not: the trace
    through the rule finds no loss, so the plain trace is made and used."""

    @jax.custom_jvp
    def loss(w, x):
        out = x @ w
        eqx_kfac.register_normal_predictive_distribution(out)
        return jnp.mean(out**2)

    @loss.defjvp
    def loss_jvp(primals, tangents):
        w, x = primals
        return jnp.mean((x @ w) ** 2), jnp.mean(2 * (x @ w) * (x @ tangents[0]))

    args = (jnp.ones((3, 2)), jnp.ones((5, 3)))
    closed, _, _ = function_jaxpr(loss, args, 0)
    assert [e.primitive.name for e in closed.jaxpr.eqns] == ["custom_jvp_call"]
    inner = closed.jaxpr.eqns[0].params["call_jaxpr"].jaxpr
    assert any(e.primitive.name == "loss_tag" for e in inner.eqns)
    assert eqx.filter_eval_shape(abstract_outputs(loss), *args).shape == ()
