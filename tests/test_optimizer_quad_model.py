"""The quadratic-model and damping math (`eqx_kfac.quadratic_model`, `gram_matrix`,
`solve_quadratic_model`, `levenberg_marquardt_damping`, `norm_constraint_scale`: the formulas the
parts are built from), against numpy written from the formulas and, for bounded coefficients,
against SciPy's bounded minimiser.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, strategies as st

import scipy.optimize

from eqx_kfac import CoefficientRange, QuadraticModel, solve_quadratic_model
from eqx_kfac import gram_matrix, levenberg_marquardt_damping, norm_constraint_scale, quadratic_model


def _random_model(seed, n=2):
    rng = np.random.default_rng(seed)
    v = rng.standard_normal((n, 6))
    c_half = rng.standard_normal((6, 6))
    c = c_half @ c_half.T
    g = rng.standard_normal(6)
    return v, c, g


def _model(v, c, g):
    v, c, g = jnp.asarray(v), jnp.asarray(c), jnp.asarray(g)
    vectors = [{"w": row[:4].reshape(2, 2), "b": row[4:]} for row in v]
    products = [{"w": (c @ row)[:4].reshape(2, 2), "b": (c @ row)[4:]} for row in v]
    grads = {"w": g[:4].reshape(2, 2), "b": g[4:]}
    return quadratic_model(vectors, grads, gram_matrix(vectors, products))


@jax.jit
def _model_and_solutions(v, c, g, damping, l2):
    model = _model(v, c, g)
    free = solve_quadratic_model(model, damping, l2, (None, None))
    damped = solve_quadratic_model(model, damping, l2, (None, None), True)
    return model, free, damped


@given(st.integers(0, 10_000), st.floats(0.0, 2.0), st.floats(0.0, 0.5))
def test_both_free_coefficients_minimise_the_damped_model(seed, damping, l2):
    v, c, g = _random_model(seed)
    model, free, damped = _model_and_solutions(v, c, g, damping, l2)
    (w0, w1), change, change_damped = free.coefficients, free.change, damped.change
    np.testing.assert_allclose(model.a, v @ c @ v.T, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(model.d, v @ v.T, rtol=1e-12)
    np.testing.assert_allclose(model.b, v @ g, rtol=1e-12)
    a = v @ (c + l2 * np.eye(6)) @ v.T
    w = -np.linalg.solve(a + damping * v @ v.T, v @ g)
    np.testing.assert_allclose([w0, w1], w, rtol=1e-8)
    np.testing.assert_allclose(change, 0.5 * w @ a @ w + w @ (v @ g), rtol=1e-8)
    np.testing.assert_allclose(
        change_damped, 0.5 * w @ (a + damping * v @ v.T) @ w + w @ (v @ g), rtol=1e-8
    )


@pytest.mark.parametrize("free", [0, 1])
def test_one_free_coefficient_minimises_along_it(free):
    v, c, g = _random_model(3)
    model = _model(v, c, g)
    damping, l2, known = 0.3, 0.01, 0.7
    fixed = [None, None]
    fixed[1 - free] = known
    solution = solve_quadratic_model(model, damping, l2, fixed)
    coefficients, change = solution.coefficients, solution.change
    a_damped = v @ (c + (l2 + damping) * np.eye(6)) @ v.T
    b = v @ g
    # q(w) with the known coefficient fixed is a parabola in the free one: its vertex.
    expected = -(b[free] + a_damped[free, 1 - free] * known) / a_damped[free, free]
    assert float(coefficients[1 - free]) == known
    np.testing.assert_allclose(coefficients[free], expected, rtol=1e-10)
    w = np.array([float(x) for x in coefficients])
    a = v @ (c + l2 * np.eye(6)) @ v.T
    np.testing.assert_allclose(change, 0.5 * w @ a @ w + w @ b, rtol=1e-10)


def test_zero_previous_update_gives_zero_momentum():
    v, c, g = _random_model(5)
    v[1] = 0.0
    model = _model(v, c, g)
    w0, w1 = solve_quadratic_model(model, 0.1, 0.0, (None, None)).coefficients
    a = v[0] @ c @ v[0] + 0.1 * v[0] @ v[0]
    assert float(w1) == 0.0
    np.testing.assert_allclose(w0, -(v[0] @ g) / a, rtol=1e-10)


def test_infinite_curvature_gives_no_finite_step():
    # An overflowing curvature must not turn into a finite (zero) step: the step is then skipped
    # by the guard, as for any non-finite update.
    zeros = jnp.zeros((2, 2))
    model = QuadraticModel(jnp.array([[jnp.inf, 0.0], [0.0, 0.0]]), zeros, zeros, jnp.array([-1.0, 0.0]))
    coefficients = solve_quadratic_model(model, 0.0, 0.0, (None, None)).coefficients
    assert not np.all(np.isfinite([float(c) for c in coefficients]))


def test_single_vector_model_with_fixed_coefficient():
    model = QuadraticModel(jnp.array([[2.0]]), jnp.array([[3.0]]), jnp.array([[3.0]]),
                           jnp.array([-1.0]))
    solution = solve_quadratic_model(model, 0.5, 0.1, (1.0,))
    (w,), change = solution.coefficients, solution.change
    assert float(w) == 1.0
    np.testing.assert_allclose(change, 0.5 * (2.0 + 0.1 * 3.0) - 1.0, rtol=1e-12)
    (w_free,) = solve_quadratic_model(model, 0.5, 0.1, (None,)).coefficients
    np.testing.assert_allclose(w_free, 1.0 / (2.0 + 0.1 * 3.0 + 0.5 * 3.0), rtol=1e-12)


@given(
    st.integers(0, 10_000),
    st.tuples(st.floats(-2.0, 1.0), st.floats(0.0, 2.0)),
    st.tuples(st.floats(-1.0, 0.0), st.floats(0.0, 1.0)),
)
def test_bounded_coefficients_minimise_over_the_box(seed, box0, box1):
    """The minimiser within bounds equals SciPy's bounded minimiser of the same quadratic (the
    model is convex, so both find the one minimum over the box)."""
    v, c, g = _random_model(seed)
    damping, l2 = 0.05, 0.01
    model = _model(v, c, g)
    boxes = [CoefficientRange(jnp.asarray(lo), jnp.asarray(lo + width)) for lo, width in (box0, box1)]
    solution = solve_quadratic_model(model, damping, l2, boxes)
    a = v @ (c + (l2 + damping) * np.eye(6)) @ v.T
    b = v @ g
    bounds = [(float(box.lower), float(box.upper)) for box in boxes]
    reference = scipy.optimize.minimize(
        lambda w: 0.5 * w @ a @ w + w @ b, np.zeros(2), jac=lambda w: a @ w + b,
        bounds=bounds, method="L-BFGS-B", options=dict(ftol=1e-15, gtol=1e-12),
    )
    w = np.array([float(x) for x in solution.coefficients])
    assert all(lo - 1e-12 <= x <= hi + 1e-12 for x, (lo, hi) in zip(w, bounds))
    value = 0.5 * w @ a @ w + w @ b
    assert value <= reference.fun + 1e-9 * (1 + abs(reference.fun))
    np.testing.assert_allclose(w, reference.x, atol=1e-5)


def test_bounds_that_hold_the_unconstrained_minimiser_change_nothing():
    v, c, g = _random_model(7)
    model = _model(v, c, g)
    free = solve_quadratic_model(model, 0.1, 0.0, (None, None))
    wide = [CoefficientRange(jnp.asarray(-1e6), jnp.asarray(1e6))] * 2
    bounded = solve_quadratic_model(model, 0.1, 0.0, wide)
    assert [float(x) for x in bounded.coefficients] == [float(x) for x in free.coefficients]
    assert float(bounded.change) == float(free.change)


@pytest.mark.parametrize(
    "new_loss, expected_factor",
    [(0.9, 1.0 / 0.59049), (0.5, 1.0), (0.1, 0.59049), (np.nan, 1.0 / 0.59049)],
)
def test_levenberg_marquardt_follows_rho(new_loss, expected_factor):
    # quad change -1 and old loss 1: rho = 1 - new_loss.
    damping, rho = levenberg_marquardt_damping(
        1.0, new_loss, -1.0, 0.2, lower_threshold=0.25, upper_threshold=0.75,
        decay_factor=0.9**5, min_damping=1e-8, max_damping=np.inf,
    )
    np.testing.assert_allclose(damping, 0.2 * expected_factor, rtol=1e-12)
    np.testing.assert_allclose(rho, (new_loss - 1.0) / -1.0, rtol=1e-12)


def test_levenberg_marquardt_clips():
    low, _ = levenberg_marquardt_damping(1.0, 0.0, -1.0, 1e-3, lower_threshold=0.25,
                                         upper_threshold=0.75, decay_factor=0.5,
                                         min_damping=1e-3, max_damping=1.0)
    high, _ = levenberg_marquardt_damping(1.0, 2.0, -1.0, 0.8, lower_threshold=0.25,
                                          upper_threshold=0.75, decay_factor=0.5,
                                          min_damping=1e-3, max_damping=1.0)
    assert float(low) == 1e-3 and float(high) == 1.0


def test_norm_constraint_scale():
    scale, sq = norm_constraint_scale(8.0, 0.5, 0.5)
    np.testing.assert_allclose(sq, 2.0)
    np.testing.assert_allclose(scale, 0.5)
    scale, _ = norm_constraint_scale(8.0, 0.5, 10.0)
    assert float(scale) == 1.0
