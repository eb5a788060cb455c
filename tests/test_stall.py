"""The stall detector on both paths (issue 50): applied steps in a row whose update is below the
parameters' resolution stop the run with the cause. The loss is scaled by a factor in the batch
(one compiled step for every scale): scaled by 1e-12 its registered losses keep their curvature,
so every step shrinks by 1e-12 and, in float32, changes nothing. A tiny MLP, a few steps each."""

import equinox as eqx
import jax
import jax.numpy as jnp
import pytest

import eqx_kfac


MODEL = eqx.nn.MLP(4, 3, 8, 1, key=jax.random.key(0), dtype=jnp.float32)
X = jax.random.normal(jax.random.key(1), (16, 4), jnp.float32)
Y = jnp.argmax(X[:, :3], axis=1)


def batch(scale):
    return X, Y, jnp.asarray(scale, jnp.float32)


def loss(model, batch):
    x, y, scale = batch
    logits = jax.vmap(model)(x)
    eqx_kfac.register_softmax_cross_entropy_loss(logits, y)
    return scale * -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), y[:, None], axis=1))


STALLS = 3
STALL = r"3 steps in a row were applied but left the parameters as they were"
SCALE = r"below the parameters' resolution(.|\n)*the loss's scale(.|\n)*Remove the factor"


def _optimizer_steps(scale, steps):
    opt = eqx_kfac.Optimizer(
        eqx.filter_value_and_grad(loss), refresh=eqx_kfac.RefreshSchedule(num_burnin_steps=0),
        guard=eqx_kfac.StepGuard(reject_loss_increase=True, max_consecutive_stalls=STALLS),
    )
    params, state = MODEL, opt.init(MODEL, jax.random.key(0), batch(1.0))
    for i in range(steps):
        params, state, stats = opt.step(params, state, jax.random.key(i), batch=batch(scale))
    return stats


def test_optimizer_stops_a_run_stalled_by_a_loss_scaled_by_1e_12():
    stats = _optimizer_steps(1.0, STALLS + 1)
    assert not bool(stats["stalled"])
    with pytest.raises(RuntimeError, match=STALL + "(.|\n)*" + SCALE):
        _optimizer_steps(1e-12, STALLS + 1)


def _kfac_optax_steps(optimizer, scale, steps):
    params = eqx.filter(MODEL, eqx.is_inexact_array)
    state = optimizer.init(params)
    grad = eqx.filter_jit(eqx.filter_grad(loss))
    for i in range(steps):
        grads = grad(eqx.combine(params, MODEL), batch(scale))
        updates, state = optimizer.update(grads, state, params, batch=batch(scale),
                                          key=jax.random.key(i))
        params = eqx.apply_updates(params, updates)
    return state


def test_kfac_optax_stops_a_run_stalled_by_a_loss_scaled_by_1e_12():
    optimizer = eqx_kfac.kfac_optax(loss, (MODEL, batch(1.0)), max_consecutive_stalls=STALLS)
    state = _kfac_optax_steps(optimizer, 1.0, STALLS + 1)
    assert int(state.guard_state.consecutive_stalls) == 0
    with pytest.raises(RuntimeError, match=STALL + "(.|\n)*" + SCALE):
        _kfac_optax_steps(optimizer, 1e-12, STALLS + 1)


def test_a_zero_learning_rate_is_named_inside_jit_too():
    optimizer = eqx_kfac.kfac_optax(loss, (MODEL, batch(1.0)), learning_rate=0.0,
                                    max_consecutive_stalls=1, stop_in_program=True)
    params = eqx.filter(MODEL, eqx.is_inexact_array)

    @eqx.filter_jit
    def step(params, state):
        grads = eqx.filter_grad(loss)(eqx.combine(params, MODEL), batch(1.0))
        return optimizer.update(grads, state, params, batch=batch(1.0), key=jax.random.key(0))

    with pytest.raises(Exception, match="the update is exactly zero though the gradient is not"):
        jax.block_until_ready(step(params, optimizer.init(params)))
