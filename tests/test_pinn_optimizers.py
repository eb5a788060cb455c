"""The PINN optimizers: the grid line search, ENGD, K-FAC with the line search, and `Optimizer`
with the Taylor-mode blocks, on a small Poisson problem."""

import inspect
import pathlib
import re
import textwrap
import warnings

import equinox as eqx
import jax
import jax.flatten_util
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


def _docs_block(containing):
    """The one code block of docs/pinn.md that contains `containing`, dedented."""
    page = (pathlib.Path(__file__).resolve().parent.parent / "docs" / "pinn.md").read_text()
    (block,) = [b for b in re.findall(r"```python\n(.*?)```", page, flags=re.DOTALL) if containing in b]
    return textwrap.dedent(block)


@pytest.mark.integration  # run by `pytest -m integration` (pyproject.toml)
def test_documented_kfac_star_lowers_the_loss(getkey):
    """docs/pinn.md's K-FAC* configuration (Kronecker-sum blocks, unbounded momentum), as written:
    from its initial damping the small problem's first steps are rejected, then it trains."""
    model, batch, loss = _poisson(getkey())
    namespace = dict(eqx=eqx, jax=jax, eqx_kfac=eqx_kfac, model=model, batch=batch, loss=loss, key=jax.random.key(0))
    exec(_docs_block("eqx_kfac.Optimizer("), namespace)
    optimizer, model, state = namespace["optimizer"], namespace["model"], namespace["state"]
    assert optimizer.step_rule.momentum.range(None, 0, 0).upper == np.inf
    value = eqx.filter_jit(loss)  # one program (eagerly, each Taylor-mode operation is one)
    first = float(value(model, batch))
    for i in range(12):
        model, state, stats = optimizer.step(model, state, jax.random.key(i), batch=batch)
    assert float(value(model, batch)) < 0.5 * first


def test_grid_line_search_reports_steps_without_decrease():
    line_search = eqx_kfac.scale_by_grid_linesearch(grid=jnp.array([0.5, 1.0]))
    value_fn = lambda p: jnp.sum(p["x"] ** 2)  # noqa: E731
    params = {"x": jnp.array([1.0])}
    state = line_search.init(params)
    assert bool(state.decreased) and int(state.num_skipped) == 0
    # Uphill: no step of the grid lowers the loss, twice; then downhill.
    for direction, decreased, skipped in (([1.0], False, 1), ([3.0], False, 2), ([-1.0], True, 2)):
        step, state = line_search.update(
            {"x": jnp.array(direction)}, state, params, value=value_fn(params), value_fn=value_fn
        )
        assert bool(state.decreased) is decreased and int(state.num_skipped) == skipped
        assert (float(step["x"][0]) == 0.0) is not decreased


def _reference_damping(damping, step_size, factor, low, high):
    """The Levenberg-Marquardt rule as docs/pinn.md states it, in plain Python."""
    if step_size >= 0.5:
        damping = damping / factor
    elif step_size < 2.0**-10:
        damping = damping * factor
    return min(max(damping, low), high)


def test_adapted_damping_follows_the_rule():
    for damping in (1e-9, 1e-3, 1.0, 9e5):
        for step_size in (0.0, 2.0**-30, 2.0**-11, 2.0**-10, 0.125, 0.25, 0.5, 1.0):
            got = float(eqx_kfac.adapted_damping(jnp.asarray(damping), jnp.asarray(step_size), 10.0, 1e-8, 1e6))
            np.testing.assert_allclose(got, _reference_damping(damping, step_size, 10.0, 1e-8, 1e6), rtol=1e-15)


@eqx.filter_jit
def _gauss_newton_reference(flat, unravel, static, batch):
    """The Gramian `Σ_k J_kᵀ J_k / N_k` and the gradient of the `_poisson` loss at the flat
    parameters, from `jax.hessian` of the network's scalar function and `jax.jacobian` of the
    residuals."""
    x_in, f, x_bd = batch
    net = lambda w, x: eqx.combine(unravel(w), static)(x)  # noqa: E731
    interior = lambda w: jax.vmap(lambda x: -jnp.trace(jax.hessian(net, 1)(w, x)))(x_in) - f  # noqa: E731
    boundary = lambda w: jax.vmap(lambda x: net(w, x))(x_bd)  # noqa: E731
    gramian, gradient = 0.0, 0.0
    for residual in (interior, boundary):
        r, jac = residual(flat), jax.jacobian(residual)(flat)
        gramian = gramian + jac.T @ jac / len(r)
        gradient = gradient + jac.T @ r / len(r)
    return gramian, gradient


def test_engd_damping_adapts_by_the_rule_from_an_unusable_start(getkey):
    """From a damping of 1e-10 the first direction is too long to use; the damping rises, then
    falls as full steps are taken: every step is the grid's best along `-(G + λ_k I)⁻¹ ∇L`
    (an independent Gramian), with `λ_k` from the rule."""
    model, batch, loss = _poisson(getkey())
    # Only tiny and long steps: each step either raises the damping or lowers it.
    grid = 2.0 ** jnp.array([-12.0, -11.0, -1.0, 0.0])
    optimizer = eqx_kfac.engd(loss, (model, batch), damping=1e-10, damping_factor=100.0, grid=grid)
    params, static = eqx.partition(model, eqx.is_inexact_array)
    unravel = jax.flatten_util.ravel_pytree(params)[1]
    flat_loss = jax.jit(lambda w: loss(eqx.combine(unravel(w), static), batch))
    value_fn = lambda p: loss(eqx.combine(p, static), batch)  # noqa: E731

    @jax.jit
    def step(params, state):
        value, grads = jax.value_and_grad(value_fn)(params)
        return optimizer.update(grads, state, params, batch=batch, value=value, value_fn=value_fn)

    state = optimizer.init(params)
    damping, sizes = 1e-10, []
    for _ in range(8):
        flat = jax.flatten_util.ravel_pytree(params)[0]
        gramian, gradient = _gauss_newton_reference(flat, unravel, static, batch)
        direction = -np.linalg.solve(gramian + damping * np.eye(len(flat)), gradient)
        losses = np.array([float(flat_loss(flat + a * direction)) for a in grid])
        decreased = losses.min() < float(flat_loss(flat))
        size = float(grid[np.argmin(losses)]) if decreased else 0.0
        updates, state = step(params, state)
        expected = size * direction
        got = jax.flatten_util.ravel_pytree(updates)[0]
        np.testing.assert_allclose(got, expected, rtol=0, atol=1e-6 * np.abs(expected).max() + 1e-300)
        assert bool(state.line_search.decreased) is bool(decreased)
        params = optax.apply_updates(params, updates)
        damping = _reference_damping(damping, size, 100.0, 1e-10, 1e6)
        np.testing.assert_allclose(float(state.damping), damping, rtol=1e-12)
        sizes.append(size)
    # Both branches of the rule were taken.
    assert min(sizes) < 2.0**-10 and max(sizes) >= 0.5


def test_residual_loss_warns_below_float64(getkey):
    model, batch, loss = _poisson(getkey())
    as32 = lambda t: jax.tree.map(lambda x: x.astype(jnp.float32) if eqx.is_inexact_array(x) else x, t)  # noqa: E731
    with pytest.warns(UserWarning, match=r"terms \[0, 1\] are float32.*jax_enable_x64"):
        eqx.filter_eval_shape(loss, as32(model), as32(batch))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        eqx.filter_eval_shape(loss, model, batch)


def _documented(name):
    """The keyword defaults docs/pinn.md's "Defaults" list states for `name`."""
    page = (pathlib.Path(__file__).resolve().parent.parent / "docs" / "pinn.md").read_text()
    line = re.search(rf"^- `{name}`: `(.*?)`$", page.split("**Defaults**")[1], flags=re.MULTILINE)
    assert line is not None, f"docs/pinn.md's Defaults list has no line for {name}"
    return {k.strip(): float(v) for k, v in (p.split("=") for p in line.group(1).split(","))}


@pytest.mark.parametrize("name", ["engd", "pinn_kfac"])
def test_defaults_are_what_the_docs_recommend(name):
    documented = _documented(name)
    parameters = inspect.signature(getattr(eqx_kfac, name)).parameters
    assert {k: parameters[k].default for k in documented} == documented
    assert {"damping", "damping_factor", "min_damping", "max_damping"} <= set(documented)


@pytest.mark.integration  # run by `pytest -m integration` (pyproject.toml)
def test_lbfgs_recipe_of_the_docs_compiles_once(getkey, xla_compilations):
    """docs/pinn.md's L-BFGS block: the step compiles once from its initial state, twice from
    `optax.lbfgs`'s own (the weak types the docs describe)."""
    model, batch, loss = _poisson(getkey())
    namespace = dict(eqx=eqx, jax=jax, jnp=jnp, model=model, batch=batch, loss=loss)
    exec(_docs_block("optax.lbfgs()"), namespace)
    step, params = namespace["lbfgs_step"], namespace["params"]

    def three_steps(opt_state):
        p = params
        for _ in range(3):
            p, opt_state = step(p, opt_state)
        jax.block_until_ready(p)

    assert xla_compilations(lambda: three_steps(namespace["opt_state"])) == 1
    raw = namespace["lbfgs"].init(params)
    assert xla_compilations(lambda: three_steps(raw)) == 2


@pytest.mark.parametrize("kwargs", [dict(damping_factor=0.5), dict(damping=1e-12), dict(max_damping=0.1)])
def test_damping_settings_out_of_order_are_refused(getkey, kwargs):
    model, batch, loss = _poisson(getkey())
    with pytest.raises(ValueError, match="damping_factor >= 1 and min_damping <= damping <= max_damping"):
        eqx_kfac.engd(loss, (model, batch), **kwargs)
