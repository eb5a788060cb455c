"""The PINN optimizers: the grid line search, ENGD, K-FAC with the line search, and `Optimizer`
with the Taylor-mode blocks, on a small Poisson problem."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import eqx_kfac


def test_grid_line_search_takes_the_best_step_or_none():
    line_search = eqx_kfac.scale_by_grid_linesearch(grid=jnp.array([0.25, 0.5, 1.0]), momentum=0.5)
    params = {"x": jnp.array([2.0])}
    state = line_search.init(params)

    def value_fn(p):
        return jnp.sum((p["x"] - 1.0) ** 2)

    # From x = 2 along -2: 0.5 lands on the minimum.
    step, state = line_search.update({"x": jnp.array([-2.0])}, state, params, value=value_fn(params), value_fn=value_fn)
    np.testing.assert_allclose(step["x"], [-1.0])
    assert float(state.learning_rate) == 0.5
    # The direction adds half the previous step: -1 - 0.5 from x = 1; no step lowers the loss.
    params = {"x": jnp.array([1.0])}
    step, state = line_search.update({"x": jnp.array([-1.0])}, state, params, value=value_fn(params), value_fn=value_fn)
    np.testing.assert_allclose(step["x"], [0.0])
    assert float(state.learning_rate) == 0.0


def _poisson(key):
    """`-Δu = 2π² sin(πx) sin(πy)` on the unit square, `u = 0` on its boundary."""
    k_in, k_bd, k_net = jax.random.split(key, 3)
    x_in = jax.random.uniform(k_in, (30, 2))
    t = jax.random.uniform(k_bd, (12,))
    x_bd = jnp.stack([t, jnp.arange(12) % 2], axis=1)
    f = 2 * jnp.pi**2 * jnp.sin(jnp.pi * x_in[:, 0]) * jnp.sin(jnp.pi * x_in[:, 1])
    model = eqx.nn.MLP(2, "scalar", 6, 1, activation=jnp.tanh, key=k_net)

    def loss(model, batch):
        x_in, f, x_bd = batch
        inner, edge = eqx_kfac.taylor_forward(model, [eqx_kfac.TaylorInput(x_in), eqx_kfac.TaylorInput(x_bd, order=0)])
        return eqx_kfac.register_residual_loss((-inner.laplacian, f), (edge.value, None))

    return model, (x_in, f, x_bd), loss


@pytest.mark.parametrize("name", ["engd", "pinn_kfac"])
def test_line_search_optimizers_lower_the_loss(getkey, name):
    model, batch, loss = _poisson(getkey())
    make = eqx_kfac.engd if name == "engd" else eqx_kfac.pinn_kfac
    optimizer = make(loss, (model, batch), damping=1e-3)
    params, static = eqx.partition(model, eqx.is_inexact_array)
    state = optimizer.init(params)

    @jax.jit
    def step(params, state):
        value_fn = lambda p: loss(eqx.combine(p, static), batch)  # noqa: E731
        value, grads = jax.value_and_grad(value_fn)(params)
        updates, state = optimizer.update(grads, state, params, batch=batch, value=value, value_fn=value_fn)
        return optax.apply_updates(params, updates), state, value

    values = []
    for _ in range(6):
        params, state, value = step(params, state)
        values.append(float(value))
    assert values[-1] < 0.5 * values[0]
    assert all(b <= a for a, b in zip(values, values[1:]))


def test_optimizer_with_the_kronecker_sum_blocks_lowers_the_loss(getkey):
    model, batch, loss = _poisson(getkey())
    optimizer = eqx_kfac.Optimizer(
        eqx.filter_value_and_grad(loss), l2_reg=0.0, use_adaptive_learning_rate=True,
        use_adaptive_momentum=True, use_adaptive_damping=True, initial_damping=1.0,
        num_burnin_steps=0, estimation_mode="ggn_exact", inverse_update_period=1,
        layer_tag_to_block_ctor={"taylor_dense": eqx_kfac.TaylorDenseKroneckerSum},
    )
    state = optimizer.init(model, jax.random.key(0), batch)
    first = float(loss(model, batch))
    for i in range(5):
        model, state, stats = optimizer.step(model, state, jax.random.key(i), batch=batch)
    assert float(loss(model, batch)) < 0.5 * first
