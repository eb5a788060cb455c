"""The guard's stop names what the last fault was: a direction that was not finite (a linear solve
that did not converge) is told apart from a loss or gradient that was not."""

import equinox as eqx
import jax
import jax.numpy as jnp
import lineax as lx
import pytest

import eqx_kfac


def _loss(model, batch):
    x, y = batch
    logits = jax.vmap(model)(x)
    eqx_kfac.register_softmax_cross_entropy_loss(logits, y)
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), y[:, None], 1))


# One CG step cannot reach a relative residual of 1e-14: lineax reports a failed solve, which the
# blocks turn into NaN. Both tests run this optimizer (one compiled step).
_OPTIMIZER = eqx_kfac.Optimizer(
    eqx.filter_value_and_grad(_loss),
    curvature=eqx_kfac.CurvatureOptions(inverse_solver=lx.CG(rtol=1e-14, atol=1e-14, max_steps=1)),
    refresh=eqx_kfac.RefreshSchedule(num_burnin_steps=0, inverse_update_period=1),
    step_rule=eqx_kfac.MomentumStep(),
    damping_rule=eqx_kfac.GivenDamping(),
    guard=eqx_kfac.StepGuard(max_consecutive_faults=2),
)


def _run(x):
    model = eqx.nn.MLP(4, 3, 8, 1, key=jax.random.key(0))
    y = jnp.arange(x.shape[0]) % 3
    optimizer = _OPTIMIZER
    state = optimizer.init(model, jax.random.key(1), (x, y))
    for i in range(2):
        model, state, stats = optimizer.step(
            model, state, jax.random.key(i), batch=(x, y), learning_rate=0.1, momentum=0.0, damping=1e-3
        )


def test_a_solve_that_does_not_converge_is_named_in_the_stop():
    x = jax.random.normal(jax.random.key(2), (16, 4))
    with pytest.raises(RuntimeError, match="linear solve that did not converge") as error:
        _run(x)
    assert "finite loss and gradient" in str(error.value)


def test_a_loss_that_is_not_finite_is_not_blamed_on_the_solver():
    x = jnp.full((16, 4), jnp.nan)
    with pytest.raises(RuntimeError, match="loss or gradient that was not finite") as error:
        _run(x)
    assert "did not converge" not in str(error.value)
